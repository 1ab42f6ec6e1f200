"""Is an index host reachable from here? One TCP connect per host, in parallel, remembered per process."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

_cache: dict[str, str | None] = {}


def _probe(host: str, timeout: float) -> str | None:
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return None
    except socket.gaierror as e:
        return f"DNS: {e.strerror or e}"
    except OSError as e:
        return f"connect: {e.strerror or type(e).__name__}"


def check(hosts: set[str], timeout: float = 1.0) -> dict[str, str | None]:
    """host -> None when a TCP connection to port 443 opens, else why not."""
    todo = sorted(h for h in hosts if h not in _cache)
    if todo:
        with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
            for host, why in zip(todo, pool.map(lambda h: _probe(h, timeout), todo), strict=True):
                _cache[host] = why
    return {h: _cache[h] for h in hosts}
