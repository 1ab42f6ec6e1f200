"""bench_main_job's floor arithmetic on a recorded result, and its first-table clock (no main job is run)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from tests.checks_helpers import fixture_env

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "benchmarks" / "results" / "main-job-vm-20261201T052628Z.json"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_main_job", ROOT / "benchmarks" / "bench_main_job.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_main_job"] = module
    spec.loader.exec_module(module)
    return module


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
    assert "cold wall / floor (not recorded): 65.4 / 53.8 min = 1.22x / target 1.10x = 1.11x" in lines
    assert lines[0].endswith("backend not recorded)")


def test_a_new_result_names_its_backend_and_first_table() -> None:
    bench = _bench()
    meta = {"matrix": "matrix.yaml", "host": "h", "cores": 4, "date": "d", "backend": "venv", "disk_growth_b": 0}
    p = {"label": "cold", "build_s": 60.0, "build_rc": 0, "run_s": 1000.0, "run_rc": 0, "report_s": 2.0,
         "report_rc": 0, "total_s": 1062.0, "first_table_s": 240.5, "phases": {}, "disk_growth_b": 0,
         "compile_cpu_s": 3600.0}
    lines = bench.render(meta, [p])
    assert "backend venv" in lines[0]
    assert "first table 240.5 s; total 1062.0 s" in lines[1]
    # 3600 / 4 + 60 = 960 s = 16.0 min; 1062 / 960 = 1.11 (1.0063x of the 1.10 target)
    assert "cold wall / floor (venv): 17.7 / 16.0 min = 1.11x / target 1.10x = 1.01x" in lines


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
