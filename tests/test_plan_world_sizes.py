"""World sizes: the planner fed an 8-GPU host's facts plans every multi-rank probe at 2..8 ranks, a smaller host
runs shareable backends at the larger sizes with ranks sharing GPUs, and NCCL says why it cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checks.results import hostfacts
from checks.run.plan import CellState, CellTarget, plan_work
from inenv import registry
from inenv.probe import HostView, Variant, key_parts, world_sizes

ROOT = Path(__file__).resolve().parent.parent
# The committed 2x H200 run's host facts, as `checks run` records them
FACTS = ROOT / "results" / "h200x2-5bce98f7" / "20261201T021126Z-b42a.manifest.json"
# The probes whose variants run several ranks (an allreduce or an all-to-all over 2 or more)
MULTI_RANK = ("ar-latency", "custom-ar", "ep-a2a", "fi-fusion", "load", "nccl-graphs", "pcie-ipc", "step", "symm-mem")


def _plan(gpus: int) -> list[Variant]:
    facts = dict(json.loads(FACTS.read_text())["facts"], gpu_count=gpus)
    probes = {pid: mod for pid, (_, mod) in registry.discover().items()}
    cell = CellTarget("local-x", CellState.LOCAL)
    return [it.variant for it in plan_work([cell], probes, hostfacts.host_view(facts))]


def test_every_multi_rank_probe_is_planned_at_every_world_size_of_an_8_gpu_host() -> None:
    plan = _plan(8)
    for pid in MULTI_RANK:
        runs = {v.ranks for v in plan if v.probe_id == pid and v.skip is None and not v.share_gpu and v.ranks > 1}
        # ar-latency only times: at the deep world sizes only; load asks the same of every world size: on a host
        # of more than 4 GPUs at 2 ranks and at the GPU count (tests/test_plan_depth.py, tests/test_probe_load.py)
        want = {"ar-latency": {2, 4, 8}, "load": {2, 8}}.get(pid, {2, 3, 4, 5, 6, 7, 8})
        assert runs == want, pid
        # each one's GPU count is its rank count: a GPU per rank
        assert all(v.gpu_count == v.ranks for v in plan if v.probe_id == pid and not v.share_gpu and v.ranks > 1)
    # every multi-rank probe is in the list above; host-p2p's two ranks are one pair of GPUs, not a world size
    assert {v.probe_id for v in plan if v.ranks > 1} == {*MULTI_RANK, "host-p2p"}
    assert {v.ranks for v in plan if v.probe_id == "host-p2p"} == {1, 2}


def test_world_sizes() -> None:
    assert world_sizes(HostView(gpu_count=0)) == (2, 3, 4, 8)
    assert world_sizes(HostView(gpu_count=1)) == (2, 3, 4, 8)
    assert world_sizes(HostView(gpu_count=6)) == (2, 3, 4, 5, 6, 8)
    assert world_sizes(HostView(gpu_count=8)) == (2, 3, 4, 5, 6, 7, 8)


def test_one_gpu_shares_it_where_the_backend_can_and_nccl_says_why_not() -> None:
    plan = _plan(1)
    step = [v for v in plan if v.probe_id == "step"]
    shared = {(v.param("backend"), v.ranks) for v in step if v.share_gpu and v.skip is None}
    backends = {v.param("backend") for v in step} - {"nccl"}
    # their own probes check agreement when shared
    elsewhere = {"flashinfer-custom-ar", "symm-mem-one-shot", "flashinfer-pcie-ipc", "flashinfer-fusion"}
    assert shared == {(b, n) for b in backends for n in (2, 3, 4, 8) if b not in elsewhere or n == 2}
    narrowed = {(v.param("backend"), v.ranks) for v in step if v.share_gpu and v.skip is not None}
    assert narrowed == {(b, n) for b in elsewhere for n in (3, 4, 8)}
    nccl = [v for v in step if v.param("backend") == "nccl"]
    assert sorted(v.ranks for v in nccl) == [2, 3, 4, 8]
    assert all(v.skip is not None and "NCCL refuses two ranks on one GPU" in v.skip.note for v in nccl)
    # the shared variants say so in their key: placement and the GPU count they share
    keys = {v.key for v in step if v.share_gpu}
    assert "ranks=8,placement=shared,gpus=1,backend=flashinfer-fusion" in keys
    assert dict(key_parts("ranks=8,placement=shared,gpus=1,backend=flashinfer-fusion"))["placement"] == "shared"
    for pid in ("symm-mem", "fi-fusion", "pcie-ipc", "custom-ar"):
        assert {v.ranks for v in plan if v.probe_id == pid and v.share_gpu and v.skip is None} == {2, 3, 4, 8}, pid
    for pid in ("ar-latency", "nccl-graphs"):  # time or NCCL: a GPU per rank or nothing
        assert not [v for v in plan if v.probe_id == pid and v.share_gpu], pid


@pytest.mark.parametrize("gpus", [2, 4])
def test_a_shared_variant_wraps_over_the_gpus_it_names(gpus: int) -> None:
    from inenv.worker import device_for, placed_on

    plan = _plan(gpus)
    pcie = next(v for v in plan if v.probe_id == "pcie-ipc" and v.share_gpu and v.ranks == 8)
    assert pcie.gpus == gpus
    assert [device_for(i, placed_on(pcie, gpus), True) for i in range(8)] == [i % gpus for i in range(8)]
    fusion = next(v for v in plan if v.probe_id == "fi-fusion" and v.share_gpu and v.ranks == 8 and v.skip is None)
    assert fusion.gpus == 1 and [device_for(i, placed_on(fusion, gpus), True) for i in range(8)] == [0] * 8
    assert Variant.from_json(json.loads(json.dumps(fusion.to_json()))) == fusion
