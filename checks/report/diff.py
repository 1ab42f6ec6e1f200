"""`checks diff A B`: every verdict and headline that differs between two runs, two hosts or two cells, and for
the report what a host's newest run changed (pure, on results already read).

A and B are each a run id, a host id, a cell id (when one host records it) or ``HOST/CELL``. Runs compare their
own results; hosts and cells compare their latest result per variant (what the table shows). Runs and hosts
are matched on (cell, probe, variant), cells on (probe, variant). A verdict is the status and its reason code;
a headline is the key measurement the table shows in a passing cell, so a rerun that measured other numbers
shows up here too.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from checks.report.headline import headline
from checks.results.hostresults import HostResults
from checks.results.result import ProbeResult
from checks.results.store import REUSED_FROM
from inenv import registry
from inenv.probe import Declared


class SelectError(ValueError):
    """A or B names nothing recorded, or names two kinds; the message says what to give instead."""


@dataclass(frozen=True)
class Side:
    kind: str  # run | host | cell
    name: str
    host_id: str
    results: Mapping[tuple[str, ...], ProbeResult]


@dataclass(frozen=True)
class Change:
    key: tuple[str, ...]
    a_verdict: str
    b_verdict: str
    a_headline: str
    b_headline: str
    a_id: str
    b_id: str

    @property
    def verdict_changed(self) -> bool:
        return self.a_verdict != self.b_verdict

    @property
    def headline_changed(self) -> bool:
        return self.a_headline != self.b_headline


@dataclass(frozen=True)
class Diff:
    kind: str
    a: str
    b: str
    compared: int  # keys present on both sides
    changes: tuple[Change, ...]
    only_a: tuple[str, ...]  # result ids
    only_b: tuple[str, ...]


def verdict(r: ProbeResult) -> str:
    v = r.verdict
    return f"{v.status.value} ({v.reason_code})" if v.reason_code else v.status.value


def _keyed(results: Sequence[ProbeResult], by_cell: bool) -> dict[tuple[str, ...], ProbeResult]:
    return {(r.cell_id, r.probe_id, r.variant) if by_cell else (r.probe_id, r.variant): r for r in results}


def select(hosts: Mapping[str, HostResults], spec: str) -> Side:
    """The results ``spec`` names (see the module doc); SelectError when it names nothing or several things."""
    if "/" in spec:
        host, _, cell = spec.partition("/")
        h = hosts.get(host)
        if h is None or not any(r.cell_id == cell for r in h.results):
            raise SelectError(f"{spec!r}: no results for cell {cell!r} on host {host!r}")
        return Side("cell", spec, host, _keyed([r for r in h.latest() if r.cell_id == cell], False))
    if spec in hosts:
        return Side("host", spec, spec, _keyed(hosts[spec].latest(), True))
    runs = [h for h in hosts.values() if spec in h.runs]
    if len(runs) == 1:
        return Side("run", spec, runs[0].host_id, _keyed(runs[0].of_run(spec), True))
    cells = [h for h in hosts.values() if any(r.cell_id == spec for r in h.results)]
    if len(runs) > 1 or len(cells) > 1:
        where = ", ".join(h.host_id for h in (runs or cells))
        raise SelectError(f"{spec!r} is recorded on hosts {where}: give HOST/{spec}" if cells and not runs else
                          f"run {spec!r} is in hosts {where}; its results cannot be told apart")
    if cells:
        h = cells[0]
        return Side("cell", spec, h.host_id, _keyed([r for r in h.latest() if r.cell_id == spec], False))
    names = [*hosts, *(run for h in hosts.values() for run in h.runs),
             *sorted({r.cell_id for h in hosts.values() for r in h.results})]
    close = difflib.get_close_matches(spec, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "; give a run id, a host id, a cell id or HOST/CELL"
    raise SelectError(f"{spec!r} names no run, host or cell under the results directory{hint}")


def compare(a: Mapping[tuple[str, ...], ProbeResult], b: Mapping[tuple[str, ...], ProbeResult]) -> list[Change]:
    out = []
    fields = registry.declarations()
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        declared = fields.get(x.probe_id, Declared())
        c = Change(key, verdict(x), verdict(y), headline(x.verdict.metrics, declared),
                   headline(y.verdict.metrics, declared), x.result_id, y.result_id)
        if c.verdict_changed or c.headline_changed:
            out.append(c)
    return out


def diff(a: Side, b: Side) -> Diff:
    if a.kind != b.kind:
        raise SelectError(f"{a.name!r} is a {a.kind} and {b.name!r} a {b.kind}: compare two runs, two hosts or "
                          "two cells")
    only_a = tuple(a.results[k].result_id for k in sorted(a.results.keys() - b.results.keys()))
    only_b = tuple(b.results[k].result_id for k in sorted(b.results.keys() - a.results.keys()))
    return Diff(a.kind, a.name, b.name, len(a.results.keys() & b.results.keys()), tuple(compare(a.results, b.results)),
                only_a, only_b)


def since_previous(h: HostResults) -> Diff | None:
    """What the host's newest run changed: each of its results against the latest result the host had before
    it for the same variant (variants the newest run did not rerun are not compared). None for one run, or when
    the newest run reran nothing (it carried every result from earlier runs)."""
    if len(h.runs) < 2:
        return None
    newest = h.runs[-1]
    before = _keyed(h.latest(before=newest), True)
    after = _keyed([r for r in h.of_run(newest) if REUSED_FROM not in r.verdict.evidence], True)  # carried: not rerun
    if not after:
        return None  # it reran nothing
    only_b = tuple(after[k].result_id for k in sorted(after.keys() - before.keys()))
    return Diff("run", f"before {newest}", newest, len(after.keys() & before.keys()),
                tuple(compare(before, after)), (), only_b)
