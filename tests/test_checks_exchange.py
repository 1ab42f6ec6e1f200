"""`checks share | import | validate`: bundles made from the committed results, crafted bundles and folders read as
untrusted input, and what the generated pages make of them."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from checks import cli
from checks.results import reader
from checks.results.provenance import Checkout
from checks.share import bundle
from checks.share.scrub import Identity, Scrubber
from tests.checks_helpers import committed

H2 = "h200x2-5bce98f7"
RUN = "20261201T021126Z-b42a"


def _main(*argv: str | Path) -> int:
    return cli.main([str(a) for a in argv])


def _bundle_of(results: Path, host: str, out: Path) -> dict:
    assert _main("share", "--results", results, "--host", host, "--out", out) in (0, 1)
    return json.loads(out.read_text())


def _section(md: str, host: str) -> str:
    """One host's section: from its heading to the next first- or second-level heading."""
    start = md.index(next(ln for ln in md.splitlines() if ln.startswith("## ") and f"host `{host}`" in ln))
    ends = [e for e in (md.find("\n## ", start + 1), md.find("\n# ", start + 1)) if e >= 0]
    return md[start:min(ends)] if ends else md[start:]


def _md(docs: Path) -> str:
    """Every Markdown page a report wrote: the answer, the archive, each host's page."""
    pages = [docs / "compatibility.md", *docs.glob("compatibility-archive.md"), *sorted((docs / "hosts").glob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


def _uncontributed(page: str) -> str:
    """A page without the marks of imported runs (each run's ", contributed: ... by CODE")."""
    return re.sub(r", contributed: imported from [^()]*(?=\))", "", page)


def test_h200x2_bundle_imported_into_an_empty_folder_regenerates_its_section(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # shared as from a machine of no name: NCCL's log lines in these results carry the recording host's
    # name, which this machine may share (both were "vm"), and would then be scrubbed, rightly
    monkeypatch.setattr(Identity, "here", classmethod(lambda cls: cls()))
    whole = tmp_path / "whole"
    shutil.copytree(committed(), whole / "results")
    path = tmp_path / "h2.bundle.json"
    data = _bundle_of(whole / "results", H2, path)
    assert data["schema"] == "stackprobe.bundle/1" and data["host"]["gpu_name"] == "NVIDIA H200"
    assert data["host"]["gpu_count"] == 2 and data["host"]["interconnect"].startswith("NVLink")
    fresh = tmp_path / "fresh"
    assert _main("import", path, "--results", fresh / "results") == 0
    for d in (whole, fresh):
        assert _main("report", "--results", d / "results", "--out", d / "docs" / "compatibility.md") == 0
    a, b = (_md(d / "docs") for d in (whole, fresh))
    # imported runs are shown as contributed, with the code that measured them; otherwise the same section
    runs = len(list((committed() / H2).glob("*.jsonl")))
    assert _section(b, H2).count(", contributed: imported from h2.bundle.json, measured by ") == runs
    assert _uncontributed(_section(b, H2)) == _section(a, H2)
    # the results files come back as the store wrote them (nothing in them needed scrubbing)
    for src in sorted((committed() / H2).glob("*.jsonl")):
        assert (fresh / "results" / H2 / src.name).read_bytes() == src.read_bytes()
    # and the whole page of that host alone is the same from the bundle as from a copy of its folder
    alone = tmp_path / "alone"
    shutil.copytree(committed() / H2, alone / "results" / H2)
    assert _main("report", "--results", alone / "results", "--out", alone / "docs" / "compatibility.md") == 0
    names = sorted(p.relative_to(fresh / "docs") for p in (fresh / "docs").rglob("*.*"))
    assert names == sorted(p.relative_to(alone / "docs") for p in (alone / "docs").rglob("*.*"))
    for name in names:
        assert (alone / "docs" / name).read_text() == _uncontributed((fresh / "docs" / name).read_text()), name


def test_importing_twice_skips_and_a_colliding_run_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "b.json"
    data = _bundle_of(committed(), H2, path)
    res = tmp_path / "results"
    assert _main("import", path, "--results", res) == 0
    assert _main("import", path, "--results", res) == 0
    assert "already present" in capsys.readouterr().err
    target = res / H2 / f"{RUN}.jsonl"
    before = target.read_bytes()
    run = next(r for r in data["runs"] if r["run_id"] == RUN)
    run["results"][0]["note"] = "different"
    path.write_text(json.dumps(data))
    assert _main("import", path, "--results", res) == 1
    err = capsys.readouterr().err
    assert f"run {H2}/{RUN} is already under" in err and "different results; refused" in err
    assert target.read_bytes() == before


def _host_folder(root: Path, host: str = "gpux2-0123abcd", run: str = "20260101T000000Z-abcd",
                 note: str = "", cell: str = "cu130-torch2.11.0-sglnone-fi0.6.18", env: dict | None = None,
                 code: dict | None = None) -> Path:
    """A small host folder: one manifest and two results, one passing one failing."""
    folder = root / host
    folder.mkdir(parents=True)
    code = code or {"version": "0.1.0", "commit": "a" * 40, "dirty": False}

    def result(variant: str, status: str, note: str) -> dict:
        return {"schema": "stackprobe.result/2", "run_id": run, "host_id": host, "cell_id": cell,
                "probe_id": "ar-latency", "variant": variant, "status": status, "reason_code": "",
                "note": note, "remediation": "", "metrics": {}, "evidence": {}, "started_at":
                "2026-01-01T00:00:00+00:00", "duration_s": 1.0, "code": {**code, "probe_hash": "0" * 16}}

    lines = [result("ranks=2,backend=nccl", "pass", ""), result("ranks=2,backend=custom", "fail", note)]
    (folder / f"{run}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    manifest = {"schema": "stackprobe.manifest/2", "run_id": run, "host_id": host, "written_at": "x",
                "executor": "docker", "level": "full", "cells": {cell: {"versions": {"torch": "2.11.0"}}},
                "probes": {}, "code": {**code, "probe_hashes": {}}, "argv": ["run", "--all"],
                "facts": {"gpu_name": "GPU X", "gpu_count": 2, "env": env or {}}}
    (folder / f"{run}.manifest.json").write_text(json.dumps(manifest))
    return folder


def test_share_scrubs_names_paths_addresses_and_credentials(tmp_path: Path) -> None:
    env = {"NCCL_COMM_ID": "alice:hunter2@10.0.0.7:29500", "NCCL_SOCKET_IFNAME": "eth0",
           "TORCH_HOME": "/home/alice/.cache/torch", "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz",
           "NCCL_DEBUG_FILE": "/tmp/nccl.gpu-node-07.log", "GLOO_ADDR": "fe80::1ff:fe23:4567:890a",
           "CUDA_NOTE": "proxy https://bob:pa55@proxy.example.com mac 00:1b:21:3a:4f:5c GPU-12345678-1234-1234-1234-"
                        "123456789abc token=s3cr3t"}
    _host_folder(tmp_path / "results", env=env, note="failed on gpu-node-07 for alice in /Users/alice/x")
    scrubber = Scrubber(Identity(("gpu-node-07",), ("alice",), ()))
    data, problems = bundle.build(tmp_path / "results", "gpux2-0123abcd", scrubber, Checkout("0.1.0", "b" * 40, False))
    text = bundle.dumps(data).decode()
    assert not problems
    for leak in ("hunter2", "10.0.0.7", "alice", "gpu-node-07", "hf_abc", "pa55", "bob", "00:1b:21", "12345678-1234",
                 "s3cr3t", "fe80::"):
        assert leak not in text, leak
    env_out = data["runs"][0]["manifest"]["facts"]["env"]
    assert env_out["NCCL_SOCKET_IFNAME"] == "eth0" and env_out["TORCH_HOME"] == "~/.cache/torch"
    assert env_out["HF_TOKEN"] == "<redacted>" and env_out["NCCL_COMM_ID"] == "<redacted>@<ip>:29500"
    assert data["runs"][0]["results"][1]["note"] == "failed on <host> for <user> in ~/x"
    assert data["scrubbed"]["credential"] >= 3 and data["scrubbed"]["IP address"] == 2


def test_show_prints_exactly_the_bytes_of_the_file(tmp_path: Path, capsysbinary: pytest.CaptureFixture) -> None:
    _host_folder(tmp_path / "results")
    out = tmp_path / "b.json"
    assert _main("share", "--results", tmp_path / "results", "--host", "gpux2-0123abcd", "--show", "--out", out) == 0
    assert capsysbinary.readouterr().out == out.read_bytes()
    assert _main("share", "--results", tmp_path / "results", "--host", "gpux2-0123abcd", "--show") == 0
    shown = capsysbinary.readouterr()
    assert shown.out == out.read_bytes() and b"nothing written" in shown.err


def test_a_bundle_says_when_its_code_was_dirty_or_unknown(tmp_path: Path) -> None:
    clean, dirty = tmp_path / "clean", tmp_path / "dirty"
    _host_folder(clean)
    _host_folder(dirty, code={"version": "0.1.0", "commit": "c" * 40, "dirty": True})
    args = ("gpux2-0123abcd", Scrubber(), Checkout("0.1.0", "unknown", None))
    code = bundle.build(clean, *args)[0]["code"]
    assert code["clean"] is True and code["warnings"] == []
    code = bundle.build(dirty, *args)[0]["code"]
    said = f"stackprobe 0.1.0 from a dirty checkout of commit {'c' * 40} made some runs"
    assert code["clean"] is False and code["warnings"] == [said]
    assert code["shared_by"] == {"version": "0.1.0", "commit": "unknown", "dirty": None}


CRAFTED_NOTE = "x | y <script>alert(1)</script> [c](javascript:alert(1)) $(touch /tmp/pwned) `id`"
CRAFTED_CELL = "cu130-torch2.11$(touch /tmp/pwned)-sglnone-fi<b>|x"
CRAFTED_HOST = "javascript:alert(1)-0123abcd"


def test_crafted_host_cell_and_note_give_no_link_no_broken_row_no_shell_text(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "src"
    _host_folder(src, note=CRAFTED_NOTE)
    data, _ = bundle.build(src, "gpux2-0123abcd", Scrubber(), Checkout("0.1.0", "a" * 40, False))
    extra = dict(data["runs"][0]["results"][0], cell_id=CRAFTED_CELL, variant="ranks=2,backend=nccl")
    data["runs"][0]["results"].append(extra)
    good = tmp_path / "good.json"
    good.write_bytes(bundle.dumps(data))
    evil = tmp_path / "evil.json"
    evil.write_bytes(bundle.dumps({**data, "host_id": CRAFTED_HOST}))
    res = tmp_path / "r" / "results"
    assert _main("import", evil, good, "--results", res) == 2  # the evil host is unreadable as a whole
    err = capsys.readouterr().err
    assert "host id 'javascript:alert(1)-0123abcd' is not of the form" in err
    assert err.count("cell id 'cu130-torch2.11$(touch") == 1  # one warning for the one bad item
    assert sorted(p.name for p in res.iterdir()) == ["gpux2-0123abcd"]
    assert _main("report", "--results", res, "--out", res.parent / "docs" / "compatibility.md") == 0
    files = [*sorted((res.parent / "docs").rglob("*.*")), *sorted((res / "gpux2-0123abcd").iterdir())]
    text = {f.name: f.read_text() for f in files}
    text["compatibility.md"] = _md(res.parent / "docs")
    for name, body in text.items():  # the refused ids reach no file
        assert "touch /tmp/pwned)-sgl" not in body and CRAFTED_HOST not in body, name
    commands = re.findall(r"`(checks [^`]*)`", text["compatibility.md"])
    commands += re.findall(r"<code>(checks [^<]*)</code>", text["compatibility.html"])
    assert commands  # the page does print commands to paste (the missing ar-latency variants)
    for c in commands:  # none carries the crafted text
        assert not re.search(r"[$`;|&<>()]", c.replace("&#39;", "'")), c
    html = text["compatibility.html"]
    assert "<script" not in html.lower()
    assert not re.search(r"""(?i)(href|src|action)\s*=\s*["']?\s*javascript:""", html)
    md = text["compatibility.md"]
    table = [ln for ln in md.splitlines() if ln.startswith("| `")]
    header = next(ln for ln in md.splitlines() if ln.startswith("| cell |"))
    cols = len(re.split(r"(?<!\\)\|", header))
    assert table and all(len(re.split(r"(?<!\\)\|", ln)) == cols for ln in table)  # no row broken by a `|`
    assert "](javascript:" not in md.split("Notes:")[0]  # no markdown link built from it in the table


def _bad_results(root: Path) -> int:
    """A results folder with one good host and one bad example of each kind; the count of bad items."""
    folder = _host_folder(root)
    run = folder / "20260101T000000Z-abcd.jsonl"
    good = run.read_text().splitlines()
    bad_lines = [b"\xff\xfe latin-1 \xe9",  # not UTF-8
                 b"[" * 5000 + b"]" * 5000,  # nested too deep
                 json.dumps(dict(json.loads(good[0]), note="\ud800")).encode(),  # a lone surrogate
                 json.dumps(dict(json.loads(good[0]), status="great")).encode(),  # unknown status
                 json.dumps(dict(json.loads(good[0]), cell_id="a|b")).encode(),  # cell id grammar
                 json.dumps(dict(json.loads(good[0]), run_id="../../etc")).encode(),  # run id
                 json.dumps(dict(json.loads(good[0]), extra=1)).encode(),  # unknown field
                 b"NaN"]
    run.write_bytes(b"\n".join([*(g.encode() for g in good), *bad_lines]) + b"\n" + b'{"torn')
    (root / "javascript:alert(1)").mkdir()  # a host folder outside the grammar
    os.symlink("/etc", root / "gpux1-0123abcd")  # a link out of the folder
    os.symlink("/nonexistent", folder / "20260101T000001Z-abcd.jsonl")  # dangling link
    os.mkfifo(folder / "20260101T000002Z-abcd.jsonl")  # would hang a reader
    (folder / "20260101T000003Z-abcd.jsonl").mkdir()  # a folder named like a run
    (folder / ".20260101T000000Z-abcd.jsonl.x.tmp").write_text("")  # a killed writer's leftover: passed over
    return len(bad_lines) + 1 + 5 + 3  # lines, the torn tail, the five entries, three runs without a manifest


def test_validate_warns_once_per_bad_item_and_keeps_the_rest(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "results"
    expected = _bad_results(root)
    assert _main("validate", root) == 1
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert len(warnings) == expected, "\n".join(warnings)
    assert "Traceback" not in err and "results directory, 1 host(s), 4 run(s), 2 result(s)" in err
    assert _main("validate", "--json", root) == 1
    found = json.loads(capsys.readouterr().out)
    assert (found["kind"], found["runs"], found["results"], len(found["problems"])) == ("results", 4, 2, expected)
    for why in ("not UTF-8", "nested deeper than", "lone surrogate", "unknown status 'great'", "cell id 'a|b'",
                "run id '../../etc'", "unknown field(s) 'extra'", "not a JSON number", "unterminated last line",
                "a symbolic link; not followed", "; not read", "folder name: host id"):
        assert why in err, why


def test_validate_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _main("validate", committed()) == 0
    assert "all well formed" in capsys.readouterr().err
    assert _main("validate", tmp_path / "missing") == 2
    notbundle = tmp_path / "x.json"
    notbundle.write_text('{"schema": "other/1"}')
    assert _main("validate", notbundle) == 2
    newer = tmp_path / "n.json"
    newer.write_text('{"schema": "stackprobe.bundle/9"}')
    assert _main("validate", newer) == 2
    err = capsys.readouterr().err
    assert "not a stackprobe bundle" in err and "update stackprobe" in err and "Traceback" not in err


def test_size_limits_and_one_host_folder(tmp_path: Path, capsys: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _host_folder(tmp_path / "results")
    assert _main("validate", folder) == 0  # one host's folder
    assert "host folder, 1 host(s), 1 run(s), 2 result(s); all well formed" in capsys.readouterr().err
    path = tmp_path / "b.json"
    _bundle_of(tmp_path / "results", "gpux2-0123abcd", path)
    monkeypatch.setattr(reader, "MAX_LINE", 503)
    assert _main("validate", path) == 1  # the failing result's line is the longer one
    assert "more than the limit of 503" in capsys.readouterr().err
    monkeypatch.setattr(reader, "MAX_FILE", 1000)
    assert _main("validate", path) == 2
    assert "more than the limit of 1000" in capsys.readouterr().err


def test_a_bundle_naming_this_machine_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Its runs would pass for this machine's own: the target of --resume, reuse and this host's advice."""
    from checks.results import hostfacts

    own = hostfacts.own_host_id()
    assert own == hostfacts.collect()["host_id"]  # the id every run here records
    _host_folder(tmp_path / "src", host=own)
    path = tmp_path / "b.json"
    assert _main("share", "--results", tmp_path / "src", "--host", own, "--out", path) in (0, 1)
    capsys.readouterr()
    res = tmp_path / "results"
    assert _main("import", path, "--results", res) == 1
    err = capsys.readouterr().err
    assert f"names this machine's own host id {own}" in err and "nothing written" in err
    assert not (res / own).exists()


def test_a_bundle_contradicting_the_gpus_of_a_host_already_here_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    host = "gpux2-0123abcd"
    res = tmp_path / "results"
    _host_folder(res, host=host)  # GPU X, 2 GPUs
    src = tmp_path / "src"
    folder = _host_folder(src, host=host, run="20260102T000000Z-abcd")
    m = folder / "20260102T000000Z-abcd.manifest.json"
    m.write_text(m.read_text().replace('"gpu_count": 2', '"gpu_count": 8'))
    path = tmp_path / "b.json"
    assert _main("share", "--results", src, "--host", host, "--out", path) in (0, 1)
    capsys.readouterr()
    assert _main("import", path, "--results", res) == 1
    err = capsys.readouterr().err
    assert f"names host {host}" in err and "gpu_count 8 here 2" in err and "nothing written" in err
    assert sorted(p.name for p in (res / host).iterdir()) == ["20260101T000000Z-abcd.jsonl",
                                                              "20260101T000000Z-abcd.manifest.json"]
    # the same GPUs: the new run is imported beside the one already there
    m.write_text(m.read_text().replace('"gpu_count": 8', '"gpu_count": 2'))
    assert _main("share", "--results", src, "--host", host, "--out", path) in (0, 1)
    assert _main("import", path, "--results", res) == 0
    assert (res / host / "20260102T000000Z-abcd.jsonl").is_file()


def test_an_import_is_refused_while_a_run_holds_the_host_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from checks.results.store import RunLock

    path = tmp_path / "b.json"
    _bundle_of(committed(), H2, path)
    capsys.readouterr()
    res = tmp_path / "results"
    with RunLock(res / H2):
        assert _main("import", path, "--results", res) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("checks")]
    assert len(err) == 1 and "is writing to" in err[0] and H2 in err[0], err
    assert list((res / H2).iterdir()) == []
    assert _main("import", path, "--results", res) == 0  # once the folder is free


def test_an_import_onto_a_full_disk_writes_whole_runs_and_lists_them(tmp_path: Path) -> None:
    import shlex
    import subprocess
    import sys

    if os.geteuid() != 0 or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("a tmpfs needs root or a user namespace with its own mounts")
    path = tmp_path / "b.json"
    data = _bundle_of(committed(), H2, path)
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = [sys.executable, "-m", "checks.cli", "import", str(path), "--results", str(disk / "results")]
    # enough for the host's first runs, not for all of them; listed after, while the tmpfs is still mounted
    script = (f"mount -t tmpfs -o size=300k tmpfs {shlex.quote(str(disk))} && {shlex.join(argv)}; rc=$?; "
              f"ls {shlex.quote(str(disk / 'results' / H2))}; exit $rc")
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "No space left on device" in p.stderr
    listed = p.stdout.split()
    runs = {n.split(".")[0] for n in listed}
    assert runs and len(runs) < len(data["runs"])  # some fit, not all
    for run in runs:  # each run there is whole: its results and its manifest, no temporary file
        assert {f"{run}.jsonl", f"{run}.manifest.json"} <= set(listed), listed
    assert not [n for n in listed if n.endswith(".tmp")]
    written = [ln for ln in p.stderr.splitlines() if ln.startswith("imported ")]
    assert sorted(w.removeprefix(f"imported {H2}/") for w in written) == sorted(runs)
    assert "the run it stopped at is not there" in p.stderr


def test_short_host_and_user_names_and_the_machines_domain_are_scrubbed_where_they_name_it() -> None:
    from checks.share.scrub import domains_of

    assert domains_of({"n1", "n1.corp.example.com"}) == ("corp.example.com",)
    assert domains_of({"box.local", "box"}) == ()  # a local-only suffix is no domain
    s = Scrubber(Identity(("n1.corp.example.com", "n1"), ("ab",), (), domains_of({"n1.corp.example.com"})))
    cases = {
        "failed on n1 for ab": "failed on <host> for <user>",
        "NCCL_COMM_ID=n1:29500": "NCCL_COMM_ID=<host>:29500",  # an assignment's value names the host too
        "addr n1:29500, peers [n1, n2]": "addr <host>:29500, peers [<host>, n2]",
        "sm_n1 n1.0 ab12 tab (ab)": "sm_n1 n1.0 ab12 tab (<user>)",
        "see https://wiki.corp.example.com/x on n1.corp.example.com": "see https://wiki.<domain>/x on <host>",
    }
    for text, want in cases.items():
        assert s.text(text) == want, text
    assert s.counts["domain name"] == 1 and s.counts["host name"] == 5 and s.counts["user name"] == 2
    assert "domain name: 1" in s.summary()


PAYLOAD = ("a|b <script>alert(1)</script><img src=x onerror=alert(1)> [x](javascript:alert(1)) **bold** "
           "`tick` $(touch /tmp/pwned) ; rm -rf ~ & 'q' \"dq\" \\ \n# heading")
# Fields whose grammar or type the reader checks: a payload there refuses the item (tested elsewhere).
CHECKED = {"schema", "run_id", "host_id", "cell_id", "probe_id", "variant", "status", "reason_code", "started_at",
           "written_at", "level", "executor", "probe_hash", "commit", "version", "argv"}


def _payload_everywhere(value: object, key: str = "") -> object:
    if key in CHECKED:
        return value
    if isinstance(value, str):
        return PAYLOAD
    if isinstance(value, dict):
        return {k: _payload_everywhere(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_payload_everywhere(v, key) for v in value]
    return value


def payload_results(tmp_path: Path) -> Path:
    """A results folder imported from a bundle whose every free-text field (notes, remediations, evidence, host
    facts, cell reasons and versions) holds PAYLOAD; the import's own checks pass it."""
    src = tmp_path / "src"
    folder = _host_folder(src, note="n", env={"NCCL_ALGO": "Ring"})
    manifest_path = next(folder.glob("*.manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    manifest["facts"].update(host_label="GPU X ×2", driver="580.1", topology="NV18", pcie=["x16"])
    manifest["cells"]["cu130-torch2.11.0-sglnone-fi0.6.18"].update(status="built", reason="r", image="img")
    manifest_path.write_text(json.dumps(manifest))
    results = [json.loads(ln) for ln in next(folder.glob("*.jsonl")).read_text().splitlines()]
    for r in results:
        r.update(remediation="do x", evidence={"log_tail": "t", "kernel": "k", "nested": {"why": ["w"]}},
                 metrics={"latency_us": {"4096": 1.5}})
    next(folder.glob("*.jsonl")).write_text("".join(json.dumps(r) + "\n" for r in results))
    data, problems = bundle.build(src, "gpux2-0123abcd", Scrubber(), Checkout("0.1.0", "a" * 40, False))
    assert not problems
    path = tmp_path / "payload.json"
    path.write_bytes(bundle.dumps(_payload_everywhere(data)))
    res = tmp_path / "r" / "results"
    assert _main("import", path, "--results", res) == 0
    return res


def test_a_bundle_with_payloads_in_every_text_field_lands_escaped_everywhere(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    res = payload_results(tmp_path)
    capsys.readouterr()
    out = res.parent / "docs" / "compatibility.md"
    assert _main("report", "--results", res, "--out", out) == 0
    md, html = _md(out.parent), out.with_suffix(".html").read_text()
    assert PAYLOAD.split()[0] not in md  # the raw "a|b" never lands: its bar is escaped
    assert "<script" not in md.lower() and "<img" not in md.lower() and "](javascript:" not in md
    header = next(ln for ln in md.splitlines() if ln.startswith("| cell |"))
    cols = len(re.split(r"(?<!\\)\|", header))
    assert all(len(re.split(r"(?<!\\)\|", ln)) == cols for ln in md.splitlines() if ln.startswith("| `"))
    assert not any(ln.startswith("# heading") for ln in md.splitlines())  # no line of it starts a heading
    assert "<script" not in html.lower() and "<img" not in html.lower()
    assert not re.search(r"(?i)<[a-z][^>]*\son\w+\s*=", html)  # no element carries an event handler
    assert not re.search(r"""(?i)(href|src|action)\s*=\s*["']?\s*javascript:""", html)
    assert "&lt;script&gt;" in html  # the payload is shown, as text
    assert _main("advise", "--results", res) == 0
    printed = capsys.readouterr().out
    assert "<script>" in printed  # the recorded text is there, as text
    assert not any(ln.startswith("# heading") for ln in printed.splitlines())  # and it starts no line of its own
    for command in re.findall(r"run `([^`]*)`", printed):  # every command printed to paste
        assert "pwned" not in command and shlex.split(command)[0] == "checks", command


def test_an_import_names_the_hardware_class_its_host_joins(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Identity, "here", classmethod(lambda cls: cls()))
    path = tmp_path / "h2.bundle.json"
    _bundle_of(committed(), H2, path)
    capsys.readouterr()
    assert _main("import", path, "--results", tmp_path / "results") == 0
    err = capsys.readouterr().err
    assert (f"contributed results of host {H2} (hardware class H200 ×2, NVLink (NV18), driver 580: one column of "
            "the table with the other hosts of it), measured by stackprobe") in err
