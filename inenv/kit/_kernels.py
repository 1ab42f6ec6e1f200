"""Which GPU kernels a captured CUDA graph launches, read from the graph itself.

A replay of a graph launches exactly the graph's kernel nodes, so their names say which kernel a backend chose
(its own, or NCCL's after a fallback) without running the graph under a profiler: torch's profiler spends about
5 s starting CUPTI the first time in each process (5.1 s measured on an H100; 5.3-6.3 s each for eight processes
starting it at once), a quarter of a step variant's seconds with a GPU per rank (4.2-4.6 of 15-18 s). A graph
captured with ``_device.capture(..., keep=True)`` keeps CUDA's graph object (torch's ``keep_graph``), and CUDA
prints it as DOT (``cudaGraphDebugDotPrint``, through ``CUDAGraph.debug_dump``): one record per node, a kernel
node's holding the kernel's mangled name. :func:`dot_kernels` reads those names and :func:`readable` turns each
into its qualified name without template arguments or parameters (``vllm::cross_device_reduce_1stage``).

:func:`launched` is what a probe calls: the graph's kernels, or, where torch keeps no graph (a torch before
``keep_graph``) or the print's kernel nodes are in a form this module does not read, one replay under torch's
profiler.

In-environment side: the standard library, and torch inside the functions.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

from inenv.kit import _errors

FROM_GRAPH, FROM_PROFILER = "graph", "profiler"  # how a launched record's names were read (its ``read_from``)
# A kernel node's record in CUDA's DOT: "{KERNEL ... | {ID | <id> | <mangled name>\<\<\<grid,block,smem\>\>\>}"
_KERNEL_NODE = re.compile(r"\{KERNEL(?:\\n|\s)*\|\s*\{ID\s*\|[^|]*\|\s*([^|{}\\<\s]+)")
_SOURCE_NAME = re.compile(r"(\d+)")
_ANONYMOUS = "_GLOBAL__N_"  # how the Itanium ABI spells an anonymous namespace's name
_ABBREVIATIONS = {"St": "std"}


def readable(mangled: str) -> str:
    """A kernel's qualified name from its Itanium-mangled name, without template arguments or parameters
    (``_ZN4vllm26cross_device_reduce_1stageI...`` -> ``vllm::cross_device_reduce_1stage``); a name that is not
    mangled (an ``extern "C"`` kernel) or that this reading does not follow is returned as it is (pure)."""
    if not mangled.startswith("_Z"):
        return mangled
    pos = 2
    if mangled.startswith("L", pos):  # internal linkage
        pos += 1
    nested = mangled.startswith("N", pos)
    pos += nested
    parts: list[str] = []
    while pos < len(mangled):
        abbrev = mangled[pos:pos + 2]
        if abbrev in _ABBREVIATIONS:
            parts.append(_ABBREVIATIONS[abbrev])
            pos += 2
            continue
        if mangled[pos] in "KVr" and nested and not parts:  # cv-qualifiers of a member function
            pos += 1
            continue
        found = _SOURCE_NAME.match(mangled, pos)
        if found is None:
            break
        size, start = int(found.group(1)), found.end()
        name = mangled[start:start + size]
        if len(name) != size:
            return mangled
        parts.append("(anonymous namespace)" if name.startswith(_ANONYMOUS) else name)
        pos = start + size
        if not nested:
            break
    return "::".join(parts) if parts else mangled


def dot_kernels(text: str) -> Counter[str]:
    """The kernels of a graph by readable name and count, from CUDA's DOT print of it (pure): every kernel node's,
    a child graph's too; memset, memcpy, event and host nodes are not kernels."""
    return Counter(readable(m.group(1)) for m in _KERNEL_NODE.finditer(text))


def graph_kernels(graph: Any) -> Counter[str] | str:
    """The kernels ``graph`` (captured with ``keep=True``) launches on every replay, by name and count; the reason
    as text when the graph cannot be read (not kept, a torch without ``debug_dump``, kernel nodes in a form
    :func:`dot_kernels` does not follow)."""
    try:
        with tempfile.TemporaryDirectory(prefix="stackprobe-graph-") as folder:
            path = os.path.join(folder, "graph.dot")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch announces every dump with a warning
                graph.debug_dump(path)
            if not os.path.exists(path):
                return "torch kept no graph to print (a torch before keep_graph)"
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
    except Exception as exc:
        return _errors.error_tail(exc, 200)
    names = dot_kernels(text)
    if not names and "KERNEL" in text:  # kernel nodes in a form this reading does not follow
        return "the graph's kernel nodes could not be read"
    return names  # empty: the graph launches no kernel (an allreduce a world of one makes in place)


def profiled(replay: Callable[[], None]) -> Counter[str] | str:
    """The GPU kernels one run of ``replay`` launched, by name and count (torch's profiler; memset and memcpy left
    out); the error text when the profiler cannot say."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        names: Counter[str] = Counter()
        for evt in prof.events():
            if str(getattr(evt, "device_type", "")).endswith("CUDA") and "memcpy" not in evt.name.lower() \
                    and "memset" not in evt.name.lower():
                names[evt.name] += 1
        return names
    except Exception as exc:
        return _errors.error_tail(exc, 200)


def launched(ran: Any) -> tuple[Counter[str] | str, str]:
    """The kernels ``ran`` launches and how they were read: a captured graph's from the graph itself
    (:data:`FROM_GRAPH`), else one replay under the profiler (:data:`FROM_PROFILER`); an eager call (any other
    callable) is run once under the profiler."""
    replay = getattr(ran, "replay", None)
    if replay is None:
        return profiled(ran), FROM_PROFILER
    names = graph_kernels(ran)
    if isinstance(names, Counter):
        return names, FROM_GRAPH
    return profiled(replay), FROM_PROFILER
