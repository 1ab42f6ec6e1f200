"""The docker executor: one container per variant, or with warm ranks one container per serving worker
(checks.run.containerserver) that runs the cell's variants one after another, through the Docker SDK (host
side).

The container gets every GPU when the host has any, the host IPC namespace (NCCL and CUDA IPC need
shared memory and fd passing between ranks), unlimited memlock, the in-environment code (inenv/) mounted
read-only, no privileges, no Docker socket and no network (ranks talk over loopback). It is removed afterwards,
also at the timeout and on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from checks.results.result import Verdict
from checks.run import classify, isolate, serving
from checks.run.containerserver import ATTACH, ContainerProcess
from checks.run.executor import (
    CODE_ROOT,
    EnvPrint,
    ExecutorError,
    RunEnv,
    apply_env,
    env_print,
    hard_timeout,
    is_gated,
    parse_result_text,
    probe_path_dirs,
    worker_args,
)
from checks.run.isolate import ProcessOutcome
from common import memlock
from common.build import kernellayer
from common.caches import BYTECODE_ROOT, bytecode_key
from common.reasons import Catalogue
from inenv import gpugate, kit
from inenv.probe import Variant
from inenv.registry import PROBE_PATH_ENV
from inenv.status import Status
from inenv.worker import PYCACHE_ENV, bytecode_folder_name

MOUNT_ROOT = "/opt/stackprobe-code"  # apart from /opt/stackprobe, where cell images keep their locks
COMPILE_CACHE_MOUNT = "/opt/stackprobe-compile-cache"  # the host's shared compile cache, read-write
IN_ENV_PACKAGES = ("inenv",)  # what the ranks import from this checkout: mounted read-only
LABEL = "stackprobe.run"
# KEY=VALUE labels added to every container, so whoever started a run (a test session, a CI job) can find
# and remove whatever its runs left behind, and nothing else
LABELS_ENV = "STACKPROBE_CONTAINER_LABELS"
TAIL_LINES = 200


def _connect() -> tuple[Any, str | None]:
    """(a Docker SDK client that answered a ping, None), or (None, why not in one line, no fix)."""
    try:
        # lazy: the Docker SDK costs 170 ms at every `checks` start (checks.cli imports this module)
        import docker

        c = docker.from_env(timeout=120)
        c.ping()
        return c, None
    except Exception as exc:
        return None, why_no_daemon(exc, os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET)


DEFAULT_SOCKET = "unix:///var/run/docker.sock"  # where the SDK looks without DOCKER_HOST


def _root_cause(exc: BaseException) -> BaseException:
    """The operating system's error under the SDK's wrappers (its causes, contexts and the arguments the
    HTTP library nests them in), else ``exc`` itself."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo += [x for x in (e.__cause__, e.__context__, *e.args) if isinstance(x, BaseException)]
        todo += [getattr(e, "reason", None)] if isinstance(getattr(e, "reason", None), BaseException) else []
    return exc


def why_no_daemon(exc: BaseException, where: str) -> str:
    """Why no daemon answered at ``where`` (DOCKER_HOST's spelling), as a sentence: no Python exception's
    repr."""
    cause = _root_cause(exc)
    if isinstance(cause, FileNotFoundError):
        return f"no socket at {where}"
    if isinstance(cause, ConnectionRefusedError):
        return f"nothing listens at {where}"
    if isinstance(cause, PermissionError):
        return f"this user may not open {where}: permission denied"
    if isinstance(cause, TimeoutError) or "timed out" in str(cause).lower():
        return f"the daemon at {where} did not answer in time"
    if isinstance(cause, OSError) and cause.strerror:
        return f"the daemon at {where} cannot be reached: {cause.strerror.lower()}"
    text = str(getattr(exc, "explanation", None) or exc).splitlines()
    first = text[0].strip()[:200] if text else ""
    return f"the daemon at {where} did not answer" + (f": {first}" if first and "(" not in first else "")


def unreachable() -> str | None:
    """Why no Docker daemon can be used from here (the SDK's error), or None when one answers."""
    return _connect()[1]


def client() -> Any:
    """A Docker SDK client, or ExecutorError with one line saying why not and what to do."""
    c, problem = _connect()
    if problem is not None:
        raise ExecutorError(f"Docker is not reachable ({problem}); start dockerd, or leave out --backend docker "
                            "to run venv cells, or use --backend local")
    return c


def extra_labels(value: str | None = None) -> dict[str, str]:
    """``a=1,b=2`` from STACKPROBE_CONTAINER_LABELS (or ``value``) as labels; an entry without ``=`` is a
    label with an empty value."""
    raw = os.environ.get(LABELS_ENV, "") if value is None else value
    return {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in raw.split(",")) if k.strip()}


def exit_to_returncode(code: int) -> int:
    """Docker reports death by signal N as exit status 128+N; map it back to -N like subprocess does."""
    return -(code - 128) if 128 < code < 128 + 65 else code


class ContainerLost(Exception):
    """The daemon failed a variant after its container started: the container is gone or dead, removed or
    killed outside this variant (``code`` container-lost), or the daemon itself answered with an error or not at
    all (docker-daemon-error). The harness's failure, recorded as the variant's result."""

    def __init__(self, code: str, note: str, duration_s: float) -> None:
        super().__init__(note)
        self.code, self.note, self.duration_s = code, note, round(duration_s, 3)

    @classmethod
    def of(cls, name: str, exc: BaseException, duration_s: float) -> ContainerLost:
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker, in _connect
        import docker.errors

        why = str(getattr(exc, "explanation", None) or exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        status = getattr(getattr(exc, "response", None), "status_code", None)
        gone = isinstance(exc, docker.errors.NotFound) or (status == 409 and ("removal" in why or "dead" in why))
        if gone:
            return cls("container-lost", f"container {name} is gone or dead: removed or killed outside this "
                       f"variant before its result could be read (Docker: {why})", duration_s)
        return cls("docker-daemon-error", f"the Docker daemon failed while container {name} ran: {why}", duration_s)


@dataclass
class DockerExecutor:
    image: str
    python: str = "python3"
    gpus_on_host: int = 0
    run_label: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    memlock_unlimited: bool = True
    memlock_note: str = "unlimited"
    image_id: str | None = None
    use_init: bool = True  # PID 1 ignores default-action signals; an init makes a crash look like one
    name: str = "docker"
    run_env: RunEnv = ()  # the run's settings for this cell (checks.run.executor.run_env), host paths as given
    # True: variants run on serving workers, each a container kept between variants (checks.run.serving,
    # inenv.warm); False: one container per variant
    warm: bool = False
    _client: Any = None
    places: bool = field(default=True, init=False)  # run() takes a variant's own environment (its GPUs)
    _servers: serving.ServerPool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # a run without GPU lock has no GPU: its servers hold no GPU memory, and each cell keeps its last
        self._servers = serving.ServerPool(self._launch, keep_one=not self.gated)

    @property
    def gated(self) -> bool:
        return is_gated(self.run_env)

    def with_run_env(self, run_env: RunEnv, warm: bool = False) -> DockerExecutor:
        return replace(self, run_env=run_env, warm=warm)

    def close(self) -> None:
        """The serving workers' containers end (a one-shot variant's container ends with its variant)."""
        self._servers.close()

    def fingerprint(self) -> EnvPrint | None:
        """The image's id, or for an image of ours with a kernel layer the id of the image below it and each
        carried module's digest, from the layer's labels (common.build.kernellayer); None when the image vanished
        or the daemon went away (the run says so per variant)."""
        try:
            image = self.docker.images.get(self.image)
        except Exception:
            return None
        layer = kernellayer.read(image.labels)
        if layer is None:
            return EnvPrint(f"image {image.id}")
        base, kernels = layer
        return env_print(f"image {base}", kernels)

    def sweep(self) -> None:
        """Remove this executor's containers: a worker thread waiting on the daemon cannot be interrupted
        until its container is gone (a serving worker's too: its variant's thread then returns)."""
        self._servers.close()
        try:
            for name in self.leftovers():
                self.docker.api.remove_container(name, force=True)
        except Exception as exc:  # the daemon went away: the sweep of the test or the next run finds them
            print(f"warning: could not remove the containers of {self.image}: {exc}", file=sys.stderr)

    @property
    def docker(self) -> Any:
        if self._client is None:
            self._client = client()
        return self._client

    def _config(self, command: list[str], name: str = "", extra: RunEnv = (), stdin: bool = False) -> dict[str, Any]:
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker, in _connect
        from docker.types import DeviceRequest, Ulimit

        volumes = {str(CODE_ROOT / pkg): {"bind": f"{MOUNT_ROOT}/{pkg}", "mode": "ro"} for pkg in IN_ENV_PACKAGES}
        probe_dirs = []
        for i, d in enumerate(probe_path_dirs()):
            target = f"{MOUNT_ROOT}/extra-probes-{i}"
            volumes[str(d.resolve())] = {"bind": target, "mode": "ro"}
            probe_dirs.append(target)
        env = {"PYTHONPATH": MOUNT_ROOT, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
        if probe_dirs:
            env[PROBE_PATH_ENV] = ":".join(probe_dirs)
        apply_env(env, self.run_env)
        apply_env(env, extra)  # one variant's own (its GPUs: checks.run.placement.lane_env)
        cache = env.get(kit.COMPILE_CACHE_ENV)
        if cache:  # outside the image, so what one container builds the next one, and the next run, finds
            volumes[cache] = {"bind": COMPILE_CACHE_MOUNT, "mode": "rw"}
            env[kit.COMPILE_CACHE_ENV] = COMPILE_CACHE_MOUNT
        lock = env.get(gpugate.ENV)
        if lock:  # one lock file for the host's every worker, in a container or not (inenv.gpugate)
            volumes[lock] = {"bind": f"/tmp/{gpugate.LOCK_NAME}", "mode": "rw"}
            env[gpugate.ENV] = f"/tmp/{gpugate.LOCK_NAME}"
        pycache = self._bytecode_dir()
        env.pop(PYCACHE_ENV, None)  # the host's folder is no path in the container
        if pycache:  # the ranks' bytecode outlives the container (inenv.worker.bytecode_cache)
            volumes[pycache] = {"bind": f"/tmp/{bytecode_folder_name(0)}", "mode": "rw"}
            env[PYCACHE_ENV] = "/tmp"
        cfg: dict[str, Any] = {
            "image": self.image,
            "command": command,
            "environment": env,
            "volumes": volumes,
            "working_dir": "/tmp",
            # the image's own ENTRYPOINT (a serving image's starts its server) is not what runs: the command is
            "entrypoint": [""],
            "ipc_mode": "host",
            "ulimits": [Ulimit(name="memlock", soft=-1, hard=-1)] if self.memlock_unlimited else [],
            "privileged": False,
            "init": self.use_init,
            "network_mode": "none",
            "labels": {**extra_labels(), LABEL: self.run_label},
            "name": name or self.container_name(),
        }
        if stdin:  # a serving worker reads its requests there, attached before it starts (checks.run.containerserver)
            cfg["stdin_open"] = True
        if self.gpus_on_host:
            cfg["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
        return cfg

    def _start(self, cfg: dict[str, Any]) -> tuple[Any, Any]:
        """Create, attach when its stdin is open, then start: the container and its attach socket (None when
        not attached). A container that fails to start is removed, not left behind.

        The name is chosen before ``create`` and the removal goes by name: a Ctrl-C that lands while the
        daemon's reply to ``create`` is in flight leaves a container this process never got a handle to."""
        sock = None
        try:
            ctr = self.docker.containers.create(**cfg)
            if cfg.get("stdin_open"):
                sock = self.docker.api.attach_socket(ctr.id, params=ATTACH)
            ctr.start()
        except BaseException:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
            self._remove(cfg["name"])
            raise
        return ctr, sock

    def _remove(self, name: str) -> None:
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker, in _connect
        import docker.errors

        if name:
            with contextlib.suppress(docker.errors.APIError):  # NotFound included: already gone
                self.docker.api.remove_container(name, force=True)

    def _start_degrading(self, command: list[str], names: list[str], extra: RunEnv = (),
                         stdin: bool = False) -> tuple[Any, Any]:
        """Start a container for ``command`` named ``names[0]`` (:meth:`_start`); each retry after a refusal
        takes a new name, appended to ``names`` (the daemon may still be removing the refused one)."""
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker, in _connect
        import docker.errors

        while True:
            cfg = self._config(command, names[-1], extra, stdin)
            try:
                return self._start(cfg)
            except docker.errors.APIError as exc:
                # Judged by what this attempt asked for, not by the executor's state now: variants of one cell
                # start at once, and another one's refusal may have degraded it meanwhile.
                # A daemon that itself runs under a memlock cap cannot raise it for containers; NCCL and
                # CUDA IPC then work with the cap. Recorded in the results as evidence.memlock.
                if cfg["ulimits"] and "rlimit" in str(exc):
                    self.memlock_unlimited = False
                    self.memlock_note = memlock.refused(str(exc.explanation or exc))
                elif cfg["init"] and "init" in str(exc):
                    self.use_init = False  # no docker-init on this host: the worker runs as PID 1
                else:
                    raise
                names.append(f"{names[0]}-{len(names)}")

    def _started(self, command: list[str], names: list[str], extra: RunEnv = (),
                 stdin: bool = False) -> tuple[Any, Any]:
        """:meth:`_start_degrading`, the daemon's refusal as ExecutorError (one line, what to do)."""
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker, in _connect
        import docker.errors

        try:
            return self._start_degrading(command, names, extra, stdin)
        except docker.errors.ImageNotFound:
            raise ExecutorError(f"image {self.image} not found: run `provision build` first") from None
        except docker.errors.APIError as exc:
            why = str(exc.explanation or exc)
            hint = "; install the NVIDIA container toolkit for GPU access" if "device driver" in why else ""
            raise ExecutorError(f"cannot start a container from {self.image}: {why}{hint}",
                                "docker-daemon-error") from None

    def _launch(self, own: dict[str, str], extra: RunEnv, out: Any, err: Any) -> serving.Launched:
        """A serving worker's container (checks.run.serving.Launcher): the cell's container for one-shot
        variants with ``python -m inenv.warm`` as its command and its stdin open. ``own`` (the host's token
        and scratch folder) stays on the host: what the server starts ends with its container."""
        names = [self.container_name()]  # a container that fails to start is removed by _start
        _, sock = self._started([self.python, "-m", "inenv.warm"], names, extra, stdin=True)
        proc = ContainerProcess(self.docker.api, names[-1], sock, out, err, exit_to_returncode)
        return serving.Launched(proc, proc.kill, names[-1], proc.lost)

    def container_name(self) -> str:
        """A new container's name: unique, so that every variant owns the container it starts, whatever runs
        beside it on the same executor."""
        return f"stackprobe-{self.run_label}-{uuid.uuid4().hex[:8]}"

    def _run(self, command: list[str], timeout_s: float, name: str = "", extra: RunEnv = ()) -> ProcessOutcome:
        """Run ``command`` in a new container named ``name`` (a new one when empty) and remove that container,
        and only that one, at the end. The daemon failing after the start (the container removed by someone
        else, the daemon gone) raises ContainerLost: the variant's result, not the run's end."""
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker, in _connect
        import docker.errors
        import requests.exceptions

        names = [name or self.container_name()]  # the first, then one per retry (_start_degrading)
        started = time.monotonic()
        timed_out = interrupted = False
        code: int | None = None
        try:
            ctr, _ = self._started(command, names, extra)
            try:
                while code is None:  # short waits, so a cancelled run (isolate.STOP) ends it within POLL_S
                    try:
                        code = int(ctr.wait(timeout=isolate.POLL_S * 5).get("StatusCode", -1))
                    except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError) as exc:
                        # over the daemon's socket a read timeout can come as a ConnectionError saying so
                        if not isinstance(exc, requests.exceptions.ReadTimeout) and "timed out" not in str(exc):
                            raise  # the daemon went away: not a hang
                        if isolate.STOP.is_set():
                            interrupted = True
                        elif time.monotonic() - started >= timeout_s:
                            timed_out = True
                        else:
                            continue
                        ctr.kill()
                        break
                if interrupted:
                    raise KeyboardInterrupt  # after the finally below removed the container
                out = ctr.logs(stdout=True, stderr=False, tail=TAIL_LINES).decode(errors="replace")
                err = ctr.logs(stdout=False, stderr=True, tail=TAIL_LINES).decode(errors="replace")
                oom = False
                if not timed_out:
                    ctr.reload()
                    oom = bool(ctr.attrs.get("State", {}).get("OOMKilled"))
            except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
                raise ContainerLost.of(names[-1], exc, time.monotonic() - started) from None
        finally:
            # by name, so that no moment between create and this point leaves a container behind
            for each in names:
                self._remove(each)
        result, result_error = parse_result_text(out)
        if oom:
            err += "\ncontainer OOMKilled: host memory exhausted"
        return ProcessOutcome(
            returncode=None if timed_out else exit_to_returncode(code if code is not None else -1),
            timed_out=timed_out,
            result=result,
            result_error=result_error,
            stdout_tail=out[-4000:],
            stderr_tail=err[-4000:],
            duration_s=round(time.monotonic() - started, 3),
            leftovers=0,
        )

    def inspect(self) -> dict[str, Any]:
        p = self._run([self.python, "-m", "inenv.worker", "--inspect"], 300)
        if p.result is None:
            last = (p.stderr_tail.strip().splitlines() or ["no output"])[-1]
            raise ExecutorError(f"image {self.image}: environment inspection failed: {p.result_error or last}")
        return p.result

    def run(self, variant: Variant, gpus: int, timeout_s: float, catalogue: Catalogue,
            queue_s: float = 0.0, env: RunEnv = ()) -> Verdict:
        limit = hard_timeout(timeout_s, queue_s)
        if self.warm:
            command = f"docker run -i {self.image} {self.python} -m inenv.warm ({variant.probe_id})"
            p = self._servers.run(variant, gpus, timeout_s, queue_s, limit, env)
            name = p.where  # the serving container it ran in
            if p.lost:
                verdict = classify.decided(Status.NOT_RUN, "container-lost", p.lost, catalogue)
                verdict = verdict.replace(duration_s=p.duration_s)
            else:
                verdict = classify.from_process(p, catalogue, limit)
        else:
            name = self.container_name()
            command = f"docker run {self.image} {self.python} -m inenv.worker --probe {variant.probe_id}"
            try:
                p = self._run([self.python, *worker_args(variant, gpus, timeout_s, queue_s)], limit, name, env)
            except ContainerLost as lost:
                verdict = classify.decided(Status.NOT_RUN, lost.code, lost.note, catalogue)
                verdict = verdict.replace(duration_s=lost.duration_s)
            else:
                verdict = classify.from_process(p, catalogue, limit)
        return verdict.with_evidence(image=self.image, image_id=self._image_id(), memlock=self.memlock_note,
                                     container=name, command=command)

    def _bytecode_dir(self) -> str | None:
        """A host folder for the bytecode the ranks of this image compile, mounted where the container's root
        keeps it. One per image id, since an image's sources never change: Python's check of a bytecode
        file against its source's size and time then never meets another image's file of the same path.
        The worker uses it only when it is its user's alone (mode 0700), so a host user other than root
        gets no cache in a root container, and loses nothing else."""
        image_id = bytecode_key(self._image_id() or "")
        if not image_id:
            return None
        folder = BYTECODE_ROOT / image_id
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder.chmod(0o700)
        except OSError:
            return None
        return str(folder)

    def _image_id(self) -> str | None:
        if self.image_id is None:
            try:
                self.image_id = str(self.docker.images.get(self.image).id)
            except Exception:
                self.image_id = ""
        return self.image_id or None

    def leftovers(self) -> list[str]:
        """Containers of this executor that still exist (should always be none)."""
        # one list call: containers.list() inspects each one and fails on any that vanishes meanwhile
        found = self.docker.api.containers(all=True, filters={"label": f"{LABEL}={self.run_label}"})
        return [n.lstrip("/") for c in found for n in c["Names"]]


def image_digest(image: str) -> str | None:
    try:
        return str(client().images.get(image).id)
    except Exception:
        return None
