"""`checks run / list` end to end in local mode: real worker processes, real store, real signals."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checks.cli import main
from checks.results import hostfacts, provenance
from checks.results.provenance import Provenance, probe_hash
from checks.results.store import read_file
from tests.checks_helpers import FIXTURES, ROOT, TOKEN_VAR, fixture_env, pids_with_env, report_md


def checks(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "checks.cli", *args], capture_output=True, text=True,
                          env=env or fixture_env(), cwd=ROOT, timeout=timeout)


def _jsonl(results: Path) -> list[Path]:
    return sorted(results.glob("*/*.jsonl"))


def test_run_local_records_results_and_manifest(tmp_path: Path) -> None:
    p = checks("run", "--backend", "local", "--probe", "t-trivial", "--probe", "t-gpu", "--probe", "t-missing",
               "--json", "--results", str(tmp_path), "--level", "full")
    assert p.returncode == 0, p.stderr
    assert "plan 1 cell(s) x 3 probe(s) = 5 variant(s)" in p.stderr
    assert "2 decided without running, skip: no GPU on this host" in p.stderr
    printed = json.loads(p.stdout)
    [path] = _jsonl(tmp_path)
    stored, warnings = read_file(path)
    assert warnings == [] and [r.to_json() for r in stored] == printed
    by = {(r.probe_id, r.variant): r.verdict for r in stored}
    assert by[("t-trivial", "ranks=2")].status == "pass"
    assert by[("t-gpu", "ranks=1")].status == "skip" and by[("t-gpu", "ranks=1")].reason_code == "no-gpu"
    assert by[("t-missing", "ranks=1")].status == "skip"
    assert by[("t-missing", "ranks=1")].reason_code == "missing-package"
    r = stored[0]
    assert r.cell_id.startswith("local-cu") and r.host_id == path.parent.name
    manifest = json.loads(path.with_name(path.name.replace(".jsonl", ".manifest.json")).read_text())
    assert manifest["facts"]["host_id"] == r.host_id and manifest["executor"] == "local"
    assert manifest["cells"][r.cell_id]["versions"]["torch"].startswith("2.11.0")
    code = manifest["code"]  # the code that made these results, in the manifest and in every result
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert code["commit"] == head and isinstance(code["dirty"], bool) and code["version"] == "0.1.0"
    assert code["probe_hashes"]["t-trivial"] == probe_hash(FIXTURES / "t_trivial.py")
    assert sorted(code["probe_hashes"]) == ["t-gpu", "t-missing", "t-trivial"]
    for res in stored:
        assert res.code == Provenance(code["version"], head, code["dirty"], code["probe_hashes"][res.probe_id])
        assert printed[0]["code"]["commit"] == head


FRESH = '''"""Passes; its source is edited by the test to show a verdict going stale."""

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-fresh", title="fresh", feature="provenance", ranks=(1,), needs_gpu=False, timeout_s=60)


def run(ctx: RankContext) -> dict:
    return outcome("pass")
'''


def test_main_in_process_records_the_probe_code_and_report_marks_it_stale_after_an_edit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    probes, results, out = tmp_path / "probes", tmp_path / "results", tmp_path / "docs" / "compatibility.md"
    probes.mkdir()
    (probes / "t_fresh.py").write_text(FRESH)
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", str(probes))
    # made at a clean commit, whatever state this checkout is in (a dirty one is marked too: asserted below)
    monkeypatch.setattr(provenance, "checkout", lambda root=None: provenance.Checkout("0.1.0", "c0ffee", False))
    handler = signal.getsignal(signal.SIGTERM)
    argv = ["run", "--backend", "local", "--probe", "t-fresh", "--results", str(results), "--json", "--level", "full"]
    assert main(argv) == 0
    assert signal.getsignal(signal.SIGTERM) is handler  # main's Ctrl-C handlers do not outlive it
    [printed] = json.loads(capsys.readouterr().out)
    made_by = probe_hash(probes / "t_fresh.py")
    assert printed["status"] == "pass" and printed["code"]["probe_hash"] == made_by
    [path] = _jsonl(results)
    manifest = json.loads(path.with_name(path.name.replace(".jsonl", ".manifest.json")).read_text())
    assert manifest["argv"] == argv  # what main was given, not the interpreter's command line
    assert manifest["code"]["probe_hashes"] == {"t-fresh": made_by}

    assert main(["report", "--results", str(results), "--out", str(out)]) == 0
    assert "`local-" in report_md(out) and "↻" not in report_md(out)
    (probes / "t_fresh.py").write_text(FRESH.replace('outcome("pass")', 'outcome("pass", note="")'))
    capsys.readouterr()
    assert main(["report", "--results", str(results), "--out", str(out), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert main(["report", "--results", str(results), "--out", str(out)]) == 0
    md = report_md(out)
    assert re.search(r"✅ ↻( \*\(static\)\*)? \|", md)
    assert "the probe's source changed since): `checks run --backend local --probe t-fresh`" in md


def test_resume_skips_recorded_variants(tmp_path: Path) -> None:
    one = ("--backend", "local", "--level", "full", "--results", str(tmp_path))  # one run, resumed
    assert checks("run", *one, "--probe", "t-trivial").returncode == 0
    p = checks("run", *one, "--resume", "--probe", "t-trivial", "--probe", "t-raise")
    assert p.returncode == 0, p.stderr
    assert "resumed: 2 variant(s)" in p.stderr
    [path] = _jsonl(tmp_path)
    stored, _ = read_file(path)
    assert sorted((r.probe_id, r.variant) for r in stored) == [
        ("t-raise", "ranks=1"), ("t-trivial", "ranks=1"), ("t-trivial", "ranks=2")]


def _run_until_slow_probe_runs(tmp_path: Path, stderr: int) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """A local run of t-trivial then t-zz-slow, returned once t-trivial's two results are stored and the
    slow probe's worker and rank are running."""
    env = fixture_env()
    proc = subprocess.Popen([sys.executable, "-m", "checks.cli", "run", "--backend", "local", "--probe", "t-trivial",
                             "--probe", "t-zz-slow", "--results", str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        files = _jsonl(tmp_path)
        if files and len(read_file(files[0])[0]) == 2 and len(pids_with_env(env[TOKEN_VAR])) > 1:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # the slow probe's worker and rank are now running
    return proc, env


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_exits_130_keeps_finished_results_and_leaves_nothing(tmp_path: Path, sig: int) -> None:
    proc, env = _run_until_slow_probe_runs(tmp_path, subprocess.PIPE)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    stored, warnings = read_file(_jsonl(tmp_path)[0])
    assert warnings == [] and [r.probe_id for r in stored] == ["t-trivial", "t-trivial"]
    assert pids_with_env(env[TOKEN_VAR]) == []


@pytest.mark.parametrize(("args", "needle"), [
    (["run", "--backend", "local", "--probe", "t-trivail"], "unknown probe 't-trivail'; did you mean 't-trivial'?"),
    (["run", "--backend", "local"], "choose probes with --all or --probe"),
    (["run", "--backend", "local", "--all", "--probe", "t-trivial"], "not both"),
    (["run", "--backend", "local", "--probe", "t-trivial", "--only", "cu999-*"], "does not match --cuda/--only"),
    (["run", "--backend", "local", "--probe", "t-trivial", "--cuda", "11"], "does not match --cuda/--only"),
    (["run", "--backend", "local", "--python", "/nonexistent/python", "--probe", "t-trivial"], "/nonexistent/python"),
    (["run", "--backend", "local", "--probe", "t-trivial", "--timeout-scale", "0"], "--timeout-scale must be > 0"),
    (["run", "--backend", "local", "--probe", "t-trivial", "--jobs", "0"], "--jobs 0: give 1 or more"),
    (["run", "--backend", "local", "--probe", "t-trivial", "--level", "fast"],
     "argument --level: invalid choice: 'fast'"),
    (["run", "--local", "--backend", "venv", "--probe", "t-trivial"], "--backend venv and --local name different"),
    (["run", "--executor", "slurm", "--backend", "docker", "--probe", "t-trivial"],
     "--backend docker and --executor slurm name different backends"),
    (["run", "--bogus"], "unrecognized arguments: --bogus"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", str(FIXTURES))
    assert main([*args, "--results", str(tmp_path)] if args[0] == "run" and "--bogus" not in args else args) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not list(tmp_path.glob("*/*.jsonl"))


def test_docker_mode_without_docker_is_exit_2(tmp_path: Path) -> None:
    envs = tmp_path / "envs" / "cu130-torch2.11.0-sgl0.4.2-fi0.6.17"
    envs.mkdir(parents=True)
    (envs / "build.json").write_text(json.dumps({"status": "built", "tag": "stackprobe-test/none:1"}))
    env = fixture_env(DOCKER_HOST="unix:///nonexistent/docker.sock")
    # --backend docker: without it, no daemon means venv cells (tests/test_provision_venv.py)
    p = checks("run", "--backend", "docker", "--probe", "t-trivial", "--only", "cu130-torch2.11.0-sgl0.4.2-fi0.6.17",
               "--envs", str(tmp_path / "envs"), "--results", str(tmp_path / "res"), env=env)
    assert p.returncode == 2, p.stderr
    assert "Docker is not reachable" in p.stderr and "--backend local" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_list_json_has_the_fixture_probes() -> None:
    p = checks("list", "--json")
    rows = {r["id"]: r for r in json.loads(p.stdout)}
    assert rows["t-gloo-allreduce"]["ranks"] == [2, 3] and rows["t-gloo-allreduce"]["needs_gpu"] is False
    assert rows["t-gpu"]["requires"] == ["torch"]


def test_kill_9_of_the_runner_leaves_valid_lines_and_no_processes(tmp_path: Path) -> None:
    proc, env = _run_until_slow_probe_runs(tmp_path, subprocess.DEVNULL)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stored, warnings = read_file(_jsonl(tmp_path)[0])
    assert warnings == [] and [r.probe_id for r in stored] == ["t-trivial", "t-trivial"]
    deadline = time.monotonic() + 10
    while pids_with_env(env[TOKEN_VAR]) and time.monotonic() < deadline:
        time.sleep(0.1)  # the worker, then its rank, are killed as their parents die
    assert pids_with_env(env[TOKEN_VAR]) == []


def _run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.splitlines()


def test_run_ends_with_the_table_and_a_verdict_count_and_summarises_what_is_worth_reading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One event per line however long (stderr is not a terminal here), the
    cell of how many, done/total, rows only for verdicts worth reading, and last the verdict count and the
    table that was regenerated."""
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", str(FIXTURES))
    results = tmp_path / "results"
    argv = ["run", "--backend", "local", "--probe", "t-trivial", "--probe", "t-gpu", "--probe", "t-missing", "--probe",
            "t-raise", "--results", str(results), "--level", "full"]
    code, err = _run_in_process(argv, capsys)
    assert code == 0, err
    [path] = _jsonl(results)
    cell = read_file(path)[0][0].cell_id
    assert len(cell) > 40  # with the status, the probe and the counts, a result line is longer than 80 columns
    assert f"cell 1 of 1 {cell}: 4 to run, 2 decided without running" in err
    ran = [ln for ln in err if ln.lstrip().startswith(("pass ", "skip ", "fail "))]
    assert len(ran) == 4  # one line per variant that ran; the two planned skips are counted in the plan
    assert all(f" {cell} " in ln and " done" in ln and len(ln) > 80 for ln in ran)  # not wrapped
    assert ran[-1].endswith("· 6 of 6 done")
    assert any(ln.startswith(f"  start {cell} t-raise ranks=1 (4 of 6; no earlier run)") for ln in err)
    assert not any(ln.strip().startswith("(") or ln.startswith("no-gpu") for ln in err)  # no wrapped tails
    # the summary: only pass/partial/fail/crash/hang get a row, with the full cell id; the rest on one line
    top = err.index("summary (pass, partial, fail, crash, hang by cell and probe):")
    rows = err[top + 1:top + 5]
    assert rows[0].split() == [cell, "t-raise", "1", "fail", "(fi-arch-gate)"]
    # a pass on a host without a GPU was proven without one, and says so
    static = ["[static]"] if hostfacts.collect()["gpu_count"] == 0 else []
    assert rows[1].split() == [cell, "t-trivial", "2", "pass", *static]
    assert rows[2] == "  not listed: 3 skip (no-gpu 2, missing-package 1)"
    assert rows[3].startswith("  static: proven without a GPU") == bool(static)
    table = results / "compatibility.md"  # a results folder of its own gets its own table
    assert err[-2:] == ["verdicts: 6 variants: 2 pass, 3 skip, 1 fail",
                        f"table: {table} and {table.with_suffix('.html')}, from every run in {results}"]
    assert f"`{cell}`" in report_md(table) and table.with_suffix(".html").exists()
    # the table the run wrote is the one `checks report` writes from the same results
    assert main(["report", "--results", str(results), "--out", str(table), "--check"]) == 0

    # a second run estimates from what the first recorded (--fresh: in a clean checkout it would reuse them)
    code, err = _run_in_process([*argv, "--no-report", "--fresh"], capsys)
    assert code == 0
    assert any(ln.startswith("to run: 4 of 6 variant(s), about ") and ln.endswith(
        "(from the durations this host recorded)") and "never timed" not in ln for ln in err)
    assert any(ln.startswith(f"  start {cell} t-raise ranks=1 (4 of 6; last time ") for ln in err)
    assert any(", about " in ln and ln.endswith(" left") for ln in err if " done" in ln)
    assert err[-1] == (f"table: not regenerated (--no-report); `checks report --results {results}` writes it")


SLOW = '''"""Sleeps long enough for the progress ticker to speak."""

import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-sleepy", title="sleepy", feature="progress", ranks=(1,), needs_gpu=False, timeout_s=60)


def run(ctx: RankContext) -> dict:
    time.sleep(2.5)
    return outcome("pass")
'''


def test_a_long_variant_is_said_to_be_running_while_it_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import checks.run.runconsole

    probes = tmp_path / "probes"
    probes.mkdir()
    (probes / "t_sleepy.py").write_text(SLOW)
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", str(probes))
    monkeypatch.setattr(checks.run.runconsole, "TICK_S", 0.8)
    code, err = _run_in_process(["run", "--backend", "local", "--probe", "t-sleepy", "--results", str(tmp_path / "r"),
                                 "--no-report"], capsys)
    assert code == 0
    ticks = [ln for ln in err if ln.startswith("running local-")]
    assert ticks and " t-sleepy ranks=1: " in ticks[0] and " so far (no earlier run); 0 of 1 done" in ticks[0]
    assert err.index(ticks[0]) < next(i for i, ln in enumerate(err) if ln.lstrip().startswith("pass "))


def test_memlock_not_raised_is_said_once_per_run_in_clean_words(tmp_path: Path) -> None:
    """The daemon's refusal, as recorded by older runs with its API quoting, is said once."""
    import io

    from checks.results.result import Verdict
    from checks.results.store import RunStore
    from checks.run import runprogress
    from checks.run.options import RunOptions
    from checks.run.plan import CellTarget, plan_work
    from checks.run.runconsole import with_progress
    from checks.run.runner import Work, execute
    from common import reasons
    from common.progress import console
    from inenv.probe import HostView
    from inenv.registry import discover
    from inenv.status import Status

    recorded = ('not raised: the Docker daemon refused (container init: error setting rlimits for ready process: '
                'error setting rlimit type 8: operation not permitted: unknown"))')

    class Refused:
        gated = False

        def sweep(self) -> None:
            pass

        def run(self, variant: object, gpus: int, timeout_s: float, catalogue: object) -> Verdict:
            return Verdict(Status.PASS, evidence={"memlock": recorded})

    probes = {pid: mod for pid, (_, mod) in discover({"STACKPROBE_PROBE_PATH": str(FIXTURES)}).items()
              if pid == "t-trivial"}
    cell = CellTarget("cu130-x", "resolved", image="img", image_status="built")
    items = plan_work([cell], probes, HostView())
    buf = io.StringIO()
    con = console()
    con.file = buf
    view = runprogress.RunView(items, runprogress.expected_durations(items, {}))
    store = RunStore(tmp_path, "host", "run")
    work = Work(items, store, reasons.default(), 0, executors={"cu130-x": Refused()})
    report = with_progress(con, view, lambda hooks: execute(RunOptions(), work, hooks))
    assert len(report.results) == 2
    said = [ln for ln in buf.getvalue().splitlines() if ln.startswith("memlock:")]
    assert said == ["memlock: containers of this run do not get memlock unlimited, the Docker daemon refused "
                    "(error setting rlimits for ready process: error setting rlimit type 8: operation not "
                    "permitted); they run with the daemon's own limit, which large NCCL or CUDA IPC buffers may "
                    "exceed. To fix: give dockerd an unlimited hard memlock limit: a dockerd inside a container "
                    "needs that container started with --ulimit memlock=-1 (or CAP_SYS_RESOURCE); a rootless "
                    "dockerd needs LimitMEMLOCK=infinity in its systemd unit"]


@pytest.mark.parametrize(("argv", "backend"), [
    ([], "auto"), (["--local"], "local"), (["--executor", "local"], "local"), (["--executor", "slurm"], "slurm"),
    (["--executor", "docker"], "docker"), (["--backend", "slurm"], "slurm"),
    (["--local", "--backend", "local"], "local"),
])
def test_the_older_spellings_name_one_backend(argv: list[str], backend: str) -> None:
    from checks.cli import parser, run_options

    full = ["run", "--probe", "t-trivial", *argv]
    opts = run_options(parser().parse_args(full), full)
    assert opts.backend == backend and opts.argv == tuple(full)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.backend = "docker"  # type: ignore[misc]


def test_every_backend_the_command_line_offers_is_in_the_registry() -> None:
    from checks.run.backends import BACKENDS
    from checks.run.options import AUTO, BACKEND_CHOICES

    assert sorted(BACKENDS) == sorted(set(BACKEND_CHOICES) - {AUTO}) == ["docker", "local", "slurm", "venv"]
    for make in BACKENDS.values():
        backend = make()
        assert all(callable(getattr(backend, m)) for m in ("targets", "prepare", "run", "cancel"))
        assert isinstance(backend.name, str) and isinstance(backend.gpu_lock, bool)


@pytest.mark.parametrize("argv, says", [
    (["--resume", "--fresh"], "--resume continues the latest run and --fresh reruns everything; give one"),
    (["--compile-cache", "/tmp/c", "--no-compile-cache"], "--compile-cache names a cache and --no-compile-cache"),
    (["--backend", "docker", "--python", "python3"], "--python is the interpreter of --backend local (or slurm)"),
    (["--backend", "venv", "--partition", "gpu", "--time", "5"], "--partition, --time are for --backend slurm"),
])
def test_run_refuses_contradicting_options_with_one_line(argv: list[str], says: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--all", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_run_options_defaults_are_the_command_lines() -> None:
    from checks.cli import parser, run_options
    from checks.run.options import RunOptions, default_jobs

    given = run_options(parser().parse_args(["run", "--all"]), ["run", "--all"])
    plain = RunOptions(all_probes=True)
    assert (given.jobs, given.level) == (plain.jobs, plain.level) == (default_jobs(), None)
