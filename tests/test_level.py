"""`checks run --level quick|full`: quick plans fi-jit's smallest module per arch and runs the GPU probes at
one message size; what it shortened says so and a full run never reuses it, and the table marks what a quick run
answered. With no --level, a quick pass writes the first table, then a full pass adds what it lacks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checks.results.provenance import Provenance, checkout, probe_hashes
from checks.results.result import ProbeResult, Verdict
from checks.results.store import RunStore, read_file
from checks.run import incremental
from checks.run.executor import LocalExecutor
from checks.run.options import RunOptions
from checks.run.plan import CellTarget, WorkItem, plan_work
from checks.run.runner import Work, execute
from common import reasons
from inenv.probe import FULL, LEVEL_ENV, QUICK, HostView, ProbeSpec, Variant
from inenv.probes import fi_jit, pcie_ipc
from inenv.registry import discover
from inenv.status import Status
from tests.checks_helpers import fixture_env
from tests.test_incremental import ALL, Checkout

SIZES = '''"""Needs the GPU; reports the message sizes its rank would measure at the run's level."""

from inenv.probe import HostView, ProbeSpec, RankContext, Variant, at_level, outcome

SPEC = ProbeSpec(id="t-sizes", title="sizes", feature="levels", ranks=(1,), needs_gpu=True, timeout_s=60)


def variants(host: HostView) -> list[Variant]:
    return [Variant(SPEC.id, 1, params=(("backend", "nccl"),))]


def run(ctx: RankContext) -> dict:
    return outcome("pass", metrics={"sizes": list(at_level((1, 16, 128)))})
'''


def test_quick_plans_only_the_smallest_fi_jit_module_for_every_arch() -> None:
    full = fi_jit.plan(HostView(gpu_count=1))
    quick = fi_jit.plan(HostView(gpu_count=1, level=QUICK))
    assert len(full) == len(fi_jit.fi.COMM_MODULES) * 3 > 3 and [v.key for v in quick] == [
        "ranks=1,module=vllm_comm,arch=local", "ranks=1,module=vllm_comm,arch=12.0a",
        "ranks=1,module=vllm_comm,arch=12.0f"]
    assert {v.key for v in quick} <= {v.key for v in full}  # the same variants, fewer of them


def test_gpu_probe_cases_at_quick_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """(tokens, hidden, edge) of pcie-ipc's all-reduce cases: the decode shapes at DeepSeek-V3's hidden size
    7168 from 1 to 128 tokens, then the two shapes outside flashinfer's admission rules; a quick run keeps the
    smallest decode shape and the edges."""

    def shapes() -> list[tuple[int, int, bool]]:
        return [(c.tokens, c.hidden, c.edge) for c in pcie_ipc.cases("all-reduce")]

    monkeypatch.delenv(LEVEL_ENV, raising=False)
    assert shapes() == [(1, 2048, False), (1, 7168, False), (8, 7168, False), (128, 7168, False),
                        (1, 8, True), (3, 1365, True)]
    monkeypatch.setenv(LEVEL_ENV, QUICK)
    assert shapes() == [(1, 2048, False), (1, 8, True), (3, 1365, True)]


@pytest.mark.parametrize(("level", "sizes"), [(FULL, [1, 16, 128]), (QUICK, [1])])
def test_the_ranks_of_a_gpu_variant_measure_one_size_at_quick_level(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, level: str, sizes: list[int]) -> None:
    probes_dir = tmp_path / "probes"
    probes_dir.mkdir()
    (probes_dir / "t_sizes.py").write_text(SIZES)
    env = fixture_env(STACKPROBE_PROBE_PATH=str(probes_dir))
    for name in ("STACKPROBE_PROBE_PATH", "PYTHONPATH"):
        monkeypatch.setenv(name, env[name])
    probes = {pid: mod for pid, (_, mod) in discover({"STACKPROBE_PROBE_PATH": str(probes_dir)}).items()
              if pid == "t-sizes"}
    cell = CellTarget("cu130-torchx-sgl1-fi1", "resolved", image_status="built")
    items = plan_work([cell], probes, HostView(gpu_count=1, level=level))
    store = RunStore(tmp_path / "results", "cpu-0123abcd", "20261201T000000Z-0001")
    codes = {pid: checkout().for_probe(h) for pid, h in probe_hashes(probes).items()}
    execute(RunOptions(level=level), Work(items, store, reasons.default(), 1, codes,
                                          executors={cell.cell_id: LocalExecutor(sys.executable)}))
    [r] = read_file(store.results_path)[0]
    assert r.verdict.status == "pass" and r.verdict.metrics["sizes"] == sizes
    assert r.variant == "ranks=1,backend=nccl"  # the level does not change the key: a later run replaces it
    assert r.verdict.evidence.get("level") == (QUICK if level == QUICK else None)


def test_a_quick_run_marks_what_it_shortened_and_a_full_run_reuses_the_rest(tmp_path: Path) -> None:
    c = Checkout(tmp_path)
    quick = c.run("--level", "quick", "--probe", "fi-jit")
    assert "plan 1 cell(s) x 3 probe(s) = 6 variant(s)" in quick.stderr  # fi-jit: vllm_comm x (local, 12.0a, 12.0f)
    assert c.ran() == ALL
    printed = json.loads(quick.stdout)
    # no variant here needs a GPU: each did at the quick level what it does at the full one, so none is marked
    assert len(printed) == 6 and not any("level" in r["evidence"] for r in printed)
    [run] = c.runs()
    assert json.loads(run.with_name(run.stem + ".manifest.json").read_text())["level"] == "quick"

    out = tmp_path / "table.md"
    p = subprocess.run([sys.executable, "-m", "checks.cli", "report", "--results", str(c.results), "--out",
                        str(out)], capture_output=True, text=True, cwd=c.root, env=c.env, timeout=300)
    assert p.returncode == 0, p.stderr
    md = archived(out)  # the table still marks what a quick run answered (a local cell: on the archive page)
    assert "✅2 *(quick)*" in md and f"({printed[0]['started_at'][:10]}, quick)" in md
    assert "*quick*: made\nby `checks run --level quick` or the first pass of `checks run` without `--level`" in md

    full = c.run("--level", "full")  # the counting probes' results answer the full level: carried, not rerun
    assert c.ran() == [] and "reused 3 unchanged" in full.stderr
    assert {r["evidence"].get("reused_from") for r in json.loads(full.stdout)} == {run.stem}
    again = c.run("--level", "quick")  # a quick run may carry full results: they answer more
    assert c.ran() == [] and "reused 3 unchanged" in again.stderr


def test_a_gpu_variant_of_a_quick_run_is_never_reused_by_a_full_run() -> None:
    """What the quick level shortens (a GPU probe's ranks measure one size) is marked, and the full level
    runs it again; the rest is unmarked and carried."""
    cell = CellTarget("cu130-torchx-sgl1-fi1", "resolved", image_status="built")
    gpu = ProbeSpec(id="t-g", title="g", feature="f", needs_gpu=True)
    cpu = ProbeSpec(id="t-c", title="c", feature="f", needs_gpu=False)
    items = [WorkItem(cell, spec, Variant(spec.id, 1), 60.0) for spec in (gpu, cpu)]
    inputs = incremental.Inputs("env", "host")
    made = {it.key: ProbeResult("run1", "host", cell.cell_id, it.spec.id, it.variant.key,
                                incremental.stamped(Verdict(Status.PASS), inputs,
                                                    incremental.shortened(it, QUICK)),
                                "2026-01-01T00:00:00Z", Provenance("0.1.0", "c0ffee", False, "h"))
            for it in items}
    assert [incremental.shortened(it, QUICK) for it in items] == [True, False]
    assert [incremental.shortened(it, FULL) for it in items] == [False, False]
    decided = incremental.decide(items, made, {it.key: inputs for it in items}, {"t-g": "h", "t-c": "h"}, FULL)
    assert [it.reused is not None for it in decided] == [False, True]
    again = incremental.decide(items, made, {it.key: inputs for it in items}, {"t-g": "h", "t-c": "h"}, QUICK)
    assert [it.reused is not None for it in again] == [True, True]


# --- no --level: quick first, then what full adds -------------------------------------------------------------
DEEPER = '''"""Plans a second variant at the full level only. That one copies the table as it stands to
STACKPROBE_TEST_COUNT.table (the first answer, when the run is staged) and waits while STACKPROBE_TEST_COUNT.hold
exists."""

import os
import shutil
import time

from inenv.probe import FULL, HostView, ProbeSpec, RankContext, Variant, outcome

SPEC = ProbeSpec(id="t-deeper", title="deeper", feature="levels", ranks=(1,), needs_gpu=False, timeout_s=120)


def variants(host: HostView) -> list[Variant]:
    depths = ("1", "2") if host.level == FULL else ("1",)
    return [Variant(SPEC.id, 1, params=(("depth", d),)) for d in depths]


def run(ctx: RankContext) -> dict:
    count = os.environ["STACKPROBE_TEST_COUNT"]
    with open(count, "a") as f:
        f.write("t-deeper " + ctx.variant.key + "\\n")
    if ctx.variant.param("depth") == "2":
        table = os.environ.get("STACKPROBE_TEST_TABLE", "")
        if os.path.exists(table):
            shutil.copy(table, count + ".table")
        while os.path.exists(count + ".hold"):
            time.sleep(0.1)
    return outcome("pass")
'''
DEEP = ["t-deeper ranks=1,depth=1", "t-deeper ranks=1,depth=2"]


def archive_of(table: Path) -> Path:
    """The page beside ``table`` that holds the cells no matrix declares: a local environment's verdicts."""
    return table.with_name(f"{table.stem}-archive.md")


def archived(table: Path) -> str:
    return archive_of(table).read_text()


def deeper(tmp_path: Path) -> tuple[Checkout, Path, dict[str, str]]:
    c = Checkout(tmp_path)
    (c.probes / "t_deeper.py").write_text(DEEPER)
    table = tmp_path / "table.md"
    return c, table, {**c.env, "STACKPROBE_TEST_TABLE": str(archive_of(table))}


def table_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("table: ")]


def test_no_level_writes_the_quick_table_then_the_full_one_running_each_variant_once(tmp_path: Path) -> None:
    c, table, env = deeper(tmp_path)
    p = c.run("--staged", env=env, report=table)
    assert c.ran() == sorted([*ALL, *DEEP])  # the full pass reran nothing the quick pass measured
    quick_run, full_run = c.runs()
    levels = [json.loads(r.with_name(r.stem + ".manifest.json").read_text())["level"] for r in c.runs()]
    assert levels == ["quick", "full"]

    first = Path(str(c.count) + ".table").read_text()  # the table as the full pass found it
    # t-count-a, t-count-b, and t-deeper's one variant planned at the quick level
    assert "| ✅2 *(quick)* *(static)* | ✅ *(quick)* *(static)* | ✅ *(quick)* *(static)* |" in first
    assert full_run.stem not in first and f"{quick_run.stem}.jsonl) (20" in first
    last = archived(table)  # every cell answered by the full run: the quick pass's carried, t-deeper's new one
    assert "*(quick)*" not in last and f"{full_run.stem}.jsonl) (20" in last
    assert "| ✅2 *(reused)* *(static)* | ✅ *(reused)* *(static)* | ✅2 *(1 of 2 reused)* *(static)* |" in last

    assert len(table_lines(p.stderr)) == 2
    said = p.stderr.index("first answer: table written (quick level, 4 variant(s) in ")
    assert table_lines(p.stderr)[0] in p.stderr[:said] and table_lines(p.stderr)[1] in p.stderr[said:]
    assert "now the full level: 1 variant(s) to run" in p.stderr[said:]
    assert "verdicts: 4 variants: 4 pass (quick level)" in p.stderr[:said]

    printed = json.loads(p.stdout)  # --json: each variant once, from the last pass that recorded it
    assert [r["run_id"] for r in printed] == [full_run.stem] * 5
    assert sorted(r["variant"] for r in printed if r["evidence"].get("reused_from") != quick_run.stem) == [
        "ranks=1,depth=2"]


def test_no_level_with_nothing_changed_runs_the_full_pass_alone(tmp_path: Path) -> None:
    """An unchanged rerun: the full level would run nothing, so no quick pass writes a table first."""
    c, table, env = deeper(tmp_path)
    c.run("--staged", env=env, report=table)
    first_runs, answered = c.runs(), table.read_text()
    c.ran()
    again = c.run("--staged", env=env, report=table)
    assert "level: full only: every variant is unchanged since its last run, so one pass answers" in again.stderr
    assert "first answer" not in again.stderr and "level: quick" not in again.stderr
    assert len(table_lines(again.stderr)) == 1 and table.read_text() == answered
    assert c.ran() == [] and c.runs() == first_runs  # nothing ran, nothing recorded
    printed = json.loads(again.stdout)
    assert len(printed) == 5 and all(r["evidence"].get("reused_from") for r in printed)
    # a changed probe: its variants run again, and the quick pass answers first as before
    probe = c.probes / "t_deeper.py"
    probe.write_text(probe.read_text() + "\n# changed\n")
    changed = c.run("--staged", env=env, report=table)
    assert "level: full only" not in changed.stderr and "first answer: table written" in changed.stderr
    assert c.ran() == sorted(DEEP)
    # --fresh reruns everything, in both passes' order
    fresh = c.run("--staged", "--fresh", env=env, report=table)
    assert "level: full only" not in fresh.stderr and "first answer" in fresh.stderr


def test_an_unchanged_rerun_prepares_its_one_pass_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check that the full level would run nothing prepares the full pass (targets, fingerprints, plan);
    that pass takes the work instead of preparing it a second time, and a quick pass before it plans from the
    same preparation (the environments are not started again to read what it read)."""
    from checks import cli
    from checks.run import session

    c, table, env = deeper(tmp_path)
    c.run("--staged", env=env, report=table)
    c.ran()
    for name in ("STACKPROBE_PROBE_PATH", "STACKPROBE_TEST_COUNT", "STACKPROBE_TEST_TABLE"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    levels: list[str | None] = []
    real = session.prepared
    monkeypatch.setattr(session, "prepared", lambda opts: (levels.append(opts.level), real(opts))[1])
    probes = [a for pid in ("t-count-a", "t-count-b", "t-deeper") for a in ("--probe", pid)]
    argv = ["run", "--backend", "local", *probes, "--results", str(c.results), "--report", str(table)]
    assert cli.main(argv) == 0
    assert levels == [FULL] and c.ran() == []  # one preparation, for the one pass, and nothing ran
    (c.probes / "t_deeper.py").write_text((c.probes / "t_deeper.py").read_text() + "\n# changed\n")
    levels.clear()
    assert cli.main(argv) == 0
    # one preparation serves both passes: the quick pass plans again at its level from the full pass's
    assert levels == [FULL] and c.ran() == sorted(DEEP)


def test_level_quick_alone_runs_one_pass(tmp_path: Path) -> None:
    c, table, env = deeper(tmp_path)
    p = c.run("--level", "quick", env=env, report=table)
    assert c.ran() == sorted([*ALL, DEEP[0]])
    assert len(c.runs()) == 1 and len(table_lines(p.stderr)) == 1 and "first answer" not in p.stderr
    assert len(json.loads(p.stdout)) == 4 and "| ✅ *(quick)* *(static)* |" in archived(table)
    assert not any("level" in r["evidence"] for r in json.loads(p.stdout))  # no variant here is shortened


def test_ctrl_c_in_the_full_pass_keeps_the_quick_table_and_every_finished_result(tmp_path: Path) -> None:
    c, table, env = deeper(tmp_path)
    hold, snapshot = Path(str(c.count) + ".hold"), Path(str(c.count) + ".table")
    hold.touch()
    probes = [a for pid in ("t-count-a", "t-count-b", "t-deeper") for a in ("--probe", pid)]
    err = tmp_path / "stderr.txt"
    with err.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "checks.cli", "run", "--backend", "local", *probes,
                                 "--results", str(c.results), "--report", str(table)], cwd=c.root, env=env,
                                stdout=subprocess.DEVNULL, stderr=f, text=True)
    try:
        deadline = time.monotonic() + 120
        while not snapshot.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert snapshot.exists(), err.read_text()  # the full pass is running its depth-2 variant
        quick_table = archive_of(table).read_bytes()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, err.read_text()
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
    said = err.read_text()
    assert "first answer: table written" in said and "table: not regenerated after the stop" in said
    assert archive_of(table).read_bytes() == quick_table == snapshot.read_bytes() and b"*(quick)*" in quick_table
    assert c.ran() == sorted([*ALL, *DEEP])  # depth 2 started, and was stopped
    [quick_run] = c.runs()  # the full pass recorded nothing new: its carried copies are not written alone
    assert len(read_file(quick_run)[0]) == 4
    again = c.run("--level", "full", env=env)  # what the quick pass measured answers the full level
    assert c.ran() == [DEEP[1]] and "reused 4 unchanged" in again.stderr


def test_resume_without_level_continues_the_latest_run_in_the_pass_of_its_level(tmp_path: Path) -> None:
    c, table, env = deeper(tmp_path)
    c.run("--level", "full", env=env)
    [full_run] = c.runs()
    c.ran()
    p = c.run("--staged", "--resume", env=env)  # the latest run is full: no quick pass, that run continued
    assert c.ran() == [] and "quick level: not run; --resume continues the latest run" in p.stderr
    assert "resumed: 5 variant(s)" in p.stderr and c.runs() == [full_run]
    quick = c.run("--level", "quick", "--fresh", env=env)  # now the latest run is a quick one
    assert c.ran() == sorted([*ALL, DEEP[0]])
    p = c.run("--staged", "--resume", env=env)  # its quick pass continues it; the full pass is a run of its own
    assert "resumed: 4 variant(s)" in p.stderr and c.ran() == []  # depth 2: the first full run's, reused
    assert len(c.runs()) == 3 and c.runs()[1] == Path(str(quick_run(quick)))


def quick_run(p: subprocess.CompletedProcess[str]) -> str:
    """The results file a run names on its `results` line."""
    return next(line.split(" ", 1)[1] for line in p.stderr.splitlines() if line.startswith("results /"))
