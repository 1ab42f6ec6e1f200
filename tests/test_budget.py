"""`checks run --budget`: what a pass costs, what fits, what is left out and why, the packaged prior that
costs what no host here timed, and the run that starts nothing after its time (checks.run.cost.budget,
checks.run.cost.model, checks.run.runner)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checks.results.store import RunStore
from checks.run import runprogress, session
from checks.run.cost import budget
from checks.run.cost import model as costmodel
from checks.run.options import RunOptions, UsageError
from checks.run.plan import CellTarget, WorkItem
from checks.run.runner import Work, execute
from common import reasons
from inenv.probe import ProbeSpec, Variant
from inenv.status import Status

ROOT = Path(__file__).resolve().parent.parent
CELL = CellTarget("cu130-torch2.11.0-sglnone-fi0.7.4", "resolved")
GPU = ProbeSpec(id="step", title="t", feature="f", ranks=(2, 3, 4, 8), needs_gpu=True, timeout_s=60)
CPU = ProbeSpec(id="inventory", title="t", feature="f", ranks=(1,), needs_gpu=False, timeout_s=60)


def gpu_item(ranks: int, shared: bool = False, load: bool = False, backend: str = "nccl") -> WorkItem:
    params = (("backend", backend),) + ((("load", "sustained"),) if load else ())
    return WorkItem(CELL, GPU, Variant("step", ranks, params, share_gpu=shared, gpus=1 if shared else 0), 60.0)


def cpu_item(name: str) -> WorkItem:
    return WorkItem(CELL, CPU, Variant("inventory", 1, (("part", name),)), 60.0)


def test_pass_seconds_runs_timed_gpu_variants_alone_untimed_side_by_side_and_cpu_ones_over_jobs() -> None:
    items = [gpu_item(2), gpu_item(4), cpu_item("a"), cpu_item("b"), gpu_item(8, shared=True),
             WorkItem(CELL, GPU, Variant("step", 3, (("backend", "nccl"), ("depth", "setup"))), 60.0)]
    cost = {items[0].key: 10.0, items[1].key: 20.0, items[2].key: 6.0, items[3].key: 4.0, items[4].key: 7.0,
            items[5].key: 5.0}
    # untimed: 8 ranks x 7 s + 3 ranks x 5 s = 71 rank-seconds; over 16 ranks at once 4.4 s, less than the
    # longest of them, 7 s: 10 + 20 + 7 + (6 + 4) / 2
    assert budget.pass_seconds(items, cost, jobs=2, shared_ranks=16) == 42.0
    assert budget.pass_seconds(items, cost, jobs=1, shared_ranks=16) == 47.0
    assert budget.pass_seconds(items, cost, jobs=2, shared_ranks=8) == 10 + 20 + 71 / 8 + 5  # the cap binds
    assert budget.pass_seconds(items, cost, jobs=2, shared_ranks=0) == 47.0  # --gpu-alone: 10 + 20 + 7 + 5 + 5


def test_timed_variants_go_side_by_side_on_a_switched_host_of_eight_gpus_and_one_at_a_time_over_pcie() -> None:
    """Planted timed variants (ranks, seconds): 4x30 (a), 2x20 (b), 2x10 (c), 8x5 (d), 4x25 (e), and an untimed
    one. Placed costliest first on 8 GPUs: a on 0-3 and e on 4-7 at 0; e ends at 25: b and c on 4-7; a ends
    at 30, c at 35, b at 45: d (every GPU) runs 45-50. Timed lane 50 s (PCIe: 30+20+10+5+25 = 90 s), plus
    the untimed variant's 8 s (2 ranks x 8 s over a cap of 16, less than its own 8 s)."""
    items = [gpu_item(4, backend="a"), gpu_item(2, backend="b"), gpu_item(2, backend="c"), gpu_item(8, backend="d"),
             gpu_item(4, backend="e"), gpu_item(2, shared=True)]
    cost = dict(zip((it.key for it in items), (30.0, 20.0, 10.0, 5.0, 25.0, 8.0), strict=True))
    assert budget.pass_seconds(items, cost, jobs=1, shared_ranks=16, gpus=8, switched=True) == 50.0 + 8.0
    assert budget.pass_seconds(items, cost, jobs=1, shared_ranks=16, gpus=8, switched=False) == 90.0 + 8.0
    assert budget.pass_seconds(items, cost, jobs=1, shared_ranks=0, gpus=8, switched=True) == 90.0 + 8.0  # --gpu-alone
    assert budget.placed_seconds([(4, 30.0), (2, 20.0), (2, 10.0), (8, 5.0), (4, 25.0)], 8) == 50.0
    assert budget.placed_seconds([(2, 7.0)] * 4, 8) == 7.0  # four pairs at once
    assert budget.placed_seconds([(2, 7.0)] * 5, 8) == 14.0
    # pairs that name their GPUs: 0-1, 0-2 and 2-3 (7 s each) and 4-5 (3 s): 0-1, 2-3 and 4-5 start at once; 0-2
    # waits for 0-1 and 2-3 to end at 7 s and ends at 14 s. Counted as any two GPUs, the four would end at 7 s
    assert budget.placed_seconds([((0, 1), 7.0), ((0, 2), 7.0), ((2, 3), 7.0), ((4, 5), 3.0)], 8) == 14.0
    # a pair and a variant of four GPUs: 0-1 (10 s) first; the four take 2-5 beside it (8 s); 6-7 (9 s) beside both
    assert budget.placed_seconds([((0, 1), 10.0), (4, 8.0), ((6, 7), 9.0)], 8) == 10.0
    # a pair naming a GPU the host lacks takes every GPU, as the runner gives it: 5 s, then 0-1's 5 s
    assert budget.placed_seconds([((0, 9), 5.0), ((0, 1), 5.0)], 4) == 10.0


def test_a_pass_longer_than_ten_minutes_without_a_budget_is_told_what_ten_would_keep() -> None:
    """Timed variants one at a time: 300 + 200 s of the quick answer and the host's size, 200 s of sustained
    load. Ten minutes keep the first two (500 s) and leave the load variant; a pass of 9 minutes gets no line."""
    items = [gpu_item(2), gpu_item(8), gpu_item(8, load=True, backend="b")]
    cost = dict(zip((it.key for it in items), (300.0, 200.0, 200.0), strict=True))
    line = budget.budget_hint(items, cost, jobs=1, gpus=8, shared_ranks=16)
    assert line == ("budget: none given, and this pass costs about 11m40s; given 10 minutes (`--budget 10`, which "
                    "counts the whole command) it would run about 8m20s and leave out 1 variant(s) for a later run: "
                    "step 1 (sustained load)")
    assert budget.budget_hint(items[:2] + [gpu_item(4)], {**cost, gpu_item(4).key: 40.0}, jobs=1, gpus=8,
                              shared_ranks=16) == ""


def test_untimed_variants_are_guessed_at_the_stated_constant() -> None:
    item = gpu_item(2)
    assert budget.seconds_of(item, {}) == 10.0
    assert budget.pass_seconds([item], {item.key: None}, jobs=1) == 10.0


def test_tiers_put_the_quick_answer_first_and_sustained_load_last() -> None:
    items = [gpu_item(2), gpu_item(4), gpu_item(8), gpu_item(3, shared=True), gpu_item(2, load=True), cpu_item("x")]
    smallest = budget.smallest_sizes(items)
    # 8 GPUs: 2 ranks is the smallest world size of its params (0), 8 the host's GPU count (1), 4 another real
    # size (2), 3 shared ranks (3), the sustained-load variant (4), one rank (0)
    assert [budget.tier(it, smallest, 8) for it in items] == [0, 2, 1, 3, 4, 0]


def test_a_probe_that_replays_under_load_is_the_last_tier_at_every_world_size() -> None:
    load = ProbeSpec("load", "l", "f", needs_gpu=True, distinct_gpus=False, ranks=(2, 4), min_ranks=2, sustained=True)
    items = [WorkItem(CELL, load, Variant("load", n, (("backend", "nccl"),)), 60.0) for n in (2, 8)]
    smallest = budget.smallest_sizes(items)
    assert [budget.tier(it, smallest, 8) for it in items] == [4, 4]


def test_a_shallow_variant_is_a_gpu_per_rank_at_another_world_size() -> None:
    # 8 GPUs, one backend: deep at 2, 4 and 8, depth=setup at 3, 5, 6 and 7 (inenv.probe.multi_rank)
    setup = (("backend", "nccl"), ("depth", "setup"))
    deep = [gpu_item(n) for n in (2, 4, 8)]
    shallow = [WorkItem(CELL, GPU, Variant("step", n, setup), 60.0) for n in (3, 5, 6, 7)]
    smallest = budget.smallest_sizes([*deep, *shallow])
    # the question's smallest world size is 2 whatever the depth: 3 shallow ranks are not the quick answer
    assert [budget.tier(it, smallest, 8) for it in [*deep, *shallow]] == [0, 2, 1, 2, 2, 2, 2]
    assert budget.TIER_NAMES[2] == "a GPU per rank at other world sizes"


def test_fit_keeps_the_most_informative_that_fit_and_says_what_it_left() -> None:
    quick, real8, real4, shared3, load = gpu_item(2), gpu_item(8), gpu_item(4), gpu_item(3, shared=True), \
        gpu_item(2, load=True)
    items = [quick, real8, real4, shared3, load]
    cost = {quick.key: 5.0, real8.key: 10.0, real4.key: 10.0, shared3.key: 1.0, load.key: 100.0}
    fitted = budget.fit(items, cost, budget_s=16.5, jobs=1, gpus=8, shared_ranks=16)
    # tier order: quick (5), real8 (10): 15 s; real4 would make 25; shared3 (1 s beside nothing else: 1 s)
    # still fits
    assert [it.key for it in fitted.left_out] == [real4.key, load.key]
    assert fitted.kept_s == pytest.approx(16.0) and fitted.planned_s == pytest.approx(126.0)
    assert fitted.budget_s == 16.5
    left = {it.key: it for it in fitted.items if it.decided is not None}
    assert set(left) == {real4.key, load.key}
    assert all(it.decided.status is Status.NOT_RUN and it.decided.reason_code == "over-budget" for it in left.values())
    assert "tier 4 of 4" in left[load.key].decided.note and "sustained load" in left[load.key].decided.note
    assert [it.key for it in fitted.items] == [it.key for it in items]  # plan order kept
    lines = budget.left_out_lines(fitted)
    assert lines[0].startswith("budget: 16 s left, and this pass's cost, about 2m06s, does not fit; running about "
                               "16 s and leaving out 2 variant(s)")
    assert "step 1 (a GPU per rank at other world sizes), step 1 (sustained load)" in lines[0]
    assert "`checks run --probe step`" in lines[1]


def test_a_budget_the_plan_fits_leaves_nothing_out() -> None:
    items = [gpu_item(2), cpu_item("a")]
    fitted = budget.fit(items, {items[0].key: 3.0, items[1].key: 2.0}, budget_s=60.0, jobs=1, gpus=2)
    assert fitted.left_out == [] and fitted.items == items
    assert budget.left_out_lines(fitted) == ["budget: 1m00s left, and this pass's cost, about 5.0 s, fits"]


def test_items_that_do_not_run_cost_nothing_and_stay_as_they_were() -> None:
    decided = gpu_item(4)
    from checks.run.plan import Decided
    decided = WorkItem(decided.cell, decided.spec, decided.variant, 60.0,
                       decided=Decided(Status.SKIP, "too-few-gpus", "needs 4 GPUs"))
    fitted = budget.fit([decided], {}, budget_s=0.0, jobs=1, gpus=1)
    assert fitted.left_out == [] and fitted.items[0].decided.reason_code == "too-few-gpus"
    assert budget.pass_seconds([decided], {}, 1) == 0.0


def test_cost_lines_per_probe_and_world_size_longest_first() -> None:
    a, b, c, d = gpu_item(2), gpu_item(2, backend="x"), gpu_item(4, shared=True), cpu_item("a")
    cost = {a.key: 4.0, b.key: 6.0, c.key: 30.0, d.key: None}
    lines = budget.cost_lines([a, b, c, d], cost, {d.key: True})
    assert lines == ["step: 3 variant(s), about 40 s (2 ranks 2 x 5.0 s; 4 ranks shared 1 x 30 s)",
                     "inventory: 1 variant(s), about 10 s (1 rank 1 x 10 s; 1 never timed, guessed at 10 s)"]


def test_the_cost_model_scales_shared_ranks_by_world_size_and_own_gpus_by_the_stated_growth() -> None:
    table = costmodel.CostTable("NVIDIA H200 x2", {costmodel.Shape("step", 2, True): 8.0,
                                                   costmodel.Shape("step", 2, False): 10.0,
                                                   costmodel.Shape("fi-jit", 1, False, "vllm_comm"): 15.0},
                                growth=0.05)
    assert table.predict(costmodel.Shape("step", 2, True)).seconds == 8.0
    shared8 = table.predict(costmodel.Shape("step", 8, True))
    assert shared8.seconds == 32.0 and "sharing GPUs" in shared8.how
    own8 = table.predict(costmodel.Shape("step", 8, False))
    assert own8.seconds == pytest.approx(13.0) and "assumption" in own8.how  # 10 * (1 + 0.05 * 6)
    assert table.predict(costmodel.Shape("fi-jit", 1, False, "trtllm_comm")) is None  # another module: unknown
    assert table.predict(costmodel.Shape("symm-mem", 2, False)) is None


def test_prior_tables_for_a_host_take_its_class_then_the_nearest_gpu_count() -> None:
    tables = costmodel.parse_prior({"schema": 1, "rank_growth": 0.1, "classes": {
        "NVIDIA H200 x1": {"step|2|shared|": 9.0}, "NVIDIA H200 x2": {"step|2|own|": 7.0},
        "NVIDIA B200 x8": {"step|8|own|": 20.0}, "no GPU": {"inventory|1|own|": 9.5}}})
    assert [t.label for t in costmodel.tables_for(tables, "NVIDIA H200", 2)] == \
        ["NVIDIA H200 x2", "NVIDIA H200 x1", "NVIDIA B200 x8"]
    assert [t.label for t in costmodel.tables_for(tables, "NVIDIA RTX PRO 6000", 8)] == \
        ["NVIDIA B200 x8", "NVIDIA H200 x2", "NVIDIA H200 x1"]
    assert [t.label for t in costmodel.tables_for(tables, "", 0)] == ["no GPU"]
    got = costmodel.predict(costmodel.tables_for(tables, "NVIDIA H200", 2), costmodel.Shape("step", 4, False))
    assert got is not None and got[1] == "NVIDIA H200 x2" and got[0].seconds == pytest.approx(8.4)  # 7 * 1.2


@pytest.mark.parametrize("bad", [None, [], {"schema": 2, "classes": {}}, {"schema": 1, "classes": []},
                                 {"schema": 1, "classes": {"x": {"step|two|own|": 1.0, "step|2|own|": "9",
                                                                 "s|2|own|": float("nan"), "q|2|mine|": 1.0,
                                                                 "z|2|own|": -1.0, "y|2|own|": True}}}])
def test_a_prior_that_does_not_fit_its_grammar_is_left_out(bad: object) -> None:
    assert costmodel.parse_prior(bad) == {}


def test_derive_takes_the_median_per_class_and_shape_over_the_newest_run_that_timed_it() -> None:
    s = costmodel.Shape("step", 2, True)
    h200, inventory = "NVIDIA H200 x1", costmodel.Shape("inventory", 1, False)
    new, old = "20261201T021126Z-b42a", "20261130T213046Z-f1ed"
    got = costmodel.derive([(h200, s, 3.0, new, True, True, "c1"), (h200, s, 9.0, new, True, True, "c1"),
                            (h200, s, 4.0, new, True, True, "c1"), (h200, s, float("inf"), new, True, True, "c1"),
                            (h200, s, 20.0, old, True, True, "c1"), (h200, s, 21.0, old, True, True, "c1"),
                            (h200, s, 22.0, old, True, True, "c1"), (h200, s, 23.0, old, True, True, "c1"),
                            ("no GPU", inventory, 2.0, old, True, True, "c1")])
    # the older run's four slow records would make the median over both runs 9.0
    assert got["classes"] == {"NVIDIA H200 x1": {"step|2|shared|": 4.0}, "no GPU": {"inventory|1|own|": 2.0}}


def test_derive_passes_over_a_newer_run_whose_records_of_the_shape_are_all_skips() -> None:
    s = costmodel.Shape("step", 2, True)
    h200, engine = "NVIDIA H200 x1", costmodel.Shape("engine", 1, False)
    newest, older = "20261206T150047Z-bebb", "20261205T031854Z-94b2"
    got = costmodel.derive([(h200, s, 0.3, newest, False, True, "c1"),  # preflight skips
                            (h200, s, 0.4, newest, False, True, "c1"),
                            (h200, s, 9.0, older, True, True, "c1"), (h200, s, 0.3, older, False, True, "c1"),
                            (h200, engine, 0.2, newest, False, True, "c1"),
                            (h200, engine, 0.5, older, False, True, "c1")])
    # the older run's one variant that ran, not its skip; a shape only ever skipped keeps its newest skips
    assert got["classes"] == {"NVIDIA H200 x1": {"step|2|shared|": 9.0, "engine|1|own|": 0.2}}


def test_derive_passes_over_a_newer_run_that_compiled_beside_its_variants_for_a_quiet_one_of_the_same_code() -> None:
    load, jit = costmodel.Shape("load", 2, True), costmodel.Shape("fi-jit", 1, False, "trtllm_comm", True)
    step = costmodel.Shape("step", 2, True)
    h100 = "NVIDIA H100 80GB HBM3 x1"
    compiling, quiet, older = "20261207T104917Z-e213", "20261207T104646Z-8ca8", "20261206T174201Z-eaec"
    got = costmodel.derive([
        (h100, load, 12.0, compiling, True, False, "L2"), (h100, jit, 180.0, compiling, True, False, "J2"),
        (h100, step, 9.0, compiling, True, False, "S2"),
        (h100, load, 8.0, quiet, True, True, "L2"), (h100, step, 5.0, quiet, True, True, "S1"),
        (h100, load, 7.0, older, True, True, "L1"), (h100, jit, 300.0, older, True, False, "J1")])
    # load: the quiet run of the same code; step: the quiet run measured older code, so the newest stands;
    # the compile: the newest run that compiled it
    assert got["classes"] == {h100: {"load|2|shared|": 8.0, "step|2|shared|": 9.0,
                                     "fi-jit|1|own|trtllm_comm|compile": 180.0}}


def test_the_packaged_prior_loads_and_costs_every_probe_a_one_gpu_h200_runs() -> None:
    tables = costmodel.load_prior()
    assert "NVIDIA H200 x1" in tables and "no GPU" in tables
    probes = {s.probe for s in tables["NVIDIA H200 x1"].seconds}
    assert {"step", "symm-mem", "fi-fusion", "custom-ar", "pcie-ipc", "inventory", "fi-jit"} <= probes


def test_one_rank_figures_stand_below_every_class_and_only_for_the_full_level(tmp_path: Path) -> None:
    from checks.run.cost.prior import step_grids

    good = tmp_path / "a" / "step-grid-2.json"
    later = tmp_path / "b" / "step-grid-2.json"
    eight = tmp_path / "b" / "step-grid-8.json"
    for path, body in ((good, {"gpu": "NVIDIA H100 80GB HBM3", "world_widths": 2, "estimate_s": 30.0}),
                       (later, {"gpu": "NVIDIA H100 80GB HBM3", "world_widths": 2, "estimate_s": 20.0}),
                       (eight, {"gpu": "NVIDIA H100 80GB HBM3", "world_widths": 8, "estimate_s": 15.5})):
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(body))
    bad = []
    for i, body in enumerate(["{", "[]", {"gpu": 3, "world_widths": 2, "estimate_s": 1.0},
                              {"gpu": "G", "world_widths": 1, "estimate_s": 1.0},
                              {"gpu": "G", "world_widths": True, "estimate_s": 1.0},
                              {"gpu": "G", "world_widths": 2, "estimate_s": "5"},
                              {"gpu": "G", "world_widths": 2, "estimate_s": -1.0},
                              {"gpu": "G\n", "world_widths": 2, "estimate_s": 1.0}]):
        bad.append(tmp_path / f"bad{i}.json")
        bad[-1].write_text(body if isinstance(body, str) else json.dumps(body))
    floors = step_grids([good, later, eight, *bad])
    # the later file of one GPU and world size stands; every malformed file is left out
    assert floors == {"NVIDIA H100 80GB HBM3": {costmodel.Shape("step", 2, False): 20.0,
                                                 costmodel.Shape("step", 8, False): 15.5}}
    data = costmodel.derive([("NVIDIA H200 x2", costmodel.Shape("step", 2, False), 7.0, "r1", True, True, "c")],
                            floors)
    assert data["one_rank"] == {"NVIDIA H100 80GB HBM3": {"step|2|own|": 20.0, "step|8|own|": 15.5}}
    tables = costmodel.parse_prior(data)
    label = "NVIDIA H100 80GB HBM3, one rank of each"
    # a class's own records of a GPU per rank come first, whatever the GPU; one rank's figures last
    assert [t.label for t in costmodel.tables_for(tables, "NVIDIA H100 80GB HBM3", 8)] == ["NVIDIA H200 x2", label]
    (only_floor,) = [t for t in tables.values() if t.one_rank]
    got = costmodel.predict([only_floor], costmodel.Shape("step", 4, False))
    assert got is not None and got[0].seconds == pytest.approx(20.0 * 1.1)  # carried up from 2 ranks, growth 0.05
    assert costmodel.ONE_RANK_HOW in got[0].how
    assert costmodel.predict([only_floor], costmodel.Shape("step", 8, False))[0].how == costmodel.ONE_RANK_HOW
    assert costmodel.at_level(tables.values(), quick=True) == [tables["NVIDIA H200 x2"]]
    assert len(costmodel.at_level(tables.values(), quick=False)) == 2
    # what the plan says of such a variant on a host of another GPU: the figure, whose GPU, and how it was made
    item = gpu_item(8)
    got = runprogress.expected_durations([item], {}, "venv", None, [only_floor])[item.key]
    assert got.seconds == 15.5
    assert got.text() == ("about 16 s by the prior measured on NVIDIA H100 80GB HBM3, one rank of each (one rank of "
                          "such a variant measured, the links' time estimated)")


def test_set_up_checks_with_a_gpu_per_rank_are_costed_from_the_same_checks_by_ranks_sharing_a_gpu() -> None:
    table = costmodel.CostTable("NVIDIA H200 x1", {costmodel.Shape("custom-ar", 2, True): 4.0,
                                                   costmodel.Shape("custom-ar", 8, True): 8.0,
                                                   costmodel.Shape("step", 2, False, setup=True): 3.0})
    got = table.predict(costmodel.Shape("custom-ar", 6, False, setup=True))
    # the nearest shared size is 8 ranks (8.0 s), scaled by the world size: 8.0 * 6 / 8
    assert got is not None and got.seconds == pytest.approx(6.0) and "sharing GPUs" in got.how
    # a set-up shape measured with a GPU per rank stands over the shared one
    assert table.predict(costmodel.Shape("step", 5, False, setup=True)).seconds == pytest.approx(3.0 * 1.15)
    assert table.predict(costmodel.Shape("nccl-graphs", 3, False, setup=True)) is None
    # a GPU per rank running the full grid is not the set-up checks: nothing to carry it from
    assert table.predict(costmodel.Shape("custom-ar", 4, False)) is None


def test_the_packaged_prior_holds_the_committed_step_grid_figures() -> None:
    committed = sorted(ROOT.glob("benchmarks/results/*/step-grid-*.json"))
    assert committed
    gpus = {json.loads(p.read_text())["gpu"] for p in committed}
    floors = {t.label for t in costmodel.load_prior().values() if t.one_rank}
    assert floors == {f"{gpu}, one rank of each" for gpu in gpus}


def test_expected_durations_fall_back_to_the_prior_and_say_so() -> None:
    item = gpu_item(8, shared=True)
    tables = [costmodel.CostTable("NVIDIA H200 x1", {costmodel.Shape("step", 2, True): 9.0})]
    got = runprogress.expected_durations([item], {}, "venv", None, tables)[item.key]
    assert got.seconds == 36.0 and got.prior == "NVIDIA H200 x1"
    assert got.text() == ("about 36 s by the prior measured on NVIDIA H200 x1 (scaled from 2 ranks sharing GPUs by "
                          "the world size)")
    view = runprogress.RunView([item], {item.key: got})
    assert view.basis() == "no earlier run on this host; 1 by the prior measured on NVIDIA H200 x1 (packaged with " \
                           "stackprobe)"


def test_budget_option_is_validated_once() -> None:
    with pytest.raises(UsageError, match="--budget 0: give the minutes"):
        RunOptions(all_probes=True, budget_s=0.0).check()
    with pytest.raises(UsageError, match="--budget"):
        RunOptions(all_probes=True, budget_s=float("nan")).check()
    assert RunOptions(all_probes=True, budget_s=90.0).check().budget_s == 90.0


def test_budget_on_the_command_line_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "checks.cli", "run", "--all", "--budget", "-3", "--results",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["checks run: --budget -3: give the minutes this host can spare, more "
                                                "than 0 and at most 10080"]


class _Slow:
    """An executor whose every variant takes ``seconds`` and passes (the runner's deadline is what is tested)."""

    gated = False

    def __init__(self, seconds: float) -> None:
        self.seconds, self.ran = seconds, []

    def run(self, variant: Variant, gpus: int, timeout_s: float, catalogue: object, **_: object) -> object:
        from checks.results.result import Verdict
        time.sleep(self.seconds)
        self.ran.append(variant.key)
        return Verdict(Status.PASS, duration_s=self.seconds)


def test_nothing_starts_after_the_deadline_and_what_did_not_start_is_over_budget(tmp_path: Path) -> None:
    items = [cpu_item(str(i)) for i in range(4)]
    ex = _Slow(0.3)
    store = RunStore(tmp_path, "cpu-12345678", "20261206T000000Z-abcd")
    work = Work(items, store, reasons.default(), 0, executors={CELL.cell_id: ex},
                deadline=time.monotonic() + 0.45)
    report = execute(RunOptions(all_probes=True, jobs=1, level="full"), work)
    statuses = [(r.variant, r.verdict.status, r.verdict.reason_code) for r in report.results]
    assert statuses[:2] == [(items[0].variant.key, Status.PASS, ""), (items[1].variant.key, Status.PASS, "")]
    assert statuses[2:] == [(items[2].variant.key, Status.NOT_RUN, "over-budget"),
                            (items[3].variant.key, Status.NOT_RUN, "over-budget")]
    assert ex.ran == [items[0].variant.key, items[1].variant.key]
    stored = [json.loads(line) for line in store.results_path.read_text().splitlines()]
    assert [r["reason_code"] for r in stored] == ["", "", "over-budget", "over-budget"]


def test_the_over_budget_reason_is_in_the_catalogue_with_a_next_step() -> None:
    entry = reasons.default().get("over-budget")
    assert entry is not None and "larger --budget" in entry.remediation


def test_session_fit_budget_without_a_deadline_changes_nothing() -> None:
    items = [gpu_item(2)]
    planned = session.Planned(items, {}, None, {}, {})  # type: ignore[arg-type]
    view = runprogress.RunView(items, {})
    assert session.fit_budget(RunOptions(all_probes=True), planned, view, 1, None) == (planned, view, None)


def test_prior_records_come_from_timed_results_and_leave_out_unmarked_sharing(tmp_path: Path) -> None:
    from checks.run.cost import prior
    from tests.test_runprogress_lent import H200, _run

    _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200, [
        (CELL.cell_id, "step", "ranks=2,placement=shared,gpus=1,backend=nccl", 9.5),
        (CELL.cell_id, "step", "ranks=2,backend=nccl", 25.0),  # 2 ranks, one GPU, not marked shared: left out
        (CELL.cell_id, "fi-jit", "ranks=1,module=vllm_comm,arch=local", 14.0),
        (CELL.cell_id, "inventory", "ranks=1", 0.0)])  # took no time: not timed
    (tmp_path / "h200x1-bbbbbbbb").symlink_to(tmp_path / "h200x1-aaaaaaaa")  # a linked folder is not read
    got = list(prior.records(tmp_path, {"fi-jit": "module"}))
    assert got == [("NVIDIA H200 x1", costmodel.Shape("step", 2, True), 9.5, "20261201T000000Z-aaaa", True, True,
                    "h"),
                   ("NVIDIA H200 x1", costmodel.Shape("fi-jit", 1, False, "vllm_comm"), 14.0, "20261201T000000Z-aaaa",
                    True, True, "h")]


def test_a_run_whose_host_compiled_is_not_quiet(tmp_path: Path) -> None:
    from checks.run.cost import prior
    from tests.test_runprogress_lent import H200, _run

    path = _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200, [
        (CELL.cell_id, "step", "ranks=2,placement=shared,gpus=1,backend=nccl", 9.5),
        (CELL.cell_id, "fi-jit", "ranks=1,module=trtllm_comm,arch=local", 180.0)])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["metrics"] = {"compile_s": 171.9}  # fi-jit measured a compile here
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = list(prior.records(tmp_path, {"fi-jit": "module"}))
    assert got == [("NVIDIA H200 x1", costmodel.Shape("step", 2, True), 9.5, "20261201T000000Z-aaaa", True, False,
                    "h"),
                   ("NVIDIA H200 x1", costmodel.Shape("fi-jit", 1, False, "trtllm_comm", True), 180.0,
                    "20261201T000000Z-aaaa", True, False, "h")]


def _jit_item(module: str, arch: str = "local") -> WorkItem:
    from inenv.probes import fi_jit

    cell = CellTarget(CELL.cell_id, "resolved", versions={"flashinfer": "0.7.4"})
    return WorkItem(cell, fi_jit.SPEC, Variant("fi-jit", 1, (("module", module), ("arch", arch))), 3000.0)


def test_a_compile_variant_compiles_here_unless_carried_held_or_published() -> None:
    from checks.run.plan import compiles_here

    none_published: object = lambda item, modules: list(modules)  # noqa: E731
    all_published: object = lambda item, modules: []  # noqa: E731
    item = _jit_item("trtllm_comm")
    assert compiles_here(item, {}, "9.0", none_published)
    assert not compiles_here(item, {CELL.cell_id: {"trtllm_comm": ("sm_90a",)}}, "9.0", none_published)
    assert compiles_here(item, {CELL.cell_id: {"trtllm_comm": ("sm_120a",)}}, "9.0", none_published)  # other GPUs'
    assert not compiles_here(item, {}, "9.0", all_published)
    cross = _jit_item("trtllm_comm", "12.0a")
    assert not compiles_here(cross, {CELL.cell_id: {"trtllm_comm": ("sm_90a", "sm_120a")}}, None, none_published)
    assert compiles_here(cross, {CELL.cell_id: {"trtllm_comm": ("sm_90a",)}}, None, none_published)
    assert not compiles_here(gpu_item(2), {}, "9.0", none_published)  # no build parameter: nothing to compile


def test_a_compile_is_costed_as_a_compile_and_the_plan_says_what_compiles() -> None:
    load, build = _jit_item("trtllm_comm"), _jit_item("moe_a2a")
    tables = [costmodel.CostTable("NVIDIA H200 x1", {
        costmodel.Shape("fi-jit", 1, False, "trtllm_comm"): 5.5,
        costmodel.Shape("fi-jit", 1, False, "moe_a2a"): 6.0,
        costmodel.Shape("fi-jit", 1, False, "moe_a2a", compiles=True): 91.5})]
    got = runprogress.expected_durations([load, build], {}, "local", None, tables, compiling={build.key})
    assert got[load.key].seconds == 5.5 and got[build.key].seconds == 91.5
    view = runprogress.RunView([load, build], got, compiling=frozenset({build.key}))
    assert session.compile_lines(view) == [f"  {CELL.cell_id}: compiles moe_a2a@local here, about 1m32s of compiling"]
    assert costmodel.Shape.parse("fi-jit|1|own|moe_a2a|compile") == costmodel.Shape("fi-jit", 1, False, "moe_a2a",
                                                                                      True)
    assert costmodel.Shape.parse("fi-jit|1|own|moe_a2a|compiled") is None


def test_what_a_users_environment_holds_is_read_from_it_and_checked(tmp_path: Path) -> None:
    from checks.run import cells

    fake = tmp_path / "python"
    answer = {"vllm_comm": {"arch_dir": "90a", "source": "jit-cache"}, "trtllm_comm": {"arch_dir": "../x"},
              "not_a_module": {"arch_dir": "90a"}, "moe_a2a": "text"}
    fake.write_text("#!/bin/sh\necho 'noise'\necho '@@FI-JIT@@ " + json.dumps(answer) + "'\n")
    fake.chmod(0o755)

    class Env:
        python = str(fake)

        def env(self) -> dict[str, str]:
            return {"PATH": "/usr/bin:/bin"}

    assert cells.env_modules(Env(), "9.0") == {"vllm_comm": ("sm_90a",)}  # type: ignore[arg-type]
    fake.write_text("#!/bin/sh\necho '@@FI-JIT@@ {not json'\n")
    assert cells.env_modules(Env(), "9.0") == {}  # type: ignore[arg-type]
    Env.python = str(tmp_path / "missing")
    assert cells.env_modules(Env(), "9.0") == {}  # type: ignore[arg-type]


def test_a_setup_depth_variant_is_its_own_shape() -> None:
    item = WorkItem(CELL, GPU, Variant("step", 3, (("backend", "nccl"), ("depth", "setup"))), 60.0)
    shape = runprogress.shape_of(item)
    assert shape == costmodel.Shape("step", 3, False, setup=True) and shape.label() == "step|3|setup|"
    assert costmodel.Shape.parse("step|3|setup|") == shape
    table = costmodel.CostTable("x", {costmodel.Shape("step", 2, False): 30.0,
                                      costmodel.Shape("step", 5, False, setup=True): 4.0})
    assert table.predict(shape).seconds == pytest.approx(4.0 * (1 + 0.05 * -2))  # from the setup shape, not 30 s


def test_gpu_alone_reaches_every_worker_of_the_run() -> None:
    from checks.cli import parser, run_options
    from checks.run.executor import run_env
    from inenv import gpugate

    args = parser().parse_args(["run", "--all", "--gpu-alone"])
    assert run_options(args, ["run", "--all", "--gpu-alone"]).gpu_alone
    assert dict(run_env("c", (), None, gpu_alone=True))[gpugate.ALONE_ENV] == "1"
    assert dict(run_env("c", (), None))[gpugate.ALONE_ENV] == ""  # unset: shared where a variant times nothing


def test_an_environment_is_inspected_once_per_executor(tmp_path: Path) -> None:
    """The cell's discovery and the host's peer facts both ask the local environment what it is; the
    interpreter is started once (each start imports torch: seconds on a GPU host)."""
    from checks.run.executor import LocalExecutor
    from inenv.probe import RESULT_MARKER

    count = tmp_path / "count"
    fake = tmp_path / "python"
    line = RESULT_MARKER + json.dumps({"versions": {"torch": "2.11.0"}})
    fake.write_text(f"#!/bin/sh\necho x >> {count}\necho '{line}'\n")
    fake.chmod(0o755)
    ex = LocalExecutor(str(fake))
    assert ex.inspect() == {"versions": {"torch": "2.11.0"}} == ex.inspect()
    assert count.read_text().count("x") == 1


def test_prior_records_leave_out_the_hosts_asked(tmp_path: Path) -> None:
    from checks.run.cost import prior
    from tests.test_runprogress_lent import H200, _run

    for host, seconds in (("h200x1-aaaaaaaa", 9.5), ("h200x1-bbbbbbbb", 4.0)):
        _run(tmp_path, host, "20261201T000000Z-aaaa", "venv", H200,
             [(CELL.cell_id, "step", "ranks=2,placement=shared,gpus=1,backend=nccl", seconds)])
    got = list(prior.records(tmp_path, {}, leave_out=frozenset({"h200x1-aaaaaaaa"})))
    assert got == [("NVIDIA H200 x1", costmodel.Shape("step", 2, True), 4.0, "20261201T000000Z-aaaa", True, True,
                    "h")]


P2P = ProbeSpec(id="host-p2p", title="t", feature="f", ranks=(1, 2), needs_gpu=True, timeout_s=60)
NVSWITCH8 = {"gpu_count": 8, "topology": "\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\n" + "\n".join(
    f"GPU{i}\t" + "\t".join("X" if j == i else "NV18" for j in range(8)) for i in range(8))}


def _placed_plan() -> tuple[list[WorkItem], dict[tuple[str, str, str], runprogress.Expected]]:
    """Planted timed variants on an 8-GPU host: A 4 ranks 30 s, pairs 0-1 and 0-2 (GPUs named) 20 s each, D 2
    ranks 10 s."""
    a, d = gpu_item(4, backend="a"), gpu_item(2, backend="d")
    b = WorkItem(CELL, P2P, Variant("host-p2p", 2, (("check", "copy"), ("pair", "0-1"))), 60.0)
    c = WorkItem(CELL, P2P, Variant("host-p2p", 2, (("check", "copy"), ("pair", "0-2"))), 60.0)
    items = [a, b, c, d]
    return items, {it.key: runprogress.Expected(s) for it, s in zip(items, (30.0, 20.0, 20.0, 10.0), strict=True)}


def test_the_time_left_places_timed_variants_side_by_side_on_an_nvswitch_host() -> None:
    """By hand, costliest first on 8 GPUs every pair NVLink: at 0 A takes GPUs 0-3 and D 4-5; the pairs wait for
    GPU 0; A ends at 30: pair 0-1 runs 30-50, then pair 0-2 50-70 (they share GPU 0). 70 s; one at a time
    30 + 20 + 20 + 10 = 80 s, and so with --gpu-alone (no shared lane)."""
    items, expected = _placed_plan()
    assert runprogress.RunView(items, expected, gpus=8, switched=True).left().seconds == 70.0
    assert runprogress.RunView(items, expected, gpus=8, switched=False).left().seconds == 80.0
    assert runprogress.RunView(items, expected, shared_ranks=0, gpus=8, switched=True).left().seconds == 80.0
    # what the session tells the view: NVLink between every pair, not --gpu-alone, not Slurm
    opts = RunOptions(all_probes=True)
    assert session.side_by_side(opts, "docker", NVSWITCH8)
    assert not session.side_by_side(opts, "slurm", NVSWITCH8)
    assert not session.side_by_side(RunOptions(all_probes=True, gpu_alone=True), "docker", NVSWITCH8)
    pcie = {**NVSWITCH8, "topology": NVSWITCH8["topology"].replace("NV18", "SYS")}
    assert not session.side_by_side(opts, "docker", pcie)


def test_the_time_left_on_a_pcie_switch_host_places_timed_variants_one_a_switch() -> None:
    """Four 2-rank timed variants of 10 s on 8 GPUs behind PCIe switches: 10 s with a switch each (four
    switches of two), 20 s with two switches of four (one variant a switch), 40 s on GPUs of the CPU's root
    ports (one at a time). The session tells the view so from the facts."""
    items = [gpu_item(2, backend=f"b{i}") for i in range(4)]
    expected = {it.key: runprogress.Expected(10.0) for it in items}
    pairs, quads = ((0, 1), (2, 3), (4, 5), (6, 7)), ((0, 1, 2, 3), (4, 5, 6, 7))
    assert runprogress.RunView(items, expected, gpus=8, switched=True, islands=pairs).left().seconds == 10.0
    assert runprogress.RunView(items, expected, gpus=8, switched=True, islands=quads).left().seconds == 20.0
    assert runprogress.RunView(items, expected, gpus=8, switched=False).left().seconds == 40.0
    links = [["X" if i == j else "PIX" if i // 2 == j // 2 else "SYS" for j in range(8)] for i in range(8)]
    facts = {"gpu_count": 8, "peer_access": [[True] * 8 for _ in range(8)],
             "topology": "\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\n"
             + "\n".join(f"GPU{i}\t" + "\t".join(row) for i, row in enumerate(links))}
    assert session.side_by_side(RunOptions(all_probes=True), "docker", facts)
    assert not session.side_by_side(RunOptions(all_probes=True, gpu_alone=True), "docker", facts)


def test_a_budget_on_an_nvswitch_host_keeps_what_fits_side_by_side() -> None:
    """A budget of 75 s: placed side by side the plan takes 70 s (the test above) and all of it is kept; one at a
    time it takes 80 s, so the costliest of the four (all the quick answer, tier 0; cheaper first: D 10, the pairs
    20 + 20, A 30) is left out and 50 s kept."""
    items, expected = _placed_plan()
    planned = session.Planned(items, {}, None, {}, {})  # type: ignore[arg-type]
    opts = RunOptions(all_probes=True)
    view = runprogress.RunView(items, expected, gpus=8, switched=True)
    _, kept, fitted = session.fit_budget(opts, planned, view, 8, time.monotonic() + 75.0)
    assert fitted is not None and fitted.left_out == [] and fitted.kept_s == 70.0 and kept.left().seconds == 70.0
    alone = runprogress.RunView(items, expected, gpus=8, switched=False)
    _, kept, fitted = session.fit_budget(opts, planned, alone, 8, time.monotonic() + 75.0)
    assert fitted is not None and [it.key for it in fitted.left_out] == [items[0].key] and fitted.kept_s == 50.0
    assert kept.left().seconds == 50.0


def test_a_cell_whose_build_found_no_nvcc_is_not_costed_as_compiling_and_the_plan_says_so(tmp_path: Path) -> None:
    """The CUDA 12.8 cell of the registry ships no nvcc: its build record says what the look for one found, the
    plan says the cell compiles nothing (instead of minutes of compiling), and a cell whose build found an nvcc,
    or whose record never asked, is not named."""
    from common.build import backend, buildrecord

    def record(cid: str, identity: dict[str, object] | None) -> None:
        (tmp_path / cid).mkdir()
        kernels = {"kernels": {"identity": identity}} if identity is not None else {}
        (tmp_path / cid / "build.json").write_text(json.dumps({"cell_id": cid, "status": "built", **kernels}))

    record("a", {"nvcc": None, "nvcc_error": "/usr/local/cuda/bin/nvcc:\n not found"})
    record("b", {"nvcc": "13.0", "nvcc_error": ""})
    record("c", None)
    assert buildrecord.read(tmp_path / "a").record.no_nvcc == "/usr/local/cuda/bin/nvcc: not found"

    def jit(cid: str) -> WorkItem:
        from inenv.probes import fi_jit

        return WorkItem(CellTarget(cid, "resolved", versions={"flashinfer": "0.6.17"}), fi_jit.SPEC,
                        Variant("fi-jit", 1, (("module", "vllm_comm"), ("arch", "12.0a"))), 3000.0)

    opts = RunOptions(all_probes=True, envs=tmp_path)
    items = [jit("a"), jit("b"), jit("c")]
    assert session.without_nvcc(opts, backend.DOCKER, items) == {"a": "/usr/local/cuda/bin/nvcc: not found"}
    view = runprogress.RunView(items, {}, compiling=frozenset({items[1].key}), no_nvcc={"a": "nvcc: not found"})
    assert session.compile_lines(view) == [
        "  b: compiles vllm_comm@12.0a here (1 never timed)",
        "  a: compiles nothing: its build found no nvcc in the cell (nvcc: not found); the compile probe's variants "
        "check that themselves"]


def test_load_variants_of_engine_backends_are_costed_as_skips_in_a_cell_without_the_engine() -> None:
    """The load probe declares that SGLang's custom allreduce V2 needs sglang, vLLM's needs vllm and sgl-kernel's
    needs sgl-kernel: in a cell whose build found none of them, those variants (and only those) skip at once; a
    cell that holds vLLM and sgl-kernel runs those backends' variants. The step and custom-ar declare sgl-kernel
    for theirs."""
    from common.build import buildrecord
    from inenv.probes import custom_ar, load, step

    def item(cid: str, backend_: str) -> WorkItem:
        return WorkItem(CellTarget(cid, "resolved"), load.SPEC,
                        Variant("load", 2, (("backend", backend_), ("pattern", "replay"))), 600.0)

    names = ("nccl", "sglang-custom-ar-v2", "vllm-custom-ar", "sgl-custom-ar")
    items = [item(c, b) for c in ("plain", "with-vllm") for b in names]
    # what two cells' build self-checks reported, as their records hold it
    plain = buildrecord.BuildRecord.from_json({"cell_id": "plain", "status": "built",
                                               "selfcheck": {"engines": {}, "sgl_kernel": {}}})
    full = buildrecord.BuildRecord.from_json({"cell_id": "with-vllm", "status": "built",
                                              "selfcheck": {"engines": {"vllm": "0.33.0"},
                                                            "sgl_kernel": {"version": "0.4.10"}}})
    assert plain.holds == {} and full.holds == {"vllm": "0.33.0", "sgl-kernel": "0.4.10"}
    held = {"plain": plain.holds, "with-vllm": full.holds}
    got = session.lacking_distributions(items, held.get)
    assert got == {items[1].key: "sglang", items[2].key: "vllm", items[3].key: "sgl-kernel", items[5].key: "sglang"}
    assert session.lacking_distributions(items, lambda cell_id: None) == {}  # a cell that does not say what it holds
    others = [WorkItem(CellTarget("plain", "resolved"), step.SPEC, Variant("step", 2, (("backend", "sgl-custom-ar"),)),
                       600.0),
              WorkItem(CellTarget("plain", "resolved"), custom_ar.SPEC,
                       Variant("custom-ar", 2, (("impl", "sgl_kernel"), ("full_nvlink", "forced"))), 600.0),
              WorkItem(CellTarget("plain", "resolved"), custom_ar.SPEC,
                       Variant("custom-ar", 2, (("impl", "flashinfer"), ("full_nvlink", "forced"))), 600.0)]
    assert session.lacking_distributions(others, held.get) == {others[0].key: "sgl-kernel", others[1].key: "sgl-kernel"}


def test_an_engine_variant_whose_cell_lacks_the_engine_is_costed_as_the_skip_it_will_be(tmp_path: Path) -> None:
    """The engine probe declares which distribution each variant needs (its DISTRIBUTIONS). A cell whose build
    self-check found no vLLM: its engine=vllm variant is costed at a skip's second, not at the 56 s a sibling
    cell that holds vLLM recorded on this host; its own record, once it has one, is used as it is. A cell whose
    record does not say what it holds, or the local environment, is costed as before."""
    from common.build import backend, buildrecord
    from inenv.probes import engine

    def record(cid: str, engines: dict[str, str] | None) -> None:
        (tmp_path / cid).mkdir()
        check = {"selfcheck": {"engines": engines}} if engines is not None else {}
        (tmp_path / cid / "build.json").write_text(json.dumps({"cell_id": cid, "status": "built", **check}))

    record("plain", {})
    record("vllm", {"vllm": "0.33.0"})
    record("unsaid", None)
    assert buildrecord.read(tmp_path / "vllm").record.holds == {"vllm": "0.33.0"}
    assert buildrecord.read(tmp_path / "unsaid").record.holds is None

    def item(cid: str, name: str) -> WorkItem:
        return WorkItem(CellTarget(cid, "resolved"), engine.SPEC, Variant("engine", 1, (("engine", name),)), 120.0)

    items = [item(c, e) for c in ("plain", "vllm", "unsaid") for e in ("vllm", "sglang")]
    opts = RunOptions(all_probes=True, envs=tmp_path)
    lacking = session.skipping_at_once(opts, backend.DOCKER, items)
    assert lacking == {items[0].key: "vllm", items[1].key: "sglang", items[3].key: "sglang"}
    assert session.skipping_at_once(opts, "local", items) == {}
    # this host ran the vLLM cell's variant for 56 s: its sibling in the plain cell is still a skip
    history = {items[2].key: {backend.DOCKER: runprogress.Learned(56.0, backend.DOCKER, "pass")}}
    expected = runprogress.expected_durations(items, history, backend.DOCKER, lacking=lacking)
    assert expected[items[0].key].seconds == runprogress.SKIP_S
    assert expected[items[0].key].text() == "about 1.0 s: vllm is not installed in its cell, so it skips at once"
    assert expected[items[2].key].seconds == 56.0 and expected[items[2].key].own
    assert expected[items[4].key].seconds == 56.0  # a cell that does not say: its probe's record, as before
    view = runprogress.RunView(items, expected)
    assert "3 as a skip: a package they need is not in their cell (its build's self-check)" in view.basis()
    # once the plain cell's variant has a record of its own, that is what counts
    history[items[0].key] = {backend.DOCKER: runprogress.Learned(3.2, backend.DOCKER, "skip missing-package")}
    again = runprogress.expected_durations(items, history, backend.DOCKER, lacking=lacking)
    assert again[items[0].key].seconds == 3.2 and again[items[0].key].own
