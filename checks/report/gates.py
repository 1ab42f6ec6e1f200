"""What a serving engine installed in a cell gates on this host: the engine probe's recorded gate data read
against the host's compute capability and tensor-parallel sizes. Pure.

The data is the engine's own (its world-size lists and size tables, as the engine probe recorded them);
this module only looks values up and says what it found: a world size listed or not, a table entry for the
host's compute capability or none (with the entries the table has), the size limit at that tp. How the
engine acts on a missing entry is the engine's code, which this module does not restate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checks.report.advise import human_bytes
from checks.results.result import ProbeResult
from inenv.probe import HostView
from inenv.status import Status

ENGINE_PROBE = "engine"
DEFAULT_TPS = (2, 4, 8)  # the sizes read on a host that does not say how many GPUs it has
# The engine probe's backend names for the backends advice names (an engine's custom allreduce is the
# vLLM-style kernel flashinfer ships as vllm_comm).
GATED = {"flashinfer-custom-ar": "custom-ar", "symm-mem-one-shot": "symm-mem", "symm-mem-two-shot": "symm-mem",
         "flashinfer-pcie-ipc": "pcie-ipc"}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
# Gates that choose between kernels of a backend rather than admit it (no multimem entry: the engine runs
# its other symmetric-memory kernel), so no value of theirs leaves the backend out.
KERNEL_CHOICE = frozenset({"symm-mem-multimem-world-sizes"})


@dataclass(frozen=True)
class GateLine:
    gate: str
    backend: str  # the engine probe's backend name (custom-ar, symm-mem, pcie-ipc)
    text: str
    off: tuple[int, ...] = ()  # tp sizes this gate's data leaves out on this host (not listed, no entry, 0)


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

    def off_for(self, backend: str, tp: int) -> list[GateLine]:
        """The gate lines of ``backend`` (advice's name) whose data leaves ``tp`` out here."""
        mine = GATED.get(backend)
        return [g for g in self.lines if g.backend == mine and tp in g.off]


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _entry(table: Mapping[str, Any], keys: str, capability: str | None) -> tuple[str, Any] | None:
    """The table's entry for the capability, spelled as the table spells its keys."""
    if capability is None:
        return None
    major = capability.split(".")[0]
    key = major if keys == "int" else capability
    return (key, table[key]) if key in table else None


def _size(value: Any) -> str:
    return human_bytes(value) if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _line(name: str, gate: Mapping[str, Any], capability: str | None, tps: Sequence[int]) -> GateLine:
    line = _read(name, gate, capability, tps)
    return GateLine(line.gate, line.backend, line.text) if name in KERNEL_CHOICE else line


def _read(name: str, gate: Mapping[str, Any], capability: str | None, tps: Sequence[int]) -> GateLine:
    backend = str(gate.get("backend", ""))
    where = str(gate.get("where", ""))
    if not gate.get("found"):
        return GateLine(name, backend, f"{name}: not read ({gate.get('why', 'no reason recorded')})")
    value = gate.get("value")
    if (sizes := _ints(value)) is not None:
        off = tuple(n for n in tps if n not in sizes)
        said = "; ".join(f"tp {n} {'listed' if n in sizes else 'not listed'}" for n in tps)
        return GateLine(name, backend, f"{name} {sizes}: {said} ({where})", off)
    if isinstance(value, int) and not isinstance(value, bool):
        return GateLine(name, backend, f"{name}: {_size(value)} at every architecture ({where})")
    if isinstance(value, Mapping):
        entries = ", ".join(sorted(map(str, value), key=lambda k: [int(p) if p.isdigit() else p
                                                                 for p in k.split(".")]))
        keys = str(gate.get("keys") or "str")
        if capability is None:
            return GateLine(name, backend, f"{name}: entries for {entries} (no GPU on this host to look up) ({where})")
        found = _entry(value, keys, capability)
        if found is None:
            return GateLine(name, backend, f"{name}: no entry for compute capability {capability} (entries: "
                            f"{entries}) ({where})", tuple(tps))
        key, entry = found
        if isinstance(entry, Mapping):
            per = [(n, entry.get(str(n))) for n in tps]
            off = tuple(n for n, v in per if v in (None, 0))
            said = "; ".join(f"tp {n} {_size(v) if v is not None else 'no value'}" for n, v in per)
            return GateLine(name, backend, f"{name}[{key}]: {said} ({where})", off)
        if (sizes := _ints(entry)) is not None:
            said = "; ".join(f"tp {n} {'listed' if n in sizes else 'not listed'}" for n in tps)
            return GateLine(name, backend, f"{name}[{key}] {sizes}: {said} ({where})")
        return GateLine(name, backend, f"{name}[{key}]: {entry!r} ({where})")
    return GateLine(name, backend, f"{name}: {value!r} ({where})")


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
        gates = ev.get("gates")
        lines = []
        if isinstance(gates, Mapping):
            for name in sorted(gates):
                g = gates[name]
                if isinstance(g, Mapping):
                    lines.append(_line(str(name), g, capability, tps))
        out.append(EngineGates(r.cell_id, ENGINE_NAMES.get(engine, engine), str(ev.get("version") or "?"),
                               r.verdict.status.value, r.verdict.note, r.result_id, capability, tuple(tps),
                               tuple(lines)))
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
