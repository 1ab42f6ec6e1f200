"""Host facts: parsing nvidia-smi output, stable host ids, secrets dropped, a host without a GPU."""

from __future__ import annotations

import shutil

from checks.results import hostfacts

# `nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits` on a 2x H200 host.
QUERY_2XH200 = """0, NVIDIA H200, 00000000:18:00.0, 9.0, 143771, 580.159.04, 345, 1980, 3201, 700.00, Enabled
1, NVIDIA H200, 00000000:2A:00.0, 9.0, 143771, 580.159.04, 345, 1980, 3201, 700.00, Enabled
"""
TOPO_NVLINK = """\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\t0-47\t0\t\tN/A
GPU1\tNV18\t X \t0-47\t0\t\tN/A
"""
TOPO_PCIE = """\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity
GPU0\t X \tNODE\tSYS\tSYS\t0-31
GPU1\tNODE\t X \tSYS\tSYS\t0-31
GPU2\tSYS\tSYS\t X \tNODE\t32-63
GPU3\tSYS\tSYS\tNODE\t X \t32-63
"""
# Recorded on the lent H200 machine (2026-11-29), escapes included.
QUERY_H200 = "0, NVIDIA H200, 00000000:00:06.0, 9.0, 143771, 580.159.04, 345, 1980, 3201, 700.00, Enabled\n"
TOPO_H200 = "\t\x1b[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\nGPU0\t X \t0-15\t0\t\tN/A\n"
BANNER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: 13.0     |
+-----------------------------------------+------------------------+----------------------+
"""


def test_parse_gpu_query() -> None:
    gpus = hostfacts.parse_gpu_csv(QUERY_2XH200 + "garbage line\n")
    assert len(gpus) == 2
    g = gpus[1]
    assert g["index"] == 1 and g["name"] == "NVIDIA H200" and g["compute_capability"] == "9.0"
    assert g["memory_mib"] == 143771 and g["power_limit_w"] == 700 and g["clocks_max_sm_mhz"] == 1980
    assert g["pci_bus_id"] == "00000000:2A:00.0"


def test_parse_not_supported_fields() -> None:
    row = "0, NVIDIA RTX PRO 6000 Blackwell Server Edition, 00000000:01:00.0, 12.0, 97887, 580.95.05, [N/A], " \
          "[N/A], [N/A], [N/A], Disabled\n"
    [g] = hostfacts.parse_gpu_csv(row)
    assert g["compute_capability"] == "12.0" and g["clocks_sm_mhz"] is None and g["power_limit_w"] is None


def test_recorded_h200() -> None:
    [g] = hostfacts.parse_gpu_csv(QUERY_H200)
    assert g["name"] == "NVIDIA H200" and g["compute_capability"] == "9.0" and g["driver"] == "580.159.04"
    assert hostfacts.strip_ansi(TOPO_H200).startswith("\tGPU0\tCPU Affinity")
    assert hostfacts.interconnect(TOPO_H200, 1) == "single GPU"
    assert hostfacts.host_id([g], "x").startswith("h200x1-")


def test_driver_cuda_and_interconnect() -> None:
    assert hostfacts.parse_driver_cuda(BANNER) == "13.0"
    assert hostfacts.parse_driver_cuda("no banner") is None
    assert hostfacts.interconnect(TOPO_NVLINK, 2) == "NVLink (NV18)"
    assert hostfacts.interconnect(TOPO_PCIE, 4) == "PCIe (worst path SYS)"
    assert hostfacts.interconnect(None, 1) == "single GPU"


def test_host_id_is_stable_and_reveals_no_hostname() -> None:
    gpus = hostfacts.parse_gpu_csv(QUERY_2XH200)
    a = hostfacts.host_id(gpus, "gpu-node-17.internal")
    assert a == hostfacts.host_id(gpus, "gpu-node-17.internal")
    assert a.startswith("h200x2-") and "node" not in a
    assert a != hostfacts.host_id(gpus, "gpu-node-18.internal")
    assert hostfacts.host_id([], "box").startswith("cpu-")


def test_secrets_are_dropped_and_only_relevant_env_kept() -> None:
    env = {"NCCL_ALGO": "Tree", "NCCL_IB_TOKEN": "s3cr3t", "HF_TOKEN": "x", "CUDA_VISIBLE_DEVICES": "0,1",
           "AWS_SECRET_ACCESS_KEY": "y", "HOME": "/root", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVIDIA_API_KEY": "z", "SGLANG_PASSWORD": "p"}
    assert hostfacts.safe_env(env) == {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_ALGO": "Tree",
                                       "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def test_collect_on_this_host() -> None:
    facts = hostfacts.collect(env={"NCCL_DEBUG": "INFO", "MY_TOKEN": "t"})
    assert facts["env"] == {"NCCL_DEBUG": "INFO"}
    if shutil.which("nvidia-smi") is None:  # the development box: facts say there is no GPU, and why
        assert facts["gpu_count"] == 0 and facts["gpus"] == []
        assert facts["no_gpu_reason"] == "nvidia-smi not found"
        assert facts["host_id"].startswith("cpu-")
        assert hostfacts.host_view(facts).gpu_count == 0
    else:
        assert facts["gpu_count"] >= 1 and facts["no_gpu_reason"] is None


def test_inspect_fills_sm_count_peer_access_and_nccl() -> None:
    inspect = {"versions": {"nccl": "2.28.9"}, "gpus": [{"index": 0, "sm_count": 132}],
               "peer_access": [[True]], "multicast": [False]}
    facts = hostfacts.collect(inspect)
    assert facts["nccl"] == "2.28.9" and facts["peer_access"] == [[True]] and facts["multicast"] == [False]
    view = hostfacts.host_view({"gpu_count": 2, "compute_capability": "9.0"}, ("12.0a",))
    assert view.gpu_count == 2 and view.target_archs == ("12.0a",)


def test_with_inspect_adds_the_environments_facts_without_touching_the_smi_facts() -> None:
    smi = {"host_id": "h200x2-00000000", "gpu_count": 2,
           "gpus": [{"index": 0, "name": "NVIDIA H200"}, {"index": 1, "name": "NVIDIA H200"}]}
    inspect = {"versions": {"nccl": "2.30.7"}, "gpus": [{"index": 1, "sm_count": 132}, "junk"],
               "peer_access": [[True, True], [True, True]], "multicast": [True, True]}
    facts = hostfacts.with_inspect(smi, inspect)
    assert facts["gpus"] == [{"index": 0, "name": "NVIDIA H200"},
                             {"index": 1, "name": "NVIDIA H200", "sm_count": 132}]
    assert facts["nccl"] == "2.30.7" and facts["multicast"] == [True, True] and facts["host_id"] == "h200x2-00000000"
    assert smi["gpus"][1] == {"index": 1, "name": "NVIDIA H200"} and "nccl" not in smi
    assert hostfacts.with_inspect(smi, None)["peer_access"] == []


# `nvidia-smi topo -m` as it prints them: four GPUs with NICs beside them.
_TOPO_ALL_NV = """\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity
GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-47
GPU1\tNV18\t X \tNV18\tNV18\tPXB\t0-47
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t48-95
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t48-95
NIC0\tPXB\tPXB\tSYS\tSYS\t X
"""
_TOPO_ONE_PCIE_PAIR = _TOPO_ALL_NV.replace("GPU2\tNV18\tNV18\t X \tNV18", "GPU2\tNV18\tNV18\t X \tSYS").replace(
    "GPU3\tNV18\tNV18\tNV18\t X ", "GPU3\tNV18\tNV18\tSYS\t X ")


def test_the_page_and_the_placement_read_every_pair_nvlink_the_same_way() -> None:
    from checks.run import placement

    for topo, word, switched in ((_TOPO_ALL_NV, "NVLink (NV18)", True),
                                 (_TOPO_ONE_PCIE_PAIR, "mixed NVLink/PCIe", False)):
        assert hostfacts.interconnect(topo, 4) == word
        assert placement.switched({"gpu_count": 4, "topology": topo}) is switched
    # eight NV words in the text but a matrix that lacks GPU3's row: not every pair is known to be NVLink
    cut = "\n".join(line for line in _TOPO_ALL_NV.splitlines() if not line.startswith("GPU3"))
    assert hostfacts.all_nvlink(cut, 4) is None and not placement.switched({"gpu_count": 4, "topology": cut})
    assert hostfacts.all_nvlink(_TOPO_ALL_NV, 1) is None  # one GPU has no pair
