"""`provision` command line: plan, lock, build, base. Exit 0 ok, 1 a cell failed, 2 bad input, 130 Ctrl-C."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from provision.errors import InputError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", default=None, help="matrix file (default: matrix.yaml of the project)")
    p.add_argument("--cuda", help="select cells by CUDA version; '13' selects every 13.x")
    p.add_argument("--torch", help="select cells by torch channel (stable, nightly) or version")
    p.add_argument("--only", action="append", metavar="GLOB", help="select cells whose id matches (repeatable)")
    p.add_argument("--offline", action="store_true", help="do not check whether index hosts are reachable")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="provision", description="Resolve, lock and build the cells of a matrix.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="list every selected cell: resolved versions, or why it cannot exist")
    _common(p)
    p.add_argument("--json", action="store_true", help="one JSON array of cells")
    p.add_argument("--live", action="store_true", help="also resolve each resolved cell with uv (network)")
    p = sub.add_parser("lock", help="write envs/<cell>/ (requirements.in, uv lock with hashes, cell.json)")
    _common(p)
    p.add_argument("--envs", default=None, help="output folder (default: envs/ of the project)")
    p.add_argument("--refresh", action="store_true", help="re-resolve even when the inputs did not change")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("build", help="lock, render and build the selected cells as Docker images")
    _common(p)
    p.add_argument("--dry-run", action="store_true", help="render Dockerfiles and print the plan, build nothing")
    p.add_argument("--jobs", type=int, default=1, help="cells built in parallel")
    p.add_argument("--base", choices=("auto", "nvidia", "registry-free"), default="auto",
                   help="auto: nvidia/cuda if that image is present locally, else the registry-free base")
    p.add_argument("--base-image", help="FROM this image (nvidia/cuda-like, with the CUDA toolkit) instead")
    p.add_argument("--envs", default=None)
    p.add_argument("--dockerfiles", default=None)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("base", help="make the registry-free base images (debootstrap + docker import)")
    p.add_argument("--json", action="store_true")
    return ap


def _matrix(args: argparse.Namespace) -> Path:
    from provision.api import DEFAULT_MATRIX

    return Path(args.matrix) if args.matrix else DEFAULT_MATRIX


def cmd_plan(args: argparse.Namespace) -> int:
    from provision.api import plan
    from provision.planview import plan_json, plan_lines

    cells = plan(_matrix(args), args.cuda, args.torch, args.only, offline=args.offline)
    if args.live:
        from provision.lock import live_check

        cells = live_check(cells)
    if args.json:
        print(json.dumps(plan_json(cells), indent=1))
    else:
        print("\n".join(plan_lines(cells)))
    return 0


def cmd_lock(args: argparse.Namespace) -> int:
    from provision.api import plan
    from provision.lock import ENVS, lock_cells

    cells = plan(_matrix(args), args.cuda, args.torch, args.only, offline=args.offline)
    results = lock_cells(cells, Path(args.envs) if args.envs else ENVS, echo=not args.json, refresh=args.refresh)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from provision.build import BuildOptions, build_cells

    opts = BuildOptions.from_args(args, _matrix(args))
    return build_cells(opts)


def cmd_base(args: argparse.Namespace) -> int:
    from provision.baseimage import BaseImageError, ensure_all

    try:
        tags = ensure_all()
    except BaseImageError as e:
        raise InputError(str(e)) from None
    print(json.dumps(tags) if args.json else "\n".join(tags))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        handler = {"plan": cmd_plan, "lock": cmd_lock, "build": cmd_build, "base": cmd_base}[args.cmd]
        code = handler(args)
    except InputError as e:
        print(f"provision: {e.one_line()}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("provision: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # output piped into head & co.: not an error of ours
        sys.stderr.close()
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
