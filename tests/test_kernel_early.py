"""The quick module carried while the images still build (provision.kernels.early), the order one builder takes
(provision.build.grouped) and what the kernel stage after the builds is left (left_over, carry_kernels)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from common.build import backend, kernelstage
from provision import kernels
from provision.build import grouped, spread
from provision.kernels.early import EarlyQuick, family, left_over

FI_A = {"flashinfer": "0.7.4", "torch_cuda": "13.0"}
FI_B = {"flashinfer": "0.6.17", "torch_cuda": "13.0"}


def rec(cid: str, versions: dict[str, str] = FI_A, status: str = "built") -> dict[str, Any]:
    return {"cell_id": cid, "status": status, "versions": versions}


def test_one_builder_builds_each_torch_builds_cells_together_the_biggest_group_first() -> None:
    # (cell, torch build) as the lock gives them: the torch build no other cell shares comes last
    steps = [("c1", "t214"), ("cu128", "t29"), ("c3", "t215"), ("c4", "t214"), ("c5", "t215"), ("c6", "t214")]
    assert [c for c, _ in grouped(steps, lambda s: s[1])] == ["c1", "c4", "c6", "c3", "c5", "cu128"]
    # parallel builders keep apart the cells of one torch build
    assert [c for c, _ in spread(steps, lambda s: s[1])] == ["c1", "cu128", "c3", "c4", "c5", "c6"]


def test_the_family_of_a_record_is_its_flashinfer_and_cuda() -> None:
    assert family(rec("x")) == ("0.7.4", "13.0")
    assert family({"cell_id": "y", "versions": "odd"}) == (None, None)


def test_the_stage_after_the_builds_gets_the_cells_not_carried_and_the_twins_they_copy_from() -> None:
    archs = {"a1": ("9.0a",), "a2": ("9.0a",), "b1": ("9.0a",), "b2": ("9.0a",)}
    records = [rec("a1"), rec("a2"), rec("b1", FI_B), rec("b2", FI_B)]
    assert left_over(archs, records, {"a1", "a2", "b1", "b2"}) == {}
    # b2 was still queued when the builds ended: its twin b1 comes along, so b2 copies b1's build
    assert left_over(archs, records, {"a1", "a2", "b1"}) == {"b1": ("9.0a",), "b2": ("9.0a",)}
    assert left_over(archs, records, set()) == archs


def wait_for(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class FakeCarry:
    """Stands in for stage.carry: records which cells each call was given, marks them carried."""

    def __init__(self, fail: str = "", hold: threading.Event | None = None) -> None:
        self.calls: list[tuple[list[str], dict[str, tuple[str, ...]], int]] = []
        self.fail = fail
        self.hold = hold
        self.started = threading.Event()

    def __call__(self, records: list[dict[str, Any]], archs: dict[str, tuple[str, ...]], jobs: int, *args: Any,
                 **kw: Any) -> list[dict[str, Any]]:
        assert kw["modules"] == kernels.QUICK_MODULES
        self.calls.append(([str(r["cell_id"]) for r in records], dict(archs), jobs))
        self.started.set()
        if self.hold is not None:
            assert self.hold.wait(30)
        if records[-1]["cell_id"] == self.fail:
            raise OSError("docker: daemon gone")
        return [{**r, "kernels": {"modules": {"vllm_comm": {"carried": True}}}} for r in records]


def test_each_built_cell_is_carried_in_turn_with_the_carried_cells_of_its_family(tmp_path: Path) -> None:
    fake = FakeCarry(fail="bad")
    said: list[str] = []
    archs = {c: ("9.0a", "12.0f") for c in ("a1", "b1", "a2", "bad")}  # "none" carries no kernels
    early = EarlyQuick(archs, tmp_path, lambda cid, m: said.append(f"{cid} {m}"), carrier=fake, enabled=True)
    built = [rec("a1"), rec("b1", FI_B), rec("a2"), rec("failed", status="failed"), rec("none"), rec("bad")]
    for r in built:  # each build ends after the one before it was carried
        early.add(r)
        cid = r["cell_id"]
        wait_for(lambda cid=cid: cid in early.carried or said or cid in ("failed", "none"))
    out = early.finish(built)
    assert [c[0] for c in fake.calls] == [["a1"], ["b1"], ["a1", "a2"], ["a1", "a2", "bad"]]
    assert all(jobs == 1 for _, _, jobs in fake.calls)  # one compile at a time: the builds keep a core
    assert fake.calls[2][1] == {"a1": ("9.0a", "12.0f"), "a2": ("9.0a", "12.0f")}
    assert early.carried == {"a1", "b1", "a2"}
    assert [("kernels" in r) for r in out] == [True, True, True, False, False, False]
    assert said == ["bad kernels: the quick module is left to the stage after the builds (docker: daemon gone)"]


def test_when_the_builds_end_the_cell_in_hand_finishes_and_the_queued_ones_are_left(tmp_path: Path) -> None:
    hold = threading.Event()
    fake = FakeCarry(hold=hold)
    early = EarlyQuick({"a1": ("9.0a",), "b1": ("9.0a",)}, tmp_path, lambda cid, m: None, carrier=fake,
                       enabled=True)
    early.add(rec("a1"))
    assert fake.started.wait(30)
    early.add(rec("b1", FI_B))  # queued behind a1
    done: list[list[dict[str, Any]]] = []
    finisher = threading.Thread(target=lambda: done.append(early.finish([rec("a1"), rec("b1", FI_B)])))
    finisher.start()
    finisher.join(0.3)
    assert finisher.is_alive()  # it waits for the cell in hand
    hold.set()
    finisher.join(30)
    assert [c[0] for c in fake.calls] == [["a1"]] and early.carried == {"a1"}
    assert "kernels" in done[0][0] and "kernels" not in done[0][1]


def test_nothing_is_carried_early_while_an_earlier_builds_stage_runs(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCarry()
    monkeypatch.setattr(kernelstage, "running", lambda folder=None: SimpleNamespace(pid=1))
    early = EarlyQuick({"a1": ("9.0a",)}, tmp_path, lambda cid, m: None, carrier=fake)
    early.add(rec("a1"))
    assert early.finish([rec("a1")]) == [rec("a1")] and fake.calls == [] and early.carried == frozenset()


def test_provision_build_carries_a_cells_quick_module_while_the_next_builds_and_not_again_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real carry on venv cells of this environment (no flashinfer here, so each build says so fast): the
    first cell's quick module is carried while the second cell still builds; the stage after the builds compiles
    no quick module again and starts the long ones for both."""
    from common.resolve import RESOLVED
    from provision import buildsession
    from provision.options import BuildOptions

    monkeypatch.setattr(kernelstage, "FOLDER", tmp_path / "state")
    monkeypatch.setattr(kernels.jobs, "KERNELS", tmp_path / "kernels")
    monkeypatch.setenv("STACKPROBE_COMPILE_CACHE", str(tmp_path / "cache"))
    envs = tmp_path / "envs"
    records = []
    for cid in ("cellx", "celly"):
        (envs / cid).mkdir(parents=True)
        r = {"cell_id": cid, "status": "built", "backend": backend.VENV, "python": sys.executable,
             "base_python": sys.executable, "versions": {"flashinfer": f"0.7.{len(records)}", "torch_cuda": "13.0"}}
        (envs / cid / backend.RECORD_NAMES[backend.VENV]).write_text(json.dumps(r))
        records.append(r)
    said: list[str] = []
    first_carried = threading.Event()

    def report(cid: str, msg: str) -> None:
        said.append(f"{cid} {msg}".strip())
        if cid == "cellx" and msg.startswith("kernels: vllm_comm not carried"):
            first_carried.set()

    class Builder:
        def build(self, folders: Any, opts: Any, report: Any, on_built: Any) -> list[dict[str, Any]]:
            on_built(records[0])
            # the second cell "builds" until the first one's quick module is carried
            assert first_carried.wait(120), said
            said.append("celly built")
            on_built(records[1])
            return records

    monkeypatch.setattr(buildsession, "reporter", lambda o: report)
    opts = BuildOptions(tmp_path / "matrix.yaml", envs=envs, kernel_archs=("9.0a",), kernel_jobs=1)
    cells = [SimpleNamespace(cell_id=c, status=RESOLVED) for c in ("cellx", "celly")]
    built, carried = buildsession.build_carrying_early(Builder(), [], cells, opts, None)  # type: ignore[arg-type]
    assert said.index("celly built") > said.index(next(m for m in said if m.startswith("cellx kernels: vllm_comm")))
    # celly's build ended last: carried early when the thread took it before the builds ended, else left over
    assert "cellx" in carried and "kernels" in built[0]
    assert ("kernels" in built[1]) == ("celly" in carried)
    said.clear()
    out = buildsession.carry_kernels(cells, built, opts, None, carried)  # type: ignore[arg-type]
    again = [m.split()[0] for m in said if "kernels: [" in m and "vllm_comm" in m]
    assert again == ([] if "celly" in carried else ["celly"]), said  # no quick module twice
    assert any("go on after this command" in m for m in said)
    assert kernelstage.wait(said.append, poll_s=0.2)
    assert all(o["kernels"]["modules"]["vllm_comm"]["reason_code"] == "fi-jit-error" for o in out)
