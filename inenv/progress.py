"""Where each rank of a long-running variant stands: one small record per rank, rewritten in place.

A rank that replays collectives thousands of times writes its position (phase, replay number, token count, PDL
setting, stream) into ``<workdir>/progress-<rank>.rec`` before each replay: one fixed-size record written with
``os.pwrite`` at offset 0, about a microsecond, so it can be done for every replay. The launcher that watches
the ranks (``inenv.worker._watch``, also under ``inenv.warm``) reads the records: a record that declares a stall
deadline (``stall_s`` > 0) and has not changed for that long means its rank is hung there, and the variant's
``hang`` verdict names, per rank, where each one stopped. The deadline travels in the record, so whichever
launcher watches applies it, and a phase that may take long for reasons of its own (a JIT build while the
backend is set up) declares none.

In-environment side: standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORD_BYTES = 512  # one record, space-padded and ending in a newline; a longer one is cut to its fixed fields
PHASES = ("prepare", "capture", "replay", "flush", "done")
POLL_S = 0.25  # how often the watcher reads the records


def path(workdir: Path, rank: int) -> Path:
    return workdir / f"progress-{rank}.rec"


class Writer:
    """One rank's record. ``static`` fields (backend, pattern, ...) are encoded once; :meth:`at` rewrites the
    position. Text values of the position are from :data:`PHASES` only, so no escaping is needed per write."""

    def __init__(self, workdir: Path, rank: int, **static: Any) -> None:
        self.fd = os.open(path(workdir, rank), os.O_RDWR | os.O_CREAT, 0o644)
        self.rank = rank
        self.static = json.dumps(static, sort_keys=True, default=str)[1:-1]
        self.replay = 0

    def at(self, phase: str, *, replay: int = 0, size: int = 0, stream: int = 0, pdl: bool = False,
           verified: int = 0, stall_s: float = 0.0) -> None:
        """This rank's position now: ``replay`` is the number of replays issued so far (the one being issued
        included), ``verified`` the last replay whose sampled check came back right, ``stall_s`` how long the
        record may stand still in this phase before the watcher calls the rank hung (0: no limit)."""
        if phase not in PHASES:
            raise ValueError(f"progress phase {phase!r} is not one of {', '.join(PHASES)}")
        self.replay = replay
        flag = "true" if pdl else "false"
        text = (f'{{"phase":"{phase}","replay":{replay:d},"size":{size:d},"stream":{stream:d},"pdl":{flag},'
                f'"verified":{verified:d},"stall_s":{stall_s:.3f},"t":{time.time():.3f}')
        text = f"{text},{self.static}}}" if self.static else f"{text}}}"
        if len(text) >= RECORD_BYTES:
            text = text[: text.index(',"t":')] + "}"
        os.pwrite(self.fd, text.ljust(RECORD_BYTES - 1).encode() + b"\n", 0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def read(workdir: Path, rank: int) -> dict[str, Any] | None:
    """A rank's record, or None when it wrote none or it cannot be read as one (a torn read is retried by the
    next poll)."""
    try:
        with open(path(workdir, rank), "rb") as f:
            raw = f.read(RECORD_BYTES)
    except OSError:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_all(workdir: Path, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
    return {r: rec for r in ranks if (rec := read(workdir, r)) is not None}


_WHERE = {"prepare": "setting up after {n} replays", "capture": "capturing a graph after {n} replays",
          "replay": "at replay {n}", "flush": "waiting for replays up to {n} to finish",
          "done": "done after {n} replays"}


def describe(record: Mapping[str, Any]) -> str:
    """Where a rank stands, in words: ``flashinfer-fusion replay: at replay 1234 (verified to 1216), 64 tokens,
    PDL on, stream 1``. Fields a record lacks are left out."""
    head = " ".join(str(record[k]) for k in ("backend", "pattern") if record.get(k))
    phase = str(record.get("phase", "?"))
    parts = [_WHERE.get(phase, phase).format(n=record.get("replay", 0))]
    if record.get("verified"):
        parts[0] += f" (verified to {record['verified']})"
    if record.get("size"):
        parts.append(f"{record['size']} tokens")
    if "pdl" in record:
        parts.append(f"PDL {'on' if record['pdl'] else 'off'}")
    if "stream" in record:
        parts.append(f"stream {record['stream']}")
    return f"{head}: {', '.join(parts)}" if head else ", ".join(parts)


@dataclass
class Watch:
    """The launcher's view of the records: when each rank's record last changed, by the launcher's own clock
    (a rank's clock is never compared with it)."""

    workdir: Path
    seen: dict[int, tuple[bytes, float]] = field(default_factory=dict)
    last_poll: float = 0.0

    def _raw(self, rank: int) -> bytes | None:
        try:
            with open(path(self.workdir, rank), "rb") as f:
                return f.read(RECORD_BYTES)
        except OSError:
            return None

    def stalled(self, ranks: Iterable[int], now: float | None = None) -> dict[int, dict[str, Any]]:
        """The ranks among ``ranks`` whose record declares a stall deadline and has stood still for longer than
        it, with their records (read at most every :data:`POLL_S`; {} between polls)."""
        now = time.monotonic() if now is None else now
        if now - self.last_poll < POLL_S:
            return {}
        self.last_poll = now
        out: dict[int, dict[str, Any]] = {}
        for rank in ranks:
            raw = self._raw(rank)
            if raw is None:
                continue
            before = self.seen.get(rank)
            if before is None or before[0] != raw:
                self.seen[rank] = (raw, now)
                continue
            try:
                record = json.loads(raw)
                limit = float(record.get("stall_s") or 0.0)
            except (ValueError, TypeError, AttributeError):
                continue
            if limit > 0 and now - before[1] > limit:
                out[rank] = record
        return out
