"""Facts about the host, collected once per run (host side; never changes any GPU setting).

GPUs, compute capability and memory come from ``nvidia-smi`` queries; SM counts, the peer-access
matrix, multicast support and the NCCL version come from the environment's own torch (through
``inenv.worker --inspect``) when a GPU exists.

``host_id`` tells machines apart without revealing them: ``<label>-<8 hex>``, the label a slug of the GPU
model and count (``h200x2``, ``cpu``), the hex a salted hash of stable machine facts (``/etc/machine-id``
and the GPUs' UUIDs); two machines of one model and one host name get different ids, and the facts hashed
are never recorded. Where no machine id exists (some containers), a random key kept under the user's state
folder stands in for it, so the id stays stable on that machine. ``host_label`` is the readable part beside
it (GPU model × count, interconnect).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from inenv import atomic
from inenv.probe import HostView

GPU_FIELDS = ("index", "name", "pci.bus_id", "compute_cap", "memory.total", "driver_version", "clocks.sm",
              "clocks.max.sm", "clocks.mem", "power.limit", "persistence_mode")
ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "FLASHINFER_", "NVSHMEM_", "SGLANG_", "NVIDIA_", "OMP_",
                "GLOO_", "TRITON_")
NOISE = ("NVIDIA_REQUIRE_",)  # container images' driver-branch lists: kilobytes, no information about the run
SECRET = re.compile(r"(SECRET|TOKEN|PASSW|PASSWD|PWD|KEY|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|CERT)", re.I)
# user:password@ (or user@) before a host, with or without a scheme: NCCL_COMM_ID='user:secret@host:port'
USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)?[^\s/@:'\"]+(?::[^\s/@'\"]*)?@(?=[^\s@]+)")
HOST_ID_SALT = b"stackprobe host id v2\0"  # per purpose: the same machine facts hashed elsewhere give other values
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")


def _run(cmd: list[str], timeout: float = 30) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def parse_gpu_csv(text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(GPU_FIELDS):
            continue
        row = dict(zip(GPU_FIELDS, cells, strict=True))
        gpus.append({
            "index": int(row["index"]),
            "name": row["name"],
            "pci_bus_id": row["pci.bus_id"],
            "compute_capability": row["compute_cap"],
            "memory_mib": _num(row["memory.total"]),
            "driver": row["driver_version"],
            "clocks_sm_mhz": _num(row["clocks.sm"]),
            "clocks_max_sm_mhz": _num(row["clocks.max.sm"]),
            "clocks_mem_mhz": _num(row["clocks.mem"]),
            "power_limit_w": _num(row["power.limit"]),
            "persistence_mode": row["persistence_mode"],
        })
    return gpus


def _num(text: str) -> float | int | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return int(v) if v.is_integer() else v


def parse_driver_cuda(text: str) -> str | None:
    """The CUDA version the driver supports, from the banner of plain `nvidia-smi`."""
    m = re.search(r"CUDA Version:\s*([\d.]+)", text)
    return m.group(1) if m else None


_NVLINK = re.compile(r"NV\d+")


def topology_links(topology: str | None, count: int) -> list[list[str]] | None:
    """The ``count`` x ``count`` link matrix of ``nvidia-smi topo -m`` (``X`` on the diagonal), or None when the
    text holds no row for every GPU."""
    rows: dict[int, list[str]] = {}
    for line in (topology or "").splitlines():
        m = re.match(r"\s*GPU(\d+)\s+(.*)", line)
        if m is None:
            continue
        cells = m.group(2).split()
        if len(cells) >= count:
            rows[int(m.group(1))] = cells[:count]
    if count < 1 or any(i not in rows for i in range(count)):
        return None
    return [rows[i] for i in range(count)]


def all_nvlink(topology: str | None, count: int) -> str | None:
    """GPU0-GPU1's link word (``NV18``) when `nvidia-smi topo -m` joins every pair of the ``count`` GPUs by
    NVLink; None for fewer than two GPUs, any pair on PCIe, or a matrix without a row for each GPU. The one
    reading of "every GPU pair NVLink": the page's interconnect word and the placement of timed variants."""
    links = topology_links(topology, count) if count >= 2 else None
    if links is None:
        return None
    if all(_NVLINK.fullmatch(links[a][b]) for a in range(count) for b in range(count) if a != b):
        return links[0][1]
    return None


def _groups(links: list[list[str]], count: int, joined: Callable[[str, str], bool]) -> tuple[tuple[int, ...], ...]:
    """The GPUs in the groups ``joined`` (a pair's link words, each way) connects, each group by its lowest GPU, a
    GPU joined to none a group of its own; () unless every pair inside a group is joined (A-B and B-C joined, A-C
    not: which links are shared is unknown)."""
    group = list(range(count))  # each GPU's group: the lowest GPU joined to it

    def root(g: int) -> int:
        while group[g] != g:
            g = group[g]
        return g

    for a in range(count):
        for b in range(a + 1, count):
            if joined(links[a][b], links[b][a]):
                group[max(root(a), root(b))] = min(root(a), root(b))
    members: dict[int, list[int]] = {}
    for g in range(count):
        members.setdefault(root(g), []).append(g)
    out = tuple(tuple(m) for _, m in sorted(members.items()))
    if any(not joined(links[a][b], links[b][a]) for m in out for a in m for b in m if a < b):
        return ()
    return out


def switch_groups(topology: str | None, count: int) -> tuple[tuple[int, ...], ...]:
    """The host's GPUs grouped by the PCIe switch they sit behind: GPUs whose every pair is ``PIX`` in `nvidia-smi
    topo -m` (a path through at most one PCIe bridge, so their traffic stays inside that switch) form one group,
    every other GPU a group of its own; () when the matrix lacks a row for each GPU, has fewer than two, or its
    ``PIX`` pairs do not form such groups (A-B and B-C joined, A-C not: which links are shared is unknown)."""
    links = topology_links(topology, count) if count >= 2 else None
    if links is None:
        return ()
    return _groups(links, count, lambda ab, ba: ab == "PIX" and ba == "PIX")


_SOCKET_LOCAL = frozenset({"PIX", "PXB", "PHB", "NODE"})  # PCIe paths that stay inside one CPU socket


def socket_groups(topology: str | None, count: int) -> tuple[tuple[int, ...], ...]:
    """The host's GPUs grouped by the CPU socket whose PCIe they hang off: every pair of a group a path that stays
    in one socket (``PIX``, ``PXB``, ``PHB`` or ``NODE`` in `nvidia-smi topo -m`), every pair of two groups
    ``SYS`` (across the link between sockets); () when the matrix lacks a row for each GPU, has fewer than two,
    names a link of another kind (NVLink) or its pairs do not split that way."""
    links = topology_links(topology, count) if count >= 2 else None
    if links is None or any(links[a][b] not in _SOCKET_LOCAL | {"SYS"}
                            for a in range(count) for b in range(count) if a != b):
        return ()
    out = _groups(links, count, lambda ab, ba: ab != "SYS" and ba != "SYS")
    of = {g: i for i, m in enumerate(out) for g in m}
    if any(links[a][b] != "SYS" for a in range(count) for b in range(count) if of.get(a) != of.get(b)):
        return ()  # across two groups only SYS: a pair linked inside a socket one way only is not split by it
    return out


def interconnect(topo: str | None, count: int) -> str:
    """A short word for the GPU-to-GPU links in `nvidia-smi topo -m` (NV# = NVLink, else PCIe)."""
    if count < 2 or not topo:
        return "single GPU" if count == 1 else "none"
    if (word := all_nvlink(topo, count)) is not None:
        return f"NVLink ({word})"
    links = re.findall(r"\b(NV\d+|SYS|NODE|PHB|PXB|PIX)\b", topo)
    nvlink = [x for x in links if x.startswith("NV")]
    if nvlink:
        return "mixed NVLink/PCIe"
    worst = next((k for k in ("SYS", "NODE", "PHB", "PXB", "PIX") if k in links), "unknown")
    return f"PCIe (worst path {worst})"


def strip_ansi(text: str) -> str:
    """nvidia-smi underlines the topology header with terminal escapes even when piped."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def slug(text: str) -> str:
    s = re.sub(r"^nvidia\s+", "", text.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "gpu"


def machine_key(machine_ids: tuple[str, ...] = MACHINE_ID_FILES) -> str:
    """This machine's stable identity: its machine-id, else a random key made once and kept under
    $XDG_STATE_HOME/stackprobe (a container without a machine-id). Never recorded; only hashed."""
    for f in machine_ids:
        try:
            text = Path(f).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            return text
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "stackprobe" / "host-key"
    try:
        return state.read_text().strip() or _new_key(state)
    except FileNotFoundError:
        return _new_key(state)
    except OSError:
        return socket.gethostname()  # nowhere to keep a key: the host name is all that is left


def _new_key(path: Path) -> str:
    key = secrets.token_hex(16)
    with contextlib.suppress(OSError):
        atomic.write_text(path, key + "\n")
    return key


def gpu_uuids(smi: str | None) -> list[str]:
    """The GPUs' UUIDs (``nvidia-smi --query-gpu=uuid``); hashed into the host id, never recorded."""
    if not smi:
        return []
    return sorted(x.strip() for x in (_run([smi, "--query-gpu=uuid", "--format=csv,noheader"]) or "").splitlines()
                  if x.strip())


def host_id(gpus: list[dict[str, Any]], machine: str, uuids: list[str] | tuple[str, ...] = ()) -> str:
    """``<label>-<8 hex>``: the GPU slug and count (or ``cpu``) and a salted hash of the machine's key and its
    GPUs' UUIDs (checks.results.ids.HOST_ID is its grammar)."""
    facts = "\0".join([machine, *sorted(uuids)]).encode()
    digest = hashlib.sha256(HOST_ID_SALT + facts).hexdigest()[:8]
    if not gpus:
        return f"cpu-{digest}"
    return f"{slug(gpus[0]['name'])}x{len(gpus)}-{digest}"


def host_label(gpus: list[dict[str, Any]], link: str) -> str:
    """The readable part beside the id: ``NVIDIA H200 ×2, NVLink (NV18)``; ``no GPU``."""
    if not gpus:
        return "no GPU"
    return f"{gpus[0]['name']} ×{len(gpus)}" + (f", {link}" if len(gpus) > 1 else "")


def scrub(value: str) -> str:
    """A value with any credentials inside it replaced: ``user:secret@host`` -> ``***@host``."""
    return USERINFO.sub(lambda m: (m["scheme"] or "") + "***@", value)


def safe_env(env: dict[str, str]) -> dict[str, str]:
    """The environment variables that shape GPU communication, minus anything that looks like a secret
    (by its name) and with credentials inside values replaced."""
    return {k: scrub(v) for k, v in sorted(env.items())
            if k.startswith(ENV_PREFIXES) and not SECRET.search(k) and not k.startswith(NOISE)}


def _gpus(smi: str) -> list[dict[str, Any]]:
    return parse_gpu_csv(_run([smi, f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"]) or "")


def own_host_id() -> str:
    """This machine's host id, as ``collect`` makes it (its GPUs and machine key), without the other facts."""
    smi = shutil.which("nvidia-smi")
    return host_id(_gpus(smi) if smi else [], machine_key(), gpu_uuids(smi))


def collect(inspect: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Host facts. `inspect` is the environment's `inenv.worker --inspect` output, if one was run."""
    return with_inspect(gpu_facts(env), inspect)


def gpu_facts(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The facts ``nvidia-smi`` and the machine give, before any environment is inspected. Its four queries run
    at once: on a VM each takes a second or more, and the run's first answer waits for them."""
    smi = shutil.which("nvidia-smi")
    gpus: list[dict[str, Any]] = []
    uuids: list[str] = []
    facts: dict[str, Any] = {}
    if smi:
        with ThreadPoolExecutor(max_workers=4) as pool:
            asked = (pool.submit(_gpus, smi), pool.submit(_run, [smi]), pool.submit(_run, [smi, "topo", "-m"]),
                     pool.submit(gpu_uuids, smi))
            gpus, banner, topology, uuids = (f.result() for f in asked)
        facts["driver_cuda"] = parse_driver_cuda(banner or "")
        facts["topology"] = strip_ansi(topology or "").rstrip() or None
        facts["nvidia_smi"] = smi
    link = interconnect(facts.get("topology"), len(gpus))
    facts.update({
        "host_id": host_id(gpus, machine_key(), uuids),
        "host_label": host_label(gpus, link),
        "gpu_count": len(gpus),
        "gpus": gpus,
        "gpu_name": gpus[0]["name"] if gpus else None,
        "compute_capability": gpus[0]["compute_capability"] if gpus else None,
        "driver": gpus[0]["driver"] if gpus else None,
        "interconnect": link,
        "no_gpu_reason": None if gpus else ("nvidia-smi not found" if not smi else "nvidia-smi lists no GPU"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "env": safe_env(dict(os.environ) if env is None else env),
    })
    return facts


def with_inspect(facts: dict[str, Any], inspect: dict[str, Any] | None) -> dict[str, Any]:
    """``facts`` (:func:`gpu_facts`) with what the environment's inspection adds: SM counts (known only to the CUDA
    runtime), peer access, multicast and NCCL's version. A new dict; ``facts`` is left as it was."""
    inspect = inspect or {}
    seen = {g.get("index"): g for g in inspect.get("gpus") or [] if isinstance(g, dict)}
    gpus = [{**g, "sm_count": seen[g["index"]].get("sm_count")} if g["index"] in seen else dict(g)
            for g in facts.get("gpus") or []]
    return {**facts, "gpus": gpus, "peer_access": inspect.get("peer_access") or [],
            "multicast": inspect.get("multicast") or [], "nccl": (inspect.get("versions") or {}).get("nccl")}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def host_view(facts: dict[str, Any], target_archs: tuple[str, ...] | None = None) -> HostView:
    kwargs: dict[str, Any] = {}
    if target_archs is not None:  # () is an answer: the local GPU only
        kwargs["target_archs"] = target_archs
    return HostView(gpu_count=int(facts.get("gpu_count") or 0), compute_capability=facts.get("compute_capability"),
                    gpu_name=facts.get("gpu_name"), **kwargs)
