"""The manifest of one run, ``results/<host_id>/<run_id>.manifest.json`` (pure; the store writes it).

It records what the results of the run need beside them: the host facts, every selected cell (its
versions, image and status, and the fingerprint of its environment that incremental runs compare: the
environment less its carried kernel set, and ``kernels``, each carried module's digest), the
probes (title and the question each answers), the executor, the level (``full`` or ``quick``), the
command line and, since schema 2, ``code``: the checkout the run used and the source hash of every
selected probe (each result also carries its own probe's hash).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from checks.results.provenance import Checkout
from checks.run.executor import EnvPrint
from checks.run.plan import CellTarget
from inenv.probe import FULL

SCHEMA = "stackprobe.manifest/2"  # 2: `code`


def build(run_id: str, host_id: str, written_at: str, executor: str, facts: Mapping[str, Any],
          cells: list[CellTarget], probes: Mapping[str, ModuleType], code: Checkout,
          probe_hashes: Mapping[str, str], argv: list[str], level: str = FULL,
          fingerprints: Mapping[str, EnvPrint | None] | None = None) -> dict[str, Any]:
    prints = {cid: p.to_json() for cid, p in (fingerprints or {}).items() if p is not None}
    return {
        "schema": SCHEMA, "run_id": run_id, "host_id": host_id, "written_at": written_at, "executor": executor,
        "level": level, "facts": dict(facts),
        "cells": {c.cell_id: {"status": c.status, "reason": c.reason, "versions": c.versions, "image": c.image,
                              "image_status": c.image_status,
                              **prints.get(c.cell_id, {"fingerprint": None})} for c in cells},
        "probes": {pid: {"title": m.SPEC.title, "feature": m.SPEC.feature} for pid, m in sorted(probes.items())},
        "code": code.to_json(probe_hashes),
        "argv": list(argv),
    }


def _dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def merge(old: Mapping[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a resumed run: the cells and probes of both invocations (the newer wins) and the
    newer checkout, with the probe hashes of both (each result keeps the exact code that made it)."""
    if not old:
        return new
    out = dict(new)
    out["cells"] = {**_dict(old.get("cells")), **new["cells"]}
    out["probes"] = {**_dict(old.get("probes")), **new["probes"]}
    old_hashes = _dict(_dict(old.get("code")).get("probe_hashes"))
    out["code"] = {**new["code"], "probe_hashes": dict(sorted({**old_hashes, **new["code"]["probe_hashes"]}.items()))}
    return out
