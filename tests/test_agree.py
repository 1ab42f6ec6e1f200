"""Rank agreement (inenv/kit/_agree.py): ulps, the verdict on planted outputs, and real gloo ranks that
allreduce random bf16 tensors on the CPU, one of them planted to diverge."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from inenv.kit import _agree

ROOT = Path(__file__).resolve().parent.parent
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


@needs_torch
def test_ulps_between_neighbours_and_across_zero() -> None:
    import torch

    one = torch.tensor([1.0], dtype=torch.bfloat16)
    # bf16 has 7 stored fraction bits: the next value above 1.0 is 1 + 2**-7, three ulps above is 1 + 3 * 2**-7
    assert int(_agree.ulps_between(one, torch.tensor([1.0 + 2**-7], dtype=torch.bfloat16))) == 1
    assert int(_agree.ulps_between(one, torch.tensor([1.0 + 3 * 2**-7], dtype=torch.bfloat16))) == 3
    # +0 and -0 are one point; the smallest subnormals either side of zero are 2 apart
    assert int(_agree.ulps_between(torch.tensor([0.0], dtype=torch.bfloat16),
                                   torch.tensor([-0.0], dtype=torch.bfloat16))) == 0
    tiny = 2.0**-133  # bf16's smallest subnormal
    assert int(_agree.ulps_between(torch.tensor([tiny], dtype=torch.bfloat16),
                                   torch.tensor([-tiny], dtype=torch.bfloat16))) == 2
    half = torch.tensor([1.0], dtype=torch.float16)
    assert int(_agree.ulps_between(half, torch.tensor([1.0 + 2**-10], dtype=torch.float16))) == 1


@needs_torch
def test_error_in_ulps_against_a_float64_reference() -> None:
    import torch

    ref = torch.tensor([1.0 + 2**-9, 3.0], dtype=torch.float64)  # 1 + a quarter bf16 ulp; 3 exactly
    got = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    assert _agree.error_ulps(got, ref) == 0.25
    # at 3.0 (exponent 1) a bf16 ulp is 2**-6: one ulp off is 1.0
    assert _agree.error_ulps(torch.tensor([3.0 + 2**-6], dtype=torch.bfloat16), torch.tensor([3.0],
                             dtype=torch.float64)) == 1.0
    assert _agree.error_ulps(torch.tensor([math.inf], dtype=torch.bfloat16), torch.tensor([1.0])) == math.inf
    # fp16 at 1.0: ulp 2**-10
    assert _agree.error_ulps(torch.tensor([1.0], dtype=torch.float16),
                             torch.tensor([1.0 + 2**-11], dtype=torch.float64)) == 0.5


@needs_torch
def test_judge_names_the_divergent_rank_and_the_nondeterministic_call() -> None:
    import torch

    base = torch.tensor([1.0, 2.0, -4.0, 0.5], dtype=torch.bfloat16)
    off = base.clone()
    off[2] = -4.0 - 2 * 2**-5  # two ulps below -4 (ulp at 4 is 2**-5)
    ref = {"out": base.to(torch.float64)}
    same = [{"out": base.clone()} for _ in range(3)]
    agreed = _agree.judge(same, same, ref)
    assert (agreed.identical, agreed.differing, agreed.max_ulp_between_ranks, agreed.deterministic) == (
        True, 0, 0, True)
    assert agreed.max_ulp_vs_reference == 0.0
    first = [{"out": base.clone()}, {"out": base.clone()}, {"out": off}]
    split = _agree.judge(first, first, ref)
    assert (split.identical, split.differing, split.max_ulp_between_ranks, split.divergent_ranks) == (
        False, 1, 2, (2,))
    assert split.max_ulp_vs_reference == 2.0
    # every rank agrees in each call, but the second call differs from the first: identical, not deterministic
    second = [{"out": off.clone()} for _ in range(3)]
    drift = _agree.judge(same, second, ref)
    assert (drift.identical, drift.deterministic, drift.changed_on_repeat) == (True, False, 1)


def test_summary_and_verdict_for_a_divergent_backend() -> None:
    ok = {"verdict": "ok", "identical": True, "deterministic": True, "differing": 0, "max_ulp_between_ranks": 0,
          "max_ulp_vs_reference": 0.5}
    bad = {**ok, "identical": False, "differing": 7, "max_ulp_between_ranks": 1}
    results = {"bf16:eager:1x4096": ok, "bf16:graph:1x4096": bad, "fp16:eager:1x4096": {"verdict": "unsupported"},
               "fp16:graph:1x4096": {"verdict": "hang"}}
    summary = _agree.summarize(results)
    assert summary["ranks_identical"] is False and summary["deterministic"] is True
    assert summary["divergent_cases"] == ["bf16:graph:1x4096"]
    assert (summary["differing_elements"], summary["max_ulp_between_ranks"], summary["judged"]) == (7, 1, 2)
    assert summary["unsupported"] == ["fp16:eager:1x4096"] and summary["not_judged"] == ["fp16:graph:1x4096"]
    passed = {"status": "pass", "note": "", "reason_code": "", "metrics": {}, "evidence": {}}
    got = _agree.apply(dict(passed), summary, "nccl")
    assert (got["status"], got["reason_code"]) == ("partial", "rank-divergent")
    assert "bf16:graph:1x4096" in got["note"] and "speculative verify" in got["note"]
    failed = _agree.apply({**passed, "status": "fail", "reason_code": "x"}, summary, "nccl")
    assert (failed["status"], failed["reason_code"]) == ("fail", "x")  # a worse verdict stays
    clean = _agree.apply(dict(passed), _agree.summarize({"k": ok}), "nccl")
    assert clean["status"] == "pass" and clean["metrics"]["agreement"]["ranks_identical"] is True


def test_a_probes_own_shallow_agreement_cases_judge_its_outcome() -> None:
    # what pcie-ipc and fi-fusion make of the step's shallow selection run on their shared ranks
    exact = {"verdict": "exact", "mismatches": 0}
    ok = {"verdict": "ok", "identical": True, "deterministic": True, "differing": 0, "max_ulp_between_ranks": 0,
          "max_ulp_vs_reference": 0.5, "exact": exact}
    passed = {"status": "pass", "note": "", "reason_code": "", "metrics": {}, "evidence": {}}
    codes = ("x-wrong", "x-noop", "x-error")

    def judged(cases: dict, start: dict = passed) -> dict:
        return _agree.shallow_outcome(dict(start), cases, "X", *codes)

    clean = judged({"bf16:graph:256x8192": ok, "fp16:graph:256x8192": {"verdict": "unsupported", "error": "dtype"}})
    assert (clean["status"], clean["reason_code"]) == ("pass", "")
    assert clean["metrics"]["agreement"]["unsupported"] == ["fp16:graph:256x8192"]
    wrong = judged({"bf16:graph:256x8192": {**ok, "exact": {"verdict": "wrong", "detail": "3 of 9 differ"}}})
    assert (wrong["status"], wrong["reason_code"]) == ("fail", "x-wrong")
    assert "bf16:graph:256x8192" in wrong["note"] and "3 of 9 differ" in wrong["note"]
    for left in ("no-op", "zero"):
        noop = judged({"bf16:graph:256x8192": {**ok, "exact": {"verdict": left, "detail": "untouched"}}})
        assert (noop["status"], noop["reason_code"]) == ("fail", "x-noop")
    raised = judged({"bf16:graph:256x8192": {"verdict": "error", "error": "capture: CUDA error"}})
    assert (raised["status"], raised["reason_code"]) == ("partial", "x-error") and "CUDA error" in raised["note"]
    hung = judged({"bf16:graph:256x8192": {**ok, "exact": {"verdict": "hang", "error": "no progress in 60 s"}}})
    assert (hung["status"], hung["reason_code"]) == ("partial", "x-error")
    apart = judged({"bf16:graph:256x8192": {**ok, "identical": False, "differing": 4, "max_ulp_between_ranks": 1}})
    assert (apart["status"], apart["reason_code"]) == ("partial", "rank-divergent")
    # a verdict the probe's own checks reached stays when it is worse; a partial of its own is not masked
    failed = judged({"bf16:graph:256x8192": {"verdict": "error", "error": "e"}},
                    {**passed, "status": "fail", "reason_code": "own"})
    assert (failed["status"], failed["reason_code"]) == ("fail", "own")
    part = judged({"bf16:graph:256x8192": {"verdict": "error", "error": "e"}},
                  {**passed, "status": "partial", "reason_code": "own-graph", "note": "graph"})
    assert (part["status"], part["reason_code"]) == ("partial", "own-graph")
    worse = judged({"bf16:graph:256x8192": {**ok, "exact": {"verdict": "wrong", "detail": "d"}}},
                   {**passed, "status": "partial", "reason_code": "own-graph", "note": "graph"})
    assert (worse["status"], worse["reason_code"]) == ("fail", "x-wrong")


def test_cases_cover_every_model_hidden_size_decode_and_verify() -> None:
    from inenv import models

    wanted = _agree.cases(("bf16", "fp16"))
    hiddens = {int(str(d["hidden"])) for d in models.SHAPES.values()}
    assert {c.hidden for c in wanted} == hiddens
    assert {c.mode for c in wanted} == {"eager", "graph"} and {c.dtype for c in wanted} == {"bf16", "fp16"}
    assert 1 in {c.tokens for c in wanted} and 32 * 8 in {c.tokens for c in wanted}  # decode; 32 x (1 + 7) verify
    assert len({c.key for c in wanted}) == len(wanted) == 2 * len(hiddens) * 3 * 2
    quick = _agree.cases(("bf16",), quick=True)
    assert len(quick) == 2


# --- real gloo ranks --------------------------------------------------------------------------------------

_RANK = r"""
import json, os, sys
from pathlib import Path
from inenv.probe import RankContext, Variant
from inenv.kit import _agree, _dist
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
plant = os.environ.get("PLANT", "")
ctx = RankContext(rank, world, rank, None, Variant("t", world), Path(sys.argv[1]))
_dist.init_dist(ctx, "gloo")
calls = {"n": 0}

def bind(case):
    if case.dtype == "fp16" and plant == "refuse-fp16" and rank == 1:
        raise TypeError("this backend has no fp16 kernel")
    buf = torch.empty(case.numel, dtype=_agree.torch_dtype(case.dtype))

    def step():
        dist.all_reduce(buf)  # gloo's allreduce of a CPU bf16/fp16 tensor
        calls["n"] += 1
        if plant == "diverge" and rank == world - 1:
            flat = buf.view(-1).view(torch.int16)
            flat[3] ^= 1  # one bit of one element on the last rank
        if plant == "drift" and calls["n"] % 2 == 0:
            buf.view(-1)[0] += buf.view(-1)[0].abs() * 2**-6  # every rank, second call only

    return _agree.allreduce_bound(case, buf, buf, step, rank, world)

wanted = [_agree.Case(d, t, h, "eager") for d in ("bf16", "fp16") for t, h in ((1, 4096), (32, 1024))]
results = _agree.run_cases(bind, wanted, None)
Path(sys.argv[1], f"out{rank}.json").write_text(json.dumps({"results": results,
                                                              "summary": _agree.summarize(results)}))
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_ranks(tmp_path: Path, world: int, plant: str, code: str = _RANK) -> list[dict[str, object]]:
    script = tmp_path / "rank.py"
    script.write_text(code)
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT), PLANT=plant)
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()[-2000:]
    return [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(world)]


@needs_torch
def test_gloo_ranks_agree_bitwise_and_are_near_the_exact_sum(tmp_path: Path) -> None:
    ranks = _gloo_ranks(tmp_path, 3, "")
    assert all(r == ranks[0] for r in ranks)  # every rank reaches the same verdict
    summary = ranks[0]["summary"]
    assert isinstance(summary, dict)
    assert summary["judged"] == 4 and summary["ranks_identical"] is True and summary["deterministic"] is True
    assert summary["differing_elements"] == 0 and summary["max_ulp_between_ranks"] == 0
    # three random bf16 values summed in bf16 round at least once somewhere in 4096+32768 elements, and a sum of
    # three terms rounded twice stays within a few ulps of the exact sum
    assert 0.0 < summary["max_ulp_vs_reference"] < 8.0


@needs_torch
def test_a_planted_divergent_rank_is_caught_on_every_rank(tmp_path: Path) -> None:
    ranks = _gloo_ranks(tmp_path, 3, "diverge")
    assert all(r == ranks[0] for r in ranks)
    summary = ranks[0]["summary"]
    assert isinstance(summary, dict)
    assert summary["ranks_identical"] is False and summary["deterministic"] is True
    assert summary["differing_elements"] == 4  # one element in each of the four cases
    assert summary["max_ulp_between_ranks"] == 1
    results = ranks[0]["results"]
    assert isinstance(results, dict)
    assert {tuple(r["divergent_ranks"]) for r in results.values()} == {(2,)}


@needs_torch
def test_nondeterminism_and_a_refused_dtype(tmp_path: Path) -> None:
    drift = _gloo_ranks(tmp_path / "drift", 2, "drift") if (tmp_path / "drift").mkdir() is None else []
    summary = drift[0]["summary"]
    assert isinstance(summary, dict)
    assert summary["ranks_identical"] is True and summary["deterministic"] is False
    refused = _gloo_ranks(tmp_path / "refuse", 2, "refuse-fp16") if (tmp_path / "refuse").mkdir() is None else []
    for r in refused:  # rank 1 refused fp16: both ranks record the two fp16 cases as unsupported and go on
        s = r["summary"]
        assert isinstance(s, dict)
        assert sorted(s["unsupported"] + s["not_judged"]) == ["fp16:eager:1x4096", "fp16:eager:32x1024"]
        assert s["judged"] == 2 and s["ranks_identical"] is True


# --- the probes' own bindings, on gloo ranks with stand-in backends -----------------------------------------

_PROBES_RANK = r"""
import json, os, sys
from pathlib import Path
from inenv.probe import RankContext, Variant
from inenv.kit import _agree, _dist
from inenv.probes import ar_latency, custom_ar, step, stepmodel
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ctx = RankContext(rank, world, rank, None, Variant("t", world), Path(sys.argv[1]))
_dist.init_dist(ctx, "gloo")
n = _agree.max_numel()

class GlooComm(step.Comm):  # step's backend interface, reduced by gloo
    name, in_place, dtypes = "gloo", True, ("bf16", "fp16")
    def __init__(self):
        self.flat_in = torch.empty(n, dtype=torch.bfloat16)
    def reduce(self, inp, out):
        dist.all_reduce(inp)

class GlooFused(step.Comm):  # allreduce, residual add in bf16, RMSNorm in fp32: as fi-fusion's reference does
    name, fused = "gloo-fused", True
    def __init__(self):
        self.flat_in = torch.empty(n, dtype=torch.bfloat16)
    def fused_op(self, inp, res_in, gamma, res_out, norm_out):
        dist.all_reduce(inp)
        res_out.copy_((inp.float() + res_in.float()).to(torch.bfloat16))
        x = res_out.float()
        norm = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + stepmodel.EPS) * gamma.float()
        if rank == 1:  # a rank that rounds its norm another way: the last element one ulp up
            norm.view(-1)[-1] = norm.view(-1)[-1] * (1 + 2**-7)
        norm_out.copy_(norm.to(torch.bfloat16))

class GlooBackend(ar_latency.Backend):  # ar-latency's backend interface, out of place
    name, dtypes = "gloo-out", ("bf16",)
    def __init__(self):
        self.inp, self.out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    def buffers(self, numel):
        return self.inp[:numel], self.out[:numel]
    def step(self, inp, out):
        def call():
            out.copy_(inp)
            dist.all_reduce(out)
        return call

class GlooAR:  # the custom allreduce's calls (staged eagerly, on its own input captured), reduced by gloo
    def all_reduce_staged(self, inp, out):
        out.copy_(inp)
        dist.all_reduce(out)
    all_reduce_graph = all_reduce_staged
    def register_graph_buffers(self):
        return 0

flat = {k: torch.empty(n, dtype=torch.bfloat16) for k in ("res0", "res_a", "res_b", "norm", "out")}
wanted = [_agree.Case(d, 8, 1024, "eager") for d in ("bf16", "fp16")]
got = {}
for label, bind in (("step", step.agreement_bind(GlooComm(), rank, world, flat)),
                    ("fused", step.agreement_bind(GlooFused(), rank, world, flat)),
                    ("ar", ar_latency.agreement_bind(GlooBackend(), rank, world)),
                    ("custom", custom_ar.agreement_bind(GlooAR(), rank, world, "cpu"))):
    results = _agree.run_cases(bind, wanted, None)
    got[label] = {"results": results, "summary": _agree.summarize(results)}
    passed = {"status": "pass", "note": "", "reason_code": "", "metrics": {}, "evidence": {}}
    got[label]["outcome"] = _agree.apply(passed, got[label]["summary"], label)
Path(sys.argv[1], f"out{rank}.json").write_text(json.dumps(got))
os._exit(0)
"""


@needs_torch
def test_the_probes_bindings_on_gloo_ranks(tmp_path: Path) -> None:
    ranks = _gloo_ranks(tmp_path, 2, "", _PROBES_RANK)
    assert ranks[0] == ranks[1]
    got = ranks[0]
    plain = got["step"]
    assert isinstance(plain, dict)
    assert plain["summary"]["judged"] == 2 and plain["summary"]["ranks_identical"] is True
    assert plain["outcome"]["status"] == "pass"
    # the sums themselves: two random terms rounded once, within an ulp of the exact sum at their magnitude
    assert 0.0 < plain["summary"]["max_ulp_vs_reference"] <= 1.0
    # the fused stand-in: residual agrees, the norm's last element differs on rank 1; fp16 is not its dtype
    fused = got["fused"]
    assert isinstance(fused, dict)
    case = fused["results"]["bf16:eager:8x1024"]
    assert case["outputs"] == ["norm", "residual"] and case["differing"] == 1 and case["divergent_ranks"] == [1]
    assert fused["summary"]["unsupported"] == ["fp16:eager:8x1024"]
    assert (fused["outcome"]["status"], fused["outcome"]["reason_code"]) == ("partial", "rank-divergent")
    # a norm rounded once from fp32 over a residual rounded once is a few ulps from the float64 norm at the
    # magnitude of the terms carried through the row's scaling (at each element's own value, a near-zero
    # element's tiny ulp would read as hundreds)
    assert 0.0 < case["max_ulp_vs_reference"] <= 4.0, case
    out_of_place = got["ar"]
    assert isinstance(out_of_place, dict)
    assert out_of_place["summary"]["ranks_identical"] is True and out_of_place["summary"]["judged"] == 1
    assert 0.0 < out_of_place["summary"]["max_ulp_vs_reference"] <= 1.0
    custom = got["custom"]
    assert isinstance(custom, dict)
    assert custom["summary"]["judged"] == 2 and custom["summary"]["ranks_identical"] is True  # bf16 and fp16
    assert 0.0 < custom["summary"]["max_ulp_vs_reference"] <= 1.0
    assert out_of_place["summary"]["unsupported"] == ["fp16:eager:8x1024"]


_SYMM_RANK = r"""
import json, os, sys
from pathlib import Path
from inenv.probe import RankContext, Variant
from inenv.kit import _agree, _dist
from inenv.probes import symmops
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ctx = RankContext(rank, world, rank, None, Variant("t", world), Path(sys.argv[1]))
_dist.init_dist(ctx, "gloo")
_agree.TOKENS = (1,)  # one decode token per model hidden size: gloo on two shared cores

def gloo_op(inp, out, staged):  # symm-mem's step builders' contract: read staged, leave the sum in out
    def step():
        inp.copy_(staged)
        out.copy_(inp)
        dist.all_reduce(out)
    return step

symmops.steps = lambda group_name: {"one_shot": gloo_op}
buf = torch.empty(_agree.max_numel(), dtype=torch.bfloat16)
found = symmops.agreement(buf, "g", rank, world, None, lambda _: None)
Path(sys.argv[1], f"out{rank}.json").write_text(json.dumps({"results": found, "summary": _agree.summarize(found)}))
os._exit(0)
"""


@needs_torch
def test_symm_mems_binding_on_gloo_ranks(tmp_path: Path) -> None:
    """The symm-mem probe's agreement binding with a gloo stand-in for the op: every model hidden size eagerly;
    the graph cases need CUDA and are recorded as not judged here, never as agreeing."""
    from inenv import models

    ranks = _gloo_ranks(tmp_path, 2, "", _SYMM_RANK)
    assert ranks[0] == ranks[1]
    summary, results = ranks[0]["summary"], ranks[0]["results"]
    assert isinstance(summary, dict) and isinstance(results, dict)
    hiddens = sorted({int(str(d["hidden"])) for d in models.SHAPES.values()})
    assert sorted(k for k, r in results.items() if r["verdict"] == "ok") == sorted(
        f"one_shot:bf16:eager:1x{h}" for h in hiddens)
    assert summary["ranks_identical"] is True and summary["judged"] == len(hiddens)
    assert 0.0 < summary["max_ulp_vs_reference"] <= 1.0
    assert summary["not_judged"] == sorted(f"one_shot:bf16:graph:1x{h}" for h in hiddens)


# --- the integer-valued check of an agreement case (``exact=True``), on gloo ranks --------------------------

_EXACT_RANK = r"""
import json, os, sys
from pathlib import Path
from inenv.probe import RankContext, Variant
from inenv.kit import _agree, _dist
from inenv.probes import custom_ar, step, stepmodel
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ctx = RankContext(rank, world, rank, None, Variant("t", world), Path(sys.argv[1]))
_dist.init_dist(ctx, "gloo")
n = _agree.max_numel()
calls = {"n": 0}

class Planted:  # a custom allreduce's calls, reduced by gloo; from its third call on (the integer one) planted
    def __init__(self, plant):
        self.plant = plant
    def all_reduce_staged(self, inp, out):
        calls["n"] += 1
        if self.plant == "noop" and calls["n"] % 3 == 0:
            return  # launches nothing, raises nothing
        out.copy_(inp)
        dist.all_reduce(out)
        if self.plant == "wrong" and calls["n"] % 3 == 0 and rank == 1:
            out.view(-1)[5] += 1
    all_reduce_graph = all_reduce_staged
    def register_graph_buffers(self):
        return 0

class GlooFused(step.Comm):
    name, fused = "gloo-fused", True
    def __init__(self):
        self.flat_in = torch.empty(n, dtype=torch.bfloat16)
    def fused_op(self, inp, res_in, gamma, res_out, norm_out):
        dist.all_reduce(inp)
        res_out.copy_((inp.float() + res_in.float()).to(torch.bfloat16))
        x = res_out.float()
        norm_out.copy_((x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + stepmodel.EPS) * gamma.float()
                        ).to(torch.bfloat16))

flat = {k: torch.empty(n, dtype=torch.bfloat16) for k in ("res0", "res_a", "res_b", "norm", "out")}
wanted = [_agree.Case(d, 8, 1024, "eager") for d in ("bf16", "fp16")]
got = {}
for plant in ("", "noop", "wrong"):
    calls["n"] = 0
    results = _agree.run_cases(custom_ar.agreement_bind(Planted(plant), rank, world, "cpu"), wanted, None,
                               exact=True)
    got[plant or "working"] = {"results": results, "summary": _agree.summarize(results)}
fused = _agree.run_cases(step.agreement_bind(GlooFused(), rank, world, flat), wanted[:1], None, exact=True)
got["fused"] = {"results": fused}
plain = _agree.run_cases(custom_ar.agreement_bind(Planted(""), rank, world, "cpu"), wanted[:1], None)
got["without"] = {"results": plain}
Path(sys.argv[1], f"out{rank}.json").write_text(json.dumps(got))
os._exit(0)
"""


@needs_torch
def test_the_exact_call_catches_a_kernel_that_did_nothing_or_summed_wrong(tmp_path: Path) -> None:
    ranks = _gloo_ranks(tmp_path, 3, "", _EXACT_RANK)
    assert ranks[0] == ranks[1] == ranks[2]  # every rank records the same exact check
    got = ranks[0]
    working = got["working"]
    assert isinstance(working, dict)
    assert {k: r["exact"]["verdict"] for k, r in working["results"].items()} == {
        "bf16:eager:8x1024": "exact", "fp16:eager:8x1024": "exact"}
    assert working["summary"]["inexact_cases"] == [] and working["summary"]["ranks_identical"] is True
    noop = got["noop"]
    assert isinstance(noop, dict)
    for r in noop["results"].values():  # the output kept the sentinel it was filled with
        assert (r["exact"]["verdict"], r["exact"]["detail"]) == ("no-op", "output equals its prior contents")
    assert noop["summary"]["inexact_cases"] == ["bf16:eager:8x1024", "fp16:eager:8x1024"]
    wrong = got["wrong"]
    assert isinstance(wrong, dict)
    for r in wrong["results"].values():  # one element one too high on rank 1
        assert (r["exact"]["verdict"], r["exact"]["rank"], r["exact"]["mismatches"]) == ("wrong", 1, 1)
    fused = got["fused"]
    assert isinstance(fused, dict)
    case = fused["results"]["bf16:eager:8x1024"]
    assert case["exact"]["verdict"] == "exact" and case["exact"]["norm"]["within_1ulp"] is True
    without = got["without"]
    assert isinstance(without, dict)
    assert "exact" not in without["results"]["bf16:eager:8x1024"]  # the full grid's cases make no exact call


@needs_torch
def test_ulp_spacing_matches_the_definition_by_frexp() -> None:
    import torch

    def by_frexp(x: float, dtype: str) -> float:
        # the ulp of a 16-bit float at |x|: 2**(floor(log2|x|) - fraction bits), subnormals at the smallest normal
        fraction, lowest = {"bf16": (7, -126), "fp16": (10, -14)}[dtype]
        e = math.frexp(abs(x))[1] - 1 if x else lowest
        return 2.0 ** (max(e, lowest) - fraction)

    values = [0.0, -0.0, 1.0, -1.0, 1.5, 3.0, 2.0**-3, 0.7, -123.456, 65504.0, 2.0**-14, 2.0**-15, 2.0**-24,
              2.0**-126, 2.0**-130, 1e-40, 5e-324, 2.0**100, -(2.0**-127)]
    for dtype in ("bf16", "fp16"):
        got = _agree.spacing(torch.tensor(values, dtype=torch.float64), dtype).tolist()
        assert got == [by_frexp(v, dtype) for v in values], dtype


@needs_torch
def test_the_exact_sum_and_its_magnitude_from_one_pass_per_case() -> None:
    import torch

    shape, world = (3, 5), 4
    for seed in (5, 6, 5):  # a case after another reads its own inputs, not the last case's sums
        inputs = [_agree.random_input(shape, r, seed, "bf16").to(torch.float64) for r in range(world)]
        want = inputs[0] + inputs[1] + inputs[2] + inputs[3]
        size = inputs[0].abs() + inputs[1].abs() + inputs[2].abs() + inputs[3].abs()
        assert torch.equal(_agree.exact_sum(shape, world, seed, "bf16", magnitude=True), size)
        assert torch.equal(_agree.exact_sum(shape, world, seed, "bf16"), want)
        assert not torch.equal(_agree.exact_sum(shape, world - 1, seed, "bf16"), want)


@needs_torch
def test_own_error_counts_the_second_call_only_where_it_differs() -> None:
    import torch

    ref = {"out": torch.tensor([1.0, 3.0], dtype=torch.float64)}
    same = {"out": torch.tensor([1.0, 3.0], dtype=torch.bfloat16)}
    off = {"out": torch.tensor([1.0, 3.0 + 2**-6], dtype=torch.bfloat16)}  # one bf16 ulp above 3.0
    assert _agree.own_error(same, same, ref) == 0.0
    assert _agree.own_error(same, off, ref) == 1.0
    assert _agree.own_error(off, same, ref) == 1.0
    # measured at the scale where that is larger: 3.0's error at a magnitude of 6.0 is half an ulp
    assert _agree.own_error(off, off, ref, {"out": torch.tensor([1.0, 6.0], dtype=torch.float64)}) == 0.5


@needs_torch
def test_ranks_that_differ_only_in_the_sign_of_zero_agree_and_are_counted_apart() -> None:
    import torch

    # a sum that cancels gives +0 or -0 by the order of its additions: equal as numbers, so the same decisions
    plus = torch.tensor([0.0, 1.0, 0.0, -2.0], dtype=torch.bfloat16)
    minus = torch.tensor([-0.0, 1.0, -0.0, -2.0], dtype=torch.bfloat16)
    assert not torch.equal(plus.view(torch.int16), minus.view(torch.int16))  # the bits do differ
    first = [{"out": plus.clone()}, {"out": minus.clone()}, {"out": plus.clone()}]
    agreed = _agree.judge(first, first, None, error=0.0)
    assert (agreed.identical, agreed.differing, agreed.divergent_ranks, agreed.zero_signs) == (True, 0, (), 2)
    assert agreed.to_json()["zero_signs"] == 2
    # the sign of a zero flipping between two calls on the same inputs is no change either
    repeat = _agree.judge([{"out": plus.clone()}], [{"out": minus.clone()}], None, error=0.0)
    assert (repeat.deterministic, repeat.changed_on_repeat) == (True, 0)
    # one ulp beside a zero's sign is a divergence, and its count leaves the zeros out
    one_up = minus.clone()
    one_up[1] = 1.0 + 2**-7
    split = _agree.judge([{"out": plus.clone()}, {"out": one_up}], [{"out": plus.clone()}, {"out": one_up}], None,
                         error=0.0)
    assert (split.identical, split.differing, split.max_ulp_between_ranks, split.zero_signs) == (False, 1, 1, 2)
    summary = _agree.summarize({"bf16:graph:1x4": agreed.to_json()})
    assert summary["ranks_identical"] is True and summary["zero_sign_elements"] == 2
    assert summary["divergent_cases"] == []
