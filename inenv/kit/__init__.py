"""Helpers the probes share (``inenv/kit/_*.py``, each hashed into every probe that imports it).

The host side (common/) names here what it needs of them, so no module outside inenv reaches into a private
helper for a fact: the environment variable that points builds at the shared compile cache. Read on first use
(PEP 562), so a probe importing one helper does not load the compile-cache module with it.
"""

from __future__ import annotations

__all__ = ["COMPILE_CACHE_ENV"]


def __getattr__(name: str) -> str:
    if name == "COMPILE_CACHE_ENV":
        from inenv.kit._compile_cache import ENV

        return ENV
    raise AttributeError(f"module 'inenv.kit' has no attribute {name!r}")
