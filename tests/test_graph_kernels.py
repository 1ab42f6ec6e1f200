"""Which kernels a captured CUDA graph launches, read from CUDA's DOT print of the graph (inenv/kit/_kernels.py):
mangled names made readable, kernel nodes told from the others, and the profiler left for graphs torch did not
keep. The DOT text is the shape CUDA 13 printed for a graph captured on an H100 (torch 2.11's ``debug_dump`` of a
``keep_graph=True`` graph), with a memset node and an NCCL kernel added."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from inenv.kit import _kernels
from inenv.probes import stepmodel

ADD = ("_ZN2at6native29vectorized_elementwise_kernelILi8ENS0_21CUDAFunctorOnSelf_addIN3c108BFloat16EEESt5arrayIPcLm2"
       "EEEEviT0_T1_")
NCCL = "_Z40ncclDevKernel_AllReduce_Sum_bf16_RING_LL24ncclDevKernelArgsStorageILm4096EE"


def _node(index: int, label: str) -> str:
    return (f'"graph_4_node_{index}"[style="bold" shape="record" label="{{{label}\n'
            f"| {{ID | {index} (topoId: {index}) | {{body}}}}\n"
            "| {{node handle | func handle} | {0x00000000510B7568 | 0x000000005095A510}}\n"
            "| {cooperative | 0}\n| {priority | 0}\n}\"];\n")


def _kernel(index: int, mangled: str) -> str:
    return _node(index, "KERNEL").replace("{body}", mangled + r"\<\<\<4,128,0\>\>\>")


DOT = ('digraph dot {\nsubgraph cluster_4 {\nlabel="graph_4" graph[style="dashed"];\n'
       + _kernel(0, ADD)
       + _node(1, "MEMSET").replace("{body}", "dst 0x7f00")
       + _kernel(2, NCCL) + _kernel(3, NCCL)
       + '"graph_4_node_0" -> "graph_4_node_1";\n}\n}\n')


def test_mangled_names_become_qualified_names_without_arguments() -> None:
    assert _kernels.readable(ADD) == "at::native::vectorized_elementwise_kernel"
    assert _kernels.readable(NCCL) == "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
    # an anonymous namespace, a template kernel in a named one
    assert (_kernels.readable("_ZN12_GLOBAL__N_131all_reduce_one_shot_push_kernelI13__nv_bfloat16EEvv")
            == "(anonymous namespace)::all_reduce_one_shot_push_kernel")
    assert (_kernels.readable("_ZN4vllm26cross_device_reduce_1stageI13__nv_bfloat16Li2EEEvPNS_8RankDataE")
            == "vllm::cross_device_reduce_1stage")
    assert _kernels.readable("_ZL10local_stepv") == "local_step"  # internal linkage


def test_names_it_cannot_follow_are_kept_as_they_are() -> None:
    assert _kernels.readable("ampere_sgemm_32x32_sliced1x4_tn") == "ampere_sgemm_32x32_sliced1x4_tn"
    assert _kernels.readable("_Z99short") == "_Z99short"  # a length past the name's end
    assert _kernels.readable("_Zq") == "_Zq"


def test_kernel_nodes_are_counted_and_other_nodes_are_not() -> None:
    assert _kernels.dot_kernels(DOT) == Counter({"at::native::vectorized_elementwise_kernel": 1,
                                                 "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 2})
    assert _kernels.dot_kernels('digraph dot {\n"n"[label="{MEMSET\n| {ID | 0 | x}}"];\n}\n') == Counter()


class _Graph:
    """A captured graph's surface: ``debug_dump`` writes ``text`` (nothing when None), ``replay`` runs nothing."""

    def __init__(self, text: str | None) -> None:
        self.text = text

    def debug_dump(self, path: str) -> None:
        if self.text is not None:
            Path(path).write_text(self.text)

    def replay(self) -> None:
        pass


def test_a_kept_graph_is_read_and_one_torch_kept_not_goes_to_the_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _kernels.launched(_Graph(DOT)) == (_kernels.dot_kernels(DOT), _kernels.FROM_GRAPH)
    profiled: list[Any] = []

    def profile(replay: Any) -> Counter[str]:
        profiled.append(replay)
        return Counter({"void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*)": 1})

    monkeypatch.setattr(_kernels, "profiled", profile)
    unkept = _Graph(None)
    names, how = _kernels.launched(unkept)
    assert how == _kernels.FROM_PROFILER and profiled == [unkept.replay]
    assert names == Counter({"void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*)": 1})
    assert isinstance(_kernels.graph_kernels(unkept), str)
    assert _kernels.graph_kernels(_Graph("digraph dot {\n}\n")) == Counter()  # a graph of no kernel
    assert isinstance(_kernels.graph_kernels(_Graph('"n"[label="{KERNEL | {node handle | 0x1}}"];')), str)
    eager = lambda: None  # noqa: E731 - an eager call: run under the profiler
    assert _kernels.launched(eager)[1] == _kernels.FROM_PROFILER and profiled[-1] is eager


def test_the_step_records_what_the_graph_launched_and_whether_it_was_nccl() -> None:
    found = stepmodel.kernels_of(_Graph(DOT))
    assert found == {"kernels": {"at::native::vectorized_elementwise_kernel": 1,
                                 "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 2},
                     "nccl": True, "read_from": "graph"}
    own = _kernels.readable("_ZN4vllm26cross_device_reduce_1stageI13__nv_bfloat16Li2EEEvPNS_8RankDataE")
    assert stepmodel.kernels_of(_Graph(_kernel(0, "_ZN4vllm26cross_device_reduce_1stageI13__nv_bfloat16Li2EEEvPNS_"
                                              "8RankDataE")))["nccl"] is False
    assert own == "vllm::cross_device_reduce_1stage"
