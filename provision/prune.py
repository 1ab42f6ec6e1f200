"""`provision prune`: remove the stackprobe images and venv cells that serve no cell of the matrix
(and the untagged images a rebuild of a cell left behind), and the bytecode folders of images that are gone.

``plan`` is pure: from the images present, the tags `provision build` recorded, the cells of the matrices
and the venv folders, it returns what to remove and why. ``gather`` and ``apply`` are the docker and file
system edges. Images are removed by tag, never by id: a tag that shares its image with a tag that stays
only loses its name, and the bytes stay (its size is then counted as 0). Where the engine's layer store can
be read, the bytes an image frees are those of its layers that no image that stays uses (the cells of one
torch build share its layers), each counted once; elsewhere an image's whole size, an upper bound. BuildKit
keeps a removed image's layers in its build cache, so removing images always ends with `docker builder prune`
(which keeps the layers of the images that stay, and their cache).

The docker executor keeps one bytecode folder per image id (any image a cell names, not only stackprobe's);
nothing else removes them, so a folder whose image neither stays nor is removed by this prune goes. Without
an engine there is no telling which images exist, and no bytecode folder goes.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.api import resolve_all
from common.build import backend, buildrecord
from common.caches import BYTECODE_ROOT, bytecode_key, compile_cache_dir
from provision.baseimage import DEFAULT_TAG, DEV_TAG
from provision.render import CELL_LABEL, image_tag

GB = 1_000_000_000
IMAGE, VENV, BUILD_CACHE, COMPILE_CACHE, BYTECODE = "image", "venv", "build-cache", "compile-cache", "bytecode"
REPO_PREFIX = "stackprobe/"


@dataclass(frozen=True)
class Image:
    repo: str  # stackprobe/<name>
    tag: str
    image_id: str
    size: int  # bytes
    layers: tuple[str, ...] = ()  # chain ids of its layers, base first (empty: unknown)
    cell: str = ""  # its org.stackprobe.cell label: `provision build` made it for that cell

    @property
    def ref(self) -> str:
        return f"{self.repo}:{self.tag}"

    @property
    def tagged(self) -> bool:
        return self.tag != "<none>"

    @property
    def target(self) -> str:
        """What `docker image rm` is given: the tag, or the id of an image that has none."""
        return self.ref if self.tagged else self.image_id


@dataclass(frozen=True)
class Removal:
    kind: str  # image | venv | build-cache | compile-cache | bytecode
    target: str  # image ref, folder, or "docker builder prune"
    reason: str
    size: int  # bytes it frees (0: an image that only loses a name)


def cell_repo(cell_id: str) -> str:
    """The image repository of a cell, as `provision build` names it (provision.render.image_tag)."""
    return image_tag(cell_id, "x").rsplit(":", 1)[0]


def _image_reason(img: Image, cells_by_repo: Mapping[str, str], recorded: Mapping[str, str],
                  base_tags: frozenset[str]) -> str | None:
    """Why this image serves nothing any more, or None to keep it."""
    cell = cells_by_repo.get(img.repo)
    if cell is not None:
        current = recorded.get(cell)
        # Without a recorded tag there is no telling which image is the current one: keep them all.
        if current is None or img.ref == current:
            return None
        return f"older image of {cell} (envs/{cell}/build.json records {current})"
    name = img.repo[len(REPO_PREFIX):]
    if name.startswith("base"):
        return None if img.ref in base_tags else f"stale base image (current: {', '.join(sorted(base_tags))})"
    return "no cell of the matrix builds this image"


def plan(images: Iterable[Image], recorded: Mapping[str, str], cells: Iterable[str], venvs: Mapping[str, int],
         base_tags: Iterable[str], build_cache: int | None = None,
         scope: Collection[str] | None = None, compile_cache: tuple[str, int] | None = None,
         layer_sizes: Mapping[str, int] | None = None,
         bytecode: Mapping[str, int] | None = None) -> list[Removal]:
    """What to remove: stackprobe images no cell uses, venv cells of no matrix cell, and the BuildKit cache
    when ``build_cache`` (its size in bytes) is given. ``images`` are all the images (any repository, and
    untagged ones: they keep their layers); ``recorded`` maps a cell to the tag its build.json records;
    ``venvs`` maps a venv folder to its size; ``scope``, when given, the only image refs that may go;
    ``compile_cache``, when given, the shared compile cache's (folder, size); ``layer_sizes`` the bytes of
    each layer (chain id), when the layer store was read; ``bytecode`` maps each bytecode folder of the
    docker executor to its size (None: the images present are unknown, so none may go)."""
    cell_set = set(cells)
    cells_by_repo = {cell_repo(c): c for c in cell_set}
    bases = frozenset(base_tags)
    every = list(images)
    images = [i for i in every if i.tagged]
    ours = [i for i in images if i.repo.startswith(REPO_PREFIX) and (scope is None or i.ref in scope)]
    doomed = [(i, r) for i in ours if (r := _image_reason(i, cells_by_repo, recorded, bases)) is not None]
    if scope is None:
        # An untagged image `provision build` made (its cell label says so) lost its tag to a later build of
        # that cell: nothing can name it any more. Another tool's untagged images are not ours to judge.
        doomed += [(i, f"untagged image of {i.cell}: a later build of that cell took its tag")
                   for i in every if not i.tagged and i.cell]
    doomed_keys = {(i.ref, i.image_id) for i, _ in doomed}
    kept = [i for i in every if (i.ref, i.image_id) not in doomed_keys]
    kept_ids = {i.image_id for i in kept}
    by_layer = layer_sizes is not None and all(i.layers for i in every)
    kept_layers = {layer for i in kept for layer in i.layers}
    out, counted, freed = [], set(), set()
    for img, reason in sorted(doomed, key=lambda d: d[0].target):
        # An image's bytes come free once, and only when no kept tag names it.
        if img.image_id in kept_ids:
            out.append(Removal(IMAGE, img.target, f"{reason}; untag only: a kept tag names the same image", 0))
        elif img.image_id in counted:
            out.append(Removal(IMAGE, img.target, f"{reason}; same image as a tag above", 0))
        elif by_layer:
            assert layer_sizes is not None
            mine = [layer for layer in img.layers if layer not in kept_layers and layer not in freed]
            freed.update(mine)
            size = sum(layer_sizes.get(layer, 0) for layer in mine)
            shared = "" if size == img.size else f"; {human(img.size - size)} of its layers stay or count above"
            out.append(Removal(IMAGE, img.target, reason + shared, size))
        else:
            out.append(Removal(IMAGE, img.target, reason, img.size))
        counted.add(img.image_id)
    for folder, size in sorted(venvs.items()):
        if Path(folder).name not in cell_set:
            out.append(Removal(VENV, folder, "venv cell of no matrix cell", size))
    if build_cache is not None:
        out.append(Removal(BUILD_CACHE, "docker builder prune", "BuildKit build cache (--build-cache)", build_cache))
    elif any(r.kind == IMAGE and r.size for r in out):
        # An image BuildKit built leaves its layers in BuildKit's cache when it is removed: the bytes counted
        # above come free only when that cache is pruned (the layers of images that stay are kept, still cached).
        out.append(Removal(BUILD_CACHE, "docker builder prune", "gives back the removed images' layers, which "
                           "BuildKit keeps in its cache (counted above); it also drops other unused build cache", 0))
    if compile_cache is not None:
        out.append(Removal(COMPILE_CACHE, compile_cache[0], "compiled JIT modules every run shares (--compile-cache)",
                           compile_cache[1]))
    if bytecode is not None:
        out.extend(_bytecode_removals(bytecode, every, kept, [i for i, _ in doomed], scope is not None))
    return out


def _bytecode_removals(folders: Mapping[str, int], present: Sequence[Image], kept: Sequence[Image],
                       doomed: Sequence[Image], scoped: bool) -> list[Removal]:
    """The bytecode folders whose image is gone, or goes with this prune (no kept tag or untagged image
    names its id). With a scope only the latter: a scope narrows what may go to the images it names."""
    staying = {bytecode_key(i.image_id) for i in kept}
    going: dict[str, str] = {}
    for img in sorted(doomed, key=lambda i: i.ref):
        going.setdefault(bytecode_key(img.image_id), img.ref)
    here = {bytecode_key(i.image_id) for i in present}
    out = []
    for folder, size in sorted(folders.items()):
        key = Path(folder).name
        if key in staying:
            continue
        if key in going:
            out.append(Removal(BYTECODE, folder, f"bytecode of image {key}, which this prune removes ({going[key]})",
                               size))
        elif not scoped and key not in here:
            out.append(Removal(BYTECODE, folder, f"bytecode of image {key}, which is no longer present", size))
    return out


def human(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1_000_000:.0f} MB"


def lines(removals: Sequence[Removal], dry_run: bool) -> list[str]:
    """What `provision prune` prints: one line per removal, then the total."""
    verb = "would remove" if dry_run else "removed"
    out = [f"{verb} {r.kind:<11} {r.target}  {human(r.size)}  ({r.reason})" for r in removals]
    total = sum(r.size for r in removals)
    out.append(f"{'would reclaim' if dry_run else 'reclaimed'} {human(total)} in {len(removals)} removal(s)"
               if removals else "nothing to prune")
    return out


def to_json(removals: Sequence[Removal], dry_run: bool) -> dict[str, object]:
    return {"dry_run": dry_run, "total_bytes": sum(r.size for r in removals),
            "removals": [{"kind": r.kind, "target": r.target, "reason": r.reason, "bytes": r.size} for r in removals]}


# --- edges (docker, file system) ---------------------------------------------------------------------------
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}


def parse_size(text: str) -> int:
    """Docker's human sizes ("20.1GB", "587MB", "0B") are decimal units."""
    m = re.match(r"\s*([\d.]+)\s*([kmgt]?b)", text.lower())
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0


def chain_ids(diff_ids: Sequence[str]) -> tuple[str, ...]:
    """The layer store's id of each layer of an image: a layer's id names it with everything below it."""
    out: list[str] = []
    for diff in diff_ids:
        out.append(diff if not out else "sha256:" + hashlib.sha256(f"{out[-1]} {diff}".encode()).hexdigest())
    return tuple(out)


def list_images(docker: str) -> list[Image]:
    """Every image (tagged or not) with its full id (the docker executor names bytecode folders by it),
    its exact size and its layers."""
    cmd = [docker, "images", "--all", "--format", "{{.Repository}}|{{.Tag}}|{{.ID}}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [ln.split("|") for ln in out.splitlines() if ln.count("|") == 2]
    ids = sorted({r[2] for r in rows})
    facts: dict[str, tuple[str, int, tuple[str, ...], str]] = {}
    if ids:
        # tab-separated: a tab inside a JSON string is escaped, so it never splits one
        fmt = "{{.Id}}\t{{.Size}}\t{{json .RootFS.Layers}}\t{{json .Config.Labels}}"
        info = subprocess.run([docker, "image", "inspect", "--format", fmt, *ids],
                              capture_output=True, text=True, check=True).stdout
        for ln in info.splitlines():
            full, size, layers, labels = ln.split("\t", 3)
            cell = str((json.loads(labels) or {}).get(CELL_LABEL, ""))
            facts[full.removeprefix("sha256:")[:12]] = (full, int(size), chain_ids(json.loads(layers) or []), cell)
    return [Image(repo, tag, *facts.get(iid.removeprefix("sha256:")[:12], (iid, 0, (), "")))
            for repo, tag, iid in rows]


def layer_sizes(docker: str, chains: Iterable[str]) -> dict[str, int] | None:
    """Bytes of each layer, from the engine's layer store (``<root>/image/<driver>/layerdb``); None when it
    cannot be read (not root, another engine): then image sizes stand in."""
    info = subprocess.run([docker, "info", "--format", "{{.DockerRootDir}}|{{.Driver}}"], capture_output=True,
                          text=True).stdout.strip()
    if info.count("|") != 1:
        return None
    root, driver = info.split("|")
    store = Path(root) / "image" / driver / "layerdb" / "sha256"
    out = {}
    for chain in set(chains):
        try:
            out[chain] = int((store / chain.removeprefix("sha256:") / "size").read_text())
        except (OSError, ValueError):
            return None
    return out


def recorded_tags(envs: Path) -> dict[str, str]:
    """cell -> the image tag its envs/<cell>/build.json records."""
    out = {}
    for f in sorted(envs.glob(f"*/{backend.RECORD_NAMES[backend.DOCKER]}")):
        found = buildrecord.read(f.parent, backend.DOCKER).record
        if found is not None and found.tag:
            out[f.parent.name] = found.tag
    return out


def matrix_cells(matrices: Iterable[Path]) -> set[str]:
    """Every cell id of the matrices, resolvable or not (offline: no index is asked)."""
    return {r.cell_id for m in matrices for r in resolve_all(m, offline=True)}


def _du(folder: Path) -> int:
    total = 0
    for p in folder.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def folder_sizes(root: Path) -> dict[str, int]:
    """Each folder right under ``root`` (venv cells, bytecode folders) and its size."""
    return {str(d): _du(d) for d in sorted(root.iterdir()) if d.is_dir()} if root.is_dir() else {}


def build_cache_size(docker: str) -> int:
    out = subprocess.run([docker, "system", "df", "--format", "{{.Type}}|{{.Size}}"], capture_output=True,
                         text=True).stdout
    return sum(parse_size(ln.split("|", 1)[1]) for ln in out.splitlines() if ln.startswith("Build Cache|"))


def apply(removals: Sequence[Removal], docker: str) -> list[Removal]:
    """Remove each; the ones that could not be removed come back (with docker's reason)."""
    failed = []
    for r in removals:
        if r.kind == IMAGE:
            # by tag: a tag that shares its image with another only loses its name
            proc = subprocess.run([docker, "image", "rm", r.target], capture_output=True, text=True)
            if proc.returncode != 0:
                failed.append(Removal(r.kind, r.target, proc.stderr.strip()[-300:], 0))
        elif r.kind in (VENV, COMPILE_CACHE, BYTECODE):
            shutil.rmtree(r.target, ignore_errors=True)
            if Path(r.target).exists():
                failed.append(Removal(r.kind, r.target, "could not remove every file", 0))
        elif r.kind == BUILD_CACHE:
            proc = subprocess.run([docker, "builder", "prune", "-f"], capture_output=True, text=True)
            if proc.returncode != 0:
                failed.append(Removal(r.kind, r.target, proc.stderr.strip()[-300:], 0))
    return failed


def gather(matrices: Sequence[Path], envs: Path, venvs: Path, docker: str | None, build_cache: bool,
           scope: Collection[str] | None = None, compile_cache: bool = False,
           bytecode_root: Path | None = None) -> list[Removal]:
    """The removals for this machine (``docker`` None: no engine, venv cells only); ``scope`` narrows the
    images that may go to these refs; ``compile_cache``: also the shared compile cache `checks run` uses;
    ``bytecode_root``: where the docker executor keeps its bytecode folders (default: BYTECODE_ROOT)."""
    cache = compile_cache_dir(None, not compile_cache)
    images = list_images(docker) if docker else []
    return plan(images, recorded_tags(envs), matrix_cells(matrices), folder_sizes(venvs), (DEFAULT_TAG, DEV_TAG),
                build_cache_size(docker) if docker and build_cache else None, scope,
                compile_cache=(str(cache), _du(cache)) if cache is not None and cache.is_dir() else None,
                layer_sizes=layer_sizes(docker, (layer for i in images for layer in i.layers)) if docker else None,
                bytecode=folder_sizes(bytecode_root or BYTECODE_ROOT) if docker else None)
