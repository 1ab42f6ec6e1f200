"""The Python package index configured on this machine, read over HTTP: what `provision catalog check` asks it.

The edge of the catalog check. Every network access goes through `_get` (`stream` for a wheel member read
whole, by `provision abi`); `read` is the one entry point
(tests call it for real on a few releases). Nothing is downloaded whole: index pages are the simple API
(PEP 691 JSON, or PEP 503 HTML), and a wheel is read with HTTP byte ranges (its zip directory, then only
the members needed: METADATA, torch/version.py, the smallest sgl-kernel shared objects). The index is the
one uv would use (`uv pip compile --emit-index-url`), so no host name lives in this code.

Wheel bytes read once are kept in a `Store` (by default `.cache/registry/` of this checkout, beside the
project's other caches): a wheel file never changes, so a range of it is kept under the wheel's sha256 where the
index gives one, else under its URL without credentials or query. Index pages change whenever a release is
published, so the check reads them live every time; only a store made for tests keeps them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import subprocess
import tempfile
import threading
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

from common.errors import InputError
from common.home import CACHE_ROOT
from inenv import atomic
from inenv.kit import linkage  # the project's stdlib ELF reader
from provision.catalogcheck import KernelSeen, Readings, Seen, Wants
from provision.lock import uv_bin

TIMEOUT_S = 30.0
# A kernel wheel is 0.4-0.6 GB; its CUDA release is read from the smallest shared objects, up to this many
# compressed bytes (the CUDA 13 builds carry the nvcc banner only in members of ~5 MB).
KERNEL_READ_BUDGET = 24 << 20
# Markers are evaluated for the images' platform: Linux x86-64, CPython 3.12, no extras.
TARGET_ENV = {"extra": "", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "os_name": "posix", "python_version": "3.12", "python_full_version": "3.12.0",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
_SIMPLE_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
# nvcc's ptxas stamps "Cuda compilation tools, release X.Y, VX.Y.Z" into each cubin; in compressed fatbins
# only part of the text survives, so match from the producer name to "release X.Y".
_NVCC = re.compile(rb"ptxas\x00[^\x00]{0,48}?release (\d+)\.(\d+)")
_CUDART = re.compile(r"libcudart\.so\.(\d+)$")
_SHA256 = re.compile(r"sha256=([0-9a-f]{64})")
CACHE = CACHE_ROOT / "registry"


class RegistryError(InputError):
    """The index cannot be reached or does not answer as an index does."""


# ---- pure readers of what the index returns ------------------------------------------------------


def pins(metadata: str) -> dict[str, str]:
    """Requirements of a base install on the images' platform: canonical name -> version for `==X`, the
    specifier text otherwise, "" when unconstrained. Requirements behind extras or other platforms are left out."""
    out: dict[str, str] = {}
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        try:
            req = Requirement(line.split(":", 1)[1].strip())
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
            continue
        specs = list(req.specifier)
        exact = len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version
        out[canonicalize_name(req.name)] = specs[0].version if exact else str(req.specifier)
    return out


def torch_variant(version_py: str) -> str | None:
    """The CUDA label of a torch build from its torch/version.py: the local part of __version__
    (2.15.0+cu132), else `cuda = 'X.Y'`; "cpu" when cuda is None."""
    m = re.search(r"""^__version__\s*=\s*['"][^'"+]+\+([A-Za-z0-9.]+)['"]""", version_py, re.M)
    if m:
        return m.group(1)
    m = re.search(r"""^cuda\b[^=]*=\s*(?:['"](\d+)\.(\d+)['"]|None)""", version_py, re.M)
    if not m:
        return None
    return f"cu{m.group(1)}{m.group(2)}" if m.group(1) else "cpu"


def nvcc_releases(blob: bytes) -> set[str]:
    """CUDA releases ("13.0") of the nvcc that compiled the GPU code in a shared object."""
    return {f"{a.decode()}.{b.decode()}" for a, b in _NVCC.findall(blob)}


def _dist_version(filename: str) -> tuple[str, Version] | None:
    try:
        if filename.endswith(".whl"):
            name, version, _build, _tags = parse_wheel_filename(filename)
        else:
            name, version = parse_sdist_filename(filename)
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None
    return name, version


def newest_release(filenames: Iterable[str]) -> str | None:
    """The newest final release among distribution file names (no pre-, dev- or local versions)."""
    versions = [v for f in filenames if (dv := _dist_version(f)) and not (v := dv[1]).is_prerelease and not v.local]
    return str(max(versions)) if versions else None


def pick_wheel(filenames: Iterable[str], version: str) -> str | None:
    """The wheel of exactly `version` that a Linux x86-64 CPython 3.12 install would take, preferring the
    highest build tag; a pure-Python wheel when there is no binary one."""
    want = Version(version)
    ranked = []
    for f in filenames:
        if not f.endswith(".whl"):
            continue
        try:
            _name, v, build, tags = parse_wheel_filename(f)
        except InvalidWheelFilename:
            continue
        if v != want:
            continue
        plats = {t.platform for t in tags}
        if any(p.endswith("x86_64") and p.startswith(("manylinux", "linux")) for p in plats):
            rank = 0
        elif plats == {"any"}:
            rank = 1
        else:
            continue
        interp = 0 if any(t.interpreter == "cp312" for t in tags) else 1  # the images' Python, else abi3/py3
        ranked.append(((rank, interp, -build[0] if build else 0, f), f))  # highest build tag first
    return min(ranked)[1] if ranked else None


# ---- the network edge ---------------------------------------------------------------------------


def configured_index() -> str:
    """The default index uv resolves against here (its config files, UV_DEFAULT_INDEX, UV_INDEX_URL)."""
    try:
        proc = subprocess.run([uv_bin(), "pip", "compile", "-", "--emit-index-url", "--no-header", "--quiet"],
                              input="", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RegistryError(f"cannot ask uv for the configured index: {e}") from None
    for line in proc.stdout.splitlines():
        if line.startswith("--index-url "):
            return line.split(None, 1)[1].strip()
    raise RegistryError(f"uv names no default index (exit {proc.returncode}): {proc.stderr.strip()[:200]}")


@dataclass(frozen=True)
class _Response:
    status: int
    body: bytes
    content_type: str
    content_range: str
    url: str


_received = [0]  # response body bytes `_get` took from the network in this process
_received_lock = threading.Lock()


def received_bytes() -> int:
    """Bytes of response bodies read from the network so far in this process (what a cache saves)."""
    with _received_lock:
        return _received[0]


def _get(url: str, headers: dict[str, str] | None = None) -> _Response | None:
    """One HTTP GET: None on 404, RegistryError on anything else that is not an answer."""
    req = urllib.request.Request(url.split("#")[0],
                                 headers={"User-Agent": "stackprobe-catalog-check", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            body = resp.read()
            with _received_lock:
                _received[0] += len(body)
            return _Response(resp.status, body, resp.headers.get("Content-Type", ""),
                             resp.headers.get("Content-Range", ""), resp.geturl())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise RegistryError(f"{_where(url)} answered HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        raise RegistryError(f"index unreachable: {_where(url)}: {why}") from None


def stream(url: str, first: int, last: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Bytes ``first``..``last`` (inclusive) of a file with one HTTP Range request, chunk by chunk as they arrive,
    so a member of a wheel is read without holding it (or the wheel) in memory; counted in `received_bytes`."""
    req = urllib.request.Request(url.split("#")[0], headers={"User-Agent": "stackprobe-abi",
                                                               "Range": f"bytes={first}-{last}"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            if resp.status != 206:
                raise RegistryError(f"{_where(url)} does not serve byte ranges; cannot read a wheel member "
                                    "without downloading the wheel")
            while block := resp.read(chunk):
                with _received_lock:
                    _received[0] += len(block)
                yield block
    except urllib.error.HTTPError as e:
        raise RegistryError(f"{_where(url)} answered HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise RegistryError(f"index unreachable: {_where(url)}: {getattr(e, 'reason', e)}") from None


def _where(url: str) -> str:
    parts = urlsplit(url)  # without credentials or query
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname or ''}{port}{parts.path}"


def wheel_key(url: str) -> str:
    """The name a wheel's bytes are kept under: its sha256 when the URL's fragment gives one (the same file
    from any mirror), else a hash of the URL without credentials, query or fragment (a wheel's path names
    one file; a query may carry a token)."""
    m = _SHA256.fullmatch(urlsplit(url).fragment.lower())
    if m:
        return f"sha256-{m.group(1)}"
    return "url-" + hashlib.sha256(_where(url).encode()).hexdigest()


_MAGIC = b"spc1"


def _seal(payload: bytes) -> bytes:
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _unseal(blob: bytes) -> bytes | None:
    """The payload of a stored entry; None when it is cut short or changed (its digest does not match)."""
    head = len(_MAGIC) + 32
    if len(blob) < head or not blob.startswith(_MAGIC):
        return None
    payload = blob[head:]
    return payload if hashlib.sha256(payload).digest() == blob[len(_MAGIC) : head] else None


@dataclass(frozen=True)
class Store:
    """Where reads of the index are kept between runs. `wheels`: byte ranges of wheel files (immutable);
    `pages`: index pages, which change as releases are published, so only tests set it (None: read live)."""

    wheels: Path | None
    pages: Path | None = None

    def _load(self, path: Path) -> bytes | None:
        try:
            return _unseal(path.read_bytes())
        except OSError:
            return None

    def _save(self, path: Path, payload: bytes) -> None:
        """Atomic write; a store that cannot be written costs only the saving."""
        with contextlib.suppress(OSError):
            atomic.write_bytes(path, _seal(payload))

    def range(self, url: str, name: str, fetch: Callable[[], tuple[int, bytes]],
              expect: Callable[[int], int]) -> tuple[int, bytes]:
        """(file size, bytes) of one byte range of a wheel, named `name` ("tail-65536", "0-1023"), from the
        store, else from `fetch` and then kept. `expect(size)` is the length the range must have."""
        path = self.wheels / wheel_key(url) / name if self.wheels else None
        if path is not None and (payload := self._load(path)) is not None and len(payload) >= 8:
            size = int.from_bytes(payload[:8], "big")
            if len(payload) - 8 == expect(size):
                return size, payload[8:]
        size, data = fetch()
        if path is not None and len(data) == expect(size):
            self._save(path, size.to_bytes(8, "big") + data)
        return size, data

    def page(self, url: str, fetch: Callable[[], _Response | None]) -> _Response | None:
        """An index page from the store (tests only), else from `fetch`; a 404 is never kept."""
        if self.pages is None:
            return fetch()
        path = self.pages / hashlib.sha256(_where(url).encode()).hexdigest()
        if (payload := self._load(path)) is not None and b"\n" in payload:
            head, body = payload.split(b"\n", 1)
            try:
                meta = json.loads(head)
                final = url if meta["url"] == _where(url) else str(meta["url"])
                return _Response(200, body, str(meta["content_type"]), "", final)
            except (ValueError, KeyError, TypeError):
                pass  # not an entry this code wrote: read the page again
        resp = fetch()
        if resp is not None:
            meta = {"url": _where(resp.url), "content_type": resp.content_type}
            self._save(path, json.dumps(meta).encode() + b"\n" + resp.body)
        return resp


def default_store() -> Store:
    """What `provision catalog check` keeps: wheel bytes only, so every run reads the index pages live."""
    return Store(CACHE / "wheels")


class _Links(HTMLParser):
    """The anchors of a PEP 503 project page that are not yanked: (text, href)."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            a = dict(attrs)
            self._href = None if "data-yanked" in a else a.get("href")
            self._text = ""

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._text.strip(), self._href))
            self._href = None


def _with_sha256(url: str, sha256: str | None) -> str:
    """The URL with its fragment set to `sha256=<hex>` when the index gives that digest, else none."""
    parts = urlsplit(url)
    fragment = f"sha256={sha256.lower()}" if sha256 and _SHA256.fullmatch(f"sha256={sha256.lower()}") else ""
    return urlunsplit(parts._replace(fragment=fragment))


def files(index: str, package: str, store: Store | None = None) -> dict[str, str] | None:
    """filename -> absolute URL of a project's files that are not yanked, with `#sha256=` where the index
    gives the digest; None if the index lacks the project."""
    page = urljoin(index.rstrip("/") + "/", canonicalize_name(package) + "/")
    resp = (store or Store(None)).page(page, lambda: _get(page, {"Accept": _SIMPLE_ACCEPT}))
    if resp is None:
        return None
    if "json" in resp.content_type:
        data = json.loads(resp.body)
        return {f["filename"]: _with_sha256(urljoin(resp.url, f["url"]), (f.get("hashes") or {}).get("sha256"))
                for f in data["files"] if not f.get("yanked")}
    parser = _Links()
    parser.feed(resp.body.decode(errors="replace"))
    out = {}
    for text, href in parser.links:
        url = urljoin(resp.url, href)
        m = _SHA256.fullmatch(urlsplit(url).fragment.lower())
        out[text or PurePosixPath(urlsplit(href).path).name] = _with_sha256(url, m.group(1) if m else None)
    return out


class _Ranged(io.RawIOBase):
    """A remote file read with HTTP byte ranges, for zipfile; refuses to read more than `budget` bytes.
    Each range comes from `store` when it holds it."""

    TAIL = 65536  # the zip's end records, and the size from Content-Range

    def __init__(self, url: str, budget: int, store: Store | None = None) -> None:
        self.url, self.budget, self.pos, self.fetched = url, budget, 0, 0
        self.store = store or Store(None)

        def fetch_tail() -> tuple[int, bytes]:
            resp = _get(url, {"Range": f"bytes=-{self.TAIL}"})
            if resp is None:
                raise RegistryError(f"{_where(url)} is listed by the index but answers HTTP 404")
            if resp.status != 206 or "/" not in resp.content_range:
                raise RegistryError(f"{_where(url)} does not serve byte ranges; "
                                    "cannot read a wheel without downloading it")
            return int(resp.content_range.rsplit("/", 1)[1]), resp.body

        self.size, self.tail = self.store.range(url, f"tail-{self.TAIL}", fetch_tail,
                                                lambda size: min(size, self.TAIL))
        self.tail_start = self.size - len(self.tail)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buf) -> int:  # type: ignore[no-untyped-def]
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        if self.pos >= self.tail_start:
            data = self.tail[self.pos - self.tail_start : self.pos - self.tail_start + n]
        else:
            if self.fetched + n > self.budget:
                raise RegistryError(f"reading {_where(self.url)} would take more than {self.budget >> 20} MiB")
            first, last = self.pos, self.pos + n - 1

            def fetch() -> tuple[int, bytes]:
                resp = _get(self.url, {"Range": f"bytes={first}-{last}"})
                if resp is None or resp.status != 206:
                    raise RegistryError(f"{_where(self.url)} stopped serving byte ranges")
                return self.size, resp.body

            _size, data = self.store.range(self.url, f"{first}-{last}", fetch, lambda _size: n)
            self.fetched += len(data)
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _wheel(url: str, store: Store | None, budget: int = 8 << 20) -> zipfile.ZipFile:
    return zipfile.ZipFile(io.BufferedReader(_Ranged(url, budget, store), buffer_size=1 << 18))


def _metadata(zf: zipfile.ZipFile) -> str:
    name = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
    return zf.read(name).decode(errors="replace")


def _release_wheel(package: str, version: str, pages: dict[str, dict[str, str] | None]) -> tuple[str, str] | Seen:
    """(wheel filename, URL) of a release, or a Seen saying why there is none."""
    listing = pages.get(package)
    if listing is None:
        return Seen(None, f"{package} is not on the index")
    wheel = pick_wheel(listing, version)
    if wheel is None:
        return Seen(None, f"{package} {version} has no Linux x86-64 wheel on the index")
    return wheel, listing[wheel]


def _engine(package: str, version: str, pages: dict[str, dict[str, str] | None],
            store: Store) -> tuple[dict[str, str], dict[str, Seen]] | dict[str, Seen]:
    """An engine release's declared pins and the readings every engine has (torch, flashinfer, the wheel's
    platform); ``{"release": Seen}`` when the index has no wheel of it."""
    found = _release_wheel(package, version, pages)
    if isinstance(found, Seen):
        return {"release": found}
    wheel, url = found
    declared = pins(_metadata(_wheel(url, store)))
    where = f"{wheel} METADATA Requires-Dist"
    return declared, {"torch": Seen(declared.get("torch"), where),
                      "flashinfer": Seen(declared.get("flashinfer-python"), where),
                      "platform": Seen(wheel_platform(wheel), f"{wheel} file name")}


def _sglang(version: str, pages: dict[str, dict[str, str] | None], store: Store) -> dict[str, Seen]:
    found = _engine("sglang", version, pages, store)
    if isinstance(found, dict):
        return found
    declared, seen = found
    kernel = next((n for n in ("sglang-kernel", "sgl-kernel") if n in declared), None)
    return {**seen, "sgl_kernel": Seen(declared.get(kernel) if kernel else None, seen["torch"].evidence)}


def wheel_platform(filename: str) -> str:
    """The manylinux tag of a wheel's file name (``manylinux_2_34``), or "none" for a pure-Python wheel."""
    try:
        _, _, _, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return "none"
    found = sorted({t.platform.removesuffix("_x86_64") for t in tags if t.platform.startswith("manylinux_")})
    return found[0] if found else "none"


def _served(package: str, version: str, pages: dict[str, dict[str, str] | None]) -> bool:
    """Whether the index lists a file of that release (a wheel or a source distribution)."""
    listing = pages.get(package) or {}
    return any((dv := _dist_version(f)) is not None and dv[1] == Version(version) for f in listing)


def _vllm(version: str, pages: dict[str, dict[str, str] | None], store: Store) -> dict[str, Seen]:
    found = _engine("vllm", version, pages, store)
    if isinstance(found, dict):
        return found
    declared, seen = found
    missing = [f"{name} {declared[name]} is not on the index" for name in ("torch", "flashinfer-python")
               if declared.get(name) and not _served(name, declared[name], pages)]
    return {**seen, "unserved": Seen("; ".join(missing), "the index's release lists of torch and flashinfer-python")}


def _kernel(package: str, version: str, pages: dict[str, dict[str, str] | None],
            store: Store) -> KernelSeen:
    found = _release_wheel(package, version, pages)
    if isinstance(found, Seen):
        return KernelSeen(found, found, found)
    wheel, url = found
    zf = _wheel(url, store, KERNEL_READ_BUDGET + (8 << 20))  # the members plus the zip directory and METADATA
    torch = Seen(pins(_metadata(zf)).get("torch"), f"{wheel} METADATA Requires-Dist")
    releases: set[str] = set()
    cudart: str | None = None
    read_from: list[str] = []
    spent = 0
    for info in sorted((i for i in zf.infolist() if i.filename.endswith(".so")), key=lambda i: i.compress_size):
        if releases or spent + info.compress_size > KERNEL_READ_BUDGET:
            break
        blob = zf.read(info.filename)
        spent += info.compress_size
        read_from.append(PurePosixPath(info.filename).name)
        releases |= nvcc_releases(blob)
        if cudart is None:
            with tempfile.NamedTemporaryFile(suffix=".so") as tmp:
                tmp.write(blob)
                tmp.flush()
                link = linkage(tmp.name)
            majors = [m.group(1) for n in (link.needed if link else ()) if (m := _CUDART.match(n))]
            cudart = majors[0] if majors else None
    members = ", ".join(read_from)
    if releases:
        value = "+".join(sorted(releases, key=Version))
        if cudart and {r.split(".")[0] for r in releases} != {cudart}:  # built by one CUDA, linked to another
            value += f" (libcudart.so.{cudart})"
        linked = f"; DT_NEEDED libcudart.so.{cudart}" if cudart else ""
        cuda = Seen(value, f"{wheel}: nvcc release in {members}{linked}")
    else:
        cuda = Seen(cudart, f"{wheel}: DT_NEEDED libcudart.so.{cudart} (CUDA major only; no nvcc banner in {members})")
    return KernelSeen(Seen(version, f"{package} {version} on the index"), torch, cuda)


def _torch(version: str, pages: dict[str, dict[str, str] | None], store: Store) -> Seen:
    found = _release_wheel("torch", version, pages)
    if isinstance(found, Seen):
        return found
    wheel, url = found
    zf = _wheel(url, store)
    text = zf.read("torch/version.py").decode(errors="replace") if "torch/version.py" in zf.namelist() else ""
    return Seen(torch_variant(text), f"{wheel} torch/version.py")


def _guarded(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A wheel that is not a wheel (no zip directory, no METADATA) is the index's fault: one line, exit 2."""

    def run(arg: Any) -> Any:
        try:
            return fn(arg)
        except (zipfile.BadZipFile, StopIteration, KeyError, EOFError) as e:
            raise RegistryError(f"unreadable wheel for {arg}: {type(e).__name__}: {e}") from None

    return run


def read(wants: Wants, index: str | None = None, workers: int = 8, store: Store | None = None) -> Readings:
    """Ask the index everything `wants` names, keeping what `store` keeps (default: `default_store()`).
    Raises RegistryError when it cannot be read."""
    index = index or configured_index()
    store = store or default_store()
    packages = sorted({*wants.newest, *(p for p, _ in wants.kernels)}
                      | ({"sglang"} if wants.sglang else set()) | ({"torch"} if wants.torch else set())
                      | ({"vllm", "torch", "flashinfer-python"} if wants.vllm else set()))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pages = dict(zip(packages, pool.map(lambda p: files(index, p, store), packages), strict=True))
        sglang = pool.map(_guarded(lambda v: _sglang(v, pages, store)), wants.sglang)
        kernels = pool.map(_guarded(lambda pv: _kernel(pv[0], pv[1], pages, store)), wants.kernels)
        torch = pool.map(_guarded(lambda v: _torch(v, pages, store)), wants.torch)
        vllm = pool.map(_guarded(lambda v: _vllm(v, pages, store)), wants.vllm)
        newest = {p: Seen(newest_release(pages[p]) if pages[p] is not None else None,
                          f"{p} release list" if pages[p] is not None else f"{p} is not on the index")
                  for p in wants.newest}
        return Readings(index=index, newest=newest, sglang=dict(zip(wants.sglang, sglang, strict=True)),
                        kernels=dict(zip((v for _, v in wants.kernels), kernels, strict=True)),
                        torch=dict(zip(wants.torch, torch, strict=True)),
                        vllm=dict(zip(wants.vllm, vllm, strict=True)))
