"""Every recorded result of one host, with its runs and host facts, read once for the decision commands
(`checks advise`, `checks diff`, the report's decision notes). Reading is the only side effect here.

A host's results are the union of its runs; ``latest`` keeps, per (cell, probe, variant), the result of the
newest run, which is what the table shows too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checks.results import portable
from checks.results.freshness import EXECUTORS
from checks.results.reader import Run
from checks.results.result import ProbeResult, table_view
from checks.results.store import contributed, read_file, read_manifest, read_origin, scan


@dataclass(frozen=True)
class HostResults:
    host_id: str
    runs: tuple[str, ...]  # run ids, oldest first (run ids sort by time)
    results: tuple[ProbeResult, ...]  # every valid result of every run
    facts: Mapping[str, Any]  # the newest manifest's host facts ({} when no manifest could be read)
    warnings: tuple[str, ...] = ()
    executors: Mapping[str, str] = field(default_factory=dict)  # run id -> the back end its manifest names
    contributed: Mapping[str, str] = field(default_factory=dict)  # run id -> how an imported run is named (store)

    def executor(self, cell_id: str) -> str:
        """The back end of the newest run holding a result of ``cell_id``: the one a rerun of it uses
        (``docker`` when no manifest says)."""
        runs = sorted({r.run_id for r in self.results if r.cell_id == cell_id})
        return next((self.executors[r] for r in reversed(runs) if r in self.executors), "docker")

    def latest(self, before: str | None = None) -> list[ProbeResult]:
        """Per (cell, probe, variant), the result the table shows (``shows_over``) among the runs (those before
        ``before`` if given)."""
        best = table_view(r for r in self.results if before is None or r.run_id < before)
        return [best[k] for k in sorted(best)]

    def of_run(self, run_id: str) -> list[ProbeResult]:
        return sorted((r for r in self.results if r.run_id == run_id), key=lambda r: r.key)

    @property
    def gpu_count(self) -> int | None:
        """The GPU count the newest manifest recorded; None when no manifest says."""
        n = self.facts.get("gpu_count")
        return n if isinstance(n, int) and not isinstance(n, bool) else None


def from_runs(host_id: str, runs: Mapping[str, Run]) -> HostResults:
    """One host from runs already read by the one reader (a host folder and a bundle's runs together, to see
    what an import would change before anything is written)."""
    ordered = sorted(runs)
    results = tuple(ProbeResult.from_json(o) for r in ordered for o in runs[r].results)
    facts: dict[str, Any] = {}
    executors: dict[str, str] = {}
    for r in ordered:
        m = runs[r].manifest or {}
        if runs[r].results and isinstance(m.get("facts"), Mapping):
            facts = dict(m["facts"])
        if m.get("executor") in EXECUTORS:
            executors[r] = str(m["executor"])
    origins = {r: contributed(runs[r].origin) for r in ordered if runs[r].origin}
    return HostResults(host_id, tuple(ordered), results, facts, (), executors, origins)


def load(results_dir: Path) -> dict[str, HostResults]:
    """Every host under ``results_dir``; unreadable lines and manifests become warnings, never errors."""
    return load_all(results_dir)[0]


def load_all(results_dir: Path) -> tuple[dict[str, HostResults], list[str]]:
    """Every host under ``results_dir``, and a warning for each folder or file skipped outside any host
    (each host's own warnings are in its HostResults)."""
    found, skipped = scan(results_dir)
    per_host: dict[str, list[tuple[str, Path]]] = defaultdict(list)
    for host, run_id, path in found:
        per_host[host].append((run_id, path))
    out: dict[str, HostResults] = {}
    for host, runs in sorted(per_host.items()):
        results: list[ProbeResult] = []
        warnings: list[str] = []
        facts: dict[str, Any] = {}
        executors: dict[str, str] = {}
        origins: dict[str, str] = {}
        for run_id, path in runs:
            res, warn = read_file(path)
            results.extend(portable.result(r) for r in res)
            warnings.extend(warn)
            if not res:
                continue  # a run with nothing readable describes nothing: its manifest is not read
            manifest, why = read_manifest(path.with_name(f"{run_id}.manifest.json"))
            if manifest is not None and isinstance(manifest.get("facts"), Mapping):
                facts = dict(manifest["facts"])  # runs are in time order: the newest wins
            elif why:
                warnings.append(why)
            if manifest is not None and manifest.get("executor") in EXECUTORS:
                executors[run_id] = str(manifest["executor"])
            origin, why = read_origin(path.with_name(f"{run_id}.origin.json"))
            if origin is not None:
                origins[run_id] = contributed(origin)
            elif why:
                warnings.append(why)
        out[host] = HostResults(host, tuple(r for r, _ in runs), tuple(results), facts, tuple(warnings), executors,
                                origins)
    return out, skipped
