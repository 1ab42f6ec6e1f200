"""`provision` command line: plan, lock, build, prune, base, doctor, abi, catalog check.

Exit 0 ok, 1 a cell failed (catalog check: a fact drifted), 2 bad input or unreachable index, 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from common.abi import ABI_CACHE, cached
from common.api import DEFAULT_MATRIX, plan
from common.catalog import CATALOG_PATH, Catalog
from common.catalog import load as load_catalog
from common.errors import InputError, suggest
from common.resolve import Resolved
from inenv.gpuarch import TargetError, parse_targets
from provision.abi.view import cell_warnings, extensions_of
from provision.baseimage import BaseImageError, ensure_all
from provision.dockercli import Docker, docker_cli
from provision.lock import ENVS, live_check, lock_cells
from provision.options import VENVS, BuildOptions
from provision.planview import plan_json, plan_lines
from provision.render import DOCKERFILES


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", default=None, help="matrix file (default: matrix.yaml of the project)")
    p.add_argument("--cuda", help="select cells by CUDA version; '13' selects every 13.x")
    p.add_argument("--torch", help="select cells by torch channel (stable, nightly) or version")
    p.add_argument("--only", action="append", metavar="GLOB", help="select cells whose id matches (repeatable)")
    p.add_argument("--no-reach-check", dest="offline", action="store_true",
                   help="do not check whether the index hosts are reachable (lock and build still use the network)")
    p.add_argument("--offline", dest="offline", action="store_true", help=argparse.SUPPRESS)  # the earlier name


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
    p = sub.add_parser("build", help="lock and build the selected cells: Docker images, or venv cells without Docker")
    _common(p)
    p.add_argument("--backend", choices=("auto", "docker", "venv"), default="auto",
                   help="auto: Docker images when a Docker daemon answers, else virtual environments (venv cells)")
    p.add_argument("--base-python", metavar="PATH",
                   help="venv overlay cells on this interpreter's environment: its torch, CUDA libraries and NCCL "
                        "as installed, only the cell's other packages in the overlay (an NCCL release the cell "
                        "names among them)")
    p.add_argument("--wheels", metavar="DIR", help="venv cells: install from this folder of wheels (no index)")
    p.add_argument("--venvs", default=None, help="where venv cells are made (default: .cache/venvs/ of the project)")
    p.add_argument("--dry-run", action="store_true", help="render Dockerfiles and print the plan, build nothing")
    p.add_argument("--jobs", type=int, default=1, help="cells built in parallel")
    p.add_argument("--kernel-archs", metavar="LIST",
                   help="compile each cell's flashinfer comm modules for these GPU architectures, comma separated "
                        "(e.g. 9.0a,12.0f), or none; default: the matrix's kernel_archs (9.0a,12.0a,12.0f)")
    p.add_argument("--kernel-jobs", type=int, default=None,
                   help="comm module builds at once (default: the cores, at most one per 8 GiB of memory)")
    p.add_argument("--wait-kernels", action="store_true",
                   help="build the long comm modules before returning (default: they go on after the command, "
                        "and `checks run` waits for them before its full level)")
    p.add_argument("--base", choices=("auto", "nvidia", "registry-free"), default="auto",
                   help="auto: nvidia/cuda if that image is present locally, else the registry-free base")
    p.add_argument("--base-image", help="FROM this image (nvidia/cuda-like, with the CUDA toolkit) instead")
    p.add_argument("--envs", default=None)
    p.add_argument("--dockerfiles", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--ignore-disk", action="store_true",
                   help="build even when the free space looks too small for the cells still to build")
    p = sub.add_parser("prune", help="remove stackprobe images and venv cells that no cell of the matrix uses")
    p.add_argument("--matrix", action="append", default=None, metavar="FILE",
                   help="a matrix whose cells stay (repeatable; matrix.yaml always counts)")
    p.add_argument("--envs", default=None, help="where `provision build` records its images (default: envs/)")
    p.add_argument("--venvs", default=None, help="venv cells folder (default: .cache/venvs/ of the project)")
    p.add_argument("--build-cache", action="store_true", help="also run `docker builder prune`")
    p.add_argument("--compile-cache", action="store_true", help="also remove the compiled JIT modules `checks run` "
                   "shares between cells and runs (.cache/compile, or $STACKPROBE_COMPILE_CACHE)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="one JSON object: removals, total_bytes")
    p = sub.add_parser("doctor", help="check what the main job needs on this machine and say how to fix what lacks")
    p.add_argument("--matrix", default=None, help="matrix file (default: matrix.yaml of the project)")
    p.add_argument("--envs", default=None, help="where `provision build` records its images (default: envs/)")
    p.add_argument("--venvs", default=None, help="venv cells folder (default: .cache/venvs/ of the project)")
    p.add_argument("--backend", choices=("auto", "docker", "venv"), default="auto",
                   help="judge this backend (auto: the one `provision build` takes here)")
    p.add_argument("--json", action="store_true", help="one JSON object: backend, why, ready, checks")
    p = sub.add_parser("base", help="make the registry-free base images (debootstrap + docker import)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("abi", help="which extension release (sgl-kernel, vLLM...) loads beside which torch build, "
                                   "from their binaries' symbol tables")
    p.add_argument("--json", action="store_true", help="one JSON object: torch, extensions, cells")
    p.add_argument("--package", action="append", metavar="NAME", help="only this extension (repeatable)")
    p.add_argument("--detail", action="store_true", help="say every cell's verdict, not only the findings")
    p.add_argument("--cached", action="store_true", help="only the indexes already made; ask the registry nothing")
    p.add_argument("--variants", action="store_true",
                   help="also each torch release's other CUDA builds, from the PyTorch index (where reachable)")
    p.add_argument("--catalog", default=None, help="catalog file (default: common/catalog.yaml)")
    p.add_argument("--index", default=None, help="simple-API index URL (default: the one uv is configured with)")
    p = sub.add_parser("catalog", help="the catalog of publication facts")
    csub = p.add_subparsers(dest="catalog_cmd", required=True)
    p = csub.add_parser("check", help="re-read from the package index every catalog fact it can confirm; "
                                      "exit 1 when one drifted")
    p.add_argument("--json", action="store_true", help="one JSON object: index, checked, drift, unchecked")
    p.add_argument("--catalog", default=None, help="catalog file (default: common/catalog.yaml)")
    p.add_argument("--index", default=None, help="simple-API index URL (default: the one uv is configured with)")
    return ap


def _matrix(args: argparse.Namespace) -> Path:
    return Path(args.matrix) if args.matrix else DEFAULT_MATRIX


def cmd_plan(args: argparse.Namespace) -> int:
    cells = plan(_matrix(args), args.cuda, args.torch, args.only, offline=args.offline)
    if args.live:
        cells = live_check(cells)
    if args.json:
        print(json.dumps(plan_json(cells), indent=1))
    else:
        print("\n".join(plan_lines(cells)))
    for line in abi_warnings(cells):
        print(f"provision: warning: {line}", file=sys.stderr)
    return 0


def abi_warnings(cells: Sequence[Resolved], root: Path | None = None) -> list[str]:
    """Cells whose sgl-kernel or serving engine will not load beside their torch, from the indexes `provision
    abi` made (no network; a release not indexed yet is not judged)."""
    catalog = load_catalog()
    wanted = {("torch", r.versions.get("torch", "")) for r in cells}
    wanted |= {pair for r in cells for pair in extensions_of(r, catalog)}
    torches, exts = cached(sorted(wanted), root or ABI_CACHE)
    return cell_warnings(cells, catalog, torches, exts)


def cmd_lock(args: argparse.Namespace) -> int:
    cells = plan(_matrix(args), args.cuda, args.torch, args.only, offline=args.offline)
    results = lock_cells(cells, Path(args.envs) if args.envs else ENVS, echo=not args.json, refresh=args.refresh)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


def build_options(args: argparse.Namespace) -> BuildOptions:
    """The command line of `provision build` as options, validated; nothing past this function sees ``args``."""
    return BuildOptions(
        _matrix(args), args.cuda, args.torch, tuple(args.only or ()), args.offline, args.dry_run, args.jobs,
        args.base, args.base_image, Path(args.envs) if args.envs else ENVS,
        Path(args.dockerfiles) if args.dockerfiles else DOCKERFILES, args.json, backend=args.backend,
        base_python=args.base_python, wheels=Path(args.wheels) if args.wheels else None,
        venvs=Path(args.venvs) if args.venvs else VENVS, ignore_disk=args.ignore_disk,
        kernel_archs=kernel_archs_arg(args.kernel_archs), kernel_jobs=args.kernel_jobs,
        wait_kernels=args.wait_kernels).check()


def kernel_archs_arg(text: str | None) -> tuple[str, ...] | None:
    """``--kernel-archs``: None when not given (the matrix decides), () for none, else the normalised list."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        archs = parse_targets(text.replace(" ", ","))
    except TargetError as exc:
        raise InputError(f"--kernel-archs: {exc}") from None
    if not archs:
        raise InputError("--kernel-archs: give architectures such as 9.0a,12.0f, or none")
    return archs


def cmd_build(args: argparse.Namespace) -> int:
    # lazy: provision.buildsession (rich, both builders) costs 100 ms at every `provision` start
    from provision.buildsession import build_cells

    return build_cells(build_options(args))


def cmd_base(args: argparse.Namespace) -> int:
    try:
        tags = ensure_all()
    except BaseImageError as e:
        raise InputError(str(e)) from None
    print(json.dumps(tags) if args.json else "\n".join(tags))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    # lazy: provision.doctor (its installer, resolution, docker modules) costs 8 ms at every `provision` start
    from provision import doctor

    facts = doctor.gather(_matrix(args), Path(args.envs) if args.envs else ENVS,
                          Path(args.venvs) if args.venvs else None)
    checks = doctor.diagnose(facts)
    backend, why = doctor.auto_backend(facts) if args.backend == "auto" else (args.backend, "asked for")
    if args.json:
        print(json.dumps(doctor.to_json(checks, backend, why), indent=1))
    else:
        print("\n".join(doctor.report(checks, backend, why, auto=args.backend == "auto")))
    return doctor.exit_code(checks, backend)


def cmd_prune(args: argparse.Namespace) -> int:
    # lazy: provision.prune (and the compile cache's layout) costs 10 ms at every `provision` start
    from provision import prune

    if any(not m.strip() for m in args.matrix or ()):
        raise InputError("--matrix '': give a matrix file whose cells stay, or leave the option out")
    docker = Docker(cli=docker_cli())
    problem = docker.unreachable()
    if problem:  # venv cells can still be pruned without an engine
        print(f"provision: images and their bytecode folders not looked at: {problem}", file=sys.stderr)
    cli = None if problem else docker.cli
    matrices = [DEFAULT_MATRIX, *(Path(m) for m in args.matrix or ())]
    removals = prune.gather(matrices, Path(args.envs) if args.envs else ENVS,
                            Path(args.venvs) if args.venvs else VENVS, cli, args.build_cache,
                            compile_cache=args.compile_cache)
    failed = [] if args.dry_run else prune.apply(removals, docker.cli)
    done = [r for r in removals if r.target not in {f.target for f in failed}]
    if args.json:
        print(json.dumps({**prune.to_json(done, args.dry_run),
                          "failed": [{"target": f.target, "reason": f.reason} for f in failed]}, indent=1))
    else:
        print("\n".join(prune.lines(done, args.dry_run)))
        for f in failed:
            print(f"provision: could not remove {f.target}: {f.reason}", file=sys.stderr)
    return 1 if failed else 0


def _read_catalog(given: str | None) -> Catalog:
    path = Path(given) if given else CATALOG_PATH
    try:
        return load_catalog(path)
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        raise InputError(f"cannot read the catalog: {type(e).__name__}: {e}", file=str(path)) from None


def cmd_abi(args: argparse.Namespace) -> int:
    # lazy: provision.abi (the registry reader, packaging, the ELF reader) costs 20 ms at every `provision` start
    from provision.abi import command

    return command.run(command.AbiOptions(_read_catalog(args.catalog), tuple(args.package or ()), args.json,
                                          args.detail, args.cached, variants=args.variants, index_url=args.index))


def cmd_catalog(args: argparse.Namespace) -> int:
    # lazy: provision.registry and catalogcheck (packaging, wheel readers) cost 21 ms at `provision` start
    from provision import catalogcheck, registry

    path = Path(args.catalog) if args.catalog else CATALOG_PATH
    try:
        catalog = load_catalog(path)
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        raise InputError(f"cannot read the catalog: {type(e).__name__}: {e}", file=str(path)) from None
    outcome = catalogcheck.compare(catalog, registry.read(catalogcheck.wants(catalog), args.index))
    if args.json:
        print(json.dumps(catalogcheck.outcome_json(outcome), indent=1))
    else:
        print("\n".join(catalogcheck.outcome_lines(outcome)))
    return 1 if outcome.drift else 0


def _subparser(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand parser ``args`` went through (``build``, ``catalog check``), else ``ap``."""
    p = ap
    for dest in ("cmd", "catalog_cmd"):
        action = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, dest, None)
        if action is None or name not in action.choices:
            break
        p = action.choices[name]
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Like parse_args, but an unknown option is reported with the usage of the subcommand it was given
    to, and the closest option of that subcommand (``--dryrun``: did you mean ``--dry-run``?)."""
    ap = parser()
    args, extra = ap.parse_known_args(argv)
    if extra:
        p = _subparser(ap, args)
        options = [o for a in p._actions for o in a.option_strings]
        hint = suggest(extra[0].split("=", 1)[0], options) if extra[0].startswith("-") else ""
        p.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        handler = {"plan": cmd_plan, "lock": cmd_lock, "build": cmd_build, "base": cmd_base,
                   "catalog": cmd_catalog, "abi": cmd_abi, "doctor": cmd_doctor,
                   "prune": cmd_prune}[args.cmd]
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
