"""host-p2p's readers on odd sysfs trees (a link loop, garbage class and NUMA files): the GPU that could not be
read is named and the verdict is partial, never a GPU dropped without a word; and NVML's atomics bit per pair as
the p2p-no-native-atomics verdict, which `checks advise` reads for the backends whose signals are P2P atomics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checks.report import advise
from checks.results import hostresults
from checks.results.result import ProbeResult, Verdict
from inenv.kit import _p2p, _pci
from inenv.probes import host_p2p as hp
from inenv.status import Status
from tests.checks_helpers import ROOT
from tests.test_pci import fake_host
from tests.test_probes_host_p2p import FakeNvml

LOOPED = "0000:04:00.0"


def _loop(tmp: Path) -> _pci.Host:
    """The fake two-GPU host with GPU 04:00.0's bus entry a link to itself."""
    host = fake_host(tmp)
    entry = host.pci / LOOPED
    entry.unlink()
    entry.symlink_to(entry.name)
    return host


def test_a_link_loop_is_named_not_raised(tmp_path: Path) -> None:
    host = _loop(tmp_path)
    chain = _pci.chain_of(host, LOOPED)
    assert not chain.fact.seen and chain.device_dir is None
    assert chain.fact.source == f"/sys/bus/pci/devices/{LOOPED}"
    unread: list[str] = []
    assert _pci.nvidia_gpus(host, unread).value == ["0000:03:00.0"]
    assert len(unread) == 1 and unread[0].startswith(f"{LOOPED}: /sys/bus/pci/devices/{LOOPED}/vendor")


def test_the_facts_name_the_gpu_behind_a_link_loop(tmp_path: Path) -> None:
    r = hp.host_facts(_loop(tmp_path), None, "torch is not installed", FakeNvml(), "")
    assert r["status"] == "partial" and r["metrics"]["gpus"] == 2  # NVML lists both: neither is dropped
    assert f"GPU 1 ({LOOPED}): its sysfs facts could not be read" in r["note"]
    gpu1 = r["evidence"]["gpus"][1]
    assert gpu1["address"] == LOOPED and gpu1["unread"]
    json.dumps(r)


def test_sysfs_alone_names_the_gpu_it_could_not_count(tmp_path: Path) -> None:
    """No NVML, no torch: the GPUs come from sysfs. Another host: GPU 03:00.0's NUMA file garbage, GPU 04:00.0's
    class file garbage."""
    host = fake_host(tmp_path)
    gpu0 = next(p for p in (tmp_path / "sys" / "devices").rglob("0000:03:00.0") if p.is_dir())
    gpu1 = next(p for p in (tmp_path / "sys" / "devices").rglob(LOOPED) if p.is_dir())
    (gpu0 / "numa_node").write_text("--5\n")
    (gpu1 / "class").write_text("zz\n")
    port = _pci.read_port(host, gpu0, True)
    assert not port.numa_node.seen and port.numa_node.not_visible == "unparsable '--5'"
    r = hp.host_facts(host, None, "torch is not installed", None, "pynvml is not installed")
    assert r["status"] == "partial" and r["metrics"]["gpus"] == 1
    assert f"sysfs {LOOPED}: /sys/bus/pci/devices/{LOOPED}/class: unparsable 'zz': not counted as a GPU" in r["note"]
    assert r["evidence"]["gpus"][0]["device"]["numa_node"]["not_visible"] == "unparsable '--5'"


def test_one_gpu_that_breaks_a_reader_leaves_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = fake_host(tmp_path)
    real = _pci.read_port

    def fussy(h: _pci.Host, device_dir: Path, admin: bool | None) -> _pci.Port:
        if device_dir.name == LOOPED:
            raise ValueError("a file this reader did not expect")
        return real(h, device_dir, admin)

    monkeypatch.setattr(_pci, "read_port", fussy)
    r = hp.host_facts(host, None, "", FakeNvml(), "")
    assert r["status"] == "partial" and r["metrics"]["gpus"] == 2
    assert f"GPU 1 ({LOOPED}): its sysfs facts could not be read (ValueError: a file this reader" in r["note"]
    gpus = r["evidence"]["gpus"]
    assert "device" in gpus[0] and [b["address"] for b in gpus[0]["upstream"]][0] == "0000:02:00.0"


class NoAtomics(FakeNvml):
    """Peer read and write, no native atomics: what NVML reports for every SM120 pair over PCIe."""

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        return 5 if index == 3 else 0  # atomics: NVML_P2P_STATUS_NOT_SUPPORTED


def test_a_pair_without_native_atomics_is_its_own_verdict(tmp_path: Path) -> None:
    r = hp.host_facts(fake_host(tmp_path), None, "", NoAtomics(nvlink=True), "")
    # NVLink: ACS and the IOMMU do not count; the link of GPU 0 is still degraded, the first finding
    assert r["metrics"]["no_native_atomics"] == {"0-1": "not supported"}
    assert "peer access without native peer-to-peer atomics (NVML): GPU 0-1: atomics not supported" in r["note"]
    assert r["reason_code"] == "pcie-link-degraded"
    fine = hp.host_facts(fake_host(tmp_path / "b"), None, "", FakeNvml(), "")  # write refused: unavailable
    assert fine["metrics"]["no_native_atomics"] == {}


def test_no_native_atomics_is_the_reason_when_nothing_weighs_more() -> None:
    paths = {"0-1": hp.PathView(("GPU 0", "GPU 1"), topology="NV4",
                                p2p=(("read", "ok"), ("write", "ok"), ("atomics", "not supported")))}
    gpus = [hp.Gpu(0, "0000:03:00.0", "NVML"), hp.Gpu(1, LOOPED, "NVML")]
    r = hp.facts_verdict(gpus, paths, _pci.Fact("off", "x"), [], "", [], {})
    assert (r["status"], r["reason_code"]) == ("partial", "p2p-no-native-atomics")
    assert _p2p.no_native_atomics({"0-1": hp.PathView(("a", "b"), p2p=(("read", "ok"), ("write", "ok"),
                                                                      ("atomics", "not visible (x)")))}) == {}


def _facts_result(bare: dict[str, Any]) -> ProbeResult:
    v = Verdict(Status.PARTIAL, note="peer access without native peer-to-peer atomics",
                reason_code="p2p-no-native-atomics", metrics={"no_native_atomics": bare})
    return ProbeResult("20261204T000000Z-bbbb", "h200x2-5bce98f7", "any-cell", "host-p2p", "ranks=1,check=facts", v,
                       "2026-12-04T00:00:00Z")


def test_advise_keeps_symmetric_memory_off_a_host_without_native_atomics() -> None:
    h = hostresults.load(ROOT / "tests" / "golden" / "advise" / "results")["h200x2-5bce98f7"]
    cell = "local-cu130-torch2.11.0-sglnone-fi0.6.18"
    before = advise.advise_cell(h.host_id, cell, 2, h.latest(), h.facts)
    assert advise.ATOMIC_BACKENDS & {c.backend for c in before.curves}  # measured and exact on the 2x H200
    after = advise.advise_cell(h.host_id, cell, 2, [*h.latest(), _facts_result({"0-1": "not supported"})], h.facts)
    assert not advise.ATOMIC_BACKENDS & {c.backend for c in after.curves}
    assert {c.backend for c in after.curves} == {c.backend for c in before.curves} - advise.ATOMIC_BACKENDS
    lines = [a for a in after.avoid if a.reason_code == "p2p-no-native-atomics"]
    assert [a.what for a in lines] == ["symm-mem-one-shot (needs native peer-to-peer atomics)",
                                       "symm-mem-two-shot (needs native peer-to-peer atomics)"]
    assert all("GPUs 0-1: not supported" in a.why for a in lines)
    same = advise.advise_cell(h.host_id, cell, 2, [*h.latest(), _facts_result({})], h.facts)
    assert {c.backend for c in same.curves} == {c.backend for c in before.curves}
