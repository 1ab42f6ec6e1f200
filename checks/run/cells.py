"""Where the selected cells come from (host side): the matrix's cells as `provision build` planned them, each
with its image state (Docker) or its venv (venv cells), the one environment of an interpreter (local), or
existing images stackprobe did not build (``--image``). Each returns the cells and, for those that can run, the
executor that runs them here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Any

from checks.run import venvcell
from checks.run.container import DockerExecutor, client
from checks.run.executor import Executor, ExecutorError, LocalExecutor, parse_result_text
from checks.run.options import RunOptions, UsageError
from checks.run.plan import CellState, CellTarget, ImageState, image_state, local_cell_id, matches_cuda, select_cells
from common import cellid
from common.api import plan_cells
from common.errors import InputError
from inenv import kit
from inenv.probe import RESULT_MARKER

Cells = tuple[list[CellTarget], dict[str, Executor]]


def local(opts: RunOptions, python: str) -> tuple[CellTarget, LocalExecutor, dict[str, Any]]:
    """The environment of ``python`` as one cell, its executor, and what it reported about itself."""
    ex = LocalExecutor(python)
    inspect = ex.inspect()
    versions = {k: str(v) for k, v in (inspect.get("versions") or {}).items() if isinstance(v, str | int | float)}
    cell = CellTarget(local_cell_id(versions), CellState.LOCAL, versions=versions, image_status=ImageState.LOCAL)
    cells = [cell]
    if opts.cuda and not matches_cuda(versions.get("torch_cuda", ""), opts.cuda):
        cells = []
    if not select_cells(cells, list(opts.only)):
        raise UsageError(f"checks run: the local environment ({cell.cell_id}) does not match --cuda/--only")
    return cell, ex, inspect


ENV_MODULES_TIMEOUT_S = 120.0


def env_modules(ex: LocalExecutor, capability: str,
                modules: tuple[str, ...] = kit.COMM_MODULES) -> dict[str, tuple[str, ...]]:
    """The flashinfer comm modules a user's environment already has for a GPU of ``capability`` as flashinfer
    would load them (its JIT cache, current by flashinfer's own build file, or an installed flashinfer-jit-cache:
    the kit's ``fi-existing`` entry with ``--have``), each with the SASS target of its arch folder; {} when it has none,
    no flashinfer, or gives no answer in time. Read once before the plan: fi-jit loads these instead of
    compiling them, so the plan, its cost and the quick pass count them as carried."""
    cmd = [ex.python, *kit.launch("fi-existing", "--have", *modules, "--capability", capability)]
    try:
        proc = subprocess.run(cmd, env=ex.env(), capture_output=True, text=True, timeout=ENV_MODULES_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    line = next((x for x in proc.stdout.splitlines() if x.startswith(kit.FI_BUILD_RESULT_PREFIX)), "")
    try:
        got = json.loads(line[len(kit.FI_BUILD_RESULT_PREFIX):]) if line else {}
    except ValueError:
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for module, found in got.items() if isinstance(got, dict) else ():
        arch = found.get("arch_dir") if isinstance(found, dict) else None
        if module in modules and isinstance(arch, str) and re.fullmatch(r"\d{2,3}[af]?", arch):
            out[module] = (f"sm_{arch}",)
    return out


def planned(opts: RunOptions) -> list[Any]:
    """The selected cells of the matrix (common.api.PlannedCell), as `provision build` planned them."""
    try:
        found = plan_cells(opts.matrix, cuda=opts.cuda, only=list(opts.only) or None)
    except InputError as exc:
        raise UsageError(exc.one_line()) from None
    if not found:
        raise UsageError(f"checks run: the selection matches no cell of {opts.matrix}")
    return found


def venv(opts: RunOptions) -> Cells:
    """Each selected cell's venv (envs/<cell>/build-venv.json), run by the local executor with its interpreter."""
    cells: list[CellTarget] = []
    executors: dict[str, Executor] = {}
    for pc in planned(opts):
        if pc.status != CellState.RESOLVED:
            cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions)))
            continue
        vc = venvcell.read(opts.envs, pc.cell_id)
        versions = {**pc.versions, **({"from_base": vc.from_base} if vc.from_base else {})}
        cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, versions, vc.python, vc.state, vc.reason))
        if vc.state is ImageState.BUILT and vc.python:
            executors[pc.cell_id] = LocalExecutor(vc.python, venvcell.BACKEND, vc.env, hermetic=vc.hermetic)
    return cells, executors


def docker(opts: RunOptions, gpus: int) -> Cells:
    """Each selected cell's image (envs/<cell>/build.json), one container per variant."""
    cells: list[CellTarget] = []
    for pc in planned(opts):
        if pc.status != CellState.RESOLVED:
            cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions)))
            continue
        state, tag, why = image_state(opts.envs, pc.cell_id)
        cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions), tag, state, why))
    runnable = [c for c in cells if c.image_status is ImageState.BUILT and c.image]
    executors: dict[str, Executor] = {}
    if runnable:
        daemon = client()  # no Docker: one line, exit 2
        for c in runnable:
            executors[c.cell_id] = DockerExecutor(image=str(c.image), gpus_on_host=gpus, _client=daemon)
    return cells, executors


# Run inside an existing image with its own python3 and the in-environment package mounted read-only: the
# versions the probes' environment reports (inenv.envinfo) and what the self-check finds by importing torch and
# reading the installed distributions (inenv.selfcheck: torch, CUDA, sgl-kernel, flashinfer, serving engines).
FACTS_CODE = ("import json; from inenv import envinfo, selfcheck; "
              f"print({RESULT_MARKER!r} + json.dumps({{'versions': envinfo.versions(), "
              "'selfcheck': selfcheck.collect()}))")
FACTS_TIMEOUT_S = 300.0
_FACTS: dict[str, dict[str, Any]] = {}  # by image id: read once per process (the quick and full passes ask both)
NEEDS = "stackprobe runs its probes with the image's own python3 and torch"


def image_facts(ex: DockerExecutor) -> dict[str, Any]:
    """What is inside ``ex.image``, read in one throwaway container (removed after; nothing is written into
    the image); UsageError with one line when the image cannot be probed."""
    image = ex.image
    try:
        p = ex._run(["python3", "-c", FACTS_CODE], FACTS_TIMEOUT_S)
    except ExecutorError as exc:
        why = " ".join(str(exc).split())  # the daemon's error on one line
        if "python3" in why and ("executable file not found" in why or "no such file or directory" in why.lower()):
            raise UsageError(f"checks run: --image {image}: the image has no python3 on its PATH; {NEEDS}") from None
        raise UsageError(f"checks run: --image {image}: {why[:300]}") from None
    data, err = parse_result_text(p.stdout_tail)
    if data is None:
        last = (p.stderr_tail.strip().splitlines() or [err or f"exit status {p.returncode}"])[-1]
        if p.returncode == 127 or ("python3" in last and "not found" in last):
            raise UsageError(f"checks run: --image {image}: the image has no python3 on its PATH; {NEEDS}")
        raise UsageError(f"checks run: --image {image}: reading what is inside failed: {last[:300]}")
    return data


def image_versions(image: str, image_id: str, facts: dict[str, Any], digest: str = "") -> dict[str, str]:
    """The cell's versions from an image's facts (FACTS_CODE's output): the environment's own report, torch as it
    imported, the serving engines, and the image named with its id where known (and its registry digest when it
    was pulled). UsageError when torch is not there or does not import."""
    found = facts.get("versions") if isinstance(facts.get("versions"), dict) else {}
    check = facts.get("selfcheck") if isinstance(facts.get("selfcheck"), dict) else {}
    torch = check.get("torch") if isinstance(check.get("torch"), dict) else {}
    if "torch" not in found:
        raise UsageError(f"checks run: --image {image}: torch is not installed in the image; {NEEDS}")
    if torch.get("error") or not torch.get("version"):
        why = str(torch.get("error") or "no version")[:200]
        raise UsageError(f"checks run: --image {image}: torch does not import in the image ({json.dumps(why)}); "
                         f"{NEEDS}")
    versions = {k: str(v) for k, v in found.items() if isinstance(v, str | int | float)}
    engines = check.get("engines") if isinstance(check.get("engines"), dict) else {}
    versions.update({str(k): str(v) for k, v in engines.items() if isinstance(v, str)})
    versions.update(image=image, **({"image_id": image_id} if image_id else {}),
                    **({"image_digest": digest} if digest else {}))
    return versions


def images(opts: RunOptions, gpus: int) -> Cells:
    """Each ``--image`` as a cell named by what is inside it, run like a built cell's image (one container per
    variant, the in-environment code mounted read-only, removed after)."""
    # lazy: the Docker SDK (170 ms) loads only when a run uses Docker
    import docker.errors

    daemon = client()  # no Docker: one line, exit 2
    cells: list[CellTarget] = []
    executors: dict[str, Executor] = {}
    for image in opts.images:
        try:
            found = daemon.images.get(image)
        except docker.errors.ImageNotFound:
            raise UsageError(f"checks run: --image {image}: no such image in the Docker daemon; `docker images` "
                             "lists those there (pull or load it first)") from None
        except docker.errors.APIError as exc:
            raise UsageError(f"checks run: --image {image}: {str(exc.explanation or exc)[:200]}") from None
        image_id = str(found.id)
        digests = found.attrs.get("RepoDigests") or []
        # image_id "" leaves out the bytecode folder: reading the facts writes nothing on the host either
        started = time.monotonic()
        if image_id not in _FACTS:
            _FACTS[image_id] = image_facts(DockerExecutor(image=image, image_id="", _client=daemon))
        facts = _FACTS[image_id]
        versions = image_versions(image, image_id, facts, str(digests[0]) if digests else "")
        cid = str(cellid.existing_image(versions))
        if cellid.parse(cid) is None:
            raise UsageError(f"checks run: --image {image}: the versions inside make no valid cell id "
                             f"({json.dumps(cid[:160])})")
        print(f"checks run: --image {image} is cell {cid} (read inside it in {time.monotonic() - started:.1f} s)",
              file=sys.stderr, flush=True)
        cell = CellTarget(cid, CellState.LOCAL, versions=versions, image=image, image_status=ImageState.BUILT)
        if cid in executors:
            raise UsageError(f"checks run: --image {image}: holds the same stack as another --image ({cid}); "
                             "give one of them")
        cells.append(cell)
        executors[cid] = DockerExecutor(image=image, gpus_on_host=gpus, image_id=image_id, _client=daemon)
    chosen = select_cells([c for c in cells if not opts.cuda or matches_cuda(c.versions.get("torch_cuda", ""),
                                                                               opts.cuda)], list(opts.only))
    if not chosen:
        raise UsageError(f"checks run: no --image ({', '.join(c.cell_id for c in cells)}) matches --cuda/--only")
    return chosen, {c.cell_id: executors[c.cell_id] for c in chosen}
