"""Where one GPU variant's seconds go before and after its probe: the per-variant floor, phase by phase.

    python benchmarks/bench_variant_floor.py [--cell CELL | --python PATH] [--json OUT] [--profile ID:VARIANT ...]

Every number is measured in the environment's own interpreter (a venv cell of `provision build --backend
venv`, else ``--python``), two ranks, one GPU each:

* ``interpreter``: ``python -c pass``; ``harness``: importing inenv.worker; ``envinfo``: the worker's
  ``versions()`` (it runs nvcc), ``toolkit.resolve()`` and ``gpu_count_hint()`` (nvidia-smi);
* ``import``: ``import torch`` (and the largest modules it imports, from ``-X importtime``), the threads
  alive after it (a rank may only be forked from a process with one), the first CUDA allocation, importing
  flashinfer and flashinfer.comm;
* ``driver``: cuInit and retaining the primary context through ctypes, no torch;
* ``spawn``: two rank processes started as the worker starts them (interpreter, import torch, CUDA,
  ``init_process_group(nccl, device_id)``, a gloo group, a first all_reduce, destroy_process_group), per
  phase, slowest rank; ``spawn-no-destroy``: the same ending in ``os._exit`` with the communicator alive;
* ``zygote``: one process imports torch, then forks the two ranks, which set their environment and go on
  as above (fork before any CUDA or NCCL use);
* ``predriver``: as ``spawn``, with cuInit and the primary context made by a thread while torch imports.

``--profile ID:VARIANT_KEY`` runs one variant through the real worker with cProfile in every rank
(STACKPROBE_RANK_PROFILE) and prints the worker's phases and the functions that took longest in rank 0.
Exits with one line when the host has fewer than two GPUs (one, with ``--skip-micro``: ranks sharing a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# --- rank side (runs in the environment's interpreter, with torch) -------------------------------------------
def _rank_body(marks: dict[str, float], destroy: bool) -> None:
    """From torch imported to a first all_reduce, marking each phase; prints the marks as JSON, exits."""
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    torch.empty(1, device="cuda")
    marks["cuda"] = time.time()
    dist.init_process_group("nccl", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    marks["nccl_init"] = time.time()
    gloo = dist.new_group(backend="gloo")
    marks["gloo"] = time.time()
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier(group=gloo)
    marks["first_collective"] = time.time()
    if destroy:
        dist.destroy_process_group()
        marks["destroyed"] = time.time()
    sys.stdout.write(json.dumps(marks) + "\n")
    sys.stdout.flush()
    os._exit(0)


def _predrive(device: int) -> None:
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cuda.cuDeviceGet(ctypes.byref(dev), device)
    cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)


def rank_main(role: str) -> None:
    marks = {"main": time.time()}
    if role == "predriver":
        import threading

        threading.Thread(target=_predrive, args=(int(os.environ["RANK"]),), daemon=True).start()
    import torch  # noqa: F401

    marks["import"] = time.time()
    _rank_body(marks, destroy=role != "no-destroy")


def zygote_main(port: int) -> None:
    """Import torch once, then fork both ranks; prints the parent's marks and each child's."""
    import threading

    t0 = time.time()
    import torch

    imported = time.time()
    tasks = len(os.listdir("/proc/self/task"))
    info = {"import_s": round(imported - t0, 3), "threads": threading.active_count(), "tasks": tasks,
            "cuda_initialized": bool(torch.cuda.is_initialized())}
    children = []
    for r in range(2):
        read, write = os.pipe()
        forked = time.time()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.dup2(write, 1)
            os.environ.update({"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(port)})
            _rank_body({"main": forked, "import": time.time()}, destroy=True)
        os.close(write)
        children.append((pid, read, forked))
    out = []
    for pid, read, _forked in children:
        with os.fdopen(read) as f:
            text = f.read()
        _, status = os.waitpid(pid, 0)
        marks = json.loads(text.strip().splitlines()[-1]) if text.strip() else {}
        marks["exited"] = time.time()
        marks["status"] = status
        out.append(marks)
    print(json.dumps({"parent": info, "ranks": out, "forked_at": imported}))


# --- driver side (standard library) ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(python: str, env: dict[str, str], code: str, *flags: str) -> tuple[float, str, str]:
    t0 = time.perf_counter()
    p = subprocess.run([python, *flags, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - t0, p.stdout, p.stderr


def best_of(python: str, env: dict[str, str], code: str, n: int = 3) -> float:
    return round(min(timed(python, env, code)[0] for _ in range(n)), 3)


def last_json(text: str) -> dict[str, Any]:
    lines = [ln for ln in text.strip().splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def importtime_top(stderr: str, n: int = 12) -> list[tuple[str, float]]:
    """The modules with the largest cumulative import time among those torch imports directly."""
    rows = []
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m and len(m.group(3)) <= 3:  # torch itself and the modules it imports directly
            rows.append((m.group(4), int(m.group(2)) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:n]


def phases_of(ranks: list[dict[str, Any]], start: float) -> dict[str, float]:
    """Per phase, the slowest rank: each mark minus the one before it; ``total`` from the first spawn."""
    order = ["main", "import", "cuda", "nccl_init", "gloo", "first_collective", "destroyed", "exited"]
    out: dict[str, float] = {}
    for i, name in enumerate(order):
        spans = []
        for r in ranks:
            prev = start if i == 0 else next((r[o] for o in reversed(order[:i]) if o in r), None)
            if name in r and prev is not None:
                spans.append(r[name] - prev)
        if spans:
            out[name] = round(max(spans), 3)
    ends = [r["exited"] for r in ranks if "exited" in r]
    if ends:
        out["total"] = round(max(ends) - start, 3)
    return out


def two_ranks(python: str, env: dict[str, str], role: str) -> dict[str, float]:
    port = free_port()
    procs = []
    start = time.time()
    for r in range(2):
        e = {**env, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([python, __file__, "--rank-role", role], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    ranks = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        marks = last_json(out)
        marks["exited"] = time.time()
        if p.returncode != 0 or not marks.get("first_collective"):
            print(f"  {role}: rank exited {p.returncode}: {err.strip()[-400:]}")
        ranks.append(marks)
    return phases_of(ranks, start)


def zygote(python: str, env: dict[str, str]) -> dict[str, Any]:
    start = time.time()
    p = subprocess.run([python, __file__, "--zygote-port", str(free_port())], env=env, capture_output=True, text=True,
                       timeout=300)
    data = last_json(p.stdout)
    if not data:
        return {"error": p.stderr.strip()[-400:]}
    after_fork = phases_of(data["ranks"], data["forked_at"])
    return {"parent": data["parent"], "after_fork": after_fork, "total": round(max(r["exited"] for r in data["ranks"])
                                                                               - start, 3)}


def variant_from_key(probe: str, key: str) -> Any:
    """The Variant a recorded key such as ``ranks=8,placement=shared,gpus=1,backend=nccl`` names (read through
    ``inenv.probe.key_parts``, the one reader of recorded keys)."""
    from inenv.probe import SHARED, Variant, key_parts

    ranks, shared, gpus, params = 1, False, 0, []
    for name, value in key_parts(key):
        if name == "ranks":
            ranks = int(value)
        elif (name, value) == ("placement", SHARED):
            shared = True
        elif name == "gpus" and shared:
            gpus = int(value)
        else:
            params.append((name, value))
    return Variant(probe, ranks, tuple(params), shared, gpus=gpus)


def profile_variant(python: str, env: dict[str, str], spec: str, gpus: int, out: Path) -> dict[str, Any]:
    probe, _, key = spec.partition(":")
    variant = variant_from_key(probe, key)
    folder = out / re.sub(r"[^A-Za-z0-9_.-]", "_", spec)
    folder.mkdir(parents=True, exist_ok=True)
    e = {**env, "STACKPROBE_RANK_PROFILE": str(folder)}
    t0 = time.perf_counter()
    p = subprocess.run([python, "-m", "inenv.worker", "--probe", probe, "--variant", json.dumps(variant.to_json()),
                        "--gpus", str(gpus), "--timeout", "300"], env=e, capture_output=True, text=True, timeout=400,
                       cwd=ROOT)
    wall = time.perf_counter() - t0
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("@@STACKPROBE-RESULT@@")), "")
    result = json.loads(line[len("@@STACKPROBE-RESULT@@"):]) if line else {}
    top: list[str] = []
    prof = folder / "rank-0.prof"
    if prof.exists():
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(str(prof), stream=buf).sort_stats("cumulative").print_stats(28)
        top = [ln for ln in buf.getvalue().splitlines() if re.match(r"\s+\d", ln)]
    return {"variant": spec, "wall_s": round(wall, 3), "status": result.get("status"),
            "reason_code": result.get("reason_code"), "duration_s": result.get("duration_s"),
            "phases": result.get("evidence", {}).get("phases"), "top": top}


def cell_env(cell: str | None, python: str | None) -> tuple[str, dict[str, str]]:
    env = {**os.environ, **MULTICAST_OFF, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    if cell:
        from checks.run import venvcell

        vc = venvcell.read(ROOT / "envs", cell)
        if vc.state != "built" or not vc.python:
            raise SystemExit(f"cell {cell}: {vc.state} ({vc.reason})")
        env.update(dict(vc.env))
        return vc.python, env
    return python or sys.executable, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", help="a venv cell id (envs/<cell>/build.json)")
    ap.add_argument("--python", help="the environment's interpreter (default: this one)")
    ap.add_argument("--json", type=Path, help="write every number here too")
    ap.add_argument("--profile", action="append", default=[], metavar="ID:VARIANT_KEY")
    ap.add_argument("--profile-dir", type=Path, default=Path(tempfile.gettempdir()) / "stackprobe-floor-profile")
    ap.add_argument("--skip-micro", action="store_true", help="only the --profile variants")
    ap.add_argument("--rank-role", help=argparse.SUPPRESS)
    ap.add_argument("--zygote-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_role:
        rank_main(args.rank_role)
        return
    if args.zygote_port:
        zygote_main(args.zygote_port)
        return
    python, env = cell_env(args.cell, args.python)
    from inenv import envinfo

    gpus = envinfo.gpu_count_hint()
    if gpus < (1 if args.skip_micro else 2):
        raise SystemExit(f"needs {'a GPU' if args.skip_micro else 'two GPUs'}; {gpus} visible")
    report: dict[str, Any] = {"python": python}

    def show(name: str, value: Any) -> None:
        report[name] = value
        print(f"{name}: {json.dumps(value)}", flush=True)

    if not args.skip_micro:
        show("interpreter_s", best_of(python, env, "pass"))
        show("harness_import_s", best_of(python, env, "import inenv.worker"))
        _, out, _ = timed(python, env, "import json,time\nfrom inenv import envinfo, toolkit\nr={}\n"
                          "t=time.perf_counter(); envinfo.versions(); r['versions_s']=time.perf_counter()-t\n"
                          "t=time.perf_counter(); toolkit.resolve(); r['toolkit_resolve_s']=time.perf_counter()-t\n"
                          "t=time.perf_counter(); envinfo.gpu_count_hint()\n"
                          "r['gpu_count_hint_s']=time.perf_counter()-t\n"
                          "print(json.dumps({k: round(v, 3) for k, v in r.items()}))")
        show("envinfo", last_json(out))
        code = ("import json,os,threading,time\nr={}\nt=time.perf_counter()\nimport torch\n"
                "r['import_torch_s']=time.perf_counter()-t\nr['threads']=threading.active_count()\n"
                "r['tasks']=len(os.listdir('/proc/self/task'))\nr['cuda_initialized']=torch.cuda.is_initialized()\n"
                "t=time.perf_counter(); torch.cuda.set_device(0); torch.empty(1, device='cuda')\n"
                "r['first_cuda_alloc_s']=time.perf_counter()-t\nr['tasks_after_cuda']=len(os.listdir('/proc/self/task'))\n"
                "try:\n t=time.perf_counter(); import flashinfer; r['import_flashinfer_s']=time.perf_counter()-t\n"
                " t=time.perf_counter(); import flashinfer.comm; r['import_flashinfer_comm_s']=time.perf_counter()-t\n"
                "except Exception as e: r['flashinfer_error']=str(e)[:200]\n"
                "print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))")
        for i in range(2):
            _, out, err = timed(python, env, code)
            show(f"import_{i}", last_json(out) or err[-300:])
        _, _, err = timed(python, env, "import torch", "-X", "importtime")
        show("importtime_top", importtime_top(err))
        _, out, err = timed(python, env, "import ctypes,json,time\nc=ctypes.CDLL('libcuda.so.1')\nr={}\n"
                            "t=time.perf_counter(); c.cuInit(0); r['cuInit_s']=time.perf_counter()-t\n"
                            "d=ctypes.c_int(); x=ctypes.c_void_p(); c.cuDeviceGet(ctypes.byref(d),0)\n"
                            "t=time.perf_counter(); c.cuDevicePrimaryCtxRetain(ctypes.byref(x),d)\n"
                            "r['primary_ctx_s']=time.perf_counter()-t\n"
                            "print(json.dumps({k: round(v,3) for k,v in r.items()}))")
        show("driver", last_json(out) or err[-300:])
        for role in ("spawn", "spawn", "no-destroy", "predriver", "predriver"):
            show(f"two_ranks_{role}", two_ranks(python, env, role))
        for _ in range(2):
            show("zygote", zygote(python, env))
    for spec in args.profile:
        res = profile_variant(python, env, spec, gpus, args.profile_dir)
        report.setdefault("profiles", []).append(res)
        print(f"profile {spec}: {res['status']} {res['reason_code'] or ''} worker {res['duration_s']} s, wall "
              f"{res['wall_s']} s, phases {json.dumps(res['phases'])}")
        for line in res["top"]:
            print("   " + line[:170])
        sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
