"""`provision prune` (the pure planner on fixed inputs, one real docker run) and the disk gate of
`provision build` (a stand-in free-space reader; no disk is filled)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from provision import build, prune
from provision.cli import main
from provision.doctor import DISK_BASE, DISK_PER_CELL, DISK_PER_TORCH, GB
from provision.prune import BUILD_CACHE, IMAGE, VENV, Image, plan

CELL = "cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1"
OTHER = "cu128-torch2.9.1-sgl0.4.1-fi0.6.16"
BASE, DEV = "stackprobe/base:bookworm-20aff611", "stackprobe/base-dev:bookworm-4a3a48f4"


def _img(ref: str, iid: str, size: int) -> Image:
    repo, tag = ref.rsplit(":", 1)
    return Image(repo, tag, iid, size)


IMAGES = [
    _img(f"stackprobe/{CELL}:new000000000", "id-new", 8 * GB),
    _img(f"stackprobe/{CELL}:old000000000", "id-old", 8 * GB),
    _img(f"stackprobe/{OTHER}:aaa", "id-other", 9 * GB),  # a current cell without a build record
    _img("stackprobe/gone-cell:111", "id-gone", 7 * GB),
    _img(BASE, "id-base", 266_000_000),
    _img(DEV, "id-dev", 587_000_000),
    _img("stackprobe/base-dev:bookworm-00000000", "id-olddev", 500_000_000),
    _img("stackprobe/not-a-cell:0000", "id-base", 266_000_000),  # a second name of the current base
    _img("stackprobe/gone-cell:222", "id-gone", 7 * GB),  # the same image as gone-cell:111
    _img("other/thing:1", "id-x", GB),  # not ours
    _img(f"stackprobe/{CELL}:<none>", "id-dangling", GB),  # no tag to remove by
]


def _plan(**kw: object) -> dict[str, prune.Removal]:
    args: dict[str, object] = dict(images=IMAGES, recorded={CELL: f"stackprobe/{CELL}:new000000000"},
                                   cells=[CELL, OTHER], venvs={"/v/" + CELL: 10, "/v/stale-cell": 3 * GB},
                                   base_tags=(BASE, DEV))
    args.update(kw)
    return {r.target: r for r in plan(**args)}  # type: ignore[arg-type]


def test_planner_removes_exactly_what_serves_no_cell() -> None:
    got = _plan()
    assert set(got) == {f"stackprobe/{CELL}:old000000000", "stackprobe/gone-cell:111", "stackprobe/gone-cell:222",
                        "stackprobe/base-dev:bookworm-00000000", "stackprobe/not-a-cell:0000", "/v/stale-cell"}
    assert "older image of " + CELL in got[f"stackprobe/{CELL}:old000000000"].reason
    assert "new000000000" in got[f"stackprobe/{CELL}:old000000000"].reason
    assert got["stackprobe/gone-cell:111"].reason == "no cell of the matrix builds this image"
    assert got["stackprobe/base-dev:bookworm-00000000"].reason.startswith("stale base image")
    assert got["/v/stale-cell"].kind == VENV and got["/v/stale-cell"].size == 3 * GB
    assert all(r.kind == IMAGE for t, r in got.items() if t.startswith("stackprobe/"))


def test_planner_counts_an_images_bytes_once_and_not_for_a_shared_name() -> None:
    got = _plan()
    # the base stays under its current tag: removing the alias frees nothing
    assert got["stackprobe/not-a-cell:0000"].size == 0 and "untag only" in got["stackprobe/not-a-cell:0000"].reason
    sizes = sorted(got[t].size for t in ("stackprobe/gone-cell:111", "stackprobe/gone-cell:222"))
    assert sizes == [0, 7 * GB]
    total = sum(r.size for r in got.values())
    assert total == 8 * GB + 7 * GB + 500_000_000 + 3 * GB
    text = prune.lines(list(got.values()), dry_run=True)
    assert text[-1] == "would reclaim 18.50 GB in 6 removal(s)"
    assert prune.lines([], dry_run=False) == ["nothing to prune"]


def test_planner_keeps_every_tag_of_a_cell_without_a_record_and_adds_the_build_cache_only_when_asked() -> None:
    got = _plan(recorded={})
    assert not any(CELL in t or OTHER in t for t in got if t.startswith("stackprobe/"))
    assert not any(r.kind == BUILD_CACHE for r in got.values())
    cache = _plan(build_cache=20 * GB)["docker builder prune"]
    assert cache.kind == BUILD_CACHE and cache.size == 20 * GB


def test_planner_a_cell_of_a_second_matrix_keeps_its_images() -> None:
    assert "stackprobe/gone-cell:111" not in _plan(cells=[CELL, OTHER, "gone-cell"])


def test_planner_a_tag_in_another_repository_keeps_the_bytes_and_scope_narrows_what_may_go() -> None:
    got = _plan(images=[*IMAGES, _img("mine/kept:1", "id-gone", 7 * GB)])
    assert got["stackprobe/gone-cell:111"].size == got["stackprobe/gone-cell:222"].size == 0
    assert set(_plan(scope={"stackprobe/gone-cell:111", BASE})) == {"stackprobe/gone-cell:111", "/v/stale-cell"}


def test_docker_sizes_parse_as_decimal_units() -> None:
    assert prune.parse_size("20.1GB") == 20_100_000_000
    assert prune.parse_size("587MB") == 587_000_000
    assert prune.parse_size("0B") == 0


def test_recorded_tags_reads_build_json(tmp_path: Path) -> None:
    (tmp_path / CELL).mkdir()
    (tmp_path / CELL / "build.json").write_text(json.dumps({"status": "built", "tag": "stackprobe/x:1"}))
    (tmp_path / "venvcell").mkdir()
    (tmp_path / "venvcell" / "build.json").write_text(json.dumps({"status": "built", "tag": None}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "build.json").write_text("{")
    assert prune.recorded_tags(tmp_path) == {CELL: "stackprobe/x:1"}


# --- disk gate of `provision build` -----------------------------------------------------------------------
def test_disk_check_refuses_only_when_the_free_space_cannot_hold_the_build() -> None:
    line, refusal = build.disk_check(25 * GB, 10 * GB, "/var/lib/docker", 3)
    assert line == "3 cell(s) to build need about 25 GB; 10 GB free under /var/lib/docker"
    assert refusal is not None and "provision prune" in refusal and "--ignore-disk" in refusal
    assert "\n" not in refusal
    assert build.disk_check(25 * GB, 30 * GB, "/x", 3)[1] is None
    assert build.disk_check(25 * GB, None, "/x", 3) == ("3 cell(s) to build need about 25 GB; free space under /x "
                                                        "unknown", None)


def _matrix(tmp_path: Path) -> Path:
    m = tmp_path / "m.yaml"
    m.write_text("matrix:\n  cuda: ['13.0']\n  torch: ['2.11.0']\n  sgl_kernel: ['0.4.2']\n"
                 "  flashinfer: ['0.6.8.post1', '0.6.17']\n")
    return m


def _build(tmp_path: Path, *extra: str) -> list[str]:
    return ["build", "--backend", "venv", "--offline", "--matrix", str(_matrix(tmp_path)), "--envs",
            str(tmp_path / "envs"), "--venvs", str(tmp_path / "venvs"), *extra]


def test_build_refuses_with_one_line_and_exit_2_when_the_disk_is_too_small(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Path] = []
    monkeypatch.setattr(build, "free_bytes", lambda p: seen.append(p) or 5 * GB)
    monkeypatch.setattr(build, "build_venvs", lambda cells, opts: pytest.fail("built despite the refusal"))
    with pytest.raises(SystemExit) as exc:
        main(_build(tmp_path))
    assert exc.value.code == 2
    assert seen == [tmp_path / "venvs"]
    err = capsys.readouterr().err.strip().splitlines()
    # two cells on one torch build, no base image for venv cells: the doctor's rule
    need = DISK_PER_TORCH + 2 * DISK_PER_CELL
    assert err[0] == f"provision: 2 cell(s) to build need about {need // GB} GB; 5 GB free under {tmp_path / 'venvs'}"
    assert err[1].startswith(f"provision: not enough disk under {tmp_path / 'venvs'}")
    assert "provision prune" in err[1] and len(err) == 2


def test_ignore_disk_builds_anyway_and_a_built_cell_needs_no_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(build, "free_bytes", lambda p: 5 * GB)
    called: list[int] = []
    monkeypatch.setattr(build, "build_venvs", lambda cells, opts: called.append(len(cells)) or 0)
    with pytest.raises(SystemExit) as exc:
        main(_build(tmp_path, "--ignore-disk"))
    assert exc.value.code == 0 and called == [2]
    # both cells built already (a record and its venv): nothing to need, nothing refused
    for cid in ("cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1", "cu130-torch2.11.0-sgl0.4.2-fi0.6.17"):
        (tmp_path / "venvs" / cid).mkdir(parents=True)
        (tmp_path / "envs" / cid).mkdir(parents=True)
        (tmp_path / "envs" / cid / "build.json").write_text(
            json.dumps({"status": "built", "venv": str(tmp_path / "venvs" / cid)}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(_build(tmp_path))
    assert exc.value.code == 0 and called == [2, 2]
    assert "need about" not in capsys.readouterr().err


def test_the_docker_gate_counts_the_base_image_when_it_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    class StandIn:
        def run(self, *args: str) -> subprocess.CompletedProcess[str]:
            assert args[:1] == ("info",)
            return subprocess.CompletedProcess(args, 0, "/var/lib/docker\n", "")

        def image_id(self, ref: str) -> None:
            return None  # nothing present: no base, no cell image

    from provision.api import plan as plan_cells

    cells = plan_cells(_matrix(tmp_path), offline=True)
    seen: list[Path] = []
    monkeypatch.setattr(build, "free_bytes", lambda p: seen.append(p) or 0)
    opts = build.BuildOptions(_matrix(tmp_path), envs=tmp_path / "envs", offline=True)
    with pytest.raises(build.InputError, match=f"about {(DISK_BASE + DISK_PER_TORCH + 2 * DISK_PER_CELL) // GB} GB"):
        build.disk_gate(cells, opts, StandIn())  # type: ignore[arg-type]
    assert seen == [Path("/var/lib/docker")]


# --- real docker -------------------------------------------------------------------------------------------
def _all_images(cli: str) -> set[str]:
    out = subprocess.run([cli, "images", "--format", "{{.Repository}}:{{.Tag}}|{{.ID}}"], capture_output=True,
                         text=True, check=True).stdout
    return set(out.split())


@pytest.mark.docker
def test_prune_removes_the_tags_no_cell_uses_and_nothing_else(docker_available: str, base_image: str,
                                                              tmp_path: Path) -> None:
    cli = docker_available
    gone = "stackprobe/not-a-cell-xyz:0000"
    old = f"{build.image_tag(CELL, '0000')}"
    for tag in (gone, old):
        subprocess.run([cli, "tag", base_image, tag], check=True, capture_output=True)
    try:
        before = _all_images(cli)
        envs = tmp_path / "envs"
        (envs / CELL).mkdir(parents=True)
        (envs / CELL / "build.json").write_text(json.dumps({"status": "built", "tag": build.image_tag(CELL, "1")}))
        # only the two test tags are looked at: the user's own images are not this test's to judge
        removals = prune.gather([Path(__file__).parent.parent / "matrix.yaml"], envs, tmp_path / "venvs", cli,
                                build_cache=False, scope=(gone, old))
        assert sorted(r.target for r in removals) == sorted([gone, old])
        assert all(r.size == 0 for r in removals)  # both name the base image, which stays
        assert prune.apply(removals, cli) == []
        after = _all_images(cli)
        assert {ln for ln in before - after} == {ln for ln in before if ln.split("|")[0] in (gone, old)}
        assert after <= before and any(ln.startswith(base_image + "|") for ln in after)
    finally:
        for tag in (gone, old):
            subprocess.run([cli, "image", "rm", tag], capture_output=True)


def test_prune_cli_removes_stale_venv_cells_without_an_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(build.Docker, "unreachable", lambda self: "docker CLI not found")
    venvs = tmp_path / "venvs"
    for name in (CELL, "cu999-stale-cell"):
        (venvs / name / "lib").mkdir(parents=True)
        (venvs / name / "lib" / "f.so").write_bytes(b"x" * 2_000_000)
    with pytest.raises(SystemExit) as exc:
        main(["prune", "--dry-run", "--venvs", str(venvs), "--envs", str(tmp_path / "envs")])
    assert exc.value.code == 0 and (venvs / "cu999-stale-cell").is_dir()
    out = capsys.readouterr()
    assert "images not looked at: docker CLI not found" in out.err
    assert out.out.splitlines() == [f"would remove venv        {venvs / 'cu999-stale-cell'}  2 MB  (venv cell of no "
                                    "matrix cell)", "would reclaim 2 MB in 1 removal(s)"]
    with pytest.raises(SystemExit) as exc:
        main(["prune", "--json", "--venvs", str(venvs), "--envs", str(tmp_path / "envs")])
    assert exc.value.code == 0
    assert json.loads(capsys.readouterr().out)["total_bytes"] == 2_000_000
    assert sorted(p.name for p in venvs.iterdir()) == [CELL]
