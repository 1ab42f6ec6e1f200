"""What the host adds to a probe's verdict from what the probe recorded, with libraries the environment under
test need not hold. One registry by probe id (JUDGES); the runner applies a probe's judge as it records the
verdict, whichever backend ran it.

inventory: every installed distribution's declared requirements, judged as ``pip check`` judges them, with
``packaging``, the library pip uses: a requirement whose marker holds for the environment's recorded marker
variables (no extra requested) must name an installed distribution whose version its specifier allows,
pre-releases included. Any that does not makes a pass partial (dependency-pin-violated).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from checks.results import provenance
from checks.results.result import Verdict
from inenv.status import Status

SHOWN = 3  # broken requirements named in a note; the evidence lists them all


@dataclass(frozen=True)
class Broken:
    dist: str  # the distribution that declares the requirement
    version: str
    requirement: str  # as declared, markers left out ("torch==2.14.1")
    required: str  # canonical name of what it requires
    installed: str | None  # that distribution's version here; None when absent

    def describe(self) -> str:
        have = f"{self.required} {self.installed} is installed" if self.installed else f"{self.required} is absent"
        return f"{self.dist} {self.version} requires {self.requirement}, {have}"

    def as_dict(self) -> dict[str, Any]:
        return {"dist": self.dist, "version": self.version, "requirement": self.requirement,
                "required": self.required, "installed": self.installed}


def _allows(req: Requirement, version: str) -> bool:
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:  # a version PEP 440 cannot read: only an arbitrary-equality clause can name it
        return req.specifier.contains(version, prereleases=True)


def broken_requirements(requirements: Mapping[str, Any], markers: Mapping[str, str]
                        ) -> tuple[list[Broken], list[str]]:
    """(requirements not met, requirements that could not be read) over every distribution recorded, each
    ``{"version": ..., "requires": [...]}`` by name; pure."""
    env = {**{str(k): str(v) for k, v in markers.items()}, "extra": ""}
    versions = {canonicalize_name(str(n)): str(info.get("version")) for n, info in requirements.items()
                if isinstance(info, Mapping)}
    broken: list[Broken] = []
    unread: list[str] = []
    for name, info in sorted(requirements.items()):
        if not isinstance(info, Mapping):
            continue
        for text in info.get("requires") or []:
            try:
                req = Requirement(str(text))
                if req.marker is not None and not req.marker.evaluate(env):
                    continue
            except (InvalidRequirement, InvalidMarker, UndefinedComparison, UndefinedEnvironmentName) as exc:
                unread.append(f"{name} {info.get('version')}: {str(text)[:120]} ({type(exc).__name__})")
                continue
            have = versions.get(canonicalize_name(req.name))
            if have is not None and _allows(req, have):
                continue
            declared = f"{req.name}{req.specifier}" + (f" @ {req.url}" if req.url else "")
            broken.append(Broken(str(name), str(info.get("version")), declared, canonicalize_name(req.name), have))
    return broken, unread


def pip_check(v: Verdict) -> Verdict:
    """The inventory's verdict with its environment's requirements judged (see the module). A verdict that
    recorded no requirements (an older probe's) is left as it is."""
    installed = v.evidence.get("installed")
    if not isinstance(installed, Mapping) or not isinstance(installed.get("requirements"), Mapping):
        return v
    markers = installed.get("markers") if isinstance(installed.get("markers"), Mapping) else {}
    broken, unread = broken_requirements(installed["requirements"], markers)
    # the judgement replaces the raw table in what is stored: it is what a reader needs, and much smaller
    kept = {k: val for k, val in installed.items() if k != "requirements"}
    kept.update(requirements_read=sum(len(i.get("requires") or []) for i in installed["requirements"].values()
                                      if isinstance(i, Mapping)),
                broken_requirements=[b.as_dict() for b in broken])
    if unread:
        kept["requirements_unchecked"] = unread[:20]
    v = v.with_evidence(installed=kept)
    if not broken:
        return v
    more = f" and {len(broken) - SHOWN} more" if len(broken) > SHOWN else ""
    said = "; ".join(b.describe() for b in broken[:SHOWN]) + more
    findings = [*(v.evidence.get("metadata_findings") or []), "dependency-pin-violated"]
    v = v.with_evidence(metadata_findings=findings)
    if v.status is Status.PASS:
        return v.replace(status=Status.PARTIAL, reason_code="dependency-pin-violated",
                         note="; ".join(p for p in (said, v.note) if p))
    return v.replace(note="; ".join(p for p in (v.note, said) if p))


JUDGES: dict[str, Callable[[Verdict], Verdict]] = {"inventory": pip_check}


NAME = "hostjudge.py"  # this file, as checks.results.provenance.VERDICT_CODE names it


def judge(probe_id: str, verdict: Verdict) -> Verdict:
    """``verdict`` with the host's judgement of probe ``probe_id`` added, if that probe has one; a verdict
    the judge changed records the judge's version (provenance.JUDGED_BY), so that a later change of this
    file marks it stale instead of leaving it silently different from what this code would say."""
    found = JUDGES.get(probe_id)
    if found is None:
        return verdict
    judged = found(verdict)
    if judged is verdict:  # nothing recorded for it to judge
        return verdict
    return judged.with_evidence(**{provenance.JUDGED_BY: {NAME: provenance.code_version(Path(__file__))}})
