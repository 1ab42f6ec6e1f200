"""The quick module carried while the images are still building: each cell's quick module (what `checks run`'s
quick pass loads) is compiled as soon as its build ends, one cell at a time in a thread of its own, while the
builder makes the next cells. An image build is mostly one busy core and disk waits, so on a small host the
compile takes the core the build leaves, and the kernel stage `provision build` runs after its builds finds these
modules current (``stage.carry`` answers them without a build).

A cell is carried with the cells carried before it whose flashinfer and CUDA are its own (the only cells a module
build can be shared with: ``stage.twins``), so a twin cell copies the build instead of compiling it again. When the
builds end, the cell in hand is finished and the ones still queued are left to the stage after the builds, which
runs them ``jobs`` at a time (:func:`left_over`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence, Set
from pathlib import Path
from typing import Any

from common.build import buildrecord, kernelstage
from provision.dockercli import Docker
from provision.kernels.jobs import QUICK_MODULES
from provision.kernels.stage import Report, carry, family

Carry = Callable[..., list[dict[str, Any]]]


def left_over(archs: Mapping[str, tuple[str, ...]], records: Sequence[Mapping[str, Any]],
              carried: Set[str]) -> dict[str, tuple[str, ...]]:
    """The cells (and their targets) the stage after the builds carries the quick module of: those not ``carried``
    early, with the carried cells of their family, whose builds a twin copies (pure)."""
    fam = {str(r.get("cell_id")): family(r) for r in records}
    open_families = {fam.get(c) for c in archs if c not in carried}
    return {c: a for c, a in archs.items() if c not in carried or fam.get(c) in open_families}


class EarlyQuick:
    """Carries the quick module of each cell handed to :meth:`add` in a thread of its own (the module docstring).
    :meth:`finish` ends it and gives the records with what it carried; ``enabled`` False (a kernel stage of an
    earlier build is running, which the stage after the builds waits for first): :meth:`add` takes nothing."""

    def __init__(self, archs: Mapping[str, tuple[str, ...]], envs: Path, report: Report,
                 docker: Docker | None = None, carrier: Carry = carry, enabled: bool | None = None) -> None:
        self.archs = dict(archs)
        self.envs = envs
        self.report = report
        self.docker = docker
        self._carry = carrier
        self.enabled = (kernelstage.running() is None and not kernelstage.locked()) if enabled is None else enabled
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stop = threading.Event()
        self._carried: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, rec: dict[str, Any]) -> None:
        """A cell whose build ended (its record written): carried next, when it can run and carries kernels."""
        if not self.enabled or self._stop.is_set() or not buildrecord.runnable(rec):
            return
        if not self.archs.get(str(rec.get("cell_id"))):
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="early-quick-kernels", daemon=True)
                self._thread.start()
        self._queue.put(rec)

    def _work(self) -> None:
        while (rec := self._queue.get()) is not None:
            if self._stop.is_set():
                continue
            cid = str(rec.get("cell_id"))
            with self._lock:
                kin = [r for r in self._carried.values() if family(r) == family(rec)]
            try:
                out = self._carry([*kin, rec], {str(r.get("cell_id")): self.archs[str(r.get("cell_id"))]
                                                for r in (*kin, rec)},
                                  1, self.envs, self.report, self.docker, modules=QUICK_MODULES)
            except Exception as exc:  # the stage after the builds carries it instead
                self.report(cid, f"kernels: the quick module is left to the stage after the builds ({exc})")
                continue
            with self._lock:
                for r in out:
                    self._carried[str(r.get("cell_id"))] = r

    def finish(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Stop taking cells, wait for the one in hand, and give ``records`` with each carried cell's record as the
        carry left it (the others as they are)."""
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            carried = dict(self._carried)
        return [carried.get(str(r.get("cell_id")), r) for r in records]

    @property
    def carried(self) -> frozenset[str]:
        """The cells whose quick module was carried early (after :meth:`finish`: all of them)."""
        with self._lock:
            return frozenset(self._carried)

    def abandon(self) -> None:
        """Take no more cells (an interrupted build); the cell in hand ends with this process."""
        self._stop.set()
        self._queue.put(None)
