"""A fresh clone on a GPU host: how soon the first table comes, how long one cell's full suite takes, and how
many compiler processes the GPU host started, with or without the kernels the cell carries.

    python3 benchmarks/bench_gpu_host.py --matrix matrices/h200-overlay.yaml --only 'cu130-*-fi0.7.4' \
        --case carried [--wheels .whl/overlay] [--base-python python3] [--limit 600] [--out DIR]

``--case local``: the environment a user serves from: ``--base-python``'s own environment (its torch, CUDA libraries
and NCCL) with the flashinfer wheels of ``--wheels`` installed into it (pip, no index: a lent machine's environment,
given back after the call), nothing carried, probed as it is with ``checks run --backend local --python`` (the
fi-jit probe loads what the environment's flashinfer JIT cache holds and compiles for this GPU only what it lacks).
``--profile``: afterwards the quick level once more under cProfile (``profile-quick.txt``: the host side's 40
costliest calls by cumulative time). ``--cold``: afterwards the quick level four more times with ``--fresh``: as it
is (``warm_quick_s``), with warm ranks started as new interpreters instead of forked from their serving worker
(``STACKPROBE_FORK_RANKS=0``: ``spawned_quick_s``), with ``--cold-ranks`` (every variant in rank processes of its
own: ``cold_quick_s``) and with ``--gpu-alone`` (every GPU variant alone on the GPUs: ``alone_quick_s``), the A/B of
forked and warm ranks and of the shared GPU lock on one machine.
``--case carried``: the cell's kernel set (``.cache/kernels/<cell>/``, made on a CPU machine by `provision build`
and copied here) is installed by `provision build`; ``--case none``: ``--kernel-archs none``, in a venv folder
of its own, so nothing is carried and fi-jit compiles on this host. Then `checks run --all` (the quick pass,
then the full one) with its table watched on disk: ``first_table_s`` is the first write of the table,
``full_s`` the whole run (None when ``--limit`` stopped it first: then it is interrupted as by Ctrl-C, so
nothing it started outlives it). ``gpu_host_compiles``: the distinct nvcc,
cicc, ptxas and ninja processes seen on this host while the build and the run went (the process table read
every 0.1 s; a compile lasts seconds), a compiler asked only for its version apart (``compiler_queries``: the
build reads `nvcc --version`, which a 0.1 s poll sees now and then), and ``objects_compiled`` the object files the
JIT workspace holds after.
fi-jit plans only the (module, target) pairs ``STACKPROBE_FI_JIT_ONLY`` names when it is set (recorded as
``fi_jit_only``): a matrix whose cells carry only this GPU's target leaves the cross-compile targets to cells
that carry them. The JSON (``backend``, ``host_class``, ``first_table_s``, ``full_s``, ``gpu_host_compiles``) goes to
``--out``/gpu-host-<case>.json; the run's results to ``--out``/res.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FORK_OFF = "STACKPROBE_FORK_RANKS"  # inenv.forked.DISABLE_ENV
COMPILERS = ("nvcc", "cicc", "ptxas", "ninja", "fatbinary", "nvlink")
# A compiler started only to say what it is (the build reads `nvcc --version` to record the cell's toolkit) compiles
# nothing: such processes are counted apart.
QUERY_ARGS = frozenset({"--version", "-V", "--help", "-h", "--list-gpu-arch", "--list-gpu-code"})


class ProcessWatch:
    """Distinct compiler processes (by pid and start time) seen in /proc while it runs, those that only said what
    they are (:data:`QUERY_ARGS`) apart."""

    def __init__(self, every_s: float = 0.1) -> None:
        self.every_s = every_s
        self.seen: dict[tuple[str, str], str] = {}
        self.asked: dict[tuple[str, str], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    name = (proc / "comm").read_text().strip()
                    stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                    start = stat[19]
                    argv = (proc / "cmdline").read_bytes().split(b"\0")[1:] if name in COMPILERS else []
                except (OSError, IndexError):
                    continue
                # an exited process not yet reaped has no argv to tell a compile from a query; a compile, which
                # lasts seconds, is seen while it runs
                if name in COMPILERS and stat[0] != "Z":
                    query = any(a.decode(errors="replace") in QUERY_ARGS for a in argv)
                    (self.asked if query else self.seen)[(proc.name, start)] = name
            self._stop.wait(self.every_s)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def counts(self, queries: bool = False) -> dict[str, int]:
        """Processes per compiler name: those that compiled, or (``queries``) those that only said what they are."""
        out: dict[str, int] = {}
        for name in (self.asked if queries else self.seen).values():
            out[name] = out.get(name, 0) + 1
        return out


def first_write(table: Path, t0: float, stop: threading.Event, got: dict[str, float]) -> None:
    before = table.stat().st_mtime if table.exists() else None
    while not stop.is_set():
        if table.exists() and table.stat().st_mtime != before:
            got["first"] = time.monotonic() - t0
            return
        stop.wait(0.2)


def host_class() -> dict[str, Any]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    return {"gpu_name": out[0] if out else None, "gpu_count": len(out), "cores": os.cpu_count()}


def stamped(source: Any, sink: Any, t0: float) -> None:
    """Copy ``source``'s lines to ``sink``, each with the seconds since ``t0`` in front: where the run's time
    goes (host facts, the plan, each variant, the table) reads off the log."""
    for line in iter(source.readline, ""):
        sink.write(f"{time.monotonic() - t0:7.2f} {line}")
        sink.flush()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--matrix", required=True)
    p.add_argument("--only", required=True)
    p.add_argument("--case", choices=("carried", "none", "local"), required=True)
    p.add_argument("--cold", action="store_true", help="then the quick level warm and cold (--cold-ranks), timed")
    p.add_argument("--prefill", default="", help="--case local: flashinfer comm modules (vllm_comm,...) the "
                   "environment's own JIT cache is filled with first, by flashinfer's own build as an engine's "
                   "first use would; their compiles are counted apart (prefill_compiles)")
    p.add_argument("--profile", action="store_true", help="then the quick level once more (--fresh, no table) "
                   "under cProfile: where the host side's seconds go (profile-quick.txt, the 40 costliest calls)")
    p.add_argument("--wheels")
    p.add_argument("--base-python")
    p.add_argument("--limit", type=float, default=600.0)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = out / f"res-{args.case}"
    venvs = ROOT / ".cache" / f"venvs-{args.case}"
    jit = Path(f"/tmp/jit-{args.case}")
    env = dict(os.environ, STACKPROBE_JIT_CACHE=str(jit), FLASHINFER_WORKSPACE_BASE=str(jit), PYTHONUNBUFFERED="1",
               STACKPROBE_COMPILE_CACHE=str(ROOT / ".cache" / f"compile-{args.case}"))
    if args.case == "local":
        serve = args.base_python or "python3"
        fill = "; ".join(f"from flashinfer.jit.comm import gen_{m}_module as g; g().build_and_load()"
                         for m in args.prefill.split(",") if m)
        build = ["bash", "-c", f'set -e; {serve} -m pip install -q --no-index --no-deps {args.wheels}/*.whl'
                 + (f'; {serve} -c "{fill}"' if fill else "")]
        run = [sys.executable, "-m", "checks.cli", "run", "--all", "--backend", "local", "--python", serve,
               "--results", str(res)]
    else:
        build = [sys.executable, "-m", "provision.cli", "build", "--backend", "venv", "--matrix", args.matrix,
                 "--only", args.only, "--venvs", str(venvs)]
        build += ["--wheels", args.wheels, "--no-reach-check"] if args.wheels else []
        build += ["--base-python", args.base_python] if args.base_python else []
        build += ["--kernel-archs", "none"] if args.case == "none" else []
        run = [sys.executable, "-m", "checks.cli", "run", "--all", "--backend", "venv", "--matrix", args.matrix,
               "--only", args.only, "--results", str(res)]
    log = out / f"gpu-host-{args.case}.log"
    table = res / "compatibility.md"
    got: dict[str, float] = {}
    with ProcessWatch() as watch, log.open("w") as fh:
        t0 = time.monotonic()
        b = subprocess.run(build, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        build_s = time.monotonic() - t0
        compiles_in_build = sum(watch.counts().values())
        stop = threading.Event()
        t1 = time.monotonic()
        threading.Thread(target=first_write, args=(table, t1, stop, got), daemon=True).start()
        proc = subprocess.Popen(run, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        copier = threading.Thread(target=stamped, args=(proc.stdout, fh, t1), daemon=True)
        copier.start()
        rc: int | None = None
        try:
            rc = proc.wait(timeout=args.limit)
        except subprocess.TimeoutExpired:
            # as Ctrl-C: the run ends its variants (their compiles too) and keeps what finished
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        run_s = time.monotonic() - t1
        copier.join(timeout=10)
        stop.set()
        ab: dict[str, float | None] = {}
        if args.cold:
            for name, extra, more in (("warm_quick_s", [], {}), ("spawned_quick_s", [], {FORK_OFF: "0"}),
                                      ("cold_quick_s", ["--cold-ranks"], {}), ("alone_quick_s", ["--gpu-alone"], {})):
                fh.write(f"\n== {name}: the quick level again, --fresh {' '.join(extra)} {more or ''}\n")
                fh.flush()
                t2 = time.monotonic()
                again = subprocess.Popen([*run, "--level", "quick", "--fresh", "--no-report", *extra], cwd=ROOT,
                                         env={**env, **more}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)
                stamped(again.stdout, fh, t2)
                ab[name] = round(time.monotonic() - t2, 1) if again.wait(timeout=args.limit) == 0 else None
        if args.profile:
            prof = out / "profile-quick.prof"
            fh.write("\n== profile: the quick level again under cProfile, --fresh --no-report\n")
            fh.flush()
            t3 = time.monotonic()
            again = subprocess.Popen([sys.executable, "-m", "cProfile", "-o", str(prof), *run[1:], "--level", "quick",
                                      "--fresh", "--no-report"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
            stamped(again.stdout, fh, t3)
            ab["profiled_quick_s"] = round(time.monotonic() - t3, 1) if again.wait(timeout=args.limit) == 0 else None
            if prof.is_file():
                import io
                import pstats

                text = io.StringIO()
                pstats.Stats(str(prof), stream=text).sort_stats("cumulative").print_stats(40)
                (out / "profile-quick.txt").write_text(text.getvalue())
    objects = sum(1 for _ in jit.rglob("*.o")) if jit.is_dir() else 0
    result = {
        "backend": "local" if args.case == "local" else "venv", "case": args.case, "host_class": host_class(),
        "matrix": args.matrix, "only": args.only,
        "fi_jit_only": os.environ.get("STACKPROBE_FI_JIT_ONLY") or None,  # fi-jit's planned (module, target) pairs
        "build_s": round(build_s, 1), "build_rc": b.returncode, "prefill": args.prefill or None,
        "first_table_s": round(got["first"], 1) if "first" in got else None,
        "full_s": round(run_s, 1) if rc is not None else None, "run_rc": rc, "limit_s": args.limit,
        "gpu_host_compiles": sum(watch.counts().values()), "compiles_in_build": compiles_in_build,
        "compiler_processes": watch.counts(), "compiler_queries": watch.counts(queries=True),
        "objects_compiled": objects, **ab,
    }
    (out / f"gpu-host-{args.case}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
