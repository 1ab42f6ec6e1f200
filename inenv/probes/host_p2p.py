"""host-p2p: can the GPUs of this host talk to each other directly, how fast, and if not, why (docs/probes.md).

Three kinds of variant:

- ``check=facts`` (one rank; runs on a host without a GPU too): the host below the stack, read without changing
  anything. Per GPU its PCI address, NUMA node and PCIe link (current against maximum, the speed read again
  while copies run, since an idle GPU lowers its link speed), the bridges above it up to its root port with
  each one's ACS capability and control bits (parsed from configuration space, inenv/kit/_pci.py), the IOMMU
  and its mode, and the driver's view of every pair (NVML: topology, P2P read/write/atomics status). Each fact
  names where it was read, or why it could not be.
- ``check=copy,pair=A-B`` (two ranks, one GPU each; rank 0 drives both GPUs, rank 1 holds the second): peer
  access as CUDA reports it, copies of a known pattern in both directions into a sentinel-filled destination
  checked exactly (copy engine large and small, and a strided copy a kernel does), then unidirectional and
  bidirectional bandwidth and small-copy latency against the link's theoretical rate. The PCIe error counters the
  driver does not report (AER of each GPU and bridge on the pair's paths, the GPUs' replay counters) are read
  before and after: copies that pass while the link retransmits are named.
- ``check=nccl,pair=A-B,p2p=default|disabled|level-loc`` (two ranks): the first allreduces in fresh processes
  with NCCL's defaults, with ``NCCL_P2P_DISABLE=1`` and with ``NCCL_P2P_LEVEL=LOC``, checked exactly. Where the
  defaults fail, the same allreduces run again in fresh processes with ``NCCL_P2P_DISABLE=1`` (the control):
  both failing says the host, not peer-to-peer, is broken.

Every pair gets the copy check; NCCL runs on a bounded, stated set of pairs (:func:`pairs_for_nccl`). A pair of two
GPU models is named as such. ``A`` and ``B`` are the GPUs' indices on the host: a pair variant the runner placed
on those two GPUs alone (beside other timed variants on an NVSwitch host) finds its devices by them
(``inenv.probe.visible_index``), and names them by them in its results. Nothing here changes a GPU or PCI
setting: every fact is read.

Every step that touches a GPU waits with a deadline, so a stuck copy or collective becomes this probe's verdict,
with the cause the facts point to (ACS redirect on a bridge of the path, a translating IOMMU) in its note.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inenv.kit import _device, _dist, _errors, _iommu, _nccl, _pci
from inenv.kit._p2p import (
    NVLINK_GBS,
    Gpu,
    LinkView,
    PathView,
    facts_verdict,
    gen_speed,
    link_problem,
    link_view,
    nvml_pair,
    nvml_session,
    nvml_view,
    pair_path,
    read_gpu,
    replay_counts,
    two_models,
)
from inenv.kit._pci import Fact, spelled
from inenv.probe import (
    LANE_GPUS_ENV,
    LEVEL_ENV,
    QUICK,
    HostView,
    ProbeSpec,
    RankContext,
    Variant,
    gpu_shortfall,
    outcome,
    visible_index,
)
from inenv.probes.p2pnccl import (
    CONTROL,
    CONTROL_MARKER,
    NCCL_DEADLINE_S,
    P2P_SETTINGS,
    failed,
    first_allreduces,
    p2p_control,
    p2p_env,
    what_failed,
)

SPEC = ProbeSpec(
    id="host-p2p",
    title="Host peer-to-peer health",
    feature="Can the GPUs of this host talk to each other directly (PCIe links, ACS, IOMMU, peer copies, NCCL's "
    "first allreduce with and without P2P), how fast, and if not, why and what fixes it?",
    ranks=(1, 2),  # the facts on one rank; a pair on two, one GPU each
    min_ranks_by_param=(("check", "copy", 2), ("check", "nccl", 2)),
    distinct_gpus=True,  # a pair is two GPUs; NCCL refuses two ranks on one
    needs_gpu=True,
    gpu_optional=(("check", "facts"),),  # the host facts are read on a host without a GPU too
    # the facts time nothing (the links' trained speed is read under load, and other variants' load only helps),
    # so they run beside the variants sharing the GPU instead of waiting for it alone
    untimed_params=(("check", "facts"),),
    timeout_s=330.0,  # a failed first allreduce (90 s) and its control in fresh processes (importing torch, 60 s)
    reusable=False,  # ACS bits, the IOMMU mode and link training change with the host, not the stack
    preload=_dist.PRELOAD_DIST,
)

COPY_DEADLINE_S = 20.0  # one copy or one timed batch of copies
LOAD_DEADLINE_S = 10.0
COPY_WORDS = 16 << 20  # int32: 64 MiB
SMALL_WORDS = 1024  # 4 KiB
STRIDED_WORDS = 4 << 20  # every other word of 16 MiB, written by a kernel
BW_BYTES = 256 << 20
BW_REPS = 8
BW_REPS_QUICK = 3
LATENCY_REPS = 200
LOAD_BYTES = 64 << 20
LOAD_REPS = 32  # host-to-device copies queued while the link speed is read: 2 GiB
FILL = -559038737  # 0xDEADBEEF as int32: the pattern (0 .. 2**31-2) never holds it


# --------------------------------------------------------------------------------------------------
# What the facts say caused a peer-to-peer failure between a pair (pure)


def cause_words(code: str, cause: str) -> str:
    """How a note names the facts: as the likely cause when they point at one, else as what was seen."""
    return f"likely cause: {cause}" if code else f"the facts name no cause ({cause})"


def likely_cause(p: PathView) -> tuple[str, str]:
    """(reason code, note) for a peer-to-peer failure between the pair, from the facts (pure): ACS redirect on
    a bridge of the path first, then a translating IOMMU; "" when the facts name no cause."""
    code = ""
    notes: list[str] = []
    if p.redirect:
        code = "p2p-acs-redirect"
        notes.append("ACS redirect on the path: " + "; ".join(
            f"{addr} ({kind}) {'+'.join(bits)}" for addr, kind, bits in p.redirect))
    mode = p.iommu.value if p.iommu.seen else None
    if mode in ("translated", "mixed"):
        code = code or "p2p-iommu-translated"
        notes.append(f"IOMMU {mode} ({p.iommu.source})")
    elif mode:
        notes.append(f"IOMMU {mode}")
    else:
        notes.append(f"IOMMU mode not visible ({p.iommu.not_visible})")
    if p.acs_hidden:
        notes.append("ACS not visible on " + "; ".join(f"{addr}: {why}" for addr, why in p.acs_hidden[:3]))
    refused = [f"{cap} {status}" for cap, status in p.p2p if cap in ("read", "write") and status != "ok"]
    if refused:
        notes.append("the driver reports P2P " + ", ".join(refused))
    if p.topology:
        notes.append(f"NVML topology {p.topology}, meeting at {p.meets_at}")
    return code, "; ".join(notes)


# --------------------------------------------------------------------------------------------------
# Planning


def pairs_for_copy(n: int, level: str) -> list[tuple[int, int]]:
    """Every pair, at any GPU count (a path between two GPUs beyond GPU 0 crosses bridges no pair with GPU 0 does);
    a quick run, and a host of fewer than two GPUs, plans pair 0-1 only."""
    if n < 2 or level == QUICK:
        return [(0, 1)]
    return [(a, b) for a in range(n) for b in range(a + 1, n)]


def pairs_for_nccl(n: int, level: str) -> list[tuple[int, int]]:
    """A bounded set: pair 0-1; on more than two GPUs, 0 and the last GPU (on PCIe hosts the pair farthest
    apart); on more than four, also the pair across the middle (n/2-1 and n/2: one GPU on each socket of a
    two-socket host) and the last two GPUs. At most four pairs, each run with every P2P setting."""
    if n <= 2 or level == QUICK:
        return [(0, 1)]
    if n <= 4:
        return [(0, 1), (0, n - 1)]
    return list(dict.fromkeys([(0, 1), (0, n - 1), (n // 2 - 1, n // 2), (n - 2, n - 1)]))


def variants(host: HostView) -> list[Variant]:
    short = gpu_shortfall(host, 2, "a pair of GPUs")
    out = [Variant(SPEC.id, 1, (("check", "facts"),))]
    out += [Variant(SPEC.id, 2, (("check", "copy"), ("pair", f"{a}-{b}")), skip=short)
            for a, b in pairs_for_copy(host.gpu_count, host.level)]
    out += [Variant(SPEC.id, 2, (("check", "nccl"), ("pair", f"{a}-{b}"), ("p2p", setting)), skip=short)
            for a, b in pairs_for_nccl(host.gpu_count, host.level) for setting in P2P_SETTINGS]
    return out


def parse_pair(text: str | None) -> tuple[int, int]:
    a, _, b = (text or "0-1").partition("-")
    return int(a), int(b)


def quick() -> bool:
    return os.environ.get(LEVEL_ENV) == QUICK





def cuda_address(torch: Any, index: int) -> str | None:
    p = torch.cuda.get_device_properties(index)
    try:
        return f"{int(p.pci_domain_id):04x}:{int(p.pci_bus_id):02x}:{int(p.pci_device_id):02x}.0"
    except (AttributeError, TypeError, ValueError):
        return None


def cuda_name(torch: Any, index: int) -> str | None:
    try:
        return str(torch.cuda.get_device_name(index))
    except Exception:  # the name is a fact among others: its absence is not this probe's failure
        return None


def gpus_seen(torch: Any, nvml: dict[str, Any], sysfs: Fact) -> list[Gpu]:
    """The GPUs by the index this process's CUDA gives them (the index a pair names), else NVML's, else the
    order of their addresses in sysfs."""
    if torch is not None:
        return [Gpu(i, cuda_address(torch, i), "CUDA", name=cuda_name(torch, i))
                for i in range(torch.cuda.device_count())]
    if nvml.get("gpus"):
        return [Gpu(g["index"], g["address"], "NVML") for g in nvml["gpus"]]
    if sysfs.seen and sysfs.value:
        return [Gpu(i, a, "sysfs address order") for i, a in enumerate(sysfs.value)]
    return []


def gpu_devices_present(host: _pci.Host) -> bool:
    return host.at("dev", "nvidiactl").exists() or host.at("dev", "nvidia0").exists()


def torch_with_gpu(host: _pci.Host, sysfs: Fact) -> tuple[Any, str]:
    """torch when it is installed and sees a GPU; else None and why. torch is not imported where neither a
    device node nor sysfs shows an NVIDIA GPU (its import alone takes seconds)."""
    if importlib.util.find_spec("torch") is None:
        return None, "torch is not installed in this environment"
    if not gpu_devices_present(host) and not (sysfs.seen and sysfs.value):
        return None, "no NVIDIA device node (/dev/nvidiactl) and no NVIDIA GPU in sysfs"
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None, "torch sees no CUDA device"
    return torch, ""


def read_under_load(torch: Any, g: Gpu, host: _pci.Host, nv: Any) -> Fact:
    """The GPU's link speed read while host-to-device copies keep it busy (an idle GPU lowers its speed)."""
    def now() -> tuple[float | None, str]:
        if g.port is not None and g.chain is not None and g.chain.device_dir is not None:
            f = _pci.read_link(host, g.chain.device_dir).speed
            if f.seen:
                return f.value, f.source
        if nv is not None and g.address:
            with contextlib.suppress(Exception):
                handle = nv.nvmlDeviceGetHandleByPciBusId(g.address.encode())
                return gen_speed(nv.nvmlDeviceGetCurrPcieLinkGeneration(handle)), "nvmlDeviceGetCurrPcieLinkGeneration"
        return None, ""

    try:
        src = torch.empty(LOAD_BYTES, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(LOAD_BYTES, dtype=torch.uint8, device=f"cuda:{g.index}")
        stream = torch.cuda.Stream(device=g.index)
        with torch.cuda.stream(stream):
            for _ in range(LOAD_REPS):
                dst.copy_(src, non_blocking=True)
        readings = []
        for _ in range(3):
            time.sleep(0.005)
            readings.append(now())
        settle(torch, [stream], LOAD_DEADLINE_S, "host-to-device copies")
    except Exception as exc:
        return _pci.hidden("", f"copies to read the link under load failed: {_errors.last_line(str(exc))}")
    speeds = [s for s, _ in readings if s]
    if not speeds:
        return _pci.hidden(next((w for _, w in readings if w), ""), "no link speed readable under load")
    return Fact(max(speeds), f"{next(w for s, w in readings if s)} during {LOAD_REPS} x {LOAD_BYTES >> 20} MiB "
                             "host-to-device copies")


def peer_matrix(torch: Any, n: int) -> list[list[bool]]:
    return [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]


# --------------------------------------------------------------------------------------------------
# check=facts




def run_facts(ctx: RankContext) -> dict[str, Any]:
    return facts_outcome(_pci.Host())


def facts_outcome(host: _pci.Host, sysfs: Fact | None = None) -> dict[str, Any]:
    """The facts variant's outcome (``sysfs``: the NVIDIA GPUs sysfs shows, when already read)."""
    torch, why_torch = torch_with_gpu(host, sysfs if sysfs is not None else _pci.nvidia_gpus(host))
    with nvml_session() as (nv, why_nvml):
        return host_facts(host, torch, why_torch, nv, why_nvml)


def preflight(variant: Variant, host: _pci.Host | None = None) -> dict[str, Any] | None:
    """The facts variant on a host where neither a device node nor sysfs shows an NVIDIA GPU, read in the worker
    before any rank starts: nothing there needs torch (:func:`torch_with_gpu` would not import it), and a rank
    process imports torch.distributed before its probe starts (seconds per cell, on every run: the facts are
    never carried forward). Every other variant launches its ranks."""
    if variant.param("check", "facts") != "facts":
        return None
    host = host or _pci.Host()
    sysfs = _pci.nvidia_gpus(host)
    if gpu_devices_present(host) or (sysfs.seen and sysfs.value):
        return None
    return facts_outcome(host, sysfs)


def host_facts(host: _pci.Host, torch: Any, why_torch: str, nv: Any, why_nvml: str) -> dict[str, Any]:
    """The facts variant's outcome: everything read under ``host``, with NVML ``nv`` (None: ``why_nvml``) and
    torch (None: ``why_torch``; then nothing is read under load and no peer access)."""
    admin = _pci.sys_admin(host)
    vm = _pci.virtual_machine(host)
    unread: list[str] = []
    sysfs = _pci.nvidia_gpus(host, unread)
    nvml = nvml_view(nv, why_nvml)
    gpus = gpus_seen(torch, nvml, sysfs)
    by_address = {g["address"]: g for g in nvml.get("gpus") or []}
    for g in gpus:
        g.nvml = by_address.get(g.address, {})
        read_gpu(host, g, admin.value if admin.seen else None)
        if torch is not None:
            g.loaded = read_under_load(torch, g, host, nv)
    types = [g.port.iommu_type for g in gpus if g.port is not None]
    iommu, iommu_json = _iommu.read_iommu(host, types)
    paths = {f"{a.index}-{b.index}": pair_path(a, b, iommu, nvml, vm)
             for x, a in enumerate(gpus) for b in gpus[x + 1:]}
    links = [p for p in (link_problem(link_view(g)) for g in gpus) if p]
    hidden_host = []
    if not host.pci.is_dir():
        hidden_host.append(f"{host.shown(host.pci)}: no PCI tree here (a container or VM without the host's sysfs)")
    evidence: dict[str, Any] = {
        "host": {"virtual_machine": vm.to_json(), "cap_sys_admin": admin.to_json(),
                 "nvidia_in_sysfs": sysfs.to_json()},
        "gpus": [g.to_json() for g in gpus],
        "iommu": iommu_json,
        "nvml": nvml,
        "paths": {k: dataclasses.asdict(p) | {"iommu": p.iommu.to_json()} for k, p in paths.items()},
    }
    if torch is not None:
        evidence["peer_access"] = peer_matrix(torch, len(gpus))
    else:
        evidence["torch"] = why_torch
    why = "; ".join(w for w in (why_torch, nvml.get("not_visible", ""),
                                "" if sysfs.seen else f"sysfs: {sysfs.not_visible}") if w)
    if vm.seen and vm.value:
        hidden_host.append("inside a VM: the IOMMU and bridges read here are the guest's, not the host's")
    seen = {g.address for g in gpus}
    lost = [f"sysfs {u}: not counted as a GPU" for u in unread if u.split(": ", 1)[0] not in seen]
    if lost:
        evidence["host"]["nvidia_unread"] = lost
    return facts_verdict(gpus, paths, iommu, links, why, hidden_host, evidence, lost)


# --------------------------------------------------------------------------------------------------
# Device work with deadlines on several GPUs


def settle(torch: Any, streams: list[Any], deadline_s: float, what: str) -> None:
    """Until the work queued on ``streams`` (of any GPUs) is done; :class:`_device.Hung` after the deadline."""
    events = []
    for s in streams:
        done = torch.cuda.Event()
        done.record(s)
        events.append(done)
    end = time.monotonic() + deadline_s
    while not all(e.query() for e in events):
        if time.monotonic() > end:
            raise _device.Hung(f"{_device.HUNG_WORDS} {deadline_s:.0f} s ({what})")
        time.sleep(0.0005)


def copy_kind(numel: int, mismatches: int, untouched: int, zeros: int) -> dict[str, Any]:
    """What a copy into a FILL-filled destination did (pure): ``exact``, ``no-op`` (every word still holds
    the fill: nothing arrived), ``zero``, or ``wrong``."""
    if mismatches == 0:
        return {"verdict": "exact"}
    if untouched == numel:
        return {"verdict": "no-op", "detail": "the destination still holds its fill: nothing arrived"}
    if zeros == numel:
        return {"verdict": "zero", "detail": "the destination is all zero"}
    return {"verdict": "wrong", "detail": f"{mismatches}/{numel} words differ ({untouched} still hold the fill)"}


def _words(torch: Any, n: int, seed: int, device: Any) -> Any:
    i = torch.arange(n, dtype=torch.int64, device=device)
    return ((i * 2654435761 + seed * 40503) % 2147483647).to(torch.int32)


def copy_once(torch: Any, src: int, dst: int, n: int, strided: bool, seed: int, what: str = "") -> dict[str, Any]:
    """One copy of ``n`` pattern words from device ``src`` to device ``dst``, checked exactly on ``dst``
    (``what``: the copy as a hang names it)."""
    data = _words(torch, n, seed, f"cuda:{src}")
    out = torch.full((n,), FILL, dtype=torch.int32, device=f"cuda:{dst}")
    want = _words(torch, n, seed, f"cuda:{dst}")
    if strided:
        want[1::2] = FILL
    settle(torch, [torch.cuda.current_stream(src), torch.cuda.current_stream(dst)], COPY_DEADLINE_S, "setup")
    t0 = time.perf_counter()
    if strided:
        out[::2].copy_(data[::2])
    else:
        out.copy_(data)
    settle(torch, [torch.cuda.current_stream(src), torch.cuda.current_stream(dst)], COPY_DEADLINE_S,
           what or f"copy GPU {src} -> GPU {dst}")
    took = time.perf_counter() - t0
    if torch.equal(out, want):
        return {"verdict": "exact", "s": round(took, 6)}
    return copy_kind(n, int((out != want).sum()), int((out == FILL).sum()), int((out == 0).sum()))


COPIES = (("copy-engine", COPY_WORDS, False), ("small", SMALL_WORDS, False), ("kernel-strided", STRIDED_WORDS, True))


def copy_checks(torch: Any, a: int, b: int, names: tuple[int, int] | None = None) -> dict[str, dict[str, Any]]:
    """Every kind of copy in both directions between devices ``a`` and ``b`` (named as the host's GPUs
    ``names``, default themselves), each checked exactly; a copy that hangs ends the checks (the GPUs' queues
    are stuck behind it)."""
    checks: dict[str, dict[str, Any]] = {}
    name = dict(zip((a, b), names or (a, b), strict=True))
    for src, dst in ((a, b), (b, a)):
        for seed, (kind, n, strided) in enumerate(COPIES, 1):
            key = f"{name[src]}->{name[dst]} {kind}"
            try:
                checks[key] = copy_once(torch, src, dst, n, strided, seed,
                                        f"copy GPU {name[src]} -> GPU {name[dst]}")
            except _device.Hung as exc:
                checks[key] = {"verdict": "hang", "detail": str(exc)}
                return checks
            except Exception as exc:
                checks[key] = {"verdict": "error", "detail": _errors.last_line(_errors.error_tail(exc))}
    return checks


def bandwidth_gbs(torch: Any, a: int, b: int, both: bool, reps: int, during: Callable[[], None] | None = None
                  ) -> float:
    """GB/s of ``reps`` copies of BW_BYTES from GPU ``a`` to ``b`` (and ``b`` to ``a`` at once when ``both``),
    each direction on streams of its own, timed on the host from the first enqueue to the last completion.
    ``during`` is called while four untimed copies run, before the timed ones."""
    xa = torch.empty(BW_BYTES, dtype=torch.uint8, device=f"cuda:{a}")
    ya = torch.empty(BW_BYTES, dtype=torch.uint8, device=f"cuda:{b}")
    xb = torch.empty(BW_BYTES, dtype=torch.uint8, device=f"cuda:{b}")
    yb = torch.empty(BW_BYTES, dtype=torch.uint8, device=f"cuda:{a}")
    # Each direction: a stream on its source and one on its destination, so the two directions never wait on
    # each other's streams (torch orders a cross-device copy with the current stream of both devices).
    lanes = [(torch.cuda.Stream(device=a), torch.cuda.Stream(device=b), ya, xa)]
    if both:
        lanes.append((torch.cuda.Stream(device=b), torch.cuda.Stream(device=a), yb, xb))
    streams = [s for lane in lanes for s in lane[:2]]

    def enqueue(count: int) -> None:
        for _ in range(count):
            for out_s, in_s, dst, src in lanes:
                with torch.cuda.stream(out_s), torch.cuda.stream(in_s):
                    dst.copy_(src, non_blocking=True)

    enqueue(1)
    settle(torch, streams, COPY_DEADLINE_S, "warm-up copy")
    if during is not None:  # untimed: what it reads while the link is busy costs the timed copies nothing
        enqueue(4)
        during()
        settle(torch, streams, COPY_DEADLINE_S, "copies read under load")
    t0 = time.perf_counter()
    enqueue(reps)
    settle(torch, streams, COPY_DEADLINE_S * max(1, reps // 4), f"{reps} timed copies")
    took = time.perf_counter() - t0
    return reps * BW_BYTES * len(lanes) / took / 1e9


def latency_us(torch: Any, a: int, b: int, reps: int) -> float:
    """Microseconds per 4 KiB torch copy from GPU ``a`` to ``b``, back to back (CUDA events on ``a``)."""
    src = torch.zeros(SMALL_WORDS, dtype=torch.int32, device=f"cuda:{a}")
    dst = torch.empty(SMALL_WORDS, dtype=torch.int32, device=f"cuda:{b}")
    dst.copy_(src)
    settle(torch, [torch.cuda.current_stream(a), torch.cuda.current_stream(b)], COPY_DEADLINE_S, "warm-up copy")
    with torch.cuda.device(a):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        end.record()
    settle(torch, [torch.cuda.current_stream(a), torch.cuda.current_stream(b)], COPY_DEADLINE_S, "small copies")
    return start.elapsed_time(end) * 1000.0 / reps


def pair_rate(views: tuple[LinkView, LinkView], path: PathView, links: int, version: int | None
              ) -> tuple[float | None, str]:
    """The pair's theoretical rate per direction (GB/s) and what it is: NVLink's links, else the slower of the
    two GPUs' PCIe links (pure)."""
    if path.nvlink and links and version in NVLINK_GBS:
        return links * NVLINK_GBS[version], f"{links} NVLink{version} link(s) x {NVLINK_GBS[version]:g} GB/s"
    rated = [(v.rate_gbs(), v) for v in views if v.rate_gbs()]
    if not rated:
        return None, "no link rate readable"
    rate, v = min(rated, key=lambda r: r[0] or 0.0)
    return rate, f"PCIe {spelled(v.attainable, v.width or v.max_width)} of {v.label}, the slower link"


def rise_words(rise: dict[str, int]) -> str:
    """How a note names the error counters that rose during the copies ("" when none did)."""
    if not rise:
        return ""
    shown = ", ".join(f"{k} +{v}" for k, v in sorted(rise.items())[:6])
    more = f" and {len(rise) - 6} more" if len(rise) > 6 else ""
    return f"PCIe error counters rose during the copies ({shown}{more})"


def copy_verdict(path: PathView, peer: dict[str, bool], checks: dict[str, dict[str, Any]],
                 metrics: dict[str, Any], evidence: dict[str, Any], rise: dict[str, int] | None = None,
                 models: str = "") -> dict[str, Any]:
    """The copy variant's outcome (pure over what was measured). ``rise``: the error counters that grew while the
    copies ran (``_pci.counter_rise``); ``models``: the pair named as two GPU models (``_p2p.two_models``)."""
    code, cause = likely_cause(path)
    a, b = path.labels
    rose = rise_words(rise or {})
    metrics = {**metrics, "pcie_errors": sum((rise or {}).values())}
    lead = f"{models}: " if models else ""
    tail = f"; {rose}" if rose else ""
    hung = {k: c for k, c in checks.items() if c.get("verdict") == "hang"}
    bad = {k: c for k, c in checks.items() if c.get("verdict") not in ("exact", "hang")}
    if hung:
        what = ", ".join(sorted(hung))
        detail = next(iter(hung.values())).get("detail", "")
        return outcome("fail", f"{lead}peer copy did not finish ({what}: {detail}); {cause_words(code, cause)}{tail}",
                       code or "p2p-copy-hung", metrics, evidence)
    wrong = {k: c for k, c in bad.items() if c.get("verdict") != "error"}
    if wrong:
        first = next(iter(wrong.values()))
        what = ", ".join(f"{k}: {c['verdict']}" for k, c in sorted(wrong.items()))
        return outcome("fail", f"{lead}peer copies arrived wrong ({what}; {first.get('detail', '')}); "
                       f"{cause_words(code, cause)}{tail}", code or "p2p-copy-wrong", metrics, evidence)
    if bad:
        k, first = next(iter(sorted(bad.items())))
        return outcome("fail", f"{lead}peer copy {k} raised: {first.get('detail', '')}; {cause}{tail}",
                       "p2p-copy-failed", metrics, evidence)
    rate = metrics.get("unidir_of_link")
    uni = metrics.get("unidir_gbs") or {}
    speed = (f"{max(uni.values()):.1f} GB/s one way" + (f", {rate:.0%} of {metrics['link_basis']}" if rate else "")
             if uni else "bandwidth not measured: " + str(evidence.get("timing_error", "")))
    if not all(peer.values()):
        refused = ", ".join(k for k, ok in peer.items() if not ok)
        return outcome("partial", f"{lead}CUDA reports no peer access ({refused}): copies between {a} and {b} are "
                                  f"exact but staged through host memory ({speed}); {cause}{tail}", "p2p-unavailable",
                       metrics, evidence)
    if rose:
        return outcome("partial", f"{lead}peer access both ways, copies exact, {speed}; but {rose}: the link "
                                  "retransmits or drops packets the driver does not report",
                       "pcie-errors-under-traffic", metrics, evidence)
    return outcome("pass", f"{lead}peer access both ways, copies exact, {speed}", metrics=metrics, evidence=evidence)


@dataclasses.dataclass(frozen=True)
class PairFacts:
    """The facts of one pair, read in a pair variant: the path view, both links, evidence, NVLink links and
    version, and the two GPUs as read."""

    path: PathView
    views: tuple[LinkView, LinkView]
    evidence: dict[str, Any]
    nvlinks: int
    version: int | None
    gpus: tuple[Gpu, Gpu]

    @property
    def models(self) -> str:
        return two_models(*self.gpus)


def read_counters(host: _pci.Host, gpus: Sequence[Gpu], nv: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The error counters the driver does not report, read without changing anything: AER of each GPU and each
    bridge on its chain (by address, ``kind -> name -> count``) and each GPU's PCIe replay counter (NVML, as
    ``"<address> (NVML)" -> {"replay": {"count": n}}``); and, by what, why a counter is not visible."""
    counts: dict[str, Any] = {}
    unseen: dict[str, str] = {}
    for g in gpus:
        if g.chain is None or g.chain.device_dir is None or not g.address:
            unseen[g.label] = g.unread or (g.chain.fact.not_visible if g.chain is not None else "no PCI address")
            continue
        for addr, folder in ((g.address, g.chain.device_dir), *g.chain.bridges):
            if addr in counts or addr in unseen:
                continue
            fact = _pci.read_aer(host, folder)
            if fact.seen:
                counts[addr] = fact.value
            else:
                unseen[addr] = fact.not_visible
    for addr, value in replay_counts(nv, [g.address for g in gpus if g.address]).items():
        if isinstance(value, int):
            counts[f"{addr} (NVML)"] = {"replay": {"count": value}}
        else:
            unseen[f"{addr} replay counter (NVML)"] = str(value.get("not_visible", ""))
    if nv is None:
        unseen["replay counters (NVML)"] = "NVML is not available here"
    return counts, unseen


def pair_facts(torch: Any, a: int, b: int, devices: tuple[int, int] | None = None) -> PairFacts:
    """The facts of one pair of the host's GPUs ``a`` and ``b`` (this process's CUDA devices ``devices``,
    default the same indices), read in a pair variant."""
    host = _pci.Host()
    admin = _pci.sys_admin(host)
    vm = _pci.virtual_machine(host)
    gpus = [Gpu(i, cuda_address(torch, d), "CUDA", name=cuda_name(torch, d))
            for i, d in zip((a, b), devices or (a, b), strict=True)]
    with nvml_session() as (nv, why):
        nvml = nvml_view(nv, why, only=[g.address for g in gpus if g.address])
    by_address = {g["address"]: g for g in nvml.get("gpus") or []}
    for g in gpus:
        g.nvml = by_address.get(g.address, {})
        read_gpu(host, g, admin.value if admin.seen else None)
    iommu, iommu_json = _iommu.read_iommu(host, [g.port.iommu_type for g in gpus if g.port is not None])
    path = pair_path(gpus[0], gpus[1], iommu, nvml, vm)
    entry = nvml_pair(nvml, gpus[0].address, gpus[1].address) or {}
    versions = [lk.get("version") for lk in (gpus[0].nvml.get("nvlink") or {}).get("active", [])]
    version = next((v for v in versions if isinstance(v, int)), None)
    evidence = {"gpus": [g.to_json() for g in gpus], "iommu": iommu_json, "nvml_pair": entry,
                "path": dataclasses.asdict(path) | {"iommu": iommu.to_json()},
                "host": {"virtual_machine": vm.to_json(), "cap_sys_admin": admin.to_json()}}
    if models := two_models(gpus[0], gpus[1]):
        evidence["models"] = models
    return PairFacts(path, (link_view(gpus[0]), link_view(gpus[1])), evidence, int(entry.get("nvlinks") or 0),
                     version, (gpus[0], gpus[1]))


def pair_devices(pair: tuple[int, int], count: int) -> tuple[tuple[int, int] | None, str]:
    """This process's CUDA devices for the host's GPUs ``pair`` (:func:`inenv.probe.visible_index`), of the
    ``count`` it sees; else None and why."""
    got = [visible_index(g) for g in pair]
    missing = [g for g, d in zip(pair, got, strict=True) if d is None or d >= count]
    if missing:
        lane = os.environ.get(LANE_GPUS_ENV)
        return None, (f"pair {pair[0]}-{pair[1]} needs GPU {missing[-1]}; {count} visible"
                      + (f" (the host's GPUs {lane})" if lane else ""))
    return (int(got[0] or 0), int(got[1] or 0)), ""


def pair_precheck(ctx: RankContext) -> tuple[Any, tuple[int, int], tuple[int, int], dict[str, Any] | None]:
    """torch, the pair (the host's GPU indices), this process's CUDA devices for them, and a skip outcome when
    this environment cannot run it."""
    if importlib.util.find_spec("torch") is None:
        return None, (0, 1), (0, 1), outcome("skip", "torch is not installed in this environment", "missing-package")
    import torch

    pair = parse_pair(ctx.param("pair"))
    if not torch.cuda.is_available():
        return torch, pair, pair, outcome("skip", "no CUDA device in this rank", "no-gpu")
    devices, why = pair_devices(pair, torch.cuda.device_count())
    if devices is None:
        return torch, pair, pair, outcome("skip", why, "too-few-gpus")
    return torch, pair, devices, None


def run_copy(ctx: RankContext) -> dict[str, Any]:
    if ctx.rank != 0:
        return outcome("pass", "holds the pair's second GPU while rank 0 drives both", evidence={"role": "holder"})
    torch, (a, b), (da, db), skipped = pair_precheck(ctx)
    if skipped is not None:
        return skipped
    facts = pair_facts(torch, a, b, (da, db))
    path, views, evidence, nvlinks, version = facts.path, facts.views, facts.evidence, facts.nvlinks, facts.version
    if (da, db) != (a, b):
        evidence["cuda_devices"] = {str(a): da, str(b): db}
    peer = {f"{a}->{b}": bool(torch.cuda.can_device_access_peer(da, db)),
            f"{b}->{a}": bool(torch.cuda.can_device_access_peer(db, da))}
    with nvml_session() as (nv, _):
        before, unseen = read_counters(_pci.Host(), facts.gpus, nv)
    checks = copy_checks(torch, da, db, (a, b))
    rate, basis = pair_rate(views, path, nvlinks, version)
    metrics: dict[str, Any] = {"link_gbs": round(rate, 2) if rate else None, "link_basis": basis}
    evidence.update({"peer_access": peer, "copies": checks})
    if all(c["verdict"] == "exact" for c in checks.values()):
        reps = BW_REPS_QUICK if quick() else BW_REPS
        loaded: dict[str, Any] = {}
        host = _pci.Host()

        def read_links() -> None:
            time.sleep(0.005)
            for g in evidence["gpus"]:
                chain = _pci.chain_of(host, g["address"]) if g.get("address") else None
                if chain is not None and chain.device_dir is not None:
                    loaded[g["address"]] = _pci.read_link(host, chain.device_dir).speed.to_json()

        try:
            uni = {f"{a}->{b}": bandwidth_gbs(torch, da, db, False, reps, read_links),
                   f"{b}->{a}": bandwidth_gbs(torch, db, da, False, reps)}
            metrics["unidir_gbs"] = {k: round(v, 2) for k, v in uni.items()}
            metrics["bidir_gbs"] = round(bandwidth_gbs(torch, da, db, True, reps), 2)
            metrics["copy_latency_us"] = round(latency_us(torch, da, db, LATENCY_REPS), 2)
        except _device.Hung as exc:
            checks["bandwidth"] = {"verdict": "hang", "detail": str(exc)}
        except Exception as exc:
            evidence["timing_error"] = _errors.last_line(_errors.error_tail(exc))
        evidence["link_under_load"] = loaded
        if rate and metrics.get("unidir_gbs"):
            metrics["unidir_of_link"] = round(max(metrics["unidir_gbs"].values()) / rate, 3)
            metrics["bidir_of_link"] = round(metrics.get("bidir_gbs", 0.0) / (2 * rate), 3)
        if metrics.get("unidir_gbs"):
            metrics["headline"] = (f"{max(metrics['unidir_gbs'].values()):.1f} GB/s"
                                   + (f" ({metrics['unidir_of_link']:.0%} of link)" if rate else ""))
    with nvml_session() as (nv, _):
        after, _ = read_counters(_pci.Host(), facts.gpus, nv)
    rise = _pci.counter_rise(before, after)
    evidence["error_counters"] = {"before": before, "after": after, "rose": rise, "not_visible": unseen}
    return copy_verdict(path, peer, checks, metrics, evidence, rise, facts.models)



def nccl_verdict(setting: str, box: dict[str, Any], path: PathView, metrics: dict[str, Any],
                 evidence: dict[str, Any], control: dict[str, Any] | None = None, models: str = "") -> dict[str, Any]:
    """One NCCL setting's outcome (pure over its result): without peer-to-peer a failure is NCCL's own; with it,
    the note names the cause the facts point to, and the control (``control``: the same allreduces with
    ``NCCL_P2P_DISABLE=1`` in fresh processes, run where the defaults failed) says whether peer-to-peer is what
    fails: when it fails too, the host is broken below NCCL's choice of transport and P2P is not judged
    (``p2p-control-failed``). ``models``: the pair named as two GPU models."""
    env = {"default": "NCCL's defaults", "disabled": "NCCL_P2P_DISABLE=1", "level-loc": "NCCL_P2P_LEVEL=LOC"}[setting]
    transports = ", ".join(evidence.get("transports") or []) or "none logged"
    lead = f"{models}: " if models else ""
    if not failed(box):
        return outcome("pass", f"{lead}first allreduces exact with {env} (transports: {transports})", metrics=metrics,
                       evidence=evidence)
    what, fallback = what_failed(box)
    if setting == "default":
        code, cause = likely_cause(path)
        note = f"{lead}with {env}: {what}; transports: {transports}"
        if control is None:
            note += (f"; {cause_words(code, cause)}; the p2p=disabled variant of this pair runs the same allreduces "
                     "without peer-to-peer")
            return outcome("fail", note, code or fallback, metrics, evidence)
        if control.get("not_run"):
            note += (f"; {cause_words(code, cause)}; the control with NCCL_P2P_DISABLE=1 did not run "
                     f"({control['not_run']})")
            return outcome("fail", note, code or fallback, metrics, evidence)
        if failed(control):
            said, _ = what_failed(control)
            shm = ", ".join(control.get("transports") or []) or "none logged"
            note += (f"; the control fails too: with NCCL_P2P_DISABLE=1 {said} (transports: {shm}): the host (its "
                     "driver, GPUs or NCCL's set-up), not peer-to-peer, is what fails, and peer-to-peer is not judged "
                     f"by this variant; {cause_words(code, cause)}")
            return outcome("fail", note, "p2p-control-failed", metrics, evidence)
        note += (f"; the control passes: with NCCL_P2P_DISABLE=1 the same allreduces are exact, so peer-to-peer is "
                 f"what fails; {cause_words(code, cause)}")
        return outcome("fail", note, code or fallback, metrics, evidence)
    note = f"{lead}with {env}: {what}; transports: {transports}; without peer-to-peer this is NCCL's own failure"
    return outcome("fail", note, fallback, metrics, evidence)


def control_main(argv: Sequence[str]) -> int:
    """The control process: the first allreduces of the rank its spec names, with this process's environment
    (NCCL_P2P_DISABLE=1), one result line on stdout. It leaves without waiting for a stuck NCCL thread."""
    spec = json.loads(argv[0])
    ctx = RankContext(int(spec["rank"]), int(spec["world"]), int(spec["local_rank"]), spec["device"],
                      Variant(SPEC.id, int(spec["world"]), (("check", "nccl"), ("p2p", CONTROL))),
                      Path(spec["workdir"]), str(spec["master_addr"]), int(spec["port"]))
    box = first_allreduces(ctx, spec["device"], float(spec["deadline_s"]), str(spec["backend"]))
    box["pid"] = os.getpid()
    box["env"] = {k: os.environ.get(k, "(unset)") for k in P2P_SETTINGS[CONTROL]}
    sys.stdout.write(CONTROL_MARKER + json.dumps(box, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)


def run_nccl(ctx: RankContext) -> dict[str, Any]:
    setting = ctx.param("p2p", "default") or "default"
    if setting not in P2P_SETTINGS:
        return outcome("fail", f"unknown p2p setting {setting!r}; known: {', '.join(P2P_SETTINGS)}", "probe-bug")
    set_, unset = p2p_env(setting)
    removed = {k: os.environ.pop(k) for k in unset if k in os.environ}
    os.environ.update(set_)
    os.environ.update(_nccl.nccl_debug_env(ctx.workdir))
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    multicast = _dist.keep_multicast_off()
    torch, pair, devices, skipped = pair_precheck(ctx)
    if skipped is not None:
        return skipped
    facts = pair_facts(torch, *pair, devices)
    store = _dist.rendezvous_store(ctx) if setting == "default" else None
    box = first_allreduces(ctx, devices[ctx.rank], NCCL_DEADLINE_S)
    checked = p2p_control(ctx, store, devices[ctx.rank], failed(box)) if store is not None else None
    log = _nccl.read_nccl_logs(ctx.workdir, os.getpid())
    metrics = {k: box[k] for k in ("init_s", "first_allreduce_s") if k in box}
    evidence = {"nccl_env": {**set_, **{k: "(unset)" for k in unset}}, "removed_from_env": removed,
                "multicast_env": multicast, "transports": log["transports"], "nccl_version": log["nccl_version"],
                "nccl_warnings": log["warnings"], "result": box, "facts": facts.evidence}
    if checked is not None:
        evidence["control"] = checked
    return nccl_verdict(setting, box, facts.path, metrics, evidence, checked, facts.models)


def run(ctx: RankContext) -> dict[str, Any]:
    check = ctx.param("check", "facts")
    if check == "facts":
        return run_facts(ctx)
    if check == "copy":
        return run_copy(ctx)
    if check == "nccl":
        return run_nccl(ctx)
    return outcome("fail", f"unknown check {check!r}; known: facts, copy, nccl", "probe-bug")


if __name__ == "__main__" and sys.argv[1:2] == ["--control"] and len(sys.argv) == 3:
    sys.exit(control_main(sys.argv[2:]))


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("headline", "text", "the variant's answer in a few words (IOMMU mode, bandwidth against the link)", "headline"),
    ("gpus", "count", "GPUs the facts variant found", None),
    ("degraded_links", "count", "GPUs whose PCIe link trained below the card's maximum", None),
    ("acs_redirect_bridges", "count", "bridges on a GPU pair's PCIe path with ACS redirect bits on", None),
    ("no_native_atomics", "record", "pairs NVML reports peer read/write for but no native P2P atomics, with its "
     "status", "no-atomics"),
    ("link_gbs", "GB/s", "the pair's theoretical rate per direction (NVLink links, else the slower PCIe link)", None),
    ("link_basis", "text", "what link_gbs is computed from", None),
    ("unidir_gbs", "GB/s by direction", "one-way peer copy bandwidth, 256 MiB copies", None),
    ("bidir_gbs", "GB/s", "both directions at once, bytes of both over the time", None),
    ("unidir_of_link", "fraction", "the faster direction's bandwidth over link_gbs", None),
    ("bidir_of_link", "fraction", "bidir_gbs over twice link_gbs", None),
    ("copy_latency_us", "µs", "one 4 KiB torch copy between the pair, back to back", None),
    ("pcie_errors", "count", "PCIe error counts that rose while a pair's copies ran (AER of each GPU and bridge on the "
     "paths, the GPUs' replay counters)", None),
    ("init_s", "s", "NCCL communicator creation", None),
    ("first_allreduce_s", "s", "the first allreduce, its connection set-up included", None),
)
EVIDENCE = (
    ("gpus", "record", "per GPU: address, link, NUMA node, IOMMU group, the bridges above it with ACS", None),
    ("iommu", "record", "the IOMMU's mode and every fact it was decided from", None),
    ("nvml", "record", "NVML's view: links, NVLink, topology and P2P status per pair", None),
    ("copies", "record", "per direction and kind, each peer copy's result against the exact pattern", None),
    ("error_counters", "record", "AER and replay counters of the pair's paths before and after the copies, what rose "
     "and what is not visible with why", None),
    ("control", "record", "check=nccl,p2p=default that failed: the same first allreduces with NCCL_P2P_DISABLE=1 in "
     "fresh processes", None),
)

