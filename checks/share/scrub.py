"""Scrub what identifies a person or leaks a secret from JSON values bound for another machine (pure).

``checks share`` passes every string of a bundle (keys too) through :func:`text`; ``scrub`` walks a JSON
value without recursion and returns a scrubbed copy with a count per kind of what it replaces:

- this machine's host names (short and fully qualified), its DNS domain and user name, as whole words (a
  name of one or two characters only where it stands alone);
- home folders: this user's ``$HOME``, ``/root``, ``/home/<name>``, ``/Users/<name>``, ``C:\\Users\\<name>``;
- IPv4, IPv6 and MAC addresses, GPU and MIG UUIDs;
- credentials inside values: ``user:password@`` in URLs and NCCL/Gloo addresses, ``password=...``-style
  pairs, bearer tokens and well-known token shapes;
- the value of any environment variable whose name looks like a secret (``TOKEN``, ``PASSWORD``, ``KEY``...).

Versions, ids, hashes and numbers do not match any of these, so a scrubbed result reads as it did.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import socket
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checks.results.hostfacts import SECRET

REDACTED = "<redacted>"
GENERIC_NAMES = frozenset({"localhost", "root", "user", "admin", "ubuntu", "debian", "runner", "nobody", "docker"})
# Names of one or two characters are scrubbed only where nothing but spaces, quotes, brackets and ends of
# text stand beside them, so "n1" goes where it names the host but "sm_n1" or "n1.0" stay as written.
SHORT_NAME = 3

_RULES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("credential", re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@:]+:[^\s/@]*@"), r"\1" + REDACTED + "@"),
    ("credential", re.compile(r"(?<![\w/.:-])[A-Za-z0-9._%+-]+:[^\s@/:'\"]+@(?=[\w.\[-])"), REDACTED + "@"),
    ("credential", re.compile(r"(?i)\b(password|passwd|pwd|passphrase|token|secret|api[_-]?key|access[_-]?key"
                              r"|auth|credentials?)=[^\s&;,'\"]+"), r"\1=" + REDACTED),
    ("credential", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"), "Bearer " + REDACTED),
    ("credential", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|hf_[A-Za-z0-9]{20,}"
                              r"|AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9_-]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}"
                              r"|glpat-[A-Za-z0-9_-]{20,})\b"), REDACTED),
    ("private key", re.compile(r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----[\s\S]*?(?:-----END \1PRIVATE KEY-----|$)"),
     REDACTED),
    ("token", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), REDACTED),  # a JWT
    ("credential", re.compile(r"\b(?:AIza[0-9A-Za-z_-]{35}|(?:sk|rk)_live_[A-Za-z0-9]{16,}|ASIA[0-9A-Z]{16}"
                              r"|ya29\.[0-9A-Za-z_-]{20,})"), REDACTED),
    ("credential", re.compile(r"(?i)\b(aws_secret_access_key|aws_session_token|secret_access_key)([\"']?\s*[:=]\s*"
                              r"[\"']?)[A-Za-z0-9/+=]{16,}"), r"\1\2" + REDACTED),
    # a bare 40-character cloud secret key (AWS's shape) wherever it stands, an assignment's value included
    # (note=KEY): base64 letters mixing upper and lower case and digits; a commit or a hash (hex, one case)
    # never matches
    ("credential", re.compile(r"(?<![A-Za-z0-9/+])(?=[A-Za-z0-9/+]*[A-Z])(?=[A-Za-z0-9/+]*[a-z])"
                              r"(?=[A-Za-z0-9/+]*[0-9])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"), REDACTED),
    # a Slurm node list names a range or several nodes (gpu[01-08], n[1,3-4]); x[0] is an index, kept
    ("node list", re.compile(r"(?<![\w-])[A-Za-z][\w-]*\[\d+(?:-\d+(?:,\d+(?:-\d+)?)*|(?:,\d+(?:-\d+)?)+)\]"),
     "<nodes>"),
    ("home path", re.compile(r"(?<![\w.])/(?:home|Users)/[^/\s'\":]+"), "~"),
    ("home path", re.compile(r"(?<![\w.])/root(?=/|\b)"), "~"),
    ("home path", re.compile(r"(?i)\b[A-Z]:\\Users\\[^\\\s'\"]+"), "~"),
    ("GPU UUID", re.compile(r"\b(GPU|MIG)-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b"), r"\1-<uuid>"),
    ("MAC address", re.compile(r"(?i)(?<![\w:-])(?:[0-9a-f]{2}[:-]){5}[0-9a-f]{2}(?![\w:-])"), "<mac>"),
    ("IP address", re.compile(r"(?i)(?<![\w:.])(?:[0-9a-f]{1,4}:){7}[0-9a-f]{1,4}(?![\w:.])"), "<ip>"),
    ("IP address", re.compile(r"(?i)(?<![\w:.])(?:[0-9a-f]{1,4}:){1,6}:(?:[0-9a-f]{1,4}(?::[0-9a-f]{1,4}){0,5})?"
                              r"(?![\w:.])"), "<ip>"),
    ("IP address", re.compile(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}"
                              r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\w.])"), "<ip>"),
)
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


@dataclass(frozen=True)
class Identity:
    """What names this machine and its user: replaced wherever it appears."""

    hostnames: tuple[str, ...] = ()
    users: tuple[str, ...] = ()
    homes: tuple[str, ...] = ()
    domains: tuple[str, ...] = ()  # the DNS domain of the host's fully qualified name ("corp.example.com")

    @classmethod
    def here(cls) -> Identity:
        hosts = {socket.gethostname(), socket.getfqdn()}
        hosts |= {h.split(".", 1)[0] for h in hosts}
        users = {os.environ.get(k, "") for k in ("USER", "LOGNAME", "SUDO_USER")}
        with contextlib.suppress(KeyError, OSError):  # no passwd entry for this uid (a container)
            users.add(getpass.getuser())
        homes = {str(Path.home())} if Path.home() != Path("/") else set()
        return cls(_names(hosts), _names(users), tuple(sorted(h for h in homes if len(h) > 1)),
                   domains_of(hosts))


def domains_of(hosts: set[str]) -> tuple[str, ...]:
    """The domains of fully qualified host names (``gpu7.corp.example.com`` -> ``corp.example.com``); a
    one-label remainder (a bare top-level domain) or a local-only suffix is no domain worth scrubbing."""
    out = set()
    for h in hosts:
        label, _, rest = h.partition(".")
        if label and "." in rest and rest.lower() not in ("localdomain", "local", "lan", "home.arpa"):
            out.add(rest)
    return tuple(sorted(out, key=lambda v: (-len(v), v)))


def _names(values: set[str]) -> tuple[str, ...]:
    return tuple(sorted((v for v in values if v and v.lower() not in GENERIC_NAMES), key=lambda v: (-len(v), v)))


def _word(name: str, flags: str = "") -> re.Pattern[str]:
    """``name`` as a whole word; a short one only between spaces, quotes, brackets, an assignment's ``=`` or the
    text's ends (and before a port's colon or a list's comma), and in its own case only: a host named ``vm``
    is scrubbed from ``HOSTNAME=vm`` while the word "VM" in a sentence stays."""
    if len(name) >= SHORT_NAME:
        return re.compile(flags + r"(?<![\w-])" + re.escape(name) + r"(?![\w-])")
    return re.compile(r"(?<![^\s\"'(\[<=])" + re.escape(name) + r"(?![^\s\"')\]>:,;])")


@dataclass
class Scrubber:
    identity: Identity = field(default_factory=Identity)
    counts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        rules: list[tuple[str, re.Pattern[str], str]] = []
        for home in sorted(self.identity.homes, key=len, reverse=True):
            rules.append(("home path", re.compile(re.escape(home) + r"(?=/|\b|$)"), "~"))
        rules.extend(_RULES)
        for name in self.identity.hostnames:
            rules.append(("host name", _word(name, "(?i)"), "<host>"))
        for name in self.identity.domains:  # after the host names, so a whole FQDN reads <host>
            rules.append(("domain name", re.compile(r"(?i)(?<![\w-])" + re.escape(name) + r"(?![\w-])"),
                          "<domain>"))
        for name in self.identity.users:
            rules.append(("user name", _word(name), "<user>"))
        self.rules = tuple(rules)

    def text(self, value: str) -> str:
        for kind, pattern, repl in self.rules:
            value, n = pattern.subn(repl, value)
            if n:
                self.counts[kind] += n
        return value

    def scrub(self, value: Any) -> Any:
        """A scrubbed copy of a JSON value (dicts, lists, strings, numbers, booleans, None), walked iteratively."""
        root: list[Any] = [None]
        stack: list[tuple[Any, Any, Any]] = [(value, root, 0)]
        while stack:
            item, parent, slot = stack.pop()
            if isinstance(item, dict):
                out: Any = {}
                for k, v in item.items():
                    key = self.text(str(k))
                    if isinstance(v, str) and _ENV_NAME.fullmatch(str(k)) and SECRET.search(str(k)):
                        out[key] = REDACTED
                        self.counts["secret variable"] += 1
                        continue
                    out[key] = None
                    stack.append((v, out, key))
            elif isinstance(item, list):
                out = [None] * len(item)
                stack.extend((v, out, i) for i, v in enumerate(item))
            elif isinstance(item, str):
                out = self.text(item)
            else:
                out = item
            parent[slot] = out
        return root[0]

    def summary(self) -> str:
        if not self.counts:
            return "nothing needed scrubbing"
        return ", ".join(f"{kind}: {n}" for kind, n in sorted(self.counts.items()))
