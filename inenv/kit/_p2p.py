"""host-p2p's reading of the driver and its judgement of the facts: NVML's view of each GPU and pair, a GPU's
link and a pair's path as the verdict reads them, the likely cause of a peer-to-peer failure, and the facts
variant's verdict (pure over what was read, so tested on fake sysfs trees and a stand-in NVML). The probe
(``inenv/probes/host_p2p.py``) reads the facts with torch and runs the copies and NCCL checks.

In-environment side: standard library, pynvml inside the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from inenv.kit import _pci
from inenv.kit._pci import Fact, spelled
from inenv.probe import outcome

# nvml.h values: pynvml spells some of these constants as one-element tuples, which NVML refuses.
P2P_CAPS = (("read", 0), ("write", 1), ("nvlink", 2), ("atomics", 3), ("pci", 4))
P2P_STATUS = {0: "ok", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
              4: "disabled by regkey", 5: "not supported", 6: "unknown"}
TOPOLOGY = {0: "same board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
NVLINK_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
NVLINK_MAX_LINKS = 18
NVLINK_GBS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}  # per link and direction, by NVLink version


# --------------------------------------------------------------------------------------------------
# NVML: the driver's view of each GPU and pair


def _ask(fn: Callable[..., Any], *args: Any) -> tuple[Any, str]:
    try:
        return fn(*args), ""
    except Exception as exc:  # NVML raises its own error types for "not supported" and the like
        return None, f"{type(exc).__name__}: {exc}"[:160]


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def nvml_session() -> Iterator[tuple[Any, str]]:
    """(pynvml initialised, "") or (None, why not); shut down afterwards."""
    try:
        import pynvml
    except ImportError:
        yield None, "pynvml is not installed (the nvidia-ml-py package)"
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        yield None, f"NVML did not initialise ({type(exc).__name__}: {exc})"[:200]
        return
    try:
        yield pynvml, ""
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _nvml_gpu(nv: Any, index: int, handle: Any) -> dict[str, Any]:
    info, err = _ask(nv.nvmlDeviceGetPciInfo, handle)
    out: dict[str, Any] = {"index": index, "address": _pci.normal_address(_text(info.busId)) if info else None}
    if err:
        out["address_error"] = err
    name, _ = _ask(nv.nvmlDeviceGetName, handle)
    out["name"] = _text(name) if name is not None else None
    out["pcie_replay"] = replay_count(nv, handle)
    link: dict[str, Any] = {}
    for key, fn in (("gen", "nvmlDeviceGetCurrPcieLinkGeneration"), ("max_gen", "nvmlDeviceGetMaxPcieLinkGeneration"),
                    ("gpu_max_gen", "nvmlDeviceGetGpuMaxPcieLinkGeneration"),
                    ("width", "nvmlDeviceGetCurrPcieLinkWidth"), ("max_width", "nvmlDeviceGetMaxPcieLinkWidth")):
        value, err = _ask(getattr(nv, fn), handle) if hasattr(nv, fn) else (None, "not in this pynvml")
        link[key] = value if err == "" else {"not_visible": err, "source": fn}
    out["link"] = link
    active: list[dict[str, Any]] = []
    why = ""
    for n in range(NVLINK_MAX_LINKS):
        state, err = _ask(nv.nvmlDeviceGetNvLinkState, handle, n)
        if err:
            why = why or err
            break
        if not state:
            continue
        remote, _ = _ask(nv.nvmlDeviceGetNvLinkRemotePciInfo, handle, n)
        kind, _ = _ask(nv.nvmlDeviceGetNvLinkRemoteDeviceType, handle, n) if hasattr(
            nv, "nvmlDeviceGetNvLinkRemoteDeviceType") else (None, "")
        version, _ = _ask(nv.nvmlDeviceGetNvLinkVersion, handle, n)
        active.append({"link": n, "remote": _pci.normal_address(_text(remote.busId)) if remote else None,
                       "switch": kind == NVLINK_SWITCH, "version": version})
    out["nvlink"] = {"active": active, **({"stopped_at": why} if why and not active else {})}
    return out


def replay_count(nv: Any, handle: Any) -> Any:
    """The GPU's PCIe replay counter (NVML keeps it since boot), or what NVML said instead."""
    if not hasattr(nv, "nvmlDeviceGetPcieReplayCounter"):
        return {"not_visible": "not in this pynvml", "source": "nvmlDeviceGetPcieReplayCounter"}
    value, err = _ask(nv.nvmlDeviceGetPcieReplayCounter, handle)
    return value if not err and isinstance(value, int) else {"not_visible": err or f"got {value!r}",
                                                             "source": "nvmlDeviceGetPcieReplayCounter"}


def replay_counts(nv: Any, addresses: Sequence[str]) -> dict[str, Any]:
    """The PCIe replay counter of each GPU at ``addresses`` (NVML), by address; {} without NVML."""
    out: dict[str, Any] = {}
    if nv is None:
        return out
    for address in addresses:
        handle, err = _ask(nv.nvmlDeviceGetHandleByPciBusId, address.encode())
        out[address] = replay_count(nv, handle) if not err else {"not_visible": err, "source": "NVML"}
    return out


def nvlinks_between(a: dict[str, Any], b: dict[str, Any]) -> int:
    """NVLink links joining two GPUs (pure): direct links to the other, or links into NVSwitches on both."""
    links_a, links_b = a.get("nvlink", {}).get("active", []), b.get("nvlink", {}).get("active", [])
    direct = sum(1 for link in links_a if link.get("remote") == b.get("address"))
    if direct:
        return direct
    return min(sum(bool(lk.get("switch")) for lk in links_a), sum(bool(lk.get("switch")) for lk in links_b))


def nvml_view(nv: Any, why: str, only: list[str] | None = None) -> dict[str, Any]:
    """Every GPU NVML lists and every pair of them (or of those at the addresses ``only``)."""
    if nv is None:
        return {"not_visible": why, "source": "NVML"}
    count, err = _ask(nv.nvmlDeviceGetCount)
    if err:
        return {"not_visible": err, "source": "nvmlDeviceGetCount"}
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpus = [_nvml_gpu(nv, i, h) for i, h in enumerate(handles)]
    driver, _ = _ask(nv.nvmlSystemGetDriverVersion)
    wanted = [i for i, g in enumerate(gpus) if only is None or g["address"] in only]
    pairs: dict[str, Any] = {}
    for x, i in enumerate(wanted):
        for j in wanted[x + 1:]:
            level, err = _ask(nv.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
            entry: dict[str, Any] = {"addresses": [gpus[i]["address"], gpus[j]["address"]],
                                     "topology": TOPOLOGY.get(level, str(level)) if not err else None}
            if err:
                entry["topology_error"] = err
            links = nvlinks_between(gpus[i], gpus[j])
            if links:
                entry["topology"] = f"NV{links}"
                entry["nvlinks"] = links
            status: dict[str, str] = {}
            for cap, index in P2P_CAPS:
                value, err = _ask(nv.nvmlDeviceGetP2PStatus, handles[i], handles[j], index)
                status[cap] = P2P_STATUS.get(value, str(value)) if not err else f"not visible ({err})"
            entry["p2p"] = status
            pairs[f"{i}-{j}"] = entry
    return {"source": "NVML", "driver": _text(driver) if driver else None, "gpus": gpus, "pairs": pairs}


def nvml_pair(view: dict[str, Any], a: str | None, b: str | None) -> dict[str, Any] | None:
    for entry in (view.get("pairs") or {}).values():
        if set(entry.get("addresses", [])) == {a, b}:
            return entry
    return None


# --------------------------------------------------------------------------------------------------
# What the facts say about one GPU's link and one pair's path (pure parts are tested without a GPU)


@dataclass(frozen=True)
class LinkView:
    """One GPU's PCIe link as the judgement reads it (GT/s and lanes; None: unknown)."""

    label: str
    width: int | None = None
    max_width: int | None = None  # the card's
    speed: float | None = None  # read while copies ran; None: never read under load
    idle_speed: float | None = None
    max_speed: float | None = None  # the card's
    slot_speed: float | None = None  # the most the port above it allows
    slot_width: int | None = None

    @property
    def attainable(self) -> float | None:
        known = [s for s in (self.max_speed, self.slot_speed) if s]
        return min(known) if known else None

    def rate_gbs(self) -> float | None:
        """Its theoretical data rate per direction at the best speed it may train at, on the lanes it has."""
        return _pci.link_gbs(self.attainable, self.width or self.max_width)


def link_problem(v: LinkView) -> str | None:
    """How far below the card's maximum the link trained (pure); None when it is at its maximum or unknown.
    The speed counts only as read under load: an idle GPU lowers its link speed on purpose."""
    issues: list[str] = []
    if v.width and v.max_width and v.width < v.max_width:
        slot = f" (the port above it is x{v.slot_width})" if v.slot_width and v.slot_width < v.max_width else ""
        issues.append(f"trained at x{v.width} of x{v.max_width}{slot}")
    if v.speed and v.max_speed and v.speed < v.max_speed:
        slot = (f" (the port above it allows {spelled(v.slot_speed)})"
                if v.slot_speed and v.slot_speed < v.max_speed else "")
        issues.append(f"ran at {spelled(v.speed)} under load, the card supports {spelled(v.max_speed)}{slot}")
    if not issues:
        return None
    have = _pci.link_gbs(v.speed or v.max_speed, v.width or v.max_width)
    best = _pci.link_gbs(v.max_speed, v.max_width)
    share = f": {have / best:.0%} of its {best:.1f} GB/s per direction" if have and best else ""
    return f"{v.label} " + "; ".join(issues) + share


@dataclass(frozen=True)
class PathView:
    """What the facts say about the path between two GPUs, as the verdict names it."""

    labels: tuple[str, str]
    meets_at: str = "not visible"
    redirect: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # (bridge, port type, ACS bits on)
    acs_hidden: tuple[tuple[str, str], ...] = ()  # (bridge, why its ACS is not visible)
    iommu: Fact = field(default_factory=lambda: _pci.hidden("", "not read"))
    topology: str | None = None  # NVML's
    p2p: tuple[tuple[str, str], ...] = ()  # NVML's P2P status per capability

    @property
    def nvlink(self) -> bool:
        return bool(self.topology and self.topology.startswith("NV"))


# --------------------------------------------------------------------------------------------------
# Reading the facts


@dataclass
class Gpu:
    index: int
    address: str | None
    index_source: str
    port: _pci.Port | None = None
    bridges: list[_pci.Port] = field(default_factory=list)
    chain: _pci.Chain | None = None
    nvml: dict[str, Any] = field(default_factory=dict)
    loaded: Fact = field(default_factory=lambda: _pci.hidden("", "not read under load"))
    unread: str = ""  # why its sysfs facts could not be read ("": read, or nothing to read)
    name: str | None = None  # the model as CUDA names it (torch), where torch was read

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.address or 'address not visible'})"

    @property
    def model(self) -> str | None:
        """The GPU's model: NVML's name, CUDA's, else its PCI device id (``10de:2335``); None when none is seen."""
        if self.nvml.get("name"):
            return str(self.nvml["name"])
        if self.name:
            return self.name
        ids = self.port.ids if self.port is not None else None
        return f"PCI {ids.value}" if ids is not None and ids.seen else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "address": self.address, "index_source": self.index_source,
                               "model": self.model}
        if self.chain is not None:
            out["chain"] = self.chain.fact.to_json()
            out["root_complex"] = self.chain.root_complex or None
        if self.port is not None:
            out["device"] = self.port.to_json()
        out["upstream"] = [b.to_json() for b in self.bridges]
        if self.nvml:
            out["nvml"] = self.nvml
        out["link_under_load"] = self.loaded.to_json()
        if self.unread:
            out["unread"] = self.unread
        return out


def gen_speed(value: Any) -> float | None:
    return _pci.SPEED_OF_GENERATION.get(value) if isinstance(value, int) else None


def _num(value: Any) -> Any:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def link_view(g: Gpu) -> LinkView:
    """The link as sysfs shows it, NVML's view where sysfs shows nothing; the port above from its sysfs."""
    nv = g.nvml.get("link", {}) if g.nvml else {}
    link = g.port.link if g.port else None

    def seen(fact: Fact | None) -> Any:
        return fact.value if fact is not None and fact.seen else None

    slot = g.bridges[0].link if g.bridges else None
    slot_speed = seen(slot.max_speed if slot else None)
    system_max = gen_speed(nv.get("max_gen"))
    card_max = seen(link.max_speed if link else None) or gen_speed(nv.get("gpu_max_gen")) or system_max
    if system_max and card_max and system_max < card_max and not slot_speed:
        slot_speed = system_max
    return LinkView(
        g.label,
        width=seen(link.width if link else None) or _num(nv.get("width")),
        max_width=seen(link.max_width if link else None) or _num(nv.get("max_width")),
        speed=g.loaded.value if g.loaded.seen else None,
        idle_speed=seen(link.speed if link else None) or gen_speed(nv.get("gen")),
        max_speed=card_max,
        slot_speed=slot_speed,
        slot_width=seen(slot.max_width if slot else None),
    )


def read_gpu(host: _pci.Host, g: Gpu, admin: bool | None) -> Gpu:
    """The GPU's chain, port and bridges from sysfs; what cannot be read (a link loop, a file the readers do not
    expect) leaves this GPU's sysfs facts out and says why in ``unread``, never the other GPUs'."""
    if not g.address:
        return g
    try:
        g.chain = _pci.chain_of(host, g.address)
        if not g.chain.fact.seen and g.chain.device_dir is None:
            g.unread = g.chain.fact.not_visible
        if g.chain.device_dir is not None:
            g.port = _pci.read_port(host, g.chain.device_dir, admin)
            g.bridges = [_pci.read_port(host, d, admin) for _, d in g.chain.bridges]
    except Exception as exc:  # sysfs is the host's, not ours: one GPU's odd tree must not lose the others
        g.chain, g.port, g.bridges = None, None, []
        g.unread = f"{type(exc).__name__}: {exc}"[:200]
    return g


# --------------------------------------------------------------------------------------------------
# The facts variant's verdict


def pair_path(a: Gpu, b: Gpu, iommu: Fact, nvml: dict[str, Any], vm: Fact) -> PathView:
    """The path between two GPUs' as their chains and ports show it."""
    ports = {p.address: p for p in (*a.bridges, *b.bridges)}
    meets, crossed = ("not visible", [])
    if a.chain is not None and b.chain is not None:
        meets, crossed = _pci.path_between(a.chain, b.chain)
    redirect, hidden = [], []
    for addr in crossed:
        p = ports.get(addr)
        if p is None:
            continue
        kind = p.port_type.value if p.port_type.seen else (p.kind.value or "bridge")
        if not p.acs.seen:
            hidden.append((addr, p.acs.not_visible))
        elif p.acs_control is not None and p.acs_control.redirecting:
            redirect.append((addr, str(kind), tuple(p.acs_control.redirecting)))
    if not crossed and vm.seen and vm.value:
        hidden.append(("the host's bridges", "inside a VM the bridges above the GPUs and their ACS are the "
                                             "host's, not visible here (read them on the host)"))
    entry = nvml_pair(nvml, a.address, b.address) or {}
    return PathView((a.label, b.label), meets, tuple(redirect), tuple(hidden), iommu, entry.get("topology"),
                    tuple(sorted((entry.get("p2p") or {}).items())))


# What the facts variant reports, weightiest first: its reason code is the first one found.
FINDINGS = (
    ("pcie-link-degraded", "a GPU's link trained below the card's maximum"),
    ("p2p-unavailable", "the driver refuses peer-to-peer for a pair"),
    ("mixed-gpu-models", "the host holds GPUs of more than one model"),
    ("p2p-no-native-atomics", "a pair has peer access but no native peer-to-peer atomics"),
    ("p2p-acs-redirect", "ACS redirect on a bridge of a pair's PCIe path"),
    ("p2p-iommu-translated", "the IOMMU translates the GPUs' DMA"),
    ("pcie-link-settings", "ASPM on, or a payload size that differs from the port's, on a GPU's path"),
    ("p2p-facts-not-visible", "facts peer-to-peer depends on could not be read"),
)


def models(gpus: Sequence[Gpu]) -> dict[str, list[int]]:
    """The GPU indices of each model the host holds (pure; a GPU whose model is not seen is left out)."""
    out: dict[str, list[int]] = {}
    for g in gpus:
        if g.model:
            out.setdefault(g.model, []).append(g.index)
    return out


def two_models(a: Gpu, b: Gpu) -> str:
    """How a note names a pair of two GPU models ("" when both are one model, or a model is not seen)."""
    if a.model and b.model and a.model != b.model:
        return f"a pair of two GPU models (GPU {a.index}: {a.model}, GPU {b.index}: {b.model})"
    return ""


def _setting(port: _pci.Port, key: str) -> Any:
    value = port.settings.value if port.settings.seen and isinstance(port.settings.value, dict) else {}
    return value.get(key)


def settings_problems(gpus: Sequence[Gpu]) -> list[str]:
    """Per GPU, the link settings that slow its path (pure): ASPM switched on for its link or a bridge's above it
    (a link in L0s or L1 pays an exit latency on every burst), and a Max_Payload_Size that differs from the port
    above it's."""
    out = []
    for g in gpus:
        if g.port is None:
            continue
        issues = [f"ASPM {aspm} on at {p.address}" for p in (g.port, *g.bridges)
                  if (aspm := _setting(p, "aspm")) and aspm != "disabled"]
        mps, above = _setting(g.port, "mps"), _setting(g.bridges[0], "mps") if g.bridges else None
        if isinstance(mps, int) and isinstance(above, int) and mps != above:
            issues.append(f"Max_Payload_Size {mps} bytes, {above} at the port above it ({g.bridges[0].address})")
        if issues:
            out.append(f"{g.label}: " + "; ".join(issues))
    return out


def no_native_atomics(paths: dict[str, PathView]) -> dict[str, str]:
    """The pairs NVML reports peer read and write for but not native atomics, with the status it gives (pure)."""
    out = {}
    for k, p in paths.items():
        status = dict(p.p2p)
        atomics = status.get("atomics", "")
        if status.get("read") == "ok" and status.get("write") == "ok" and atomics not in ("", "ok") \
                and not atomics.startswith("not visible"):
            out[k] = atomics
    return out


def facts_verdict(gpus: list[Gpu], paths: dict[str, PathView], iommu: Fact, links: list[str], why_no_gpu: str,
                  hidden_host: list[str], evidence: dict[str, Any], lost: Sequence[str] = ()) -> dict[str, Any]:
    """The facts variant's outcome (pure over what was read): a degraded link, the driver refusing P2P, a pair
    without native P2P atomics, ACS redirect on a path, a translating IOMMU and facts that could not be read, in
    that order of weight; ACS, the IOMMU and hidden bridges only count for a pair that is not joined by NVLink,
    while a GPU whose sysfs facts could not be read (``lost``: one sysfs could not even classify) always does."""
    mode = iommu.value if iommu.seen else "not visible"
    summary = "; ".join([f"{len(gpus)} GPU(s)", *(f"{g.label} {spelled(v.idle_speed, v.width)}" for g, v in
                         ((g, link_view(g)) for g in gpus)), f"IOMMU {mode}"])
    metrics: dict[str, Any] = {"gpus": len(gpus), "degraded_links": len(links),
                               "acs_redirect_bridges": len({a for p in paths.values() for a, _, _ in p.redirect}),
                               "headline": f"IOMMU {mode}"}
    if not gpus:
        also = "".join(f"; {h}" for h in (*lost, *hidden_host))
        note = f"no GPU visible ({why_no_gpu}): host facts only ({summary}{also}); the GPU parts were skipped"
        return outcome("skip", note, "no-gpu", metrics, evidence)
    found: dict[str, str] = {}
    if links:
        found["pcie-link-degraded"] = "; ".join(links)
    held = models(gpus)
    if len(held) > 1:
        found["mixed-gpu-models"] = "GPUs of more than one model: " + "; ".join(
            f"{name} (GPU {', '.join(map(str, idx))})" for name, idx in held.items()) + (
            ": a pair of two models is named as such; NCCL's peer-to-peer pairs of two models were reported to hang")
    slow = settings_problems(gpus)
    if slow:
        found["pcie-link-settings"] = "link settings on a GPU's path: " + "; ".join(slow[:4])
    pcie = {k: p for k, p in paths.items() if not p.nvlink}
    refused = [f"GPU {k}: P2P {cap} {status}" for k, p in pcie.items() for cap, status in p.p2p
               if cap in ("read", "write") and status != "ok" and not status.startswith("not visible")]
    if refused:
        found["p2p-unavailable"] = "the driver refuses peer-to-peer: " + "; ".join(refused[:4])
    bare = no_native_atomics(paths)
    metrics["no_native_atomics"] = bare
    if bare:
        found["p2p-no-native-atomics"] = ("peer access without native peer-to-peer atomics (NVML): " + "; ".join(
            f"GPU {k}: atomics {why}" for k, why in sorted(bare.items())[:4]) + ": torch symmetric memory's signals "
            "rely on them and can wedge under load")
    bridges: dict[str, tuple[str, tuple[str, ...], set[str]]] = {}
    for k, p in pcie.items():
        for addr, kind, bits in p.redirect:
            bridges.setdefault(addr, (kind, bits, set()))[2].add(k)
    if bridges:
        found["p2p-acs-redirect"] = "ACS redirect sends peer traffic up to the root complex: " + "; ".join(
            f"bridge {addr} ({kind}) has {'+'.join(bits)} on, on the path of pair(s) {', '.join(sorted(pairs))}"
            for addr, (kind, bits, pairs) in sorted(bridges.items()))
    if pcie and mode in ("translated", "mixed"):
        found["p2p-iommu-translated"] = (f"the IOMMU translates the GPUs' DMA ({mode}: {iommu.source}); "
                                         "peer-to-peer over PCIe goes through it")
    unseen = [*lost, *(f"{g.label}: its sysfs facts could not be read ({g.unread})" for g in gpus if g.unread)]
    unseen += sorted({f"{addr}: {why}" for p in pcie.values() for addr, why in p.acs_hidden})
    if pcie and not iommu.seen:
        unseen.append(f"IOMMU mode: {iommu.not_visible}")
    if pcie:
        unseen += hidden_host
    if unseen:
        found["p2p-facts-not-visible"] = "not visible: " + "; ".join(unseen[:4]) + (
            f" (and {len(unseen) - 4} more)" if len(unseen) > 4 else "")
    metrics["headline"] = f"{len(gpus)} GPU(s), IOMMU {mode}" + (f", {len(links)} degraded link(s)" if links else "")
    if found:
        for code, _ in FINDINGS:
            if code in found:
                break
        return outcome("partial", "; ".join(found[c] for c, _ in FINDINGS if c in found), code, metrics, evidence)
    one = "; one GPU: no pair to check" + "".join(f"; {h}" for h in hidden_host) if len(gpus) == 1 else ""
    return outcome("pass", summary + one, metrics=metrics, evidence=evidence)
