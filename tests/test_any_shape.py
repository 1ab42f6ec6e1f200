"""A value of any shape in a result, a manifest or a bundle never breaks a report: real committed runs (an H100
host's and a CPU host's engine gates) with their fields replaced by values of other shapes (mixed-type keys,
mixed lists, text for numbers, deep nesting, copies of the result inside itself) go through every rendering
path in-process (`checks report` with its HTML page, `checks advise` as text, JSON and with a model, `checks
validate` of the folder and of a bundle, `checks share`, and `checks import`'s preview against the host's own
runs) with no traceback; each field the reader refuses is one warning naming it, and the rest still renders."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from checks.cli import main as checks_main
from checks.report import gates
from checks.results import reader
from tests.checks_helpers import ROOT

H100 = "h100-80gb-hbm3x1-8f3e4eb6"  # step, ar-latency, symm-mem, custom-ar... from a 1x H100 host
CPU = "cpu-7eb23414"
ENGINE_RUNS = ("20261204T234512Z-f822", "20261204T234410Z-f6b7")  # the engine probe's gate tables, read on CPU
RENAMED = {"20261206T064804Z-1400": "20261206T070804Z-1400", "20261206T064844Z-1d2b": "20261206T070844Z-1d2b"}

SHAPES: dict[str, Any] = {
    "mixed-keys": {"9.0": 1, "sm90": "x", "10": [1, "a"], "": None, "1.2.3": {"4": 5}},
    "mixed-list": [1, "a", None, {"k": [1]}, [2, "b"], True, 1.5],
    "text": "sm_90a`<b>|x\x1b[31m",
    "number": -3,
    "deep": {"a": {"a": {"a": {"a": {"a": [{"a": {}}]}}}}},
}


def _files() -> list[tuple[str, Path]]:
    out = [(H100, f) for f in sorted((ROOT / "results" / H100).iterdir())]
    return out + [(CPU, f) for f in sorted((ROOT / "results" / CPU).iterdir()) if f.name.startswith(ENGINE_RUNS)]


def _leaves(obj: Any, value: Any) -> None:
    """Every value that is neither an object nor a list, anywhere under ``obj``, replaced by ``value``."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in list(items):
        if isinstance(v, dict | list):
            _leaves(v, value)
        else:
            obj[k] = copy.deepcopy(value)


def _more_keys(obj: Any, value: Any) -> None:
    """Every object under ``obj`` given keys a compute-capability table could hold, of mixed spelling."""
    if isinstance(obj, dict):
        for v in list(obj.values()):
            _more_keys(v, value)
        obj.update({"9.0": copy.deepcopy(value), "sm90": copy.deepcopy(value), "12": copy.deepcopy(value)})
    elif isinstance(obj, list):
        for v in obj:
            _more_keys(v, value)


def _results(mode: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(r: dict[str, Any]) -> dict[str, Any]:
        r = copy.deepcopy(r)
        if mode == "evidence-leaves":
            _leaves(r["evidence"], value)
        elif mode == "evidence-keys":
            _more_keys(r["evidence"], value)
        elif mode == "metrics":
            r["metrics"] = {k: copy.deepcopy(value) for k in r["metrics"]}
        elif mode == "self":  # the result inside itself, its run as where it was reused from
            r["evidence"] = {**r["evidence"], "reused_from": r["run_id"], "inputs": copy.deepcopy(r),
                             "agreement": {"divergent_cases": copy.deepcopy(r)}}
            r["metrics"] = {**r["metrics"], "self": copy.deepcopy(r["metrics"])}
        return r
    return edit


def _manifest(value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(m: dict[str, Any]) -> dict[str, Any]:
        m = copy.deepcopy(m)
        for part in ("facts", "cells", "probes", "code"):
            _leaves(m.get(part), value)
        return m
    return edit


def _layout(folder: Path, results: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
            manifest: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Path:
    for host, f in _files():
        (folder / host).mkdir(parents=True, exist_ok=True)
        if f.suffix == ".jsonl" and results is not None:
            lines = [results(json.loads(ln)) for ln in f.read_text().splitlines() if ln.strip()]
            (folder / host / f.name).write_text("".join(json.dumps(r) + "\n" for r in lines))
        elif f.name.endswith(".manifest.json") and manifest is not None:
            (folder / host / f.name).write_text(json.dumps(manifest(json.loads(f.read_text()))))
        else:
            shutil.copy(f, folder / host / f.name)
    return folder


def _checks(*args: str) -> tuple[int, str, str]:
    """``checks ARGS`` in this process: (exit code, stdout, stderr); a traceback fails the test, naming it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = checks_main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
        except Exception:
            pytest.fail(f"checks {' '.join(args)}: {traceback.format_exc()}")
    assert "Traceback" not in err.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()


def _every_path(tmp_path: Path, results: Path) -> dict[str, str]:
    """Every rendering path over ``results``; the stderr of each, by command."""
    said = {}
    code, _, said["report"] = _checks("report", "--results", str(results), "--out", str(tmp_path / "page.md"))
    assert code == 0 and (tmp_path / "page.html").is_file(), said["report"]
    for name, extra in (("advise", ()), ("advise-json", ("--json",)), ("advise-model", ("--model", "llama-3.1-70b")),
                        ("advise-tp", ("--host", H100, "--tp", "4"))):
        code, out, said[name] = _checks("advise", "--results", str(results), *extra)
        assert code in (0, 1) and out, (name, said[name])
    code, _, said["validate"] = _checks("validate", str(results))
    assert code in (0, 1), said["validate"]
    bundle = tmp_path / "h100.bundle.json"
    code, _, said["share"] = _checks("share", "--results", str(results), "--host", H100, "--out", str(bundle))
    assert code in (0, 1) and bundle.is_file(), said["share"]
    code, _, said["validate-bundle"] = _checks("validate", str(bundle))
    assert code in (0, 1), said["validate-bundle"]
    # the same host's newer runs against the runs it already holds: the import preview lists what they change
    text = bundle.read_text()
    for old, new in RENAMED.items():
        text = text.replace(old, new)
    newer = tmp_path / "newer.bundle.json"
    newer.write_text(text)
    held = _layout(tmp_path / "held")
    code, _, said["import"] = _checks("import", str(newer), "--results", str(held))
    # listed and held back, or (its GPU facts left out) refused as another machine's: one line, nothing written
    assert code == 1 and ("not imported: it would change" in said["import"] or "refused, nothing written" in
                          said["import"]), said["import"][-2000:]
    assert sorted(p.name for p in (held / H100).iterdir()) == sorted(f.name for h, f in _files() if h == H100)
    fresh = tmp_path / "fresh"
    code, _, said["import-fresh"] = _checks("import", str(bundle), "--results", str(fresh))
    assert code == 0, said["import-fresh"]
    code, _, said["report-imported"] = _checks("report", "--results", str(fresh), "--out", str(tmp_path / "i.md"))
    assert code == 0, said["report-imported"]
    for name, text in said.items():
        assert not any(reader.escape.unsafe(c) for c in text if c not in "\n\t"), (name, text)
    return said


@pytest.mark.parametrize(("mode", "shape"), [
    ("evidence-leaves", "mixed-keys"),
    ("evidence-keys", "text"),  # every gate table's keys a compute capability, a name and a number at once
    ("evidence-keys", "mixed-list"),
    ("metrics", "deep"),
    ("metrics", "number"),
    ("self", "deep"),
])
def test_results_of_any_shape_render_on_every_path(tmp_path: Path, mode: str, shape: str) -> None:
    results = _layout(tmp_path / "results", results=_results(mode, SHAPES[shape]))
    said = _every_path(tmp_path, results)
    assert "not imported: it would change" in said["import"]  # the preview, every changed figure listed
    if mode == "metrics" and shape == "number":
        # a declared field of another shape: one warning for it, naming the file, the line and the field (the
        # H100 host's four custom-ar results each carry a headline)
        warned = [ln for ln in said["validate"].splitlines()
                  if "metrics.headline of custom-ar is not text (int where text is declared); that field is left out"
                  in ln]
        assert len(warned) == len({ln.split(": ")[1] for ln in warned}) == 4, said["validate"][-3000:]
        assert all(f"/{H100}/" in ln and ".jsonl:" in ln for ln in warned)


@pytest.mark.parametrize("shape", ["mixed-list", "text", "mixed-keys"])
def test_manifests_of_any_shape_render_on_every_path(tmp_path: Path, shape: str) -> None:
    results = _layout(tmp_path / "results", manifest=_manifest(SHAPES[shape]))
    said = _every_path(tmp_path, results)
    warned = [ln for ln in said["validate"].splitlines() if ".manifest.json:" in ln]
    assert warned and all("left out" in ln for ln in warned), said["validate"][-2000:]


def test_a_gate_table_whose_keys_mix_numbers_and_names_reads_in_order() -> None:
    assert gates._entries({"sm90": 1, "10.0": 1, "9.0": 1, "9": 1, "": 1, "8.x": 1, "12.0": 1}) == \
        "8.x, 9, 9.0, 10.0, 12.0, , sm90"  # a number before any text, numbers by value


@pytest.mark.parametrize(("unit", "good", "bad"), [
    ("µs by message bytes", {"1024": 3.5}, {"1024": "fast"}),
    ("count", 3, True),
    ("s", 1.5, "1.5"),
    ("text", "ok", ["ok"]),
    ("bool", False, "false"),
    ("record", {"a": [1, "b"]}, 7),
    ("GB/s by direction", {"h2d": 20.0}, [20.0]),
])
def test_a_declared_field_of_another_shape_is_left_out_with_one_line(unit: str, good: Any, bad: Any) -> None:
    assert reader.unit_problem(unit, good) is None
    assert reader.unit_problem(unit, bad)


def test_a_manifest_field_of_another_shape_is_one_line_and_the_rest_is_kept() -> None:
    m = {"schema": "stackprobe.manifest/2", "run_id": "r", "host_id": "h",
         "facts": {"gpu_count": "8", "gpu_name": "H100", "peer_access": [[True, 1]], "multicast": [True, None]},
         "cells": {"c1": [1], "c2": {"image": "i", "versions": {"torch": 2.1}}}, "probes": {"p": {"title": 1}},
         "code": {"version": "0.1.0", "dirty": "no", "probe_hashes": {"p": None}}}
    out, bad = reader.manifest_fields(m)
    assert out["facts"] == {"gpu_name": "H100", "multicast": [True, None]}
    assert out["cells"] == {"c2": {"image": "i"}} and out["probes"] == {} and out["code"] == {"version": "0.1.0"}
    assert bad == ["facts.gpu_count is a str, not int; left out", "facts.peer_access holds an item of another "
                   "shape; left out", "cells.c1 is a list, not an object; left out",
                   "cells.c2.versions holds a value that is not text; left out",
                   "probes.p is not an object of texts; left out", "code.dirty is a str, not bool or NoneType; "
                   "left out", "code.probe_hashes holds a value that is not text; left out"]


def test_an_engine_version_with_backticks_opens_no_code_span_in_the_gates_heading(tmp_path: Path) -> None:
    def edit(r: dict[str, Any]) -> dict[str, Any]:
        if r["probe_id"] == "engine" and r["evidence"].get("engine"):
            r = {**r, "evidence": {**r["evidence"], "version": "0.5.4`rc1 `<b>x</b>"}}
        return r

    results = _layout(tmp_path / "results", results=edit)
    code, _, err = _checks("report", "--results", str(results), "--out", str(tmp_path / "page.md"))
    assert code == 0, err
    pages = [tmp_path / "page.md", *tmp_path.glob("page-archive.md"), *(tmp_path / "hosts").glob("*.md")]
    headings = [ln for page in pages for ln in page.read_text().splitlines() if ln.startswith("**Engine gates")]
    assert headings, "no engine gates on the page"
    for line in headings:
        assert line.count("`") == 2, line  # the cell id's own code span, and no other
        assert "0.5.4'rc1 '&lt;b&gt;x&lt;/b&gt;" in line, line
