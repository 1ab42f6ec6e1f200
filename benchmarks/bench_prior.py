"""How close the estimate a newcomer sees at the start of the full pass comes to what the pass took, from
committed results only.

    python benchmarks/bench_prior.py [--results results] [--any-time] [--log benchmarks/results/main-job-*.log]

A newcomer is a host folder whose first full-level run had no run of the host before it but the quick pass
of the same `checks run` (or none). For each, this rebuilds the results root as it stood when that full
pass started: the newcomer's folder with its runs before the pass, every other host's runs older than the
pass (``--any-time``: all of them, later ones too). It estimates the variants the pass measured with
``checks.run.runprogress`` (this host's records, then ``lent``: hosts of its class), as the line
``to run: ...`` does, and prints that estimate against the sum of what those variants took, their ratio,
the estimate from this host's records alone, and where the estimate came from. The wall time of a pass is
not in the results (variants of one pass overlap, and a pass spends seconds before its first variant), so
the sum of the variants' durations stands for it; the notes of a benchmark under ``benchmarks/results``
give the wall time where it was measured.

``--log``: a newcomer whose results were not committed, from the log of a `checks run` with no --level that
``benchmarks/bench_main_job.py`` kept (its first cold run; the JSON beside it gives that run's wall time).
The log's quick-pass result lines stand for the newcomer's folder, its full-pass result lines for what the
full pass measured (their durations as the log rounds them), and every committed run under ``--results``
older than the full pass lends. Printed beside the ratio to the sum: the ratio to the full pass's wall time
(the run's seconds less the quick pass's, as the line ``first answer`` says them).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.results.store import read_file, read_manifest  # noqa: E402
from checks.run import runprogress  # noqa: E402
from checks.run.options import MAX_DEFAULT_JOBS  # noqa: E402
from checks.run.plan import CellTarget, WorkItem  # noqa: E402
from inenv import registry  # noqa: E402
from inenv.probe import Variant, key_parts  # noqa: E402


def _variant(probe: str, key: str) -> Variant:
    parts = dict(key_parts(key))
    ranks = int(parts.pop("ranks", "1"))
    shared = parts.pop("gpus", "") == "shared"
    params = tuple((k, v) for k, v in key_parts(key) if k in parts)
    return Variant(probe, ranks, params, share_gpu=shared)


def _runs(folder: Path) -> list[tuple[str, str]]:
    """(run id, level) of a host folder's runs, oldest first."""
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        run_id = path.name[: -len(".jsonl")]
        made = read_manifest(folder / f"{run_id}.manifest.json")[0] or {}
        out.append((run_id, str(made.get("level") or "")))
    return out


def newcomers(root: Path) -> list[tuple[str, str]]:
    """(host id, run id) of each host's first full-level run that only a quick pass (or nothing) preceded."""
    out = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        runs = _runs(folder)
        for i, (run_id, level) in enumerate(runs):
            if level != "full":
                continue
            if all(lv == "quick" for _, lv in runs[:i]) and i <= 1:
                out.append((folder.name, run_id))
            break
    return out


def _copy_runs(src: Path, dst: Path, keep: object) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("*.jsonl")):
        run_id = path.name[: -len(".jsonl")]
        if keep(run_id):
            shutil.copy2(path, dst / path.name)
            manifest = src / f"{run_id}.manifest.json"
            if manifest.exists():
                shutil.copy2(manifest, dst / manifest.name)


def case(root: Path, host: str, run_id: str, any_time: bool, specs: dict) -> dict:
    """The estimate at the start of ``host``'s full pass ``run_id`` against what its variants took."""
    made = read_manifest(root / host / f"{run_id}.manifest.json")[0] or {}
    backend, facts = str(made.get("executor") or ""), made.get("facts") or {}
    timed = [r for r in read_file(root / host / f"{run_id}.jsonl")[0] if runprogress.timed(r)]
    items = [WorkItem(CellTarget(r.cell_id, "resolved"), specs[r.probe_id], _variant(r.probe_id, r.variant),
                      specs[r.probe_id].timeout_s) for r in timed if r.probe_id in specs]
    with tempfile.TemporaryDirectory() as tmp:
        then = Path(tmp)
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            if folder.name == host:
                _copy_runs(folder, then / host, lambda r: r < run_id)
            else:
                _copy_runs(folder, then / folder.name, lambda r: any_time or r < run_id)
        own = runprogress.learned(then / host)
        compiles = {it.spec.id for it in items if it.spec.build_param}
        lent = runprogress.lent(then, host, facts, compiles)
    view = runprogress.RunView(items, runprogress.expected_durations(items, own, backend, lent))
    alone = runprogress.RunView(items, runprogress.expected_durations(items, own, backend))
    est, before = view.left(), alone.left()
    real = sum(r.verdict.duration_s for r in timed)
    return {"host": host, "run": run_id, "backend": backend, "variants": len(items), "real_sum_s": round(real, 1),
            "estimate_s": round(est.seconds, 1), "never_timed": est.unknown,
            "ratio": round(est.seconds / real, 3) if real and not est.unknown else None,
            "own_only": before.text(), "basis": view.basis()}


RESULT = re.compile(r"^\s*(pass|partial|fail|crash|hang|skip|not-run|unavailable) (\S+) (\S+) (\S+) "
                    r"(\d+(?:\.\d+)? s|\d+m\d\ds|\d+h\d\dm)(?: (\S+))? · ")
RUN_FILE = re.compile(r"^results \S*/([a-z0-9-]+)/(\d{8}T\d{6}Z-[0-9a-f]{4})\.jsonl$")
FIRST = re.compile(r"^first answer: .* in (\S+(?: s)?)\); now the full level")


def seconds_of(text: str) -> float:
    """The seconds of a duration as ``common.progress.duration`` writes it."""
    if text.endswith(" s"):
        return float(text[:-2])
    if m := re.fullmatch(r"(\d+)m(\d\d)s", text):
        return int(m[1]) * 60 + int(m[2])
    m = re.fullmatch(r"(\d+)h(\d\d)m", text)
    assert m, text
    return int(m[1]) * 3600 + int(m[2]) * 60


def from_log(log: Path, root: Path, specs: dict) -> dict:
    """The estimate a newcomer's full pass started with, had the committed runs under ``root`` been there,
    against what it took, from the log of its first `checks run` with no --level."""
    text = log.read_text(errors="replace").splitlines()
    start = next(i for i, ln in enumerate(text) if " -m checks.cli run " in ln)
    command = text[start]
    backend = re.search(r"--backend (\S+)", command)[1]
    bench = json.loads(log.with_suffix(".json").read_text())
    # the run's --jobs, else its default there: the cores, at most MAX_DEFAULT_JOBS
    jobs = int(m[1]) if (m := re.search(r"--jobs (\d+)", command)) else max(1, min(MAX_DEFAULT_JOBS, bench["cores"]))
    passes: list[list[tuple[str, str, str, str, float]]] = [[]]
    runs, quick_s = [], 0.0
    for ln in text[start + 1:]:
        if ln.startswith("$ "):
            break
        if m := RUN_FILE.match(ln):
            runs.append((m[1], m[2]))
        elif m := FIRST.match(ln):
            quick_s = seconds_of(m[1])
            passes.append([])
        elif m := RESULT.match(ln):
            passes[-1].append((m[2], m[3], m[4], f"{m[1]} {m[6] or ''}".strip(), seconds_of(m[5])))
    quick, full = passes[0], passes[1]
    host, full_run = runs[-1]
    own: runprogress.History = {}
    for cell, probe, key, outcome, took in quick:
        own.setdefault((cell, probe, key), {})[backend] = runprogress.Learned(took, backend, outcome)
    items = [WorkItem(CellTarget(cell, "resolved"), specs[probe], _variant(probe, key), specs[probe].timeout_s)
             for cell, probe, key, _, _ in full if probe in specs]
    facts = {"gpu_count": 0, "gpu_name": None, "cpu_count": int(bench["cores"])}
    with tempfile.TemporaryDirectory() as tmp:
        then = Path(tmp)
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != host):
            _copy_runs(folder, then / folder.name, lambda r: r < full_run)
        lent = runprogress.lent(then, host, facts, {it.spec.id for it in items if it.spec.build_param})
    view = runprogress.RunView(items, runprogress.expected_durations(items, own, backend, lent), jobs=jobs)
    alone = runprogress.RunView(items, runprogress.expected_durations(items, own, backend), jobs=jobs)
    est = view.left()
    real = sum(took for *_, took in full)
    wall = float(bench["passes"][0]["run_s"]) - quick_s
    return {"host": host, "run": full_run, "backend": backend, "variants": len(items), "real_sum_s": round(real, 1),
            "wall_s": round(wall, 1), "jobs": jobs, "estimate_s": round(est.seconds, 1), "never_timed": est.unknown,
            "ratio": round(est.seconds / real, 3) if real and not est.unknown else None,
            "ratio_wall": round(est.seconds / wall, 3) if wall > 0 and not est.unknown else None,
            "own_only": alone.left().text(), "basis": view.basis()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--any-time", action="store_true", help="lend from every other run, later ones too")
    ap.add_argument("--log", type=Path, action="append", default=[], help="a bench_main_job log (repeatable)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    specs = {pid: mod.SPEC for pid, (_, mod) in registry.discover().items()}
    rows = [case(args.results, h, r, args.any_time, specs) for h, r in newcomers(args.results)]
    rows += [from_log(log, args.results, specs) for log in args.log]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        wall = f", wall {row['wall_s']:.1f} s (jobs {row['jobs']}), ratio to wall {row['ratio_wall']}" \
            if "wall_s" in row else ""
        print(f"{row['host']} {row['run']} ({row['backend']}, {row['variants']} variants): estimate "
              f"{row['estimate_s']:.1f} s + {row['never_timed']} never timed, real {row['real_sum_s']:.1f} s, "
              f"ratio {ratio}{wall}; this host's records alone: {row['own_only']}")
        print(f"    from: {row['basis']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
