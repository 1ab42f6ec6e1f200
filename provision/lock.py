"""`provision lock`: uv-compiled, hash-pinned environments per cell, written atomically to envs/<cell>/.

Each cell folder holds requirements.in, requirements.lock (every package, hashes), torch.lock (torch and
everything it needs, installed as its own image layer), kernel.lock (a cell with an sgl-kernel: that one
package, its own layer above torch), toolkit.lock (the registry CUDA toolkit wheels for the registry-free base)
and cell.json.

torch.lock is a function of the torch build alone (torch requirement, its CUDA variant, its index, the Python
floor): resolved once per build and reused byte for byte by every cell on that build, whose full lock is then
resolved within its pins. So the cells of one torch build share one image layer, whatever else they install
and whenever they were locked (a lock resolved per cell picks whatever cuda-bindings its other packages allow,
and a cell locked after a cuda-bindings release differs from its siblings).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

try:  # the `uv` package in our own dependencies: its binary when none is on PATH
    from uv import find_uv_bin
except ImportError:  # an interpreter without it (a GPU host's own Python running the tool): uv from PATH only
    find_uv_bin = None

from common import canonical
from common.build import backend
from common.catalog import load as load_catalog
from common.errors import InputError
from common.home import WORK_ROOT
from common.resolve import RESOLVED, UNAVAILABLE, UNREACHABLE, Resolved
from inenv import atomic

ENVS = WORK_ROOT / "envs"  # the checkout's, or envs/ of the current folder for an installed wheel
# One lock serves both bases: Debian 12's Python 3.11 and Ubuntu 24.04's 3.12 (markers pick per version).
PYTHON_FLOOR = "3.11"
# cublas and curand: headers flashinfer's moe_a2a includes (cublasLt.h; from 0.7.4 the moe_ep all-to-all
# reaches curand_kernel.h through TensorRT-LLM's reduceKernelUtils.cuh). A full toolkit has both.
TOOLKIT_EXTRAS = "nvcc,cudart,cccl,crt,nvvm,culibos,cublas,curand"
_HEAD = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(?:==|@)")


class LockError(RuntimeError):
    pass


class TorchLockConflict(InputError):
    """A cell's packages need other versions of what its torch build's shared torch.lock pins: bad input (the
    matrix pairs them), never a silent second torch layer. ``free``: the cell's lock resolved without those pins,
    when working out the conflict resolved it."""

    def __init__(self, message: str, free: str | None = None) -> None:
        super().__init__(message)
        self.free = free


def uv_bin() -> str:
    found = shutil.which("uv")
    if found or find_uv_bin is None:
        return found or "uv"
    try:
        return find_uv_bin()
    except Exception:
        return "uv"


def uv_version() -> str:
    out = subprocess.run([uv_bin(), "--version"], capture_output=True, text=True).stdout.split()
    return out[1] if len(out) > 1 else "unknown"


def toolkit_requirement(toolkit: str) -> str:
    return f"cuda-toolkit[{TOOLKIT_EXTRAS}]=={toolkit}"


def guards(r: Resolved) -> tuple[str, ...]:
    """Constraints every lock of a cell carries; each binds only when its package is in the lock.

    cuda-python 12.6.x and older ship cuda/bindings/ themselves. In a CUDA 13 cell torch takes
    cuda-bindings 13.x; when no cuda-python 13 release matches the cuda-bindings the resolver chose first,
    it falls back to such an old cuda-python (a plain install of torch 2.11.0 with flashinfer-python 0.6.18
    takes cuda-python 12.6.2.post1 beside cuda-bindings 13.5.0), whose files overwrite cuda-bindings' and
    `import flashinfer` fails (cuda.bindings.runtime has no cudaLibrary_t). With the constraint the
    resolver pairs cuda-python with a cuda-bindings of its major instead.
    """
    major = int(r.cell.cuda.split(".")[0])
    return (f"cuda-python>={major}",) if major >= 13 else ()


def guard_violations(lock: str, constraints: Sequence[str]) -> list[str]:
    """The pins of a lock that break a guard, e.g. ["cuda-python==12.6.2.post1 (needs cuda-python>=13)"]."""
    out = []
    for text in constraints:
        req = Requirement(text)
        version = pinned(lock, req.name)
        try:
            ok = version is None or Version(version) in req.specifier
        except InvalidVersion:
            ok = False
        if not ok:
            out.append(f"{req.name}=={version} (needs {text})")
    return out


def torch_source(r: Resolved) -> tuple[str, str]:
    """(requirement line, index or "registry") of the cell's torch."""
    src = next(s for s in r.sources if s.package == "torch")
    return src.requirement, src.where


def torch_requirements(r: Resolved) -> str:
    """What the torch lock resolves: torch, and cuda-python under the CUDA-major guard as a requirement, so
    the cuda-bindings torch brings is one a cuda-python release pairs with (the kernels of a CUDA 13 cell
    import cuda-python; alone, torch takes the newest cuda-bindings, which no cuda-python may match yet).
    Only torch's own closure is kept (closure_subset). A cell that puts another NCCL wheel beside torch shares
    its torch build's lock all the same (one image layer): its own lock swaps the NCCL wheel
    (:func:`overridden`), which the cell's last layer installs over torch's."""
    return "".join(f"{line}\n" for line in (torch_source(r)[0], *guards(r)))


def nccl_lines(r: Resolved) -> tuple[str, ...]:
    """The requirement on the NCCL wheel a cell puts beside torch in place of torch's pin; () for torch's own."""
    return tuple(s.requirement for s in r.sources if s.package.startswith("nvidia-nccl-"))


def overridden(r: Resolved) -> frozenset[str]:
    """The packages (normalised names) whose torch.lock pin the cell replaces with its own: its NCCL wheel."""
    return frozenset(_norm(Requirement(line).name) for line in nccl_lines(r))


def torch_compile_args(r: Resolved) -> list[str]:
    where = torch_source(r)[1]
    args = ["--universal", "--python-version", PYTHON_FLOOR, "--generate-hashes", "--no-header"]
    if where != "registry":
        args += ["--index", where]
    if r.prerelease:
        args += ["--prerelease", "allow"]
    return args


def torch_key(r: Resolved) -> str:
    """Names one torch build: every cell with this key shares one torch.lock."""
    parts = [torch_requirements(r), torch_compile_args(r), r.versions["torch_cuda"]]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def constraint_lines(lock: str, leave_out: frozenset[str] = frozenset()) -> list[str]:
    """A lock's pins as constraints, e.g. "cuda-bindings==13.4.4 ; sys_platform == 'linux'" (no hashes), but
    those of the packages (normalised names) in ``leave_out``."""
    return [text.splitlines()[0].rstrip(" \\") for name, text, _via in parse_blocks(lock) if name not in leave_out]


def _versions(lock: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, text, _ in parse_blocks(lock):
        m = re.search(r"==\s*([^\s;\\]+)", text.splitlines()[0])
        out.setdefault(name, set()).add(m.group(1) if m else text.splitlines()[0].strip())
    return out


def torch_lock_differences(torch_lock: str, lock: str, replaced: frozenset[str] = frozenset()) -> list[str]:
    """The packages of ``torch_lock`` that ``lock`` pins otherwise, e.g. ["cuda-bindings 13.5.0 (torch.lock:
    13.4.4)"]; empty when the cell's lock agrees with every pin of its torch build but those the cell
    replaces on purpose (``replaced``: :func:`overridden`)."""
    want, got = _versions(torch_lock), _versions(lock)
    return [f"{name} {', '.join(sorted(got.get(name, {'absent'})))} (torch.lock: {', '.join(sorted(v))})"
            for name, v in want.items() if got.get(name) != v and name not in replaced]


KERNEL_PACKAGES = ("sglang-kernel", "sgl-kernel")


def kernel_lock(lock: str) -> str:
    """The sgl-kernel entry of a cell's lock, hashes included, installed without its dependencies as a layer
    of its own: the cells of one torch build and one sgl-kernel (1.2 GB of it) share that layer whatever their
    flashinfer. Empty when the cell has no sgl-kernel."""
    return "".join(text for name, text, _ in parse_blocks(lock) if name in KERNEL_PACKAGES)


def compile_args(r: Resolved) -> list[str]:
    args = ["--universal", "--python-version", PYTHON_FLOOR, "--generate-hashes", "--no-header"]
    for url in r.indexes:
        args += ["--index", url]
    if r.prerelease:
        args += ["--prerelease", "allow"]
    return args


def requirements_in(r: Resolved) -> str:
    head = f"# {r.cell_id}: written by `provision lock` from the matrix and common/catalog.yaml\n"
    return head + "".join(f"{s.requirement}\n" for s in r.sources)


def classify_uv_error(stderr: str) -> str:
    """unreachable (network) or unavailable (the index answered: nothing fits)."""
    net = ("dns error", "Failed to fetch", "error sending request", "Connect", "timed out", "certificate")
    return UNREACHABLE if any(n in stderr for n in net) else UNAVAILABLE


def _last_lines(text: str) -> str:
    """uv's first error line and its deepest cause: what failed, and why."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.startswith("warning:")]
    if not lines:
        return "no output"
    parts = [p for p in re.split(r"\s*(?:cause:|Caused by:)\s*", " ".join(lines)) if p]  # uv wraps long causes
    return parts[0] if len(parts) == 1 else f"{parts[0]} ({parts[-1]})"


def uv_compile(req_text: str, args: Sequence[str], overrides: Sequence[str] = (),
               constraints: Sequence[str] = ()) -> str:
    """The lock text, or LockError(status, message)."""
    with tempfile.TemporaryDirectory(prefix="stackprobe-lock-") as d:
        src, out = Path(d) / "requirements.in", Path(d) / "out.lock"
        src.write_text(req_text)
        if overrides:
            (Path(d) / "overrides.txt").write_text("".join(f"{o}\n" for o in overrides))
            args = [*args, "--overrides", "overrides.txt"]
        if constraints:
            (Path(d) / "constraints.txt").write_text("".join(f"{c}\n" for c in constraints))
            args = [*args, "--constraints", "constraints.txt"]
        env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1", NO_COLOR="1", COLUMNS="1000")
        # relative names, so the lock (and so the image hash) does not carry a temporary path
        proc = subprocess.run([uv_bin(), "pip", "compile", src.name, "-o", out.name, "--quiet", *args],
                              capture_output=True, text=True, env=env, cwd=d)
        if proc.returncode != 0:
            raise LockError(classify_uv_error(proc.stderr), _last_lines(proc.stderr))
        return out.read_text()


def parse_blocks(lock: str) -> list[tuple[str, str, set[str]]]:
    """(name, block text, names it is needed by) for each entry of a uv requirements lock."""
    blocks: list[tuple[str, str, set[str]]] = []
    cur: list[str] = []
    for line in lock.splitlines(keepends=True):
        if line.strip() and not line.startswith((" ", "#", "\t")):
            if cur:
                blocks.append(_block(cur))
            cur = [line]
        elif cur:
            cur.append(line)
    if cur:
        blocks.append(_block(cur))
    return blocks


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _block(lines: list[str]) -> tuple[str, str, set[str]]:
    m = _HEAD.match(lines[0])
    name = _norm(m.group(1)) if m else lines[0].split()[0]
    via: set[str] = set()
    in_via = False
    for ln in lines[1:]:
        s = ln.strip()
        if s.startswith("# via"):
            rest = s[len("# via"):].strip()
            in_via = True
            if rest:
                via.add(_norm(rest.split()[0]))
        elif in_via and s.startswith("#   "):
            via.add(_norm(s[4:].split()[0]))
        elif in_via and s.startswith("#") and len(s) > 1:
            via.add(_norm(s[1:].split()[0]))
    text = "".join(ln for ln in lines if not ln.strip().startswith("#"))
    return name, text, via


def closure_subset(lock: str, root: str) -> str:
    """The entries of `lock` that `root` needs, transitively, read from uv's `# via` annotations."""
    blocks = parse_blocks(lock)
    keep = {_norm(root)}
    changed = True
    while changed:
        changed = False
        for name, _text, via in blocks:
            if name not in keep and via & keep:
                keep.add(name)
                changed = True
    return "".join(text for name, text, _ in blocks if name in keep)


def pinned(lock: str, package: str) -> str | None:
    """Exact version of a package in a lock (first entry), or None."""
    for name, text, _ in parse_blocks(lock):
        if name == _norm(package):
            m = re.search(r"==\s*([^\s;\\]+)", text.splitlines()[0])
            if m:
                return m.group(1)
            m = re.search(r"-(\d[^-]*)-cp", text.splitlines()[0])  # a direct wheel URL
            return m.group(1) if m else None
    return None


def inputs_hash(r: Resolved, uv: str) -> str:
    wheel_nvcc = load_catalog().cuda[r.cell.cuda].wheel_nvcc
    # requirements.in names the catalog's path: hashed layout-free (common.canonical), so a catalog that
    # moves to another folder leaves every lock current
    parts: list[Any] = [canonical.layout_free(requirements_in(r)), compile_args(r), toolkit_requirement(r.toolkit), uv,
                        wheel_nvcc]
    if r.overrides or r.expect:  # only cells that have them, so every other cell keeps its lock
        parts += [list(r.overrides), list(r.expect)]
    payload = json.dumps(parts)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


_toolkit_cache: dict[str, str] = {}


def toolkit_lock(toolkit: str) -> str:
    if toolkit not in _toolkit_cache:
        args = ["--universal", "--python-version", PYTHON_FLOOR, "--generate-hashes", "--no-header"]
        _toolkit_cache[toolkit] = uv_compile(toolkit_requirement(toolkit) + "\n", args)
    return _toolkit_cache[toolkit]


def write_dir_atomically(target: Path, files: dict[str, str]) -> None:
    """Replace folder `target` with exactly `files`, never half-written. The cell's build record survives a
    relock: it names the image built from these locks, and the build hash decides whether it is still current."""
    atomic.replace_dir(target, files, keep=tuple(backend.RECORD_NAMES.values()))


def cell_json(r: Resolved, lock: str, uv: str, ihash: str, layer: str = "") -> dict[str, Any]:
    exact = {
        "torch": pinned(lock, "torch") or r.versions.get("torch", ""),
        "sgl_kernel": pinned(lock, "sglang-kernel") or pinned(lock, "sgl-kernel") or "none",
        "flashinfer": pinned(lock, "flashinfer-python") or "none",
        "nccl": pinned(lock, "nvidia-nccl-cu13") or pinned(lock, "nvidia-nccl-cu12") or "",
    }
    out: dict[str, Any] = {
        "cell_id": r.cell_id,
        "cell": {"cuda": r.cell.cuda, "torch": r.cell.torch, "sgl_kernel": r.cell.sgl_kernel,
                 "flashinfer": r.cell.flashinfer, "jit_cache": r.cell.jit_cache, "preset": r.cell.preset},
        "expected": {"cuda": r.cell.cuda, "torch_cuda": r.versions["torch_cuda"], **exact},
        "sources": {s.package: s.where for s in r.sources},
        "indexes": list(r.indexes),
        "prerelease": r.prerelease,
        "toolkit": toolkit_requirement(r.toolkit),
        "wheel_nvcc": load_catalog().cuda[r.cell.cuda].wheel_nvcc,
        "python": f">={PYTHON_FLOOR}",
        "uv": uv,
        "inputs_hash": ihash,
        "torch_lock": layer or torch_key(r),  # the torch build whose torch.lock this cell shares
    }
    preset = load_catalog().presets.get(r.cell.preset or "")
    if r.cell.engine and preset is not None:  # the serving engine the cell carries, checked in the built cell
        out["cell"]["engine"] = True
        out["expected"]["engine"] = f"{preset.engine}=={pinned(lock, preset.engine) or preset.version}"
    if r.expect:  # informational: what a probe is expected to find; the probe's result is the verdict
        out["expect"] = list(r.expect)
    if r.overrides:
        out["overrides"] = list(r.overrides)
    return out


def known_torch_lock(envs: Path, key: str, memo: dict[str, str]) -> str | None:
    """The torch.lock of this torch build already made: in this run (``memo``), else in a cell folder whose
    cell.json records the key (the first in name order, so every relock agrees on one)."""
    if key in memo:
        return memo[key]
    for meta_path in sorted(envs.glob("*/cell.json")):
        try:
            recorded = json.loads(meta_path.read_text()).get("torch_lock")
            text = (meta_path.parent / "torch.lock").read_text() if recorded == key else None
        except (OSError, ValueError):
            continue
        if text:
            return text
    return None


def torch_lock_for(r: Resolved, envs: Path, memo: dict[str, str], refresh: bool = False) -> str:
    """The one torch.lock of the cell's torch build: reused when made before (unless ``refresh``, which
    resolves it once more for this run), else resolved from torch alone."""
    key = torch_key(r)
    known = memo.get(key) if refresh else known_torch_lock(envs, key, memo)
    if known is None:
        known = closure_subset(uv_compile(torch_requirements(r), torch_compile_args(r)), "torch")
    memo[key] = known
    return known


def conflict_message(r: Resolved, differences: Sequence[str], uv_says: str = "") -> str:
    torch_req, where = torch_source(r)
    build = f"{torch_req} {r.versions['torch_cuda']}" + ("" if where == "registry" else f" from {where}")
    need = f"it needs {'; '.join(differences)}" if differences else f"uv: {uv_says}"
    return (f"{r.cell_id}: its packages do not fit the torch.lock of its torch build ({build}), which every "
            f"cell on that build shares as one image layer: {need}; change this cell's versions in the matrix")


def engine_locks(r: Resolved, shared: str) -> tuple[str, str, str]:
    """An engine cell's full lock, its torch.lock and the key that torch.lock is recorded under. Within its torch
    build's shared torch.lock when the engine's pins allow it (one image layer for the whole build); else the
    engine release's own resolution decides what sits beside torch, since its pins may contradict what torch
    alone takes (vLLM 0.33.0 caps setuptools below the release torch 2.14.0 brings on its own), and torch's
    closure in that resolution is the cell's own torch layer, under a key no other cell of the build takes."""
    try:
        return cell_lock(r, shared), shared, torch_key(r)
    except TorchLockConflict as conflict:
        lock = conflict.free or uv_compile(requirements_in(r), compile_args(r), r.overrides, guards(r))
        return lock, closure_subset(lock, "torch"), own_layer_key(r)


def own_layer_key(r: Resolved) -> str:
    """Names an engine cell's own torch layer; requirements.in hashed layout-free, as in inputs_hash."""
    return hashlib.sha256(json.dumps([torch_key(r), canonical.layout_free(requirements_in(r))]).encode()
                          ).hexdigest()[:16]


def cell_lock(r: Resolved, torch_lock: str) -> str:
    """The cell's full lock, resolved within the pins of its torch build's torch.lock but the ones the cell
    replaces (:func:`overridden`: its NCCL wheel, which its overrides decide)."""
    replaced = overridden(r)
    constraints = [*guards(r), *constraint_lines(torch_lock, replaced)]
    try:
        lock = uv_compile(requirements_in(r), compile_args(r), r.overrides, constraints)
    except LockError as e:
        if e.args[0] != UNAVAILABLE:
            raise
        try:  # does the cell resolve at all? Then the torch build's pins are what it cannot have.
            free = uv_compile(requirements_in(r), compile_args(r), r.overrides, guards(r))
        except LockError:
            raise e from None
        raise TorchLockConflict(conflict_message(r, torch_lock_differences(torch_lock, free, replaced),
                                                 e.args[1]), free) from None
    differences = torch_lock_differences(torch_lock, lock, replaced)
    if differences:
        raise TorchLockConflict(conflict_message(r, differences))
    return lock


def lock_cell(r: Resolved, envs: Path, uv: str, refresh: bool = False,
              torch_locks: dict[str, str] | None = None) -> dict[str, Any]:
    """Lock one resolved cell; reuses the existing lock when its inputs did not change and its torch.lock is
    its torch build's. ``torch_locks`` carries the torch locks made in this run (key -> text)."""
    memo = {} if torch_locks is None else torch_locks
    folder = envs / r.cell_id
    ihash = inputs_hash(r, uv)
    meta_path = folder / "cell.json"
    if not refresh and meta_path.exists() and (folder / "requirements.lock").exists():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            meta = {}
        # The guards are not in the inputs hash: they only narrow the resolution, so a lock that already
        # satisfies them is the one uv gives with them, and the committed locks stay as they are. The same
        # holds for the torch build's lock: a cell whose torch.lock is not it (locked apart) is locked again.
        known = known_torch_lock(envs, torch_key(r), memo)
        own = r.cell.engine and meta.get("torch_lock") == own_layer_key(r)  # an engine's own torch layer
        same_torch = own or known is None or (folder / "torch.lock").exists() and (
            folder / "torch.lock").read_text() == known
        if meta.get("inputs_hash") == ihash and same_torch and not guard_violations(
                (folder / "requirements.lock").read_text(), guards(r)):
            kernel = kernel_lock((folder / "requirements.lock").read_text())
            if kernel and not (folder / "kernel.lock").exists():  # derived from the lock: made, not resolved
                atomic.write_text(folder / "kernel.lock", kernel)
            return {"cell_id": r.cell_id, "status": "unchanged", "path": str(folder)}
    torch_lock, key = torch_lock_for(r, envs, memo, refresh), torch_key(r)
    if r.cell.engine:
        lock, torch_lock, key = engine_locks(r, torch_lock)
    else:
        lock = cell_lock(r, torch_lock)
    files = {
        "requirements.in": requirements_in(r),
        "requirements.lock": lock,
        "torch.lock": torch_lock,
        **({"kernel.lock": kernel} if (kernel := kernel_lock(lock)) else {}),
        "toolkit.lock": toolkit_lock(r.toolkit),
        "cell.json": json.dumps(cell_json(r, lock, uv, ihash, key), indent=1, sort_keys=True) + "\n",
    }
    write_dir_atomically(folder, files)
    return {"cell_id": r.cell_id, "status": "locked", "path": str(folder)}


def lock_cells(cells: Sequence[Resolved], envs: Path = ENVS, echo: bool = True,
               refresh: bool = False) -> list[dict[str, Any]]:
    uv = uv_version()
    out = []
    torch_locks: dict[str, str] = {}  # one torch.lock per torch build in this run
    for r in cells:
        if r.status != RESOLVED:
            res = {"cell_id": r.cell_id, "status": r.status, "reason": r.reason}
        else:
            try:
                res = lock_cell(r, envs, uv, refresh, torch_locks)
            except LockError as e:
                status, msg = e.args  # uv judged: unreachable index, or nothing published that fits
                res = {"cell_id": r.cell_id, "status": status, "reason": f"uv: {msg}"}
        out.append(res)
        if echo:
            print(f"{res['cell_id']}: {res['status']}" + (f" ({res['reason']})" if res.get("reason") else ""),
                  file=sys.stdout, flush=True)
    return out


def live_check(cells: Sequence[Resolved]) -> list[Resolved]:
    """Resolve each resolved cell with uv: the final judge of what is published where."""
    out = []
    for r in cells:
        if r.status != RESOLVED:
            out.append(r)
            continue
        try:
            uv_compile(requirements_in(r), compile_args(r), r.overrides, guards(r))
            out.append(r)
        except LockError as e:
            status, msg = e.args
            out.append(replace(r, status=status, reason=f"uv could not resolve it: {msg}"))
    return out
