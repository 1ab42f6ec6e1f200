"""bench_main_job's floor arithmetic on a recorded result, and its first-table clock (no main job is run)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.checks_helpers import benchmark, fixture_env

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "benchmarks" / "results" / "main-job-vm-20261201T052628Z.json"


def _bench():
    return benchmark("bench_main_job")


def test_the_floor_of_the_recorded_cold_run() -> None:
    bench = _bench()
    data = json.loads(RECORDED.read_text())
    cold = data["passes"][0]
    # the stored cold main job: 5772.9 CPU-s of compiles on 2 cores after a 339.7 s build, 3923.0 s in all
    assert (cold["compile_cpu_s"], data["cores"], cold["build_s"], cold["total_s"]) == (5772.9, 2, 339.7, 3923.0)
    floor = bench.floor_s(cold["compile_cpu_s"], data["cores"], cold["build_s"])
    assert floor == pytest.approx(2886.45 + 339.7)
    lines = bench.render(data, data["passes"])
    assert ("    compile CPU 5773 s; floor 5773 / 2 cores + build 339.7 s = 53.8 min; "
            "wall 65.4 min = 1.22x of the floor") in lines
    # 3923.0 / 3226.15 = 1.216; / 1.05 = 1.158
    assert "cold wall / floor (not recorded): 65.4 / 53.8 min = 1.22x / target 1.05x = 1.16x" in lines
    assert lines[0].endswith("backend not recorded)")


def test_a_new_result_names_its_backend_and_first_table() -> None:
    bench = _bench()
    meta = {"matrix": "matrix.yaml", "host": "h", "cores": 4, "date": "d", "backend": "venv", "disk_growth_b": 0}
    p = {"label": "cold", "build_s": 60.0, "build_rc": 0, "run_s": 1000.0, "run_rc": 0, "report_s": 2.0,
         "report_rc": 0, "total_s": 1062.0, "first_table_s": 240.5, "phases": {}, "disk_growth_b": 0,
         "compile_cpu_s": 3600.0}
    lines = bench.render(meta, [p])
    assert "backend venv" in lines[0]
    # recorded without first_answer_s: the build's 60 s + 240.5 s into checks run = 300.5 s after the first command
    assert "first table 240.5 s into checks run, 300.5 s after the first command; total 1062.0 s" in lines[1]
    # 300.5 s = 5.008 min against 5 min: 1.0017
    assert "first answer: 5.0 min / target 5.0 min = 1.00x" in lines
    # 3600 / 4 + 60 = 960 s = 16.0 min; 1062 / 960 = 1.106 (1.0536x of the 1.05 target)
    assert "cold wall / floor (venv): 17.7 / 16.0 min = 1.11x / target 1.05x = 1.05x" in lines


def test_the_first_answer_of_the_recorded_docker_run_counts_the_build() -> None:
    """The committed Docker main job: the first table 41.5 s into `checks run`, after a 3087.2 s build."""
    bench = _bench()
    data = json.loads((ROOT / "benchmarks" / "results" / "main-job-vm-20261203T235120Z.json").read_text())
    cold = data["passes"][0]
    assert (cold["build_s"], cold["first_table_s"]) == (3087.2, 41.5)
    assert bench.first_answer_s(cold) == 3128.7  # 3087.2 + 41.5
    # 5194.1 kernel CPU-s over 2 cores + the build outside its 2731.2 s kernel stage: 2597.05 + 356.0
    assert bench.pass_floor(cold, 2)[2] == pytest.approx(2953.05)
    lines = bench.render(data, data["passes"])
    # 3128.7 s = 52.1 min; / 5 min = 10.43
    assert "first answer: 52.1 min / target 5.0 min = 10.43x" in lines


def test_the_first_table_is_timed_when_the_file_is_written(tmp_path: Path) -> None:
    bench = _bench()
    table = tmp_path / "compatibility.md"
    table.write_text("an older table\n")
    watch = bench.TableWatch(table, every_s=0.05).start()
    time.sleep(0.3)
    table.write_text("the first table of this run\n")
    time.sleep(0.3)
    first = watch.stop()
    assert first is not None and 0.25 <= first <= 1.0
    untouched = bench.TableWatch(table, every_s=0.05).start()
    time.sleep(0.1)
    assert untouched.stop() is None


def test_a_recorded_file_that_is_not_a_result_is_one_line_and_exit_2(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert bench.main(["--recorded", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{bad}: not a bench_main_job result")


SLOW_FULL = '''"""One variant at every level, and one more at the full level that takes 3 s."""

import time

from inenv.probe import FULL, HostView, ProbeSpec, RankContext, Variant, outcome

SPEC = ProbeSpec(id="t-slow-full", title="slow full", feature="levels", ranks=(1,), needs_gpu=False, timeout_s=60)


def variants(host: HostView) -> list[Variant]:
    return [Variant(SPEC.id, 1, params=(("depth", d),)) for d in (("1", "2") if host.level == FULL else ("1",))]


def run(ctx: RankContext) -> dict:
    if ctx.variant.param("depth") == "2":
        time.sleep(3)
    return outcome("pass")
'''


def test_the_main_job_without_level_times_the_quick_pass_table(tmp_path: Path) -> None:
    """The main job's `checks run` gives no --level, and its first table is the quick pass's: written before the
    full pass spends its 3 s (a real `checks run --backend local`, watched as the benchmark watches it)."""
    bench = _bench()
    results, table = tmp_path / "results", tmp_path / "results" / "compatibility.md"
    cmd = bench.checks_run(ROOT / "matrix.yaml", results, tmp_path / "cache", table, None, "local")
    assert "--level" not in cmd and "--level" in bench.checks_run(ROOT / "matrix.yaml", results,
                                                                   tmp_path / "cache", table, "full", "local")
    probes = tmp_path / "probes"
    probes.mkdir()
    (probes / "t_slow_full.py").write_text(SLOW_FULL)
    cmd = [a for a in cmd if a != "--all"] + ["--probe", "t-slow-full"]
    env = fixture_env(STACKPROBE_PROBE_PATH=str(probes))
    run_s, rc, first = bench.watched(cmd, table, tmp_path / "log.txt", env)
    log = (tmp_path / "log.txt").read_text()
    assert rc == 0, log
    assert "first answer: table written (quick level, 1 variant(s)" in log
    assert first is not None and first < run_s - 2.5, (first, run_s)


def test_one_pass_counts_the_first_answer_from_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass whose build takes 2 s (a stand-in for `provision build`: no cell to build for the local backend)
    and whose real `checks run --backend local` writes the quick table before the full pass spends 3 s: the
    first answer counts the build, the first table does not, and the floor is the build (nothing compiled)."""
    bench = _bench()
    real_tool = bench._tool

    def tool(*args: str) -> list[str]:
        if args[:2] == ("provision", "build"):
            return [sys.executable, "-c", "import time; time.sleep(2)"]
        if args[:2] == ("provision", "plan"):
            return [sys.executable, "-c", "print('[]')"]
        return real_tool(*args)

    monkeypatch.setattr(bench, "_tool", tool)
    probes = tmp_path / "probes"
    probes.mkdir()
    (probes / "t_slow_full.py").write_text(SLOW_FULL)
    for k, v in fixture_env(STACKPROBE_PROBE_PATH=str(probes)).items():
        monkeypatch.setenv(k, v)
    results = tmp_path / "results"
    p = bench.one_pass("cold", ROOT / "matrix.yaml", results, tmp_path / "cache", tmp_path / "log.txt", set(),
                       [tmp_path], None, "local")
    assert p["run_rc"] == 0, (tmp_path / "log.txt").read_text()
    assert p["build_s"] >= 2.0
    # the quick table came before the 3 s full variant; counted from the build's start it is at least 2 s later
    assert p["first_table_s"] < p["run_s"] - 2.5
    assert p["first_answer_s"] >= p["build_s"] + p["first_table_s"] - 0.6  # two clocks, each polled every 0.5 s
    assert p["first_answer_s"] <= p["build_s"] + p["first_table_s"] + 1.5
    assert p["compile_cpu_s"] == 0.0 and p["floor_s"] == p["build_s"]
    assert bench.first_answer_s(p) == p["first_answer_s"]
    assert p["runs_recorded"] == 2  # the quick pass's run and the full pass's
    warm = bench.one_pass("warm", ROOT / "matrix.yaml", results, tmp_path / "cache", tmp_path / "log.txt", set(),
                          [tmp_path], None, "local")
    assert warm["run_rc"] == 0 and warm["runs_recorded"] == 0  # nothing new learned: nothing recorded
    assert warm["phases"] == {}  # no run file to read phases from
    assert "level: full only" in (tmp_path / "log.txt").read_text()


def test_the_floor_counts_each_compile_the_cache_ledger_holds_once(tmp_path: Path) -> None:
    """A pass whose compile cache counted its builds: the floor is their CPU over the cores plus the build's wall
    less its own compiles spread over the cores; a key built twice is named."""
    bench = _bench()
    rows = [{"key": "a", "compile_cpu_s": 100.0}, {"key": "b", "compile_cpu_s": 300.0},
            {"key": "a", "compile_cpu_s": 20.0}, "not json", {"no": "key"}]
    (tmp_path / bench.LEDGER).write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    found = bench.ledger(tmp_path)
    assert [r["key"] for r in found] == ["a", "b", "a"] and bench._cpu(found) == 420.0
    assert {k for k, n in bench._counts(found).items() if n > 1} == {"a"}
    p = {"build_s": 90.0, "compile_cpu_s": 7.0, "kernel_cpu_s": 9.0, "kernel_stage_s": 50.0,
         "compiles": {"cpu_s": 420.0, "during_build_cpu_s": 100.0}}
    # 420 / 2 cores = 210; the build's 90 s less its 100 CPU-s of compiling over 2 cores = 40 s
    assert bench.pass_floor(p, 2) == (420.0, 40.0, 250.0)


def test_a_key_is_compiled_twice_only_beyond_the_entries_the_store_holds(tmp_path: Path) -> None:
    """Two builds of one key that read different headers are two stored entries, each compiled once; a second
    build of a key with one entry is the same object compiled twice."""
    bench = _bench()
    for key, entries in (("two-headers", ("e1", "e2")), ("one-entry", ("e1",))):
        for e in entries:
            (tmp_path / key / e).mkdir(parents=True)
            (tmp_path / key / e / "record.json").write_text("{}")
    rows = [{"key": "two-headers"}, {"key": "two-headers"}, {"key": "one-entry"}, {"key": "one-entry"},
            {"key": "once"}]
    assert bench.compiled_twice(tmp_path, rows) == ["one-entry"]


def test_warm_only_needs_the_folder_of_an_earlier_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    assert bench.main(["--warm-only"]) == 2
    assert "--warm-only needs --work" in capsys.readouterr().err
    assert bench.main(["--warm-only", "--work", str(tmp_path)]) == 2  # nothing kept there
    assert "is empty" in capsys.readouterr().err
    (tmp_path / "results" / "h").mkdir(parents=True)
    (tmp_path / "compile-cache").mkdir()
    assert bench.main(["--warm-only", "--work", str(tmp_path), "--with-cells"]) == 2
    assert bench.main(["--work", str(tmp_path)]) == 2  # a cold run refuses the filled folder, as before
    assert "not empty" in capsys.readouterr().err


def test_the_cpu_clock_splits_idle_and_stolen_seconds_by_command(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench()
    readings = iter([(100.0, 5.0), (130.5, 5.0), (131.0, 9.0), (171.0, 9.5)])  # start, then the three marks
    monkeypatch.setattr(bench, "cpu_seconds", lambda: next(readings))
    clock = bench.CpuClock(every_s=3600).start()
    for name in ("build", "run", "report"):
        clock.mark(name)
    spans = clock.stop()["spans"]
    assert [(n, s["idle_cpu_s"], s["steal_cpu_s"]) for n, s in spans.items()] == [
        ("build", 30.5, 0.0), ("run", 0.5, 4.0), ("report", 40.0, 0.5)]
    assert all(s["wall_s"] >= 0 for s in spans.values())
    meta = {"matrix": "m", "host": "h", "cores": 2, "date": "d", "backend": "venv", "disk_growth_b": 0}
    p = {"label": "cold", "build_s": 1.0, "build_rc": 0, "run_s": 1.0, "run_rc": 0, "report_s": 0.0, "total_s": 2.0,
         "disk_growth_b": 0, "compile_cpu_s": 0.0, "phases": {},
         "cpu": {"spans": {"build": {"wall_s": 60.0, "idle_cpu_s": 30.5, "steal_cpu_s": 0.0}}, "timeline": []}}
    assert "    CPU left idle (stolen by the hypervisor): build 30 (0) of 120 core-s" in bench.render(meta, [p])


def test_this_machines_idle_and_stolen_seconds_only_grow() -> None:
    bench = _bench()
    first = bench.cpu_seconds()
    time.sleep(0.2)
    second = bench.cpu_seconds()
    assert first[0] > 0 and all(b >= a for a, b in zip(first, second, strict=True))
