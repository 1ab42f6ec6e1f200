"""pcie-ipc on a machine without a GPU: planning, references and verdicts on CPU tensors, the unknown-API
verdict on a stand-in flashinfer, and (when the 0.7.4 wheel is on disk) that the probe's shapes reach every
kernel flashinfer's own seed policy picks."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from inenv.probe import HostView
from inenv.probes import pcie_ipc

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fake_flashinfer"
WHEEL = ROOT / ".cache" / "wheels" / "flashinfer_python-0.7.4-py3-none-any.whl"


def test_plan_on_two_gpus_shares_gpus_only_for_correctness_variants_of_more_ranks() -> None:
    vs = pcie_ipc.variants(HostView(gpu_count=2))
    run = [v.key for v in vs if v.skip is None]
    assert run == [
        "ranks=2,op=all-reduce",
        "ranks=2,op=all-gather",
        "ranks=2,op=reduce-scatter",
        "ranks=3,placement=shared,gpus=2,op=all-reduce",
        "ranks=4,placement=shared,gpus=2,op=all-reduce",
        "ranks=8,placement=shared,gpus=2,op=all-reduce",
    ]
    skipped = [v for v in vs if v.skip]
    assert len(skipped) == 6 and all(v.skip.code == "too-few-gpus" and not v.share_gpu for v in skipped)


@pytest.mark.parametrize(("gpus", "shared"), [(0, []), (1, [2, 3, 4, 8]), (4, [8]), (8, [])])
def test_shared_variants_only_where_the_host_lacks_gpus(gpus: int, shared: list[int]) -> None:
    vs = pcie_ipc.variants(HostView(gpu_count=gpus))
    assert [v.ranks for v in vs if v.share_gpu] == shared
    assert all(v.skip is None for v in vs if v.share_gpu)
    if gpus == 0:
        assert all(v.skip and v.skip.code == "no-gpu" for v in vs)


# --- references and checks, on CPU ---------------------------------------------------------------------
@pytest.mark.parametrize("op", ["all-reduce", "all-gather", "reduce-scatter"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_reference_is_what_every_rank_must_get(op: str, world: int) -> None:
    torch = pytest.importorskip("torch")
    from inenv.kit import _data

    case = pcie_ipc.Case(2, 16)
    in_shape, out_shape = pcie_ipc.shapes(op, case, world)
    inputs = [_data.pattern(in_shape, r, 5, dtype=torch.int64) for r in range(world)]
    for rank in range(world):
        ref = pcie_ipc.reference(op, case, rank, world, 5)
        assert tuple(ref.shape) == out_shape
        if op == "all-gather":
            want = torch.cat(inputs)
        elif op == "reduce-scatter":
            want = sum(inputs)[rank * 2 : (rank + 1) * 2]
        else:
            want = sum(inputs)
        assert torch.equal(ref.to(torch.int64), want)


def test_buffers_tell_exact_from_untouched_and_wrong() -> None:
    torch = pytest.importorskip("torch")
    b = pcie_ipc._Buffers("all-reduce", pcie_ipc.Case(1, 32), 1, 4, torch.device("cpu"))
    b.fill(3)
    assert b.check()["verdict"] == "no-op"
    b.out.copy_(pcie_ipc.reference("all-reduce", b.case, 1, 4, 3))
    assert b.check()["verdict"] == "exact"
    b.out[0, 0] += 1
    assert b.check()["verdict"] == "wrong"
    b.out.copy_(b.inp)
    assert b.check()["verdict"] == "no-op"


# --- verdicts (pure) -----------------------------------------------------------------------------------
EXACT = {"verdict": "exact", "detail": ""}


def _results(**overrides: dict) -> dict[str, dict]:
    out = {c.key: {"config": {"variant": "UNSTAGED"}, "eager": EXACT, "graph": EXACT} for c in pcie_ipc.MAIN}
    out.update({c.key: {"refused": "unsupported shape"} for c in pcie_ipc.EDGES["all-reduce"]})
    out.update(overrides)
    return out


def test_judge_passes_exact_results_whatever_the_edge_shapes_did() -> None:
    assert pcie_ipc.judge("all-reduce", _results(), "seed", "eager") is None
    assert pcie_ipc.judge("all-reduce", _results(), "seed", "graph") is None


def test_judge_names_wrong_noop_and_graph_failures() -> None:
    wrong = _results(**{"8x7168": {"eager": {"verdict": "wrong", "detail": "3/57344 elements differ"}}})
    o = pcie_ipc.judge("all-reduce", wrong, "tuned", "eager")
    assert (o["status"], o["reason_code"]) == ("fail", "pcie-ipc-wrong")
    assert "tuned config, eager, 8x7168" in o["note"] and "3/57344" in o["note"]
    noop = _results(**{"1x2048": {"eager": {"verdict": "no-op", "detail": "output equals its prior contents"}}})
    assert pcie_ipc.judge("all-gather", noop, "seed", "eager")["reason_code"] == "pcie-ipc-noop"
    graph = _results(**{"128x7168": {"eager": EXACT, "graph": {"verdict": "zero", "detail": "output is all zero"}}})
    o = pcie_ipc.judge("all-reduce", graph, "seed", "graph")
    assert (o["status"], o["reason_code"]) == ("partial", "pcie-ipc-noop")
    assert o["note"].startswith("eager exact; ")


def test_every_decode_shape_refused_is_fail_with_flashinfer_words() -> None:
    words = "unsupported shape (1, 2048) dtype torch.bfloat16 at 8 ranks; check supports() first"
    refused = {c.key: {"refused": words} for c in (*pcie_ipc.MAIN, *pcie_ipc.EDGES["reduce-scatter"])}
    o = pcie_ipc.judge("reduce-scatter", refused, "seed", "eager")
    assert (o["status"], o["reason_code"]) == ("fail", "pcie-ipc-refused")
    assert words in o["note"]
    some = _results(**{"1x2048": {"refused": words}})
    assert pcie_ipc.judge("all-reduce", some, "seed", "eager") is None


def test_headline_uses_the_smallest_size_with_both_latencies() -> None:
    m = {"latency_us": {"4096": 2.61, "14336": 3.0}, "nccl_latency_us": {"4096": 12.1, "14336": 12.3}}
    assert pcie_ipc.headline(m) == "2.61 us vs NCCL 12.1 us at 4 KiB (tuned)"
    assert pcie_ipc.headline({}) == ""


# --- the unknown-API verdict, through the probe's own entry point -----------------------------------------
def test_run_on_a_flashinfer_without_pcie_ipc_is_skip_not_fail(tmp_path: Path) -> None:
    code = f"""
import json
from pathlib import Path
from inenv.probe import RankContext, Variant
from inenv.probes import pcie_ipc
ctx = RankContext(0, 2, 0, None, Variant("pcie-ipc", 2, (("op", "all-reduce"),)), Path({str(tmp_path)!r}))
print(json.dumps(pcie_ipc.run(ctx)))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES / "fi06"), str(FAKES), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    o = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (o["status"], o["reason_code"]) == ("skip", "probe-api-unknown")
    assert "flashinfer-python 0.6.18" in o["note"] and "PcieIpcAllReduceWorkspace" in o["note"]


# --- the shapes against flashinfer's real seed policy ----------------------------------------------------
@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    """flashinfer 0.7.4's pcie_ipc_policy, loaded from the wheel without importing flashinfer (it needs only
    its constants module, no torch)."""
    if not WHEEL.exists():  # the Python package registry is reachable wherever the tests run: fetch it
        WHEEL.parent.mkdir(parents=True, exist_ok=True)
        pip = shutil.which("pip3") or shutil.which("pip") or "pip"  # the project venv has no pip of its own
        got = subprocess.run([pip, "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(WHEEL.parent),
                              "flashinfer-python==0.7.4"], capture_output=True, text=True)
        if not WHEEL.exists():
            pytest.skip(f"{WHEEL.name} could not be downloaded: {(got.stderr or got.stdout).strip()[-300:]}")
    root = tmp_path_factory.mktemp("fi074")
    with zipfile.ZipFile(WHEEL) as z:
        for name in z.namelist():
            if name.startswith("flashinfer/comm/pcie_ipc_policy.py") or name.startswith(
                "flashinfer/comm/pcie_ipc_collectives/_constants.py"
            ):
                z.extract(name, root)
    comm = root / "flashinfer" / "comm"
    (comm / "pcie_ipc_collectives" / "__init__.py").write_text("")
    pkg = types.ModuleType("h6_fi074_comm")
    pkg.__path__ = [str(comm)]
    sys.modules["h6_fi074_comm"] = pkg
    try:
        return importlib.import_module("h6_fi074_comm.pcie_ipc_policy")
    finally:
        for name in [n for n in sys.modules if n.startswith("h6_fi074_comm")]:
            sys.modules.pop(name)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_main_shapes_reach_every_kernel_the_seed_policy_picks(policy: types.ModuleType, world: int) -> None:
    def variant(numel: int) -> str | None:
        cfg = policy.get_pcie_ipc_launch_config(world, numel, 2)
        return cfg.variant.name if cfg else None

    possible = {variant(n) for n in range(8, pcie_ipc.MAX_NUMEL + 1, 8)} - {None}
    reached = {variant(c.tokens * c.hidden) for c in pcie_ipc.MAIN}
    assert None not in reached  # every decode shape is admitted
    assert reached == possible, (world, sorted(possible - reached))
    assert all(variant(c.tokens * c.hidden) is None for c in pcie_ipc.EDGES["all-reduce"])
