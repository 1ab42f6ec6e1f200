"""host-p2p on the link health the driver hides: the link settings in configuration space (Max_Payload_Size,
Max_Read_Request_Size, ASPM), AER and replay counters read before and after traffic, GPUs of two models, and the
p2p=disabled control beside a failed NCCL check. Configuration space is written byte by byte from the PCI Express
Base Specification's layout (the offsets and encodings below), sysfs is a fake tree in a temporary folder, NVML a
stand-in module; the control runs for real in fresh processes over gloo on the CPU."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from inenv.kit import _p2p, _pci
from inenv.probe import RankContext, Variant
from inenv.probes import host_p2p as hp
from inenv.probes import p2pnccl as pn
from tests.test_pci import fake_host, put16, put32, root_port_config
from tests.test_probes_host_p2p import FakeNvml, path

# PCI Express capability (at 0x58 in root_port_config): +0x04 Device Capabilities (bits 2:0 Max_Payload_Size
# Supported), +0x08 Device Control (bits 7:5 Max_Payload_Size, 14:12 Max_Read_Request_Size), +0x0C Link Capabilities
# (bits 11:10 ASPM Support), +0x10 Link Control (bits 1:0 ASPM Control). Size encodings: 0 = 128 bytes, 1 = 256,
# 2 = 512, 3 = 1024, 4 = 2048, 5 = 4096. ASPM: 0 none, 1 L0s, 2 L1, 3 L0s and L1.
PCIE = 0x58


def link_config(mps: int, mrrs: int, aspm: int, mps_supported: int = 2, aspm_supported: int = 3) -> bytes:
    cfg = root_port_config(0x0000)
    put32(cfg, PCIE + 0x04, mps_supported)
    put16(cfg, PCIE + 0x08, mps << 5 | mrrs << 12)
    put32(cfg, PCIE + 0x0C, 0x5 | 16 << 4 | aspm_supported << 10)  # 32 GT/s, x16, ASPM support
    put16(cfg, PCIE + 0x10, aspm)
    return bytes(cfg)


def test_the_link_settings_are_read_from_the_pcie_capability() -> None:
    c = _pci.parse_config(link_config(mps=1, mrrs=2, aspm=2))
    assert c.pcie is not None
    assert c.pcie.settings() == {"mps": 256, "mps_supported": 512, "mrrs": 512, "aspm": "L1",
                                 "aspm_supported": "L0s+L1"}
    off = _pci.parse_config(link_config(mps=0, mrrs=5, aspm=0, mps_supported=5, aspm_supported=0))
    assert off.pcie is not None and off.pcie.settings() == {"mps": 128, "mps_supported": 4096, "mrrs": 4096,
                                                            "aspm": "disabled", "aspm_supported": "disabled"}
    assert _pci.parse_config(link_config(mps=7, mrrs=6, aspm=3)).pcie.settings()["mps"] is None  # type: ignore[union-attr]


def _gpu_dir(tmp: Path, address: str) -> Path:
    return next(p for p in (tmp / "sys" / "devices").rglob(address) if p.is_dir())


def test_without_root_aspm_comes_from_the_kernels_link_files_and_the_sizes_say_why_not(tmp_path: Path) -> None:
    host = fake_host(tmp_path)
    gpu = _gpu_dir(tmp_path, "0000:03:00.0")  # its config file holds the 64 bytes a reader without root gets
    (gpu / "link").mkdir()
    (gpu / "link" / "l0s_aspm").write_text("0\n")
    (gpu / "link" / "l1_aspm").write_text("1\n")
    port = _pci.read_port(host, gpu, False)
    assert port.settings.seen and port.settings.value["aspm"] == "L1" and port.settings.value["mps"] is None
    assert port.settings.value["not_visible"].startswith("payload and read request sizes: needs root")
    (gpu / "link" / "l1_aspm").unlink()
    hidden = _pci.read_port(host, gpu, False).settings
    assert not hidden.seen and "needs root" in hidden.not_visible and "l1_aspm" not in hidden.not_visible
    assert hidden.not_visible.endswith("/link: not exposed here (no such file)")


def _with_settings(tmp: Path, gpu_aspm: int, bridge_mps: int) -> _pci.Host:
    """The fake host with GPU 03:00.0's configuration space whole (MPS 256, MRRS 512) and its switch port's MPS
    ``bridge_mps`` (an encoding)."""
    host = fake_host(tmp)
    (_gpu_dir(tmp, "0000:03:00.0") / "config").write_bytes(link_config(mps=1, mrrs=2, aspm=gpu_aspm))
    (_gpu_dir(tmp, "0000:02:00.0") / "config").write_bytes(link_config(mps=bridge_mps, mrrs=2, aspm=0))
    return host


def test_aspm_on_and_a_payload_size_unlike_the_ports_are_named(tmp_path: Path) -> None:
    r = hp.host_facts(_with_settings(tmp_path, gpu_aspm=3, bridge_mps=0), None, "", FakeNvml(), "")
    assert ("link settings on a GPU's path: GPU 0 (0000:03:00.0): ASPM L0s+L1 on at 0000:03:00.0; Max_Payload_Size "
            "256 bytes, 128 at the port above it (0000:02:00.0)") in r["note"]
    gpu0 = r["evidence"]["gpus"][0]
    assert gpu0["device"]["link_settings"]["value"]["mrrs"] == 512
    assert gpu0["upstream"][0]["link_settings"]["value"]["mps"] == 128
    calm = hp.host_facts(_with_settings(tmp_path / "b", gpu_aspm=0, bridge_mps=1), None, "", FakeNvml(), "")
    assert "link settings" not in calm["note"]


class TwoModels(FakeNvml):
    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA GeForce RTX 5090" if h == 1 else b"NVIDIA RTX PRO 6000 Blackwell"


def test_two_gpu_models_on_one_host_are_named(tmp_path: Path) -> None:
    r = hp.host_facts(fake_host(tmp_path), None, "", TwoModels(), "")
    assert ("GPUs of more than one model: NVIDIA RTX PRO 6000 Blackwell (GPU 0); NVIDIA GeForce RTX 5090 (GPU 1)"
            in r["note"])
    assert [g["model"] for g in r["evidence"]["gpus"]] == ["NVIDIA RTX PRO 6000 Blackwell", "NVIDIA GeForce RTX 5090"]
    one = hp.host_facts(fake_host(tmp_path / "b"), None, "", FakeNvml(), "")
    assert "more than one model" not in one["note"]
    a, b = hp.Gpu(0, "0000:03:00.0", "CUDA", name="NVIDIA H100 80GB HBM3"), hp.Gpu(1, None, "CUDA", name="NVIDIA A100")
    assert _p2p.two_models(a, b) == "a pair of two GPU models (GPU 0: NVIDIA H100 80GB HBM3, GPU 1: NVIDIA A100)"
    assert _p2p.two_models(a, a) == "" and _p2p.two_models(a, hp.Gpu(2, None, "CUDA")) == ""


AER = {"correctable": "RxErr 0\nBadTLP {tlp}\nBadDLLP 0\nRollover 0\nTimeout {timeout}\nNonFatalErr 0\n"
                      "CorrIntErr 0\nHeaderOF 0\nTOTAL_ERR_COR {total}\n",
       "nonfatal": "Undefined 0\nDLP 0\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nTOTAL_ERR_NONFATAL 0\n",
       "fatal": "Undefined 0\nDLP 0\nSDES 0\nTOTAL_ERR_FATAL 0\n"}


def _aer(folder: Path, tlp: int, timeout: int) -> None:
    for kind, text in AER.items():
        (folder / f"aer_dev_{kind}").write_text(text.format(tlp=tlp, timeout=timeout, total=tlp + timeout))


class Replays(FakeNvml):
    def __init__(self, replays: dict[int, int]) -> None:
        super().__init__()
        self.replays = replays

    def nvmlDeviceGetHandleByPciBusId(self, bus: bytes) -> int:
        return [a.lower() for a in self.addresses].index("0000" + bus.decode().lower())

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self.replays[h]


def _gpus(host: _pci.Host) -> list[hp.Gpu]:
    return [_p2p.read_gpu(host, hp.Gpu(i, a, "CUDA"), True) for i, a in enumerate(("0000:03:00.0", "0000:04:00.0"))]


def test_aer_and_replay_counters_before_and_after_the_copies(tmp_path: Path) -> None:
    host = fake_host(tmp_path)
    gpu0, switch = _gpu_dir(tmp_path, "0000:03:00.0"), _gpu_dir(tmp_path, "0000:02:00.0")
    _aer(gpu0, tlp=0, timeout=0)
    _aer(switch, tlp=2, timeout=0)
    before, unseen = hp.read_counters(host, _gpus(host), Replays({0: 4, 1: 0}))
    assert before["0000:03:00.0"]["correctable"]["BadTLP"] == 0 and "TOTAL_ERR_COR" not in before["0000:03:00.0"][
        "correctable"]
    assert before["0000:03:00.0 (NVML)"] == {"replay": {"count": 4}}
    # GPU 04:00.0 and the other bridges have no AER files: named with why, never counted as zero
    assert unseen["0000:04:00.0"].startswith("no AER counters in sysfs for this device")
    _aer(gpu0, tlp=3, timeout=1)
    after, _ = hp.read_counters(host, _gpus(host), Replays({0: 9, 1: 0}))
    rise = _pci.counter_rise(before, after)
    assert rise == {"0000:03:00.0 correctable BadTLP": 3, "0000:03:00.0 correctable Timeout": 1,
                    "0000:03:00.0 (NVML) replay count": 5}
    assert _pci.counter_rise(after, after) == {} and _pci.counter_rise({}, after) == {}
    _, blind = hp.read_counters(host, _gpus(host), None)
    assert blind["replay counters (NVML)"] == "NVML is not available here"


GOOD = {"0->1 copy-engine": {"verdict": "exact"}, "1->0 copy-engine": {"verdict": "exact"}}
RATE = {"unidir_gbs": {"0->1": 50.1, "1->0": 49.0}, "unidir_of_link": 0.795, "link_basis": "PCIe Gen5 x16"}
RISE = {"0000:03:00.0 correctable BadTLP": 3, "0000:03:00.0 (NVML) replay count": 5}


def test_exact_copies_while_the_link_retransmits_are_partial() -> None:
    both = {"0->1": True, "1->0": True}
    r = hp.copy_verdict(path(), both, GOOD, RATE, {}, RISE)
    assert (r["status"], r["reason_code"]) == ("partial", "pcie-errors-under-traffic")
    assert ("copies exact, 50.1 GB/s one way, 80% of PCIe Gen5 x16; but PCIe error counters rose during the copies "
            "(0000:03:00.0 (NVML) replay count +5, 0000:03:00.0 correctable BadTLP +3)") in r["note"]
    assert r["metrics"]["pcie_errors"] == 8
    quiet = hp.copy_verdict(path(), both, GOOD, RATE, {}, {})
    assert quiet["status"] == "pass" and quiet["metrics"]["pcie_errors"] == 0
    hung = {**GOOD, "0->1 small": {"verdict": "hang", "detail": "device work not finished after 20 s"}}
    failed = hp.copy_verdict(path(), both, hung, {}, {}, RISE)
    assert failed["status"] == "fail" and failed["note"].endswith("0000:03:00.0 correctable BadTLP +3)")
    named = hp.copy_verdict(path(), both, GOOD, RATE, {}, {}, "a pair of two GPU models (GPU 0: A, GPU 1: B)")
    assert named["note"].startswith("a pair of two GPU models (GPU 0: A, GPU 1: B): peer access both ways")


HUNG = {"step": "allreduce of 14336 bytes", "hung": "not finished after 90 s", "checks": {}}
EXACT = {"step": "done", "checks": {"14336": {"verdict": "exact"}, "8388608": {"verdict": "exact"}},
         "transports": ["SHM/direct/direct"]}


def test_a_control_that_fails_too_reads_as_the_host_not_p2p() -> None:
    translated = path(iommu=_pci.Fact("translated", "/sys/kernel/iommu_groups/7/type=DMA-FQ"))
    both = hp.nccl_verdict("default", HUNG, translated, {}, {"transports": ["P2P/CUMEM"]},
                           {**HUNG, "transports": ["SHM/direct/direct"]})
    assert (both["status"], both["reason_code"]) == ("fail", "p2p-control-failed")
    assert ("the control fails too: with NCCL_P2P_DISABLE=1 allreduce of 14336 bytes hung (not finished after 90 s) "
            "(transports: SHM/direct/direct): the host") in both["note"]
    assert "peer-to-peer is not judged by this variant" in both["note"]
    p2p = hp.nccl_verdict("default", HUNG, translated, {}, {"transports": ["P2P/CUMEM"]}, EXACT)
    assert (p2p["status"], p2p["reason_code"]) == ("fail", "p2p-iommu-translated")
    assert "the control passes: with NCCL_P2P_DISABLE=1 the same allreduces are exact" in p2p["note"]
    lost = hp.nccl_verdict("default", HUNG, path(), {}, {}, {"not_run": "a peer rank never said how its attempt went"})
    assert lost["reason_code"] == "nccl-op-hang" and "did not run (a peer rank never said" in lost["note"]
    assert hp.nccl_verdict("default", EXACT, path(), {}, {}, None)["status"] == "pass"


def test_the_control_environment_disables_p2p_and_rendezvous_elsewhere() -> None:
    env = pn.control_env({"NCCL_P2P_LEVEL": "NVL", "MASTER_PORT": "1", "PYTHONPATH": "/x", "KEEP": "1"},
                         "127.0.0.1", 4242)
    assert env["NCCL_P2P_DISABLE"] == "1" and "NCCL_P2P_LEVEL" not in env and env["KEEP"] == "1"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "4242")
    assert env["PYTHONPATH"].split(":")[1] == "/x" and (Path(env["PYTHONPATH"].split(":")[0]) / "inenv").is_dir()


def _rank(rank: int, store: Any, workdir: Path, broke: bool, out: dict[int, Any]) -> None:
    ctx = RankContext(rank, 2, rank, None, Variant("host-p2p", 2, (("check", "nccl"), ("p2p", "default"))), workdir)
    out[rank] = hp.p2p_control(ctx, store, None, broke, backend="gloo")


def test_the_control_runs_in_fresh_processes_when_one_rank_failed(tmp_path: Path) -> None:
    """Two ranks over a real store: rank 1's attempt failed, so both start the control, each in a fresh interpreter
    with NCCL_P2P_DISABLE=1, which rendezvous on the port rank 0 chose and allreduce exactly (gloo on the CPU: the
    same steps first_allreduces takes with NCCL on a GPU)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, timedelta(seconds=60))
    out: dict[int, Any] = {}
    threads = [threading.Thread(target=_rank, args=(r, s, tmp_path, r == 1, out)) for r, s in ((0, server),
                                                                                              (1, client))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert set(out) == {0, 1}, out
    for rank, box in out.items():
        assert not hp.failed(box), (rank, box)
        assert box["env"] == {"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "(unset)"}
        assert box["pid"] > 0 and set(box["checks"]) == {str(n * 2) for n in pn.NCCL_ELEMS}


def test_no_control_where_every_attempt_passed_and_a_silent_peer_is_named(tmp_path: Path) -> None:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    ctx = RankContext(0, 1, 0, None, Variant("host-p2p", 1), tmp_path)
    assert hp.p2p_control(ctx, server, None, False, backend="gloo") is None
    lonely = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    port, why = pn.agree_on_control(lonely, 0, 2, True, 1.0)  # rank 1 never says
    assert port is None and why.startswith("a peer rank never said how its attempt went")


def test_the_control_process_reports_what_it_could_not_do(tmp_path: Path) -> None:
    ctx = RankContext(0, 1, 0, None, Variant("host-p2p", 1), tmp_path)
    box = pn.run_control(ctx, None, 1, backend="no-such-backend")
    assert hp.failed(box) and box["env"]["NCCL_P2P_DISABLE"] == "1", box
    assert "no-such-backend" in json.dumps(box), box
