"""Time from `uvx` to the first table, installed, against the same run from the clone.

    python benchmarks/bench_wheel.py [--python PATH] [--runs N] [--image IMAGE]

Builds the wheel (`uv build --wheel`) into a scratch folder, then N times: in a new empty folder,
``uvx --from WHEEL checks run --backend local --python PATH --all`` and, beside it, the clone's
``python -m checks.cli run`` with the same arguments and ``--results`` in a scratch folder. For each it prints the
seconds from the command's start to the first ``table:`` line (the quick level's table: the first answer) and
to its end, and the ratio installed / clone. The first uvx of a new wheel makes its tool environment (its
dependencies come from uv's cache); later ones reuse it. ``--image IMAGE`` times
``uvx ... checks run --image IMAGE --all`` the same way (the image must be in the local Docker daemon).
The ratio is what matters: a loaded host moves both columns.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], cwd: Path) -> tuple[float | None, float, int]:
    """(seconds to the first ``table:`` line or None, seconds to the end, exit code) of ``cmd``."""
    started = time.monotonic()
    first = None
    with subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        assert p.stdout is not None
        for line in p.stdout:
            if first is None and line.startswith("table: "):
                first = time.monotonic() - started
        code = p.wait()
    return first, time.monotonic() - started, code


def shown(first: float | None, total: float, code: int) -> str:
    head = f"{first:6.1f} s" if first is not None else "   none "
    return f"first table {head}, end {total:6.1f} s" + (f", exit {code}" if code else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="the interpreter probed")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--image", help="also time --image IMAGE from the wheel")
    args = ap.parse_args()
    uv = shutil.which("uv")
    if uv is None:
        print("bench_wheel: uv is not on PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="stackprobe-bench-wheel-") as tmp:
        scratch = Path(tmp)
        built = time.monotonic()
        subprocess.run([uv, "build", "--wheel", "-q", "-o", str(scratch / "dist"), str(ROOT)], check=True)
        [wheel] = (scratch / "dist").glob("stackprobe-*.whl")
        print(f"uv build --wheel: {time.monotonic() - built:.1f} s, {wheel.name} {wheel.stat().st_size // 1024} KiB")
        probe = ["run", "--backend", "local", "--python", args.python, "--all"]
        for i in range(args.runs):
            work = scratch / f"work{i}"
            work.mkdir()
            installed = timed([uv, "tool", "run", "--from", str(wheel), "checks", *probe], work)
            clone = timed([sys.executable, "-m", "checks.cli", *probe, "--results", str(scratch / f"clone{i}")], ROOT)
            ratio = f"{installed[0] / clone[0]:.2f}x" if installed[0] and clone[0] else "-"
            print(f"run {i + 1}: uvx {shown(*installed)} | clone {shown(*clone)} | first table installed/clone {ratio}")
        if args.image:
            work = scratch / "image"
            work.mkdir()
            got = timed([uv, "tool", "run", "--from", str(wheel), "checks", "run", "--image", args.image, "--all"],
                        work)
            print(f"--image {args.image}: uvx {shown(*got)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
