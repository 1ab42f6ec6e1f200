"""API generations of flashinfer behind the probes' adapters, on stand-in packages (tests/fake_flashinfer/):
0.5.3 (no MoE all-to-all, no PCIe IPC), 0.6.18 (trtllm_moe_alltoall), 0.7.4 (flashinfer.moe_ep), and a 0.7.4
whose moe_ep is present but breaks on import. The stand-ins take the real modules' arguments (names, order
and kinds, from the 0.6.18 and 0.7.4 sources) and move tokens on CPU tensors, so the adapters are driven
end to end: simulated ranks in one process and real gloo ranks. For simulated ranks the stand-ins also hold
the caller to what the real kernels, which spin on each other, demand of one GPU (``_a2a_fabric.Deadlock``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inenv.kit import _api, _device

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fake_flashinfer"


def _python(version_dir: str, code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES / version_dir), str(FAKES), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


DETECT = """
    import json
    from inenv.kit import _api, _fi_pcie
    from inenv.probes import epmoe
    out = {}
    for name, found in (("moe", epmoe.detect()), ("pcie", _fi_pcie.detect("all-reduce"))):
        out[name] = found.outcome() if isinstance(found, _api.ApiUnknown) else found.name
    print(json.dumps(out))
"""


def test_no_known_api_is_skip_naming_the_version_and_every_name_looked_for() -> None:
    out = _json(_python("fi05", DETECT))
    moe = out["moe"]
    assert (moe["status"], moe["reason_code"]) == ("skip", "probe-api-unknown")
    assert "flashinfer-python 0.5.3" in moe["note"]
    looked = moe["evidence"]["looked_for"]
    assert "flashinfer.moe_ep:create_communication" in looked
    assert "flashinfer.comm.trtllm_moe_alltoall:MoeAlltoAll" in looked
    assert all(name in moe["note"] for name in looked)
    assert moe["evidence"]["version"] == "0.5.3"
    pcie = out["pcie"]
    assert (pcie["status"], pcie["reason_code"]) == ("skip", "probe-api-unknown")
    assert "flashinfer.comm:PcieIpcAllReduceWorkspace" in pcie["note"]


@pytest.mark.parametrize(
    ("version_dir", "moe", "pcie_status"), [("fi06", "trtllm", "skip"), ("fi07", "moe-ep", "skip")]
)
def test_each_generation_is_found_by_its_names(version_dir: str, moe: str, pcie_status: str) -> None:
    out = _json(_python(version_dir, DETECT))
    assert out["moe"] == moe
    # Neither stand-in defines the PCIe IPC workspace: the 0.6 one because 0.6 has none, the 0.7 one to show
    # that an attribute missing from a module that imports is absence too.
    assert out["pcie"]["status"] == pcie_status and out["pcie"]["reason_code"] == "probe-api-unknown"


def test_a_module_that_is_there_but_breaks_on_import_is_not_an_unknown_api() -> None:
    proc = _python("fi07broken", "from inenv.probes import epmoe; print(epmoe.detect())")
    assert proc.returncode != 0
    assert "No module named 'cutlass_dsl_that_is_not_installed'" in proc.stderr


def test_resolve_and_detect_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "h6stand_in"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("class Thing:\n    inner = 3\n")
    (pkg / "broken.py").write_text("raise ImportError('libfoo.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _api.resolve("h6stand_in.sub:Thing.inner") == 3
    assert _api.resolve("h6stand_in.sub:Other") is None
    assert _api.resolve("h6stand_in.absent:Thing") is None
    assert _api.resolve("h6stand_in_absent_package") is None
    with pytest.raises(ImportError, match="libfoo"):
        _api.resolve("h6stand_in.broken:x")
    old = _api.Generation("old", ("h6stand_in.sub:Thing", "h6stand_in.sub:gone"))
    new = _api.Generation("new", ("h6stand_in.newer:Api",))
    found = _api.detect((new, old), "h6stand-in", ("h6stand-in",))
    assert isinstance(found, _api.ApiUnknown)
    assert found.version is None and "(version unknown)" in found.note
    assert found.looked_for == ("h6stand_in.newer:Api", "h6stand_in.sub:Thing", "h6stand_in.sub:gone")
    assert _api.detect((_api.Generation("x", ("h6stand_in.sub:Thing",)), old), "p", ()).name == "x"


@pytest.mark.parametrize("version_dir", ["fi06", "fi07"])
@pytest.mark.parametrize(("mode", "eps"), [("sim", "2,4,8"), ("ranks", "2")])
def test_adapter_routes_and_combines_exactly_on_each_generation(version_dir: str, mode: str, eps: str) -> None:
    """The adapter's calls (argument order and kinds checked by the stand-in), its padding-row handling (the
    stand-in fills padding rows with a real-looking token until the API's sanitising step runs) and its token
    id transport, judged by an oracle independent of the probe."""
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES / version_dir), str(FAKES), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, str(FAKES / "run_a2a.py"), mode, eps],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    out = _json(proc)
    assert out["generation"] == {"fi06": "trtllm", "fi07": "moe-ep"}[version_dir]
    assert sorted(out["ranks"]) == sorted(eps.split(","))
    for ep, ranks in out["ranks"].items():
        assert len(ranks) == int(ep)
        for rank, r in enumerate(ranks):
            assert r["dispatch"] == [] and r["probe_check"] == "", (ep, rank, r)
            assert r["combine_exact"] is True, (ep, rank)
            assert r["workspace_bytes"] > 0


# --- the probe's own dispatch check and its unknown-API verdict ----------------------------------------
def _delivered(rank: int, ep: int, tpr: int, hidden: int, route: list[list[int]]):  # noqa: ANN202
    """What a correct dispatch gives rank ``rank``: tokens in reverse order (the row is the backend's choice),
    padding rows with every expert id invalid."""
    import torch

    from inenv.probes import ep_a2a, epmoe

    ids = torch.zeros(ep, tpr, dtype=torch.int32)
    hid = torch.zeros(ep, tpr, hidden, dtype=torch.bfloat16)
    experts = torch.full((ep, tpr, ep_a2a.TOP_K), epmoe.INVALID_EXPERT, dtype=torch.int32)
    for src in range(ep):
        got = [g for g in range(src * tpr, (src + 1) * tpr) if rank in ep_a2a.targets(route[g])][::-1]
        for j, g in enumerate(got):
            ids[src, j] = g + 1
            hid[src, j] = ep_a2a.hidden_rows(torch.tensor([g]), hidden, "cpu")[0]
            experts[src, j] = torch.tensor(route[g])
    return epmoe.Received(ids, hid, experts)


def test_probe_check_flags_every_kind_of_wrong_delivery() -> None:
    torch = pytest.importorskip("torch")
    from inenv.probes import ep_a2a, epmoe

    ep, tpr, hidden, rank = 4, 5, 16, 1
    route = ep_a2a.routing(ep, tpr)
    good = _delivered(rank, ep, tpr, hidden, route)
    assert ep_a2a.check_received(good, rank, ep, tpr, route) == ""
    src = next(s for s in range(ep) if int(good.raw_ids[s, 0]) and int((good.experts[s, :, 0] < 0).sum()))
    pad = int((good.experts[src, :, 0] >= 0).sum())  # first padding row of that source

    def changed(**kw: object) -> epmoe.Received:
        parts = {"raw_ids": good.raw_ids.clone(), "hidden": good.hidden.clone(), "experts": good.experts.clone()}
        for name, edit in kw.items():
            edit(parts[name])  # type: ignore[operator]
        return epmoe.Received(**parts)

    def bump(t: torch.Tensor) -> None:
        t[src, 0, 3] += 1

    assert "hidden rows differ" in ep_a2a.check_received(changed(hidden=bump), rank, ep, tpr, route)

    def padding_looks_real(t: torch.Tensor) -> None:  # a padding row the API failed to mark
        t[src, pad] = t[src, 0]

    dup = changed(raw_ids=lambda t: t.__setitem__((src, pad), t[src, 0]), experts=padding_looks_real)
    assert "ids" in ep_a2a.check_received(dup, rank, ep, tpr, route)
    # a padding row with a stale id but marked invalid is fine: that is what a padding row is
    stale = changed(raw_ids=lambda t: t.__setitem__((src, pad), 99))
    assert ep_a2a.check_received(stale, rank, ep, tpr, route) == ""

    def lose_my_pick(t: torch.Tensor) -> None:
        g = int(good.raw_ids[src, 0]) - 1
        mine = [k for k, e in enumerate(route[g]) if e // ep_a2a.EXPERTS_PER_RANK == rank]
        t[src, 0, mine[0]] = epmoe.INVALID_EXPERT

    assert "arrived with experts" in ep_a2a.check_received(changed(experts=lose_my_pick), rank, ep, tpr, route)


@pytest.mark.parametrize("mode", ["sim", "gpus"])
def test_ep_a2a_on_a_flashinfer_without_either_api_is_skip_not_fail(tmp_path: Path, mode: str) -> None:
    """flashinfer 0.5.3 has neither MoE all-to-all API: the probe says so before touching a GPU."""
    code = f"""
        import json
        from pathlib import Path
        from inenv.probe import RankContext, Variant
        from inenv.probes import ep_a2a
        params = (("mode", "sim"), ("ep", "2")) if {mode!r} == "sim" else (("mode", "gpus"),)
        ctx = RankContext(0, 1 if {mode!r} == "sim" else 2, 0, 0, Variant("ep-a2a", 1, params), Path({str(tmp_path)!r}))
        print(json.dumps(ep_a2a.run(ctx)))
    """
    o = _json(_python("fi05", code))
    assert (o["status"], o["reason_code"]) == ("skip", "probe-api-unknown")
    assert "flashinfer-python 0.5.3" in o["note"]


# --- simulated ranks: an order of device work a GPU can finish -----------------------------------------
SIMULATE = """
    import json
    import torch
    import _a2a_fabric as fab
    from inenv.probes import epmoe
    from inenv.probes import ep_a2a
    api = epmoe.detect()
    out = {}
    for ep in (2, 8):
        waits = fab.Lanes.waits
        o = ep_a2a.simulate(api, ep, torch.device("cpu"), fab.Lanes(ep), {"sm_count": 132})
        out[ep] = {**o, "waits": fab.Lanes.waits - waits}
    print(json.dumps(out))
"""


@pytest.mark.parametrize(("version_dir", "api"), [("fi06", "trtllm"), ("fi07", "moe-ep")])
def test_probe_simulation_queues_device_work_in_an_order_a_gpu_can_finish(version_dir: str, api: str) -> None:
    """The probe's own simulated-ranks flow (the one run_sim runs on a GPU, at the probe's sizes) on stand-ins
    that refuse every order that deadlocks the spinning kernels: it passes with exact routing and combine.
    The flow committed in 936b18d queued each rank's sanitising kernel right after its dispatch; it hung on
    an H200 at ep=2, 4 and 8 (flashinfer 0.6.18), and the stand-in refuses that order (next test)."""
    pytest.importorskip("torch")
    out = _json(_python(version_dir, SIMULATE, timeout=300))
    for ep, o in out.items():
        assert (o["status"], o["reason_code"], o["note"]) == ("pass", "", ""), (ep, o)
        assert o["evidence"]["api"] == api and o["evidence"]["ep"] == int(ep)
        assert o["metrics"]["workspace_bytes_per_rank"] > 0 and o["metrics"]["sm_count"] == 132
        assert o["waits"] >= 4  # staged, dispatched, padding marked, combined: each waited for


REFUSED = """
    import json
    import torch
    import _a2a_fabric as fab
    from inenv.probes import epmoe
    from inenv.probes import ep_a2a
    api = epmoe.detect()
    ep, tpr = 2, 4
    route = ep_a2a.routing(ep, tpr)
    inputs = [ep_a2a._inputs(r, tpr, 16, route, "cpu") for r in range(ep)]

    def sim():
        a2a = epmoe.open_sim(api, epmoe.Shape(ep, tpr, 16, 2, ep * 2), torch.device("cpu"))
        for r in range(ep):
            a2a.stage(r, *inputs[r])
        return a2a

    def sanitize_after_each_dispatch(lanes):  # the order of the flow that hung (936b18d)
        a2a = sim()
        for r in range(ep):
            with lanes.on(r):
                a2a.dispatch(r)
                a2a.mark_padding(r)

    def one_stream(lanes):  # every rank's dispatch on the current stream
        a2a = sim()
        for r in range(ep):
            a2a.dispatch(r)

    def wait_mid_round(lanes):
        a2a = sim()
        with lanes.on(0):
            a2a.dispatch(0)
        lanes.wait(60)

    def combine_mid_round(lanes):
        a2a = sim()
        with lanes.on(0):
            a2a.dispatch(0)
        with lanes.on(1):
            a2a.combine(1, torch.zeros(ep, tpr, 16, dtype=torch.bfloat16))

    def in_order(lanes):
        a2a = sim()
        recv = epmoe.dispatch_all(a2a, inputs, lanes, 60)
        epmoe.combine_all(a2a, [r.hidden.clone() for r in recv], lanes, 60)

    out = {}
    for case in (sanitize_after_each_dispatch, one_stream, wait_mid_round, combine_mid_round, in_order):
        fab.FABRICS.clear()  # a refused case leaves its round open: on a GPU it would never end
        try:
            case(fab.Lanes(ep))
            out[case.__name__] = ""
        except fab.Deadlock as exc:
            out[case.__name__] = str(exc)
    print(json.dumps(out))
"""


@pytest.mark.parametrize("version_dir", ["fi06", "fi07"])
def test_stand_in_refuses_the_orders_that_hang_spinning_kernels_on_a_gpu(version_dir: str) -> None:
    pytest.importorskip("torch")
    out = _json(_python(version_dir, REFUSED))
    hung = out["sanitize_after_each_dispatch"]
    assert hung.startswith(
        "rank 0's moe_a2a_sanitize_expert_ids queued while the dispatch of ranks [0] waits for "
        "ranks [1], not launched yet"
    )
    assert "ranks 0 and 1 queue their dispatch on one stream (default stream)" in out["one_stream"]
    assert out["wait_mid_round"].startswith("the host's wait of 60 s while the dispatch of ranks [0]")
    assert "rank 1's combine queued while the dispatch of ranks [0] waits for ranks [1]" in out["combine_mid_round"]
    assert out["in_order"] == ""


HANGS = """
    import json
    import torch
    import _a2a_fabric as fab
    from inenv.kit import _device
    from inenv.probes import epmoe
    from inenv.probes import ep_a2a

    class NeverDone(fab.Lanes):
        def wait(self, deadline_s):
            raise _device.Hung(f"{_device.HUNG_WORDS} {deadline_s:.0f} s")

    print(json.dumps(ep_a2a.simulate(epmoe.detect(), 2, torch.device("cpu"), NeverDone(2), {})))
"""


def test_simulated_ranks_that_never_finish_are_device_work_hung_naming_the_step() -> None:
    pytest.importorskip("torch")
    o = _json(_python("fi06", HANGS))
    assert (o["status"], o["reason_code"]) == ("fail", "device-work-hung")
    assert o["note"] == "dispatch of 2 simulated ranks: device work not finished after 60 s"
    assert o["evidence"]["api"] == "trtllm" and o["metrics"]["workspace_bytes_per_rank"] > 0


# --- a hang has its own reason ------------------------------------------------------------------------
# As recorded on 2x H200 (flashinfer 0.6.18, ep-a2a ranks=1,mode=sim,ep=2): the Hung escaped the probe.
RECORDED_HUNG_NOTE = "Hung: device work not finished after 60 s"
RECORDED_HUNG_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/work/main/checks/rank.py", line 68, in run_probe\n'
    "    return _checked(module.run(ctx))\n"
    '  File "/work/main/checks/probes/ep_a2a.py", line 166, in run_sim\n'
    "    _device.wait_device(60)\n"
    '  File "/work/main/checks/probes/_device.py", line 30, in wait_device\n'
    '    raise Hung(f"device work not finished after {deadline_s:.0f} s")\n'
    "inenv.kit._device.Hung: device work not finished after 60 s\n"
)


def test_a_hung_that_escapes_a_probe_is_device_work_hung_not_unknown_error() -> None:
    from checks.results.result import Verdict
    from checks.run.classify import annotate
    from common import reasons
    from inenv.status import Status

    cat = reasons.default()
    v = annotate(Verdict(Status.FAIL, note=RECORDED_HUNG_NOTE, evidence={"traceback": RECORDED_HUNG_TRACEBACK}), cat)
    assert v.reason_code == _device.REASON == "device-work-hung"
    assert v.remediation == cat.get(_device.REASON).remediation  # type: ignore[union-attr]
    assert _device.HUNG_WORDS in RECORDED_HUNG_NOTE  # the message the catalogue matches is the one raised


def test_a_hang_inside_a_lockstep_step_keeps_its_own_reason() -> None:
    from inenv.kit._errors import error_tail
    from inenv.probes import ep_a2a

    hung = error_tail(_device.Hung(f"{_device.HUNG_WORDS} 60 s"))
    assert ep_a2a._a2a_error(hung) == "device-work-hung"
    assert ep_a2a._a2a_error("RuntimeError: CUDA error: an illegal memory access was encountered") == "ep-a2a-error"


def test_wait_device_waits_for_every_stream_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event on the current stream alone does not cover work on torch's side streams (they are created
    non-blocking): the wait records one on each stream given, and gives up while any is unfinished."""
    import types

    done = {"current": True, "lane 0": True, "lane 1": False}
    recorded: list[str] = []

    class Event:
        def record(self, stream: str | None = None) -> None:
            self.stream = stream or "current"
            recorded.append(self.stream)

        def query(self) -> bool:
            return done[self.stream]

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event))
    monkeypatch.setitem(sys.modules, "torch", fake)
    with pytest.raises(_device.Hung, match="device work not finished after 0 s"):
        _device.wait_device(0.05, ["lane 0", "lane 1"])
    assert recorded == ["current", "lane 0", "lane 1"]
    done["lane 1"] = True
    _device.wait_device(0.05, ["lane 0", "lane 1"])
