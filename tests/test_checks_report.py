"""`checks report` against recorded results: golden bytes, determinism, --check, corrupt lines.

Regenerate the goldens after an intended change with STACKPROBE_UPDATE_GOLDEN=1."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from checks.report.answer import Stack
from checks.report.report import generate, headline
from inenv import registry
from inenv.probe import Declared, Field, Role
from tests.checks_helpers import ROOT

GOLDEN = ROOT / "tests" / "golden" / "checks"
UPDATE = os.environ.get("STACKPROBE_UPDATE_GOLDEN") == "1"
# The probe sources "now" for the goldens: fi-fusion and nccl-graphs as the recorded runs had them, fi-jit
# changed since (see make_recorded.HASHES); the first H200 run recorded no code at all.
CURRENT = {"ar-latency": "1b2c3d4e5f607182", "fi-fusion": "5d1e0c4b7a2f9e31", "fi-jit": "e2f81c0a5b9d7364",
           "inventory": "9a8b7c6d5e4f3021", "nccl-graphs": "c47b1e0d9a3f6e25", "symm-mem": "6e5d4c3b2a190817"}


# The stacks the goldens take as declared (not this checkout's matrices, which move): the no-GPU host's cells
# but one; the H200's local environment and the torch-nightly cell are on the archive page.
STACKS = [Stack(c, "matrix.yaml") for c in (
    "cu130-torch2.11.0-sgl0.4.2-fi0.6.16", "cu130-torch2.11.0-sgl0.4.2-fi0.6.17", "cu128-torch2.9.1-sgl0.4.1-fi0.6.17")]
PAGES = ("compatibility.md", "compatibility.html", "compatibility-archive.md", "hosts/cpu-5bce98f7.md")


def _cpu(out: Path) -> str:
    """The no-GPU host's page."""
    return (out.parent / "hosts" / "cpu-5bce98f7.md").read_text()


def _archive(out: Path) -> str:
    return (out.parent / "compatibility-archive.md").read_text()


def _layout(tmp: Path) -> tuple[Path, Path]:
    """results/ beside docs/, as in the repository, so links in the page are stable."""
    shutil.copytree(GOLDEN / "results", tmp / "results")
    return tmp / "results", tmp / "docs" / "compatibility.md"


def test_report_matches_golden(tmp_path: Path) -> None:
    results, out = _layout(tmp_path)
    assert generate(results, out, None, check=False, current=CURRENT, stacks=STACKS) == 0
    assert sorted(p.relative_to(out.parent).as_posix() for p in out.parent.rglob("*.*")) == sorted(PAGES)
    for name in PAGES:
        got = (out.parent / name).read_text()
        if UPDATE:
            (GOLDEN / name).parent.mkdir(exist_ok=True)
            (GOLDEN / name).write_text(got)
        assert got == (GOLDEN / name).read_text(), f"{name} differs from the golden (STACKPROBE_UPDATE_GOLDEN=1)"


def test_report_content_says_what_matters(tmp_path: Path) -> None:
    results, out = _layout(tmp_path)
    generate(results, out, None, check=False, current=CURRENT, stacks=STACKS)
    assert "No Blackwell (SM12x) GPU has been measured" in out.read_text()
    md = _archive(out)  # the H200 ran a local environment only: no matrix declares it
    assert "## NVIDIA H200 ×1 — host `h200x1-3f9a2c1d`" in md
    assert "| NVIDIA H200 | 9.0 | 1 | 580.159.04 (13.0) |" in md
    assert "(../results/h200x1-3f9a2c1d/20261129T100000Z-a1b2.jsonl)" in md  # link to the raw results
    assert "0.41–0.88× NCCL time" in md  # a key measurement in a passing cell
    assert "⏳" not in md.split("Notes:")[-1]  # the newer run's pass replaced the hang
    # the fixture's fi-fusion and inventory rows carry a `headline` metric those probes do not declare: not shown
    assert "exact; 7168 bf16" not in md and "sm_90 in torch arch list" not in md
    cpu = _cpu(out)
    assert "(../../results/cpu-5bce98f7/20261129T130000Z-e5f6.jsonl)" in cpu  # one folder down: one more ../
    assert "`fi-arch-gate`" in cpu and "flashinfer &gt;= 0.6.17" in cpu
    assert "🚫" in md and "torch nightly has no cu128 builds" in md
    html = out.with_suffix(".html").read_text()
    assert '<td class="fail"' in html and "<style>" in html and "http" not in html  # self-contained


def _row(md: str, cell: str) -> list[str]:
    return next(ln for ln in md.splitlines() if ln.startswith(f"| `{cell}` |")).split(" | ")


def test_report_marks_stale_verdicts_and_says_how_to_refresh(tmp_path: Path) -> None:
    results, out = _layout(tmp_path)
    generate(results, out, None, check=False, current=CURRENT, stacks=STACKS)
    h200 = _archive(out).split("## NVIDIA H200")[1]  # its own section
    md = cpu = _cpu(out)
    # H200: the first run recorded no code; fi-fusion was re-measured by today's probe source.
    assert "| flashinfer | ar-latency | fi-fusion | inventory | nccl-graphs | symm-mem |" in h200
    local = _row(h200, "local-cu130-torch2.11.0-sglnone-fi0.6.18")
    assert [("↻" in c) for c in local[5:10]] == [True, False, True, True, True]
    assert ("- ar-latency, inventory, nccl-graphs, symm-mem (6 variants, in the environment of "
            "`local-cu130-torch2.11.0-sglnone-fi0.6.18`; recorded before results named the code that made them): "
            "`checks run --backend local --probe ar-latency --probe inventory --probe nccl-graphs "
            "--probe symm-mem`") in h200
    # No GPU: fi-jit's source changed since the run; nccl-graphs did not; a cell that could not be provisioned
    # or built is not a verdict of the probe and needs no rerun of it.
    a, b = "cu130-torch2.11.0-sgl0.4.2-fi0.6.16", "cu130-torch2.11.0-sgl0.4.2-fi0.6.17"
    assert "↻" in _row(cpu, a)[5] and "↻" not in _row(cpu, a)[6]
    assert "↻" in _row(cpu, b)[5]
    assert not any("↻" in c for c in _row(cpu, "cu128-torch2.9.1-sgl0.4.1-fi0.6.17")[5:])  # not-run, crash
    nightly = _archive(out).split("## No GPU")[1].split("## NVIDIA H200")[0]
    assert not any("↻" in c for c in _row(nightly, "cu128-torchnightly-sgl0.4.1-fi0.6.16")[5:])  # unavailable
    assert (f"- fi-jit (4 variants on 2 cells; the probe's source changed since): "
            f"`checks run --backend docker --only {a} --only {b} --probe fi-jit`") in cpu
    assert "↻: made by other\nprobe code than this checkout's" in md
    html = out.with_suffix(".html").read_text()
    assert f"<code>checks run --backend docker --only {a} --only {b} --probe fi-jit</code>" in html
    # The same results against the fi-jit source they were made by: nothing on that host is stale.
    generate(results, out, None, check=False, current={**CURRENT, "fi-jit": "0a6c3e9f2b7d4e18"}, stacks=STACKS)
    cpu = _cpu(out).split("## No GPU")[1]
    assert "↻" not in cpu and "checks run" not in cpu


def test_refresh_command_names_exactly_what_to_rerun() -> None:
    from checks.results.freshness import command

    assert (command(("fi-jit",), ("c1", "c2"), "docker")
            == "checks run --backend docker --only c1 --only c2 --probe fi-jit")
    assert command(("a", "b"), ("local-x",), "local") == "checks run --backend local --probe a --probe b"
    assert command(("nccl-graphs",), ("c1",), "slurm") == "checks run --backend slurm --only c1 --probe nccl-graphs"
    # a venv cell is rerun as a venv cell, wherever Docker also answers
    assert command(("pcie-ipc",), ("c1",), "venv") == "checks run --backend venv --only c1 --probe pcie-ipc"


def test_cached_builds_are_shown_as_cached(tmp_path: Path) -> None:
    results, out = _layout(tmp_path)
    generate(results, out, None, check=False, current=CURRENT, stacks=STACKS)
    md = _cpu(out)
    assert "✅1 ❌1 ↻ *(1 of 2 cached)*" in _row(md, "cu130-torch2.11.0-sgl0.4.2-fi0.6.16")[5]
    assert "cached" not in _row(md, "cu130-torch2.11.0-sgl0.4.2-fi0.6.17")[5]
    assert "*cached*:\nthe probe reused objects" in md
    assert "<i>(1 of 2 cached)</i>" in out.with_suffix(".html").read_text()


def test_same_results_same_bytes_whatever_the_file_order(tmp_path: Path) -> None:
    a_res, a_out = _layout(tmp_path / "a")
    b_res = tmp_path / "b" / "results"
    files = sorted(p for p in (GOLDEN / "results").rglob("*") if p.is_file())
    random.Random(7).shuffle(files)  # created in another order: another directory order on disk
    for f in files:
        dest = b_res / f.relative_to(GOLDEN / "results")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
    b_out = tmp_path / "b" / "docs" / "compatibility.md"
    generate(a_res, a_out, None, check=False, stacks=STACKS)
    generate(b_res, b_out, None, check=False, stacks=STACKS)
    for name in PAGES:
        assert (a_out.parent / name).read_bytes() == (b_out.parent / name).read_bytes(), name


def test_check_exits_1_when_stale_and_0_when_fresh(tmp_path: Path) -> None:
    results, out = _layout(tmp_path)
    cmd = [sys.executable, "-m", "checks.cli", "report", "--results", str(results), "--out", str(out)]
    p = subprocess.run([*cmd, "--check"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 1 and "stale" in p.stderr and not out.exists()
    assert subprocess.run(cmd, capture_output=True, cwd=ROOT).returncode == 0
    assert subprocess.run([*cmd, "--check"], capture_output=True, cwd=ROOT).returncode == 0
    path = next(results.glob("cpu-*/*.jsonl"))
    lines = path.read_text().splitlines(keepends=True)
    newer = next(ln for ln in lines if '"status": "pass"' in ln).replace('"status": "pass"', '"status": "fail"')
    path.write_text("".join(lines) + newer)  # the same variant measured again, later in the run: now failing
    assert subprocess.run([*cmd, "--check"], capture_output=True, cwd=ROOT).returncode == 1


def test_corrupt_line_is_warned_with_file_and_line_and_the_rest_reported(tmp_path: Path) -> None:
    results, out = _layout(tmp_path)
    path = next(results.glob("cpu-*/*.jsonl"))
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(2, "{this is not json\n")
    path.write_text("".join(lines))
    p = subprocess.run([sys.executable, "-m", "checks.cli", "report", "--results", str(results), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0
    assert f"warning: {path}:3: not valid JSON" in p.stderr
    assert "`fi-arch-gate`" in _archive(out)  # this checkout's matrices declare none of the fixture's cells


def test_no_results_is_exit_2(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "checks.cli", "report", "--results", str(tmp_path / "none")],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    (tmp_path / "empty").mkdir()
    p = subprocess.run([sys.executable, "-m", "checks.cli", "report", "--results", str(tmp_path / "empty"),
                        "--out", str(tmp_path / "o.md")], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "no valid results" in p.stderr and not (tmp_path / "o.md").exists()


def test_html_escapes_what_probes_wrote(tmp_path: Path) -> None:
    results, out = _layout(tmp_path)
    path = next(results.glob("cpu-*/*.jsonl"))
    text = path.read_text().replace("RuntimeError: No supported", "<script>alert(1)</script> No supported")
    path.write_text(text)
    generate(results, out, None, check=False, stacks=STACKS)
    html = out.with_suffix(".html").read_text()
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_headline_choices() -> None:
    """Each probe's headline from the metrics it declares (inenv.probe.declared), in the probe's own words first."""
    d = registry.declarations()
    assert headline({"headline": "fast", "ratio_vs_nccl": {"a": 0.5}}, d["custom-ar"]) == "fast"
    assert headline({"ratio_vs_nccl": {"a": 0.5}}, d["ar-latency"]) == "0.50× NCCL time"
    assert headline({"latency_us": {"a": 3.0, "b": 12.25}}, d["ar-latency"]) == "3.0–12.2 µs"
    assert headline({"workspace_bytes_per_rank": 29387136, "sm_count": 132}, d["ep-a2a"]) == "28.0 MiB workspace/rank"
    assert headline({"compile_s": 290.8, "objects": 3}, d["fi-jit"]) == "compiled in 291 s"
    assert headline({"compile_s": True}, d["fi-jit"]) == ""  # a flag is not a measurement
    both_sides = {"latency_us": {"a": 4.0, "b": 9.0, "c": 1.0}, "nccl_latency_us": {"a": 8.0, "b": 10.0, "c": 0}}
    assert headline(both_sides, d["custom-ar"]) == "0.50–0.90× NCCL time"  # derived where the probe stored both sides


def test_headline_reads_only_what_the_probe_declares() -> None:
    d = registry.declarations()
    assert headline({"compile_s": 290.8}, d["ep-a2a"]) == ""  # ep-a2a records no compile time
    assert headline({"headline": "fast"}, d["ar-latency"]) == ""  # nor does ar-latency write a headline
    assert headline({"workspace_bytes": 2**21}, d["fi-fusion"]) == ""  # a group's workspace, not per rank
    own = Declared(metrics=(Field("t_us", "µs by message bytes", "median", Role.LATENCY),))
    assert headline({"t_us": {"a": 2.0}, "latency_us": {"a": 9.0}}, own) == "2.0–2.0 µs"
    assert headline({"latency_us": {"a": 9.0}}, Declared()) == ""


def test_cell_headlines_name_their_variant_in_order() -> None:
    from checks.report.report import MAX_HEADLINES, labelled_headlines

    def head(key: str, text: str) -> tuple[str, tuple[tuple[str, str], ...], str]:
        return key, tuple(tuple(p.split("=")) for p in key.split(",")), text  # type: ignore[misc]

    assert labelled_headlines([]) == ""
    assert labelled_headlines([head("ranks=2,backend=nccl", "7.1–42.0 µs")]) == "7.1–42.0 µs"
    two = [head("ranks=2,backend=symm", "0.87× NCCL time"), head("ranks=2,backend=nccl", "7.1–42.0 µs")]
    assert labelled_headlines(two) == "nccl: 7.1–42.0 µs; symm: 0.87× NCCL time"
    mixed = [head("ranks=1,mode=sim,ep=2", "1.8 MiB"), head("ranks=2,mode=gpus", "3.7 MiB")]
    assert labelled_headlines(mixed) == "ranks=1,mode=sim,ep=2: 1.8 MiB; ranks=2,mode=gpus: 3.7 MiB"
    many = [head(f"ranks=2,backend=b{i}", f"{i} µs") for i in range(MAX_HEADLINES + 2)]
    assert labelled_headlines(many).endswith("; +2 more") and "b0: 0 µs" in labelled_headlines(many)
    assert headline({"other": 1}, Declared()) == ""


def _write_run(results: Path, rows: list[tuple[str, str, str, str, str, str, dict]]) -> None:
    """One run of a no-GPU host: (cell, probe, variant, status, reason code, note, evidence) per variant."""
    from checks.results.provenance import Provenance
    from checks.results.result import ProbeResult, Verdict
    from checks.results.store import RunStore
    from inenv.status import Status

    store = RunStore(results, "cpu-0123abcd", "20261130T120000Z-abcd")
    store.write_manifest({"run_id": store.run_id, "host_id": "cpu-0123abcd", "executor": "docker",
                          "facts": {"host_id": "cpu-0123abcd", "gpu_count": 0}, "cells": {}, "probes": {}})
    code = Provenance("0.1.0", "0" * 40, False, "1" * 16)
    for cell, probe, variant, status, reason, note, evidence in rows:
        verdict = Verdict(Status(status), reason, note, "install a CUDA toolkit (or the nvidia-cuda-nvcc wheel) and "
                          "set CUDA_HOME" if reason == "fi-no-nvcc" else "", 1.0, {}, evidence)
        store.append(ProbeResult(store.run_id, "cpu-0123abcd", cell, probe, variant, verdict, "2026-11-30T12:00:00Z",
                                 code))


OLD_MEMLOCK = ('not raised: the Docker daemon refused (container init: error setting rlimits for ready process: '
               'error setting rlimit type 8: operation not permitted: unknown"))')


def test_notes_merge_near_duplicates_compress_where_and_say_memlock_once(tmp_path: Path) -> None:
    """One note for notes that differ only in a version or a count, where a note
    applies as cells and counts (not every variant id), the memlock the containers did not get in the host
    section in clean words, and the catalogue's next step for fi-no-nvcc whatever a result recorded."""
    A, B, C = "cu130-torchA-sgl1-fi1", "cu130-torchB-sgl1-fi1", "cu128-torchC-sgl1-fi1"  # noqa: N806
    gate = "trtllm_comm for {}: refused before compiling: RuntimeError: No supported CUDA architectures [9, 10]."
    rows = [(A, "fi-jit", f"ranks=1,module=trtllm_comm,arch={a}", "fail", "fi-arch-gate", gate.format(a),
             {"memlock": OLD_MEMLOCK}) for a in ("12.0a", "12.0f")]
    rows += [(cell, "ar-latency", f"ranks={n},backend=b{i}", "skip", "too-few-gpus", f"needs {n} GPUs, host has 0",
              {}) for cell in (A, B) for n in (2, 4) for i in range(10)]
    rows += [(B, "custom-ar", f"ranks=1,size={s}", "fail", "", f"max error {e} at {s} tokens",
              {"memlock": "unlimited"}) for s, e in ((128, "0.5"), (64, "0.25"))]
    rows += [(C, "fi-jit", "ranks=1,module=vllm_comm,arch=12.0a", "skip", "fi-no-nvcc",
              "no nvcc in this environment: flashinfer cannot JIT anything here", {})]
    _write_run(tmp_path / "results", rows)
    out = tmp_path / "docs" / "compatibility.md"
    assert generate(tmp_path / "results", out, None, check=False, stacks=[Stack(c, "m") for c in (A, B, C)]) == 0
    md, html = (out.parent / "hosts" / "cpu-0123abcd.md").read_text(), out.with_suffix(".html").read_text()
    notes = [ln for ln in md.splitlines() if ln[:1].isdigit() and ". " in ln[:4]]
    assert len(notes) == 5, notes
    [gate_note] = [n for n in notes if "trtllm_comm for 12.0a/12.0f: refused before compiling" in n]
    assert gate_note.endswith(f"(2 variants: {A}: fi-jit ×2)")
    [gpus] = [n for n in notes if "too-few-gpus" in n]
    assert "needs 2/4 GPUs, host has 0" in gpus and gpus.endswith(f"(40 variants: {A}, {B}: ar-latency ×20)")
    assert sum("max error 0.5 at 128 tokens" in n for n in notes) == 1  # two values differ: two notes
    assert sum("max error 0.25 at 64 tokens" in n for n in notes) == 1
    assert "ranks=2,backend=b7" not in md and "ranks=2,backend=b7" not in html  # no variant id list
    assert f"(40 variants: {A}, {B}: ar-latency ×20)" in html
    from common.reasons import default

    nvcc = default().get("fi-no-nvcc")
    assert nvcc is not None and "nvidia-cuda-nvcc" not in md
    assert f"*next step:* {nvcc.remediation.replace('<', '&lt;').replace('>', '&gt;')}" in md
    memlock = ("containers did not get memlock unlimited, the Docker daemon refused (error setting rlimits for ready "
               "process: error setting rlimit type 8: operation not permitted) (2 of 4 variants run in containers, "
               "in run 20261130T120000Z-abcd); "
               "they ran with the daemon's own limit. To fix: give dockerd an unlimited hard memlock limit")
    assert f"\nMemlock: {memlock}" in md and f"<p class=\"memlock\">memlock: {memlock}" in html.replace("&#39;", "'")
    assert '"))' not in md and "&#34;))" not in html and "&quot;))" not in html
    assert "the run it came from. No Blackwell" in html and "from.No" not in html


def test_footnote_merging_and_places() -> None:
    from checks.report.footnotes import Occurrence, footnotes, places

    occ = [Occurrence("c", "p", f"v{i}", "skip", "too-few-gpus", f"needs {n} GPUs, host has 1", "")
           for i, n in enumerate((8, 2, 4, 2))]
    notes, numbers = footnotes(occ, {"too-few-gpus": "the variant needs more GPUs"}, {"too-few-gpus": "more GPUs"})
    assert [(f.number, f.note, f.remediation, f.count) for f in notes] == [
        (1, "needs 2/4/8 GPUs, host has 1", "more GPUs", 4)]
    assert numbers == [1, 1, 1, 1]
    two = [Occurrence("c", "p", "v", "fail", "", "error 0.5 at 128", ""),
           Occurrence("c", "p", "w", "fail", "", "error 0.2 at 64", "")]
    assert [f.note for f in footnotes(two, {}, {})[0]] == ["error 0.5 at 128", "error 0.2 at 64"]
    # a cell id is not a version to merge: cu130 and 0.6.8.post1 inside ids stay as they are
    ids = [Occurrence("c", "p", "v", "fail", "", f"cu130-torch2.11.0-sgl0.4.2-fi{v} broke", "")
           for v in ("0.6.16", "0.6.8.post1")]
    assert len(footnotes(ids, {}, {})[0]) == 2
    assert places([("c1", "p", "ranks=2")]) == "c1 / p / ranks=2"
    assert places([("c1", "p", "a"), ("c1", "p", "b"), ("c2", "p", "a"), ("c2", "p", "b"), ("c3", "q", "x")]) == \
        "c1, c2: p ×2; c3: q x"


def _result(probe: str, status: str, code: dict | None, cell: str = "c1", run: str = "20261201T000000Z-aaaa"):
    from checks.results.result import ProbeResult

    obj = {"schema": "stackprobe.result/2", "run_id": run, "host_id": "h", "cell_id": cell, "probe_id": probe,
           "variant": "ranks=1", "status": status, "reason_code": "", "note": "", "remediation": "", "metrics": {},
           "evidence": {}, "started_at": "2026-12-01T00:00:00Z", "duration_s": 1.0}
    if code is not None:
        obj["code"] = code
    return ProbeResult.from_json(obj)


def test_verdicts_of_unknown_or_dirty_code_are_marked_with_the_command_that_refreshes_them() -> None:
    from checks.results.freshness import refresh_list, staleness

    now = {"inventory": "aaaa"}
    clean = {"version": "0.1.0", "commit": "1796344", "dirty": False, "probe_hash": "aaaa"}
    results = {
        "clean": _result("inventory", "pass", clean, "c0"),
        "unknown": _result("inventory", "pass", {**clean, "commit": "unknown", "dirty": None}, "c1"),
        "dirty": _result("inventory", "pass", {**clean, "dirty": True}, "c2"),
        "untold": _result("inventory", "pass", {**clean, "dirty": None}, "c3"),
        "changed": _result("inventory", "pass", {**clean, "dirty": True, "probe_hash": "bbbb"}, "c4"),
        "not-run": _result("inventory", "not-run", {**clean, "dirty": True}, "c5"),
    }
    got = {k: staleness(r, now) for k, r in results.items()}
    assert got == {"clean": "", "unknown": "unknown-commit", "dirty": "dirty", "untold": "dirty",
                   "changed": "changed", "not-run": ""}
    [unknown] = refresh_list([(results["unknown"], got["unknown"])], {})
    assert unknown.command == "checks run --backend docker --only c1 --probe inventory"
    assert "commit unknown" in unknown.why
    [dirty] = refresh_list([(results[k], got[k]) for k in ("dirty", "untold")], {})
    assert dirty.command == ("checks run --backend docker --only c2 --only c3 "
                             "--probe inventory")
    assert "uncommitted changes" in dirty.why


def test_a_verdict_proven_without_a_gpu_is_marked_static_in_table_and_summary() -> None:
    from checks.report import summary

    code = {"version": "0.1.0", "commit": "1796344", "dirty": False, "probe_hash": "aaaa"}
    rs = [_result("inventory", "pass", code), _result("fi-jit", "fail", code)]
    assert summary.proven_statically(rs[:1], 0) and not summary.proven_statically(rs[:1], 2)
    assert not summary.proven_statically(rs[1:], 0)  # a fail proves nothing, statically or not
    on_cpu = summary.lines(rs, gpu_count=0)
    assert any(ln.strip().startswith("c1") and "inventory" in ln and ln.endswith("1 pass [static]") for ln in on_cpu)
    assert not any("fi-jit" in ln and "[static]" in ln for ln in on_cpu)
    assert on_cpu[-1].strip().startswith("static: proven without a GPU")
    on_gpu = summary.lines(rs, gpu_count=1)
    assert not any("static" in ln for ln in on_gpu)


def test_report_marks_static_only_on_the_gpu_less_host(tmp_path: Path) -> None:
    results, out = _layout(tmp_path)
    generate(results, out, None, check=False, current=CURRENT, stacks=STACKS)
    md = cpu = _cpu(out)
    h200 = _archive(out).split("## NVIDIA H200")[1]  # its own section
    assert "*(static)*" in _row(cpu, "cu130-torch2.11.0-sgl0.4.2-fi0.6.17")[5]
    assert "*(static)*" not in h200
    assert "*static*: proven without a GPU" in md


def test_a_page_of_a_host_the_results_no_longer_hold_is_stale_and_removed(tmp_path: Path) -> None:
    results, out = _layout(tmp_path)
    assert generate(results, out, None, check=False, current=CURRENT, stacks=STACKS) == 0
    gone = out.parent / "hosts" / "h100x8-0badc0de.md"  # a host whose folder left the results
    gone.write_text("old\n")
    assert generate(results, out, None, check=True, current=CURRENT, stacks=STACKS) == 1
    assert generate(results, out, None, check=False, current=CURRENT, stacks=STACKS) == 0
    assert not gone.exists() and (out.parent / "hosts" / "cpu-5bce98f7.md").is_file()
    assert generate(results, out, None, check=True, current=CURRENT, stacks=STACKS) == 0
