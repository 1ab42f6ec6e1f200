"""Make the indexes `common/abi.py` judges: a torch build's exports, an extension release's imports.

Each is read once from the release's wheel and kept under .cache/abi/ by the wheel's sha256; the manifest
there maps the release to that key, so a second run reads no wheel and asks the registry nothing. The wheel
of a release is pinned by the registry's listing alone (provision.registry.pick_wheel: the file a Linux
x86-64 CPython 3.12 install takes), whatever this machine's caches hold: uv's cache serves that very file
(the same sha256) instead of the network, never another build of the release, so the grid kept for the
page (docs/abi-grid.json) is the same bytes on any machine from the same catalogue and listing.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from common import abi
from common.catalog import Catalog
from common.errors import InputError, suggest
from inenv import kit
from provision import registry
from provision.abi.wheels import RemoteWheel, Wheel, in_uv_cache, uv_cache_dir

_TORCH_LIB = re.compile(r"torch/lib/[^/]+\.so(?:\.\d+)*")
_CUDA_RELEASE = re.compile(r"""^cuda\b[^=]*=\s*['"](\d+)\.\d+""", re.M)
# A wheel's own extension modules and libraries; what auditwheel vendors (<pkg>.libs/) is not the package's.
_SHARED = re.compile(r"[^/]+(?:/[^/]+)*\.so(?:\.\d+)*")


# A manifest entry for a release the index serves no wheel of (released files do not change, so it is asked
# once; deleting .cache/abi asks again).
ABSENT = "absent: "
NOT_YET = "not indexed yet (run `provision abi` where the registry is reachable)"


@dataclass(frozen=True)
class Want:
    package: str  # "torch" or an extension's distribution name
    version: str
    variant: str = ""  # torch only: a CUDA build on the PyTorch index ("cu126"); "": the registry's own build
    index: str = ""  # the simple index that serves it; "": the registry uv is configured with

    @property
    def key(self) -> str:
        """The manifest's name of the release (and build)."""
        return abi.release_key(self.package, f"{self.version}+{self.variant}" if self.variant else self.version)

    @property
    def wanted_version(self) -> str:
        return f"{self.version}+{self.variant}" if self.variant else self.version


def wants(catalog: Catalog, packages: Sequence[str] = (), variants: bool = False) -> list[Want]:
    """Every release the catalogue lists: torch's, sgl-kernel/sglang-kernel's, vLLM's and SGLang's (their wheels
    carry compiled parts) and flashinfer-cubin at each flashinfer release an engine pins. ``packages``
    narrows the extensions to those names. ``variants``: also each torch release's other CUDA builds, from the
    PyTorch index."""
    out = [Want("torch", v) for v in catalog.torch]
    if variants:
        out += [Want("torch", v, var, catalog.torch_stable_index.format(variant=var))
                for v, rel in catalog.torch.items() for var in rel.variants if var != rel.registry]
    exts = [Want(k.package, k.version) for k in catalog.kernels.values()]
    exts += [Want(p.engine, p.version) for p in catalog.presets.values() if not p.unserved]
    exts += [Want("flashinfer-cubin", v) for v in sorted({p.flashinfer for p in catalog.presets.values()
                                                          if p.flashinfer not in ("", "none")})]
    known = sorted({canonicalize_name(w.package) for w in exts})
    for p in packages:
        if not p.strip():
            raise InputError("--package '': an empty selector selects nothing; give an extension's distribution "
                             "name such as sglang-kernel, or leave the option out")
        if canonicalize_name(p) not in known:
            raise InputError(f"--package {p!r} is no extension the catalogue lists{suggest(p, known)}; known: "
                             f"{', '.join(known)}")
    names = {canonicalize_name(p) for p in packages}
    return out + [w for w in exts if not names or canonicalize_name(w.package) in names]


def torch_index(wheel: Wheel) -> abi.TorchIndex:
    names = wheel.names()
    text = wheel.text("torch/version.py") if "torch/version.py" in names else ""
    version = re.search(r"""^__version__\s*=\s*['"]([^'"+]+)""", text, re.M)
    cuda = _CUDA_RELEASE.search(text)
    exports: set[str] = set()
    for name in sorted(n for n in names if _TORCH_LIB.fullmatch(n)):
        link = wheel.linkage(name)
        if link is not None:
            exports.update(s for s in link.defined if kit.torch_symbol(s))
    if not exports:
        raise InputError(f"{wheel.filename}: no torch/lib/*.so exports a torch symbol; not a torch wheel")
    return abi.TorchIndex(version.group(1) if version else "?", registry.torch_variant(text) or "?",
                          int(cuda.group(1)) if cuda else None, wheel.filename, wheel.key, frozenset(exports))


def _own_libraries(names: Sequence[str]) -> list[str]:
    return sorted(n for n in names if _SHARED.fullmatch(n) and ".dist-info/" not in n
                  and not n.split("/", 1)[0].endswith(".libs"))


def extension_index(package: str, version: str, wheel: Wheel) -> abi.ExtensionIndex:
    names = wheel.names()
    meta = next((n for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
    pin = registry.pins(wheel.text(meta)).get("torch") if meta else None
    cxx: set[str] = set()
    stable: set[str] = set()
    cuda: set[str] = set()
    read: list[str] = []
    for name in _own_libraries(names):
        link = wheel.linkage(name)
        if link is None:
            continue
        read.append(name)
        for sym in link.undefined:
            if kit.is_torch_symbol(sym):
                cxx.add(sym)
            elif kit.torch_symbol(sym):
                stable.add(sym)
        cuda.update(n for n in link.needed if kit.CUDA_MAJOR_LIB.match(n))
    return abi.ExtensionIndex(package, version, wheel.filename, wheel.key, pin, frozenset(cxx), frozenset(stable),
                              tuple(sorted(cuda)), tuple(read))


@dataclass(frozen=True)
class Made:
    want: Want
    index: abi.TorchIndex | abi.ExtensionIndex | None
    why: str  # when index is None: why there is none
    origin: str  # "cache", "uv cache", "registry"
    read_bytes: int  # compressed bytes streamed from the registry for it
    seconds: float


def _locate(want: Want, listing: dict[str, str] | None, uv_cache: Path | None) -> Wheel | str:
    """The wheel the listing picks for a release: uv's cached copy of that very file when uv holds it (the
    same sha256), else the registry's; a string saying why there is none."""
    if listing is None:
        return "the index does not list the package"
    chosen = registry.pick_wheel(listing, want.wanted_version)
    if chosen is None:
        listed = registry._served(want.package, want.wanted_version, {want.package: listing})
        return "no Linux x86-64 wheel on the index" if listed else "not on the index"
    sha = registry.wheel_key(listing[chosen]).removeprefix("sha256-")
    found = in_uv_cache(uv_cache, canonicalize_name(want.package), chosen, sha if len(sha) == 64 else "")
    return found if found is not None else RemoteWheel(chosen, listing[chosen])


def make(want: Want, listing: dict[str, str] | None, uv_cache: Path | None, root: Path,
         say: Callable[[str], None], place: str = "") -> Made:
    start = time.monotonic()
    wheel = _locate(want, listing, uv_cache)
    if isinstance(wheel, str):
        return Made(want, None, wheel, "", 0, time.monotonic() - start)
    kept = abi.load(want.package, want.wanted_version, wheel.key, root)
    if kept is not None:  # that wheel was indexed before (under another manifest): its bytes are the same
        return Made(want, kept, "", "cache", 0, time.monotonic() - start)
    say(f"abi: {place}reading {want.package} {want.wanted_version} from {wheel.origin} ({wheel.filename})")
    index: abi.TorchIndex | abi.ExtensionIndex
    if want.package == "torch":
        index = torch_index(wheel)
        members = [n for n in wheel.names() if _TORCH_LIB.fullmatch(n)]
    else:
        index = extension_index(want.package, want.version, wheel)
        members = list(index.libraries)
    abi.save(index, root)
    return Made(want, index, "", wheel.origin, sum(wheel.size_of(n) for n in members), time.monotonic() - start)


def _listing(index: str, package: str) -> dict[str, str] | None | registry.RegistryError:
    """A project's files on an index; the registry's failure stops the command, another index's is its answer."""
    try:
        return registry.files(index, package)
    except registry.RegistryError as e:
        return e


def ensure(want_list: Sequence[Want], root: Path = abi.ABI_CACHE, index_url: str | None = None, workers: int = 2,
           offline: bool = False, say: Callable[[str], None] | None = None) -> list[Made]:
    """The index of every wanted release: from .cache/abi when made before, else made now (network).
    ``offline``: only what is cached; the rest is reported as not indexed."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    manifest = abi.load_manifest(root)
    out: dict[Want, Made] = {}
    todo: list[Want] = []
    for w in want_list:
        key = manifest.get(w.key)
        if key is not None and key.startswith(ABSENT):  # the index had no wheel of it: asked once
            out[w] = Made(w, None, key.removeprefix(ABSENT), "cache", 0, 0.0)
            continue
        found = abi.load(w.package, w.wanted_version, key, root) if key else None  # it must name this release
        if found is not None:
            out[w] = Made(w, found, "", "cache", 0, 0.0)
        else:
            todo.append(w)
    if todo and offline:
        for w in todo:
            out[w] = Made(w, None, NOT_YET, "", 0, 0)
        todo = []
    if todo:
        default = index_url or registry.configured_index()
        pairs = sorted({(w.index or default, w.package) for w in todo})
        uv_cache = uv_cache_dir()
        lock = threading.Lock()
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            pages = dict(zip(pairs, pool.map(lambda p: _listing(*p), pairs), strict=True))

            def one(item: tuple[int, Want]) -> Made:
                n, w = item
                listing = pages[(w.index or default, w.package)]
                if isinstance(listing, registry.RegistryError):
                    if not w.index:  # the registry itself: the command cannot answer (exit 2)
                        raise listing
                    return Made(w, None, str(listing), "", 0, 0.0)  # another index: said, not fatal
                made = make(w, listing, uv_cache, root, say, f"{n} of {len(todo)}: ")
                with lock:
                    entries = abi.load_manifest(root)
                    entries[w.key] = made.index.key if made.index is not None else ABSENT + made.why
                    abi.save_manifest(entries, root)
                return made

            try:
                for made in pool.map(one, enumerate(todo, 1)):
                    out[made.want] = made
            except KeyboardInterrupt:  # the indexes made so far are kept; start no other
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    return [out[w] for w in want_list]
