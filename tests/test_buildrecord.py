"""A cell's build record: one status type and one reader for provision (which writes it) and checks (which
reads it to know what can run)."""

from __future__ import annotations

import ast
import fnmatch
import json
from pathlib import Path

import pytest

from checks.run.plan import ImageState, image_state
from common.build import backend, buildrecord
from common.build.buildrecord import BuildStatus
from provision.cellrecord import previous, record
from tests.checks_helpers import ROOT


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


def test_the_reader_gives_one_typed_value_and_a_wrong_type_reads_as_absent(tmp_path: Path) -> None:
    folder = tmp_path / "cu130-torch2.11.0-sglnone-fi0.6.18"
    folder.mkdir()
    (folder / "build.json").write_text(json.dumps({
        "cell_id": folder.name, "status": "built", "tag": 7, "reason": ["x"], "python": "/v/bin/python",
        "kernels": {"installed": True, "modules": {"vllm_comm": {"carried": True, "sass": ["sm_90a"]}}}}))
    rec = buildrecord.read(folder).record
    assert isinstance(rec, buildrecord.BuildRecord)
    assert (rec.status, rec.backend, rec.tag, rec.reason, rec.python) == (
        BuildStatus.BUILT, "docker", None, "", "/v/bin/python")
    assert dict(rec.carried) == {"vllm_comm": ("sm_90a",)} and rec.runnable
    with pytest.raises(TypeError):
        rec.data["tag"] = "x"  # type: ignore[index]  # read-only: the record as it lies on disk
    assert image_state(tmp_path, folder.name) == (ImageState.FAILED, None, "build status 'built'")


def test_a_build_json_of_a_venv_cell_is_the_venv_record_until_it_has_its_own(tmp_path: Path) -> None:
    folder = tmp_path / "cell"
    folder.mkdir()
    (folder / "build.json").write_text(json.dumps({"status": "built", "backend": "venv", "python": "/a"}))
    shared = buildrecord.read(folder, "venv")
    assert shared.path.name == "build.json" and shared.record is not None and shared.record.python == "/a"
    (folder / "build.json").write_text(json.dumps({"status": "built", "tag": "stackprobe/x:1"}))
    assert buildrecord.read(folder, "venv").record is None  # an image's record is not a venv's
    (folder / "build-venv.json").write_text(json.dumps({"status": "failed", "backend": "venv", "reason": "r"}))
    own = buildrecord.read(folder, "venv")
    assert own.path.name == "build-venv.json" and own.record is not None and own.record.reason == "r"


# What names a build record's file: the table of its file names and a function that gives one's path, then the
# file names themselves, read off the table (common.build.backend.RECORD_NAMES)
RECORD_MARKS = ("RECORD_NAMES", "record_file", *sorted(backend.RECORD_NAMES.values()))


def _globs_a_record(node: ast.AST) -> bool:
    """Whether ``node`` is a call of glob, rglob or iglob with a pattern a build record's file name matches
    (``*/*.json`` lists every record of an envs folder without naming one)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("glob", "rglob", "iglob")):
        return False
    patterns = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return any(fnmatch.fnmatch(f"{folder}{name}", pattern) for pattern in patterns
               for name in RECORD_MARKS[2:] for folder in ("", "cell/", "envs/cell/"))


def _mentions(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` names a build record's file (RECORD_MARKS), lists such files by a glob, or names a
    variable that holds one (``names``)."""
    for sub in ast.walk(node):
        if _globs_a_record(sub):
            return True
        if isinstance(sub, ast.Name) and (sub.id in names or sub.id in RECORD_MARKS):
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in RECORD_MARKS:
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and any(
                m in sub.value for m in RECORD_MARKS[2:]):
            return True
    return False


def raw_record_reads(source: str) -> list[int]:
    """Lines where ``source`` parses JSON from a build record's file itself: json.load(s) of an expression, or
    of a variable assigned or looped from one, that names the file (RECORD_MARKS)."""
    tree = ast.parse(source)
    out = []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]:
        names: set[str] = set()
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and _mentions(node.value, names):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif (isinstance(node, ast.For | ast.comprehension) and _mentions(node.iter, names)
                  and isinstance(node.target, ast.Name)):
                names.add(node.target.id)
        for node in ast.walk(scope):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "load", "loads") and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"
                    and any(_mentions(a, names) for a in node.args)):
                out.append(node.lineno)
    return sorted(set(out))


def test_the_raw_read_check_sees_the_forms_a_record_was_read_in() -> None:
    """What session.py, backend.py, prune.py and the main-job benchmark did before the one reader."""
    forms = {
        "def f(o, c, b):\n    data = json.loads(record_file(o.envs / c, b).read_text())\n": [2],
        "def f(folder):\n    shared = folder / RECORD_NAMES[DOCKER]\n    x = 1\n"
        "    return json.loads(shared.read_text())\n": [4],
        "def f(envs):\n    for f in sorted(envs.glob('*/build.json')):\n        t = json.loads(f.read_text())\n": [3],
        "def f(b, c):\n    name = 'build-venv.json' if b else 'build.json'\n"
        "    return json.loads((ROOT / c / name).read_text())\n": [3],
        "def f(folder):\n    return json.loads((folder / 'cell.json').read_text())\n": [],
        # a raw read of the records: every JSON file of every cell folder, by a glob
        "def f(envs):\n    for path in sorted(envs.glob('*/*.json')):\n        data = json.loads(path.read_text())\n":
            [3],
        "def f(envs):\n    found = list(envs.rglob('build*.json'))\n    return [json.loads(p.read_text()) "
        "for p in found]\n": [3],
        "def f(envs):\n    for path in envs.glob('*/cell.json'):\n        data = json.loads(path.read_text())\n": [],
    }
    assert {src: raw_record_reads(src) for src in forms} == forms


def test_no_module_but_the_reader_parses_a_build_record() -> None:
    """Every read of a build record goes through common.build.buildrecord (its one typed value)."""
    found = [f"{path.relative_to(ROOT)}:{line}"
             for path in sorted([*ROOT.glob("common/**/*.py"), *ROOT.glob("checks/**/*.py"),
                                 *ROOT.glob("provision/**/*.py"), *ROOT.glob("benchmarks/*.py")])
             if path != ROOT / "common" / "build" / "buildrecord.py" for line in raw_record_reads(path.read_text())]
    assert found == []
    assert set(RECORD_MARKS[2:]) == {"build.json", "build-venv.json"}  # the names the forms above are written in
