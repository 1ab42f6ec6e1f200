"""`checks run --level quick|full`: quick plans fi-jit's smallest module per arch and runs the GPU probes at
one message size; its results say so, the table marks them, and a full run never reuses them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from checks.results.provenance import checkout, probe_hashes
from checks.results.store import RunStore, read_file
from checks.run.executor import LocalExecutor
from checks.run.options import RunOptions
from checks.run.plan import CellTarget, plan_work
from checks.run.runner import Work, execute
from common import reasons
from inenv.probe import FULL, LEVEL_ENV, QUICK, HostView
from inenv.probes import fi_jit, pcie_ipc
from inenv.registry import discover
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


def test_a_quick_run_is_marked_and_a_full_run_does_not_reuse_it(tmp_path: Path) -> None:
    c = Checkout(tmp_path)
    quick = c.run("--level", "quick", "--probe", "fi-jit")
    assert "plan 1 cell(s) x 3 probe(s) = 6 variant(s)" in quick.stderr  # fi-jit: vllm_comm x (local, 12.0a, 12.0f)
    assert c.ran() == ALL
    printed = json.loads(quick.stdout)
    assert {r["evidence"].get("level") for r in printed if r["probe_id"] != "fi-jit" or r["reason_code"] !=
            "no-gpu"} == {"quick"}
    [run] = c.runs()
    assert json.loads(run.with_name(run.stem + ".manifest.json").read_text())["level"] == "quick"

    out = tmp_path / "table.md"
    p = subprocess.run([sys.executable, "-m", "checks.cli", "report", "--results", str(c.results), "--out",
                        str(out)], capture_output=True, text=True, cwd=c.root, env=c.env, timeout=300)
    assert p.returncode == 0, p.stderr
    md = out.read_text()
    assert "✅2 *(quick)*" in md and f"({printed[0]['started_at'][:10]}, quick)" in md
    assert "*quick*: made\nby `checks run --level quick`" in md

    full = c.run()  # the default level: everything quick made runs again
    assert c.ran() == ALL and "unchanged" not in full.stderr
    assert not any("level" in r["evidence"] for r in json.loads(full.stdout))
    again = c.run("--level", "quick")  # a quick run may carry full results: they answer more
    assert c.ran() == [] and "reused 3 unchanged" in again.stderr
