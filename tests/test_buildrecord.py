"""A cell's build record: one status type and one reader for provision (which writes it) and checks (which
reads it to know what can run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checks.run.plan import ImageState, image_state
from common import buildrecord
from common.buildrecord import BuildStatus
from provision.cellrecord import previous, record


@pytest.mark.parametrize(("status", "runs"), [("built", True), ("skipped-unchanged", True), ("failed", False),
                                              ("would-build", False), ("great", False), (None, False)])
def test_a_records_status_says_whether_its_cell_can_run(status: str | None, runs: bool) -> None:
    rec = {} if status is None else {"status": status}
    assert buildrecord.runnable(rec) is runs
    assert (BuildStatus.of(rec) is None) is (status in (None, "great"))


def test_what_provision_writes_is_what_checks_reads(tmp_path: Path) -> None:
    folder = tmp_path / "cu130-torch2.11.0-sglnone-fi0.6.18"
    folder.mkdir()
    assert image_state(tmp_path, folder.name)[0] is ImageState.MISSING  # nothing built yet
    record(folder, status=BuildStatus.BUILT, tag="stackprobe/x:1")
    on_disk = json.loads((folder / "build.json").read_text())
    assert on_disk["status"] == "built" and isinstance(on_disk["status"], str)
    assert image_state(tmp_path, folder.name) == (ImageState.BUILT, "stackprobe/x:1", "")
    assert buildrecord.read(folder).status is BuildStatus.BUILT and previous(folder)["tag"] == "stackprobe/x:1"
    record(folder, status=BuildStatus.FAILED, tag="stackprobe/x:2", reason="self-check: torch is 2.9.1")
    assert image_state(tmp_path, folder.name) == (ImageState.FAILED, "stackprobe/x:2", "self-check: torch is 2.9.1")
    (folder / "build.json").write_text("{not json")
    loaded = buildrecord.read(folder)
    assert loaded.record is None and loaded.problem.startswith("unreadable") and previous(folder) == {}
    state, _, why = image_state(tmp_path, folder.name)
    assert state is ImageState.MISSING and "unreadable" in why and "rerun `provision build" in why
