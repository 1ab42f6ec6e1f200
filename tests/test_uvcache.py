"""tests/uvcache.py: the cache-first `uv` asks the index only for what uv's cache lacks. Real uv, a local
HTTP index of one stand-in wheel, an empty uv cache of the test's own."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_provision_lock_guard import _wheel
from uvcache import cache_first_uv

from provision import lock


class _Served:
    def __init__(self, root: Path) -> None:
        self.requests: list[str] = []
        served = self

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                served.requests.append(self.path)

            def send_header(self, keyword: str, value: str) -> None:
                if keyword != "Last-Modified":  # as the index here: no freshness lifetime to guess from
                    super().send_header(keyword, value)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[_Served]:
    (tmp_path / "files").mkdir()
    _wheel(tmp_path / "files", "demo-pkg", "1.0")
    whl = next((tmp_path / "files").iterdir())
    page = tmp_path / "simple" / "demo-pkg"
    page.mkdir(parents=True)
    sha = hashlib.sha256(whl.read_bytes()).hexdigest()
    (page / "index.html").write_text(f'<a href="../../files/{whl.name}#sha256={sha}">{whl.name}</a>\n')
    s = _Served(tmp_path)
    yield s
    s.server.shutdown()
    s.server.server_close()


def test_a_warm_cache_answers_without_the_index(served: _Served, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    real = lock.uv_bin()
    if shutil.which(real) is None:
        pytest.skip("needs uv")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.delenv("UV_OFFLINE", raising=False)
    shim = cache_first_uv(tmp_path / "bin", real)
    argv = [str(shim), "pip", "compile", "-", "--index-url", served.url, "--no-header", "--quiet",
            "--python-version", "3.12"]

    def compile_() -> str:
        proc = subprocess.run(argv, input="demo-pkg\n", capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    cold = compile_()
    assert "demo-pkg==1.0" in cold
    assert "/simple/demo-pkg/" in served.requests  # the empty cache missed: it asked the index
    served.requests.clear()
    assert compile_() == cold
    assert served.requests == []
    # UV_OFFLINE set by the caller stands: online, uv asks again (the page has no freshness lifetime)
    monkeypatch.setenv("UV_OFFLINE", "0")
    assert compile_() == cold
    assert "/simple/demo-pkg/" in served.requests


def test_a_failure_offline_is_asked_online(served: _Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version the warm cache does not list: the offline try fails, the online one confirms it."""
    real = lock.uv_bin()
    if shutil.which(real) is None:
        pytest.skip("needs uv")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    shim = cache_first_uv(tmp_path / "bin", real)
    argv = [str(shim), "pip", "compile", "-", "--index-url", served.url, "--no-header", "--quiet"]
    subprocess.run(argv, input="demo-pkg\n", capture_output=True, text=True, timeout=120, check=True)
    served.requests.clear()
    proc = subprocess.run(argv, input="demo-pkg==2.0\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "demo-pkg==2.0" in proc.stderr
    assert "/simple/demo-pkg/" in served.requests
