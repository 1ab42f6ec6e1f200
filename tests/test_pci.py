"""The PCI readers of inenv/kit/_pci.py: configuration space written here byte by byte from the PCI Express
Base Specification's layout (capability ids, offsets and bit positions spelled out below, not taken from the
code under test), a fake sysfs tree, and this machine's real sysfs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from inenv.kit import _iommu, _pci

# --- configuration space from the specification's layout ----------------------------------------------------
# Type 0/1 header: Vendor ID at 0x00 (16 bits), Device ID at 0x02, Status at 0x06 (bit 4: Capabilities List),
# Capabilities Pointer at 0x34. A standard capability: ID byte, Next Pointer byte. Capability IDs: 0x01 Power
# Management, 0x05 MSI, 0x10 PCI Express. PCI Express capability: +0x02 PCI Express Capabilities register (bits
# 7:4 Device/Port Type, 0x4 = Root Port, 0x6 = Downstream Port of a switch), +0x0C Link Capabilities (bits 3:0 Max
# Link Speed, 9:4 Maximum Link Width), +0x12 Link Status (bits 3:0 Current Link Speed, 9:4 Negotiated Link Width);
# speed 4 = 16.0 GT/s, 5 = 32.0 GT/s. Extended capabilities start at 0x100; header: bits 15:0 ID, 19:16 version,
# 31:20 Next Capability Offset. Extended IDs: 0x0001 AER, 0x0002 VC, 0x0003 Device Serial Number, 0x000D ACS,
# 0x0018 LTR, 0x001E L1 PM Substates. ACS: +0x04 ACS Capability register, +0x06 ACS Control register, bits 0 SV,
# 1 TB, 2 RR, 3 CR, 4 UF, 5 EC, 6 DT.


def put16(cfg: bytearray, off: int, value: int) -> None:
    cfg[off:off + 2] = value.to_bytes(2, "little")


def put32(cfg: bytearray, off: int, value: int) -> None:
    cfg[off:off + 4] = value.to_bytes(4, "little")


def ext_header(cap_id: int, version: int, next_offset: int) -> int:
    return cap_id | version << 16 | next_offset << 20


def test_the_extended_header_helper_matches_the_specification_bytes() -> None:
    # ACS (0x000D), version 1, next at 0x1C0: 0x1C01000D, little-endian on the wire.
    assert ext_header(0x000D, 1, 0x1C0).to_bytes(4, "little") == bytes.fromhex("0d00011c")


def root_port_config(acs_control: int = 0x001D) -> bytearray:
    cfg = bytearray(4096)
    put16(cfg, 0x00, 0x1022)  # vendor
    put16(cfg, 0x02, 0x14AB)  # device
    put16(cfg, 0x06, 0x0010)  # status: capabilities list
    cfg[0x34] = 0x40
    cfg[0x40], cfg[0x41] = 0x01, 0x58  # power management -> 0x58
    cfg[0x58], cfg[0x59] = 0x10, 0x00  # PCI Express, last
    put16(cfg, 0x5A, 0x0042)  # version 2, port type 0x4 (root port)
    put32(cfg, 0x58 + 0x0C, 0x5 | 16 << 4)  # link capabilities: 32 GT/s, x16
    put16(cfg, 0x58 + 0x12, 0x4 | 8 << 4)  # link status: 16 GT/s, x8
    # a long extended list with ACS in the middle
    put32(cfg, 0x100, ext_header(0x0001, 2, 0x150))  # AER
    put32(cfg, 0x150, ext_header(0x0002, 1, 0x180))  # VC
    put32(cfg, 0x180, ext_header(0x0003, 1, 0x1A0))  # device serial number
    put32(cfg, 0x1A0, ext_header(0x000D, 1, 0x1C0))  # ACS
    put16(cfg, 0x1A4, 0x007F)  # capability: all seven
    put16(cfg, 0x1A6, acs_control)
    put32(cfg, 0x1C0, ext_header(0x0018, 1, 0x200))  # LTR
    put32(cfg, 0x200, ext_header(0x001E, 1, 0x000))  # L1 PM substates, last
    return cfg


def test_a_root_port_with_acs_in_the_middle_of_a_long_list() -> None:
    c = _pci.parse_config(bytes(root_port_config(0x001D)))  # SV (1) + RR (4) + CR (8) + UF (0x10)
    assert (c.vendor, c.device, c.length) == (0x1022, 0x14AB, 4096)
    assert c.capabilities == ((0x01, 0x40), (0x10, 0x58))
    assert [x[0] for x in c.extended] == [0x0001, 0x0002, 0x0003, 0x000D, 0x0018, 0x001E]
    assert c.pcie is not None and c.pcie.port_type == "root port"
    assert (c.pcie.max_speed, c.pcie.max_width, c.pcie.speed, c.pcie.width) == (32.0, 16, 16.0, 8)
    assert c.acs is not None and c.acs.offset == 0x1A0
    assert _pci.acs_names(c.acs.capability) == ["SV", "TB", "RR", "CR", "UF", "EC", "DT"]
    assert c.acs.enabled == ["SV", "RR", "CR", "UF"]
    assert c.acs.redirecting == ["RR", "CR"]
    assert c.acs_not_visible == "" and c.problems == ()


def test_acs_with_no_redirect_bits_and_a_list_without_acs() -> None:
    c = _pci.parse_config(bytes(root_port_config(0x0011)))  # SV + UF
    assert c.acs is not None and c.acs.enabled == ["SV", "UF"] and c.acs.redirecting == []
    cfg = root_port_config()
    put32(cfg, 0x180, ext_header(0x0003, 1, 0x1C0))  # skip ACS
    c = _pci.parse_config(bytes(cfg))
    assert c.acs is None and c.acs_not_visible == "" and 0x000D not in [x[0] for x in c.extended]


def test_an_extended_list_that_loops_is_cut_and_named() -> None:
    cfg = root_port_config()
    put32(cfg, 0x180, ext_header(0x0003, 1, 0x150))  # back to VC
    c = _pci.parse_config(bytes(cfg))
    assert c.problems == ("extended capability list loops back to 0x150",)
    assert c.acs is None and "broken before any ACS capability" in c.acs_not_visible


def test_acs_found_before_a_loop_is_still_read() -> None:
    cfg = root_port_config()
    put32(cfg, 0x200, ext_header(0x001E, 1, 0x100))  # the last one points back to the first
    c = _pci.parse_config(bytes(cfg))
    assert c.acs is not None and c.acs.redirecting == ["RR", "CR"]
    assert c.problems == ("extended capability list loops back to 0x100",)


def test_a_standard_list_that_loops_or_points_into_the_header() -> None:
    cfg = root_port_config()
    cfg[0x59] = 0x40  # PCI Express -> power management again
    c = _pci.parse_config(bytes(cfg))
    assert "capability list loops back to 0x40" in c.problems and c.pcie is not None
    cfg = root_port_config()
    cfg[0x34] = 0x20
    c = _pci.parse_config(bytes(cfg))
    assert c.problems[0] == "capability pointer 0x20 points into the header" and c.pcie is None


def test_bad_extended_pointers_and_all_ones() -> None:
    cfg = root_port_config()
    put32(cfg, 0x150, ext_header(0x0002, 1, 0x0C0))  # below 0x100
    c = _pci.parse_config(bytes(cfg))
    assert c.problems == ("extended capability at 0x150 points to 0x0c0, below 0x100",) and c.acs is None
    cfg = root_port_config()
    put32(cfg, 0x100, 0xFFFFFFFF)
    c = _pci.parse_config(bytes(cfg))
    assert c.problems == ("extended capability header at 0x100 reads as all ones",)
    assert c.acs is None and c.acs_not_visible
    cfg = root_port_config()
    put32(cfg, 0x100, 0)
    c = _pci.parse_config(bytes(cfg))
    assert c.extended == () and c.acs is None and c.acs_not_visible == ""


def test_short_reads_say_why_acs_is_not_visible() -> None:
    full = bytes(root_port_config())
    c = _pci.parse_config(full[:64], sys_admin=False)
    assert c.acs is None and c.acs_not_visible.startswith("needs root") and "--privileged" in c.acs_not_visible
    assert c.capabilities == () and c.vendor == 0x1022  # the list starts at 0x40, past what was readable
    c = _pci.parse_config(full[:256], sys_admin=False)
    assert c.acs_not_visible.startswith("needs root") and c.pcie is not None
    c = _pci.parse_config(full[:256], sys_admin=True)
    assert "exposes 256 bytes" in c.acs_not_visible and c.pcie is not None and c.pcie.port_type == "root port"
    c = _pci.parse_config(full[:10])
    assert c.vendor is None and "only 10 bytes" in c.acs_not_visible
    c = _pci.parse_config(b"")
    assert c.length == 0 and c.acs_not_visible
    c = _pci.parse_config(b"\xff" * 4096)
    assert c.vendor == 0xFFFF and "all ones" in c.acs_not_visible


def test_link_text_and_rates() -> None:
    assert _pci.parse_speed("16.0 GT/s PCIe") == 16.0
    assert _pci.parse_speed("2.5 GT/s") == 2.5
    assert _pci.parse_speed("Unknown") is None and _pci.parse_speed("") is None
    assert _pci.parse_width("16") == 16 and _pci.parse_width("0") is None and _pci.parse_width("x8") == 8
    assert _pci.link_gbs(32.0, 16) == pytest.approx(63.0, abs=0.1)  # Gen5 x16, 128b/130b
    assert _pci.link_gbs(2.5, 1) == pytest.approx(0.25)  # Gen1, 8b/10b
    assert _pci.link_gbs(None, 16) is None
    assert _pci.spelled(32.0, 16) == "Gen5 x16 (32 GT/s)" and _pci.spelled(None) == "speed unknown"


def test_addresses_in_each_spelling() -> None:
    assert _pci.normal_address("00000000:17:00.0") == "0000:17:00.0"
    assert _pci.normal_address("0000:C1:00.0") == "0000:c1:00.0"
    assert _pci.normal_address("17:00.0") == "0000:17:00.0"
    assert _pci.normal_address("pci0000:00") is None and _pci.normal_address("") is None


def test_the_command_line_and_the_kernel_log() -> None:
    params = _iommu.cmdline_iommu("BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on iommu=pt quiet -- iommu=off")
    assert params == {"intel_iommu": "on", "iommu": "pt"}
    assert _iommu.cmdline_mode(params) == ("passthrough", "iommu=pt")
    assert _iommu.cmdline_mode({"amd_iommu": "off"}) == ("off", "amd_iommu=off")
    assert _iommu.cmdline_mode({"iommu.passthrough": "0"}) == ("translated", "iommu.passthrough=0")
    assert _iommu.cmdline_mode({"intel_iommu": "on"}) is None  # the kernel's build decides the default
    assert _iommu.log_mode(["DMAR: IOMMU enabled", "iommu: Default domain type: Passthrough (set via kernel "
                          "command line)"])[0] == "passthrough"
    assert _iommu.log_mode(["nothing"]) is None


def test_the_mode_comes_from_the_best_source() -> None:
    gpu = _pci.Fact("DMA-FQ", "/sys/kernel/iommu_groups/7/type")
    none = _pci.hidden("/x", "not exposed here (no such file)")
    groups = _pci.Fact({"identity": 3}, "/sys/kernel/iommu_groups")
    units = _pci.Fact(["dmar0"], "/sys/class/iommu")
    log = _pci.Fact(["iommu: Default domain type: Translated"], "/dev/kmsg")
    assert _iommu.decide_mode([gpu], groups, units, log, none).value == "translated"
    assert _iommu.decide_mode([], groups, units, log, none).value == "passthrough"
    mixed = _iommu.decide_mode([gpu, _pci.Fact("identity", "/g/8/type")], groups, units, log, none)
    assert mixed.value == "mixed"
    empty = _pci.Fact({}, "/sys/kernel/iommu_groups")
    off = _iommu.decide_mode([], empty, _pci.Fact([], "/sys/class/iommu"), log, none)
    assert off.value == "off"  # the log's default domain type is a policy, not an IOMMU
    assert _iommu.decide_mode([], empty, units, log, none).value == "translated"
    unknown = _iommu.decide_mode([], none, none, none, none)
    assert not unknown.seen and "no source says it" in unknown.not_visible


# --- a fake sysfs tree ---------------------------------------------------------------------------------------


def device(root: Path, path: str, vendor: int, klass: int, config: bytes | None = None,
           link: tuple[str, str, str, str] | None = None, group: str | None = None) -> Path:
    d = root / "sys" / "devices" / path
    d.mkdir(parents=True)
    address = d.name
    (d / "vendor").write_text(f"0x{vendor:04x}\n")
    (d / "device").write_text("0x1234\n")
    (d / "class").write_text(f"0x{klass:06x}\n")
    (d / "numa_node").write_text("1\n")
    if config is not None:
        (d / "config").write_bytes(config)
    if link:
        for name, value in zip(("current_link_speed", "current_link_width", "max_link_speed", "max_link_width"),
                               link, strict=True):
            (d / name).write_text(value + "\n")
    if group:
        g = root / "sys" / "kernel" / "iommu_groups" / group
        g.mkdir(parents=True, exist_ok=True)
        (d / "iommu_group").symlink_to(os.path.relpath(g, d))
    bus = root / "sys" / "bus" / "pci" / "devices"
    bus.mkdir(parents=True, exist_ok=True)
    (bus / address).symlink_to(os.path.relpath(d, bus))
    return d


def switch_port_config(acs_control: int) -> bytes:
    cfg = root_port_config(acs_control)
    put16(cfg, 0x5A, 0x0062)  # port type 0x6: switch downstream port
    return bytes(cfg)


def fake_host(tmp: Path) -> _pci.Host:
    """Root port 00:01.1 (ACS SV+RR+CR+UF) -> switch 01:00.0 -> downstream ports 02:00.0 (RR+CR) and 02:01.0
    (SV only) -> GPUs 03:00.0 (trained x8 of x16) and 04:00.0; IOMMU groups translated."""
    rp = "pci0000:00/0000:00:01.1"
    device(tmp, rp, 0x1022, 0x060400, bytes(root_port_config(0x001D)), ("32.0 GT/s PCIe", "16", "32.0 GT/s PCIe", "16"))
    device(tmp, f"{rp}/0000:01:00.0", 0x1000, 0x060400, bytes(root_port_config(0x0000))[:256])
    device(tmp, f"{rp}/0000:01:00.0/0000:02:00.0", 0x1000, 0x060400, switch_port_config(0x000C),
           ("32.0 GT/s PCIe", "16", "32.0 GT/s PCIe", "16"))
    device(tmp, f"{rp}/0000:01:00.0/0000:02:01.0", 0x1000, 0x060400, switch_port_config(0x0001),
           ("32.0 GT/s PCIe", "16", "32.0 GT/s PCIe", "16"))
    device(tmp, f"{rp}/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0x10DE, 0x030200, bytes(64),
           ("2.5 GT/s PCIe", "8", "32.0 GT/s PCIe", "16"), group="7")
    device(tmp, f"{rp}/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0x10DE, 0x030000, None,
           ("32.0 GT/s PCIe", "16", "32.0 GT/s PCIe", "16"), group="8")
    for g in ("7", "8"):
        (tmp / "sys" / "kernel" / "iommu_groups" / g / "type").write_text("DMA-FQ\n")
    (tmp / "sys" / "class" / "iommu" / "ivhd0").mkdir(parents=True)
    (tmp / "proc" / "self").mkdir(parents=True)
    (tmp / "proc" / "cmdline").write_text("root=/dev/nvme0n1p2 amd_iommu=on\n")
    (tmp / "proc" / "self" / "status").write_text("Name:\tx\nCapEff:\t000001ffffffffff\n")
    (tmp / "proc" / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu vme sse2\n")
    (tmp / "dev").mkdir()
    (tmp / "dev" / "kmsg").write_text("6,1,10,-;AMD-Vi: Interrupt remapping enabled\n 9,2;continued\n"
                                      "6,2,11,-;iommu: Default domain type: Translated\n")
    return _pci.Host(tmp)


def test_the_chain_above_a_gpu_nearest_first(tmp_path: Path) -> None:
    host = fake_host(tmp_path)
    assert _pci.nvidia_gpus(host).value == ["0000:03:00.0", "0000:04:00.0"]
    c = _pci.chain_of(host, "0000:03:00.0")
    assert [a for a, _ in c.bridges] == ["0000:02:00.0", "0000:01:00.0", "0000:00:01.1"]
    assert c.root_complex == "pci0000:00" and c.fact.source == "/sys/devices/" + (
        "pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0")
    ports = [_pci.read_port(host, d, True) for _, d in c.bridges]
    assert ports[0].port_type.value == "switch downstream port" and ports[0].acs_control is not None
    assert ports[0].acs_control.redirecting == ["RR", "CR"]
    assert ports[1].acs.not_visible.startswith("the kernel exposes 256 bytes")
    assert ports[2].port_type.value == "root port" and ports[2].acs.value["redirect"] == ["RR", "CR"]
    gpu = _pci.read_port(host, c.device_dir, False)
    assert gpu.kind.value == "3D controller" and gpu.ids.value == "10de:1234" and gpu.numa_node.value == 1
    assert (gpu.link.speed.value, gpu.link.width.value, gpu.link.max_speed.value) == (2.5, 8, 32.0)
    assert gpu.iommu_group.value == "7" and gpu.iommu_type.value == "DMA-FQ"
    assert gpu.acs.not_visible.startswith("needs root")
    other = _pci.read_port(host, _pci.chain_of(host, "0000:04:00.0").device_dir, True)
    assert other.config.not_visible == "not exposed here (no such file)" and not other.acs.seen
    json.dumps(gpu.to_json())


def test_the_path_between_two_gpus_meets_at_the_switch(tmp_path: Path) -> None:
    host = fake_host(tmp_path)
    a, b = _pci.chain_of(host, "0000:03:00.0"), _pci.chain_of(host, "0000:04:00.0")
    assert _pci.path_between(a, b) == ("bridge 0000:01:00.0", ["0000:02:00.0", "0000:01:00.0", "0000:02:01.0"])
    lone = _pci.Chain("0000:05:00.0", root_complex="pci0000:80")
    assert _pci.path_between(a, lone)[0] == "two root complexes (pci0000:00, pci0000:80)"


def test_the_iommu_of_the_fake_host(tmp_path: Path) -> None:
    host = fake_host(tmp_path)
    gpu = _pci.read_port(host, _pci.chain_of(host, "0000:03:00.0").device_dir, True)
    mode, facts = _iommu.read_iommu(host, [gpu.iommu_type])
    assert (mode.value, mode.source) == ("translated", "/sys/kernel/iommu_groups/7/type=DMA-FQ")
    assert facts["units"]["value"] == ["ivhd0"] and facts["group_types"]["value"] == {"DMA-FQ": 2}
    assert facts["cmdline"]["value"] == {"amd_iommu": "on"}
    assert facts["kernel_log"]["value"] == ["AMD-Vi: Interrupt remapping enabled",
                                            "iommu: Default domain type: Translated"]
    assert _pci.sys_admin(host).value is True and _pci.virtual_machine(host).value is False


def test_unreadable_and_missing_files_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = fake_host(tmp_path)
    d = _pci.chain_of(host, "0000:03:00.0").device_dir
    real_open = open

    def refuse(path: object, *args: object, **kwargs: object) -> object:
        if str(path).endswith("/config"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(_pci, "open", refuse, raising=False)
    port = _pci.read_port(host, d, False)
    assert port.acs.not_visible == "needs root (permission denied)"
    assert port.config.source == "/sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0/config"
    monkeypatch.undo()
    (d / "config").unlink()
    (d / "config").mkdir()
    assert _pci.read_port(host, d, True).acs.not_visible == "not a file here"
    (d / "current_link_speed").write_text("Unknown\n")
    assert _pci.read_link(host, d).speed.not_visible == "the kernel reports 'Unknown'"


def test_a_container_without_sys_bus_pci(tmp_path: Path) -> None:
    host = _pci.Host(tmp_path)
    chain = _pci.chain_of(host, "0000:03:00.0")
    assert chain.bridges == () and chain.fact.not_visible.startswith("no /sys/bus/pci here")
    assert not _pci.nvidia_gpus(host).seen
    mode, facts = _iommu.read_iommu(host, [])
    assert not mode.seen and facts["kernel_log"]["not_visible"].startswith("no /dev/kmsg here")
    assert not _pci.sys_admin(host).seen and not _pci.virtual_machine(host).seen
    json.dumps(facts)


def test_this_machines_sysfs_gives_facts_or_reasons() -> None:
    """Whatever this machine exposes (a VM with or without a PCI tree): every fact is a value or a reason."""
    host = _pci.Host()
    admin = _pci.sys_admin(host)
    names = sorted(os.listdir(host.pci)) if host.pci.is_dir() else []
    for name in names:
        chain = _pci.chain_of(host, name)
        assert chain.fact.seen, chain.fact
        port = _pci.read_port(host, chain.device_dir, admin.value if admin.seen else None)
        for fact in (port.kind, port.ids, port.numa_node, port.iommu_group, port.iommu_type, port.port_type,
                     port.acs, port.config, port.link.speed, port.link.width):
            assert fact.seen or fact.not_visible, (name, fact)
        json.dumps(port.to_json())
    mode, facts = _iommu.read_iommu(host, [])
    assert mode.seen or mode.not_visible
    json.dumps(facts)
    assert _pci.nvidia_gpus(host).seen == host.pci.is_dir()
