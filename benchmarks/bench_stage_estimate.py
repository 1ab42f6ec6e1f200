"""The kernel stage's time left, replayed on a real stage: what the estimator (provision.kernels.StageProgress)
of this checkout would have said at each of the stage's ticks, beside what the stage said (the log's own
"about X left", the code of the run) and the true time left (the stage's end less the tick).

    uv run python benchmarks/bench_stage_estimate.py --log STAGE.log --compiled .compiled.jsonl [--jobs 2]

``--log``: the stage's log (``.cache/kernels/stage.log``); ``--compiled``: the compile cache's record of the builds
(``.compiled.jsonl``: each build's compiler CPU seconds). The replay takes every build's start and end from the
log, its CPU seconds from the compile cache (a build the log says was copied from a twin or not carried spent
none), spreads a running build's CPU evenly over its wall time, and feeds the estimator those events on a clock
of its own; this host's earlier builds are the quick module's (vllm_comm) rows of the compile cache. Printed:
every fifth tick, and per estimator the smallest and largest estimate over the truth and the largest change
between two ticks beyond the time that passed (a perfect estimate falls by the 30 s between its ticks: 0).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inenv.probes.fi_jit import BUILD_COST  # noqa: E402
from provision import kernels  # noqa: E402
from provision.kernels import estimate  # noqa: E402

BEGIN = re.compile(r"^(\d\d:\d\d:\d\d) (\S+) kernels: \[(\d+)/(\d+)\] (\S+) for ([^(]+?)( copied from .*)?$")
END = re.compile(r"^(\d\d:\d\d:\d\d) (\S+) kernels: (\S+) (carried for ([0-9a-z. ]+?) \(|not carried: )")
TICK = re.compile(r"^(\d\d:\d\d:\d\d) kernels: \d+/\d+ done, .* about ([0-9hms ]+) left \(")


def clock(text: str) -> float:
    h, m, s = (int(x) for x in text.split(":"))
    return h * 3600.0 + m * 60.0 + s


def seconds(text: str) -> float:
    """``1h02m``, ``33m39s``, ``44 s``, ``3.8 s`` as seconds."""
    total = 0.0
    for value, unit in re.findall(r"([\d.]+)\s*([hms])", text):
        total += float(value) * {"h": 3600.0, "m": 60.0, "s": 1.0}[unit]
    return total


def parse(log: Path, compiled: Path) -> dict[str, object]:
    lines = log.read_text(errors="replace").splitlines()
    jobs: dict[tuple[str, str], dict[str, object]] = {}
    ticks: list[tuple[float, float]] = []
    for line in lines:
        if m := BEGIN.match(line):
            t, cell, index, _n, module, archs, copied = m.groups()
            jobs[(cell, module)] = {"begin": clock(t), "index": int(index), "archs": tuple(archs.split()),
                                    "copied": bool(copied), "end": clock(t) if copied else None, "built": 0}
        elif (m := END.match(line)) and (m.group(2), m.group(3)) in jobs:
            job = jobs[(m.group(2), m.group(3))]
            job["end"] = clock(m.group(1))
            job["built"] = len(m.group(5).split()) if m.group(5) else 0
        elif m := TICK.match(line):
            ticks.append((clock(m.group(1)), seconds(m.group(2))))
    cpu: dict[tuple[str, str], float] = {}
    quick: list[float] = []
    for row in (json.loads(x) for x in compiled.read_text().splitlines() if x.strip()):
        key = (str(row.get("cell")), str(row.get("module")))
        spent = float(row.get("compile_cpu_s") or 0.0)
        if row.get("module") == "vllm_comm":
            quick.append(spent / max(1, len(str(row.get("arch_list") or "x").split())))
        elif key in jobs:
            cpu[key] = cpu.get(key, 0.0) + spent
    unfinished = [k for k, j in jobs.items() if j["end"] is None]
    if unfinished:
        raise SystemExit(f"{log}: the stage had not ended ({len(unfinished)} build(s) without an end line)")
    return {"jobs": jobs, "cpu": cpu, "ticks": ticks, "learned": sum(quick) / len(quick) if quick else None}


def replay(parsed: dict[str, object], parallel: int) -> list[tuple[float, float]]:
    jobs: dict[tuple[str, str], dict[str, object]] = parsed["jobs"]  # type: ignore[assignment]
    cpu: dict[tuple[str, str], float] = parsed["cpu"]  # type: ignore[assignment]
    order = sorted(jobs, key=lambda k: int(jobs[k]["index"]))  # type: ignore[arg-type]
    todo = [kernels.Job(cell, module, jobs[(cell, module)]["archs"], "", "",  # type: ignore[arg-type]
                        BUILD_COST_OF.get(module, 0.0) * len(jobs[(cell, module)]["archs"]))  # type: ignore[arg-type]
            for cell, module in order]
    now = {"t": 0.0}
    real_time = estimate.time
    estimate.time = SimpleNamespace(monotonic=lambda: now["t"])  # type: ignore[assignment]
    try:
        def running_cpu() -> float:
            t = now["t"]
            total = 0.0
            for key, job in jobs.items():
                begin, end = float(job["begin"]), float(job["end"])  # type: ignore[arg-type]
                if begin <= t < end and not job["copied"]:
                    total += cpu.get(key, 0.0) * (t - begin) / (end - begin)
            return total

        learned = {"vllm_comm": parsed["learned"]} if parsed["learned"] else {}
        copied = [k for k in order if jobs[k]["copied"]]
        progress = kernels.StageProgress(todo, parallel, learned, live=running_cpu, copied=copied)  # type: ignore[arg-type]
        progress.cpu0 = float("inf")  # the stage's CPU is what the replay says it is
        events = sorted([(float(j["begin"]), 0, k) for k, j in jobs.items()]  # type: ignore[arg-type]
                        + [(float(j["end"]), 1, k) for k, j in jobs.items()])  # type: ignore[arg-type]
        by_key = {(j.cell_id, j.module): j for j in todo}
        out: list[tuple[float, float]] = []
        ticks: list[tuple[float, float]] = parsed["ticks"]  # type: ignore[assignment]
        i = 0
        for t, _logged in ticks:
            while i < len(events) and events[i][0] <= t:
                when, kind, key = events[i]
                now["t"] = when
                if kind == 0:
                    progress.begin(by_key[key])
                else:
                    progress.end(by_key[key])
                    built = int(jobs[key]["built"])  # type: ignore[arg-type]
                    progress.spent(cpu.get(key, 0.0), by_key[key], built or None)
                i += 1
            now["t"] = t
            out.append((t, progress.left_s(progress.live())[0]))
        return out
    finally:
        estimate.time = real_time  # type: ignore[assignment]


BUILD_COST_OF = dict(BUILD_COST)


def summary(name: str, pairs: list[tuple[float, float, float]]) -> str:
    """``pairs``: (tick, estimate, truth)."""
    ratios = [e / truth for _, e, truth in pairs if truth > 60]
    # what the estimate gained between two ticks over the time that passed (0: it fell as the clock did)
    rises = [b[1] - a[1] + (b[0] - a[0]) for a, b in zip(pairs, pairs[1:], strict=False)]
    return (f"{name:>9}: estimate / truth from {min(ratios):.2f} to {max(ratios):.2f}; largest change between two "
            f"ticks beyond the time that passed {max(rises, key=abs) / 60:+.1f} min")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, required=True)
    ap.add_argument("--compiled", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    parsed = parse(args.log, args.compiled)
    jobs: dict[tuple[str, str], dict[str, object]] = parsed["jobs"]  # type: ignore[assignment]
    end = max(float(j["end"]) for j in jobs.values())  # type: ignore[arg-type]
    start = min(float(j["begin"]) for j in jobs.values())  # type: ignore[arg-type]
    ticks: list[tuple[float, float]] = parsed["ticks"]  # type: ignore[assignment]
    replayed = replay(parsed, args.jobs)
    print(f"stage of {len(jobs)} build(s), {(end - start) / 60:.1f} min; quick module's CPU a target "
          f"{parsed['learned']}; minutes left at every fifth tick:")
    print(f"{'tick':>8} {'truth':>7} {'logged':>7} {'replay':>7}")
    logged = [(t, e, end - t) for t, e in ticks]
    mine = [(t, e, end - t) for t, e in replayed]
    for k, ((t, old, truth), (_, new, _)) in enumerate(zip(logged, mine, strict=True)):
        if k % 5 == 0:
            print(f"{(t - start) / 60:7.1f}m {truth / 60:7.1f} {old / 60:7.1f} {new / 60:7.1f}")
    print(summary("logged", logged))
    print(summary("replayed", mine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
