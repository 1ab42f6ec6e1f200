"""What `provision build` says while it builds: cell n of N, one line per build step (never a layer digest),
how long a build has run against its last build, the time left; and the note of an image without nvcc
in the reason catalogue's words. A stand-in Docker replays a recorded BuildKit log; no daemon is needed."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from common.progress import Ticker, console, duration, estimate
from common.reasons import default as catalogue
from provision import build, buildprogress
from provision.baseimage import DEFAULT_TAG
from provision.options import BuildOptions
from tests.checks_helpers import ROOT

LOG = (ROOT / "tests" / "golden" / "provision" / "buildkit-plain.log").read_text().splitlines()
CELLS = ("cu128-torch2.9.1-sgl0.4.1-fi0.6.16", "cu128-torch2.9.1-sgl0.4.1-fi0.6.17")


def facts(cell: str) -> dict[str, Any]:
    """What the self-check prints for such an image (recorded from the real cu128 build)."""
    fi = cell.rsplit("fi", 1)[1]
    return {"python": "3.11.2", "torch": {"version": "2.9.1+cu128", "cuda": "12.8", "nccl": "2.27.5"},
            "sgl_kernel": {"version": "0.4.1", "cudart_major": ["12"]}, "flashinfer": {"version": fi}}


class ReplayDocker:
    """The docker CLI as build_locked uses it; ``build`` replays the recorded BuildKit log."""

    cli = "docker"

    def __init__(self, pause_s: float = 0.0) -> None:
        self.images = {DEFAULT_TAG: "sha256:base"}
        self.pause_s = pause_s
        self.builds = 0

    def buildkit(self) -> bool:
        return True

    def image_id(self, ref: str) -> str | None:
        return self.images.get(ref)

    def build(self, dockerfile: Path, context: Path, tag: str, buildkit: bool, log: Path, on_line: Any) -> int:
        self.builds += 1
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            for line in LOG:
                out.write(line + "\n")
                if line.strip():
                    on_line(line.strip())
                if line.startswith("#11 0.444"):
                    time.sleep(self.pause_s)  # the long step: the ticker speaks meanwhile
        self.images[tag] = f"sha256:{tag[-12:]}"
        return 0

    def run(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        if args[0] == "run":  # the self-check
            cell = next(c for c in CELLS if f"stackprobe/{c}:" in " ".join(args))
            return subprocess.CompletedProcess(args, 0, json.dumps(facts(cell)) + "\n", "")
        return subprocess.CompletedProcess(args, 0, "", "")


@pytest.fixture
def cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    monkeypatch.setattr(build, "LOGS", tmp_path / "logs")
    monkeypatch.setattr("provision.baseimage.ensure_base", lambda **kw: DEFAULT_TAG)
    out = []
    for cid in CELLS:
        # the matrix's cu128 cell, and a copy of it that asks another flashinfer: two cells of one torch build
        shutil.copytree(ROOT / "envs" / CELLS[1], tmp_path / "envs" / cid,
                        ignore=shutil.ignore_patterns("build.json"))
        meta = json.loads((tmp_path / "envs" / cid / "cell.json").read_text())
        meta["cell_id"], meta["expected"]["flashinfer"] = cid, cid.rsplit("fi", 1)[1]
        (tmp_path / "envs" / cid / "cell.json").write_text(json.dumps(meta))
        out.append(tmp_path / "envs" / cid)
    return out


def _opts(tmp_path: Path) -> BuildOptions:
    return BuildOptions(tmp_path / "unused.yaml", envs=tmp_path / "envs", dockerfiles=tmp_path / "df")


def test_build_says_cell_n_of_n_its_steps_how_long_and_what_is_left(tmp_path: Path, cells: list[Path]) -> None:
    first, second = cells
    (first / "build.json").write_text(json.dumps({"status": "built", "tag": "stackprobe/old:1", "build_s": 480.0}))
    (second / "build.json").write_text(json.dumps({"status": "failed", "build_s": 60.0}))
    said: list[tuple[str, str]] = []
    docker = ReplayDocker(pause_s=0.6)
    records = build.build_locked(cells, _opts(tmp_path), docker, lambda cid, msg: said.append((cid, msg)),
                                 tick_s=0.2)
    assert [r["status"] for r in records] == ["built", "built"] and docker.builds == 2
    lines = [f"{cid} {msg}".strip() for cid, msg in said]
    assert lines[0] == "images: 2 to build; about 9m00s by their last builds"
    a, b = CELLS
    tag_a = records[0]["tag"]
    # and why each builds again: a record with no inputs to compare, a failed build
    assert f"{a} cell 1 of 2: building {tag_a} (last build 8m00s; its last build recorded no inputs to compare)" \
        in lines
    assert f"{b} cell 2 of 2: building {records[1]['tag']} (last build 1m00s; its last build failed)" in lines
    steps = [msg for cid, msg in said if cid == a and msg.startswith(("step ", "exporting"))]
    assert steps == [
        "step 1/7: FROM docker.io/stackprobe/base:bookworm-20aff611",
        "step 4/7: COPY torch.lock /opt/stackprobe/torch.lock",
        "step 2/7: RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install --quiet uv==0.13.9",
        "step 3/7: RUN python3 -m venv /opt/venv",
        "step 5/7: RUN /opt/uv/bin/uv pip install --python /opt/venv/bin/python --no-deps --require-hashes -r "
        "/opt/stackprobe/torch.lock",
        "step 6/7: COPY requirements.lock /opt/stackprobe/requirements.lock",
        "step 7/7: RUN /opt/uv/bin/uv pip sync --python /opt/venv/bin/python --require-hashes "
        "/opt/stackprobe/requirements.lock",
        "exporting the image",
    ]
    # none of the recorded log's 13 layer digests, package lines or timings reaches the console
    assert not any("sha256:" in ln or ln.split(" ", 1)[-1].startswith("#") or "+ numpy" in ln for ln in lines)
    assert all("\n" not in ln for ln in lines)
    ticks = [ln for ln in lines if ln.startswith(f"{a} (cell 1 of 2) building for ")]
    # the long step is where the ticks fall (a loaded machine may tick once before it, at an earlier step)
    assert ticks and all(" of 8m00s last time" in t for t in ticks)
    assert any(t.endswith(" of 8m00s last time; at step 7/7: RUN /opt/uv/bin/uv pip sync --python "
                          "/opt/venv/bin/python --require-hashes /opt/stackprobe/requirements.lock") for t in ticks)
    end_a = next(ln for ln in lines if ln.startswith(f"{a} cell 1 of 2: built after "))
    assert end_a.endswith("· 1 of 2 done, about 1m00s left")
    assert next(ln for ln in lines if ln.startswith(f"{b} cell 2 of 2: built after ")).endswith("· 2 of 2 done")

    # the second build: nothing changed, nothing is built, and the build times stay for the next estimate
    again: list[str] = []
    rebuilt = build.build_locked(cells, _opts(tmp_path), docker, lambda cid, msg: again.append(f"{cid} {msg}"))
    assert [r["status"] for r in rebuilt] == ["skipped-unchanged"] * 2 and docker.builds == 2
    assert again[-1] == " images: 0 to build, 2 unchanged"
    assert json.loads((first / "build.json").read_text())["build_s"] == records[0]["build_s"]


def test_a_rebuild_names_the_inputs_that_changed(tmp_path: Path, cells: list[Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each build records a digest of each input of its tag; a later build that changes the tag says which
    input differs: a lock, or the self-check's files."""
    docker = ReplayDocker()
    first = build.build_locked(cells, _opts(tmp_path), docker, lambda cid, msg: None)
    assert [r["status"] for r in first] == ["built", "built"]
    assert set(first[0]["inputs"]) == {"Dockerfile", "base image", "build args", "self-check", "toolkit.lock",
                                       "torch.lock", "kernel.lock", "requirements.lock"}
    with (cells[0] / "requirements.lock").open("a") as f:
        f.write("# one more line\n")
    texts = build.selfcheck_texts()
    monkeypatch.setattr(build, "selfcheck_texts", lambda: [*texts[:-1], texts[-1] + "\nX = 1\n"])
    said: list[str] = []
    again = build.build_locked(cells, _opts(tmp_path), docker, lambda cid, msg: said.append(f"{cid} {msg}"))
    assert [r["status"] for r in again] == ["built", "built"] and docker.builds == 4
    a, b = CELLS
    starts = sorted(ln for ln in said if " cell " in ln and ": building " in ln)
    assert starts[0].startswith(f"{a} cell 1 of 2: building ")
    assert starts[0].endswith("; requirements.lock, self-check changed since its last build)")
    assert starts[1].endswith("; self-check changed since its last build)")


def test_an_image_without_nvcc_says_the_catalogues_reason_and_next_step(tmp_path: Path, cells: list[Path]) -> None:
    """The build's note and the table's note for fi-no-nvcc are one text, and its next step
    is the nvidia/cuda devel base (the registry's CUDA 12 nvcc wheel has no nvcc)."""
    [rec, _] = build.build_locked(cells, _opts(tmp_path), ReplayDocker())
    reason = catalogue().get("fi-no-nvcc")
    assert reason is not None
    assert rec["base"] == DEFAULT_TAG  # registry-free, no toolkit: the CUDA 12.8 wheels have no nvcc
    assert rec["note"] == (f"{reason.message}; next step: {reason.remediation} (for this cell: "
                           "nvidia/cuda:12.8.1-devel-ubuntu24.04)")
    assert "provision build --base nvidia" in reason.remediation and "nvidia-cuda-nvcc" not in reason.remediation
    assert json.loads((cells[0] / "build.json").read_text())["note"] == rec["note"]


def test_buildlog_keeps_steps_and_errors_only() -> None:
    assert buildprogress.step("#4 [stage-0 1/7] FROM x") == ("4", "step 1/7: FROM x")
    assert buildprogress.step("Step 3/9 : RUN make") == ("step3", "step 3/9: RUN make")
    assert buildprogress.step("#1 [internal] load build definition from x.Dockerfile") is None
    assert buildprogress.step("#5 sha256:bc9fdab8e16ee2e424b04d3a8bf11c07a9fa5affa0ddd83afa8e3aed453cab39") is None
    long = buildprogress.step("#9 [2/3] RUN " + "x" * 400)
    assert long is not None and len(long[1]) == len("step 2/3: ") + buildprogress.STEP_LIMIT and long[1].endswith("…")
    assert buildprogress.error("#9 ERROR: process \"/bin/sh -c false\" did not complete successfully: exit code: 1")
    assert buildprogress.error("#11 13.80  + numpy==2.4.6") is None


def test_durations_estimates_and_a_console_that_never_wraps() -> None:
    assert [duration(s) for s in (0.44, 42.4, 482, 3900)] == ["0.4 s", "42 s", "8m02s", "1h05m"]
    assert estimate([60.0, None, 30.0]).text() == "about 1m30s + 1 never timed"
    assert estimate([None]).text() == "unknown (1 never timed)"
    assert estimate([]).text() == "nothing left"
    buf = io.StringIO()
    con = console()
    con.file = buf  # not a terminal, as in a log or CI: 80 columns by default
    line = "cell 1 of 2 " + "cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1 " * 5
    con.print(line.strip(), markup=False)
    assert buf.getvalue() == line.strip() + "\n"


def test_ticker_repeats_until_stopped() -> None:
    heard: list[str] = []
    with Ticker(heard.append, interval=0.1) as ticker:
        ticker.start("a", lambda elapsed: f"a {elapsed:.1f}")
        time.sleep(0.45)
        ticker.stop("a")
        n = len(heard)
        time.sleep(0.3)
    assert 2 <= n <= 5 and len(heard) == n and heard[0].startswith("a 0.")


def test_an_images_self_check_runs_beside_the_next_images_build(tmp_path: Path, cells: list[Path]) -> None:
    """One builder: the first image's self-check (a container of it) waits until the second image's build has
    begun. Run one after the other, that never happens and the wait runs out; run beside it, both cells are built
    and the first cell's line comes after its check, with the time it took."""
    import threading

    class SlowCheckDocker(ReplayDocker):
        def __init__(self) -> None:
            super().__init__()
            self.second_started = threading.Event()
            self.events: list[str] = []

        def build(self, dockerfile: Path, context: Path, tag: str, buildkit: bool, log: Path, on_line: Any) -> int:
            self.events.append(f"build {tag.split(':')[0]}")
            if self.builds == 1:
                self.second_started.set()
            return super().build(dockerfile, context, tag, buildkit, log, on_line)

        def run(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
            if args[0] == "run" and f"stackprobe/{CELLS[0]}:" in " ".join(args):
                beside = self.second_started.wait(timeout=20)
                self.events.append(f"check {CELLS[0]} ended, second build begun: {beside}")
                if not beside:
                    return subprocess.CompletedProcess(args, 1, "", "the second build never began")
            return super().run(*args, **kw)

    docker = SlowCheckDocker()
    said: list[str] = []
    records = build.build_locked(cells, _opts(tmp_path), docker, lambda cid, msg: said.append(f"{cid} {msg}"))
    assert [r["status"] for r in records] == ["built", "built"], records
    assert docker.events[:3] == [f"build stackprobe/{CELLS[0]}", f"build stackprobe/{CELLS[1]}",
                                 f"check {CELLS[0]} ended, second build begun: True"]
    assert any(ln.startswith(f"{CELLS[0]} cell 1 of 2: built after ") for ln in said)
