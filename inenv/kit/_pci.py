"""The PCI facts peer-to-peer depends on: links, the bridges above each GPU with their ACS bits, each link's
settings (payload and read request sizes, ASPM) and its error counters (AER); the IOMMU is read in _iommu.py.

Every reader takes the file-system root it reads under (``/`` on a host, a tree under a test's temporary folder)
and returns :class:`Fact` values: what was read and where, or ``not_visible`` with the reason it could not be read
(a file this kernel, VM or container does not expose, a read that needs root), never a guess. The configuration
space parser is pure (bytes in, fields out) and follows the PCI Express Base Specification's layout: the
standard capability list from the pointer at 0x34, the extended capability list from 0x100, and the ACS
extended capability (id 0x000D) with its capability register at +4 and control register at +6; in the PCI Express
capability, Device Capabilities (+0x04, Max_Payload_Size Supported), Device Control (+0x08, Max_Payload_Size and
Max_Read_Request_Size), Link Capabilities (+0x0C, ASPM Support) and Link Control (+0x10, ASPM Control). Everything
here only reads: no GPU or PCI setting is ever written.

In-environment side: standard library only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --- facts ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fact:
    """One thing read from the host: its value and where it was read, or why it could not be read."""

    value: Any = None
    source: str = ""
    not_visible: str = ""  # the reason, when nothing could be read

    @property
    def seen(self) -> bool:
        return not self.not_visible

    def to_json(self) -> dict[str, Any]:
        if self.not_visible:
            return {"not_visible": self.not_visible, "source": self.source}
        return {"value": self.value, "source": self.source}


def hidden(source: str, why: str) -> Fact:
    return Fact(None, source, why)


def why_unreadable(exc: OSError) -> str:
    """The reason a file could not be read, as a ``not_visible`` says it."""
    if isinstance(exc, FileNotFoundError):
        return "not exposed here (no such file)"
    if isinstance(exc, PermissionError):
        return "needs root (permission denied)"
    if isinstance(exc, NotADirectoryError | IsADirectoryError):
        return "not a file here"
    return f"unreadable ({exc.strerror or type(exc).__name__})"


@dataclass(frozen=True)
class Host:
    """Where the readers read: ``root`` is ``/`` on a real host."""

    root: Path = Path("/")

    def at(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    @property
    def pci(self) -> Path:
        return self.at("sys", "bus", "pci", "devices")

    def shown(self, path: Path) -> str:
        """``path`` as it is named on the host (``/sys/...``), whatever the root."""
        try:
            return "/" + str(path.relative_to(self.root)).lstrip("/")
        except ValueError:
            return str(path)

    def text(self, path: Path) -> Fact:
        try:
            return Fact(path.read_text(errors="replace").strip(), self.shown(path))
        except OSError as exc:
            return hidden(self.shown(path), why_unreadable(exc))

    def raw(self, path: Path, limit: int = 4096) -> tuple[bytes | None, str]:
        """Up to ``limit`` bytes of a file, or None and why not."""
        try:
            with open(path, "rb") as f:
                return f.read(limit), ""
        except OSError as exc:
            return None, why_unreadable(exc)


# --- links ---------------------------------------------------------------------------------------------------

# Bytes per second per lane and direction of each signalling rate (GT/s), after line coding: 8b/10b up to
# 5 GT/s, 128b/130b for 8-32 GT/s, and 64 GT/s's FLIT mode (242 of 256 bytes carry data).
LANE_GBS: dict[float, float] = {
    2.5: 2.5 * 8 / 10 / 8,
    5.0: 5.0 * 8 / 10 / 8,
    8.0: 8.0 * 128 / 130 / 8,
    16.0: 16.0 * 128 / 130 / 8,
    32.0: 32.0 * 128 / 130 / 8,
    64.0: 64.0 * 242 / 256 / 8,
}
GENERATION: dict[float, int] = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
SPEED_OF_GENERATION: dict[int, float] = {g: s for s, g in GENERATION.items()}
# The link speed field of Link Capabilities / Link Status: 1 = 2.5 GT/s ... 6 = 64 GT/s.
SPEED_CODE: dict[int, float] = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
_SPEED = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*GT/s")


def parse_speed(text: str) -> float | None:
    """GT/s from sysfs's ``current_link_speed`` text (``16.0 GT/s PCIe``); None for ``Unknown``."""
    m = _SPEED.match(text or "")
    return float(m.group(1)) if m else None


def parse_width(text: str) -> int | None:
    t = (text or "").strip().lower().lstrip("x")
    return int(t) if t.isdigit() and int(t) > 0 else None


def generation(speed: float | None) -> int | None:
    return GENERATION.get(speed) if speed is not None else None


def spelled(speed: float | None, width: int | None = None) -> str:
    """``Gen5 x16 (32 GT/s)``, from what is known."""
    gen = generation(speed)
    parts = [f"Gen{gen}" if gen else (f"{speed:g} GT/s" if speed is not None else "speed unknown")]
    if width:
        parts.append(f"x{width}")
    if gen and speed is not None:
        parts.append(f"({speed:g} GT/s)")
    return " ".join(parts)


def link_gbs(speed: float | None, width: int | None) -> float | None:
    """A link's data rate per direction in GB/s, or None when speed or width is unknown."""
    if speed is None or not width or speed not in LANE_GBS:
        return None
    return LANE_GBS[speed] * width


@dataclass(frozen=True)
class Link:
    speed: Fact  # GT/s
    width: Fact  # lanes
    max_speed: Fact
    max_width: Fact

    def to_json(self) -> dict[str, Any]:
        return {"speed_gts": self.speed.to_json(), "width": self.width.to_json(),
                "max_speed_gts": self.max_speed.to_json(), "max_width": self.max_width.to_json()}


def _link_value(host: Host, path: Path, parse: Any) -> Fact:
    raw = host.text(path)
    if not raw.seen:
        return raw
    value = parse(raw.value)
    if value is None:
        return hidden(raw.source, f"the kernel reports {raw.value!r}")
    return Fact(value, raw.source)


def read_link(host: Host, device_dir: Path) -> Link:
    return Link(_link_value(host, device_dir / "current_link_speed", parse_speed),
                _link_value(host, device_dir / "current_link_width", parse_width),
                _link_value(host, device_dir / "max_link_speed", parse_speed),
                _link_value(host, device_dir / "max_link_width", parse_width))


# --- configuration space -------------------------------------------------------------------------------------

HEADER_BYTES = 64  # the type 0/1 header; a reader without CAP_SYS_ADMIN gets this much
CONVENTIONAL_BYTES = 256  # conventional PCI configuration space
EXTENDED_BYTES = 4096  # PCI Express extended configuration space
STATUS = 0x06
STATUS_CAP_LIST = 0x10  # Status register bit 4: the capability list at CAP_POINTER is valid
CAP_POINTER = 0x34
CAP_ID_PCIE = 0x10
EXT_CAP_START = 0x100
EXT_CAP_ACS = 0x000D
# ACS capability and control register bits, bit 0 first.
ACS_BITS = ("SV", "TB", "RR", "CR", "UF", "EC", "DT")
ACS_NAMES = {
    "SV": "Source Validation",
    "TB": "Translation Blocking",
    "RR": "P2P Request Redirect",
    "CR": "P2P Completion Redirect",
    "UF": "Upstream Forwarding",
    "EC": "P2P Egress Control",
    "DT": "Direct Translated P2P",
}
# The control bits that send peer-to-peer traffic up to the root complex instead of across the port.
REDIRECT_BITS = ("RR", "CR", "EC")
# PCI Express Capabilities register bits 7:4, Device/Port Type.
PORT_TYPES = {
    0x0: "endpoint",
    0x1: "legacy endpoint",
    0x4: "root port",
    0x5: "switch upstream port",
    0x6: "switch downstream port",
    0x7: "PCIe-to-PCI bridge",
    0x8: "PCI-to-PCIe bridge",
    0x9: "root complex integrated endpoint",
    0xA: "root complex event collector",
}
CAP_SYS_ADMIN = 21  # its bit in /proc/<pid>/status CapEff
# Link Capabilities bits 11:10 (ASPM Support) and Link Control bits 1:0 (ASPM Control) read the same way
ASPM_STATES = {0: "disabled", 1: "L0s", 2: "L1", 3: "L0s+L1"}


def payload_bytes(code: int) -> int | None:
    """Max_Payload_Size and Max_Read_Request_Size encodings: 0 = 128 bytes ... 5 = 4096; 6 and 7 are reserved."""
    return 128 << code if 0 <= code <= 5 else None


def _u16(data: bytes, off: int) -> int:
    return int.from_bytes(data[off:off + 2], "little")


def _u32(data: bytes, off: int) -> int:
    return int.from_bytes(data[off:off + 4], "little")


def acs_names(register: int) -> list[str]:
    return [name for bit, name in enumerate(ACS_BITS) if register >> bit & 1]


@dataclass(frozen=True)
class Acs:
    offset: int
    capability: int  # the ACS Capability register (16 bits): what the port can do
    control: int  # the ACS Control register (16 bits): what is switched on

    @property
    def enabled(self) -> list[str]:
        return acs_names(self.control)

    @property
    def redirecting(self) -> list[str]:
        return [b for b in self.enabled if b in REDIRECT_BITS]

    def to_json(self) -> dict[str, Any]:
        return {"offset": f"0x{self.offset:03x}", "capability": acs_names(self.capability),
                "control": self.enabled, "redirect": self.redirecting,
                "registers": f"cap 0x{self.capability:04x} ctrl 0x{self.control:04x}"}


@dataclass(frozen=True)
class PcieCap:
    offset: int
    port_type: str
    max_speed: float | None  # Link Capabilities
    max_width: int | None
    speed: float | None  # Link Status
    width: int | None
    mps_supported: int | None = None  # bytes, Device Capabilities bits 2:0
    mps: int | None = None  # bytes, Device Control bits 7:5
    mrrs: int | None = None  # bytes, Device Control bits 14:12
    aspm_supported: str | None = None  # Link Capabilities bits 11:10
    aspm: str | None = None  # Link Control bits 1:0: what is switched on

    def settings(self) -> dict[str, Any]:
        """The link's settings as the facts record them."""
        return {"mps": self.mps, "mps_supported": self.mps_supported, "mrrs": self.mrrs, "aspm": self.aspm,
                "aspm_supported": self.aspm_supported}


@dataclass(frozen=True)
class Config:
    """What a device's configuration space shows (see :func:`parse_config`)."""

    length: int
    vendor: int | None = None
    device: int | None = None
    capabilities: tuple[tuple[int, int], ...] = ()  # standard list: (id, offset), in list order
    extended: tuple[tuple[int, int, int], ...] = ()  # extended list: (id, version, offset), in list order
    pcie: PcieCap | None = None
    acs: Acs | None = None
    acs_not_visible: str = ""  # why ACS is unknown; "" when the extended list was read (acs None: it has none)
    problems: tuple[str, ...] = ()  # a broken list: a loop, a pointer into the header, one past the end

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes": self.length}
        if self.capabilities:
            out["capabilities"] = [f"0x{cid:02x}@0x{off:02x}" for cid, off in self.capabilities]
        if self.extended:
            out["extended"] = [f"0x{cid:04x}v{ver}@0x{off:03x}" for cid, ver, off in self.extended]
        if self.problems:
            out["problems"] = list(self.problems)
        return out


def short_reason(length: int, sys_admin: bool | None) -> str:
    """Why the extended configuration space (and ACS in it) cannot be read from a file of ``length`` bytes."""
    if length <= 128 and not sys_admin:
        return (f"needs root: the kernel gives readers without CAP_SYS_ADMIN only the first {length} bytes of "
                "configuration space (run as root on the host, or the container with --privileged)")
    if length <= 128:
        return f"only the first {length} bytes of configuration space are readable here"
    if length < EXTENDED_BYTES and not sys_admin:
        return f"needs root: only {length} of {EXTENDED_BYTES} bytes of configuration space are readable"
    if length == CONVENTIONAL_BYTES:
        return ("the kernel exposes 256 bytes of configuration space: the device has no extended space, or this "
                "kernel or VM cannot reach it (no ECAM/MMCONFIG access); ACS lives in the extended space")
    return f"only {length} of {EXTENDED_BYTES} bytes of configuration space are readable"


def _standard(data: bytes) -> tuple[list[tuple[int, int]], PcieCap | None, list[str], str]:
    """The standard capability list: (id, offset) pairs, the PCIe capability, problems, and where the readable
    bytes ended the walk ("" when the list was read to its end)."""
    caps: list[tuple[int, int]] = []
    problems: list[str] = []
    if not _u16(data, STATUS) & STATUS_CAP_LIST:
        return caps, None, problems, ""
    seen: set[int] = set()
    ptr = data[CAP_POINTER] & 0xFC
    cut = ""
    while ptr:
        if ptr < HEADER_BYTES:
            problems.append(f"capability pointer 0x{ptr:02x} points into the header")
            break
        if ptr + 2 > len(data):
            cut = f"capability at 0x{ptr:02x} lies beyond the {len(data)} bytes readable"
            break
        if ptr in seen:
            problems.append(f"capability list loops back to 0x{ptr:02x}")
            break
        seen.add(ptr)
        caps.append((data[ptr], ptr))
        ptr = data[ptr + 1] & 0xFC
    pcie = None
    at = next((off for cid, off in caps if cid == CAP_ID_PCIE), None)
    if at is not None and at + 0x14 <= len(data):
        flags = _u16(data, at + 2)
        link_cap = _u32(data, at + 0x0C)
        link_status = _u16(data, at + 0x12)
        dev_cap, dev_ctl = _u32(data, at + 0x04), _u16(data, at + 0x08)
        link_ctl = _u16(data, at + 0x10)
        pcie = PcieCap(at, PORT_TYPES.get(flags >> 4 & 0xF, f"type 0x{flags >> 4 & 0xF:x}"),
                       SPEED_CODE.get(link_cap & 0xF), (link_cap >> 4 & 0x3F) or None,
                       SPEED_CODE.get(link_status & 0xF), (link_status >> 4 & 0x3F) or None,
                       payload_bytes(dev_cap & 0x7), payload_bytes(dev_ctl >> 5 & 0x7),
                       payload_bytes(dev_ctl >> 12 & 0x7), ASPM_STATES[link_cap >> 10 & 0x3],
                       ASPM_STATES[link_ctl & 0x3])
    return caps, pcie, problems, cut


def _extended(data: bytes) -> tuple[list[tuple[int, int, int]], Acs | None, list[str]]:
    out: list[tuple[int, int, int]] = []
    problems: list[str] = []
    acs = None
    seen: set[int] = set()
    off = EXT_CAP_START
    while True:
        if off + 4 > len(data):
            problems.append(f"extended capability pointer 0x{off:03x} lies beyond the {len(data)} bytes readable")
            break
        if off in seen:
            problems.append(f"extended capability list loops back to 0x{off:03x}")
            break
        seen.add(off)
        header = _u32(data, off)
        if header == 0xFFFFFFFF:
            problems.append(f"extended capability header at 0x{off:03x} reads as all ones")
            break
        if header == 0:
            break  # no (further) extended capabilities
        cid, version, nxt = header & 0xFFFF, header >> 16 & 0xF, header >> 20 & 0xFFC
        out.append((cid, version, off))
        if cid == EXT_CAP_ACS and acs is None:
            if off + 8 <= len(data):
                acs = Acs(off, _u16(data, off + 4), _u16(data, off + 6))
            else:
                problems.append(f"ACS capability at 0x{off:03x} is cut off by the end of the readable bytes")
        if nxt == 0:
            break
        if nxt < EXT_CAP_START:
            problems.append(f"extended capability at 0x{off:03x} points to 0x{nxt:03x}, below 0x100")
            break
        off = nxt
    return out, acs, problems


def parse_config(data: bytes, sys_admin: bool | None = True) -> Config:
    """A device's configuration space as read from sysfs's ``config`` file. ``sys_admin``: whether the reader
    holds CAP_SYS_ADMIN (the kernel cuts the file to 64 bytes for one that does not)."""
    n = len(data)
    if n < HEADER_BYTES:
        return Config(n, acs_not_visible=f"only {n} bytes of configuration space readable (the header is 64)")
    vendor, device = _u16(data, 0), _u16(data, 2)
    if vendor == 0xFFFF:
        return Config(n, vendor, device, acs_not_visible="the device reads as all ones (not responding)")
    caps, pcie, problems, cut = _standard(data)
    extended: list[tuple[int, int, int]] = []
    acs = None
    why = ""
    if n < EXTENDED_BYTES:
        why = short_reason(n, sys_admin)
    else:
        extended, acs, ext_problems = _extended(data)
        problems += ext_problems
        if acs is None and ext_problems:
            why = f"the extended capability list is broken before any ACS capability ({ext_problems[0]})"
    if cut and not why:
        why = cut
    return Config(n, vendor, device, tuple(caps), tuple(extended), pcie, acs, why, tuple(problems))


# --- devices and the chain above them ------------------------------------------------------------------------

_ADDRESS = re.compile(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
CLASS_NAMES = {
    0x0300: "VGA controller",
    0x0302: "3D controller",
    0x0600: "host bridge",
    0x0604: "PCI bridge",
    0x0680: "bridge",
}
NVIDIA = 0x10DE


def normal_address(text: str) -> str | None:
    """``0000:17:00.0`` from sysfs's, NVML's (``00000000:17:00.0``) or CUDA's spelling; None if it is none."""
    m = _ADDRESS.match((text or "").strip().lower())
    if not m:
        return None
    return f"{int(m.group(1) or '0', 16):04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


def is_address(name: str) -> bool:
    return bool(_ADDRESS.match(name)) and name.count(":") == 2


@dataclass(frozen=True)
class Port:
    """One PCI function as sysfs and its configuration space show it."""

    address: str
    kind: Fact
    ids: Fact
    numa_node: Fact
    link: Link
    iommu_group: Fact
    iommu_type: Fact
    port_type: Fact
    acs: Fact  # Acs.to_json(), None when the device has no ACS capability
    config: Fact
    acs_control: Acs | None = None
    settings: Fact = field(default_factory=lambda: hidden("", "not read"))  # PcieCap.settings(): MPS, MRRS, ASPM

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "kind": self.kind.to_json(), "ids": self.ids.to_json(),
                "numa_node": self.numa_node.to_json(), "link": self.link.to_json(),
                "iommu_group": self.iommu_group.to_json(), "iommu_type": self.iommu_type.to_json(),
                "port_type": self.port_type.to_json(), "acs": self.acs.to_json(), "config": self.config.to_json(),
                "link_settings": self.settings.to_json()}


def _hex(fact: Fact) -> int | None:
    try:
        return int(str(fact.value), 16) if fact.seen else None
    except ValueError:
        return None


def read_port(host: Host, device_dir: Path, sys_admin: bool | None) -> Port:
    address = device_dir.name
    klass = host.text(device_dir / "class")
    code = _hex(klass)
    kind = Fact(CLASS_NAMES.get(code >> 8, f"class 0x{code:06x}") if code is not None else None, klass.source,
                klass.not_visible)
    vendor, dev = host.text(device_dir / "vendor"), host.text(device_dir / "device")
    v, d = _hex(vendor), _hex(dev)
    ids = Fact(f"{v:04x}:{d:04x}", vendor.source) if v is not None and d is not None else hidden(
        vendor.source, vendor.not_visible or dev.not_visible or "unparsable ids")
    numa = host.text(device_dir / "numa_node")
    if numa.seen:
        try:
            numa = Fact(int(numa.value, 10), numa.source)
        except ValueError:
            numa = hidden(numa.source, f"unparsable {str(numa.value)[:40]!r}")
        if numa.value == -1:
            numa = hidden(numa.source, "the firmware reports no NUMA node (-1)")
    group_link = device_dir / "iommu_group"
    try:
        group = Fact(os.path.basename(os.readlink(group_link)), host.shown(group_link))
    except OSError as exc:
        why = "no IOMMU group: no IOMMU translates this device's DMA (or this kernel does not expose it)" if (
            isinstance(exc, FileNotFoundError)) else why_unreadable(exc)
        group = hidden(host.shown(group_link), why)
    kind_of_group = host.text(Path(os.path.realpath(group_link)) / "type") if group.seen else hidden(
        host.shown(group_link / "type"), "no IOMMU group")
    data, why = host.raw(device_dir / "config")
    shown = host.shown(device_dir / "config")
    if data is None:
        cfg = None
        config = hidden(shown, why)
        port_type = hidden(shown, why)
        acs = hidden(shown, why)
    else:
        cfg = parse_config(data, sys_admin)
        config = Fact(cfg.to_json(), shown)
        port_type = Fact(cfg.pcie.port_type, shown) if cfg.pcie else hidden(
            shown, "no PCI Express capability in the readable bytes")
        if cfg.acs is not None:
            acs = Fact(cfg.acs.to_json(), shown)
        elif cfg.acs_not_visible:
            acs = hidden(shown, cfg.acs_not_visible)
        else:
            acs = Fact(None, shown)  # read to the end: it has no ACS capability
    if cfg is not None and cfg.pcie is not None:
        settings = Fact(cfg.pcie.settings(), shown)
    else:  # a short read says why (needs root) where the capability list does not
        unread = cfg.acs_not_visible if cfg is not None and cfg.length < EXTENDED_BYTES else ""
        settings = sysfs_aspm(host, device_dir, unread or port_type.not_visible or config.not_visible)
    return Port(address, kind, ids, numa, read_link(host, device_dir), group, kind_of_group, port_type, acs,
                config, cfg.acs if cfg else None, settings)


ASPM_FILES = ("l0s_aspm", "l1_aspm")  # the kernel's per-link ASPM switches (``link/`` of the device below it)


def sysfs_aspm(host: Host, device_dir: Path, why_not_config: str) -> Fact:
    """The link's ASPM as the kernel's ``link/l0s_aspm`` and ``link/l1_aspm`` files show it, where configuration
    space does not (a reader without CAP_SYS_ADMIN sees only its first 64 bytes): the payload and read request
    sizes are then not visible, with ``why_not_config``."""
    on = []
    for name in ASPM_FILES:
        f = host.text(device_dir / "link" / name)
        if not f.seen or f.value not in ("0", "1"):
            return hidden(host.shown(device_dir / "config"), f"{why_not_config}; {host.shown(device_dir / 'link')}: "
                          f"{f.not_visible or 'unparsable ' + repr(str(f.value)[:20])}")
        if f.value == "1":
            on.append(name.split("_")[0].upper().replace("L0S", "L0s"))
    return Fact({"mps": None, "mps_supported": None, "mrrs": None, "aspm": "+".join(on) or "disabled",
                 "aspm_supported": None, "not_visible": f"payload and read request sizes: {why_not_config}"},
                host.shown(device_dir / "link"))


# --- error counters (AER) ------------------------------------------------------------------------------------

AER_FILES = ("aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal")
# The correctable counters that say the link retransmitted: Replay Timer Timeout and REPLAY_NUM Rollover (the
# data link layer's replays), with Bad TLP and Bad DLLP (the packets it replayed for)
REPLAY_COUNTERS = ("Timeout", "Rollover", "BadTLP", "BadDLLP")


def parse_aer(text: str) -> dict[str, int]:
    """An ``aer_dev_*`` file: one ``<name> <count>`` per line (pure); the ``TOTAL_ERR_*`` lines, sums of the
    others, are left out."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and not parts[0].startswith("TOTAL_"):
            out[parts[0]] = int(parts[1])
    return out


def read_aer(host: Host, device_dir: Path) -> Fact:
    """The device's AER counters, by kind (``correctable``, ``nonfatal``, ``fatal``), as sysfs shows them (readable
    without root); not visible with why when the kernel exposes none for it."""
    out: dict[str, dict[str, int]] = {}
    missing = []
    for name in AER_FILES:
        f = host.text(device_dir / name)
        if f.seen:
            out[name.removeprefix("aer_dev_")] = parse_aer(f.value)
        else:
            missing.append(f.not_visible)
    if out:
        return Fact(out, host.shown(device_dir))
    why = missing[0] if missing else "not read"
    if why.startswith("not exposed here"):
        why = ("no AER counters in sysfs for this device (no AER capability, AER kept by the firmware, or a kernel "
               "before 4.17)")
    return hidden(host.shown(device_dir / AER_FILES[0]), why)


def counter_rise(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """The counters that grew between two readings of ``where -> kind -> name -> count`` (pure), as
    ``"<where> <kind> <name>" -> growth``; a counter missing from either reading is not compared."""
    out: dict[str, int] = {}
    for where, kinds in after.items():
        was = before.get(where)
        if not isinstance(kinds, dict) or not isinstance(was, dict):
            continue
        for kind, counts in kinds.items():
            old = was.get(kind)
            if not isinstance(counts, dict) or not isinstance(old, dict):
                continue
            for name, count in counts.items():
                prior = old.get(name)
                if isinstance(count, int) and isinstance(prior, int) and count > prior:
                    out[f"{where} {kind} {name}"] = count - prior
    return out


@dataclass(frozen=True)
class Chain:
    """A device and the bridges above it, nearest first, up to its root port; ``root_complex`` names the host
    bridge's bus (``pci0000:00``)."""

    address: str
    bridges: tuple[tuple[str, Path], ...] = ()
    root_complex: str = ""
    device_dir: Path | None = None
    fact: Fact = field(default_factory=Fact)


def chain_of(host: Host, address: str) -> Chain:
    if not host.pci.is_dir():
        return Chain(address, fact=hidden(host.shown(host.pci), "no /sys/bus/pci here (a container or VM without "
                                                                "the host's PCI tree)"))
    link = host.pci / address
    try:
        real = link.resolve(strict=True)
    except OSError as exc:
        return Chain(address, fact=hidden(host.shown(link), why_unreadable(exc)))
    except RuntimeError as exc:  # a symbolic link loop (Path.resolve raises RuntimeError before Python 3.13)
        return Chain(address, fact=hidden(host.shown(link), f"unreadable: {exc}"[:200]))
    parts = real.parts
    at = [i for i, p in enumerate(parts) if is_address(p)]
    if not at or parts[at[-1]] != address:
        return Chain(address, device_dir=real, fact=hidden(host.shown(real), "the device path names no PCI chain"))
    bridges = tuple((parts[i], Path(*parts[:i + 1])) for i in reversed(at[:-1]))
    rc = parts[at[0] - 1] if at[0] > 0 and parts[at[0] - 1].startswith("pci") else ""
    return Chain(address, bridges, rc, real, Fact([a for a, _ in bridges], host.shown(real)))


def nvidia_gpus(host: Host, unread: list[str] | None = None) -> Fact:
    """The NVIDIA display-class functions sysfs lists (their PCI addresses, in address order). A function that
    may be one but whose vendor or class file cannot be read or parsed is not counted; it is named in
    ``unread`` (``"<address>: why"``), so a GPU is never left out without a word."""
    try:
        names = sorted(os.listdir(host.pci))
    except OSError as exc:
        return hidden(host.shown(host.pci), why_unreadable(exc))
    found = []
    for name in names:
        vendor, klass = host.text(host.pci / name / "vendor"), host.text(host.pci / name / "class")
        v, k = _hex(vendor), _hex(klass)
        if v == NVIDIA and k is not None and k >> 16 == 0x03:
            found.append(name)
        elif unread is not None and (v == NVIDIA and k is None or v is None and (k is None or k >> 16 == 0x03)):
            bad = vendor if v is None else klass
            why = bad.not_visible or f"unparsable {str(bad.value)[:40]!r}"
            unread.append(f"{name}: {bad.source or host.shown(host.pci / name)}: {why}")
    return Fact(found, host.shown(host.pci))


# --- the process and the machine -----------------------------------------------------------------------------


def sys_admin(host: Host) -> Fact:
    """Whether this process holds CAP_SYS_ADMIN (which reading all of configuration space needs)."""
    status = host.text(host.at("proc", "self", "status"))
    if not status.seen:
        return status
    for line in status.value.splitlines():
        if line.startswith("CapEff:"):
            try:
                return Fact(bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1), status.source)
            except (IndexError, ValueError):
                break
    return hidden(status.source, "no CapEff line")


def virtual_machine(host: Host) -> Fact:
    """Whether the CPU says it runs under a hypervisor (the ``hypervisor`` flag)."""
    info = host.text(host.at("proc", "cpuinfo"))
    if not info.seen:
        return info
    flags = next((ln for ln in info.value.splitlines() if ln.startswith(("flags", "Features"))), None)
    if flags is None:
        return hidden(info.source, "no flags line")
    return Fact("hypervisor" in flags.split(), info.source)


# --- the path between two devices ----------------------------------------------------------------------------


def path_between(a: Chain, b: Chain) -> tuple[str, list[str]]:
    """Where the upward paths of two devices meet, and the bridges a transfer between them crosses (pure):
    each side's bridges below the meeting bridge, and the meeting bridge itself."""
    above_b = [addr for addr, _ in b.bridges]
    for i, (addr, _) in enumerate(a.bridges):
        if addr in above_b:
            j = above_b.index(addr)
            return f"bridge {addr}", [x for x, _ in a.bridges[:i + 1]] + above_b[:j]
    crossed = [x for x, _ in a.bridges] + above_b
    if a.root_complex and a.root_complex == b.root_complex:
        return f"root complex {a.root_complex}", crossed
    if a.root_complex and b.root_complex:
        return f"two root complexes ({a.root_complex}, {b.root_complex})", crossed
    return "not visible", crossed
