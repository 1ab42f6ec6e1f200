"""`checks run --backend slurm` against a real slurmctld and slurmd (tools/slurm_local.sh: Debian's
Slurm 22.05 on this machine, one node, accounting through the job completion log). No mock scheduler:
jobs are submitted with sbatch, followed with squeue, cancelled with scancel and their ends read back
from sacct and scontrol.

They skip where Slurm is absent and fail instead when STACKPROBE_REQUIRE_SLURM=1 (set by .ci/run).
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.checks_helpers import ROOT, TOKEN_VAR, fixture_env, pids_with_env
from tests.test_fi_jit import write_standin

REQUIRE_SLURM = os.environ.get("STACKPROBE_REQUIRE_SLURM") == "1"
SCRIPT = ROOT / "tools" / "slurm_local.sh"
NVCC = "/usr/local/cuda/bin/nvcc"

SLEEPER = '''"""Sleeps far past any test's time limit: only Slurm or a cancel ends it."""

import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-slurm-sleep", title="sleeps", feature="Slurm time limit", ranks=(1, 2), needs_gpu=False,
                 timeout_s=900)


def run(ctx: RankContext) -> dict:
    time.sleep(900)
    return outcome("pass")
'''


def _slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return p.returncode == 0 and any(s.startswith(("idle", "mix", "alloc")) for s in p.stdout.split())


def _unavailable(why: str) -> None:
    if REQUIRE_SLURM:
        pytest.fail(f"STACKPROBE_REQUIRE_SLURM=1 but {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def slurm() -> None:
    """A Slurm cluster to submit to: the one already answering, or this machine's own, started with
    tools/slurm_local.sh (as .ci/run does). It is left running: test processes of `pytest -n` share it,
    and the first to finish must not stop it under the others (one lock serialises the starts)."""
    if _slurm_answers():
        return
    if shutil.which("slurmctld") is None or shutil.which("sbatch") is None:
        _unavailable("Slurm is not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        _unavailable("no Slurm cluster answers, and starting this machine's own needs root")
    with open(Path(tempfile.gettempdir()) / "stackprobe-slurm-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        p = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=180)
    if p.returncode != 0:
        _unavailable(f"tools/slurm_local.sh start failed: {p.stderr.strip()[-500:]}")
    os.environ["SLURM_CONF"] = subprocess.run([str(SCRIPT), "env"], capture_output=True,
                                              text=True).stdout.split("=", 1)[1].strip()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    probes = tmp_path / "probes"
    probes.mkdir(exist_ok=True)
    (probes / "t_slurm_sleep.py").write_text(SLEEPER)
    env = fixture_env(STACKPROBE_SLURM_POLL_S="1", **extra)
    env["STACKPROBE_PROBE_PATH"] += os.pathsep + str(probes)
    return env


def checks(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "checks.cli", "run", "--python", sys.executable, *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def _by_key(results: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["probe_id"], r["variant"]): r for r in results}


def _same_verdicts(local: list[dict], slurm: list[dict]) -> None:
    a, b = _by_key(local), _by_key(slurm)
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k]["status"], a[k]["reason_code"], a[k]["note"]) == (b[k]["status"], b[k]["reason_code"],
                                                                        b[k]["note"]), k
        assert a[k]["cell_id"] == b[k]["cell_id"] and a[k]["host_id"] == b[k]["host_id"]


def _queue(name: str = "") -> str:
    args = ["squeue", "-h", "-o", "%i|%j|%T"] + ([f"--name={name}"] if name else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout


def test_inventory_through_slurm_gives_the_local_verdict(slurm: None, tmp_path: Path) -> None:
    env = _env(tmp_path)
    local = checks(env, "--backend", "local", "--probe", "inventory", "--probe", "t-trivial", "--json",
                   "--results", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    p = checks(env, "--backend", "slurm", "--probe", "inventory", "--probe", "t-trivial", "--json",
               "--results", str(tmp_path / "slurm"))
    assert p.returncode == 0, p.stderr
    assert "in 2 job(s)" in p.stderr and "RUNNING on" in p.stderr, p.stderr  # one job per CPU probe
    results = json.loads(p.stdout)
    _same_verdicts(json.loads(local.stdout), results)
    assert {r["status"] for r in results} == {"pass"}
    # no --level: the quick pass ran both CPU probes in Slurm jobs; the full pass carried all of it, no job
    manifests = [json.loads(path.with_name(path.name.replace(".jsonl", ".manifest.json")).read_text())
                 for path in sorted((tmp_path / "slurm").glob("*/*.jsonl"))]
    assert [m["level"] for m in manifests] == ["quick", "full"]
    assert all(m["executor"] == "slurm" and m["facts"]["slurm"]["job_id"] for m in manifests)
    assert p.stderr.count("in 2 job(s)") == 1 and "now the full level: nothing more to run" in p.stderr
    quick_run = {r["evidence"]["reused_from"] for r in results}
    assert len(quick_run) == 1 and {r["run_id"] for r in results} == {manifests[1]["run_id"]}
    ids = {r["evidence"]["slurm"]["job"] for r in results}
    assert len(ids) == 2 and all(i.isdigit() for i in ids)


VENV_CELL = "cu130-torch2.11.0-sglnone-fi0.6.18"  # what the one-cell matrix below resolves to
MATRIX = 'matrix:\n  cuda: ["13.0"]\n  torch: ["2.11.0"]\n  sgl_kernel: [none]\n  flashinfer: ["0.6.18"]\n'


def test_venv_cells_are_the_default_and_run_as_the_local_executor_runs_them(slurm: None, tmp_path: Path) -> None:
    """Without --python the nodes run each venv cell of the matrix with the interpreter and environment
    (PATH, PYTHONPATH, CUDA_HOME) of its envs/<cell>/build.json, as `checks run --backend venv` does here.
    The record is written by hand in the shape `provision build --backend venv` gives it; its interpreter is
    this one."""
    envs = tmp_path / "envs"
    (envs / VENV_CELL).mkdir(parents=True)
    bindir = Path(sys.executable).parent
    (envs / VENV_CELL / "build.json").write_text(json.dumps({
        "cell_id": VENV_CELL, "backend": "venv", "status": "built", "python": sys.executable,
        "venv": str(bindir.parent), "path": [str(bindir)], "cuda_home": str(tmp_path / "cuda")}))
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    where = ["--matrix", str(tmp_path / "matrix.yaml"), "--envs", str(envs), "--probe", "t-trivial",
             "--probe", "inventory", "--json", "--level", "full"]
    env = _env(tmp_path)
    local = subprocess.run([sys.executable, "-m", "checks.cli", "run", "--backend", "venv", *where, "--results",
                            str(tmp_path / "local")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert local.returncode == 0, local.stderr
    p = subprocess.run([sys.executable, "-m", "checks.cli", "run", "--backend", "slurm", *where, "--results",
                        str(tmp_path / "slurm")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout)
    _same_verdicts(json.loads(local.stdout), results)
    assert {r["cell_id"] for r in results} == {VENV_CELL} and len(results) == 3
    python = Path(sys.executable).relative_to(ROOT)  # the clone's environment, written from the clone's top
    assert all(r["evidence"]["command"].startswith(f"{python} -m inenv.worker") for r in results)
    [script] = [f for f in (ROOT / ".cache" / "slurm" / results[0]["run_id"]).glob("*/job.sh")
                if "t-trivial" in (f.parent / "job.json").read_text()]
    text = script.read_text()
    assert f"export CUDA_HOME={tmp_path / 'cuda'}" in text and f"export PYTHONPATH={ROOT}\n" in text


def test_fi_jit_cross_compile_through_slurm_gives_the_local_verdict(slurm: None, tmp_path: Path) -> None:
    """The smallest fi-jit cross-compile (vllm_comm for 12.0a) with the host's nvcc 13.0. flashinfer is not
    installed in this interpreter, so a stand-in package plays its JIT front end (see tests/test_fi_jit.py);
    the compile, the link and the reading back of the SASS are real."""
    if not os.access(NVCC, os.X_OK):
        pytest.skip("needs nvcc at /usr/local/cuda")
    site = tmp_path / "site"
    write_standin(site)
    env = _env(tmp_path, CUDA_HOME="/usr/local/cuda", STACKPROBE_FI_JIT_ONLY="vllm_comm@12.0a",
               PYTHONPATH=f"{site}{os.pathsep}{ROOT}", PATH=f"{Path(sys.executable).parent}{os.pathsep}"
               f"{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="")
    out = {}
    for name, how in (("local", ["--backend", "local"]), ("slurm", ["--backend", "slurm"])):
        # Each run compiles into its own caches: with one shared compile cache the second run's verdict
        # would rightly say "cached", and the two notes would differ for that reason alone.
        p = checks({**env, "STACKPROBE_JIT_CACHE": str(tmp_path / f"jit-{name}")}, *how, "--probe", "fi-jit",
                   "--target-arch", "12.0a", "--compile-cache", str(tmp_path / f"compiled-{name}"), "--json",
                   "--results", str(tmp_path / name), timeout=600)
        assert p.returncode == 0, p.stderr
        out[name] = json.loads(p.stdout)
    _same_verdicts(out["local"], out["slurm"])
    [r] = out["slurm"]
    assert (r["variant"], r["status"]) == ("ranks=1,module=vllm_comm,arch=12.0a", "pass"), r
    assert r["evidence"]["targets_in_output"] == ["sm_120a"]


def _read_until(proc: subprocess.Popen[str], wanted: list[str], timeout: float) -> str:
    """The runner's stderr until every string in ``wanted`` has appeared."""
    assert proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    seen = ""
    deadline = time.monotonic() + timeout
    fd = proc.stderr.fileno()
    while not all(w in seen for w in wanted):
        assert time.monotonic() < deadline, f"waited for {wanted}; stderr so far:\n{seen}"
        assert proc.poll() is None, f"runner exited {proc.returncode}:\n{seen}{proc.stderr.read()}"
        if sel.select(timeout=1):
            # what the pipe holds, read from the descriptor: a buffered readline() may take two lines from the
            # pipe and return one, and select() then never reports the other (the runner is quiet meanwhile)
            seen += os.read(fd, 65536).decode(errors="replace")
    return seen


def test_ctrl_c_cancels_running_and_queued_jobs(slurm: None, tmp_path: Path) -> None:
    env = _env(tmp_path)
    # three CPU probes are three jobs; each asking for a whole node, one runs and two wait
    proc = subprocess.Popen([sys.executable, "-m", "checks.cli", "run", "--backend", "slurm", "--python",
                             sys.executable, "--probe", "t-slurm-sleep", "--probe", "t-zz-slow", "--probe",
                             "t-trivial", "--sbatch-arg=--exclusive",
                             "--results", str(tmp_path / "r")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        seen = _read_until(proc, ["RUNNING on", "PENDING", "started"], 180)
        mine = [ln for ln in _queue().splitlines() if "stackprobe-" in ln]
        states = {ln.split("|")[2] for ln in mine}
        assert {"RUNNING", "PENDING"} <= states, mine
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = seen + err
    assert proc.returncode == 130, err
    assert "no job of this run is left in the queue" in err, err
    job_name = mine[0].split("|")[1]
    assert _queue(job_name) == ""  # nothing of the run left queued or running
    assert pids_with_env(env[TOKEN_VAR]) == []  # the node killed the running job's processes
    recorded = [json.loads(ln) for f in (tmp_path / "r").glob("*/*.jsonl") for ln in f.read_text().splitlines()]
    assert recorded == []  # the sleeper was cut short and the others never started: nothing to record


def test_a_job_at_its_time_limit_is_recorded_as_timeout_never_as_pass(slurm: None, tmp_path: Path) -> None:
    env = _env(tmp_path)
    p = checks(env, "--backend", "slurm", "--probe", "t-slurm-sleep", "--time", "1", "--json", "--level", "full",
               "--results", str(tmp_path / "r"), timeout=400)
    assert p.returncode == 0, p.stderr
    by = {r["variant"]: r for r in json.loads(p.stdout)}
    ran, waited = by["ranks=1"], by["ranks=2"]  # one job: the first variant runs into the limit
    assert (ran["status"], ran["reason_code"]) == ("hang", "slurm-timeout"), ran
    assert "at its time limit (1 min) while this variant ran" in ran["note"]
    assert ran["evidence"]["slurm"]["state"] == "TIMEOUT" and ran["remediation"]
    assert (waited["status"], waited["reason_code"]) == ("not-run", "slurm-timeout"), waited
    assert "DUE TO TIME LIMIT" in ran["evidence"]["slurm_output_tail"]
    stored = [json.loads(ln) for f in (tmp_path / "r").glob("*/*.jsonl") for ln in f.read_text().splitlines()]
    assert sorted(r["variant"] for r in stored) == ["ranks=1", "ranks=2"]  # both recorded, none lost


def test_sbatch_refusal_is_recorded_for_the_jobs_variants(slurm: None, tmp_path: Path) -> None:
    p = checks(_env(tmp_path), "--backend", "slurm", "--probe", "t-trivial", "--sbatch-arg=--mem=99999999",
               "--json", "--results", str(tmp_path / "r"))
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout)
    assert results and {(r["status"], r["reason_code"]) for r in results} == {("not-run", "slurm-submit-failed")}
    assert all(r["note"].startswith("sbatch: ") and r["remediation"] for r in results), results


def test_a_container_image_without_pyxis_is_refused_in_one_line(slurm: None, tmp_path: Path) -> None:
    p = checks(_env(tmp_path), "--backend", "slurm", "--probe", "t-trivial", "--container-image", "ubuntu:24.04",
               "--results", str(tmp_path / "r"))
    assert p.returncode == 2
    assert "no --container-image option (the pyxis plugin is not installed)" in p.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").glob("*/*.jsonl"))


# --- what every backend gets from the run session, through Slurm -------------------------------------------------
WAITER = '''"""Passes once the file STACKPROBE_TEST_GO names exists; waits for it until then."""

import os
import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-zz-wait", title="waits", feature="resume", ranks=(1,), needs_gpu=False, timeout_s=600)


def run(ctx: RankContext) -> dict:
    while not os.path.exists(os.environ["STACKPROBE_TEST_GO"]):
        time.sleep(0.2)
    return outcome("pass")
'''


def _keys(results: Path) -> list[tuple[str, str, str, str]]:
    """(run, cell, probe, variant) of every stored result, sorted."""
    return sorted((r["run_id"], r["cell_id"], r["probe_id"], r["variant"]) for f in results.glob("*/*.jsonl")
                  for r in map(json.loads, f.read_text().splitlines()))


def test_a_killed_slurm_run_resumed_records_every_variant_exactly_once(slurm: None, tmp_path: Path) -> None:
    """The first run is interrupted while one job waits and the other has finished; --resume submits only the
    variant that was not recorded, into the same run."""
    env = _env(tmp_path, STACKPROBE_TEST_GO=str(tmp_path / "go"))
    (tmp_path / "probes" / "t_zz_wait.py").write_text(WAITER)
    argv = [sys.executable, "-m", "checks.cli", "run", "--backend", "slurm", "--python", sys.executable, "--probe",
            "t-trivial", "--probe", "t-zz-wait", "--results", str(tmp_path / "r"), "--no-report", "--level", "full"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        seen = _read_until(proc, ["t-zz-wait ranks=1 started", "ended COMPLETED"], 180)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, seen + err
    first = _keys(tmp_path / "r")
    assert [k[2:] for k in first] == [("t-trivial", "ranks=1"), ("t-trivial", "ranks=2")], seen + err

    (tmp_path / "go").touch()
    p = subprocess.run([*argv, "--resume", "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "resumed: 2 variant(s) already recorded were not run again" in p.stderr
    assert "1 variant(s) in 1 job(s)" in p.stderr, p.stderr
    every = _keys(tmp_path / "r")
    assert len(every) == len(set(every)) == 3  # each variant once
    assert {k[0] for k in every} == {first[0][0]}  # one run: the resumed one
    assert [k[2:] for k in every] == [("t-trivial", "ranks=1"), ("t-trivial", "ranks=2"), ("t-zz-wait", "ranks=1")]
    [path] = (tmp_path / "r").glob("*/*.jsonl")
    assert {json.loads(ln)["status"] for ln in path.read_text().splitlines()} == {"pass"}


def test_quick_level_reuse_json_and_the_table_through_slurm(slurm: None, tmp_path: Path) -> None:
    """A clean checkout (only a clean one's results are reused), its jobs' folders inside it as usual."""
    from tests.test_incremental import ALL, Checkout

    c = Checkout(tmp_path, backend=("--backend", "slurm", "--python", sys.executable))
    c.env.update(STACKPROBE_SLURM_POLL_S="1")
    if "SLURM_CONF" in os.environ:  # the cluster the fixture started; one already answering needs none
        c.env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    quick = c.run("--level", "quick", "--probe", "fi-jit")
    assert "plan 1 cell(s) x 3 probe(s) = 6 variant(s)" in quick.stderr  # fi-jit: vllm_comm x (local, 12.0a, 12.0f)
    assert c.ran() == ALL
    printed = json.loads(quick.stdout)
    assert len(printed) == 6 and not any("level" in r["evidence"] for r in printed)  # no GPU variant: none shortened
    [run] = c.runs()
    manifest = json.loads(run.with_name(run.stem + ".manifest.json").read_text())
    assert (manifest["executor"], manifest["level"]) == ("slurm", "quick")

    table = c.results / "compatibility.md"
    full = c.run(report=table)  # full level: the quick run's unshortened results answer it, no job runs
    assert c.ran() == [] and "3 unchanged, reused from run" in full.stderr and "0 variant(s) in 0 job(s)" in full.stderr
    assert all(r["evidence"]["slurm"]["job"] for r in json.loads(full.stdout))
    assert f"table: {table} and {table.with_suffix('.html')}" in full.stderr
    assert "t-count-a" in table.with_name("compatibility-archive.md").read_text()  # a local cell: archived

    again = c.run()  # nothing changed: nothing runs, no job is submitted
    assert c.ran() == []
    assert "3 unchanged, reused from run" in again.stderr and "0 variant(s) in 0 job(s)" in again.stderr
    carried = json.loads(again.stdout)
    assert len(carried) == 3 and {r["evidence"]["reused_from"] for r in carried} == {run.stem}


def test_a_slurm_run_takes_the_run_lock_of_its_host(slurm: None, tmp_path: Path) -> None:
    from checks.results import hostfacts
    from checks.results.store import RunLock

    host = hostfacts.collect()["host_id"]  # a node of the one-node cluster is this machine
    with RunLock(tmp_path / "r" / host):
        p = checks(_env(tmp_path), "--backend", "slurm", "--probe", "t-trivial", "--results", str(tmp_path / "r"))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("checks: another `checks run` or `checks import` is writing to "
                                                 f"{tmp_path / 'r' / host}; wait for it to finish")
    assert "submitted" not in p.stderr and not list((tmp_path / "r").glob("*/*.jsonl"))  # nothing was submitted
