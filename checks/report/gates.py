"""What a serving engine installed in a cell gates on this host: the engine probe's recorded gate data read
against the host's compute capability and tensor-parallel sizes. Pure.

The data is the engine's own (its world-size lists and size tables as the engine probe recorded them, and the
answers of the engine's own functions where it has one that applies a table). How a release applies the rest
(the key it looks a table up by, what a missing entry or a 0 does, a world-size ceiling, which of its
allreducers advice's flashinfer-custom-ar stands for) is stackprobe's reading of that release's code
(checks.report.engine_rules), named with the file and lines read on every line it decides. A release with no
reading is shown with its data and judged by nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checks.report import engine_rules
from checks.report.advise import human_bytes
from checks.report.engine_rules import DEFAULT, KERNEL, MAJOR, MAJOR_MINOR, Reading, Rule
from checks.results.result import ProbeResult
from inenv.probe import HostView
from inenv.status import Status

VERDICT_ROLE = "gate reader"  # what checks.results.provenance.VERDICT_CODE reads this file as
ENGINE_PROBE = "engine"
DEFAULT_TPS = (2, 4, 8)  # the sizes read on a host that does not say how many GPUs it has
# The engine probe's backend names for the backends advice names; which of an engine's allreducers stands for
# flashinfer-custom-ar is each reading's (Reading.custom_ar), shown with the gates.
GATED = {"flashinfer-custom-ar": "custom-ar", "symm-mem-one-shot": "symm-mem", "symm-mem-two-shot": "symm-mem",
         "flashinfer-pcie-ipc": "pcie-ipc"}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


@dataclass(frozen=True)
class GateLine:
    gate: str
    backend: str  # the engine probe's backend name (custom-ar, symm-mem, pcie-ipc)
    text: str
    off: tuple[int, ...] = ()  # tp sizes the engine's rule, applied to its data, leaves out on this host


@dataclass(frozen=True)
class EngineGates:
    cell_id: str
    engine: str  # display name
    version: str
    status: str
    note: str
    result_id: str
    capability: str | None
    tps: tuple[int, ...]
    lines: tuple[GateLine, ...]
    rules: str = ""  # whose rules decided the lines: stackprobe's reading of this release, or none

    def off_for(self, backend: str, tp: int) -> list[GateLine]:
        """The gate lines of ``backend`` (advice's name) whose rule leaves ``tp`` out here."""
        mine = GATED.get(backend)
        return [g for g in self.lines if g.backend == mine and tp in g.off]


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _size(value: Any) -> str:
    return human_bytes(value) if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _entries(table: Mapping[str, Any]) -> str:
    """The table's keys in the order a person reads them (``8.0, 9.0, 10.0, 12.0``), whatever text they hold: a
    numeric part sorts before any other text and among numbers by value."""
    return ", ".join(sorted(map(str, table), key=lambda k: [(0, int(p), "") if p.isdecimal() and p.isascii() else
                                                             (1, 0, p) for p in k.split(".")]))


def _key(rule: Rule, capability: str) -> str:
    return capability.split(".")[0] if rule.key == MAJOR else capability


# what a recorded table's key spelling (the engine probe's "keys") must be for a reading's lookup key
_SPELLING = {MAJOR: "int", MAJOR_MINOR: "str"}


def _said(release: str, rule: Rule) -> str:
    return f"stackprobe's reading of {release}: {rule.said} ({rule.cite()})"


def _answer(answers: Mapping[str, Any], rule: Rule, capability: str | None) -> tuple[str, Mapping[str, Any] | None]:
    """(the answering function's name, its answer at ``capability``; None when it gave none there)."""
    ans = answers.get(rule.answered_by) if rule.answered_by else None
    if not isinstance(ans, Mapping):
        return rule.answered_by, None
    name = str(ans.get("where") or rule.answered_by)
    at = ans.get("at")
    got = at.get(capability) if isinstance(at, Mapping) and capability else None
    return name, got if isinstance(got, Mapping) and _ints(got.get("world_sizes")) is not None else None


def _list(name: str, backend: str, where: str, sizes: list[int], capability: str | None, tps: Sequence[int],
          rule: Rule, answers: Mapping[str, Any], release: str) -> GateLine:
    fn, answer = _answer(answers, rule, capability)
    off, said = [], []
    for n in tps:
        if rule.above is not None and n > rule.above:
            off.append(n)
            said.append(f"tp {n} above {rule.above}: off")
        elif n in sizes:
            said.append(f"tp {n} listed")
        elif not rule.answered_by:
            off.append(n)
            said.append(f"tp {n} not listed")
        elif answer is not None and n in answer["world_sizes"]:
            said.append(f"tp {n} not listed, admitted by the engine's own {fn}")
        elif answer is not None:
            off.append(n)
            said.append(f"tp {n} not listed, nor admitted by the engine's own {fn}")
        else:
            said.append(f"tp {n} not listed; undecided: the engine's own {fn} gave no answer at "
                        f"{capability or 'this host'} in this result")
    return GateLine(name, backend, f"{name} {sizes}: {'; '.join(said)} ({where}); {_said(release, rule)}",
                    tuple(off))


def _table(name: str, backend: str, where: str, gate: Mapping[str, Any], capability: str | None,
           tps: Sequence[int], rule: Rule, release: str) -> GateLine:
    value: Mapping[str, Any] = gate["value"]
    spelled = str(gate.get("keys") or "")
    if rule.key and spelled and _SPELLING.get(rule.key) != spelled:
        return GateLine(name, backend, f"{name}: entries for {_entries(value)} ({where}); not judged: its keys are "
                        f"spelled as {spelled}, and {_said(release, rule)}")
    if capability is None:
        return GateLine(name, backend, f"{name}: entries for {_entries(value)} (no GPU on this host to look up) "
                                       f"({where})")
    key = _key(rule, capability)
    ruled = _said(release, rule)
    if key not in value:
        head = f"{name}: no entry for compute capability {capability} (entries: {_entries(value)}) ({where})"
        if rule.missing == DEFAULT:
            return GateLine(name, backend, f"{head}: the engine keeps its default limit; {ruled}")
        if rule.missing == KERNEL:
            return GateLine(name, backend, f"{head}: the engine runs its other kernel; {ruled}")
        return GateLine(name, backend, f"{head}: off; {ruled}", tuple(tps))
    entry = value[key]
    if isinstance(entry, Mapping):
        off, said = [], []
        for n in tps:
            v = entry.get(str(n))
            if v is None:
                said.append(f"tp {n} no entry" + (": default limit" if rule.missing == DEFAULT else
                                                   ": other kernel" if rule.missing == KERNEL else ": off"))
                if rule.missing not in (DEFAULT, KERNEL):
                    off.append(n)
            elif v == 0 and rule.zero_off:
                said.append(f"tp {n} 0: off")
                off.append(n)
            else:
                said.append(f"tp {n} {_size(v)}")
        return GateLine(name, backend, f"{name}[{key}]: {'; '.join(said)} ({where}); {ruled}", tuple(off))
    if (sizes := _ints(entry)) is not None:
        said_l = "; ".join(f"tp {n} {'listed' if n in sizes else 'not listed'}" for n in tps)
        return GateLine(name, backend, f"{name}[{key}] {sizes}: {said_l} ({where}); {ruled}")
    return GateLine(name, backend, f"{name}[{key}]: {entry!r} ({where}); {ruled}")


def _read(name: str, gate: Mapping[str, Any], capability: str | None, tps: Sequence[int], found: Reading | None,
          answers: Mapping[str, Any], release: str) -> GateLine:
    backend = str(gate.get("backend", ""))
    where = str(gate.get("where", ""))
    if not gate.get("found"):
        return GateLine(name, backend, f"{name}: not read ({gate.get('why', 'no reason recorded')})")
    value = gate.get("value")
    rule = found.rules.get(name) if found is not None else None
    if rule is None:
        return GateLine(name, backend, f"{_shown(name, value, where)}; not judged: stackprobe holds no reading of "
                                       f"{release}'s code for this gate")
    if (sizes := _ints(value)) is not None:
        return _list(name, backend, where, sizes, capability, tps, rule, answers, release)
    if isinstance(value, int) and not isinstance(value, bool):
        off = tuple(tps) if value == 0 and rule.zero_off else ()
        return GateLine(name, backend, f"{name}: {_size(value)} at every architecture ({where}); "
                                       f"{_said(release, rule)}", off)
    if isinstance(value, Mapping):
        return _table(name, backend, where, gate, capability, tps, rule, release)
    return GateLine(name, backend, f"{name}: {value!r} ({where}); not judged: a {type(value).__name__} where "
                                   f"{_said(release, rule)}")


def _shown(name: str, value: Any, where: str) -> str:
    if isinstance(value, Mapping):
        return f"{name}: entries for {_entries(value)} ({where})"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{name}: {_size(value)} ({where})"
    return f"{name}: {value!r} ({where})"


def engine_gates(results: Sequence[ProbeResult], capabilities: Sequence[str], tps: Sequence[int],
                 cell: str | None = None) -> list[EngineGates]:
    """Per cell, engine the engine probe read (an engine absent from the cell is left out) and compute
    capability (none given: the tables' entries only), its gates at each tp size."""
    return [g for cap in (tuple(capabilities) or (None,)) for g in _at(results, cap, tps, cell)]


def capabilities(facts: Mapping[str, Any], results: Iterable[ProbeResult]) -> tuple[str, ...]:
    """The compute capability to read gates at: the host's GPU's, or on a host without one those of the
    architectures fi-jit cross-compiled for there (``12.0a`` -> ``12.0``), or where it recorded none, the
    cross-compile targets a run plans by default."""
    cap = facts.get("compute_capability")
    if isinstance(cap, str) and cap:
        return (cap,)
    archs = {str(r.params.get("arch")) for r in results if r.probe_id == "fi-jit"} or set(HostView().target_archs)
    return tuple(sorted({a.rstrip("af") for a in archs if a[:1].isdigit() and "." in a}))


def _at(results: Sequence[ProbeResult], capability: str | None, tps: Sequence[int],
        cell: str | None) -> list[EngineGates]:
    out = []
    for r in sorted(results, key=lambda r: (r.cell_id, r.variant)):
        if r.probe_id != ENGINE_PROBE or (cell is not None and r.cell_id != cell):
            continue
        if r.verdict.status in (Status.SKIP, Status.NOT_RUN, Status.UNAVAILABLE):
            continue
        ev = r.verdict.evidence
        engine = str(ev.get("engine") or r.params.get("engine", "?"))
        version = str(ev.get("version") or "?")
        shown = ENGINE_NAMES.get(engine, engine)
        release = f"{shown} {version}"
        found = engine_rules.reading(engine, version)
        answers = ev.get("answers") if isinstance(ev.get("answers"), Mapping) else {}
        gates = ev.get("gates")
        lines = []
        if isinstance(gates, Mapping):
            for name in sorted(gates):
                g = gates[name]
                if isinstance(g, Mapping):
                    lines.append(_read(str(name), g, capability, tps, found, answers, release))
        rules = (f"Rules: stackprobe's reading of {release}'s code (the file and lines read are on each line); its "
                 f"flashinfer-custom-ar is {found.custom_ar} "
                 f"({engine_rules.cite(found.custom_ar_spans)})" if found is not None else
                 f"Rules: stackprobe holds no reading of {release}'s code: its data is shown, and no backend is "
                 "judged off by it")
        out.append(EngineGates(r.cell_id, shown, version, r.verdict.status.value, r.verdict.note, r.result_id,
                               capability, tuple(tps), tuple(lines), rules))
    return out


def tp_sizes(gpu_count: int | None, tp: int | None) -> tuple[int, ...]:
    """The tp sizes to read gates at: the one asked for (any size), else every size from 2 to this host's GPU
    count (3, 5, 6 and 7 included: the engines' tables treat some of them apart), every default on a host that
    does not say."""
    if tp:
        return (tp,)
    if not gpu_count:
        return DEFAULT_TPS
    return tuple(range(2, gpu_count + 1)) or (gpu_count,)
