"""Hardware classes: what a reader shops for (GPU model, GPU count, interconnect, driver major), the one grouping
of hosts that the table, `checks report --json` and `checks advise` share (pure).

Every lend of a cloud machine gets a host id of its own; hosts of one class answer the same question, so they
are one column: a class holds its hosts, and the report keeps per variant the newest verdict of any of them,
naming the host and run it came from. Host facts are untrusted text: the label keeps them as they are (each
page escapes it where it lands); the slug, which element ids and CSS selectors use, is letters, digits and
``-`` only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

NO_GPU = "no GPU"


@dataclass(frozen=True)
class HwClass:
    gpu: str  # the GPU model without the vendor prefix ("H200"); "" for a host without a GPU
    count: int
    interconnect: str  # "NVLink (NV18)"; "" for one GPU or none
    driver_major: str  # "580"; "" when unknown or without a GPU

    @property
    def label(self) -> str:
        """``H200 ×2, NVLink (NV18), driver 580``; ``no GPU``."""
        if not self.gpu:
            return NO_GPU
        parts = [f"{self.gpu} ×{self.count}"]
        if self.interconnect:
            parts.append(self.interconnect)
        if self.driver_major:
            parts.append(f"driver {self.driver_major}")
        return ", ".join(parts)

    @property
    def short(self) -> str:
        """``H200×2``; ``no GPU``: what a table cell names the class by."""
        return f"{self.gpu}×{self.count}" if self.gpu else NO_GPU

    @property
    def slug(self) -> str:
        """The class as an element id and CSS class: ``h200-x2-nvlink-nv18-d580``; letters, digits and ``-``
        only (a hash where the facts leave none)."""
        words = re.sub(r"[^a-z0-9]+", "-", f"{self.gpu} x{self.count} {self.interconnect} d{self.driver_major}"
                       .lower()).strip("-") if self.gpu else "nogpu"
        return words[:60] if words else "c" + hashlib.sha256(self.label.encode("utf-8", "surrogateescape")) \
            .hexdigest()[:12]

    @property
    def sort_key(self) -> tuple[Any, ...]:
        """GPU classes first, most GPUs first, then by label."""
        return (not self.gpu, -self.count, self.label)


def of(facts: Mapping[str, Any]) -> HwClass:
    """The class of a host from its recorded facts (a manifest's ``facts``); missing or odd facts read as
    unknown, never as an error."""
    name, count = facts.get("gpu_name"), facts.get("gpu_count")
    n = count if isinstance(count, int) and not isinstance(count, bool) else 0
    if not name or not isinstance(name, str) or n < 1:
        return HwClass("", 0, "", "")
    inter = facts.get("interconnect")
    inter = str(inter) if isinstance(inter, str) and n > 1 and inter not in ("none", "single GPU") else ""
    driver = facts.get("driver")
    major = str(driver).split(".", 1)[0] if isinstance(driver, str) and driver[:1].isdigit() else ""
    return HwClass(re.sub(r"^NVIDIA\s+", "", name).strip() or name, n, inter, major)


def group(facts: Mapping[str, Mapping[str, Any]]) -> dict[HwClass, tuple[str, ...]]:
    """Host id -> facts grouped by class: each class with its host ids (sorted), classes in page order."""
    out: dict[HwClass, list[str]] = {}
    for host in sorted(facts):
        out.setdefault(of(facts[host]), []).append(host)
    return {c: tuple(out[c]) for c in sorted(out, key=lambda c: c.sort_key)}


def shorts(classes: Iterable[HwClass]) -> dict[HwClass, str]:
    """Each class's name in a table cell: its short name, made longer where two classes would share it."""
    classes = list(classes)
    taken: dict[str, int] = {}
    for c in classes:
        taken[c.short] = taken.get(c.short, 0) + 1
    return {c: c.short if taken[c.short] == 1 else c.label for c in classes}
