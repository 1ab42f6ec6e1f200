"""host-p2p's NCCL check between a pair: the NCCL settings it runs, the first allreduces in a thread waited for
with a deadline, and the control (the same allreduces with ``NCCL_P2P_DISABLE=1`` in fresh processes, NCCL reading
its environment once per process), run where the defaults failed.

Not a probe (no SPEC): host-p2p imports it and carries it in its hash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from inenv.kit import _data, _device, _dist, _errors, _nccl
from inenv.probe import RankContext

P2P_SETTINGS: dict[str, dict[str, str | None]] = {  # None: removed from the ranks' environment
    "default": {"NCCL_P2P_DISABLE": None, "NCCL_P2P_LEVEL": None},
    "disabled": {"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": None},
    "level-loc": {"NCCL_P2P_DISABLE": None, "NCCL_P2P_LEVEL": "LOC"},
}
NCCL_DEADLINE_S = 90.0  # the communicator and the first allreduces together
CONTROL = "disabled"  # the setting the control of a failed default runs: NCCL_P2P_DISABLE=1
CONTROL_DEADLINE_S = 60.0  # the control's communicator and allreduces
CONTROL_START_S = 90.0  # a fresh interpreter importing torch, and the wait for the peer to say how it went
CONTROL_MARKER = "@@STACKPROBE-P2P-CONTROL@@ "
CONTROL_KEY = "stackprobe-p2p-control"
NCCL_ELEMS = (_data.HIDDEN, 4 << 20)  # bf16: one decode token (14 KiB), then 8 MiB


# --------------------------------------------------------------------------------------------------
# check=nccl


def p2p_env(setting: str) -> tuple[dict[str, str], list[str]]:
    """Variables to set and to remove for one setting (KeyError for an unknown one)."""
    wanted = P2P_SETTINGS[setting]
    return {k: v for k, v in wanted.items() if v is not None}, [k for k, v in wanted.items() if v is None]


def first_allreduces(ctx: RankContext, device_index: int | None, deadline_s: float,
                     backend: str = "nccl") -> dict[str, Any]:
    """The communicator and the first allreduces, in a thread the rank waits for with a deadline: a step
    stuck inside NCCL (even its initialisation) becomes a ``hang`` here, and the rank still reports it.
    ``backend``: NCCL; gloo on the CPU (``device_index`` None) runs the same steps where no GPU is."""
    box: dict[str, Any] = {"step": "communicator initialisation"}
    done = threading.Event()

    def work() -> None:
        try:
            import torch
            import torch.distributed as dist

            t0 = time.monotonic()
            device = _dist.init_dist(dataclasses.replace(ctx, device_index=device_index), backend, deadline_s)
            box["init_s"] = round(time.monotonic() - t0, 3)
            checks: dict[str, Any] = {}
            box["checks"] = checks
            for seed, n in enumerate(NCCL_ELEMS, 1):
                box["step"] = f"allreduce of {n * 2} bytes"
                x = _data.pattern((n,), ctx.rank, seed, device)
                buf = torch.full((n,), _data.SENTINEL, dtype=torch.bfloat16, device=device)
                buf.copy_(x)
                t = time.monotonic()
                dist.all_reduce(buf)
                if device.type == "cuda":
                    _device.wait_device(max(1.0, deadline_s - (time.monotonic() - t0)))
                if "first_allreduce_s" not in box:
                    box["first_allreduce_s"] = round(time.monotonic() - t, 3)
                chk = _data.check_exact(buf, _data.pattern_sum((n,), ctx.world_size, seed, device),
                                        prior=_data.filled((n,)), own_input=x)
                checks[str(n * 2)] = chk.to_json()
                if not chk.ok:
                    break
            box["step"] = "done"
        except _device.Hung as exc:
            box["hung"] = str(exc)
        except Exception as exc:
            box["error"] = _errors.error_tail(exc)
        finally:
            done.set()

    threading.Thread(target=work, name="stackprobe-first-allreduce", daemon=True).start()
    if not done.wait(deadline_s):
        box["hung"] = f"not finished after {deadline_s:.0f} s"
    return box


def failed(box: dict[str, Any]) -> bool:
    """Whether the first allreduces of ``box`` did not all come back exact."""
    checks = box.get("checks") or {}
    return bool(box.get("hung") or box.get("error") or not checks
                or any(c.get("verdict") != "exact" for c in checks.values()))


def what_failed(box: dict[str, Any]) -> tuple[str, str]:
    """(what went wrong, the reason code it alone gives) for a box that :func:`failed`."""
    checks = box.get("checks") or {}
    wrong = {k: c for k, c in checks.items() if c.get("verdict") != "exact"}
    if box.get("hung"):
        return f"{box.get('step', 'a step')} hung ({box['hung']})", "nccl-op-hang"
    if box.get("error"):
        return f"{box.get('step', 'a step')} failed: {_errors.last_line(box['error'])}", _nccl.classify_error(
            box["error"])
    size, c = next(iter(wrong.items())) if wrong else ("", {"verdict": "missing", "detail": "no check ran"})
    return f"allreduce of {size} bytes {c['verdict']} ({c.get('detail', '')})", "nccl-wrong-result"

# --------------------------------------------------------------------------------------------------
# The control: the same first allreduces with NCCL_P2P_DISABLE=1, in fresh processes (NCCL reads its
# environment once per process), run where the defaults failed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def agree_on_control(store: Any, rank: int, world: int, broke: bool, timeout_s: float) -> tuple[int | None, str]:
    """Every rank says over ``store`` whether its own attempt failed; the control runs when any did, on a
    rendezvous port rank 0 picks. Returns (that port, "") to run it, (None, "") when every attempt passed, and
    (None, why) when a rank never said."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)
    store.set(f"{CONTROL_KEY}/failed/{rank}", "1" if broke else "0")
    keys = [f"{CONTROL_KEY}/failed/{r}" for r in range(world)]
    try:
        store.wait(keys, timeout)
        if not any(store.get(k) == b"1" for k in keys):
            return None, ""
        if rank == 0:
            store.set(f"{CONTROL_KEY}/port", str(free_port()))
        store.wait([f"{CONTROL_KEY}/port"], timeout)
        return int(store.get(f"{CONTROL_KEY}/port")), ""
    except Exception as exc:  # the store's own timeout or a peer that is gone
        return None, f"a peer rank never said how its attempt went ({_errors.last_line(str(exc))})"


def control_env(base: dict[str, str], master_addr: str, port: int) -> dict[str, str]:
    """The control process's environment: this rank's, with the control's P2P setting and rendezvous, and this
    checkout first on the module path (pure)."""
    set_, unset = p2p_env(CONTROL)
    env = {k: v for k, v in base.items() if k not in unset}
    env.update(set_)
    env.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(port)})
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH", "")) if p)
    return env


def run_control(ctx: RankContext, device_index: int | None, port: int, backend: str = "nccl") -> dict[str, Any]:
    """The control for this rank in a fresh interpreter (``python -m inenv.probes.host_p2p --control``), waited
    for with a deadline; its box as :func:`first_allreduces` gives it, with its process id (its NCCL log)."""
    spec = {"rank": ctx.rank, "world": ctx.world_size, "local_rank": ctx.local_rank, "device": device_index,
            "master_addr": ctx.master_addr, "port": port, "workdir": str(ctx.workdir), "backend": backend,
            "deadline_s": CONTROL_DEADLINE_S}
    cmd = [sys.executable, "-m", "inenv.probes.host_p2p", "--control", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=control_env(dict(os.environ), ctx.master_addr, port), capture_output=True,
                              text=True, timeout=CONTROL_DEADLINE_S + CONTROL_START_S)
    except subprocess.TimeoutExpired:
        return {"hung": f"the control process did not finish within {CONTROL_DEADLINE_S + CONTROL_START_S:.0f} s",
                "step": "the control"}
    except OSError as exc:
        return {"not_run": f"could not start {sys.executable}: {exc.strerror or exc}"}
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(CONTROL_MARKER)), None)
    if line is None:
        tail = _errors.last_line(proc.stderr) if proc.stderr.strip() else "no output"
        return {"error": f"the control process exited {proc.returncode} without a result: {tail}",
                "step": "the control"}
    try:
        box = json.loads(line[len(CONTROL_MARKER):])
    except ValueError:
        return {"error": "the control process wrote an unreadable result", "step": "the control"}
    return box if isinstance(box, dict) else {"error": "the control process wrote no box", "step": "the control"}


def p2p_control(ctx: RankContext, store: Any, device_index: int | None, broke: bool,
                backend: str = "nccl") -> dict[str, Any] | None:
    """The control where any rank's attempt failed (None where all passed), with the transports its NCCL log
    names; ``{"not_run": why}`` when the ranks could not agree on it."""
    port, why = agree_on_control(store, ctx.rank, ctx.world_size, broke, NCCL_DEADLINE_S + CONTROL_START_S)
    if port is None:
        return {"not_run": why} if why else None
    box = run_control(ctx, device_index, port, backend)
    if isinstance(box.get("pid"), int):
        box["transports"] = _nccl.read_nccl_logs(ctx.workdir, box["pid"])["transports"]
    return box
