"""stackprobe's reading of each engine release's gate rules: how the engine looks its gate data up and what it
does with what it finds there, for the releases whose code was read. Pure data and two pure helpers.

The engine probe records an engine's gate *data* as the engine holds it (world-size lists, size tables) and,
where the engine has a function that applies a table, that function's own answer. How the engine applies the
rest (the key it builds from the GPU, what a missing entry or a 0 does, a world-size ceiling) is code inside
its communicators' constructors, which need a process group and a GPU to run. Those rules are written here, per
release, as stackprobe's reading of that release's code, with the file and lines read and a fingerprint of
those lines; tests/test_engine_rules.py compares each fingerprint with the release's source as installed, so the
reading fails its test the day the engine's code for the rule changes. A release without a reading here is
shown with its data and judged by no rule.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# How a missing entry is taken, per the engine's code: the backend is not built ("off"), the engine keeps its
# default limit ("default"), or it runs another kernel of the same backend ("kernel").
OFF, DEFAULT, KERNEL = "off", "default", "kernel"
# How the engine spells the compute capability it looks a table up by: "9.0" or 9.
MAJOR_MINOR, MAJOR = "major.minor", "major"


def fingerprint(lines: Sequence[str]) -> str:
    """The first 16 hex digits of the SHA-256 of the lines, each stripped of trailing blanks, joined by
    newlines: a change of any character outside line-end blanks changes it."""
    return hashlib.sha256("\n".join(line.rstrip() for line in lines).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Span:
    """Lines of an engine's source (path inside its wheel, first and last line, 1-based) and their fingerprint."""

    path: str
    first: int
    last: int
    sha: str

    def cite(self) -> str:
        lines = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        return f"{self.path}:{lines}"

    def differs(self, source: str) -> str | None:
        """None when ``source`` (the file's text as installed) holds the lines read; else what differs."""
        lines = source.splitlines()
        if len(lines) < self.last:
            return f"{self.cite()}: the file has {len(lines)} lines"
        got = fingerprint(lines[self.first - 1:self.last])
        return None if got == self.sha else f"{self.cite()}: fingerprint {got}, read as {self.sha}"


def cite(spans: Sequence[Span]) -> str:
    """The spans as "path:first-last, first-last; other path:line", one path named once."""
    by: dict[str, list[str]] = {}
    for s in spans:
        by.setdefault(s.path, []).append(s.cite().rsplit(":", 1)[1])
    return "; ".join(f"{path}:{', '.join(lines)}" for path, lines in by.items())


@dataclass(frozen=True)
class Rule:
    """How one release applies one gate (the engine probe's gate id)."""

    said: str  # the rule, in stackprobe's words
    spans: tuple[Span, ...]
    key: str = ""  # a table's lookup key: MAJOR_MINOR or MAJOR ("" for a list or a single value)
    missing: str = OFF  # a capability or tp with no entry
    zero_off: bool = True  # an entry of 0 leaves the backend out (its size test admits no message)
    above: int | None = None  # a tp above this is left out whatever the list says
    answered_by: str = ""  # the engine probe's answer id whose admitted world sizes admit the backend too

    def cite(self) -> str:
        return cite(self.spans)


@dataclass(frozen=True)
class Reading:
    engine: str  # the engine probe's engine name
    version: str
    rules: Mapping[str, Rule]
    custom_ar: str  # which of the engine's allreducers advice's flashinfer-custom-ar stands for, and why
    custom_ar_spans: tuple[Span, ...] = field(default=())

    def spans(self) -> tuple[Span, ...]:
        return tuple(dict.fromkeys((*(s for r in self.rules.values() for s in r.spans), *self.custom_ar_spans)))


_V = "vllm/distributed/device_communicators/"
_S = "sglang/srt/distributed/device_communicators/"

VLLM_0_33_0 = Reading("vllm", "0.33.0", {
    "custom-ar-world-sizes": Rule(
        "a tp not in the list disables the custom allreduce, and above 8 GPUs it is never used",
        (Span(_V + "custom_all_reduce.py", 211, 219, "dfd57940ec1484a3"),
         Span(_V + "custom_all_reduce.py", 496, 498, "09317592b00b8c28")), above=8),
    "custom-ar-max-bytes": Rule(
        "looked up by \"major.minor\" and tp only where symmetric memory is on; an entry lowers the default "
        "8 MiB limit, a missing one keeps it",
        (Span(_V + "custom_all_reduce.py", 138, 138, "f8eee676276780b2"),
         Span(_V + "custom_all_reduce.py", 237, 251, "b11596ab26037159")), key=MAJOR_MINOR, missing=DEFAULT),
    "symm-mem-max-bytes": Rule(
        "looked up by \"major.minor\" then tp; a missing capability or tp leaves symmetric memory off, and a 0 "
        "admits no message (size <= limit)",
        (Span(_V + "symm_mem.py", 65, 79, "5b08572f044e3750"),
         Span(_V + "symm_mem.py", 117, 125, "d35e562d7eb57881")), key=MAJOR_MINOR),
    "symm-mem-multimem-world-sizes": Rule(
        "looked up by \"major.minor\"; a listed tp runs the multimem kernel, any other the two-shot one (indexed "
        "without a default: this release's table holds the same capabilities as its symmetric-memory size table)",
        (Span(_V + "symm_mem.py", 138, 145, "e42e2e92dfbf0bac"),), key=MAJOR_MINOR, missing=KERNEL,
        zero_off=False),
    "pcie-ipc-world-sizes": Rule(
        "a tp not in the list leaves flashinfer's PCIe IPC allreduce off",
        (Span(_V + "flashinfer_pcie_ipc_all_reduce.py", 72, 79, "73a14500112b3208"),)),
}, custom_ar="vLLM's CustomAllreduce, the kernel flashinfer ships as vllm_comm",
    custom_ar_spans=(Span(_V + "cuda_communicator.py", 157, 165, "7b949cd63e186c32"),))

SGLANG_0_5_23 = Reading("sglang", "0.5.23", {
    "custom-ar-world-sizes": Rule(
        "on CUDA the custom allreduce is CustomAllReduceV2 where its own per-architecture table admits the tp "
        "(the engine's function, asked by the engine probe), else the older CustomAllreduce where this list "
        "holds it; neither: off",
        (Span(_S + "custom_all_reduce.py", 393, 398, "6ed8a312b266ac3a"),
         Span(_S + "custom_all_reduce_v2.py", 582, 597, "464f0c74272c150a"),
         Span(_S + "configs/custom_all_reduce_v2.py", 315, 338, "47f9dc8bb6dd997f"),
         Span(_S + "custom_all_reduce.py", 86, 93, "7a8175d6f56f7653"),
         Span(_S + "custom_all_reduce_utils.py", 466, 473, "b9a5a892c1812b35")),
        answered_by="custom-ar-v2-world-sizes"),
    "custom-ar-max-bytes": Rule(
        "the older CustomAllreduce's one limit at every architecture (size <= limit)",
        (Span(_S + "custom_all_reduce.py", 42, 42, "7ca67c921281aa6c"),
         Span(_S + "custom_all_reduce.py", 270, 274, "b8de46db9769bde4"))),
    "symm-mem-max-bytes": Rule(
        "looked up by the capability's major (an integer) then tp; a missing one leaves symmetric memory off, "
        "and a 0 admits no message (size < limit)",
        (Span(_S + "torch_symm_mem.py", 79, 97, "a29c541c3877bdde"),
         Span(_S + "torch_symm_mem.py", 139, 149, "5e683c15df02e4a8")), key=MAJOR),
    "symm-mem-multimem-world-sizes": Rule(
        "looked up by the major; a listed tp runs the multimem kernel, any other (or no entry) the two-shot one",
        (Span(_S + "torch_symm_mem.py", 174, 176, "8e0e6db4b44217bc"),), key=MAJOR, missing=KERNEL,
        zero_off=False),
    "pcie-ipc-world-sizes": Rule(
        "a tp not in the list leaves flashinfer's PCIe IPC allreduce off",
        (Span(_S + "pcie_ipc_ar.py", 211, 217, "27ab32ee02aebece"),)),
}, custom_ar="SGLang's custom allreduce (CustomAllReduceV2, or the older CustomAllreduce), the same one-shot / "
             "two-shot peer-memory allreduce design as flashinfer's vllm_comm",
    custom_ar_spans=(Span(_S + "custom_all_reduce.py", 393, 398, "6ed8a312b266ac3a"),))

# Every reading this module defines, by engine and release: read off its own names, so a reading added above is
# looked up without a second list to keep
READINGS: dict[tuple[str, str], Reading] = {(r.engine, r.version): r for r in list(globals().values())
                                             if isinstance(r, Reading)}


def reading(engine: str, version: str) -> Reading | None:
    return READINGS.get((engine, version))
