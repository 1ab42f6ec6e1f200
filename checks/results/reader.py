"""The one reader of results folders and bundles, all untrusted input (host side; reading is its only side effect).

Everything here may come from another machine, and every command reads through it with one set of rules:
``checks report``, ``advise``, ``diff`` and ``run`` (checks.results.store), and ``checks validate``,
``import`` and ``share`` (checks.share), so what one command calls bad no other publishes, and a bundle never
carries what an import would refuse. Every item that is not well formed becomes one :class:`Problem` naming
the file (and line, or the bundle's run) and why, and is left out; the rest goes on. The rules:

- limits: MAX_FILE bytes per results file or bundle, MAX_LINE per result line, MAX_MANIFEST per manifest,
  JSON nested at most MAX_DEPTH levels, MAX_RUNS runs per host, MAX_RESULTS results per run;
- JSON with NaN/Infinity is refused, and so are strings holding lone surrogates (no UTF-8 page can carry them);
- files are opened only when ``lstat`` says they are regular files: symbolic links (dangling or not), FIFOs,
  devices and folders are reported, never followed or read; names starting with a dot (a writer's temporary
  files, an editor's) are passed over, every other name outside the layout ``<host id>/<run id>.jsonl`` and
  ``<host id>/<run id>.manifest.json`` is reported;
- a result line must be a result of its schema with only known fields, ids in their grammars
  (``checks.results.ids``), and the host and run it claims must be the folder and file it is in;
- one result per (cell, probe, variant) in a run: a later line for a key already seen is left out;
- the last line of a file without its newline is kept when it is a complete, valid result (the writer's
  last append reached the disk whole) and left out as torn otherwise;
- a manifest must be of a known schema with only known fields, naming the host and run of its file;
- ``<run id>.origin.json``, written by ``checks import`` beside a run it imported, says where the run came
  from and whose code measured it (optional; the same rules as a manifest).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from checks.results import ids
from checks.results.result import FIELDS, ProbeResult, ResultError
from common import escape
from inenv import registry

MAX_FILE = 256 << 20  # one run's results or one bundle
MAX_MANIFEST = 16 << 20
MAX_LINE = 1 << 20  # one result (the largest recorded so far is under 8 KiB)
MAX_DEPTH = 32  # nesting of one JSON document (results nest 6 deep, a bundle 11)
MAX_RUNS = 10_000
MAX_RESULTS = 1_000_000  # per run
RESULT_KEYS = frozenset(FIELDS) | {"code"}
MANIFEST_SCHEMAS = ("stackprobe.manifest/1", "stackprobe.manifest/2")
MANIFEST_KEYS = frozenset({"schema", "run_id", "host_id", "written_at", "executor", "level", "facts", "cells",
                           "probes", "code", "argv"})
# `checks run --results X` writes these beside the host folders: the table, its archive and a page per host
REPORT_FILES = frozenset({"compatibility.md", "compatibility.html", "compatibility-archive.md"})
HOST_PAGES = "hosts"  # the folder of a page per host, beside the table
REPORT_DIRS = frozenset({HOST_PAGES})
EXPECTED_CHANGES = "expected-changes.yaml"  # the reviewed list of expected verdict changes (checks.results.changes)
RESULTS_SUFFIX = ".jsonl"
MANIFEST_SUFFIX = ".manifest.json"
# Written by `checks import` beside a run it imported: where the run came from and whose code measured it, so
# every view shows it as contributed (absent for a run made here)
ORIGIN_SUFFIX = ".origin.json"
ORIGIN_SCHEMA = "stackprobe.origin/1"
ORIGIN_KEYS = frozenset({"schema", "run_id", "host_id", "imported_at", "bundle", "measured_by", "shared_by"})


@dataclass(frozen=True)
class Problem:
    """One bad item: where (file, file:line, or bundle: run) and why. ``fatal``: the whole input is unreadable."""

    where: str
    why: str
    fatal: bool = False

    def __str__(self) -> str:
        return f"{self.where}: {self.why}"


@dataclass(frozen=True)
class Run:
    """One run's well-formed manifest (None when absent or refused) and results (parsed JSON objects)."""

    run_id: str
    manifest: Mapping[str, Any] | None
    results: tuple[Mapping[str, Any], ...]
    origin: Mapping[str, Any] | None = None  # an imported run's origin (ORIGIN_SUFFIX); None for one made here


def shown(path: Path | str) -> str:
    """A path as text that a terminal shows safely (undecodable bytes and control characters escaped)."""
    text = os.fsdecode(path) if isinstance(path, Path) else path
    return escape.terminal(text)  # undecodable bytes show as \udcXX


# compressed files a person may hand over as a bundle or a results file: said as such, not "not UTF-8"
COMPRESSED = ((b"\x1f\x8b", "gzip-compressed", "gunzip FILE"), (b"\xfd7zXZ\x00", "xz-compressed", "unxz FILE"),
              (b"BZh", "bzip2-compressed", "bunzip2 FILE"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "unzstd FILE"),
              (b"PK\x03\x04", "zip", "unzip FILE"))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_value(obj: Any, max_depth: int = MAX_DEPTH, texts: bool = True) -> str | None:
    """Why a parsed JSON value cannot be kept (too deep, a string no UTF-8 text can hold), or None.
    ``texts`` False: the strings are known to be valid text (see parse_json), only the depth is checked."""
    if not texts:
        return _too_deep(obj, max_depth)
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels"
        if isinstance(item, dict):
            for k, v in item.items():
                if _bad_text(k):
                    return "a key is not valid Unicode text (a lone surrogate)"
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str) and _bad_text(item):
            return "a string is not valid Unicode text (a lone surrogate)"
    return None


def _too_deep(obj: Any, max_depth: int) -> str | None:
    """The depth half of check_value: only containers are visited (a leaf is one level below its container)."""
    if not isinstance(obj, (dict, list)):
        return None if max_depth >= 1 else f"nested deeper than {max_depth} levels"
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels"
        for v in item.values() if isinstance(item, dict) else item:
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
            elif depth + 1 > max_depth:
                return f"nested deeper than {max_depth} levels"
    return None


# A lone surrogate can only enter a parsed value through a \uD800-\uDFFF escape: strict UTF-8 decoding refuses
# surrogates in the raw bytes. Text without such an escape needs no string-by-string check.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _bad_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_json(raw: bytes, max_depth: int | None = MAX_DEPTH) -> tuple[Any, str | None]:
    """(value, None), or (None, why) for bytes that are not one bounded, valid UTF-8 JSON document.
    ``max_depth`` None: the document is an envelope whose items the caller checks one by one (a bundle), so
    only what the JSON parser itself cannot read refuses it whole."""
    for magic, kind, how in COMPRESSED:
        if raw.startswith(magic):
            return None, f"a {kind} file, not JSON text: decompress it first ({how})"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start})"
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        return None, f"nested deeper than {max_depth} levels" if max_depth is not None else \
            "nested deeper than the JSON parser reads (about 1000 levels)"
    except ValueError as exc:
        return None, f"not valid JSON ({getattr(exc, 'msg', exc)})"
    if max_depth is None:
        return obj, None
    why = check_value(obj, max_depth, texts=_SURROGATE_ESCAPE.search(text) is not None)
    return (None, why) if why else (obj, None)


def check_result(obj: Any, host_id: str, run_id: str) -> str | None:
    """Why one parsed result line is refused, or None: the result schema, known keys and status, id grammars,
    and the host and run it claims match where it was found."""
    if isinstance(obj, dict) and (extra := sorted(set(obj) - RESULT_KEYS)):
        return f"unknown field(s) {', '.join(map(repr, extra[:5]))}"
    try:
        r = ProbeResult.from_json(obj)
    except ResultError as exc:
        return str(exc)
    for kind, value in (("cell id", r.cell_id), ("probe id", r.probe_id), ("variant", r.variant),
                        ("reason code", r.verdict.reason_code)):
        if why := ids.problem(kind, value):
            return why
    if why := _time_problem(r.started_at):
        return f"started_at {r.started_at[:40]!r}: {why}"
    if r.run_id != run_id:
        return f"run id {ids.problem('run id', r.run_id) or r.run_id} differs from its run {run_id}"
    if r.host_id != host_id:
        return f"host id {r.host_id[:60]!r} differs from its host {host_id}"
    return None


# What each unit a probe declares for a field (inenv.probe.Field) lets its value be: a field of another shape is
# left out of the result with one problem, so no reader past this one meets it.
_NUMBER_UNITS = frozenset({"absolute", "bytes", "count", "elements", "fraction", "s", "µs", "GB/s"})
_NUMBERS_BY = frozenset({"µs by message bytes", "ratio by message bytes", "GB/s by direction", "s by op",
                         "count by op"})


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def unit_problem(unit: str, value: Any) -> str | None:
    """Why ``value`` is not of the declared ``unit``'s shape, or None (an unknown unit takes any value, and every
    unit null: a value the store could not write as a number)."""
    if value is None:
        return None
    if unit in _NUMBER_UNITS:
        return None if _number(value) else "not a number"
    if unit == "bool":
        return None if isinstance(value, bool | int) else "not true or false"
    if unit == "text":
        return None if isinstance(value, str) else "not text"
    if unit == "record":
        return None if isinstance(value, dict | list) else "not an object or a list"
    if unit in _NUMBERS_BY:
        if not isinstance(value, dict):
            return "not an object"
        return None if all(v is None or _number(v) for v in value.values()) else "an entry that is not a number"
    if " by " in unit:
        return None if isinstance(value, dict) else "not an object"
    return None


def declared_fields(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``obj`` without the metrics and evidence fields whose value is not of the shape their probe declares
    (inenv.probe.Field's unit), and one line for each field left out."""
    declared = registry.declarations().get(str(obj.get("probe_id")))
    if declared is None:
        return obj, []
    bad: list[str] = []
    out = obj
    for part, fields in (("metrics", declared.metrics), ("evidence", declared.evidence)):
        values = obj.get(part)
        if not isinstance(values, dict):
            continue
        wrong = {f.name: why for f in fields if f.name in values and (why := unit_problem(f.unit, values[f.name]))}
        bad += [f"{part}.{f.name} of {obj.get('probe_id')} is {wrong[f.name]} ({type(values[f.name]).__name__} "
                f"where {f.unit} is declared); that field is left out" for f in fields if f.name in wrong]
        if wrong:
            out = {**out, part: {k: v for k, v in values.items() if k not in wrong}}
    return out, bad


def _time_problem(text: str) -> str | None:
    """Why a recorded time is not one (an ISO 8601 date and time with its UTC offset, as the writer records)."""
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return "not an ISO 8601 date and time"
    return None if t.tzinfo is not None else "an ISO 8601 time without its UTC offset"


def check_manifest(obj: Any, host_id: str, run_id: str) -> str | None:
    """Why a parsed manifest is refused, or None."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    if obj.get("schema") not in MANIFEST_SCHEMAS:
        return f"schema {str(obj.get('schema'))[:40]!r}, expected one of {', '.join(MANIFEST_SCHEMAS)}"
    if extra := sorted(set(obj) - MANIFEST_KEYS):
        return f"unknown field(s) {', '.join(map(repr, extra[:5]))}"
    if obj.get("run_id") != run_id or obj.get("host_id") != host_id:
        return f"names run {str(obj.get('run_id'))[:30]!r} of host {str(obj.get('host_id'))[:60]!r}, " \
               f"not {run_id} of {host_id}"
    for key in ("facts", "cells", "code"):
        if key in obj and not isinstance(obj[key], dict):
            return f"{key} is not an object"
    if "probes" in obj and not isinstance(obj["probes"], dict | list):  # schema 1: a list of probe ids
        return "probes is neither an object nor a list"
    for cell in obj.get("cells") or {}:
        if why := ids.problem("cell id", cell):
            return f"cells: {why}"
    for probe in obj.get("probes") or {}:
        if why := ids.problem("probe id", probe):
            return f"probes: {why}"
    if "argv" in obj and not (isinstance(obj["argv"], list) and all(isinstance(a, str) for a in obj["argv"])):
        return "argv is not a list of strings"
    return None


# The shape of each manifest field the views read: a field of another shape is left out of the manifest with one
# problem (the rest of the manifest and the run's results are kept). Keys not named here are kept as they are.
_TEXT, _MAYBE_TEXT, _INT, _OBJECT, _LIST = (str,), (str, type(None)), (int,), (dict,), (list,)
FACT_TYPES: dict[str, tuple[type, ...]] = {
    "host_id": _TEXT, "host_label": _TEXT, "cpu": _TEXT, "cpu_count": _INT, "gpu_count": _INT,
    "gpu_name": _MAYBE_TEXT, "compute_capability": _MAYBE_TEXT, "driver": _MAYBE_TEXT, "driver_cuda": _MAYBE_TEXT,
    "nccl": _MAYBE_TEXT, "no_gpu_reason": _MAYBE_TEXT, "nvidia_smi": _TEXT, "os": _TEXT, "interconnect": _TEXT,
    "topology": _TEXT, "env": _OBJECT, "gpus": _LIST, "multicast": _LIST, "peer_access": _LIST}
CELL_TYPES: dict[str, tuple[type, ...]] = {
    "fingerprint": _MAYBE_TEXT, "image": _MAYBE_TEXT, "image_status": _TEXT, "reason": _TEXT, "status": _TEXT,
    "versions": _OBJECT}
CODE_TYPES: dict[str, tuple[type, ...]] = {"version": _TEXT, "commit": _TEXT, "dirty": (bool, type(None)),
                                           "probe_hashes": _OBJECT}


# the items of the list facts: a row of booleans per GPU (peer access), a boolean or null per GPU (multicast)
FACT_ITEMS: dict[str, Callable[[Any], bool]] = {
    "peer_access": lambda row: isinstance(row, list) and all(isinstance(x, bool | None) for x in row),
    "multicast": lambda x: isinstance(x, bool | None)}


def _typed(obj: Mapping[str, Any], types: Mapping[str, tuple[type, ...]], where: str,
           bad: list[str], items: Mapping[str, Callable[[Any], bool]] | None = None) -> dict[str, Any]:
    """``obj`` without the keys whose value is not of its type (bool is no int here) or holds an item ``items``
    refuses, one line each."""
    out = {}
    for k, v in obj.items():
        want = types.get(k)
        if want is not None and (not isinstance(v, want) or (isinstance(v, bool) and bool not in want)):
            bad.append(f"{where}.{k} is a {type(v).__name__}, not {' or '.join(t.__name__ for t in want)}; left out")
            continue
        item_ok = (items or {}).get(k)
        if item_ok is not None and isinstance(v, list) and not all(item_ok(x) for x in v):
            bad.append(f"{where}.{k} holds an item of another shape; left out")
            continue
        out[k] = v
    return out


def manifest_fields(obj: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A checked manifest (check_manifest) with every field the views read of the shape they read it in:
    ``facts``, each of ``cells`` (an object; its ``versions`` an object of texts), each of ``probes`` (an object
    of texts) and ``code`` (its ``probe_hashes`` an object of texts); each field or item of another shape left
    out, with one line for it."""
    bad: list[str] = []
    out = dict(obj)
    if isinstance(obj.get("facts"), dict):
        out["facts"] = _typed(obj["facts"], FACT_TYPES, "facts", bad, FACT_ITEMS)
    if isinstance(obj.get("cells"), dict):
        cells = {}
        for cid, cell in obj["cells"].items():
            if not isinstance(cell, dict):
                bad.append(f"cells.{cid} is a {type(cell).__name__}, not an object; left out")
                continue
            cell = _typed(cell, CELL_TYPES, f"cells.{cid}", bad)
            versions = cell.get("versions")
            if isinstance(versions, dict) and not all(isinstance(v, str | None) for v in versions.values()):
                bad.append(f"cells.{cid}.versions holds a value that is not text; left out")
                cell.pop("versions")
            cells[cid] = cell
        out["cells"] = cells
    if isinstance(obj.get("probes"), dict):
        probes = {}
        for pid, info in obj["probes"].items():
            if not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                bad.append(f"probes.{pid} is not an object of texts; left out")
                continue
            probes[pid] = info
        out["probes"] = probes
    elif isinstance(obj.get("probes"), list) and not all(isinstance(p, str) for p in obj["probes"]):
        bad.append("probes holds an id that is not text; left out")
        out["probes"] = [p for p in obj["probes"] if isinstance(p, str)]
    if isinstance(obj.get("code"), dict):
        code = _typed(obj["code"], CODE_TYPES, "code", bad)
        hashes = code.get("probe_hashes")
        if isinstance(hashes, dict) and not all(isinstance(v, str) for v in hashes.values()):
            bad.append("code.probe_hashes holds a value that is not text; left out")
            code.pop("probe_hashes")
        out["code"] = code
    return out, [escape.terminal(line) for line in bad]


def check_origin(obj: Any, host_id: str, run_id: str) -> str | None:
    """Why a parsed origin record is refused, or None."""
    if not isinstance(obj, dict) or obj.get("schema") != ORIGIN_SCHEMA:
        return f"not an origin record (schema {ORIGIN_SCHEMA})"
    if set(obj) != ORIGIN_KEYS:
        return f"fields {sorted(obj)[:8]}, expected {sorted(ORIGIN_KEYS)}"
    if obj["run_id"] != run_id or obj["host_id"] != host_id:
        return f"names run {str(obj['run_id'])[:30]!r} of host {str(obj['host_id'])[:60]!r}, not {run_id} of {host_id}"
    if not (isinstance(obj["measured_by"], list) and all(isinstance(c, dict) for c in obj["measured_by"])):
        return "measured_by is not a list of objects"
    if not isinstance(obj["shared_by"], dict) or not all(isinstance(obj[k], str) for k in ("imported_at", "bundle")):
        return "shared_by is not an object, or imported_at/bundle not text"
    return None


def read_origin_file(path: Path, host_id: str, run_id: str, problems: list[Problem]) -> Mapping[str, Any] | None:
    """An imported run's origin record; None when absent (a run made here) or refused (with a problem)."""
    if not os.path.lexists(path):
        return None
    return _checked_json(path, lambda obj: check_origin(obj, host_id, run_id), problems)


def _checked_json(path: Path, check: Callable[[Any], str | None], problems: list[Problem]) -> Mapping[str, Any] | None:
    """A small JSON file of a run (within the manifest limit) that ``check`` accepts, or None with a problem."""
    data, why = read_bytes(path, MAX_MANIFEST)
    obj = None
    if data is not None:
        obj, why = parse_json(data)
        why = why or check(obj)
    if why:
        problems.append(Problem(shown(path), why))
        return None
    return obj


def _regular(path: Path, limit: int) -> str | None:
    """Why ``path`` is not read (not a regular file, too large), or None; never follows a link."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link; not followed"
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
            "not a regular file"
        return f"{kind}; not read"
    if st.st_size > limit:
        return f"{st.st_size} bytes, more than the limit of {limit}"
    return None


def read_bytes(path: Path, limit: int) -> tuple[bytes | None, str | None]:
    if why := _regular(path, limit):
        return None, why
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror})"
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror})"
    return (None, f"more than the limit of {limit} bytes") if len(data) > limit else (data, None)


def results_of(lines: Iterable[tuple[str, bytes]], host_id: str, run_id: str,
               problems: list[Problem]) -> list[Mapping[str, Any]]:
    """The well-formed results among ``(where, raw line)``; a problem for each other line and each repeat of a
    (cell, probe, variant) already seen in the run."""
    out: list[Mapping[str, Any]] = []
    seen: set[tuple[str, str, str]] = set()
    for where, raw in lines:
        if len(raw) > MAX_LINE:
            problems.append(Problem(where, f"line of {len(raw)} bytes, more than the limit of {MAX_LINE}; skipped"))
            continue
        obj, why = parse_json(raw)
        why = why or check_result(obj, host_id, run_id)
        if why:
            problems.append(Problem(where, f"{why}; skipped"))
            continue
        obj, bad = declared_fields(obj)
        problems.extend(Problem(where, why) for why in bad)
        key = (obj["cell_id"], obj["probe_id"], obj["variant"])
        if key in seen:
            problems.append(Problem(where, f"a second result for {'/'.join(key)} in one run; skipped"))
            continue
        if len(out) >= MAX_RESULTS:
            problems.append(Problem(where, f"more than {MAX_RESULTS} results in one run; the rest skipped"))
            break
        seen.add(key)
        out.append(obj)
    return out


def read_results_file(path: Path, host_id: str, run_id: str, problems: list[Problem]) -> list[Mapping[str, Any]]:
    """The well-formed results of one run's results file; a problem for the file or for each line left out."""
    data, why = read_bytes(path, MAX_FILE)
    if why or data is None:
        problems.append(Problem(shown(path), why or "cannot be read"))
        return []
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    numbered = [(f"{shown(path)}:{n}", raw) for n, raw in enumerate(lines, 1) if raw.strip()]
    if tail.strip():
        obj, why = parse_json(tail)
        if why or check_result(obj, host_id, run_id):  # torn: the rest of the line never reached the disk
            problems.append(Problem(f"{shown(path)}:{len(lines) + 1}",
                                    "unterminated last line (a run was interrupted mid-write); skipped"))
        else:
            numbered.append((f"{shown(path)}:{len(lines) + 1}", tail))
    return results_of(numbered, host_id, run_id, problems)


def read_manifest_file(path: Path, host_id: str, run_id: str, problems: list[Problem]) -> Mapping[str, Any] | None:
    """One run's manifest, or None with a problem (a missing one too: its host facts are then unknown)."""
    if not os.path.lexists(path):
        problems.append(Problem(shown(path), "missing (host facts unknown)"))
        return None
    obj = _checked_json(path, lambda obj: check_manifest(obj, host_id, run_id), problems)
    if obj is None:
        return None
    obj, bad = manifest_fields(obj)
    problems.extend(Problem(shown(path), why) for why in bad)
    return obj


def read_run(folder: Path, host_id: str, run_id: str, problems: list[Problem]) -> Run:
    """One run of a host folder: its results file and manifest."""
    results = read_results_file(folder / f"{run_id}{RESULTS_SUFFIX}", host_id, run_id, problems)
    manifest = read_manifest_file(folder / f"{run_id}{MANIFEST_SUFFIX}", host_id, run_id, problems)
    origin = read_origin_file(folder / f"{run_id}{ORIGIN_SUFFIX}", host_id, run_id, problems)
    return Run(run_id, manifest, tuple(results), origin)


def _run_file(name: str) -> str | None:
    """The run id a host folder's file name stands for, or None for any other name."""
    for suffix in (MANIFEST_SUFFIX, ORIGIN_SUFFIX, RESULTS_SUFFIX):
        if name.endswith(suffix) and ids.valid("run id", name[: -len(suffix)]):
            return name[: -len(suffix)]
    return None


def run_ids_of(folder: Path, problems: list[Problem]) -> list[str]:
    """The runs of one host folder, sorted (the newest MAX_RUNS); a problem for every other entry."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        problems.append(Problem(shown(folder), f"cannot be listed ({exc.strerror})"))
        return []
    run_ids: set[str] = set()
    for name in names:
        if name.startswith("."):  # a writer's temporary file, an editor's: passed over
            continue
        run_id = _run_file(name)
        if run_id is None:
            problems.append(Problem(shown(folder / name), "not a run's .jsonl or .manifest.json; not read"))
            continue
        if name.endswith((MANIFEST_SUFFIX, ORIGIN_SUFFIX)) and f"{run_id}{RESULTS_SUFFIX}" not in names:
            what = "a manifest" if name.endswith(MANIFEST_SUFFIX) else "an origin record"
            problems.append(Problem(shown(folder / name), f"{what} without its results file"))
            continue
        run_ids.add(run_id)
    if len(run_ids) > MAX_RUNS:
        problems.append(Problem(shown(folder), f"more than {MAX_RUNS} runs; only the newest {MAX_RUNS} read"))
    return sorted(run_ids)[-MAX_RUNS:]


def read_host(folder: Path, problems: list[Problem]) -> dict[str, Run]:
    """Every run of one host folder (named by its host id), by run id; a problem for every other entry."""
    return {r: read_run(folder, folder.name, r, problems) for r in run_ids_of(folder, problems)}


def host_folders(root: Path, problems: list[Problem]) -> list[Path]:
    """The host folders of a results directory, sorted; a problem for every other entry (the tables a run writes
    beside them excepted), and one fatal problem when the directory itself cannot be read."""
    try:
        st = os.stat(root)
    except OSError as exc:
        problems.append(Problem(shown(root), f"cannot be read ({exc.strerror})", fatal=True))
        return []
    if not stat.S_ISDIR(st.st_mode):
        problems.append(Problem(shown(root), "not a directory", fatal=True))
        return []
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        problems.append(Problem(shown(root), f"cannot be listed ({exc.strerror})", fatal=True))
        return []
    out: list[Path] = []
    for name in names:
        if name.startswith("."):
            continue
        path = root / name
        try:
            st = os.lstat(path)
        except OSError as exc:
            problems.append(Problem(shown(path), f"cannot be read ({exc.strerror})"))
            continue
        if stat.S_ISREG(st.st_mode) and (name in REPORT_FILES or name == EXPECTED_CHANGES):
            continue
        if stat.S_ISDIR(st.st_mode) and name in REPORT_DIRS:
            continue
        if not stat.S_ISDIR(st.st_mode):
            what = "a symbolic link; not followed" if stat.S_ISLNK(st.st_mode) else "not a host folder; not read"
            problems.append(Problem(shown(path), what))
            continue
        if why := ids.problem("host id", name):
            problems.append(Problem(shown(path), f"folder name: {why}; not read"))
            continue
        out.append(path)
    return out


def read_results(root: Path) -> tuple[dict[str, dict[str, Run]], list[Problem]]:
    """Every host folder under a results directory: host id -> run id -> Run, and the problems found."""
    problems: list[Problem] = []
    hosts = {path.name: read_host(path, problems) for path in host_folders(root, problems)}
    return hosts, problems
