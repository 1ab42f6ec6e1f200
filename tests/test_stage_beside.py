"""The full level beside the kernel stage `provision build` leaves running: what the stage builds is read from its
job (common.build.kernelstage.building), the variants that need a module it builds are held back
(checks.run.plan.awaiting_stage), everything else runs at once, and after the stage the held-back variants run
while the rest is carried over, not run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checks.cli import main
from checks.results.store import read_file
from checks.run.plan import Decided, WorkItem, awaiting_stage
from common.build import kernelstage
from inenv.probe import ProbeSpec, Variant
from inenv.status import Status
from tests.checks_helpers import FIXTURES, ROOT

STAGE_FIXTURES = ROOT / "tests" / "probes_fixtures_stage"


def _stand_in(folder: Path, script: str) -> subprocess.Popen[bytes]:
    """A process whose command line names the stage's module and ``folder``'s job file, as the real stage's does."""
    return subprocess.Popen([sys.executable, "-c", script, kernelstage.MARKER, str(kernelstage.job_path(folder))],
                            cwd=folder)


def _stage(folder: Path, job: object, script: str = "import time; time.sleep(30)") -> subprocess.Popen[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    kernelstage.job_path(folder).write_text(json.dumps(job))
    log = folder / kernelstage.LOG
    log.write_text("")
    proc = _stand_in(folder, script)
    kernelstage.write_state(kernelstage.Stage(proc.pid, time.time(), log, 1), folder)
    return proc


def test_what_the_running_stage_builds_is_read_from_its_job(tmp_path: Path) -> None:
    folder = tmp_path / "stage"
    proc = _stage(folder, {"cells": ["cell-a", "cell-b", 7, ""], "modules": ["trtllm_comm", "moe_a2a", None]})
    try:
        assert kernelstage.building(folder) == {"cell-a": ("trtllm_comm", "moe_a2a"),
                                                "cell-b": ("trtllm_comm", "moe_a2a")}
    finally:
        proc.kill()
        proc.wait()
    assert kernelstage.building(folder) == {}  # the stage is gone: nothing to hold back


@pytest.mark.parametrize("job", [{"cells": "cell-a", "modules": ["trtllm_comm"]}, {"cells": ["cell-a"]},
                                 ["cell-a"], {"cells": ["cell-a"], "modules": []}])
def test_a_job_of_odd_shape_holds_nothing_back(tmp_path: Path, job: object) -> None:
    folder = tmp_path / "stage"
    proc = _stage(folder, job)
    try:
        assert kernelstage.building(folder) == {}
    finally:
        proc.kill()
        proc.wait()


def test_a_job_file_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    folder = tmp_path / "stage"
    proc = _stage(folder, {})
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"cells": ["cell-a"], "modules": ["trtllm_comm"]}))
    kernelstage.job_path(folder).unlink()
    kernelstage.job_path(folder).symlink_to(elsewhere)
    try:
        assert kernelstage.building(folder) == {}
    finally:
        proc.kill()
        proc.wait()


def _item(cell: str, spec: ProbeSpec, params: tuple[tuple[str, str], ...], **kw: object) -> WorkItem:
    from types import SimpleNamespace
    return WorkItem(SimpleNamespace(cell_id=cell), spec, Variant(spec.id, spec.ranks[0], params), 60.0, **kw)  # type: ignore[arg-type]


def test_the_variants_that_need_a_module_the_stage_builds_in_their_cell_wait_for_it() -> None:
    jit = ProbeSpec(id="fi-jit", title="t", feature="f", ranks=(1,), needs_gpu=False, build_param="module")
    ipc = ProbeSpec(id="pcie-ipc", title="t", feature="f", ranks=(2,))
    other = ProbeSpec(id="inventory", title="t", feature="f", ranks=(1,), needs_gpu=False)
    items = [
        _item("a", jit, (("module", "trtllm_comm"), ("arch", "12.0a"))),  # builds what the stage builds in a
        _item("a", jit, (("module", "vllm_comm"), ("arch", "12.0a"))),  # the quick module: not the stage's
        _item("b", jit, (("module", "trtllm_comm"), ("arch", "12.0a"))),  # a cell the stage builds nothing in
        _item("a", ipc, (("op", "all-reduce"),)),  # loads pcie_ipc (the flashinfer kit's entry)
        _item("a", ipc, (("op", "all-gather"),)),  # loads pcie_ipc_ag_rs, not being built
        _item("a", other, ()),
        _item("a", jit, (("module", "pcie_ipc"), ("arch", "12.0f")),
              decided=Decided(Status.SKIP, "no-gpu", "planned")),  # decided already: kept as it is
    ]
    out = awaiting_stage(items, {"a": ("trtllm_comm", "pcie_ipc")})
    held = [(it.cell.cell_id, it.variant.key) for it in out
            if it.decided is not None and it.decided.reason_code == "awaiting-kernel-stage"]
    assert held == [("a", "ranks=1,module=trtllm_comm,arch=12.0a"), ("a", "ranks=2,op=all-reduce")]
    assert out[0].decided is not None and out[0].decided.status is Status.NOT_RUN
    assert "trtllm_comm" in out[0].decided.note and "pcie_ipc" in out[3].decided.note  # type: ignore[union-attr]
    assert [it.runs for it in out] == [False, True, True, False, True, True, False]
    assert out[6].decided == Decided(Status.SKIP, "no-gpu", "planned")
    assert awaiting_stage(items, {}) == items


def _rows(results: Path) -> dict[str, list[tuple[str, str, str, str]]]:
    """Per run file: (variant, status, reason code, the run it was carried from) of every t-stage-needs result."""
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    for path in sorted(results.glob("*/*.jsonl")):
        stored, warnings = read_file(path)
        assert warnings == []
        out[path.stem] = sorted((r.variant, r.verdict.status.value, r.verdict.reason_code,
                                 str(r.verdict.evidence.get("reused_from", "")))
                                for r in stored if r.probe_id == "t-stage-needs")
    return out


def test_a_full_pass_beside_the_stage_runs_what_needs_none_of_it_and_the_rest_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", os.pathsep.join((str(STAGE_FIXTURES), str(FIXTURES))))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setattr(kernelstage, "FOLDER", tmp_path / "stage")
    # this environment's cell id, as `checks run --backend local` names it
    assert main(["run", "--backend", "local", "--level", "full", "--probe", "t-trivial", "--json", "--no-report",
                 "--results", str(tmp_path / "pre")]) == 0
    cell = json.loads(capsys.readouterr().out)[0]["cell_id"]
    results = tmp_path / "results"
    # the stand-in stage ends once the pass beside it has recorded both its variants (the one it held back and
    # the one it ran), so the held-back one cannot have run before the stage ended
    script = ("import pathlib, sys, time\n"
              f"root = pathlib.Path({str(results)!r})\n"
              "deadline = time.monotonic() + 120\n"
              "def both():\n"
              "    text = ''.join(p.read_text() for p in root.glob('*/*.jsonl'))\n"
              "    return 'awaiting-kernel-stage' in text and 'module=vllm_comm' in text\n"
              "while time.monotonic() < deadline and not both():\n"
              "    time.sleep(0.1)\n"
              "time.sleep(1.0)\n")
    proc = _stage(tmp_path / "stage", {"cells": [cell], "modules": ["trtllm_comm"]}, script)
    try:
        code = main(["run", "--backend", "local", "--level", "full", "--probe", "t-stage-needs", "--no-report",
                     "--results", str(results)])
    finally:
        proc.kill()
        proc.wait()
    said = capsys.readouterr().err
    assert code == 0, said
    beside, after = _rows(results).items()
    assert beside[1] == [("ranks=1,module=trtllm_comm", "not-run", "awaiting-kernel-stage", ""),
                         ("ranks=1,module=vllm_comm", "pass", "", "")]
    assert after[1] == [("ranks=1,module=trtllm_comm", "pass", "", ""),
                        ("ranks=1,module=vllm_comm", "pass", "", beside[0])]  # carried, not run again
    assert "beside the kernel stage (every variant but the 1 that need what it builds" in said
    assert "the kernel stage has ended (the full level's pass beside it took " in said
    assert "now the 1 variant(s) that needed what it built" in said


def test_with_no_stage_running_the_full_pass_is_one_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", os.pathsep.join((str(STAGE_FIXTURES), str(FIXTURES))))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setattr(kernelstage, "FOLDER", tmp_path / "stage")
    results = tmp_path / "results"
    assert main(["run", "--backend", "local", "--level", "full", "--probe", "t-stage-needs", "--no-report",
                 "--results", str(results)]) == 0
    assert list(_rows(results).values()) == [[("ranks=1,module=trtllm_comm", "pass", "", ""),
                                              ("ranks=1,module=vllm_comm", "pass", "", "")]]
    assert "beside the kernel stage" not in capsys.readouterr().err
