"""Which lines of `docker build` output a person watching a build needs (pure).

The whole output goes to the cell's build log. The console gets one line per build step as it starts
(BuildKit's ``#7 [3/9] RUN ...``, the classic builder's ``Step 3/9 : RUN ...``) and every error line;
layer digests (``#5 sha256:... 10MB / 120MB``), download progress and the steps' own output stay in the log.
"""

from __future__ import annotations

import re

from provision.render import CERTENV

STEP_LIMIT = 160  # a RUN step can be a page of shell; the log has it whole
_BUILDKIT_STEP = re.compile(r"^#(?P<id>\d+) \[(?:[\w.-]+ )?(?P<n>\d+)/(?P<of>\d+)\] (?P<what>.+)$")
_BUILDKIT_EXPORT = re.compile(r"^#(?P<id>\d+) exporting to image$")  # minutes for a large image
_CLASSIC_STEP = re.compile(r"^Step (?P<n>\d+)/(?P<of>\d+) : (?P<what>.+)$")
_ERROR = re.compile(r"^(#\d+ ERROR|ERROR[: ]|error: |The command .* returned a non-zero code)")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= STEP_LIMIT else text[: STEP_LIMIT - 1] + "…"


def _what(text: str) -> str:
    """A step without what every download step repeats (cache and secret mounts, the CA bundle export)."""
    text = re.sub(r"--mount=\S+\s*", "", " ".join(text.split()))
    return _short(text.replace(" ".join(CERTENV.split()) + " ", ""))


def step(line: str) -> tuple[str, str] | None:
    """(step key, ``step 3/9: RUN ...``) when ``line`` starts a build step; BuildKit repeats a step's header
    when its output resumes after another step's, so the key lets the caller say each step once."""
    line = line.strip()
    m = _BUILDKIT_STEP.match(line)
    if m:
        return m["id"], f"step {m['n']}/{m['of']}: {_what(m['what'])}"
    m = _BUILDKIT_EXPORT.match(line)
    if m:
        return m["id"], "exporting the image"
    m = _CLASSIC_STEP.match(line)
    if m:
        return f"step{m['n']}", f"step {m['n']}/{m['of']}: {_what(m['what'])}"
    return None


def error(line: str) -> str | None:
    """The line, shortened, when it reports an error."""
    line = line.strip()
    return _short(line) if _ERROR.match(line) else None
