"""`checks run --jobs N`: CPU-only variants of different cells side by side, a GPU variant alone, Ctrl-C ends
them all. Real worker processes run stand-in probes that record, from inside their ranks, when they ran and
which other variants' processes were alive at that moment."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from checks.results.provenance import checkout, probe_hashes
from checks.results.result import ProbeResult, Verdict
from checks.results.store import RunStore, read_file
from checks.run import placement, runprogress
from checks.run.container import DockerExecutor
from checks.run.executor import LocalExecutor
from checks.run.options import RunOptions
from checks.run.plan import CellTarget, WorkItem, plan_work
from checks.run.runner import Work, execute, pick
from common import reasons
from inenv.probe import HostView, ProbeSpec, Variant
from inenv.registry import discover
from tests.checks_helpers import ROOT, TOKEN_VAR, fixture_env, pids_with_env

# Processes of other variants of this test: they carry the test's token, and another variant's isolation token.
OTHERS = '''
def others() -> int:
    """Live processes of this test that belong to another variant than this one."""
    mine = os.environ["STACKPROBE_RUN_TOKEN"]
    test = ("STACKPROBE_TEST_TOKEN=" + os.environ["STACKPROBE_TEST_TOKEN"]).encode()
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\\0")
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1].startswith("Z"):
                    continue
        except OSError:
            continue
        if test in env and ("STACKPROBE_RUN_TOKEN=" + mine).encode() not in env:
            n += 1
    return n
'''

SLOW_CPU = '''"""CPU-only: sleeps, and says when it ran and how many other variants' processes it saw meanwhile."""

import os
import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-par-slow", title="slow", feature="parallel jobs", ranks=(1,), needs_gpu=False,
                 timeout_s=@TIMEOUT@)
''' + OTHERS + '''

def run(ctx: RankContext) -> dict:
    t0 = time.time()
    time.sleep(@SLEEP@ / 2)
    seen = others()
    time.sleep(@SLEEP@ / 2)
    return outcome("pass", metrics={"t0": t0, "t1": time.time(), "others": seen})
'''

GPU = '''"""Needs the GPU (planned to run even on a host without one: the test tells the worker there is one); says
when it ran and how many other variants' processes were alive when it started and when it ended."""

import os
import time

from inenv.probe import HostView, ProbeSpec, RankContext, Variant, outcome

SPEC = ProbeSpec(id="t-par-gpu", title="gpu", feature="parallel jobs", ranks=(1,), needs_gpu=True, timeout_s=60)
''' + OTHERS + '''

def variants(host: HostView) -> list[Variant]:
    return [Variant(SPEC.id, 1)]


def run(ctx: RankContext) -> dict:
    t0, first = time.time(), others()
    time.sleep(1.0)
    last = others()
    return outcome("pass", metrics={"t0": t0, "t1": time.time(), "others": first + last})
'''


def write_probes(folder: Path, sleep: float = 3.0, timeout: float = 60) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "t_par_slow.py").write_text(SLOW_CPU.replace("@SLEEP@", str(sleep)).replace("@TIMEOUT@", str(timeout)))
    (folder / "t_par_gpu.py").write_text(GPU)
    return folder


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["t0"] < b["t1"] and b["t0"] < a["t1"]


def run_two_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: int,
                  alongside: tuple[str, ...] = ()) -> list[ProbeResult]:
    probes_dir = write_probes(tmp_path / "probes")
    env = fixture_env(STACKPROBE_PROBE_PATH=str(probes_dir))
    for name in ("STACKPROBE_PROBE_PATH", TOKEN_VAR, "PYTHONPATH"):
        monkeypatch.setenv(name, env[name])
    probes = {pid: mod for pid, (_, mod) in discover({"STACKPROBE_PROBE_PATH": str(probes_dir)}).items()
              if pid.startswith("t-par-")}
    cells = [CellTarget(f"cu130-torchcell{i}-sgl1-fi1", "resolved", image_status="built") for i in (1, 2)]
    items = plan_work(cells, probes, HostView(gpu_count=1))
    # in each cell the CPU-only probe comes first, whatever its id: the GPU variants then run back to back
    assert [(it.cell.cell_id, it.spec.id) for it in items] == [
        ("cu130-torchcell1-sgl1-fi1", "t-par-slow"), ("cu130-torchcell1-sgl1-fi1", "t-par-gpu"),
        ("cu130-torchcell2-sgl1-fi1", "t-par-slow"), ("cu130-torchcell2-sgl1-fi1", "t-par-gpu")]
    executors = {c.cell_id: LocalExecutor(sys.executable) for c in cells}
    store = RunStore(tmp_path / "results", "cpu-0123abcd", "20261201T000000Z-0001")
    codes = {pid: checkout().for_probe(h) for pid, h in probe_hashes(probes).items()}
    work = Work(items, store, reasons.default(), 1, codes, executors=executors,  # the worker is told: 1 GPU
                alongside=alongside)
    report = execute(RunOptions(jobs=jobs), work)
    assert not report.interrupted and {r.verdict.status for r in report.results} == {"pass"}
    stored, warnings = read_file(store.results_path)
    assert warnings == [] and len(stored) == 4  # each appended whole as it finished
    assert pids_with_env(env[TOKEN_VAR]) == []
    return stored


def test_two_slow_cpu_variants_of_two_cells_run_at_once_and_a_gpu_variant_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stored = run_two_cells(tmp_path, monkeypatch, jobs=2)
    slow = [dict(r.verdict.metrics) for r in stored if r.probe_id == "t-par-slow"]
    gpu = [dict(r.verdict.metrics) for r in stored if r.probe_id == "t-par-gpu"]
    assert overlap(slow[0], slow[1])  # ran side by side: together they took less than one after the other
    assert max(s["t1"] for s in slow) - min(s["t0"] for s in slow) < sum(s["t1"] - s["t0"] for s in slow)
    assert all(s["others"] >= 2 for s in slow)  # mid-sleep, the other variant's worker and rank were alive
    for g in gpu:  # a GPU variant overlapped nothing, and no other variant's process lived while it ran
        assert not any(overlap(g, o) for o in slow + [x for x in gpu if x is not g])
        assert g["others"] == 0


def test_what_runs_beside_the_whole_run_is_named_in_each_gpu_variants_evidence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stored = run_two_cells(tmp_path, monkeypatch, jobs=2, alongside=("the kernel stage",))
    beside = {(r.cell_id, r.probe_id): r.verdict.evidence.get("ran_beside") for r in stored}
    assert beside == {("cu130-torchcell1-sgl1-fi1", "t-par-slow"): None,
                      ("cu130-torchcell2-sgl1-fi1", "t-par-slow"): None,
                      ("cu130-torchcell1-sgl1-fi1", "t-par-gpu"): ["the kernel stage"],
                      ("cu130-torchcell2-sgl1-fi1", "t-par-gpu"): ["the kernel stage"]}


def test_one_job_runs_the_plan_in_order_one_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stored = run_two_cells(tmp_path, monkeypatch, jobs=1)
    assert [(r.cell_id, r.probe_id) for r in stored] == [
        ("cu130-torchcell1-sgl1-fi1", "t-par-slow"), ("cu130-torchcell1-sgl1-fi1", "t-par-gpu"),
        ("cu130-torchcell2-sgl1-fi1", "t-par-slow"), ("cu130-torchcell2-sgl1-fi1", "t-par-gpu")]
    spans = [dict(r.verdict.metrics) for r in stored]
    assert all(a["t1"] <= b["t0"] for a, b in zip(spans, spans[1:], strict=False))
    assert all(s["others"] == 0 for s in spans)


def test_pick_rules() -> None:
    """One variant per cell, plan order within a cell, CPU-only ones up to the job count, a GPU one alone."""
    cpu, gpu = ProbeSpec("c", "c", "f", needs_gpu=False), ProbeSpec("g", "g", "f", needs_gpu=True)
    a, b, c = (CellTarget(f"cell{i}", "resolved") for i in "abc")

    def item(cell: CellTarget, spec: ProbeSpec, n: int = 1) -> WorkItem:
        return WorkItem(cell, spec, Variant(spec.id, n), 60.0)

    a_gpu, a_cpu, a_cpu2, b_cpu, c_cpu = item(a, gpu), item(a, cpu), item(a, cpu, 2), item(b, cpu), item(c, cpu)
    pending = [a_gpu, a_cpu, a_cpu2, b_cpu, c_cpu]
    assert pick(pending, [], 2) is a_gpu  # nothing runs: plan order
    assert pick(pending, [a_gpu], 4) is None  # nothing beside a GPU variant
    assert pick(pending, [b_cpu], 2) is a_cpu  # the GPU variant waits; the cell's first CPU one goes
    assert pick(pending[1:], [a_cpu], 3) is b_cpu  # one per cell: a's second waits for its first
    assert pick(pending[1:], [a_cpu, b_cpu], 2) is None  # the job count
    assert pick(pending, [a_cpu], 1) is None


def test_a_gpu_variant_that_loads_no_jit_module_starts_beside_compiles() -> None:
    """NCCL's allreduce needs nothing fi-jit builds: it starts while a cell compiles; a variant that loads a
    flashinfer module (ar-latency's flashinfer-custom-ar loads vllm_comm) waits for the host to be idle, and
    no GPU variant starts beside a CPU variant that is not a compile."""
    build = ProbeSpec("fi-jit", "b", "f", needs_gpu=False, build_param="module")
    plain = ProbeSpec("c", "c", "f", needs_gpu=False)
    gpu = ProbeSpec("ar-latency", "g", "f", needs_gpu=True)
    a, b = CellTarget("cella", "resolved"), CellTarget("cellb", "resolved")
    compiling = WorkItem(a, build, Variant("fi-jit", 1, (("module", "trtllm_comm"), ("arch", "12.0a"))), 60.0)
    nccl = WorkItem(b, gpu, Variant("ar-latency", 2, (("backend", "nccl"),)), 60.0)
    custom = WorkItem(b, gpu, Variant("ar-latency", 2, (("backend", "flashinfer-custom-ar"),)), 60.0)
    other = WorkItem(a, plain, Variant("c", 1), 60.0)
    assert pick([nccl], [compiling], 4) is nccl
    assert pick([custom], [compiling], 4) is None
    assert pick([nccl], [other], 4) is None
    assert pick([nccl], [compiling, other], 4) is None


def test_a_gpu_variant_that_times_nothing_starts_beside_cpu_work_but_not_beside_its_own_module_build() -> None:
    """Ranks sharing a GPU check exact numbers and time nothing: such a variant starts beside inventory and
    beside a compile of another module, but not beside the build of the module it loads; a timed GPU variant
    still waits for the host to be idle."""
    build = ProbeSpec("fi-jit", "b", "f", needs_gpu=False, build_param="module")
    plain = ProbeSpec("inventory", "c", "f", needs_gpu=False)
    gpu = ProbeSpec("custom-ar", "g", "f", needs_gpu=True, distinct_gpus=False)
    a, b = CellTarget("cella", "resolved"), CellTarget("cellb", "resolved")
    inventory = WorkItem(a, plain, Variant("inventory", 1), 60.0)
    trt = WorkItem(a, build, Variant("fi-jit", 1, (("module", "trtllm_comm"), ("arch", "local"))), 60.0)
    vllm = WorkItem(a, build, Variant("fi-jit", 1, (("module", "vllm_comm"), ("arch", "local"))), 60.0)
    params = (("impl", "flashinfer"), ("full_nvlink", "forced"))
    shared = WorkItem(b, gpu, Variant("custom-ar", 2, params, share_gpu=True, gpus=1), 60.0)
    timed = WorkItem(b, gpu, Variant("custom-ar", 2, params), 60.0)
    assert pick([shared], [inventory], 4) is shared
    assert pick([shared], [inventory, trt], 4) is shared  # custom-ar loads vllm_comm, not trtllm_comm
    assert pick([shared], [vllm], 4) is None  # the module it loads is being built
    assert pick([timed], [inventory], 4) is None
    assert pick([shared], [inventory], 4, share=False) is None  # --gpu-alone: it waits as a timed one does
    eight = WorkItem(b, gpu, Variant("custom-ar", 8, params, share_gpu=True, gpus=1), 60.0)
    other = WorkItem(a, gpu, Variant("custom-ar", 8, params, share_gpu=True, gpus=1), 60.0)
    assert pick([other], [eight], 4, ahead=2, rank_cap=16) is other  # 16 rank processes: within the cores
    assert pick([other], [eight, shared], 4, ahead=2, rank_cap=16) is None  # 18 would pass them
    assert pick([other], [eight, shared], 4, ahead=2) is other  # no cap
    # variants that time nothing go side by side past the gate's depth, within the cap; a timed one does not
    twos = [WorkItem(b, gpu, Variant("custom-ar", 2, params + (("n", str(i)),), share_gpu=True, gpus=1), 60.0)
            for i in range(5)]
    assert pick([other], twos[:4], 4, ahead=2, rank_cap=16) is other  # 8 ranks running + its 8
    assert pick([other], twos, 4, ahead=2, rank_cap=16) is None  # 10 running + its 8 would pass 16
    assert pick([timed], twos[:3], 4, ahead=2, rank_cap=16) is None  # the gate's depth is full for a timed one
    assert pick([shared], twos[:3], 4, ahead=2, rank_cap=16, share=False) is None  # --gpu-alone
    assert pick([shared], [timed, *twos[:2]], 4, ahead=2, rank_cap=16) is None  # a timed one holds the GPUs


def test_two_cells_do_not_build_what_they_could_share_side_by_side() -> None:
    """fi-jit's module names a build another cell may share: while cell a builds trtllm_comm, cell b builds
    another module first if it can (its trtllm_comm then finds a's build stored), and its trtllm_comm goes
    only when nothing else can start."""
    jit = ProbeSpec("j", "j", "f", needs_gpu=False, build_param="module")
    a, b, c = (CellTarget(f"cell{i}", "resolved") for i in "abc")

    def item(cell: CellTarget, module: str) -> WorkItem:
        return WorkItem(cell, jit, Variant(jit.id, 1, (("module", module), ("arch", "12.0a"))), 60.0)

    a_trt, b_trt, b_moe, c_trt, c_moe = (item(a, "trtllm_comm"), item(b, "trtllm_comm"), item(b, "moe_a2a"),
                                         item(c, "trtllm_comm"), item(c, "moe_a2a"))
    assert pick([b_trt, b_moe, c_moe], [a_trt], 2) is b_moe  # b's trtllm would share a's build; its moe does not
    assert pick([b_trt, c_moe], [a_trt, b_moe], 3) is b_trt  # c's moe would share b's: b's trtllm waits for a's
    assert pick([b_trt], [a_trt], 2) is b_trt  # nothing else can start: it goes, and waits for a's
    assert pick([b_moe, b_trt], [a_trt], 2) is b_moe
    assert pick([b_trt, c_trt, c_moe], [a_trt], 3) is c_moe  # c's moe builds beside c's trtllm: another module
    plain = ProbeSpec("c", "c", "f", needs_gpu=False)  # no build_param: plan order, as before
    b_plain = WorkItem(b, plain, Variant("c", 1, (("module", "trtllm_comm"),)), 60.0)
    assert pick([b_plain, c_moe], [a_trt], 2) is b_plain


def test_cells_of_other_library_versions_build_the_same_module_side_by_side() -> None:
    """A build is shared only by cells with the same CUDA and the same versions of what the probe requires;
    another flashinfer release builds other sources, so its trtllm_comm starts beside the running one."""
    jit = ProbeSpec("j", "j", "f", needs_gpu=False, build_param="module", requires=("flashinfer",))

    def item(cell_id: str, fi: str, cuda: str = "cu130", module: str = "trtllm_comm") -> WorkItem:
        cell = CellTarget(cell_id, "resolved", versions={"flashinfer": fi, "torch_cuda": cuda, "torch": cell_id})
        return WorkItem(cell, jit, Variant(jit.id, 1, (("module", module), ("arch", "12.0a"))), 60.0)

    running = item("a", "0.6.17")
    same, other_fi, other_cuda = item("b", "0.6.17"), item("c", "0.7.2"), item("d", "0.6.17", "cu128")
    later = item("e", "0.6.17", module="moe_a2a")
    assert pick([same, other_fi], [running], 2) is other_fi
    assert pick([same, other_cuda], [running], 2) is other_cuda
    assert pick([same, later], [running], 2) is later  # b's would share a's build: it waits while e can start
    assert pick([same], [running], 2) is same


def test_the_longest_expected_build_among_the_cells_ready_starts_first() -> None:
    """Each cell's next variant in plan order may start; of those the CPU-only one expected to take longest
    goes first (declared build times when nothing was timed, an earlier run's time over them), ties in plan
    order, and a GPU variant first in plan order still goes first."""
    jit = ProbeSpec("j", "j", "f", needs_gpu=False, build_param="module")
    costs = {"j": {"big": 900.0, "mid": 300.0, "small": 10.0}}
    gpu = ProbeSpec("g", "g", "f", needs_gpu=True)
    a, b, c, d = (CellTarget(f"cell{i}", "resolved") for i in "abcd")

    def item(cell: CellTarget, module: str) -> WorkItem:
        return WorkItem(cell, jit, Variant(jit.id, 1, (("module", module), ("arch", "12.0a"))), 60.0)

    pending = [item(a, "small"), item(a, "big"), item(b, "mid"), item(c, "big"), item(d, "big")]
    a_small, _, b_mid, c_big, d_big = pending
    declared = runprogress.start_costs(pending, {}, costs)
    assert [declared[it.key] for it in pending] == [10.0, 900.0, 300.0, 900.0, 900.0]
    a_big = pending[1]
    assert pick(pending, [], 2, cost=lambda it: declared[it.key]) is a_big  # beside a's small: another module
    assert pick(pending, [c_big], 2, cost=lambda it: declared[it.key]) is b_mid  # a's and d's big would share c's
    assert pick(pending[2:], [b_mid], 2, cost=lambda it: declared[it.key]) is c_big
    assert pick([a_small, b_mid], [], 2, cost=lambda it: declared[it.key]) is b_mid
    assert pick(pending, [], 2) is a_small  # no costs: plan order
    learnt = runprogress.start_costs(pending, {c_big.key: runprogress.Expected(5.0, True),
                                               d_big.key: runprogress.Expected(None)}, costs)
    assert learnt[c_big.key] == 5.0 and learnt[d_big.key] == 900.0  # an earlier run's time wins; none: declared
    assert pick([b_mid, c_big], [], 2, cost=lambda it: learnt[it.key]) is b_mid
    on_gpu = WorkItem(d, gpu, Variant(gpu.id, 1), 60.0)
    assert pick([on_gpu, c_big], [], 2, cost=lambda it: declared[it.key] if it is c_big else 0.0) is on_gpu
    assert pick([c_big, on_gpu], [], 2, cost=lambda it: declared[it.key] if it is c_big else 0.0) is c_big


def test_a_cells_builds_of_different_modules_and_its_inventory_run_side_by_side() -> None:
    """A cell's builds of different modules are independent, and so is a variant that builds nothing: its
    biggest build starts beside its own running one, while the same module's next target keeps its plan order
    behind the first, and the cell's variants that build nothing keep theirs among themselves."""
    jit = ProbeSpec("j", "j", "f", needs_gpu=False, build_param="module")
    plain = ProbeSpec("p", "p", "f", needs_gpu=False)
    a, b = CellTarget("cella", "resolved"), CellTarget("cellb", "resolved")
    cost = {"trtllm_comm": 950.0, "moe_a2a": 340.0, "vllm_comm": 14.0}

    def item(cell: CellTarget, module: str, arch: str = "12.0a") -> WorkItem:
        return WorkItem(cell, jit, Variant(jit.id, 1, (("module", module), ("arch", arch))), 60.0)

    def by_cost(it: WorkItem) -> float:
        return cost.get(it.variant.param("module") or "", 0.0)

    vllm_a, vllm_f, trt_a, trt_f, moe_a = (item(a, "vllm_comm"), item(a, "vllm_comm", "12.0f"),
                                           item(a, "trtllm_comm"), item(a, "trtllm_comm", "12.0f"), item(a, "moe_a2a"))
    pending = [vllm_f, trt_a, trt_f, moe_a]
    assert pick(pending, [vllm_a], 2, cost=by_cost) is trt_a  # beside its own vllm_comm build
    assert pick([vllm_f], [vllm_a], 2, cost=by_cost) is None  # one build's targets in plan order
    assert pick([trt_f, moe_a], [trt_a], 2, cost=by_cost) is moe_a  # trtllm's 12.0f waits for 12.0a
    assert pick(pending, [vllm_a, trt_a], 2, cost=by_cost) is None  # the job count
    inventory, other = WorkItem(a, plain, Variant(plain.id, 1), 60.0), WorkItem(a, plain, Variant(plain.id, 2), 60.0)
    assert pick([inventory, moe_a], [trt_a], 3, cost=by_cost) is moe_a  # the costlier of the two that may start
    assert pick([inventory], [trt_a, moe_a], 3, cost=by_cost) is inventory  # beside the cell's builds
    assert pick([other, vllm_f], [inventory], 3, cost=by_cost) is vllm_f  # its next non-build waits for it
    b_trt = item(b, "trtllm_comm")
    assert pick([b_trt, moe_a], [trt_a], 3, cost=by_cost) is moe_a  # b's would share a's build


def test_store_appends_from_many_threads_keep_every_whole_line(tmp_path: Path) -> None:
    """The runner appends from its main thread; the store itself is safe from threads too (each append opens
    the file anew and holds its own flock), so nothing is lost or torn if a caller appends concurrently."""
    import threading

    from checks.results.result import Verdict
    from inenv.status import Status

    store = RunStore(tmp_path, "cpu-0123abcd", "20261201T000000Z-0001")
    code = checkout().for_probe("0" * 16)

    def writer(t: int) -> None:
        for i in range(15):
            r = ProbeResult(store.run_id, store.host_id, f"cu130-torch{t}-sgl1-fi1", "p", f"ranks={i}",
                            Verdict(Status.PASS, note="x" * 2000),
                            "2026-01-01T00:00:00Z", code)
            store.append_all([r]) if i % 2 else store.append(r)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stored, warnings = read_file(store.results_path)
    assert warnings == [] and len(stored) == 6 * 15 and len({r.key for r in stored}) == 6 * 15


MATRIX = 'matrix:\n  cuda: ["13.0"]\n  torch: ["2.11.0"]\n  sgl_kernel: [none]\n  flashinfer: ["0.6.17", "0.6.18"]\n'
CELLS = ("cu130-torch2.11.0-sglnone-fi0.6.17", "cu130-torch2.11.0-sglnone-fi0.6.18")


def venv_cells(tmp_path: Path) -> list[str]:
    """Two venv cells whose interpreter is this one (records in the shape `provision build --backend venv`
    writes), and the `checks run` options that select them."""
    envs = tmp_path / "envs"
    bindir = Path(sys.executable).parent
    for cell in CELLS:
        (envs / cell).mkdir(parents=True)
        (envs / cell / "build.json").write_text(json.dumps({
            "cell_id": cell, "backend": "venv", "status": "built", "python": sys.executable,
            "venv": str(bindir.parent), "path": [str(bindir)]}))
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    return ["--backend", "venv", "--matrix", str(tmp_path / "matrix.yaml"), "--envs", str(envs)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_parallel_jobs_ends_every_variant_and_keeps_what_finished(tmp_path: Path, sig: int) -> None:
    probes_dir = write_probes(tmp_path / "probes", sleep=120, timeout=300)
    (probes_dir / "t_par_gpu.py").unlink()
    (probes_dir / "t_quick.py").write_text((ROOT / "tests" / "probes_fixtures" / "t_trivial.py").read_text()
                                           .replace('id="t-trivial"', 'id="t-a-quick"'))
    env = fixture_env(STACKPROBE_PROBE_PATH=str(probes_dir))
    results = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "checks.cli", "run", *venv_cells(tmp_path), "--probe", "t-a-quick",
                             "--probe", "t-par-slow", "--jobs", "2", "--fresh", "--results", str(results)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # both cells' slow variants running: a worker and a rank each
        files = sorted(results.glob("*/*.jsonl"))
        if files and len(read_file(files[0])[0]) == 4 and len(pids_with_env(env[TOKEN_VAR])) >= 5:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    running = pids_with_env(env[TOKEN_VAR])
    assert len(running) >= 5, running  # the runner, and two workers with a rank each
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    stored, warnings = read_file(sorted(results.glob("*/*.jsonl"))[0])
    assert warnings == [] and sorted((r.cell_id, r.probe_id) for r in stored) == sorted(
        (c, "t-a-quick") for c in CELLS for _ in (1, 2))
    assert pids_with_env(env[TOKEN_VAR]) == []


@dataclasses.dataclass(frozen=True)
class _DaemonGone(LocalExecutor):
    """An executor that fails in the harness (as a Docker SDK call raising mid-variant would)."""

    def run(self, *args: object, **kwargs: object) -> Verdict:
        raise ConnectionError("409 Client Error: can not get logs from container which is dead")


def test_an_executor_failing_a_variant_is_that_variants_result_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probes_dir = write_probes(tmp_path / "probes")
    env = fixture_env(STACKPROBE_PROBE_PATH=str(probes_dir))
    for name in ("STACKPROBE_PROBE_PATH", TOKEN_VAR, "PYTHONPATH"):
        monkeypatch.setenv(name, env[name])
    probes = {pid: mod for pid, (_, mod) in discover({"STACKPROBE_PROBE_PATH": str(probes_dir)}).items()
              if pid == "t-par-slow"}
    cells = [CellTarget(f"cu130-torchcell{i}-sgl1-fi1", "resolved", image_status="built") for i in (1, 2)]
    items = plan_work(cells, probes, HostView(gpu_count=0))
    executors = {cells[0].cell_id: _DaemonGone(sys.executable), cells[1].cell_id: LocalExecutor(sys.executable)}
    store = RunStore(tmp_path / "results", "cpu-0123abcd", "20261201T000000Z-0001")
    codes = {pid: checkout().for_probe(h) for pid, h in probe_hashes(probes).items()}
    report = execute(RunOptions(jobs=2), Work(items, store, reasons.default(), 0, codes, executors=executors))
    assert not report.interrupted
    got = {r.cell_id: r.verdict for r in report.results}
    lost = got[cells[0].cell_id]
    assert (lost.status, lost.reason_code) == ("not-run", "harness-error")
    assert "can not get logs" in lost.note and "ConnectionError" in lost.evidence["traceback"]
    assert got[cells[1].cell_id].status == "pass"
    stored, warnings = read_file(store.results_path)
    assert warnings == [] and len(stored) == 2


def test_a_cancelled_run_ends_a_waiting_variant_by_the_event_it_checks(tmp_path: Path) -> None:
    """The worker thread's own wait sees isolate.STOP and ends its process group, then raises KeyboardInterrupt
    itself: nothing is injected into the thread, and the process is gone within a poll."""
    from checks.run import isolate

    pid_file = tmp_path / "pid"
    cmd = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
           "time.sleep(60)"]
    raised: list[BaseException] = []

    def body() -> None:
        try:
            isolate.run_isolated(cmd, dict(os.environ), 120)
        except BaseException as exc:  # what the thread's own code raised
            raised.append(exc)

    isolate.STOP.clear()
    th = threading.Thread(target=body)
    th.start()
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    set_at = time.monotonic()
    isolate.STOP.set()
    try:
        th.join(timeout=10)
        assert not th.is_alive() and time.monotonic() - set_at < 5
        assert len(raised) == 1 and isinstance(raised[0], KeyboardInterrupt)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # its process was killed, not left running
    finally:
        isolate.STOP.clear()


def test_beside_variants_that_time_nothing_cpu_work_starts_and_the_costliest_that_fits_goes_first() -> None:
    """While every GPU variant in flight times nothing, CPU-only work starts beside them (nothing beside them is
    timed), and of the waiting variants that time nothing the costliest whose ranks fit the cap goes first;
    beside a timed variant no CPU-only work starts."""
    plain = ProbeSpec("inventory", "c", "f", needs_gpu=False)
    gpu = ProbeSpec("step", "g", "f", needs_gpu=True, distinct_gpus=False)
    cell = CellTarget("cella", "resolved")
    inventory = WorkItem(cell, plain, Variant("inventory", 1), 60.0)

    def shared(ranks: int, backend: str) -> WorkItem:
        return WorkItem(cell, gpu, Variant("step", ranks, (("backend", backend),), share_gpu=True, gpus=1), 60.0)

    running = [shared(2, "a"), shared(2, "b")]
    timed = WorkItem(cell, gpu, Variant("step", 2, (("backend", "c"),)), 60.0)
    assert pick([inventory], running, 4, ahead=2, rank_cap=16) is inventory
    assert pick([inventory], [timed], 4, ahead=2, rank_cap=16) is None
    small, big, biggest = shared(2, "x"), shared(4, "y"), shared(8, "z")
    seconds = {small.key: 3.0, big.key: 9.0, biggest.key: 20.0}
    assert pick([small, big, biggest], running, 4, ahead=2, cost=lambda it: seconds.get(it.key, 0.0),
                rank_cap=16) is biggest  # 4 running + 8
    # 10 ranks running: the costliest's 8 would pass 16, and nothing smaller goes past it while it waits
    assert pick([small, big, biggest], [*running, shared(6, "w")], 4, ahead=2,
                cost=lambda it: seconds.get(it.key, 0.0), rank_cap=16) is None
    assert pick([small, big], [*running, shared(6, "w")], 4, ahead=2,
                cost=lambda it: seconds.get(it.key, 0.0), rank_cap=16) is big
    # alone on the GPU a variant starts whatever its size, even past the cap
    assert pick([shared(8, "v")], [], 4, ahead=2, rank_cap=4) is not None


# `nvidia-smi topo -m` of a host whose eight GPUs are joined by an NVSwitch, and of one whose GPUs meet over PCIe
NVSWITCH_TOPO = "\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\tCPU Affinity\n" + "\n".join(
    f"GPU{i}\t" + "\t".join("X" if j == i else "NV18" for j in range(8)) + "\t0-63" for i in range(8))
PCIE_TOPO = NVSWITCH_TOPO.replace("NV18", "SYS")


def test_timed_variants_go_side_by_side_on_disjoint_gpus_only_where_every_pair_is_nvlink() -> None:
    """On a host of eight GPUs every pair joined by NVLink, a timed variant of N ranks takes N free GPUs and
    the costliest that fits starts beside the running ones; one of 8 ranks, one of 1 rank and host-p2p's pair
    (it names GPUs) take every GPU and run alone. On PCIe facts, one at a time. Placements written by hand."""
    assert placement.switched({"gpu_count": 8, "topology": NVSWITCH_TOPO})
    assert not placement.switched({"gpu_count": 8, "topology": PCIE_TOPO})
    partial = NVSWITCH_TOPO.replace("GPU3\tNV18", "GPU3\tSYS")  # GPU3-GPU0 over PCIe
    assert not placement.switched({"gpu_count": 8, "topology": partial})
    assert not placement.switched({"gpu_count": 8, "topology": None})
    assert not placement.switched({"gpu_count": 8, "topology": NVSWITCH_TOPO.split("GPU7\tNV18")[0]})  # a row short

    gpu = ProbeSpec("step", "s", "f", needs_gpu=True)
    cell = CellTarget("cella", "resolved")

    def timed(name: str, ranks: int) -> WorkItem:
        return WorkItem(cell, gpu, Variant("step", ranks, (("n", name),)), 60.0)

    a, b, c, d, e = timed("a", 4), timed("b", 2), timed("c", 2), timed("d", 8), timed("e", 4)
    seconds = {a.key: 30.0, b.key: 20.0, c.key: 10.0, d.key: 5.0, e.key: 25.0}

    def schedule(lanes: bool) -> list[tuple[str, float, tuple[int, ...]]]:
        """Drive pick as the runner does, on a clock: (name, start, GPUs) of each variant as it starts."""
        pending, running, started, now = [a, b, c, d, e], {}, [], 0.0  # running: key -> (item, ends, GPUs)
        while pending or running:
            while (it := pick(pending, [r for r, _, _ in running.values()], 4, ahead=0,
                              cost=lambda it: seconds[it.key], rank_cap=16,
                              lanes=placement.Free(8, frozenset(g for _, _, gs in running.values() for g in gs))
                              if lanes else None)) is not None:
                pending.remove(it)
                gpus = placement.devices(it.variant, (g for _, _, gs in running.values() for g in gs), 8) \
                    if lanes else tuple(range(8))
                assert gpus is not None
                running[it.key] = (it, now + seconds[it.key], gpus)
                started.append((it.variant.param("n") or "", now, gpus))
            key = min(running, key=lambda k: running[k][1])
            now = running.pop(key)[1]
        return started

    all8 = tuple(range(8))
    assert schedule(lanes=True) == [("a", 0.0, (0, 1, 2, 3)), ("e", 0.0, (4, 5, 6, 7)), ("b", 25.0, (4, 5)),
                                    ("c", 25.0, (6, 7)), ("d", 45.0, all8)]
    assert schedule(lanes=False) == [("a", 0.0, all8), ("b", 30.0, all8), ("c", 50.0, all8), ("d", 60.0, all8),
                                     ("e", 65.0, all8)]
    # a variant that times nothing never starts beside a placed timed one, nor a timed one beside it
    shared = WorkItem(cell, gpu, Variant("step", 2, (("n", "s"),), share_gpu=True, gpus=1), 60.0)
    assert pick([shared], [a], 4, rank_cap=16, lanes=placement.Free(8, frozenset({0, 1, 2, 3}))) is None
    assert pick([b], [shared], 4, rank_cap=16, lanes=placement.Free(8, frozenset())) is None
    # one rank (facts of every GPU) takes every GPU; host-p2p's pair takes the two GPUs it names, when both are
    # free, and a pair the host lacks a GPU of takes every GPU (the variant says what is missing)
    assert placement.devices(Variant("host-p2p", 1), (), 8) == all8
    pair = Variant("host-p2p", 2, (("check", "copy"), ("pair", "3-7")))
    assert placement.devices(pair, (), 8) == (3, 7)
    assert placement.devices(pair, (0, 1, 2, 4, 5, 6), 8) == (3, 7)
    assert placement.devices(pair, (7,), 8) is None
    assert placement.devices(Variant("host-p2p", 2, (("check", "copy"), ("pair", "3-9"))), (), 8) == all8
    assert placement.lane_env((4, 5)) == (("CUDA_VISIBLE_DEVICES", "4,5"), ("STACKPROBE_LANE_GPUS", "4,5"),
                                          ("STACKPROBE_GPU_LOCK", ""))


def switch_topo(per_switch: int, gpus: int = 8, between: str = "SYS") -> str:
    """`nvidia-smi topo -m` of a PCIe host whose GPUs sit ``per_switch`` behind each switch (PIX), the switches
    joined through the CPUs (``between``)."""
    def link(i: int, j: int) -> str:
        return "X" if i == j else "PIX" if i // per_switch == j // per_switch else between
    return "\t" + "\t".join(f"GPU{i}" for i in range(gpus)) + "\tCPU Affinity\n" + "\n".join(
        f"GPU{i}\t" + "\t".join(link(i, j) for j in range(gpus)) + "\t0-63" for i in range(gpus))


def every_peer(gpus: int = 8) -> list[list[bool]]:
    return [[True] * gpus for _ in range(gpus)]


def test_pcie_switch_groups_come_from_pix_pairs_only_when_they_form_whole_groups() -> None:
    from checks.results import hostfacts

    assert hostfacts.switch_groups(switch_topo(2), 8) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert hostfacts.switch_groups(switch_topo(4, between="NODE"), 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert hostfacts.switch_groups(PCIE_TOPO, 8) == tuple((g,) for g in range(8))  # every GPU on a root port
    # GPU1 shares a switch with GPU0 and with GPU2, which do not share one: no grouping is told
    chain = switch_topo(2).replace("GPU1\tPIX\tX\tSYS", "GPU1\tPIX\tX\tPIX").replace(
        "GPU2\tSYS\tSYS\tX", "GPU2\tSYS\tPIX\tX")
    assert hostfacts.switch_groups(chain, 8) == ()
    assert hostfacts.switch_groups(switch_topo(2).split("GPU7")[0], 8) == ()  # a row short


def test_islands_need_two_switch_groups_with_peer_access_and_no_nvlink() -> None:
    four = {"gpu_count": 8, "topology": switch_topo(2), "peer_access": every_peer()}
    assert placement.islands(four) == ((0, 1), (2, 3), (4, 5), (6, 7)) and placement.side_by_side(four)
    no_peer = every_peer()
    no_peer[2][3] = False  # GPU2 cannot reach GPU3: their traffic goes through host memory
    assert placement.islands({**four, "peer_access": no_peer}) == ((0, 1), (2,), (3,), (4, 5), (6, 7))
    only_one = switch_topo(2).replace("PIX", "SYS")
    only_one = only_one.replace("GPU0\tX\tSYS", "GPU0\tX\tPIX").replace("GPU1\tSYS\tX", "GPU1\tPIX\tX")
    from checks.results import hostfacts

    assert hostfacts.switch_groups(only_one, 8) == ((0, 1), (2,), (3,), (4,), (5,), (6,), (7,))
    assert placement.islands({**four, "topology": only_one}) == ()  # one group: nothing runs beside it
    assert not placement.side_by_side({**four, "topology": only_one})
    assert placement.islands({**four, "peer_access": []}) == ()
    assert placement.islands({**four, "topology": PCIE_TOPO}) == ()
    assert placement.islands({"gpu_count": 8, "topology": NVSWITCH_TOPO, "peer_access": every_peer()}) == ()


def socket_topo(words: dict[tuple[int, int], str] | None = None, gpus: int = 8, per_socket: int = 4) -> str:
    """`nvidia-smi topo -m` of a PCIe host of two CPU sockets, ``per_socket`` GPUs on each socket's root ports
    (``NODE`` inside a socket, ``SYS`` across), with ``words`` replacing the link of some pairs (both ways)."""
    words = {**{(b, a): w for (a, b), w in (words or {}).items()}, **(words or {})}

    def link(i: int, j: int) -> str:
        return "X" if i == j else words.get((i, j)) or ("NODE" if i // per_socket == j // per_socket else "SYS")
    return "\t" + "\t".join(f"GPU{i}" for i in range(gpus)) + "\tCPU Affinity\n" + "\n".join(
        f"GPU{i}\t" + "\t".join(link(i, j) for j in range(gpus)) + "\t0-63" for i in range(gpus))


def test_without_switch_groups_the_gpus_of_each_cpu_socket_are_the_islands() -> None:
    from checks.results import hostfacts

    quads = ((0, 1, 2, 3), (4, 5, 6, 7))
    assert hostfacts.socket_groups(socket_topo(), 8) == quads
    assert hostfacts.socket_groups(socket_topo({(0, 1): "PHB", (2, 3): "PIX"}), 8) == quads
    assert hostfacts.socket_groups(socket_topo(per_socket=8), 8) == (tuple(range(8)),)  # one socket
    # GPU0 reaches GPU4 inside a socket while GPU1 reaches it only across: the pairs do not split by socket
    assert hostfacts.socket_groups(socket_topo({(0, 4): "NODE"}), 8) == ()
    assert hostfacts.socket_groups(socket_topo({(0, 1): "NV4"}), 8) == ()  # NVLink between some: not PCIe alone
    assert hostfacts.socket_groups(socket_topo().split("GPU7")[0], 8) == ()  # a row short
    facts = {"gpu_count": 8, "topology": socket_topo(), "peer_access": every_peer()}
    assert placement.islands(facts) == quads and placement.side_by_side(facts)
    # switches inside the sockets are finer islands, and come first
    switched_sockets = socket_topo({(0, 1): "PIX", (2, 3): "PIX", (4, 5): "PIX", (6, 7): "PIX"})
    assert placement.islands({**facts, "topology": switched_sockets}) == ((0, 1), (2, 3), (4, 5), (6, 7))
    # every GPU on one socket's root ports: one island, nothing beside it
    assert placement.islands({**facts, "topology": socket_topo(per_socket=8)}) == ()
    no_peer = every_peer()
    no_peer[5][6] = False  # the second socket's GPUs do not all reach each other: each alone there
    assert placement.islands({**facts, "peer_access": no_peer}) == ()


def test_timed_variants_on_a_pcie_switch_host_go_side_by_side_in_different_switches_and_cross_one_at_a_time(
        ) -> None:
    """Placements written by hand: islands of two GPUs (four switches), and of four (two switches)."""
    pairs = ((0, 1), (2, 3), (4, 5), (6, 7))
    quads = ((0, 1, 2, 3), (4, 5, 6, 7))
    two, four = Variant("step", 2, (("n", "x"),)), Variant("step", 4, (("n", "y"),))
    assert placement.devices(two, (), 8, pairs) == (0, 1)
    assert placement.devices(two, (0, 1), 8, pairs) == (2, 3)
    assert placement.devices(two, (0, 2, 4, 6), 8, pairs) is None  # every switch holds a running variant
    assert placement.devices(two, (0, 1), 8, quads) == (4, 5)  # one variant a switch, though 2 and 3 are free
    assert placement.devices(four, (), 8, quads) == (0, 1, 2, 3)
    # four ranks over switches of two: two whole free switches, crossing the host bridge
    assert placement.devices(four, (), 8, pairs) == (0, 1, 2, 3)
    assert placement.devices(four, (0, 1), 8, pairs) == (2, 3, 4, 5)
    assert placement.devices(four, (0, 1), 8, pairs, crossing=True) is None  # one crossing variant at a time
    room = placement.free([(0, 1, 2, 3)], 8, pairs)
    assert room.crossing and not room.fits(four) and room.fits(two)  # inside one switch it still goes beside
    # a variant naming GPUs: inside one switch beside others; across switches only while nothing crosses
    pair = Variant("host-p2p", 2, (("check", "copy"), ("pair", "2-3")))
    across = Variant("host-p2p", 2, (("check", "copy"), ("pair", "1-6")))
    assert placement.devices(pair, (0, 1), 8, pairs) == (2, 3)
    assert placement.devices(across, (2, 3), 8, pairs) == (1, 6)
    assert placement.devices(across, (0,), 8, pairs) is None
    assert placement.devices(across, (2, 3), 8, pairs, crossing=True) is None
    # one rank reads every GPU: alone
    assert placement.devices(Variant("host-p2p", 1), (), 8, pairs) == tuple(range(8))
    assert placement.devices(Variant("host-p2p", 1), (7,), 8, pairs) is None
    # the cost model places them the same way: four 2-GPU variants of 10 s in four switches take 10 s, in two
    # switches 20 s; two 4-GPU ones over switches of two cross one at a time, 20 s
    from checks.run.cost import budget

    assert budget.placed_seconds([(2, 10.0)] * 4, 8, pairs) == 10.0
    assert budget.placed_seconds([(2, 10.0)] * 4, 8, quads) == 20.0
    assert budget.placed_seconds([(4, 10.0)] * 2, 8, pairs) == 20.0
    assert budget.placed_seconds([(4, 10.0)] * 2, 8) == 10.0  # NVSwitch: disjoint sets, side by side


PAIRS = '''"""Timed, two ranks: each rank says which GPUs it was given and when it ran."""

import os
import time

from inenv.probe import HostView, ProbeSpec, RankContext, Variant, outcome

SPEC = ProbeSpec(id="t-par-pair", title="pair", feature="placement", ranks=(2,), needs_gpu=True, timeout_s=60)


def variants(host: HostView) -> list[Variant]:
    return [Variant(SPEC.id, 2, (("n", str(i)),)) for i in range(4)]


def run(ctx: RankContext) -> dict:
    t0 = time.time()
    time.sleep(1.5)
    return outcome("pass", metrics={"t0": t0, "t1": time.time()},
                   evidence={"visible": os.environ.get("CUDA_VISIBLE_DEVICES", "")})
'''


@pytest.mark.parametrize("per_switch", [2, 0])
def test_the_runner_places_timed_variants_in_different_pcie_switches_side_by_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_switch: int) -> None:
    """Four timed 2-rank variants on a host of 8 GPUs (the workers are told so) whose facts put the GPUs two
    behind each PCIe switch: they run at once, each on the GPUs of its own switch. With the GPUs on the CPU's
    root ports (``per_switch`` 0): one at a time, each seeing every GPU."""
    probes_dir = tmp_path / "probes"
    probes_dir.mkdir()
    (probes_dir / "t_par_pair.py").write_text(PAIRS)
    env = fixture_env(STACKPROBE_PROBE_PATH=str(probes_dir))
    for name in ("STACKPROBE_PROBE_PATH", TOKEN_VAR, "PYTHONPATH"):
        monkeypatch.setenv(name, env[name])
    probes = {pid: mod for pid, (_, mod) in discover({"STACKPROBE_PROBE_PATH": str(probes_dir)}).items()
              if pid == "t-par-pair"}
    cell = CellTarget("cu130-torchcell1-sgl1-fi1", "resolved", image_status="built")
    items = plan_work([cell], probes, HostView(gpu_count=8))
    facts = {"gpu_count": 8, "topology": switch_topo(per_switch) if per_switch else PCIE_TOPO,
             "peer_access": every_peer()}
    store = RunStore(tmp_path / "results", "cpu-0123abcd", "20261201T000000Z-0001")
    codes = {pid: checkout().for_probe(h) for pid, h in probe_hashes(probes).items()}
    work = Work(items, store, reasons.default(), 8, codes, executors={cell.cell_id: LocalExecutor(sys.executable)},
                manifest={"facts": facts})
    report = execute(RunOptions(jobs=4), work)
    assert not report.interrupted and [r.verdict.status for r in report.results] == ["pass"] * 4
    runs = sorted(((dict(r.verdict.metrics), str(r.verdict.evidence.get("visible"))) for r in report.results),
                  key=lambda run: run[0]["t0"])
    if per_switch:
        assert sorted(v for _, v in runs) == ["0,1", "2,3", "4,5", "6,7"]
        assert all(overlap(a, b) for (a, _), (b, _) in zip(runs, runs[1:], strict=False))
    else:
        assert {v for _, v in runs} == {""}  # the worker's own GPUs: every one, no lane
        assert not any(overlap(a, b) for (a, _), (b, _) in zip(runs, runs[1:], strict=False))
    assert pids_with_env(env[TOKEN_VAR]) == []


def test_a_docker_worker_placed_on_gpus_sees_only_them_and_takes_no_lock(tmp_path: Path) -> None:
    """A container's environment for a variant placed on GPUs 2 and 5: those visible, named as the host's, and the
    host's GPU lock (which the runner holds for it) left out."""
    lock = tmp_path / "gpu.lock"
    ex = DockerExecutor(image="stackprobe/x:1", run_env=(("STACKPROBE_GPU_LOCK", str(lock)),))
    env = ex._config(["true"], extra=placement.lane_env((2, 5)))["environment"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5" and env["STACKPROBE_LANE_GPUS"] == "2,5"
    assert "STACKPROBE_GPU_LOCK" not in env
    assert "STACKPROBE_GPU_LOCK" in ex._config(["true"])["environment"]  # not placed: the lock, every GPU
