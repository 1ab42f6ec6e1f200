"""A host that never timed a variant estimates it from hosts of its class under the same results root, says
whose records those are and why they stand for it, and its own measurements replace them as they arrive
(checks.run.runprogress.lent and what uses it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from checks.results.provenance import Provenance
from checks.results.result import ProbeResult, Verdict
from checks.results.store import RunStore
from checks.run import runprogress, session
from checks.run.options import RunOptions
from checks.run.plan import CellTarget, WorkItem
from inenv import registry
from inenv.probe import Variant
from inenv.probes import fi_jit, inventory
from inenv.status import Status

CELL = "cu130-torch2.11.0-sglnone-fi0.7.4"
OTHER_CELL = "cu128-torch2.11.0-sgl0.4.2-fi0.6.17"
H200 = {"gpu_count": 1, "gpu_name": "NVIDIA H200", "cpu_count": 16}
H200X2 = {"gpu_count": 2, "gpu_name": "NVIDIA H200", "cpu_count": 32}
H100 = {"gpu_count": 1, "gpu_name": "NVIDIA H100 80GB HBM3", "cpu_count": 16}
CPU16 = {"gpu_count": 0, "gpu_name": None, "cpu_count": 16}
CPU2 = {"gpu_count": 0, "gpu_name": None, "cpu_count": 2}
Row = tuple[str, str, str, float]  # cell, probe, variant key, seconds


def _jit(module: str, arch: str = "local") -> Variant:
    return Variant("fi-jit", 1, (("module", module), ("arch", arch)))


def _item(module: str, cell: str = CELL, arch: str = "local") -> WorkItem:
    return WorkItem(CellTarget(cell, "resolved"), fi_jit.SPEC, _jit(module, arch), 3000.0)


def _inventory(cell: str = CELL) -> WorkItem:
    return WorkItem(CellTarget(cell, "resolved"), inventory.SPEC, Variant("inventory"), 600.0)


def _result(run_id: str, host: str, cell: str, probe: str, key: str, seconds: float,
            evidence: dict[str, Any] | None = None) -> ProbeResult:
    return ProbeResult(run_id, host, cell, probe, key, Verdict(Status.PASS, duration_s=seconds,
                                                                evidence=evidence or {}),
                       "2026-12-01T00:00:00Z", Provenance("0.1", "abc", False, "h"))


def _run(root: Path, host: str, run_id: str, executor: str, facts: Any, rows: list[Row]) -> Path:
    """One recorded run of ``host`` under the results root: its results and the manifest with its facts."""
    folder = root / host
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(_result(run_id, host, cell, probe, key, s).to_json()) for cell, probe, key, s in rows]
    (folder / f"{run_id}.jsonl").write_text("\n".join(lines) + "\n")
    (folder / f"{run_id}.manifest.json").write_text(json.dumps({"schema": "stackprobe.manifest/2", "run_id": run_id,
                                                                "host_id": host, "executor": executor,
                                                                "facts": facts}))
    return folder / f"{run_id}.jsonl"


def _jit_row(module: str, seconds: float, cell: str = CELL, arch: str = "local") -> Row:
    return (cell, "fi-jit", _jit(module, arch).key, seconds)


def test_a_gpu_newcomer_borrows_only_from_hosts_of_the_same_gpu_model_and_count(tmp_path: Path) -> None:
    _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200,
         [_jit_row("trtllm_comm", 300.0), (CELL, "inventory", "ranks=1", 8.0)])
    _run(tmp_path, "h100x1-bbbbbbbb", "20261201T000000Z-bbbb", "venv", H100, [_jit_row("trtllm_comm", 100.0)])
    _run(tmp_path, "h200x2-cccccccc", "20261201T000000Z-cccc", "venv", H200X2, [_jit_row("trtllm_comm", 50.0)])
    _run(tmp_path, "h200x1-dddddddd", "20261201T000000Z-dddd", "docker", H200, [_jit_row("trtllm_comm", 9.0)])
    (tmp_path / "h200x1-eeeeeeee").mkdir()  # this host's folder: nothing recorded yet
    lent = runprogress.lent(tmp_path, "h200x1-eeeeeeee", H200, {"fi-jit"})
    items = [_item("trtllm_comm"), _inventory()]
    exp = runprogress.expected_durations(items, {}, "venv", lent)
    jit, inv = exp[items[0].key], exp[items[1].key]
    assert (jit.seconds, jit.host) == (300.0, "h200x1-aaaaaaaa")  # not the H100's, the 2-GPU host's or docker's
    assert jit.text() == "about 5m00s by h200x1-aaaaaaaa's record (pass on venv; same GPU model and count)"
    assert inv.seconds == 8.0
    view = runprogress.RunView(items, exp)
    assert view.opening() == ("to run: 2 of 2 variant(s), about 5m08s (no earlier run on this host; "
                              "2 by h200x1-aaaaaaaa's records: same GPU model and count)")
    # on docker the docker host's record is the one of this class
    assert runprogress.expected_durations([items[0]], {}, "docker", lent)[items[0].key].seconds == 9.0


def test_a_cpu_host_scales_compile_times_by_cores_and_takes_the_rest_as_recorded(tmp_path: Path) -> None:
    _run(tmp_path, "cpu-aaaaaaaa", "20261201T000000Z-aaaa", "docker", CPU16,
         [_jit_row("trtllm_comm", 60.0, arch="12.0a"), (CELL, "inventory", "ranks=1", 4.0)])
    _run(tmp_path, "h200x1-bbbbbbbb", "20261201T000000Z-bbbb", "docker", H200,
         [_jit_row("moe_a2a", 70.0, arch="12.0a")])  # a GPU host stands for no CPU host
    lent = runprogress.lent(tmp_path, "cpu-cccccccc", CPU2, {"fi-jit"})
    items = [_item("trtllm_comm", arch="12.0a"), _inventory(), _item("moe_a2a", arch="12.0a")]
    exp = runprogress.expected_durations(items, {}, "docker", lent)
    jit, inv, other = (exp[it.key] for it in items)
    assert jit.seconds == 480.0  # 60 s on 16 cores, on 2: 60 * 16 / 2
    assert jit.text() == ("about 8m00s by cpu-aaaaaaaa's record "
                          "(pass on docker; a CPU host of 16 cores, scaled to 2)")
    assert inv.seconds == 4.0
    assert inv.text() == "about 4.0 s by cpu-aaaaaaaa's record (pass on docker; a CPU host of 16 cores)"
    assert other.seconds is None
    # a host without its cores in its facts cannot be scaled to: nothing is lent to it
    assert runprogress.lent(tmp_path, "cpu-cccccccc", {"gpu_count": 0, "cpu_count": None}, {"fi-jit"}) == {}


def test_own_records_win_and_a_sibling_this_host_timed_comes_before_a_borrowed_record(tmp_path: Path) -> None:
    _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200,
         [_jit_row("trtllm_comm", 300.0), _jit_row("moe_a2a", 90.0)])
    own = _run(tmp_path, "h200x1-eeeeeeee", "20261202T000000Z-eeee", "venv", H200,
               [_jit_row("trtllm_comm", 40.0), _jit_row("moe_a2a", 12.0, cell=OTHER_CELL)]).parent
    lent = runprogress.lent(tmp_path, own.name, H200, {"fi-jit"})
    assert all(g.host == "h200x1-aaaaaaaa" for per in lent.values() for g in per.values())  # own folder left out
    items = [_item("trtllm_comm"), _item("moe_a2a")]
    exp = runprogress.expected_durations(items, runprogress.learned(own), "venv", lent)
    assert exp[items[0].key].text() == "last time 40 s (pass on venv)"
    assert exp[items[1].key].text() == "about 12 s by its probe's moe_a2a record (pass on venv)"


def test_a_borrowed_sibling_names_the_host_it_comes_from(tmp_path: Path) -> None:
    _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200,
         [_jit_row("trtllm_comm", 300.0, cell=OTHER_CELL)])
    lent = runprogress.lent(tmp_path, "h200x1-eeeeeeee", H200, {"fi-jit"})
    item = _item("trtllm_comm")
    got = runprogress.expected_durations([item], {}, "venv", lent)[item.key]
    assert got.seconds == 300.0
    assert got.text() == ("about 5m00s by its probe's trtllm_comm record on h200x1-aaaaaaaa "
                          "(pass on venv; same GPU model and count)")


def test_of_several_hosts_the_median_of_their_newest_records_is_taken(tmp_path: Path) -> None:
    _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200, [_jit_row("trtllm_comm", 50.0)])
    _run(tmp_path, "h200x1-aaaaaaaa", "20261202T000000Z-aaaa", "venv", H200, [_jit_row("trtllm_comm", 900.0)])
    _run(tmp_path, "h200x1-bbbbbbbb", "20261201T000000Z-bbbb", "venv", H200, [_jit_row("trtllm_comm", 100.0)])
    _run(tmp_path, "h200x1-cccccccc", "20261201T000000Z-cccc", "venv", H200, [_jit_row("trtllm_comm", 300.0)])
    item = _item("trtllm_comm")
    got = runprogress.expected_durations([item], {}, "venv", runprogress.lent(tmp_path, "h200x1-eeeeeeee", H200))
    assert (got[item.key].seconds, got[item.key].host) == (300.0, "h200x1-cccccccc")  # of 900, 100, 300
    (tmp_path / "h200x1-cccccccc" / "20261201T000000Z-cccc.jsonl").unlink()
    got = runprogress.expected_durations([item], {}, "venv", runprogress.lent(tmp_path, "h200x1-eeeeeeee", H200))
    assert (got[item.key].seconds, got[item.key].host) == (100.0, "h200x1-bbbbbbbb")  # of two, the shorter


def test_other_hosts_files_are_read_as_untrusted_and_their_bad_parts_left_out(tmp_path: Path) -> None:
    good = _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200,
                [_jit_row("trtllm_comm", 300.0)])
    # lines that are not JSON, not a result, or a duration that is not a finite number of seconds
    bad = tmp_path / "h200x1-bbbbbbbb"
    _run(tmp_path, bad.name, "20261201T000000Z-bbbb", "venv", H200, [_jit_row("moe_a2a", 20.0)])
    row = json.loads((bad / "20261201T000000Z-bbbb.jsonl").read_text())
    lines = ["{not json", json.dumps({"schema": "stackprobe.result/2"}), "[1, 2]"]
    for value in ("NaN", "Infinity", "1e300", "-5"):
        lines.append(json.dumps({**row, "variant": _jit("trtllm_comm").key, "duration_s": 0}).replace(
            '"duration_s": 0', f'"duration_s": {value}'))
    (bad / "20261201T000000Z-bbbb.jsonl").write_text("\n".join([*lines, json.dumps(row)]) + "\n")
    # manifests: not JSON, facts of the wrong types, no executor
    for host, manifest in (("h200x1-cccccccc", "{oops"),
                           ("h200x1-dddddddd", json.dumps({"executor": "venv", "facts": {**H200, "gpu_count": "1"}})),
                           ("h200x1-ffffffff", json.dumps({"executor": "venv", "facts": {**H200, "gpu_count": True}})),
                           ("h200x1-abababab", json.dumps({"executor": 7, "facts": H200})),
                           ("h200x1-cdcdcdcd", json.dumps(["venv", H200]))):
        path = _run(tmp_path, host, "20261201T000000Z-cccc", "venv", H200, [_jit_row("trtllm_comm", 1.0)])
        path.with_name("20261201T000000Z-cccc.manifest.json").write_text(manifest)
    # names outside their grammar, a folder where a results file should be, links
    _run(tmp_path, "not-a-host", "20261201T000000Z-eeee", "venv", H200, [_jit_row("trtllm_comm", 2.0)])
    _run(tmp_path, "h200x1-12121212", "not-a-run", "venv", H200, [_jit_row("trtllm_comm", 3.0)])
    (tmp_path / "h200x1-34343434" / "20261201T000000Z-3434.jsonl").mkdir(parents=True)
    os.symlink(good.parent, tmp_path / "h200x1-56565656")
    linked = tmp_path / "h200x1-78787878"
    linked.mkdir()
    os.symlink(good, linked / "20261202T000000Z-7878.jsonl")
    os.symlink(good.with_name("20261201T000000Z-aaaa.manifest.json"), linked / "20261202T000000Z-7878.manifest.json")
    lent = runprogress.lent(tmp_path, "h200x1-eeeeeeee", H200, {"fi-jit"})
    assert {k: {b: (g.seconds, g.host) for b, g in per.items()} for k, per in lent.items()} == {
        (CELL, "fi-jit", _jit("trtllm_comm").key): {"venv": (300.0, "h200x1-aaaaaaaa")},
        (CELL, "fi-jit", _jit("moe_a2a").key): {"venv": (20.0, "h200x1-bbbbbbbb")},
    }
    # this host's facts unreadable: nothing is lent
    assert runprogress.lent(tmp_path, "h200x1-eeeeeeee", {"gpu_count": -1}) == {}
    assert runprogress.lent(tmp_path / "missing", "h200x1-eeeeeeee", H200) == {}


def test_a_borrowed_duration_is_at_most_the_variants_timeout(tmp_path: Path) -> None:
    _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200, [_jit_row("trtllm_comm", 100000.0)])
    item = _item("trtllm_comm")  # its timeout: 3000 s
    got = runprogress.expected_durations([item], {}, "venv", runprogress.lent(tmp_path, "h200x1-eeeeeeee", H200))
    assert got[item.key].seconds == 3000.0


def test_the_runs_own_results_replace_borrowed_estimates_as_they_arrive(tmp_path: Path) -> None:
    _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200,
         [_jit_row("trtllm_comm", 300.0), _jit_row("trtllm_comm", 300.0, cell=OTHER_CELL)])
    lent = runprogress.lent(tmp_path, "h200x1-eeeeeeee", H200, {"fi-jit"})
    first, second = _item("trtllm_comm"), _item("trtllm_comm", cell=OTHER_CELL)
    history: runprogress.History = {}
    expected = runprogress.expected_durations([first, second], history, "venv", lent)
    view = runprogress.RunView([first, second], expected, history=history, lent=lent, backend="venv")
    # the runner's start order follows the estimates (checks.run.session.run_work keeps its costs this way)
    costs = runprogress.start_costs(view.items, view.expected, {})
    view.on_estimates = lambda: costs.update(runprogress.start_costs(view.items, view.expected, {}))
    assert view.left().seconds == 600.0 and costs[second.key] == 300.0
    # a result carried from an earlier run measured nothing: the estimate stays borrowed
    carried = _result("20261202T000000Z-eeee", "h200x1-eeeeeeee", CELL, "fi-jit", first.variant.key, 20.0,
                      {"reused_from": "20261201T000000Z-eeee"})
    view.finish(first, carried)
    assert view.expected[second.key].host == "h200x1-aaaaaaaa"
    view.done.discard(first.key)
    view.finish(first, _result("20261202T000000Z-eeee", "h200x1-eeeeeeee", CELL, "fi-jit", first.variant.key, 20.0))
    assert view.left().seconds == 20.0  # the sibling this run timed, not the other host's 300 s
    assert costs[second.key] == 20.0
    assert view.expected[second.key].text() == "about 20 s by its probe's trtllm_comm record (pass on venv)"
    assert view.basis() == "from the durations this host recorded"


def test_the_run_reads_the_hosts_beside_its_own_folder(tmp_path: Path) -> None:
    """session.progress_view: this host's folder under the results root, the others beside it."""
    _run(tmp_path, "h200x1-aaaaaaaa", "20261201T000000Z-aaaa", "venv", H200,
         [_jit_row("trtllm_comm", 300.0), _jit_row("moe_a2a", 90.0)])
    _run(tmp_path, "h200x1-eeeeeeee", "20261202T000000Z-eeee", "venv", H200, [_jit_row("trtllm_comm", 40.0)])
    store = RunStore(tmp_path, "h200x1-eeeeeeee", "20261202T010000Z-eeee")
    items = [_item("trtllm_comm"), _item("moe_a2a")]
    facts = {**H200, "host_id": store.host_id}
    view = session.progress_view(RunOptions(results=tmp_path, jobs=1), "venv", store, items, facts, {})
    assert view.opening() == ("to run: 2 of 2 variant(s), about 2m10s (from the durations this host recorded; "
                              "1 by h200x1-aaaaaaaa's records: same GPU model and count)")
    assert view.start_line(items[1]).endswith(
        "(1 of 2; about 1m30s by h200x1-aaaaaaaa's record (pass on venv; same GPU model and count))")


def test_a_carried_module_is_costed_as_a_load_in_every_estimate_the_run_states(tmp_path: Path) -> None:
    """What the run states before its quick pass and between the passes is the same view as its progress: a cell
    that carries trtllm_comm for this GPU is not costed as compiling it (on a lent H100 the line before the quick
    pass said "about 5m20s" for a full level that took 153 s, from the prior's compile time of a carried module)."""
    store = RunStore(tmp_path, "h100-80gb-hbm3x1-eeeeeeee", "20261206T000000Z-eeee")
    facts = {**H100, "host_id": store.host_id, "compute_capability": "9.0"}
    items = [WorkItem(CellTarget(CELL, "resolved", versions={"flashinfer": "0.7.4"}), fi_jit.SPEC, _jit("trtllm_comm"),
                      3000.0)]
    opts = RunOptions(results=tmp_path, jobs=1, compile_cache=tmp_path / "cc")
    bare = session.progress_view(opts, "venv", store, items, facts, {})
    carried = session.progress_view(opts, "venv", store, items, facts, {CELL: {"trtllm_comm": ("sm_90a",)}})
    assert items[0].key in bare.compiling and items[0].key not in carried.compiling
    assert "does not carry" not in carried.start_line(items[0])
    other_gpu = session.progress_view(opts, "venv", store, items, facts, {CELL: {"trtllm_comm": ("sm_120a",)}})
    assert items[0].key in other_gpu.compiling  # carried for another GPU: compiled here


def test_a_skipped_sibling_stands_for_no_other_variants_run() -> None:
    """The step at 8 shared ranks for sgl-kernel, skipped at once (not installed), had set its siblings' estimate
    to 0.0 s ("by its probe's record (skip missing-package)") while they took 30 s each on a lent H100; a run of
    a sibling still stands for them."""
    step = next(mod for pid, (_, mod) in registry.discover().items() if pid == "step")
    cell = CellTarget(CELL, "resolved")

    def item(backend: str) -> WorkItem:
        return WorkItem(cell, step.SPEC, Variant("step", 8, (("backend", backend), ("gpus", "1"),
                                                              ("placement", "shared")), share_gpu=True), 900.0)

    skipped, fusion, pcie = item("sgl-custom-ar"), item("flashinfer-fusion"), item("flashinfer-pcie-ipc")
    history: runprogress.History = {skipped.key: {"venv": runprogress.Learned(0.0, "venv", "skip missing-package")}}
    got = runprogress.expected_durations([fusion, pcie], history, "venv")
    assert got[fusion.key].seconds is None and got[pcie.key].seconds is None
    history[fusion.key] = {"venv": runprogress.Learned(30.0, "venv", "pass")}
    assert runprogress.expected_durations([pcie], history, "venv")[pcie.key].seconds == 30.0
    not_run = {skipped.key: {"venv": runprogress.Learned(0.0, "venv", "not-run deferred-world-size")}}
    assert runprogress.expected_durations([pcie], not_run, "venv")[pcie.key].seconds is None


def test_a_variant_is_priced_by_its_own_size_before_a_sibling_of_another_size() -> None:
    """custom-ar at 2 shared ranks took 2.0 s in the quick pass; at 8 shared ranks it took 14 s on a lent H100, and
    priced at the 2-rank sibling's 2.0 s it started last and ran alone at the end. The prior's own shape comes
    first; a sibling of the same size comes before the prior; another size only when neither answers."""
    from checks.run.cost import model as costmodel
    from inenv.probes import custom_ar

    cell = CellTarget(CELL, "resolved")

    def item(ranks: int) -> WorkItem:
        return WorkItem(cell, custom_ar.SPEC, Variant("custom-ar", ranks, (("gpus", "1"), ("impl", "flashinfer"),
                                                                           ("placement", "shared")), share_gpu=True),
                        300.0)

    two, eight, other_eight = item(2), item(8), WorkItem(CellTarget(OTHER_CELL, "resolved"), custom_ar.SPEC,
                                                         item(8).variant, 300.0)
    prior = [costmodel.CostTable("NVIDIA H100 80GB HBM3 x1", {costmodel.Shape("custom-ar", 8, True): 13.5})]
    history: runprogress.History = {two.key: {"venv": runprogress.Learned(2.0, "venv", "pass")}}
    got = runprogress.expected_durations([eight], history, "venv", None, prior)[eight.key]
    assert (got.seconds, got.prior) == (13.5, "NVIDIA H100 80GB HBM3 x1")
    assert runprogress.expected_durations([eight], history, "venv")[eight.key].seconds == 2.0  # nothing better
    history[other_eight.key] = {"venv": runprogress.Learned(14.0, "venv", "pass")}
    assert runprogress.expected_durations([eight], history, "venv", None, prior)[eight.key].seconds == 14.0
