"""`checks run --image` refuses an image it cannot probe in one line, on any machine: no Docker daemon is needed.

A real daemon is not reachable on every test machine (CI's first pass hides it), so these tests talk to a stand-in
for the Docker Engine API on a unix socket (DOCKER_HOST), through the real Docker SDK and the real `checks run`.
The stand-in is a fake, acceptable here for one thing only: the daemon's answers that lead to a refusal carry
the daemon's and the container runtime's real error texts, word for word:

- an image the daemon does not hold: ``404 {"message": "No such image: <name>"}``;
- a container whose command is not in the image, started without an init: ``400`` with runc's ``exec:
  "python3": executable file not found in $PATH`` error as dockerd 24+ words it;
- started with Docker's init (tini, as `checks run` starts them): the container exits 127 and tini's own line
  ``[FATAL tini (7)] exec python3 failed: No such file or directory`` is its stderr.

For an image holding python3 without torch, the stand-in runs the container's command on this machine instead:
the real in-environment code (the package the container would mount) under an interpreter started without its
site-packages (``-S``), so no torch can be found, and what it prints is what the refusal reads. Whatever else
the SDK asks (inspecting and removing containers) is answered as a daemon answers it, and every container
created must be removed again. The same refusals against a real daemon are tests/test_checks_image.py's.
"""

from __future__ import annotations

import json
import re
import socketserver
import struct
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from checks.run.container import MOUNT_ROOT
from tests.checks_helpers import fixture_env

NO_SUCH_IMAGE = "No such image: {image}"
RUNC_NO_PYTHON = ("failed to create task for container: failed to create shim task: OCI runtime create failed: runc "
                  "create failed: unable to start container process: exec: \"python3\": executable file not found "
                  "in $PATH: unknown")
TINI_NO_PYTHON = "[FATAL tini (7)] exec python3 failed: No such file or directory\n"
NEEDS = "stackprobe runs its probes with the image's own python3 and torch"


class _Daemon(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: Path, images: dict[str, str]) -> None:
        self.images = images  # image name -> what its containers do: "runc-no-python", "tini-no-python", "run"
        self.created: dict[str, dict] = {}  # container id -> {"name", "image", "config", "code", "out", "err"}
        self.removed: list[str] = []
        self.lock = threading.Lock()
        super().__init__(str(path), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Daemon
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def address_string(self) -> str:  # a unix socket has no client address
        return "local"

    def _send(self, code: int, body: bytes | dict | None = None, ctype: str = "application/json") -> None:
        data = json.dumps(body).encode() if isinstance(body, dict | list) else (body or b"")
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _path(self) -> tuple[str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        return re.sub(r"^/v[0-9.]+", "", unquote(parts.path)), parse_qs(parts.query)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}") if n else {}

    def _container(self, ref: str) -> dict | None:
        with self.server.lock:
            return next((c for cid, c in self.server.created.items() if ref in (cid, c["name"])), None)

    def do_HEAD(self) -> None:  # noqa: N802
        self._send(200, b"OK", "text/plain")

    def do_GET(self) -> None:  # noqa: N802
        path, query = self._path()
        if path == "/_ping":
            return self._send(200, b"OK", "text/plain")
        if path == "/version":
            return self._send(200, {"Version": "24.0.7", "ApiVersion": "1.43", "MinAPIVersion": "1.12",
                                    "Os": "linux", "Arch": "amd64"})
        if m := re.fullmatch(r"/images/(.+)/json", path):
            image = m.group(1)
            if image not in self.server.images:
                return self._send(404, {"message": NO_SUCH_IMAGE.format(image=image)})
            return self._send(200, {"Id": "sha256:" + "ab" * 32, "RepoTags": [image], "RepoDigests": []})
        if m := re.fullmatch(r"/containers/([^/]+)/json", path):
            c = self._container(m.group(1))
            if c is None:
                return self._send(404, {"message": f"No such container: {m.group(1)}"})
            return self._send(200, {"Id": c["id"], "Name": "/" + c["name"], "Config": {"Tty": False},
                                    "State": {"Status": "exited", "ExitCode": c["code"], "OOMKilled": False}})
        if m := re.fullmatch(r"/containers/([^/]+)/logs", path):
            c = self._container(m.group(1))
            stream, data = (1, c["out"]) if query.get("stdout") == ["1"] else (2, c["err"])
            framed = struct.pack(">BxxxL", stream, len(data)) + data if data else b""
            return self._send(200, framed, "application/vnd.docker.multiplexed-stream")
        if path == "/containers/json":
            return self._send(200, [])
        self._send(404, {"message": f"page not found: {path}"})

    def do_POST(self) -> None:  # noqa: N802
        path, query = self._path()
        body = self._body()
        if path == "/containers/create":
            cid = uuid.uuid4().hex * 2
            with self.server.lock:
                self.server.created[cid] = {"id": cid, "name": query.get("name", [cid[:12]])[0],
                                            "image": body.get("Image"), "config": body, "code": None,
                                            "out": b"", "err": b""}
            return self._send(201, {"Id": cid, "Warnings": []})
        if m := re.fullmatch(r"/containers/([^/]+)/start", path):
            c = self._container(m.group(1))
            how = self.server.images.get(c["image"], "")
            if how == "runc-no-python":
                return self._send(400, {"message": RUNC_NO_PYTHON})
            if how == "tini-no-python":
                c.update(code=127, err=TINI_NO_PYTHON.encode())
            else:
                c.update(_run_here(c["config"]))
            return self._send(204)
        if m := re.fullmatch(r"/containers/([^/]+)/wait", path):
            return self._send(200, {"StatusCode": self._container(m.group(1))["code"], "Error": None})
        if re.fullmatch(r"/containers/([^/]+)/kill", path):
            return self._send(204)
        self._send(404, {"message": f"page not found: {path}"})

    def do_DELETE(self) -> None:  # noqa: N802
        path, _ = self._path()
        if m := re.fullmatch(r"/containers/([^/]+)", path):
            c = self._container(m.group(1))
            if c is None or c["id"] in self.server.removed:
                return self._send(404, {"message": f"No such container: {m.group(1)}"})
            with self.server.lock:
                self.server.removed.append(c["id"])
            return self._send(204)
        self._send(404, {"message": f"page not found: {path}"})


def _run_here(config: dict) -> dict:
    """The container's command run on this machine with the in-environment code it would mount, by an
    interpreter that sees no site-packages (so no torch): its exit status and output, as the daemon keeps them."""
    mounts = {bind.split(":")[1]: bind.split(":")[0] for bind in config.get("HostConfig", {}).get("Binds") or []}
    code_root = next(str(Path(host).parent) for target, host in mounts.items() if target.startswith(MOUNT_ROOT))
    env = {k: v for k, _, v in (e.partition("=") for e in config.get("Env") or [])}
    env.update(PYTHONPATH=code_root, PATH="/usr/bin:/bin")
    command = list(config["Cmd"])
    assert command[0] == "python3", command
    p = subprocess.run([sys.executable, "-S", *command[1:]], capture_output=True, env=env, timeout=120)
    return {"code": p.returncode, "out": p.stdout, "err": p.stderr}


@pytest.fixture
def daemon(tmp_path: Path):
    sock = Path(f"/tmp/stackprobe-fake-docker-{uuid.uuid4().hex[:8]}.sock")  # short: a unix path has a limit
    server = _Daemon(sock, {"stackprobe-test/no-python:1": "runc-no-python",
                            "stackprobe-test/no-python-init:1": "tini-no-python",
                            "stackprobe-test/no-torch:1": "run"})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"unix://{sock}"
    server.shutdown()
    server.server_close()
    sock.unlink(missing_ok=True)


def _refusal(image: str, host: str, tmp_path: Path) -> str:
    env = fixture_env(DOCKER_HOST=host)
    env.pop("DOCKER_CONTEXT", None)
    p = subprocess.run([sys.executable, "-m", "checks.cli", "run", "--image", image, "--all", "--results",
                        str(tmp_path / "results")], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "results").exists()  # nothing written
    return lines[0]


def test_a_missing_image_is_refused_with_the_daemons_answer(daemon: tuple, tmp_path: Path) -> None:
    server, host = daemon
    assert _refusal("stackprobe-test/never-built:0", host, tmp_path) == (
        "checks run: --image stackprobe-test/never-built:0: no such image in the Docker daemon; `docker images` "
        "lists those there (pull or load it first)")
    assert server.created == {}


@pytest.mark.parametrize("image", ["stackprobe-test/no-python:1", "stackprobe-test/no-python-init:1"])
def test_an_image_without_python3_is_refused_whether_the_runtime_or_the_init_says_so(
        daemon: tuple, image: str, tmp_path: Path) -> None:
    server, host = daemon
    assert _refusal(image, host, tmp_path) == (
        f"checks run: --image {image}: the image has no python3 on its PATH; {NEEDS}")
    assert server.created and set(server.removed) == set(server.created)  # no container left behind


def test_an_image_without_torch_is_refused_from_what_its_python_reports(daemon: tuple, tmp_path: Path) -> None:
    server, host = daemon
    assert _refusal("stackprobe-test/no-torch:1", host, tmp_path) == (
        f"checks run: --image stackprobe-test/no-torch:1: torch is not installed in the image; {NEEDS}")
    [ran] = server.created.values()
    assert ran["code"] == 0 and b"torch" not in ran["err"]  # the facts were read: torch was not among them
    assert set(server.removed) == set(server.created)
