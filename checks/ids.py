"""The grammars of the ids a results file carries: host id, run id, probe id and variant (host side, pure).

Results folders are copied between hosts, so every id read from one is checked here before it names a
folder, lands in a document or is pasted into a command. Cell ids have their own home
(:mod:`provision.cellid`); :func:`cell_ok` defers to it.

- host id: ``<label>-<8 hex>``, the label a lower-case slug of the GPU model and count (``h200x2``) or
  ``cpu``, e.g. ``h200x2-5bce98f7``;
- run id: ``<UTC time>-<4 hex>``, e.g. ``20261201T021126Z-b42a``;
- probe id: lower-case words joined by ``-`` (``ar-latency``);
- variant: ``key=value`` parts joined by ``,`` of letters, digits and ``_ . : + -``;
- reason code: lower-case words joined by ``-`` (``fi-no-nvcc``), or empty.
"""

from __future__ import annotations

import re

from provision import cellid

HOST_ID = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?-[0-9a-f]{8}")
RUN_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{4}")
PROBE_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
VARIANT = re.compile(r"[A-Za-z0-9_.:+=,-]{0,512}")
REASON = re.compile(r"(?:[a-z0-9][a-z0-9-]{0,63})?")


def host_ok(text: str) -> bool:
    return HOST_ID.fullmatch(text) is not None


def run_ok(text: str) -> bool:
    return RUN_ID.fullmatch(text) is not None


def probe_ok(text: str) -> bool:
    return PROBE_ID.fullmatch(text) is not None


def variant_ok(text: str) -> bool:
    return VARIANT.fullmatch(text) is not None


def reason_ok(text: str) -> bool:
    return REASON.fullmatch(text) is not None


def cell_ok(text: str) -> bool:
    return cellid.parse(text) is not None


def shown(text: str) -> str:
    """A name from disk as one printable line: escapes for undecodable bytes, control and format characters."""
    return ascii(text)[1:-1] if not text.isprintable() or "\\" in text else text
