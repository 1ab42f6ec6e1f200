"""What the kernel stage records in a cell's build record (its ``kernels`` key: the list, per module carried or
why not, the bytes carried, the compilers' CPU seconds) and what it learns back from the records of this
host's earlier stages, each read through the one build-record reader (common.build.buildrecord) and written through
the one writer (provision.cellrecord)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from common.build import backend, buildrecord
from inenv import kit
from inenv.kit import COMM_MODULES
from provision import cellrecord
from provision.kernels.carriers import Carrier
from provision.kernels.jobs import set_digest


def learned_costs(envs: Path) -> dict[str, float]:
    """CPU seconds per target of each module, as this host's earlier kernel stages measured them (the build
    records under ``envs``, read by the one reader): the mean over every build that compiled (a cached or
    reused one is left out)."""
    seen: dict[str, list[float]] = {}
    for folder in sorted(p for p in envs.iterdir() if p.is_dir()) if envs.is_dir() else ():
        read: set[Path] = set()
        for of in backend.RECORD_NAMES:
            loaded = buildrecord.read(folder, of)
            if loaded.record is None or loaded.path in read:  # a venv cell's build.json is read once
                continue
            read.add(loaded.path)
            for module, per_target in loaded.record.compile_costs.items():
                seen.setdefault(module, []).append(per_target)
    return {m: sum(v) / len(v) for m, v in seen.items()}


def module_rows(rec: Mapping[str, Any]) -> tuple[str, ...]:
    """The modules a cell's build record has a kernel row for (carried or not, with why)."""
    summary = rec.get("kernels")
    mods = summary.get("modules") if isinstance(summary, Mapping) else None
    return tuple(str(m) for m in mods) if isinstance(mods, Mapping) else ()


def module_row(v: Mapping[str, Any], targets: int) -> dict[str, Any]:
    """One module's line of the record's ``kernels``: carried (for which targets, the targets flashinfer's gate
    refused and why) or why not; the compilers' CPU seconds when it compiled here (what later estimates learn)."""
    refused = v.get("refused") if isinstance(v.get("refused"), Mapping) else {}
    row: dict[str, Any] = ({"carried": True, "sass": v.get("sass"), "bytes": v.get("library_bytes"),
                            "arch_list": v.get("arch_list")} if v.get("ok")
                           else {"carried": False, "reason_code": v.get("reason_code"), "line": v.get("line")})
    if refused:
        row["refused"] = dict(refused)
    if not v.get("cached") and v.get("from") is None and v.get("compile_cpu_s"):
        row.update({"compile_cpu_s": v.get("compile_cpu_s"), "targets": targets})
    return row


def finish(rec: dict[str, Any], carrier: Carrier, folder: Path, kernel_dir: Path, archs: tuple[str, ...],
           modules: Mapping[str, Mapping[str, Any]], report: Callable[[str, str], None],
           stage_s: float = 0.0, identity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Install the cell's set and rewrite its record with ``kernels``: per module whether it is carried (and
    for which targets), the compilers' CPU seconds this build spent on it (0 for a set reused or a cached
    build), the cell's identity facts the set was judged by; ``stage_s`` the kernel stage's wall time."""
    summary: dict[str, Any] = {
        "arch_list": " ".join(archs), "folder": str(kernel_dir), "digest": set_digest(kernel_dir),
        "stage_s": stage_s,
        "compile_cpu_s": round(sum(float(v.get("compile_cpu_s") or 0.0) for v in modules.values()
                                   if not v.get("cached") and v.get("from") != "kernel set"), 1),
        "bytes": sum(c.library.stat().st_size for c in kit.kernel_set(kernel_dir).values()),
        "modules": {m: module_row(v, len(archs)) for m, v in sorted(modules.items())}}
    prev_rows = (rec.get("kernels") or {}).get("modules") if isinstance(rec.get("kernels"), Mapping) else None
    if isinstance(prev_rows, Mapping) and (rec.get("kernels") or {}).get("arch_list") == summary["arch_list"]:
        # the other part of the stage (the quick module, or the long ones) keeps its rows
        summary["modules"] = dict(sorted({**{m: r for m, r in prev_rows.items() if m in COMM_MODULES},
                                          **summary["modules"]}.items()))
        summary["compile_cpu_s"] = round(summary["compile_cpu_s"] + sum(
            float(r.get("compile_cpu_s") or 0.0) for m, r in prev_rows.items()
            if isinstance(r, Mapping) and m not in modules), 1)
    if identity is not None:
        summary["identity"] = dict(identity)
    changed: dict[str, Any] = {}
    prev = rec.get("kernels") or {}
    if summary["digest"] and (prev.get("digest") != summary["digest"] or not prev.get("installed")):
        try:
            changed = carrier.install(kernel_dir, rec)
            summary["installed"] = True
        except (OSError, subprocess.SubprocessError) as exc:
            summary["installed"] = False
            summary["install_error"] = str(exc)[:300]
            report(str(rec.get("cell_id")), f"kernels: not installed: {exc}")
    else:
        summary["installed"] = bool(prev.get("installed")) if summary["digest"] else False
    new = {**rec, **changed, "kernels": summary}
    if folder.is_dir():
        cellrecord.write(folder, new)
    return new
