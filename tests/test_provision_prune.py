"""`provision prune` (the pure planner on fixed inputs, one real docker run) and the disk gate of
`provision build` (a stand-in free-space reader; no disk is filled)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from common.errors import InputError
from provision import build, buildsession, prune
from provision.build import DockerBuilder
from provision.cli import main
from provision.dockercli import Docker
from provision.doctor import GB
from provision.options import BuildOptions
from provision.prune import BUILD_CACHE, BYTECODE, IMAGE, VENV, Image, plan
from provision.venvbuild import VenvBuilder

CELL = "cu130-torch2.14.1-sgl0.4.10-fi0.7.2"
OTHER = "cu128-torch2.9.1-sgl0.4.1-fi0.6.17"
BASE, DEV = "stackprobe/base:bookworm-20aff611", "stackprobe/base-dev:bookworm-4a3a48f4"


def _img(ref: str, iid: str, size: int, layers: tuple[str, ...] = ()) -> Image:
    repo, tag = ref.rsplit(":", 1)
    return Image(repo, tag, iid, size, layers)


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
                        "stackprobe/base-dev:bookworm-00000000", "stackprobe/not-a-cell:0000", "/v/stale-cell",
                        "docker builder prune"}
    # BuildKit keeps a removed image's layers in its cache: the image bytes come free with the cache prune
    cache = got["docker builder prune"]
    assert cache.kind == BUILD_CACHE and cache.size == 0 and "removed images' layers" in cache.reason
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
    assert text[-1] == "would reclaim 18.50 GB in 7 removal(s)"
    assert prune.lines([], dry_run=False) == ["nothing to prune"]


def test_planner_counts_the_layers_an_image_frees_once_and_none_a_kept_image_uses() -> None:
    """Three cells gone from the matrix, two of them on one torch build (sharing its layers), all on the base
    that stays; a dangling image still uses one cell layer. The bytes freed are each layer's once."""
    sizes = {"base": 266, "torch-a": 5000, "cell-a1": 2000, "cell-a2": 1900, "torch-b": 7000, "cell-b": 2200,
             "extra": 10}
    images = [
        _img(BASE, "id-base", 266, ("base",)),
        _img("stackprobe/gone-a1:1", "id-a1", 7266, ("base", "torch-a", "cell-a1")),
        _img("stackprobe/gone-a2:1", "id-a2", 7166, ("base", "torch-a", "cell-a2")),
        _img("stackprobe/gone-b:1", "id-b", 9466, ("base", "torch-b", "cell-b")),
        _img("stackprobe/gone-b:<none>", "id-dangling", 9476, ("base", "torch-b", "cell-b", "extra")),
    ]
    got = {r.target: r for r in plan(images, {}, [], {}, (BASE,), layer_sizes=sizes)}
    assert set(got) == {"stackprobe/gone-a1:1", "stackprobe/gone-a2:1", "stackprobe/gone-b:1", "docker builder prune"}
    assert got["stackprobe/gone-a1:1"].size == 5000 + 2000  # the torch layer counts with the first of its cells
    assert got["stackprobe/gone-a2:1"].size == 1900 and "of its layers stay or count above" in got[
        "stackprobe/gone-a2:1"].reason
    assert got["stackprobe/gone-b:1"].size == 0  # the dangling image keeps all its layers
    # without the layer store: whole image sizes, as before (an upper bound)
    assert sum(r.size for r in plan(images, {}, [], {}, (BASE,))) == 7266 + 7166 + 9466


def test_chain_ids_name_a_layer_with_everything_below_it() -> None:
    import hashlib

    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    assert prune.chain_ids([a]) == (a,)
    assert prune.chain_ids([a, b]) == (a, "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest())
    assert prune.chain_ids([b, b])[1] != prune.chain_ids([a, b])[1]


def test_planner_keeps_every_tag_of_a_cell_without_a_record_and_adds_the_build_cache_only_when_asked() -> None:
    got = _plan(recorded={})
    assert not any(CELL in t or OTHER in t for t in got if t.startswith("stackprobe/"))
    assert got["docker builder prune"].size == 0  # only to give the removed images' layers back
    assert not any(r.kind == BUILD_CACHE for r in _plan(images=[]).values())  # no image goes: no cache prune
    cache = _plan(build_cache=20 * GB)["docker builder prune"]
    assert cache.kind == BUILD_CACHE and cache.size == 20 * GB
    assert [r.kind for r in _plan(images=[], build_cache=GB).values()] == [VENV, BUILD_CACHE]


def test_planner_a_cell_of_a_second_matrix_keeps_its_images() -> None:
    assert "stackprobe/gone-cell:111" not in _plan(cells=[CELL, OTHER, "gone-cell"])


def test_planner_a_tag_in_another_repository_keeps_the_bytes_and_scope_narrows_what_may_go() -> None:
    got = _plan(images=[*IMAGES, _img("mine/kept:1", "id-gone", 7 * GB)])
    assert got["stackprobe/gone-cell:111"].size == got["stackprobe/gone-cell:222"].size == 0
    assert set(_plan(scope={"stackprobe/gone-cell:111", BASE})) == {"stackprobe/gone-cell:111", "/v/stale-cell"}


def test_planner_removes_the_untagged_images_a_rebuild_of_a_cell_left_and_no_other_untagged_one() -> None:
    left = Image("<none>", "<none>", "sha256:left", 6 * GB, cell=CELL)  # built for CELL, its tag since rebuilt
    got = _plan(images=[*IMAGES, left, Image("<none>", "<none>", "sha256:theirs", GB)])
    assert got["sha256:left"].kind == IMAGE and got["sha256:left"].size == 6 * GB
    assert got["sha256:left"].reason == f"untagged image of {CELL}: a later build of that cell took its tag"
    assert "sha256:theirs" not in got and "id-dangling" not in got  # no cell label: another tool's, or unknown
    assert "sha256:left" not in _plan(images=[*IMAGES, left], scope={"stackprobe/gone-cell:111"})


def _sha(head: str) -> str:
    """A full image id whose first 16 hex chars (what names its bytecode folder) are ``head`` * 16."""
    return "sha256:" + head * 16 + "0123456789abcdef" * 3


BC_IMAGES = [
    _img(f"stackprobe/{CELL}:new000000000", _sha("a"), 8 * GB),
    _img("stackprobe/gone-cell:111", _sha("b"), 7 * GB),  # no cell builds it: this prune removes it
    _img("other/thing:1", _sha("c"), GB),  # not stackprobe's: a cell may still run it
    Image("<none>", "<none>", _sha("d"), GB),  # untagged: stays
    _img(BASE, _sha("e"), 266_000_000),
    _img("stackprobe/not-a-cell:0000", _sha("e"), 266_000_000),  # an alias of the base, which stays
]
BC_FOLDERS = {f"/bc/{c * 16}": 1_000_000 for c in "abcdef"} | {"/bc/not-an-id": 5_000_000}


def _bc_plan(**kw: object) -> dict[str, prune.Removal]:
    return {r.target: r for r in plan(BC_IMAGES, {CELL: f"stackprobe/{CELL}:new000000000"}, [CELL], {},
                                      (BASE, DEV), **kw) if r.kind == BYTECODE}  # type: ignore[arg-type]


def test_planner_removes_the_bytecode_folders_of_images_that_are_gone_or_go_now() -> None:
    got = _bc_plan(bytecode=BC_FOLDERS)
    # a, c, d, e: an image that stays names the folder (any repository, untagged, or under another tag)
    assert sorted(got) == ["/bc/" + "b" * 16, "/bc/" + "f" * 16, "/bc/not-an-id"]
    assert got["/bc/" + "f" * 16].reason == f"bytecode of image {'f' * 16}, which is no longer present"
    assert got["/bc/" + "b" * 16].reason == f"bytecode of image {'b' * 16}, which this prune removes " \
                                            "(stackprobe/gone-cell:111)"
    assert got["/bc/not-an-id"].size == 5_000_000 and got["/bc/" + "f" * 16].size == 1_000_000
    # the rows join the same table and total as the images and venvs
    everything = plan(BC_IMAGES, {CELL: f"stackprobe/{CELL}:new000000000"}, [CELL], {}, (BASE, DEV),
                      bytecode=BC_FOLDERS)
    text = prune.lines(everything, dry_run=True)
    assert f"would remove bytecode    /bc/{'f' * 16}  1 MB  (bytecode of image {'f' * 16}, which is no longer " \
           "present)" in text
    assert text[-1] == f"would reclaim {prune.human(7 * GB + 7_000_000)} in 6 removal(s)"
    assert prune.to_json(everything, True)["total_bytes"] == 7 * GB + 7_000_000


def test_planner_keeps_every_bytecode_folder_without_an_engine_and_under_a_scope_only_the_scoped_images() -> None:
    # no engine: gather passes no images and no folders; nothing tells which images exist
    assert _bc_plan() == {}
    assert [r for r in plan([], {}, [CELL], {}, (BASE, DEV)) if r.kind == BYTECODE] == []
    # a scope names the images that may go: only their folders go with them, stale ones of others stay
    assert sorted(_bc_plan(bytecode=BC_FOLDERS, scope={"stackprobe/gone-cell:111"})) == ["/bc/" + "b" * 16]
    assert _bc_plan(bytecode=BC_FOLDERS, scope={"stackprobe/not-a-cell:0000"}) == {}  # its image stays


_STAND_IN_DOCKER = """#!{python}
import sys
args = sys.argv[1:]
full = "{full}"
if args[:2] == ["images", "--all"]:
    print("stackprobe/{cell}|new000000000|" + full.removeprefix("sha256:")[:12])  # docker prints short ids
elif args[:2] == ["image", "inspect"]:
    print(full + "\\t1000\\t[]\\tnull")
elif args[:1] == ["info"]:
    pass  # no layer store to read
else:
    sys.exit("unexpected: " + " ".join(args))
"""


def test_gather_reads_the_full_ids_and_apply_removes_the_stale_bytecode_folders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in docker CLI lists one image by its short id, as docker does; the folder named by its full id's
    first 16 hex chars stays, the others go from the disk; without an engine none goes."""
    import sys

    full = _sha("a")
    docker = tmp_path / "docker"
    docker.write_text(_STAND_IN_DOCKER.format(python=sys.executable, full=full, cell=CELL))
    docker.chmod(0o755)
    root = tmp_path / "pycache"
    for name in ("a" * 16, "a" * 12, "9" * 16):
        (root / name / "torch").mkdir(parents=True)
        (root / name / "torch" / "x.cpython-312.pyc").write_bytes(b"\0" * 3000)
    envs = tmp_path / "envs"
    (envs / CELL).mkdir(parents=True)
    (envs / CELL / "build.json").write_text(json.dumps({"tag": f"stackprobe/{CELL}:new000000000"}))
    matrix = Path(__file__).parent.parent / "matrix.yaml"
    monkeypatch.setattr(prune, "BYTECODE_ROOT", root)  # the default root when none is given
    assert prune.gather([matrix], envs, tmp_path / "venvs", None, False) == []
    removals = prune.gather([matrix], envs, tmp_path / "venvs", str(docker), False)
    assert [(r.kind, Path(r.target).name, r.size) for r in removals] == [(BYTECODE, "9" * 16, 3000),
                                                                        (BYTECODE, "a" * 12, 3000)]
    assert prune.apply(removals, str(docker)) == []
    assert sorted(p.name for p in root.iterdir()) == ["a" * 16]


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
    line, refusal = buildsession.disk_check(25 * GB, 10 * GB, "/var/lib/docker", 3, 2)
    assert line == "3 cell(s) to build (2 new torch build(s)) need about 25 GB; 10 GB free under /var/lib/docker"
    assert refusal is not None and "provision prune" in refusal and "--ignore-disk" in refusal
    assert "\n" not in refusal
    assert buildsession.disk_check(25 * GB, 30 * GB, "/x", 3)[1] is None
    assert buildsession.disk_check(25 * GB, None, "/x", 3, 1, 1) == (
        "3 cell(s) to build (1 new torch build(s), 1 already here) need about 25 GB; free space under /x unknown", None)


def _matrix(tmp_path: Path) -> Path:
    m = tmp_path / "m.yaml"
    m.write_text("matrix:\n  cuda: ['13.0']\n  torch: ['2.11.0']\n  sgl_kernel: ['0.4.2']\n"
                 "  flashinfer: ['0.6.8.post1', '0.6.17']\n")
    return m


def _build(tmp_path: Path, *extra: str) -> list[str]:
    return ["build", "--backend", "venv", "--no-reach-check", "--matrix", str(_matrix(tmp_path)), "--envs",
            str(tmp_path / "envs"), "--venvs", str(tmp_path / "venvs"), *extra]


def test_build_refuses_with_one_line_and_exit_2_when_the_disk_is_too_small(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Path] = []
    monkeypatch.setattr(buildsession, "free_bytes", lambda p: seen.append(p) or 5 * GB)
    monkeypatch.setattr(VenvBuilder, "lock", lambda self, cells, opts: ([opts.envs / c.cell_id for c in cells], []))
    monkeypatch.setattr(VenvBuilder, "build",
                        lambda self, folders, opts, report, on_built=None: pytest.fail("built despite refusal"))
    with pytest.raises(SystemExit) as exc:
        main(_build(tmp_path))
    assert exc.value.code == 2
    assert seen == [tmp_path / "venvs"]
    err = capsys.readouterr().err.strip().splitlines()
    # two venv cells on one torch build: 5.5 GB for the torch build in uv's cache and 0.6 GB per cell
    assert err[0] == (f"provision: 2 cell(s) to build (1 new torch build(s)) need about 6.7 GB; 5 GB free "
                      f"under {tmp_path / 'venvs'}")
    assert err[1].startswith(f"provision: not enough disk under {tmp_path / 'venvs'}")
    assert "provision prune" in err[1] and len(err) == 2


def test_ignore_disk_builds_anyway_and_a_built_cell_needs_no_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(buildsession, "free_bytes", lambda p: 5 * GB)
    called: list[int] = []
    monkeypatch.setattr(VenvBuilder, "lock", lambda self, cells, opts: ([opts.envs / c.cell_id for c in cells], []))
    monkeypatch.setattr(VenvBuilder, "build",
                        lambda self, folders, opts, report, on_built=None: called.append(len(folders)) or [])
    with pytest.raises(SystemExit) as exc:
        main(_build(tmp_path, "--ignore-disk"))
    assert exc.value.code == 0 and called == [2]
    # both cells built already (a record and its venv): nothing to need, nothing refused
    for cid in ("cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1", "cu130-torch2.11.0-sgl0.4.2-fi0.6.17"):  # _matrix's
        (tmp_path / "venvs" / cid).mkdir(parents=True)
        (tmp_path / "envs" / cid).mkdir(parents=True)
        (tmp_path / "envs" / cid / "build-venv.json").write_text(
            json.dumps({"backend": "venv", "status": "built", "venv": str(tmp_path / "venvs" / cid)}))
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

        def buildkit(self) -> bool:
            return True

    from common.api import plan as plan_cells

    cells = plan_cells(_matrix(tmp_path), offline=True)
    seen: list[Path] = []
    monkeypatch.setattr(buildsession, "free_bytes", lambda p: seen.append(p) or 0)
    opts = BuildOptions(_matrix(tmp_path), envs=tmp_path / "envs", offline=True)
    with pytest.raises(InputError, match="about 8.5 GB"):  # 1 GB of base images, 5.5 GB, 2 x 1 GB
        buildsession.disk_gate(cells, opts, DockerBuilder(StandIn()))  # type: ignore[arg-type]
    assert seen == [Path("/var/lib/docker")]


def _daemon(images: dict[str, str]) -> type:
    """A stand-in Docker CLI that knows ``images`` (tag or id -> id) and the default Docker root."""

    class StandIn:
        def run(self, *args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.CompletedProcess(args, 0, "/var/lib/docker\n", "")

        def image_id(self, ref: str) -> str | None:
            return StandIn.images.get(ref)

        def buildkit(self) -> bool:
            return True

    StandIn.images = dict(images)  # type: ignore[attr-defined]
    return StandIn


def test_the_docker_gate_counts_a_torch_build_an_image_here_holds_as_zero(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The three cells of the default matrix on torch 2.14.1 (one torch build): with nothing built they need
    that build once; with the current image of one of them here, the other two need their own layers only,
    and an image of an older lock or template of a cell does not count as built."""
    import shutil

    from common.api import DEFAULT_MATRIX
    from common.api import plan as plan_cells
    from provision.baseimage import DEV_TAG
    from provision.render import load_cell, render

    root = Path(__file__).resolve().parent.parent
    cells = plan_cells(DEFAULT_MATRIX, only=["cu130-torch2.14.1-*"], offline=True)
    assert len(cells) == 3
    for c in cells:
        shutil.copytree(root / "envs" / c.cell_id, tmp_path / "envs" / c.cell_id,
                        ignore=shutil.ignore_patterns("build.json"))
    first, second = (tmp_path / "envs" / c.cell_id for c in cells[:2])
    opts = BuildOptions(DEFAULT_MATRIX, envs=tmp_path / "envs", offline=True)

    StandIn = _daemon({DEV_TAG: "sha256:dev"})

    monkeypatch.setattr(buildsession, "free_bytes", lambda p: 100 * GB)
    buildsession.disk_gate(cells, opts, DockerBuilder(StandIn()))  # type: ignore[arg-type]
    # one torch build's layers (5.5 GB) and 1 GB per cell; the base image is here
    assert capsys.readouterr().err == ("provision: 3 cell(s) to build (1 new torch build(s)) need about 8.5 GB; "
                                       "100 GB free under /var/lib/docker\n")
    text = render(load_cell(first), build.Base("registry-free", DEV_TAG))
    StandIn.images[build.image_tag(first.name, build.build_hash(text, first, "sha256:dev", {}))] = "sha256:one"
    StandIn.images[build.image_tag(second.name, "0ld0ld0ld0ld")] = "sha256:old"
    buildsession.disk_gate(cells, opts, DockerBuilder(StandIn()))  # type: ignore[arg-type]
    assert capsys.readouterr().err == ("provision: 2 cell(s) to build (0 new torch build(s), 1 already here) need "
                                       "about 2 GB; 100 GB free under /var/lib/docker\n")


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


@pytest.mark.docker
def test_prune_removes_the_image_a_rebuild_left_untagged(docker_available: str, base_image: str,
                                                        tmp_path: Path) -> None:
    """Built twice under one tag, as `provision build` does when the first build's record is gone: the first
    image loses its tag and keeps its cell label; prune finds it by that label and removes it by id."""
    import os

    cli = docker_available
    tag = "stackprobe/not-a-cell-rebuilt:0000"
    ids = []
    for n in (1, 2):
        (tmp_path / "Dockerfile").write_text(f'FROM {base_image}\nLABEL org.stackprobe.cell="not-a-cell-rebuilt"\n'
                                             f"RUN echo {n} > /n\n")
        subprocess.run([cli, "build", "-t", tag, str(tmp_path)], check=True, capture_output=True,
                       env=dict(os.environ, DOCKER_BUILDKIT="1"))
        ids.append(subprocess.run([cli, "image", "inspect", "--format", "{{.Id}}", tag], check=True,
                                  capture_output=True, text=True).stdout.strip())
    try:
        [left] = [i for i in prune.list_images(cli) if i.image_id == ids[0]]
        assert not left.tagged and left.cell == "not-a-cell-rebuilt"
        removals = prune.gather([Path(__file__).parent.parent / "matrix.yaml"], tmp_path / "envs", tmp_path / "venvs",
                                cli, build_cache=False)
        mine = [r for r in removals if r.target in ids or r.target == tag]
        assert [(r.kind, r.target) for r in mine] == [(IMAGE, ids[0]), (IMAGE, tag)]  # the tag: no cell builds it
        assert prune.apply(mine, cli) == []
        assert not {i.image_id for i in prune.list_images(cli)} & set(ids)
    finally:
        for ref in (tag, *ids):
            subprocess.run([cli, "image", "rm", ref], capture_output=True)


def test_prune_cli_removes_stale_venv_cells_without_an_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(Docker, "unreachable", lambda self: "docker CLI not found")
    stale = tmp_path / "pycache" / ("9" * 16)  # no engine: no telling whether its image is gone
    stale.mkdir(parents=True)
    monkeypatch.setattr(prune, "BYTECODE_ROOT", stale.parent)
    venvs = tmp_path / "venvs"
    for name in (CELL, "cu999-stale-cell"):
        (venvs / name / "lib").mkdir(parents=True)
        (venvs / name / "lib" / "f.so").write_bytes(b"x" * 2_000_000)
    with pytest.raises(SystemExit) as exc:
        main(["prune", "--dry-run", "--venvs", str(venvs), "--envs", str(tmp_path / "envs")])
    assert exc.value.code == 0 and (venvs / "cu999-stale-cell").is_dir()
    out = capsys.readouterr()
    assert "images and their bytecode folders not looked at: docker CLI not found" in out.err
    assert out.out.splitlines() == [f"would remove venv        {venvs / 'cu999-stale-cell'}  2 MB  (venv cell of no "
                                    "matrix cell)", "would reclaim 2 MB in 1 removal(s)"]
    with pytest.raises(SystemExit) as exc:
        main(["prune", "--json", "--venvs", str(venvs), "--envs", str(tmp_path / "envs")])
    assert exc.value.code == 0
    assert json.loads(capsys.readouterr().out)["total_bytes"] == 2_000_000
    assert sorted(p.name for p in venvs.iterdir()) == [CELL]
    assert stale.is_dir()


@pytest.mark.docker
@pytest.mark.slow
def test_prune_gives_back_the_bytes_of_a_buildkit_image_it_removes(docker_available: str, base_image: str,
                                                                   tmp_path: Path) -> None:
    """BuildKit keeps a removed image's layers in its build cache: prune counts the layer the image alone has
    (read from the layer store) and its `docker builder prune` makes that layer go from the engine."""
    import os

    cli = docker_available
    tag = "stackprobe/not-a-cell-layers:0000"
    (tmp_path / "Dockerfile").write_text(f"FROM {base_image}\nRUN head -c 20000000 /dev/urandom > /blob\n")
    subprocess.run([cli, "build", "-t", tag, str(tmp_path)], check=True, capture_output=True,
                   env=dict(os.environ, DOCKER_BUILDKIT="1"))
    try:
        [img] = [i for i in prune.list_images(cli) if i.ref == tag]
        sizes = prune.layer_sizes(cli, img.layers)
        if sizes is None:
            pytest.skip("the engine's layer store is not readable here")
        top = img.layers[-1]
        assert 20_000_000 <= sizes[top] < 21_000_000
        removals = prune.gather([Path(__file__).parent.parent / "matrix.yaml"], tmp_path / "envs", tmp_path / "venvs",
                                cli, build_cache=False, scope=(tag,))
        assert [(r.kind, r.target) for r in removals] == [(IMAGE, tag), (BUILD_CACHE, "docker builder prune")]
        assert removals[0].size == sizes[top]  # the base's layer stays with the base image
        assert prune.apply(removals, cli) == []
        assert top not in {layer for i in prune.list_images(cli) for layer in i.layers}
        assert prune.layer_sizes(cli, [top]) is None  # gone from the layer store: the bytes came back
    finally:
        subprocess.run([cli, "image", "rm", tag], capture_output=True)


def test_a_cell_whose_previous_image_is_still_here_needs_no_disk_to_rebuild(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its tag moved with an input of the build (the self-check's code, say) but the image its last build made
    is still in the daemon: Docker's cache holds its layers, so the gate counts neither it nor its torch build,
    and says so; a cell built nowhere still counts."""
    import shutil

    from common.api import DEFAULT_MATRIX
    from common.api import plan as plan_cells
    from provision.baseimage import DEV_TAG

    root = Path(__file__).resolve().parent.parent
    cells = plan_cells(DEFAULT_MATRIX, only=["cu130-torch2.14.1-*"], offline=True)
    for c in cells:
        shutil.copytree(root / "envs" / c.cell_id, tmp_path / "envs" / c.cell_id,
                        ignore=shutil.ignore_patterns("build.json"))
    for c in cells[:2]:  # two of the three were built before, under tags that are not current any more
        (tmp_path / "envs" / c.cell_id / "build.json").write_text(json.dumps(
            {"cell_id": c.cell_id, "status": "built", "tag": f"stackprobe/{c.cell_id}:0ld", "image_id": "sha256:prev"}))

    StandIn = _daemon({DEV_TAG: "sha256:dev", "sha256:prev": "sha256:prev"})

    monkeypatch.setattr(buildsession, "free_bytes", lambda p: 100 * GB)
    opts = BuildOptions(DEFAULT_MATRIX, envs=tmp_path / "envs", offline=True)
    buildsession.disk_gate(cells, opts, DockerBuilder(StandIn()))  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert "2 cell(s) rebuild from the layers of their previous image" in err
    # the third needs its own layers only: its torch build is in the two images still here
    assert "1 cell(s) to build (0 new torch build(s), 1 already here) need about 1 GB" in err
