"""Incremental runs: `checks run` reuses a result whose inputs did not change, and reruns everything else.

The runs are real (`python -m checks.cli run --local` and its worker processes) in a clean git checkout of
this code made in a temporary folder: results made by code that differs from its commit are never reused,
so a checkout being edited (this one, most of the time) could not show a reuse at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checks.results.provenance import Provenance
from checks.results.result import ProbeResult, Verdict
from checks.results.store import read_file
from checks.run import incremental
from checks.run.executor import EnvPrint, env_print
from checks.run.plan import CellTarget, WorkItem
from inenv.probe import FULL, QUICK, ProbeSpec, Variant
from inenv.status import Status
from tests.checks_helpers import ROOT

COUNT_ENV = "STACKPROBE_TEST_COUNT"  # the file a counting probe appends one line to per run of a variant

COUNTING = '''"""Passes, and appends its variant to the file STACKPROBE_TEST_COUNT names: one line per run."""

import os

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="{pid}", title="{pid}", feature="incremental runs", ranks={ranks}, needs_gpu=False,
                 timeout_s=60)


def run(ctx: RankContext) -> dict:
    if ctx.rank == 0:
        with open(os.environ["STACKPROBE_TEST_COUNT"], "a") as f:
            f.write("{pid} " + ctx.variant.key + "\\n")
    return outcome("pass", metrics={{"rank": ctx.rank}})
'''

DECIDED = '''"""Decided at plan time: its one variant is a planned skip, never launched."""

from inenv.probe import ProbeSpec, RankContext, Skip, Variant

SPEC = ProbeSpec(id="t-decided", title="t-decided", feature="incremental runs", ranks=(1,), needs_gpu=False,
                 timeout_s=60)


def variants(host):
    return [Variant("t-decided", 1, skip=Skip("not-applicable", "decided without running"))]


def run(ctx: RankContext) -> dict:
    raise AssertionError("a planned skip is never launched")
'''

HANGS_ONCE = '''"""Hangs (the worker's watchdog fires) the first time, passes afterwards."""

import os
import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-hangs-once", title="hangs once", feature="incremental runs", ranks=(1,), needs_gpu=False,
                 timeout_s=3)


def run(ctx: RankContext) -> dict:
    with open(os.environ["STACKPROBE_TEST_COUNT"], "a") as f:
        f.write("t-hangs-once " + ctx.variant.key + "\\n")
    flag = os.environ["STACKPROBE_TEST_COUNT"] + ".hung"
    if not os.path.exists(flag):
        open(flag, "w").close()
        time.sleep(120)
    return outcome("pass")
'''


def clean_checkout(tmp_path: Path) -> Path:
    """This code (checks/, provision/, inenv/, common/, pyproject.toml) committed in a fresh git repository:
    `code.dirty` of its results is false, as in a clean clone."""
    root = tmp_path / "checkout"
    root.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("checks", "provision", "inenv", "common"):
        shutil.copytree(ROOT / name, root / name, ignore=skip)
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    git = ["git", "-C", str(root), "-c", "user.email=t@example.invalid", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "code under test"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    return root


def write_probes(folder: Path, hangs: bool = False, decided: bool = False) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "t_count_a.py").write_text(COUNTING.format(pid="t-count-a", ranks="(1, 2)"))
    (folder / "t_count_b.py").write_text(COUNTING.format(pid="t-count-b", ranks="(1,)"))
    if hangs:
        (folder / "t_hangs_once.py").write_text(HANGS_ONCE)
    if decided:
        (folder / "t_decided.py").write_text(DECIDED)


class Checkout:
    """`checks run --backend local` (or the backend given) of a clean checkout against stand-in probes, with one
    results folder."""

    def __init__(self, tmp_path: Path, hangs: bool = False, decided: bool = False,
                 backend: tuple[str, ...] = ("--backend", "local")) -> None:
        self.backend = backend
        self.root = clean_checkout(tmp_path)
        self.probes = tmp_path / "probes"
        write_probes(self.probes, hangs, decided)
        self.results = tmp_path / "results"
        self.count = tmp_path / "count.txt"
        self.count.touch()
        self.env = {**os.environ, "STACKPROBE_PROBE_PATH": str(self.probes), "PYTHONPATH": str(self.root),
                    COUNT_ENV: str(self.count)}
        self.env.pop("NCCL_ALGO", None)

    def run(self, *args: str, env: dict[str, str] | None = None,
            report: Path | None = None) -> subprocess.CompletedProcess[str]:
        probes = [a for p in sorted(self.probes.glob("t_*.py")) for a in ("--probe", p.stem.replace("_", "-"))]
        if "--level" not in args and "--staged" not in args:
            args = ("--level", "full", *args)  # one pass; tests of the staged run say --staged
        args = tuple(a for a in args if a != "--staged")
        table = ["--report", str(report)] if report else ["--no-report"]
        p = subprocess.run([sys.executable, "-m", "checks.cli", "run", *self.backend, *probes, "--results",
                            str(self.results), "--json", *table, *args], capture_output=True, text=True,
                           cwd=self.root, env=env or self.env, timeout=300)
        assert p.returncode == 0, p.stderr
        return p

    def ran(self) -> list[str]:
        """What ran since the last call (one line per variant run), sorted; the record is then emptied."""
        lines = sorted(self.count.read_text().splitlines())
        self.count.write_text("")
        return lines

    def runs(self) -> list[Path]:
        return sorted(self.results.glob("*/*.jsonl"))


ALL = ["t-count-a ranks=1", "t-count-a ranks=2", "t-count-b ranks=1"]


def test_a_second_identical_run_reuses_every_variant_says_so_and_records_nothing(tmp_path: Path) -> None:
    c = Checkout(tmp_path, decided=True)
    table = tmp_path / "table.md"
    first = c.run(report=table)
    assert c.ran() == ALL and "unchanged" not in first.stderr
    [run1] = c.runs()
    stored1, _ = read_file(run1)
    assert len(stored1) == 4 and all(r.code is not None and r.code.dirty is False for r in stored1)
    assert all(set(r.verdict.evidence["inputs"]) == {"env", "host"} for r in stored1 if r.probe_id != "t-decided")
    files = sorted(p.name for p in c.results.rglob("*"))
    written = {p: p.read_bytes() for p in (table, table.with_suffix(".html"))}

    # everything reused or decided as before: the run says so, and leaves no file and the table as it was
    second = c.run(report=table)
    assert c.ran() == []  # no worker ran a probe
    run_id = run1.stem
    assert f"reused 3 unchanged, reused from run {run_id}; --fresh reruns them" in second.stderr
    assert "nothing to run: all 4 variant(s) are reused or decided without running" in second.stderr
    assert f"reused: 3 variant(s) unchanged since run {run_id} were not run again (--fresh reruns them)" \
        in second.stderr
    printed = json.loads(second.stdout)
    assert [r["evidence"].get("reused_from") for r in printed if r["probe_id"] != "t-decided"] == [run_id] * 3
    assert "results: nothing new, so no run recorded (each variant reused or decided as before)" in second.stderr
    assert not [ln for ln in second.stderr.splitlines() if ln.startswith("results /")]  # names no file it never writes
    assert sorted(p.name for p in c.results.rglob("*")) == files and c.runs() == [run1]
    assert {p: p.read_bytes() for p in written} == written  # byte for byte: no new entry under "Runs:"
    # a third run likewise
    third = json.loads(c.run().stdout)
    assert [r["evidence"].get("reused_from") for r in third if r["probe_id"] != "t-decided"] == [run_id] * 3
    assert c.ran() == [] and c.runs() == [run1]

    # a changed probe: a run that adds a result records it, with the carried and decided ones beside it
    (c.probes / "t_count_b.py").write_text((c.probes / "t_count_b.py").read_text() + "# edited\n")
    c.run(report=table)
    assert c.ran() == ["t-count-b ranks=1"]
    run1_, run2 = c.runs()
    stored2, warnings = read_file(run2)
    assert run1_ == run1 and warnings == [] and len(stored2) == 4
    by_key = {r.key: r for r in stored1}
    for r in stored2:
        old = by_key[r.key]
        if r.probe_id == "t-count-a":  # carried: the same verdict, code and start, recorded in the new run
            assert (r.run_id, r.verdict.status, r.code, r.started_at) == (run2.stem, old.verdict.status, old.code,
                                                                          old.started_at)
            assert r.verdict.evidence["reused_from"] == run_id
        else:
            assert r.run_id == run2.stem and "reused_from" not in r.verdict.evidence
    manifest = json.loads(run2.with_name(run2.stem + ".manifest.json").read_text())
    assert manifest["level"] == "full"
    [cell] = manifest["cells"].values()
    assert cell["fingerprint"].startswith("local ")

    # the table lists both runs and shows the carried verdicts as reused
    md = table.with_name("table-archive.md").read_text()  # a local environment's cell: on the archive page
    assert run_id in md and run2.stem in md
    assert "✅2 *(reused)*" in md and "*reused*: carried from\nthe earlier run that measured it" in md


HOST_STATE = '''"""Reads a host fact no input captures (the file STACKPROBE_TEST_HOST_STATE names), taking a
different time on every run."""

import os
import random
import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-host-state", title="host state", feature="incremental runs", ranks=(1,), needs_gpu=False,
                 timeout_s=60, reusable=False)


def run(ctx: RankContext) -> dict:
    with open(os.environ["STACKPROBE_TEST_COUNT"], "a") as f:
        f.write("t-host-state " + ctx.variant.key + "\\n")
    time.sleep(0.05 + random.random() / 10)
    with open(os.environ["STACKPROBE_TEST_HOST_STATE"]) as f:
        fact = f.read().strip()
    return outcome("pass", note="the host reads " + fact, evidence={"fact": fact})
'''


def test_a_warm_run_that_reads_the_same_host_facts_records_nothing(tmp_path: Path) -> None:
    """A probe that reads host state (not reusable, as host-p2p) runs again on every `checks run`; when it
    reads what this host's latest record holds, the run learns nothing: one pass (no quick pass first), no run
    recorded, the table and its page byte for byte as they were. A changed fact is recorded."""
    c = Checkout(tmp_path)
    (c.probes / "t_host_state.py").write_text(HOST_STATE)
    state = tmp_path / "host-state"
    state.write_text("IOMMU off\n")
    env = {**c.env, "STACKPROBE_TEST_HOST_STATE": str(state)}
    table = tmp_path / "table.md"
    c.run("--staged", env=env, report=table)
    assert "t-host-state ranks=1" in c.ran()
    runs = c.runs()
    written = {p: p.read_bytes() for p in (table, table.with_suffix(".html"))}

    again = c.run("--staged", env=env, report=table)
    assert c.ran() == ["t-host-state ranks=1"]  # read again, once: the full pass alone
    assert ("level: full only: every variant is unchanged since its last run (1 variant(s) read this host's "
            "state again), so one pass answers") in again.stderr
    assert "first answer" not in again.stderr
    assert "results: nothing new, so no run recorded" in again.stderr
    assert c.runs() == runs
    assert {p: p.read_bytes() for p in written} == written

    state.write_text("IOMMU translated\n")
    changed = c.run("--staged", env=env, report=table)
    assert c.ran() == ["t-host-state ranks=1"]
    assert "results: nothing new" not in changed.stderr
    [new] = sorted(set(c.runs()) - set(runs))
    [fresh] = [r for r in read_file(new)[0] if r.probe_id == "t-host-state"]
    assert fresh.verdict.note == "the host reads IOMMU translated" and "reused_from" not in fresh.verdict.evidence
    assert new.stem in table.read_text()  # the table lists the run that recorded the change


def test_the_real_host_p2p_facts_rerun_on_this_host_record_nothing(tmp_path: Path) -> None:
    """host-p2p itself (its facts variant reads this machine's PCI bridges and IOMMU; the pair variants skip
    without GPUs) through `checks run --backend local`, twice: the second run reads the same facts and writes
    no run."""
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "checks.cli", "run", "--backend", "local", "--probe", "host-p2p", "--results",
           str(results), "--no-report"]
    env = {k: v for k, v in os.environ.items() if k != "STACKPROBE_PROBE_PATH"}
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    runs = sorted(results.glob("*/*"))
    assert runs
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "level: full only" in again.stderr and "results: nothing new, so no run recorded" in again.stderr
    assert sorted(results.glob("*/*")) == runs


def test_a_changed_probe_a_changed_environment_and_fresh_rerun(tmp_path: Path) -> None:
    c = Checkout(tmp_path)
    c.run()
    assert c.ran() == ALL
    # the probe's source changed: its variants run again, the other probe's are reused
    (c.probes / "t_count_b.py").write_text((c.probes / "t_count_b.py").read_text() + "# edited\n")
    p = c.run()
    assert c.ran() == ["t-count-b ranks=1"] and "reused 2 unchanged" in p.stderr
    # a variable that shapes the run in the environment the ranks inherit: everything runs again
    c.run(env={**c.env, "NCCL_ALGO": "Tree"})
    assert c.ran() == ALL
    # --fresh runs everything although nothing changed
    p = c.run("--fresh", env={**c.env, "NCCL_ALGO": "Tree"})
    assert c.ran() == ALL and "unchanged" not in p.stderr


def test_results_of_a_dirty_checkout_and_hangs_are_never_reused(tmp_path: Path) -> None:
    c = Checkout(tmp_path, hangs=True)
    first = json.loads(c.run().stdout)
    assert {r["probe_id"]: r["status"] for r in first}["t-hangs-once"] == "hang"
    assert c.ran() == [*ALL[:2], "t-count-b ranks=1", "t-hangs-once ranks=1"]
    # the hang runs again (and passes now); the passes are reused
    second = json.loads(c.run().stdout)
    assert c.ran() == ["t-hangs-once ranks=1"]
    assert {r["probe_id"]: r["status"] for r in second}["t-hangs-once"] == "pass"

    # an edit under checks/ makes the checkout dirty: what it makes is never reused
    status = c.root / "inenv" / "status.py"
    status.write_text(status.read_text() + "# an edit in progress\n")
    made = json.loads(c.run("--fresh").stdout)
    assert {r["code"]["dirty"] for r in made} == {True} and len(c.ran()) == 4
    subprocess.run(["git", "-C", str(c.root), "checkout", "--", "inenv/status.py"], check=True)
    again = json.loads(c.run().stdout)
    assert len(c.ran()) == 4 and not any("reused_from" in r["evidence"] for r in again)
    assert {r["code"]["dirty"] for r in again} == {False}


# --- the pure rules -------------------------------------------------------------------------------------------
SPEC = ProbeSpec(id="p", title="p", feature="f", needs_gpu=False)
CELL = CellTarget("cu130-x", "resolved", image="img", image_status="built")
INPUTS = incremental.Inputs("image sha256:1", "h1")


def result(status: Status = Status.PASS, reason: str = "", dirty: bool | None = False, probe_hash: str = "abc",
           inputs: incremental.Inputs | None = INPUTS, level: str = FULL) -> ProbeResult:
    v = incremental.stamped(Verdict(status, reason), inputs, level == QUICK)
    return ProbeResult("run1", "host", CELL.cell_id, "p", "ranks=1", v, "2026-01-01T00:00:00Z",
                       Provenance("0.1.0", "c0ffee", dirty, probe_hash))


@pytest.mark.parametrize(("r", "inputs", "level", "why"), [
    (result(), INPUTS, FULL, ""),
    (result(Status.FAIL, "fi-arch-gate"), INPUTS, FULL, ""),
    (result(Status.SKIP, "missing-package"), INPUTS, FULL, ""),
    (result(Status.HANG, "hang"), INPUTS, FULL, "is not one a rerun repeats"),
    (result(Status.CRASH, "signal"), INPUTS, FULL, "is not one a rerun repeats"),
    (result(Status.NOT_RUN, "jit-build-timeout"), INPUTS, FULL, "is not one a rerun repeats"),
    (result(Status.FAIL, "no-result"), INPUTS, FULL, "the harness's failure"),
    (result(Status.FAIL, "nonzero-exit"), INPUTS, FULL, "the harness's failure"),
    (result(Status.NOT_RUN, "container-lost"), INPUTS, FULL, "the harness's failure"),
    (result(Status.NOT_RUN, "harness-error"), INPUTS, FULL, "the harness's failure"),
    (result(Status.NOT_RUN, "docker-daemon-error"), INPUTS, FULL, "the harness's failure"),
    (result(dirty=True), INPUTS, FULL, "differed from its commit"),
    (result(dirty=None), INPUTS, FULL, "differed from its commit"),
    (result(probe_hash="old"), INPUTS, FULL, "the probe's source changed"),
    (result(), None, FULL, "has no fingerprint"),
    (result(), incremental.Inputs("image sha256:2", "h1"), FULL, "environment or the host facts changed"),
    (result(), incremental.Inputs("image sha256:1", "h2"), FULL, "environment or the host facts changed"),
    (result(inputs=None), INPUTS, FULL, "environment or the host facts changed"),
    (result(level=QUICK), INPUTS, FULL, "made by a quick run"),
    (result(level=QUICK), INPUTS, QUICK, ""),
    (result(), INPUTS, QUICK, ""),  # a full result answers a quick run too
])
def test_which_results_a_run_carries(r: ProbeResult, inputs: incremental.Inputs | None, level: str,
                                     why: str) -> None:
    got = incremental.why_not(r, inputs, "abc", level)
    assert (why in got and got) if why else got == ""


@pytest.mark.parametrize("code", ["container-lost", "docker-daemon-error", "harness-error", "no-result"])
def test_the_harnesss_failure_is_rerun_even_by_the_full_pass_of_the_same_command(code: str) -> None:
    """An earlier pass of this very command carries whatever it recorded, but not the harness's own failures."""
    got = incremental.why_not(result(Status.NOT_RUN, code), INPUTS, "abc", FULL, same_command=True)
    assert "the harness's failure" in got
    assert incremental.why_not(result(Status.HANG, "hang"), INPUTS, "abc", FULL, same_command=True) == ""


def test_host_facts_that_count_for_gpu_and_compile_probes() -> None:
    facts = {"gpus": [{"name": "NVIDIA H200"}], "gpu_count": 1, "driver": "580.1", "compute_capability": "9.0"}
    base = incremental.host_inputs(True, facts, ("12.0a",))
    assert incremental.host_inputs(True, facts, ("12.0a", "12.0f")) == base  # GPU probes build no targets
    assert incremental.host_inputs(True, {**facts, "driver": "580.2"}, ("12.0a",)) != base
    assert incremental.host_inputs(True, {**facts, "gpu_count": 2}, ("12.0a",)) != base
    cpu = incremental.host_inputs(False, facts, ("12.0a",))
    assert incremental.host_inputs(False, facts, ("12.0a", "12.0f")) != cpu  # compile probes do


def test_decide_and_carry() -> None:
    item = WorkItem(CELL, SPEC, Variant("p"), 60.0)
    [decided] = incremental.decide([item], {item.key: result()}, {item.key: INPUTS}, {"p": "abc"}, FULL)
    assert decided.reused is not None and not decided.runs
    copy = incremental.carried(decided.reused, "run2")
    assert copy.run_id == "run2" and copy.verdict.evidence["reused_from"] == "run1"
    assert incremental.carried(copy, "run3").verdict.evidence["reused_from"] == "run1"  # the measuring run
    [kept] = incremental.decide([item], {item.key: result()}, {item.key: INPUTS}, {"p": "new"}, FULL)
    assert kept.reused is None and kept.runs
    assert incremental.reused_line([decided, kept]) == "1 unchanged, reused from run run1; --fresh reruns them"


def test_a_probe_that_reads_host_state_is_never_carried_forward() -> None:
    """host-p2p reads a bridge's ACS bits and the IOMMU mode, which a host fix changes with nothing else: its
    results record no inputs, so no later run reuses one; a probe of the stack records them."""
    from checks.run.plan import CellTarget, WorkItem
    from inenv.probe import ProbeSpec, Variant
    from inenv.probes.host_p2p import SPEC as P2P

    cell = CellTarget("cella", "resolved")
    facts = {"gpu_count": 1, "gpus": [{"name": "NVIDIA H200"}], "driver": "580", "compute_capability": "9.0"}
    host_item = WorkItem(cell, P2P, Variant("host-p2p", 1, (("check", "facts"),)), 60.0)
    stack_item = WorkItem(cell, ProbeSpec("nccl-graphs", "t", "f"), Variant("nccl-graphs", 2), 60.0)
    assert incremental.inputs_for(host_item, EnvPrint("venv abc"), facts, ()) is None
    assert incremental.inputs_for(stack_item, EnvPrint("venv abc"), facts, ()) is not None


def test_a_variant_counts_the_environment_less_the_kernel_set_and_the_modules_it_loads() -> None:
    """The set gains and changes modules (the kernel stage after the quick pass): a variant that loads none of
    them keeps the environment it had, one that loads a module sees that module's digest, or "none"."""
    spec = ProbeSpec("t-loads", "t", "f", loads=(("mode", "with", ("vllm_comm",)),))
    cell = CellTarget("cella", "resolved")
    loads = WorkItem(cell, spec, Variant("t-loads", 1, (("mode", "with"),)), 60.0)
    plain = WorkItem(cell, spec, Variant("t-loads", 1, (("mode", "without"),)), 60.0)
    facts = {"gpu_count": 0}

    def env(item: WorkItem, kernels: dict[str, str]) -> str:
        got = incremental.inputs_for(item, env_print("image sha256:ab", kernels), facts, ())
        assert got is not None
        return got.env

    assert env(plain, {}) == env(plain, {"vllm_comm": "1111", "moe_a2a": "2222"}) == "image sha256:ab"
    assert env(loads, {}) == "image sha256:ab kernels vllm_comm=none"
    assert env(loads, {"vllm_comm": "1111", "moe_a2a": "2222"}) == "image sha256:ab kernels vllm_comm=1111"
    assert env(loads, {"vllm_comm": "3333"}) == "image sha256:ab kernels vllm_comm=3333"
    # what an environment reports is read defensively: a digest that is not text is no digest
    assert env_print("b", {"vllm_comm": 7, 3: "x", "moe_a2a": "2222"}) == EnvPrint("b", (("moe_a2a", "2222"),))
    assert env_print("b", ["vllm_comm"]) == EnvPrint("b")


LOADING = '''"""Passes, and appends its variant to STACKPROBE_TEST_COUNT; its mode=with variant loads vllm_comm."""

import os

from inenv.probe import ProbeSpec, RankContext, Variant, outcome

SPEC = ProbeSpec(id="t-loads", title="t-loads", feature="incremental runs", ranks=(1,), needs_gpu=False,
                 timeout_s=60, loads=(("mode", "with", ("vllm_comm",)),))


def variants(host):
    return [Variant("t-loads", 1, (("mode", m),)) for m in ("with", "without")]


def run(ctx: RankContext) -> dict:
    with open(os.environ["STACKPROBE_TEST_COUNT"], "a") as f:
        f.write("t-loads " + ctx.variant.key + "\\n")
    return outcome("pass")
'''


def test_a_changed_kernel_set_reruns_only_the_variants_that_load_the_changed_module(tmp_path: Path) -> None:
    """A local environment whose flashinfer carries vllm_comm in its AOT folder (a stand-in package beside a
    real shared object with the module's entry points): a new library, or the module removed, reruns the variant
    that loads it and reuses the one that does not; the manifest names the module's digest."""
    from tests.test_carried import module_library

    c = Checkout(tmp_path)
    (c.probes / "t_loads.py").write_text(LOADING)
    site = tmp_path / "site"
    aot = site / "flashinfer" / "data" / "aot" / "vllm_comm"
    aot.mkdir(parents=True)
    (site / "flashinfer" / "__init__.py").write_text("")
    record = {"schema": 1, "module": "vllm_comm", "name": "vllm_comm", "sass": ["sm_90a"], "arch_list": "9.0a"}
    (aot / "stackprobe-kernel.json").write_text(json.dumps(record))
    (aot / "vllm_comm.so").write_bytes(module_library("vllm_comm", "first"))
    c.env["PYTHONPATH"] = f"{c.root}{os.pathsep}{site}"
    loads = ["t-loads ranks=1,mode=with", "t-loads ranks=1,mode=without"]

    c.run()
    assert c.ran() == [*ALL, *loads]
    c.run()
    assert c.ran() == []
    [run1] = c.runs()
    [cell] = json.loads(run1.with_name(run1.stem + ".manifest.json").read_text())["cells"].values()
    by_hand = hashlib.sha256(json.dumps(record, sort_keys=True).encode() + b"\0"
                             + (aot / "vllm_comm.so").read_bytes()).hexdigest()[:16]
    assert cell["kernels"] == {"vllm_comm": by_hand} and cell["fingerprint"].startswith("local ")

    (aot / "vllm_comm.so").write_bytes(module_library("vllm_comm", "second"))  # rebuilt: another library
    c.run()
    assert c.ran() == ["t-loads ranks=1,mode=with"]
    for name in ("vllm_comm.so", "stackprobe-kernel.json"):  # the set without the module
        (aot / name).unlink()
    c.run()
    assert c.ran() == ["t-loads ranks=1,mode=with"]
