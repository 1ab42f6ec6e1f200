"""The IOMMU the GPUs' DMA goes through: its mode (``translated``, ``passthrough``, ``off``...) and every fact it is
decided from, read from the best source there is: the GPUs' own IOMMU groups, every group's domain type, the IOMMU
units sysfs lists, the kernel log's default domain type (``/dev/kmsg``, read without blocking and without consuming
anything), the kernel command line's IOMMU and ACS parameters.

Every reader takes the :class:`inenv.kit._pci.Host` it reads under and returns :class:`inenv.kit._pci.Fact` values:
what was read and where, or ``not_visible`` with the reason, never a guess. Everything here only reads.

In-environment side: standard library only.
"""

from __future__ import annotations

import errno
import os
import re
from collections import Counter
from typing import Any

from inenv.kit._pci import Fact, Host, hidden, why_unreadable

IOMMU_PARAMS = ("iommu", "intel_iommu", "amd_iommu", "iommu.passthrough", "iommu.strict", "pci",
                "pcie_acs_override")
GROUP_MODES = {"identity": "passthrough", "DMA": "translated", "DMA-FQ": "translated", "blocked": "blocked",
               "unmanaged": "unmanaged"}
_DEFAULT_DOMAIN = re.compile(r"Default domain type: (\w+)")
_LOG_WORDS = re.compile(r"iommu|DMAR|AMD-Vi|SMMU|ACS", re.IGNORECASE)


def cmdline_iommu(text: str) -> dict[str, str]:
    """The kernel command line's IOMMU and ACS parameters (before ``--``, which starts init's arguments)."""
    out: dict[str, str] = {}
    for token in (text or "").split():
        if token == "--":
            break
        key, eq, value = token.partition("=")
        if key in IOMMU_PARAMS:
            out[key] = value if eq else ""
    return out


def cmdline_mode(params: dict[str, str]) -> tuple[str, str] | None:
    """(mode, the parameter that says so) when the command line sets the mode outright."""
    for key in ("iommu", "amd_iommu"):
        if "pt" in params.get(key, "").split(","):
            return "passthrough", f"{key}={params[key]}"
    if params.get("iommu.passthrough") in ("1", "on", "y"):
        return "passthrough", f"iommu.passthrough={params['iommu.passthrough']}"
    if params.get("iommu.passthrough") in ("0", "off", "n"):
        return "translated", f"iommu.passthrough={params['iommu.passthrough']}"
    for key in ("iommu", "intel_iommu", "amd_iommu"):
        if "off" in params.get(key, "").split(","):
            return "off", f"{key}={params[key]}"
    if params.get("iommu") == "nopt":
        return "translated", "iommu=nopt"
    return None


def log_mode(lines: list[str]) -> tuple[str, str] | None:
    """(mode, the line) from the kernel's ``iommu: Default domain type: Translated`` line."""
    for line in lines:
        m = _DEFAULT_DOMAIN.search(line)
        if m:
            word = m.group(1).lower()
            return ({"translated": "translated", "passthrough": "passthrough"}.get(word, word), line.strip())
    return None


def read_kernel_log(host: Host, records: int = 200000) -> Fact:
    """The kernel log's IOMMU and ACS lines, read from /dev/kmsg without blocking (each reader has its own
    position: nothing is consumed)."""
    path = host.at("dev", "kmsg")
    shown = host.shown(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return hidden(shown, "no /dev/kmsg here (a container without the host's kernel log)")
    except PermissionError:
        return hidden(shown, "needs root (the kernel restricts its log: kernel.dmesg_restrict)")
    except OSError as exc:
        return hidden(shown, why_unreadable(exc))
    found: list[str] = []
    try:
        for _ in range(records):
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the record was overwritten while reading: go on with the next
                    continue
                if exc.errno == errno.EPERM:
                    return hidden(shown, "needs root (the kernel restricts its log: kernel.dmesg_restrict)")
                break
            if not chunk:
                break
            for line in chunk.decode(errors="replace").splitlines():
                if not line or line.startswith(" "):
                    continue
                text = line.split(";", 1)[1] if ";" in line else line
                if _LOG_WORDS.search(text) and len(found) < 40:
                    found.append(text.strip()[:200])
    finally:
        os.close(fd)
    return Fact(found, shown)


def group_types(host: Host) -> Fact:
    """How many IOMMU groups have each domain type (``DMA-FQ``, ``identity``...)."""
    root = host.at("sys", "kernel", "iommu_groups")
    try:
        groups = sorted(os.listdir(root))
    except OSError as exc:
        return hidden(host.shown(root), why_unreadable(exc))
    counts: Counter[str] = Counter()
    for g in groups:
        t = host.text(root / g / "type")
        counts[t.value if t.seen else "(type not readable)"] += 1
    return Fact(dict(sorted(counts.items())), host.shown(root))


def iommu_units(host: Host) -> Fact:
    root = host.at("sys", "class", "iommu")
    try:
        return Fact(sorted(os.listdir(root)), host.shown(root))
    except OSError as exc:
        return hidden(host.shown(root), why_unreadable(exc))


def decide_mode(gpu_types: list[Fact], types: Fact, units: Fact, log: Fact, cmdline: Fact) -> Fact:
    """The IOMMU mode the GPUs' DMA goes through: ``translated``, ``passthrough``, ``off`` (or ``mixed``,
    ``blocked``, ``unmanaged``), from the best source there is: the GPUs' own groups, every group, the absence
    of any IOMMU unit and group, the kernel log's default domain type, the command line (pure)."""
    seen = [t for t in gpu_types if t.seen]
    if seen:
        modes = sorted({GROUP_MODES.get(t.value, t.value) for t in seen})
        where = ", ".join(f"{t.source}={t.value}" for t in seen)
        return Fact(modes[0] if len(modes) == 1 else "mixed", where)
    if types.seen and types.value:
        modes = sorted({GROUP_MODES.get(t, t) for t in types.value})
        where = f"{types.source}/*/type: " + ", ".join(f"{k} x{v}" for k, v in types.value.items())
        return Fact(modes[0] if len(modes) == 1 else "mixed", where)
    if units.seen and not units.value and types.seen and not types.value:
        # The kernel logs its default domain type whether or not an IOMMU exists: no unit and no group wins.
        return Fact("off", f"{units.source} is empty and {types.source} holds no group")
    if log.seen and (said := log_mode(log.value)):
        return Fact(said[0], f"{log.source}: {said[1]}")
    if cmdline.seen and (said := cmdline_mode(cmdline.value)):
        return Fact(said[0], f"{cmdline.source}: {said[1]}")
    why = "; ".join(f"{f.source}: {f.not_visible}" for f in (types, units, log, cmdline) if not f.seen)
    return hidden("", f"no source says it ({why or 'IOMMU units are listed but no group has a type'})")


def read_iommu(host: Host, gpu_types: list[Fact]) -> tuple[Fact, dict[str, Any]]:
    """The IOMMU mode (:func:`decide_mode`) and every fact it was decided from, as JSON."""
    cmd = host.text(host.at("proc", "cmdline"))
    cmdline = Fact(cmdline_iommu(cmd.value), cmd.source) if cmd.seen else cmd
    units, types, log = iommu_units(host), group_types(host), read_kernel_log(host)
    mode = decide_mode(gpu_types, types, units, log, cmdline)
    return mode, {"mode": mode.to_json(), "units": units.to_json(), "group_types": types.to_json(),
                  "cmdline": cmdline.to_json(), "kernel_log": log.to_json()}
