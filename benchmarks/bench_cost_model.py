"""What the default full level costs on hosts of 1, 2, 4 and 8 GPUs, predicted by the cost model
(checks.run.cost.model) from measured per-variant costs, and how the prediction compares with a measured run.

    uv run python benchmarks/bench_cost_model.py [--gpu-name "NVIDIA H200"] [--gpus 1,2,4,8] [--jobs 4]
        [--prior checks/run/cost/prior.json | --results results] [--check RESULTS.jsonl ...] [--json]

For each GPU count it plans what `checks run --all` plans (checks.run.plan.plan_work, every probe of the suite,
one resolved cell with sgl-kernel and flashinfer, compute capability 9.0) at the quick level (each multi-rank
probe at its smallest world size: plan.deferred_sizes) and the full level, costs
every variant that would run from the prior alone (no host records: what a fresh host is told), and prints the
predicted wall time of each pass (timed GPU variants one at a time, untimed ones side by side within the rank cap
of --cores, CPU-only ones over --jobs slots: checks.run.cost.budget)
with the probes that cost most and how many variants the model had to carry to a world size nobody measured.

``--check FILE``: a measured run (a results JSONL of this project; its manifest beside it says the host's
class). The model predicts each variant that run timed, from a prior made without that host's runs (the
committed results less the run's host folder: leave-one-host-out), and prints predicted / measured for the sum of
the variants' seconds. The wall time of a pass is not in the results; the sum of its variants' seconds stands
for it, as benchmarks/bench_prior.py does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.results.store import read_file, read_manifest  # noqa: E402
from checks.run import runprogress, session  # noqa: E402
from checks.run.cost import budget  # noqa: E402
from checks.run.cost import model as costmodel  # noqa: E402
from checks.run.cost.prior import committed_step_grids, records, step_grids  # noqa: E402
from checks.run.plan import CellTarget, WorkItem, deferred_shallow, deferred_sizes, plan_work  # noqa: E402
from checks.run.runner import rank_cap  # noqa: E402
from inenv import registry  # noqa: E402
from inenv.probe import FULL, QUICK, HostView, Variant, key_parts  # noqa: E402
from inenv.status import Status  # noqa: E402

MISSING_PACKAGE = "missing-package"

TEN_MINUTES_S = 600.0
# A variant no host has timed and nothing in the prior predicts is costed at budget.UNTIMED_S; such a variant may
# well take longer (the step's full grid with a GPU per rank, measured as one rank, takes 15-18 s a variant), so
# each prediction is also printed with every guessed variant at this many seconds
GUESS_HIGH_S = 30.0
# The cores of an 8-GPU host, an assumption: 8-GPU H100/H200 servers ship with 96-224 cores (two CPUs of 48-112
# cores), and the lent 8-GPU machines have 128. The cores cap the rank processes of variants that time nothing
# running side by side (checks.run.runner.rank_cap); the 8-GPU full level is also printed at --cores to compare.
EIGHT_GPU_CORES = 128
CELL = CellTarget("cu130-torch2.11.0-sgl0.4.7-fi0.7.4", "resolved",
                  versions={"cuda": "13.0", "torch": "2.11.0", "sgl_kernel": "0.4.7", "flashinfer": "0.7.4"})
# What the cell holds of what a build self-check reports (common.build.buildrecord.BuildRecord.holds): sgl-kernel
# and no serving engine, so the variants of backends that need vLLM or SGLang itself skip at once, and a run
# prices them so (checks.run.session.lacking_distributions)
CELL_HOLDS: dict[str, str] = {"sgl-kernel": "0.4.7"}


def build_params() -> dict[str, str]:
    return {pid: mod.SPEC.build_param for pid, (_, mod) in registry.discover().items()}


def switch_islands(gpus: int, per_switch: int) -> tuple[tuple[int, ...], ...]:
    """The host's GPUs behind PCIe switches of ``per_switch`` GPUs each (checks.run.placement.islands), an assumed
    topology: 8-GPU PCIe servers put two or four GPUs behind each switch, or four on each of two CPU sockets."""
    return tuple(tuple(range(k, min(k + per_switch, gpus))) for k in range(0, gpus, per_switch))


def link_name(switched: bool, islands: tuple[tuple[int, ...], ...]) -> str:
    if islands:
        return f"PCIe sw{len(islands[0])}"
    return "NVSwitch" if switched else "PCIe"


def predict_pass(tables: list[costmodel.CostTable], gpus: int, gpu_name: str, level: str,
                 jobs: int, cores: int = 16, switched: bool = False,
                 islands: tuple[tuple[int, ...], ...] = ()) -> dict[str, object]:
    probes = {pid: mod for pid, (_, mod) in registry.discover().items()}
    host = HostView(gpu_count=gpus, compute_capability="9.0", gpu_name=gpu_name, target_archs=(), level=level)
    planned = plan_work([CELL], probes, host)
    items = [it for it in (deferred_shallow(deferred_sizes(planned)) if level == QUICK else planned) if it.runs]
    lacking = session.lacking_distributions(items, lambda cell_id: CELL_HOLDS)
    tables = costmodel.at_level(tables, level == QUICK)
    expected = runprogress.expected_durations(items, {}, "", None, tables, lacking=lacking)
    seconds = {k: e.seconds for k, e in expected.items()}
    # variants costed from one rank's figures (the step's grid with a GPU per rank, bench_step_grid.py)
    one_rank = {t.label for t in tables if t.one_rank}
    from_one_rank = sum(1 for e in expected.values() if e.seconds is not None and e.prior in one_rank)
    per_probe: Counter[str] = Counter()
    for it in items:
        per_probe[it.spec.id] += budget.seconds_of(it, seconds)
    carried = sum(1 for e in expected.values() if e.seconds is not None and e.basis)
    guessed = sum(1 for e in expected.values() if e.seconds is None)
    switched = switched or bool(islands)
    lanes = budget.Lanes(jobs, rank_cap(cores), gpus=gpus, switched=switched, islands=islands)
    for it in items:
        lanes.add(it, budget.seconds_of(it, seconds))
    # the same pass with every guessed variant at GUESS_HIGH_S instead of budget.UNTIMED_S: how much the figure
    # rests on the guesses
    high = {k: (GUESS_HIGH_S if v is None else v) for k, v in seconds.items()}
    return {"gpus": gpus, "level": level, "link": link_name(switched, islands), "cores": cores,
            "variants": len(items),
            "predicted_s": round(budget.pass_seconds(items, seconds, jobs, rank_cap(cores), gpus, switched, islands),
                                 1),
            "guessed_high_s": round(budget.pass_seconds(items, high, jobs, rank_cap(cores), gpus, switched, islands),
                                    1),
            "lanes_s": {"timed": round(lanes.timed_wall(), 1),
                        "untimed": round(lanes.wall() - lanes.timed_wall() - lanes.cpu / max(1, jobs), 1),
                        "cpu": round(lanes.cpu / max(1, jobs), 1)},
            "carried_to_unmeasured_sizes": carried, "guessed": guessed, "from_one_rank": from_one_rank,
            "top": [(p, round(s, 1)) for p, s in per_probe.most_common(4)]}


def _variant(probe: str, key: str) -> Variant:
    parts = dict(key_parts(key))
    ranks = int(parts.get("ranks", "1") or 1)
    shared = parts.get("placement") == "shared"
    params = tuple((k, v) for k, v in key_parts(key) if k not in ("ranks", "placement", "gpus"))
    return Variant(probe, ranks, params, share_gpu=shared, gpus=int(parts.get("gpus", "0") or 0))


def check(path: Path, results: Path) -> dict[str, object]:
    """Predicted / measured for the variants a measured run timed, from a prior without its host's runs."""
    host = path.parent.name
    made = read_manifest(path.with_name(path.name.removesuffix(".jsonl") + ".manifest.json"))[0] or {}
    cls = runprogress.host_class(made.get("facts"))
    if cls is None:
        raise SystemExit(f"{path}: its manifest does not say the host's class")
    own_label = costmodel.host_label(cls.gpu_name, cls.gpu_count)
    kept = records(results, build_params(), leave_out=frozenset({host}))
    tables = costmodel.tables_for(costmodel.parse_prior(costmodel.derive(kept)), cls.gpu_name, cls.gpu_count)
    specs = {pid: mod.SPEC for pid, (_, mod) in registry.discover().items()}
    timed = [r for r in read_file(path)[0] if runprogress.timed(r) and r.probe_id in specs]
    items = [WorkItem(CellTarget(r.cell_id, "resolved"), specs[r.probe_id], _variant(r.probe_id, r.variant),
                      specs[r.probe_id].timeout_s) for r in timed]
    # a variant whose package its cell lacks skips at once, and a run knows that before it starts (the cell's
    # build record: checks.run.session.skipping_at_once), so it is priced as that skip here too
    lacking = {it.key: "its package" for r, it in zip(timed, items, strict=True)
               if r.verdict.status is Status.SKIP and r.verdict.reason_code == MISSING_PACKAGE}
    expected = runprogress.expected_durations(items, {}, "", None, tables, lacking=lacking)
    predicted = sum(budget.seconds_of(it, {k: e.seconds for k, e in expected.items()}) for it in items)
    measured = sum(r.verdict.duration_s for r in timed)
    return {"run": f"{host}/{path.name}", "class": own_label, "variants": len(items),
            "measured_sum_s": round(measured, 1), "predicted_sum_s": round(predicted, 1),
            "ratio": round(predicted / measured, 3) if measured else None,
            "guessed": sum(1 for e in expected.values() if e.seconds is None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-name", default="NVIDIA H200")
    ap.add_argument("--gpus", default="1,2,4,8")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--cores", type=int, default=16, help="the GPU host's cores, which cap the rank processes of "
                    "variants that time nothing running side by side (default 16); hosts of 8 GPUs or more: "
                    "--cores-8 instead, and the full level again at --cores to compare")
    ap.add_argument("--cores-8", type=int, default=EIGHT_GPU_CORES, help="the cores of a host of 8 GPUs or more "
                    f"(default {EIGHT_GPU_CORES}, an assumption: such servers have 96-224)")
    ap.add_argument("--prior", type=Path, default=costmodel.PRIOR_PATH)
    ap.add_argument("--results", type=Path, help="derive the prior from this results root instead of --prior")
    ap.add_argument("--check", type=Path, nargs="*", default=[])
    ap.add_argument("--step-grid", type=Path, nargs="*", default=[], metavar="JSON",
                    help="benchmarks/bench_step_grid.py's JSON files not yet in the prior: one rank's figures for the "
                    "step's variants with a GPU per rank, over the prior's own for the same GPU")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    committed = step_grids(committed_step_grids(ROOT))  # what tools/make_prior.py reads
    tables_all = costmodel.parse_prior(costmodel.derive(records(args.results, build_params()), committed)) \
        if args.results else costmodel.load_prior(args.prior)
    tables_all.update(costmodel.parse_prior(costmodel.derive([], step_grids(args.step_grid))))
    rows = []
    for n in (int(x) for x in args.gpus.split(",")):
        tables = costmodel.tables_for(tables_all, args.gpu_name, n)
        cores = args.cores_8 if n >= 8 else args.cores
        links: list[tuple[bool, tuple[tuple[int, ...], ...]]] = [(False, ())]
        links += [(False, switch_islands(n, k)) for k in (2, 4) if n >= 2 * k]
        links += [(True, ())] if n > 1 else []
        for level in (QUICK, FULL):
            for switched, islands in links:
                rows.append(predict_pass(tables, n, args.gpu_name, level, args.jobs, cores, switched, islands))
                if level == FULL and cores != args.cores:
                    rows.append(predict_pass(tables, n, args.gpu_name, level, args.jobs, args.cores, switched,
                                             islands))
    checks = [check(p, args.results or ROOT / "results") for p in args.check]
    if args.json:
        print(json.dumps({"predictions": rows, "checks": checks}, indent=1))
        return 0
    print(f"predicted cost of `checks run --all` on {args.gpu_name} hosts, one cell, from the prior alone "
          f"(jobs {args.jobs}; cores: {args.cores} below 8 GPUs, {args.cores_8} at 8 GPUs or more, an assumption: "
          f"8-GPU servers have 96-224, the full level again at {args.cores} to compare; growth per extra rank with "
          f"a GPU each: {costmodel.RANK_GROWTH:g}, an assumption)")
    print("link: PCIe, timed variants one at a time (every GPU on one CPU socket's root ports); PCIe swK, GPUs "
          "behind PCIe switches of K GPUs each (an assumed topology), timed variants side by side in different "
          "switches (K = 4 on 8 GPUs: also a host of two CPU sockets of four GPUs each without switches, whose "
          "sockets are the same islands: checks.run.placement.islands); "
          "NVSwitch (every GPU pair NV#), timed variants side by side on disjoint GPU sets (checks.run.placement); "
          "lanes: timed / untimed / CPU-only seconds of the wall time")
    floors = [t for t in tables_all.values() if t.one_rank]
    for t in floors:
        print(f"one rank's figures ({t.label}: {costmodel.ONE_RANK_HOW}, benchmarks/bench_step_grid.py): "
              + ", ".join(f"{s.probe} at {s.ranks} ranks {v:g} s" for s, v in sorted(t.seconds.items()))
              + "; used where no class's records predict a variant (column 'one rank')")
    print(f"{'GPUs':>4} {'level':>5} {'link':>9} {'cores':>5} {'variants':>8} {'predicted':>10} {'lanes':>20} "
          f"{'carried':>7} {'one rank':>8} {'guessed':>7}  costliest probes")
    for r in rows:
        top = ", ".join(f"{p} {s:g} s" for p, s in r["top"])  # type: ignore[union-attr]
        ln = r["lanes_s"]
        lanes = f"{ln['timed']:g}/{ln['untimed']:g}/{ln['cpu']:g}"  # type: ignore[index]
        print(f"{r['gpus']:>4} {r['level']:>5} {r['link']:>9} {r['cores']:>5} {r['variants']:>8} "
              f"{r['predicted_s']:>9g}s {lanes:>20} {r['carried_to_unmeasured_sizes']:>7} {r['from_one_rank']:>8} "
              f"{r['guessed']:>7}  {top}")
    for r in rows:
        if r["gpus"] == 8 and r["level"] == FULL:
            fits = "fits" if float(r["predicted_s"]) <= TEN_MINUTES_S else "does not fit"  # type: ignore[arg-type]
            print(f"8 GPUs, full level, {r['link']}, {r['cores']} cores: {r['predicted_s']} s {fits} 10 minutes "
                  f"({r['guessed']} variants guessed at {budget.UNTIMED_S:g} s; at {GUESS_HIGH_S:g} s each: "
                  f"{r['guessed_high_s']} s)")
    for c in checks:
        print(f"check {c['run']} ({c['class']}, {c['variants']} timed variants): predicted {c['predicted_sum_s']} s / "
              f"measured {c['measured_sum_s']} s = {c['ratio']} ({c['guessed']} guessed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
