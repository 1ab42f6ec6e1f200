"""One host's standing in a few lines: per cell what works there, what does not and why, what only a GPU host
can add (pure). `checks advise` starts with it for the host it runs on; the page of the newest run's host
starts with it, from that run's results alone (after `checks run`, the host it ran on; the same on every
machine that reads the results).

fi-jit's passes are said as what compiles (module and targets), every other probe's as the probe passing;
what failed, crashed, hung, works in part or was skipped for a reason other than the missing GPU is said with
its reason code, and each code's meaning once from the reason catalogue. Variants skipped for want of a GPU
are counted, not listed; cells that were not built on the host share one line per reason.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from checks.results.hostresults import HostResults
from checks.results.result import ProbeResult
from inenv.status import Status

COMPILE_PROBE = "fi-jit"
NO_GPU = "no-gpu"
NOT_BUILT = frozenset({Status.NOT_RUN, Status.UNAVAILABLE})
BROKEN = frozenset({Status.FAIL, Status.CRASH, Status.HANG, Status.PARTIAL, Status.SKIP})


@dataclass(frozen=True)
class CellStanding:
    cell_id: str
    works: tuple[str, ...]  # "compiles trtllm_comm (12.0a, 12.0f)", "inventory passes"
    broken: tuple[str, ...]  # "fi-jit fail fi-no-nvcc: moe_a2a (12.0a, 12.0f)"
    codes: tuple[str, ...] = ()  # the reason codes ``broken`` names


@dataclass(frozen=True)
class Here:
    host_id: str
    label: str  # "NVIDIA H200 ×2, NVLink (NV18)"; "no GPU"
    gpus: int
    newest_run: str
    cells: tuple[CellStanding, ...]
    not_built: tuple[tuple[str, str, tuple[str, ...]], ...]  # (status, reason code, cells) of cells never run
    why: tuple[tuple[str, str], ...]  # (reason code, what it means) for every code said above
    need_gpu: int  # variants skipped for want of a GPU
    need_gpu_probes: tuple[str, ...]


def newest_host(runs: Mapping[str, Sequence[str]]) -> str | None:
    """The host whose newest run is the newest of all (run ids begin with their UTC start, so they sort by
    time; a tie goes to the host id sorting last); None without runs."""
    best = max(((max(r), h) for h, r in runs.items() if r), default=None)
    return best[1] if best else None


def _targets(rs: Sequence[ProbeResult]) -> str:
    """``trtllm_comm (12.0a, 12.0f), vllm_comm (12.0a)``: fi-jit's variants by module, with their targets."""
    by: dict[str, set[str]] = defaultdict(set)
    for r in rs:
        by[r.params.get("module") or r.variant].add(r.params.get("arch") or "")
    return ", ".join(f"{m} ({', '.join(sorted(a for a in archs if a))})" if any(archs) else m
                     for m, archs in sorted(by.items()))


def _cell(cell_id: str, rs: Sequence[ProbeResult]) -> CellStanding:
    works, broken = [], []
    by_probe: dict[str, list[ProbeResult]] = defaultdict(list)
    for r in rs:
        by_probe[r.probe_id].append(r)
    for pid, prs in sorted(by_probe.items()):
        passed = [r for r in prs if r.verdict.status is Status.PASS]
        if passed and pid == COMPILE_PROBE:
            works.append(f"compiles {_targets(passed)}")
        elif passed:
            works.append(f"{pid} passes" + (f" ({len(passed)} of {len(prs)})" if len(passed) < len(prs) else ""))
        groups: dict[tuple[str, str], list[ProbeResult]] = defaultdict(list)
        for r in prs:
            v = r.verdict
            if v.status in BROKEN and v.reason_code != NO_GPU:
                groups[(v.status.value, v.reason_code)].append(r)
        for (status, code), grs in sorted(groups.items()):
            what = f": {_targets(grs)}" if pid == COMPILE_PROBE else f" ({len(grs)})" if len(grs) > 1 else ""
            broken.append(f"{pid} {status} {code or 'unexplained'}{what}")
    codes = sorted({r.verdict.reason_code for r in rs if r.verdict.status in BROKEN and r.verdict.reason_code
                    and r.verdict.reason_code != NO_GPU})
    return CellStanding(cell_id, tuple(works), tuple(broken), tuple(codes))


def standing(host: HostResults, messages: Mapping[str, str]) -> Here:
    """``host``'s latest result per variant, said per cell; ``messages``: the reason catalogue's meaning per
    code."""
    latest = host.latest()
    per_cell: dict[str, list[ProbeResult]] = defaultdict(list)
    for r in latest:
        per_cell[r.cell_id].append(r)
    cells, never = [], defaultdict(list)
    for cell_id, rs in sorted(per_cell.items()):
        if all(r.verdict.status in NOT_BUILT for r in rs):
            first = min(rs, key=lambda r: r.key).verdict
            never[(first.status.value, first.reason_code)].append(cell_id)
            continue
        cells.append(_cell(cell_id, rs))
    no_gpu = [r for r in latest if r.verdict.reason_code == NO_GPU]
    said = sorted({code for c in cells for code in c.codes} | {code for _, code in never if code})
    gpus = int(host.gpu_count or 0)
    return Here(host.host_id, str(host.facts.get("host_label") or ("no GPU" if not gpus else "")), gpus,
                host.runs[-1] if host.runs else "", tuple(cells),
                tuple((s, c, tuple(ids)) for (s, c), ids in sorted(never.items())),
                tuple((c, messages.get(c, "")) for c in said),
                len(no_gpu), tuple(sorted({r.probe_id for r in no_gpu})))


def gpu_adds(h: Here) -> str:
    """What a run on a GPU host would add to a host without one."""
    return (f"A GPU host adds the runtime verdicts ({h.need_gpu} variant(s) skipped here without a GPU: "
            f"{', '.join(h.need_gpu_probes)}), their latencies and the launch advice: run `uv run checks run --all` "
            "there, then `checks advise` on its results.")


def rows(h: Here) -> list[str]:
    """The standing as plain sentences, one per cell, per reason of cells never built, per reason code's meaning,
    and what a GPU host would add (for a host without one)."""
    out = []
    for c in h.cells:
        parts = ([f"works: {'; '.join(c.works)}"] if c.works else []) + (
            [f"does not: {'; '.join(c.broken)}"] if c.broken else [])
        out.append(f"{c.cell_id}: {' · '.join(parts) or 'nothing recorded beyond what needs a GPU'}")
    out += [f"{status} {code}: {', '.join(cells)}" for status, code, cells in h.not_built]
    out += [f"why {code}: {meaning}" for code, meaning in h.why if meaning]
    if not h.gpus and h.need_gpu:
        out.append(gpu_adds(h))
    return out


def lines(h: Here, title: str = "this host") -> list[str]:
    """The standing as plain text lines (`checks advise`)."""
    return [f"{title}: {h.host_id} ({h.label}), newest run {h.newest_run}", *(f"  {r}" for r in rows(h))]
