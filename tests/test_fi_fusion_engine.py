"""fi-fusion's ``case=engine`` (PDL on, decode and prefill counts, the quant-fused patterns) on two CPU gloo ranks,
flashinfer's fused call replaced by an exact gloo stand-in: the probe's own checks pass it, and a call that
raises at one count, or quantized bits that differ between ranks, end both ranks with the verdict that names it.
The GPU path itself runs on a lent GPU host."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checks_helpers import ROOT

_RANK = r"""
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from inenv.probe import RankContext, Variant
from inenv.kit import _device, _dist
from inenv.kit import _flashinfer as fi
from inenv.probes import fi_fusion

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
# CPU stand-ins for what needs a GPU: the probe's own steps and checks run unchanged
_dist.init_dist = lambda ctx, backend="nccl", timeout_s=120.0: torch.device("cpu")
_device.wait_device = lambda deadline_s: None
torch.cuda.get_device_capability = lambda device=None: (10, 0)  # a GPU with FP4 conversions: every pattern runs

class Replay:
    def __init__(self, step, calls):
        self.step, self.calls = step, calls
    def replay(self):
        for _ in range(self.calls):
            self.step()

def capture(step, calls, warmup=3, pool=None, keep=False):
    for _ in range(warmup):
        step()
    return Replay(step, calls)

_device.capture = capture
fi_fusion.HIDDEN = 64  # gloo on two shared cores
FAIL = os.environ.get("STANDIN_FAIL", "")
CALLS = []

class Fusion:
    # allreduce over gloo, residual add and RMSNorm as the reference computes them; quantized bytes from the norm
    api = "stand-in"
    def create_workspace(self, rank, world, max_tokens, hidden, dtype, group):
        pass
    def workspace_bytes(self):
        return 4096
    def fused(self, inp, *, pattern, rank, world, residual_in, residual_out, gamma, eps, norm_out=None,
              quant_out=None, scale_out=None, scale_factor=None, output=None, use_oneshot=None,
              launch_with_pdl=False):
        CALLS.append((pattern, inp.shape[0], launch_with_pdl))
        if FAIL == f"{pattern}-{inp.shape[0]}":
            raise RuntimeError("CUDA error: invalid argument")
        total = inp.float().clone()
        dist.all_reduce(total)
        res, norm = fi_fusion.reference(total.bfloat16(), residual_in, gamma)
        residual_out.copy_(res)
        if norm_out is not None:
            norm_out.copy_(norm)
        if quant_out is not None:
            q = quant_out.view(torch.uint8)
            q.copy_((norm.float()[:, : q.shape[1]] * 8).round().to(torch.int64).remainder(251).to(torch.uint8))
            if FAIL == "quant-rank1" and rank == 1:
                q[0, 0] += 1

fi.Fusion = Fusion
ctx = RankContext(rank, world, rank, 0, Variant("fi-fusion", world, params=(("case", "engine"),), share_gpu=True,
                                              gpus=1), Path(sys.argv[1]))
result = fi_fusion.run(ctx)
result["calls"] = sorted(set(CALLS))
Path(sys.argv[1], f"{FAIL or 'none'}-{rank}.json").write_text(json.dumps(result))
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(tmp_path: Path, fail: str) -> list[dict[str, object]]:
    script = tmp_path / "standin.py"
    script.write_text(_RANK)
    port = _free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT), STANDIN_FAIL=fail)
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()[-3000:]
    return [json.loads((tmp_path / f"{fail or 'none'}-{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize(("fail", "status", "code", "note"), [
    ("", "pass", "", ""),
    ("nvfp4-2048", "fail", "fi-fusion-size-failed", "nvfp4 at 2048 tokens raised: RuntimeError: CUDA error: invalid "
     "argument"),
    ("quant-rank1", "fail", "fi-fusion-wrong", "fp8 at 1 tokens eager: the quantized bits differ between ranks"),
])
def test_the_engine_case_checks_every_pattern_and_count_and_names_what_failed(
        tmp_path: Path, fail: str, status: str, code: str, note: str) -> None:
    results = _ranks(tmp_path, fail)
    assert [(r["status"], r["reason_code"]) for r in results] == [(status, code)] * 2, results[0]["note"]
    assert results[0]["note"] == results[1]["note"] == note
    calls = {tuple(c) for c in results[0]["calls"]}  # type: ignore[union-attr]
    assert {p for p, _, _ in calls} == {"rmsnorm", "fp8", "nvfp4"} and {pdl for _, _, pdl in calls} == {True}
    if not fail:
        assert {n for _, n, _ in calls} == {1, 8, 32, 128, 512, 2048}  # decode, verify and prefill counts
        checks = results[0]["evidence"]["checks"]  # type: ignore[index]
        assert len(checks) == 6 * 3 * 2 and all(r["ok"] for r in checks.values())
        assert "latency_us" not in results[0]["metrics"]  # ranks sharing a GPU: checked, not timed


def test_the_engine_headline_names_the_smallest_a_middle_and_the_largest_count() -> None:
    from inenv.probes import fi_fusion

    got = fi_fusion.engine_headline({"1": 8.04, "8": 8.5, "32": 9.1, "128": 12.0, "512": 40.2, "2048": 150.0})
    assert got == "PDL on, residual+RMSNorm graph: 1 tok 8.0 µs, 128 tok 12.0 µs, 2048 tok 150.0 µs"
    assert fi_fusion.engine_patterns(9) == ("rmsnorm", "fp8") and fi_fusion.engine_patterns(12)[-1] == "nvfp4"
