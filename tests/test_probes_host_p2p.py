"""host-p2p without a GPU: its plan, NVML read through a stand-in module, the facts variant on a fake sysfs
tree and on this machine, and the verdicts each kind of variant reaches from what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inenv import worker
from inenv.kit import _p2p, _pci
from inenv.probe import QUICK, HostView, Variant
from inenv.probes import host_p2p as hp
from tests.checks_helpers import ROOT
from tests.test_pci import fake_host


def keys(host: HostView) -> list[str]:
    return [v.key for v in hp.variants(host)]


def test_the_plan_by_gpu_count() -> None:
    none = hp.variants(HostView(gpu_count=0))
    assert [v.key for v in none] == ["ranks=1,check=facts", "ranks=2,check=copy,pair=0-1",
                                     *(f"ranks=2,check=nccl,pair=0-1,p2p={s}" for s in hp.P2P_SETTINGS)]
    assert none[0].skip is None and all(v.skip is not None and v.skip.code == "no-gpu" for v in none[1:])
    one = hp.variants(HostView(gpu_count=1))
    assert all(v.skip is not None and v.skip.code == "too-few-gpus" for v in one[1:])
    assert all(v.skip is None for v in hp.variants(HostView(gpu_count=2)))
    four = keys(HostView(gpu_count=4))
    assert sum("check=copy" in k for k in four) == 6 and sum("check=nccl" in k for k in four) == 6
    eight = keys(HostView(gpu_count=8))
    # every pair gets the copy check, pairs beyond GPU 0 included; NCCL a bounded set: 0-1, the farthest pair,
    # the pair across the middle and the last two
    assert [k for k in eight if "check=copy" in k] == [f"ranks=2,check=copy,pair={a}-{b}" for a in range(8)
                                                       for b in range(a + 1, 8)]
    assert [k.split("pair=")[1].split(",")[0] for k in eight if "check=nccl" in k] == [
        p for p in ("0-1", "0-7", "3-4", "6-7") for _ in hp.P2P_SETTINGS]
    six = keys(HostView(gpu_count=6))
    assert sum("check=copy" in k for k in six) == 15
    assert {k.split("pair=")[1].split(",")[0] for k in six if "check=nccl" in k} == {"0-1", "0-5", "2-3", "4-5"}
    assert len(keys(HostView(gpu_count=8, level=QUICK))) == 5


def test_the_worker_runs_the_facts_variant_without_a_gpu_and_refuses_the_pairs() -> None:
    mod = SimpleNamespace(SPEC=hp.SPEC)
    facts = Variant("host-p2p", 1, (("check", "facts"),))
    copy = Variant("host-p2p", 2, (("check", "copy"), ("pair", "0-1")))
    assert worker.skip_reason(mod, facts, 0) is None
    assert worker.skip_reason(mod, copy, 0) == ("no-gpu", "no GPU on this host")
    assert worker.skip_reason(mod, copy, 1) == ("too-few-gpus", "needs 2 GPUs, host has 1")
    assert worker.skip_reason(mod, Variant("host-p2p", 1, (("check", "nccl"),)), 2)[0] == "too-few-ranks"


# --- NVML through a stand-in -----------------------------------------------------------------------------


class NvmlError(Exception):
    pass


class FakeNvml:
    """Two PCIe GPUs at 03:00.0 and 04:00.0 meeting at a host bridge; P2P write refused by the chipset."""

    def __init__(self, addresses: tuple[str, ...] = ("00000000:03:00.0", "00000000:04:00.0"),
                 nvlink: bool = False) -> None:
        self.addresses, self.nvlink = addresses, nvlink

    def nvmlDeviceGetCount(self) -> int:
        return len(self.addresses)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self.addresses[h].encode())

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA RTX PRO 6000 Blackwell"

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.95.05"

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return 1  # idle

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return 5

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, h: int) -> int:
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return 8 if h == 0 else 16

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return 16

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if not self.nvlink:
            raise NvmlError("Not Supported")
        return 1 if link < 18 else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return SimpleNamespace(busId=b"00000000:00:00.0")

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return _p2p.NVLINK_SWITCH

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> int:
        return 4

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 30  # NVML_TOPOLOGY_HOSTBRIDGE

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        assert isinstance(index, int)  # never pynvml's tuple-spelled constant
        return 1 if index == 1 else 0  # write: chipset not supported


def test_a_pair_finds_its_devices_by_the_host_indices_it_was_placed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """pair=3-7 placed on the host's GPUs 3 and 7 sees them as CUDA devices 0 and 1 (the runner says which host
    GPUs they are); not placed, it sees every GPU by its host index; placed without one of them, it says so."""
    monkeypatch.delenv("STACKPROBE_LANE_GPUS", raising=False)
    assert hp.pair_devices((3, 7), 8) == ((3, 7), "")
    assert hp.pair_devices((3, 7), 4) == (None, "pair 3-7 needs GPU 7; 4 visible")
    monkeypatch.setenv("STACKPROBE_LANE_GPUS", "3,7")
    assert hp.pair_devices((3, 7), 2) == ((0, 1), "")
    monkeypatch.setenv("STACKPROBE_LANE_GPUS", "7,3")
    assert hp.pair_devices((3, 7), 2) == ((1, 0), "")
    monkeypatch.setenv("STACKPROBE_LANE_GPUS", "2,3")
    assert hp.pair_devices((3, 7), 2) == (None, "pair 3-7 needs GPU 7; 2 visible (the host's GPUs 2,3)")


def test_nvml_gives_each_gpu_and_pair() -> None:
    view = hp.nvml_view(FakeNvml(), "")
    assert [g["address"] for g in view["gpus"]] == ["0000:03:00.0", "0000:04:00.0"]
    assert view["gpus"][0]["link"] == {"gen": 1, "max_gen": 5, "gpu_max_gen": 5, "width": 8, "max_width": 16}
    assert view["gpus"][0]["nvlink"] == {"active": [], "stopped_at": "NvmlError: Not Supported"}
    pair = view["pairs"]["0-1"]
    assert pair["topology"] == "PHB" and pair["p2p"]["write"] == "chipset not supported"
    assert pair["p2p"]["read"] == "ok" and set(pair["p2p"]) == {"read", "write", "nvlink", "atomics", "pci"}
    assert hp.nvml_pair(view, "0000:04:00.0", "0000:03:00.0") is pair
    switched = hp.nvml_view(FakeNvml(nvlink=True), "")
    assert switched["pairs"]["0-1"]["topology"] == "NV18" and switched["pairs"]["0-1"]["nvlinks"] == 18
    assert hp.nvml_view(None, "pynvml is not installed") == {"not_visible": "pynvml is not installed",
                                                             "source": "NVML"}


def test_nvlink_between_two_gpus_direct_or_through_switches() -> None:
    a = {"address": "a", "nvlink": {"active": [{"remote": "b"}, {"remote": "b"}, {"remote": "c"}]}}
    b = {"address": "b", "nvlink": {"active": [{"remote": "a"}]}}
    assert _p2p.nvlinks_between(a, b) == 2
    s1 = {"address": "a", "nvlink": {"active": [{"remote": "x", "switch": True}] * 18}}
    s2 = {"address": "b", "nvlink": {"active": [{"remote": "y", "switch": True}] * 12}}
    assert _p2p.nvlinks_between(s1, s2) == 12 and _p2p.nvlinks_between(s1, {"address": "b"}) == 0


# --- what the facts say ------------------------------------------------------------------------------------


def test_a_link_below_its_maximum_is_named_with_how_far() -> None:
    narrow = hp.LinkView("GPU 1 (0000:04:00.0)", width=8, max_width=16, max_speed=32.0, idle_speed=2.5)
    assert hp.link_problem(narrow) == ("GPU 1 (0000:04:00.0) trained at x8 of x16: 50% of its 63.0 GB/s per "
                                       "direction")
    slow = hp.LinkView("GPU 0 (a)", width=16, max_width=16, speed=16.0, max_speed=32.0, slot_speed=16.0)
    assert hp.link_problem(slow) == ("GPU 0 (a) ran at Gen4 (16 GT/s) under load, the card supports Gen5 (32 GT/s) "
                                     "(the port above it allows Gen4 (16 GT/s)): 50% of its 63.0 GB/s per direction")
    idle = hp.LinkView("GPU 0 (a)", width=16, max_width=16, idle_speed=2.5, max_speed=32.0)
    assert hp.link_problem(idle) is None  # an idle GPU lowers its speed on purpose
    assert hp.link_problem(hp.LinkView("GPU 0")) is None


def path(**kw: Any) -> hp.PathView:
    base: dict[str, Any] = {"labels": ("GPU 0 (0000:03:00.0)", "GPU 1 (0000:04:00.0)"), "meets_at": "bridge x",
                            "iommu": _pci.Fact("passthrough", "/sys/kernel/iommu_groups/7/type=identity")}
    return hp.PathView(**{**base, **kw})


def test_the_likely_cause_names_the_bridge_and_the_iommu_mode() -> None:
    acs = path(redirect=(("0000:02:00.0", "switch downstream port", ("RR", "CR")),),
               iommu=_pci.Fact("translated", "/sys/kernel/iommu_groups/7/type=DMA-FQ"), topology="PXB")
    code, note = hp.likely_cause(acs)
    assert code == "p2p-acs-redirect"
    assert note == ("ACS redirect on the path: 0000:02:00.0 (switch downstream port) RR+CR; IOMMU translated "
                    "(/sys/kernel/iommu_groups/7/type=DMA-FQ); NVML topology PXB, meeting at bridge x")
    code, note = hp.likely_cause(path(iommu=_pci.Fact("translated", "/dev/kmsg: iommu: Default domain type: "
                                                      "Translated")))
    assert code == "p2p-iommu-translated" and note.startswith("IOMMU translated (/dev/kmsg")
    code, note = hp.likely_cause(path(acs_hidden=(("0000:01:00.0", "needs root"),),
                                      p2p=(("read", "ok"), ("write", "chipset not supported"))))
    assert code == "" and "ACS not visible on 0000:01:00.0: needs root" in note
    assert "the driver reports P2P write chipset not supported" in note


def test_the_facts_of_a_fake_two_gpu_pcie_host(tmp_path: Path) -> None:
    r = hp.host_facts(fake_host(tmp_path), None, "torch is not installed", FakeNvml(), "")
    assert (r["status"], r["reason_code"]) == ("partial", "pcie-link-degraded")
    note = r["note"]
    assert note.startswith("GPU 0 (0000:03:00.0) trained at x8 of x16: 50% of its 63.0 GB/s per direction")
    assert "the driver refuses peer-to-peer: GPU 0-1: P2P write chipset not supported" in note
    assert ("bridge 0000:02:00.0 (switch downstream port) has RR+CR on, on the path of pair(s) 0-1") in note
    assert "the IOMMU translates the GPUs' DMA (translated: /sys/kernel/iommu_groups/7/type=DMA-FQ" in note
    assert "not visible: 0000:01:00.0: the kernel exposes 256 bytes" in note
    assert r["metrics"]["gpus"] == 2 and r["metrics"]["acs_redirect_bridges"] == 1
    e = r["evidence"]
    assert [g["index_source"] for g in e["gpus"]] == ["NVML", "NVML"]
    assert [b["address"] for b in e["gpus"][0]["upstream"]] == ["0000:02:00.0", "0000:01:00.0", "0000:00:01.1"]
    assert e["paths"]["0-1"]["meets_at"] == "bridge 0000:01:00.0" and e["paths"]["0-1"]["topology"] == "PHB"
    assert e["iommu"]["mode"]["value"] == "translated"
    json.dumps(r)


def test_the_facts_without_nvml_take_the_gpus_from_sysfs(tmp_path: Path) -> None:
    r = hp.host_facts(fake_host(tmp_path), None, "torch is not installed", None, "pynvml is not installed")
    assert [g["index_source"] for g in r["evidence"]["gpus"]] == ["sysfs address order"] * 2
    assert r["reason_code"] == "pcie-link-degraded" and "driver refuses" not in r["note"]


def test_the_facts_of_an_empty_container(tmp_path: Path) -> None:
    r = hp.host_facts(_pci.Host(tmp_path), None, "torch sees no CUDA device", None, "pynvml is not installed")
    assert (r["status"], r["reason_code"]) == ("skip", "no-gpu")
    assert r["note"].startswith("no GPU visible (torch sees no CUDA device; pynvml is not installed; sysfs: ")
    assert "IOMMU not visible" in r["note"]


def test_one_gpu_passes_with_its_facts(tmp_path: Path) -> None:
    host = fake_host(tmp_path)
    r = hp.host_facts(host, None, "", FakeNvml(addresses=("00000000:04:00.0",)), "")
    assert r["status"] == "pass" and r["note"].endswith("IOMMU translated; one GPU: no pair to check")
    assert "likely cause" not in hp.nccl_verdict("default", {"step": "x", "hung": "90 s"}, path(), {}, {})["note"]


def test_nvlink_pairs_leave_acs_and_the_iommu_out(tmp_path: Path) -> None:
    r = hp.host_facts(fake_host(tmp_path), None, "", FakeNvml(nvlink=True), "")
    assert r["reason_code"] == "pcie-link-degraded"
    assert "ACS" not in r["note"] and "IOMMU translates" not in r["note"] and "not visible" not in r["note"]


def test_the_facts_variant_on_this_machine() -> None:
    """Through the worker, as `checks run` starts it: facts or reasons, never a traceback."""
    variant = json.dumps(Variant("host-p2p", 1, (("check", "facts"),)).to_json())
    proc = subprocess.run([sys.executable, "-m", "inenv.worker", "--probe", "host-p2p", "--variant", variant,
                           "--gpus", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("@@STACKPROBE-RESULT@@"))
    r = json.loads(line.split("@@STACKPROBE-RESULT@@", 1)[1])
    assert r["status"] in ("skip", "pass", "partial"), r
    assert "traceback" not in r["evidence"], r["evidence"].get("traceback")
    mode = r["evidence"]["iommu"]["mode"]
    assert "value" in mode or mode["not_visible"]


# --- pair verdicts ---------------------------------------------------------------------------------------


def test_the_pair_rate_is_nvlink_or_the_slower_pcie_link() -> None:
    fast = hp.LinkView("GPU 0 (a)", width=16, max_width=16, max_speed=32.0)
    slow = hp.LinkView("GPU 1 (b)", width=8, max_width=16, max_speed=32.0)
    rate, basis = hp.pair_rate((fast, slow), path(), 0, None)
    assert rate == pytest.approx(31.5, abs=0.1) and basis == "PCIe Gen5 x8 (32 GT/s) of GPU 1 (b), the slower link"
    rate, basis = hp.pair_rate((fast, slow), path(topology="NV18"), 18, 4)
    assert (rate, basis) == (450.0, "18 NVLink4 link(s) x 25 GB/s")


def test_a_copy_that_did_nothing_is_told_from_one_that_wrote_wrong_words() -> None:
    assert hp.copy_kind(100, 100, 100, 0)["verdict"] == "no-op"
    assert hp.copy_kind(100, 100, 0, 100)["verdict"] == "zero"
    assert hp.copy_kind(100, 30, 30, 0) == {"verdict": "wrong", "detail": "30/100 words differ (30 still hold the "
                                                                          "fill)"}
    assert hp.copy_kind(100, 0, 0, 0) == {"verdict": "exact"}


GOOD = {"0->1 copy-engine": {"verdict": "exact"}, "1->0 copy-engine": {"verdict": "exact"}}
RATE = {"unidir_gbs": {"0->1": 50.1, "1->0": 49.0}, "unidir_of_link": 0.795, "link_basis": "PCIe Gen5 x16"}


def test_copy_verdicts() -> None:
    both = {"0->1": True, "1->0": True}
    r = hp.copy_verdict(path(), both, GOOD, RATE, {})
    assert (r["status"], r["note"]) == ("pass", "peer access both ways, copies exact, 50.1 GB/s one way, 80% of "
                                                "PCIe Gen5 x16")
    r = hp.copy_verdict(path(), {"0->1": False, "1->0": False}, GOOD, RATE, {})
    assert (r["status"], r["reason_code"]) == ("partial", "p2p-unavailable") and "staged through host" in r["note"]
    acs = path(redirect=(("0000:00:01.1", "root port", ("RR", "CR")),))
    hung = {**GOOD, "0->1 small": {"verdict": "hang", "detail": "device work not finished after 20 s"}}
    r = hp.copy_verdict(acs, both, hung, {}, {})
    assert (r["status"], r["reason_code"]) == ("fail", "p2p-acs-redirect")
    assert "0000:00:01.1 (root port) RR+CR" in r["note"] and "0->1 small" in r["note"]
    noop = {**GOOD, "1->0 kernel-strided": {"verdict": "no-op", "detail": "nothing arrived"}}
    r = hp.copy_verdict(path(), both, noop, {}, {})
    assert (r["status"], r["reason_code"]) == ("fail", "p2p-copy-wrong") and "1->0 kernel-strided: no-op" in r["note"]
    r = hp.copy_verdict(path(), both, {"0->1 small": {"verdict": "error", "detail": "RuntimeError: x"}}, {}, {})
    assert (r["status"], r["reason_code"]) == ("fail", "p2p-copy-failed")


def test_nccl_verdicts_name_the_cause_only_where_p2p_was_on() -> None:
    translated = path(iommu=_pci.Fact("translated", "/sys/kernel/iommu_groups/7/type=DMA-FQ"))
    hung = {"step": "allreduce of 14336 bytes", "hung": "not finished after 90 s", "checks": {}}
    r = hp.nccl_verdict("default", hung, translated, {}, {"transports": ["P2P/CUMEM"]})
    assert (r["status"], r["reason_code"]) == ("fail", "p2p-iommu-translated")
    assert r["note"].startswith("with NCCL's defaults: allreduce of 14336 bytes hung (not finished after 90 s); "
                                "transports: P2P/CUMEM; likely cause: IOMMU translated")
    assert "the p2p=disabled variant of this pair" in r["note"]
    r = hp.nccl_verdict("disabled", hung, translated, {}, {})
    assert (r["status"], r["reason_code"]) == ("fail", "nccl-op-hang") and "NCCL's own failure" in r["note"]
    ok = {"step": "done", "checks": {"14336": {"verdict": "exact"}, "8388608": {"verdict": "exact"}}}
    r = hp.nccl_verdict("level-loc", ok, translated, {}, {"transports": ["SHM/direct/direct"]})
    assert (r["status"], r["note"]) == ("pass", "first allreduces exact with NCCL_P2P_LEVEL=LOC (transports: "
                                                "SHM/direct/direct)")
    wrong = {"step": "done", "checks": {"14336": {"verdict": "no-op", "detail": "output equals its own input"}}}
    r = hp.nccl_verdict("default", wrong, path(), {}, {})
    assert (r["status"], r["reason_code"]) == ("fail", "nccl-wrong-result")
    failed = {"step": "communicator initialisation", "error": "DistBackendError: NCCL error: invalid usage"}
    assert hp.nccl_verdict("disabled", failed, path(), {}, {})["reason_code"] == "nccl-invalid-usage"


def test_each_setting_sets_and_removes_its_variables() -> None:
    assert hp.p2p_env("default") == ({}, ["NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL"])
    assert hp.p2p_env("disabled") == ({"NCCL_P2P_DISABLE": "1"}, ["NCCL_P2P_LEVEL"])
    assert hp.p2p_env("level-loc") == ({"NCCL_P2P_LEVEL": "LOC"}, ["NCCL_P2P_DISABLE"])


def test_the_facts_share_the_gpu_and_the_copies_have_it_alone() -> None:
    """The facts variant times nothing: it runs beside variants sharing the GPU (on a lent H100 it had waited
    8.7 s for them to drain, holding every shared variant behind it); the copy check times the link alone."""
    from checks.run import runner
    from checks.run.plan import CellTarget, WorkItem
    from inenv.probe import untimed

    facts = Variant("host-p2p", 1, (("check", "facts"),))
    copy = Variant("host-p2p", 2, (("check", "copy"),))
    assert untimed(hp.SPEC, facts) and not untimed(hp.SPEC, copy)
    item = WorkItem(CellTarget("c", "resolved"), hp.SPEC, facts, 330.0)
    assert runner.shares_gpu(item)


def test_the_facts_of_a_host_without_an_nvidia_gpu_are_read_before_any_rank_starts(tmp_path: Path) -> None:
    """No device node and no NVIDIA GPU in sysfs: the facts are read in the worker (a rank would import
    torch.distributed for seconds first, on every run of every cell) and say the same; a device node or an
    NVIDIA GPU in sysfs, or any other check, launches the ranks."""
    (tmp_path / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    facts = Variant("host-p2p", 1, (("check", "facts"),))
    got = hp.preflight(facts, _pci.Host(tmp_path))
    assert got is not None and (got["status"], got["reason_code"]) == ("skip", "no-gpu")
    assert "no NVIDIA device node (/dev/nvidiactl) and no NVIDIA GPU in sysfs" in got["note"]
    assert got["evidence"]["gpus"] == []
    assert hp.preflight(Variant("host-p2p", 2, (("check", "copy"),)), _pci.Host(tmp_path)) is None
    (tmp_path / "dev" / "nvidiactl").write_text("")
    assert hp.preflight(facts, _pci.Host(tmp_path)) is None
    assert hp.preflight(facts, fake_host(tmp_path / "with-gpus")) is None  # two NVIDIA GPUs in its sysfs
