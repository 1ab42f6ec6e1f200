"""Where a variant runs: the Executor protocol and the local executor (a given Python interpreter).

Both executors run the same in-environment worker (``python -m inenv.worker``, or for a warm local executor
its serving form ``python -m inenv.warm``: checks.run.serving) and turn whatever comes back into a verdict with
:mod:`checks.run.classify`. The docker executor is in checks/run/container.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from checks.results import portable
from checks.results.hostfacts import safe_env
from checks.results.result import Verdict
from checks.run import classify, isolate, serving
from common import home
from common.build.celltoolkit import base_env
from common.caches import HOST_BYTECODE_ROOT
from common.reasons import Catalogue
from inenv import gpugate, kernelprint, kit
from inenv.probe import RESULT_MARKER, Variant
from inenv.probes.fi_jit import ARCHS_ENV
from inenv.registry import PROBE_PATH_ENV
from inenv.worker import PYCACHE_ENV

CODE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the `checks` package
HARD_TIMEOUT_MARGIN_S = 30.0  # the worker's own watchdog fires first and collects stacks
FINGERPRINT_TIMEOUT_S = 120.0
RunEnv = tuple[tuple[str, str], ...]  # NAME=value for every worker of a cell; an empty value unsets NAME


class ExecutorError(RuntimeError):
    """The executor cannot run at all (no interpreter, no Docker): bad environment, exit 2. Raised by a running
    variant, it stops its cell: ``code`` is the reason its variants are not run with."""

    def __init__(self, message: str, code: str = "image-missing") -> None:
        super().__init__(message)
        self.code = code


def worker_args(variant: Variant, gpus: int, timeout_s: float, queue_s: float = 0.0) -> list[str]:
    queue = ["--queue", f"{queue_s:g}"] if queue_s > 0 else []
    return ["-m", "inenv.worker", "--probe", variant.probe_id, "--variant", json.dumps(variant.to_json()),
            "--gpus", str(gpus), "--timeout", f"{timeout_s:g}", *queue]


def hard_timeout(timeout_s: float, queue_s: float = 0.0) -> float:
    """The host's watchdog: the worker's own soft timeout, the margin it needs to report a hang, and the
    time it may wait at the GPU gate (inenv.gpugate) before its soft timeout starts."""
    return timeout_s + HARD_TIMEOUT_MARGIN_S + queue_s


def gpu_lock_path() -> Path | None:
    """The host's GPU lock file (inenv.gpugate), created if missing so that a container can have it mounted;
    None when it cannot be (the run then starts each GPU variant only after the last one ended)."""
    path = Path(tempfile.gettempdir()) / gpugate.LOCK_NAME
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    except OSError as exc:
        print(f"warning: no GPU lock file ({path}: {exc}); GPU variants will not start up ahead", file=sys.stderr)
        return None
    return path


def run_env(cell_id: str, archs: tuple[str, ...], compile_cache: Path | None, host_id: str = "",
            gpu_lock: Path | None = None, token: str = "", gpu_alone: bool = False) -> RunEnv:
    """What every worker of a cell is told beyond its variant: the shared compile cache (its host path;
    a container gets it mounted), every cross-compile target of the run (fi-jit builds them in one go),
    which cell and host built what the cache holds, the host's GPU lock (inenv.gpugate; mounted too) and
    the run's token (a combined build is handed to the other targets of its run: inenv.kit._compile_cache;
    it names no environment, so no fingerprint reads it); ``gpu_alone``: every GPU variant takes the lock
    exclusive, also those that time nothing (--gpu-alone); where the ranks keep their bytecode (under this
    folder's cache, not the machine's temporary folder: inenv.worker.bytecode_cache)."""
    return ((kit.COMPILE_CACHE_ENV, str(compile_cache or "")), (ARCHS_ENV, " ".join(archs)),
            (kit.CELL_ENV, cell_id), (kit.HOST_ENV, host_id),
            (gpugate.ENV, str(gpu_lock or "")), (kit.HANDOFF_TOKEN_ENV, token),
            (gpugate.ALONE_ENV, "1" if gpu_alone else ""), (PYCACHE_ENV, str(HOST_BYTECODE_ROOT)))


def run_token() -> str:
    """A new run's token (run_env): random, so two runs never share one."""
    return secrets.token_hex(8)


def for_run(executors: Mapping[str, Executor], archs: tuple[str, ...], compile_cache: Path | None,
            host_id: str = "", gpu_lock: Path | None = None, token: str = "",
            warm: bool = False, gpu_alone: bool = False) -> dict[str, Executor]:
    """Each cell's executor with its run environment; ``warm``: its variants share rank processes where the
    executor can keep them (checks.run.serving)."""
    if compile_cache is not None:
        compile_cache.mkdir(parents=True, exist_ok=True)  # a bind mount of a missing folder makes a root-owned one
    return {cid: ex.with_run_env(run_env(cid, archs, compile_cache, host_id, gpu_lock, token, gpu_alone), warm=warm)
            for cid, ex in executors.items()}


def is_gated(run_env: RunEnv) -> bool:
    """Whether workers given ``run_env`` take turns on the GPU lock (inenv.gpugate)."""
    return any(name == gpugate.ENV and value for name, value in run_env)


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EnvPrint:
    """What identifies a cell's environment for incremental runs: ``base``, the environment without its carried
    kernel set (a Docker image's id below the kernel layer; an interpreter's distributions, toolkit, compiler
    and run-shaping variables), and ``kernels``, each carried module's digest (inenv.kernelprint), sorted by
    module. A variant's environment is the base and the digests of the modules it loads (:meth:`of`)."""

    base: str
    kernels: tuple[tuple[str, str], ...] = ()

    def of(self, modules: Iterable[str]) -> str:
        """The environment of a variant that loads ``modules``: the base alone when it loads none, so such a
        variant's inputs are the same before and after the set changes."""
        have = dict(self.kernels)
        wanted = sorted(set(modules))
        if not wanted:
            return self.base
        return f"{self.base} kernels " + ",".join(f"{m}={have.get(m, kernelprint.ABSENT)}" for m in wanted)

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.base, "kernels": dict(self.kernels)}


def env_print(base: str, kernels: Any) -> EnvPrint:
    """An :class:`EnvPrint` of ``base`` and the module digests an environment reported (read defensively: only
    text keys with text values count)."""
    found = kernels.items() if isinstance(kernels, Mapping) else ()
    return EnvPrint(base, tuple(sorted((k, v) for k, v in found if isinstance(k, str) and isinstance(v, str))))


def apply_env(env: dict[str, str], changes: RunEnv) -> dict[str, str]:
    for name, value in changes:
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    return env


class Executor(Protocol):
    """Runs one cell's variants on this host, each isolated: one process tree (or container) per variant, or a
    serving worker whose kept ranks a variant that ends badly takes down with it (checks.run.serving)."""

    name: str

    @property
    def gated(self) -> bool:
        """Whether its workers take turns on the host's GPU lock, so the runner may start the next GPU variant
        while one runs (inenv.gpugate)."""
        ...

    def with_run_env(self, run_env: RunEnv, warm: bool = False) -> Executor:
        """The same executor with the run's settings for its cell (run_env()); ``warm``: its variants may
        share rank processes kept between them (inenv.warm), where the executor can keep them."""
        ...

    def inspect(self) -> dict[str, Any]:
        """`python -m inenv.worker --inspect` in the environment: versions and GPU facts."""
        ...

    def fingerprint(self) -> EnvPrint | None:
        """What identifies the environment for incremental runs (checks.run.incremental), or None when it cannot
        be told (then nothing of this cell is reused)."""
        ...

    def run(self, variant: Variant, gpus: int, timeout_s: float, catalogue: Catalogue,
            queue_s: float = 0.0, env: RunEnv = ()) -> Verdict:
        """Run one variant isolated; always returns a verdict (never raises for a probe's failure).
        ``queue_s``: how long it may wait at the GPU gate (only for a gated executor); ``env``: set over the
        cell's run environment for this variant alone (its own GPUs: checks.run.placement.lane_env; only for an
        executor whose ``places`` is True)."""
        ...

    def sweep(self) -> None:
        """Ctrl-C, from the main thread: remove what a running variant holds outside its process group (a
        container), so the thread waiting on it returns."""
        ...

    def close(self) -> None:
        """The end of a run (or its Ctrl-C): end whatever the executor keeps between variants."""
        ...


def parse_result_text(text: str) -> tuple[dict[str, Any] | None, str]:
    lines = [ln for ln in text.splitlines() if ln.startswith(RESULT_MARKER)]
    if not lines:
        return None, ""
    try:
        data = json.loads(lines[-1][len(RESULT_MARKER):])
    except ValueError as exc:
        return None, f"invalid JSON after the result marker: {exc}"
    return (data, "") if isinstance(data, dict) else (None, "the result line is not a JSON object")


@dataclass(frozen=True)
class LocalExecutor:
    """A given interpreter on this host: ``--backend local``, or a venv cell (``name`` "venv", whose ``extra_env``
    sets its PATH, PYTHONPATH and CUDA_HOME: checks.run.venvcell)."""

    python: str = sys.executable
    name: str = "local"
    extra_env: tuple[tuple[str, str], ...] = ()  # set last, over the runner's own environment; "" unsets
    run_env: RunEnv = ()  # the run's settings for this cell (run_env()), before extra_env
    # True for a full venv cell: its processes start from what an image's container would have of the
    # runner's environment (common.build.celltoolkit.base_env), not from all of it
    hermetic: bool = False
    # True: variants run on serving workers that keep their ranks (checks.run.serving, inenv.warm); False:
    # one `python -m inenv.worker` per variant
    warm: bool = False
    places: bool = field(default=True, init=False)  # run() takes a variant's own environment (its GPUs)
    _servers: serving.ServerPool = field(init=False, repr=False, compare=False)
    # what the environment said of itself (inspect), read once: the cell's discovery and the host's peer
    # facts both ask, and each asking starts the interpreter and imports torch (2.3 s on a 1x H100 host)
    _inspected: dict[str, Any] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        resolved = shutil.which(self.python) if os.sep not in self.python else self.python
        if not resolved or not os.access(resolved, os.X_OK):
            raise ExecutorError(f"{self._what}: no such executable interpreter")
        try:
            code_path()  # the probes' code, checked before any process imports it
        except home.CacheError as exc:
            raise ExecutorError(exc.line()) from None
        # a run without GPU lock has no GPU: its servers hold no GPU memory, and each cell keeps its last
        object.__setattr__(self, "_servers", serving.ServerPool(serving.popen_launcher(self.python, self.env),
                                                                keep_one=not self.gated))

    @property
    def _what(self) -> str:
        return f"--python {self.python}" if self.name == "local" else f"{self.name} cell {self.python}"

    def env(self) -> dict[str, str]:
        env = base_env(os.environ) if self.hermetic else dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code_path()), env.get("PYTHONPATH", "")) if p)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop("VIRTUAL_ENV", None)  # the interpreter chosen, not the venv stackprobe itself runs in
        apply_env(env, self.run_env)
        apply_env(env, self.extra_env)
        return env

    @property
    def gated(self) -> bool:
        return is_gated(self.run_env)

    def with_run_env(self, run_env: RunEnv, warm: bool = False) -> LocalExecutor:
        return replace(self, run_env=run_env, warm=warm)

    def sweep(self) -> None:
        """The idle serving workers end; a running variant's process group (a serving worker's too) is ended by
        its own thread."""
        self._servers.close()

    def close(self) -> None:
        self._servers.close()

    def fingerprint(self) -> EnvPrint | None:
        """What inenv.envinfo.fingerprint reads in the interpreter, with the run-shaping variables of the
        environment its ranks get, and the digest of each carried module there (inenv.kernelprint)."""
        env = self.env()
        code = ("import json, inenv.envinfo as e, inenv.kernelprint as k; "
                "print(json.dumps([e.fingerprint(), k.installed()]))")
        try:
            proc = subprocess.run([self.python, "-c", code], capture_output=True, text=True, env=env,
                                  timeout=FINGERPRINT_TIMEOUT_S)
            found, kernels = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else (None, {})
        except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError):
            found, kernels = None, {}
        return env_print(f"{self.name} {digest([found, safe_env(env)])}", kernels) if found else None

    def inspect(self) -> dict[str, Any]:
        if not self._inspected:
            self._inspected.update(self._inspect())
        return dict(self._inspected)

    def _inspect(self) -> dict[str, Any]:
        try:
            proc = subprocess.run([self.python, "-m", "inenv.worker", "--inspect"], capture_output=True, text=True,
                                  env=self.env(), timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ExecutorError(f"{self._what}: cannot inspect the environment ({exc})") from None
        data, err = parse_result_text(proc.stdout)
        if data is None:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ExecutorError(f"{self._what}: environment inspection failed: {err or last}")
        return data

    def run(self, variant: Variant, gpus: int, timeout_s: float, catalogue: Catalogue,
            queue_s: float = 0.0, env: RunEnv = ()) -> Verdict:
        cmd = [self.python, *worker_args(variant, gpus, timeout_s, queue_s)]
        limit = hard_timeout(timeout_s, queue_s)
        if self.warm:
            p = self._servers.run(variant, gpus, timeout_s, queue_s, limit, env)
        else:
            p = isolate.run_isolated(cmd, apply_env(self.env(), env), limit)
        verdict = classify.from_process(p, catalogue, limit)
        return verdict.with_evidence(command=portable.text(" ".join(cmd[:3] + [variant.probe_id]), str(home.WORK_ROOT)))


@functools.cache
def code_path() -> Path:
    """What a local worker puts first on PYTHONPATH to import the probes: the checkout, or for an installed
    wheel a copy of the in-environment package alone (common.home.in_env_root), so that none of stackprobe's
    own dependencies shadows a package of the environment under test."""
    return home.in_env_root()


def probe_path_dirs() -> list[Path]:
    return [Path(p) for p in os.environ.get(PROBE_PATH_ENV, "").split(os.pathsep) if p]
