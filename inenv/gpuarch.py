"""GPU architecture targets as a user writes them (``12.0a``), checked against what nvcc knows and spelled
one way; and the SASS flashinfer may compile a target into. Pure, standard library only: the CLI checks
``--target-arch`` with it before anything runs, and the fi-jit probe judges its output with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inenv.spelling import nearest

# Compute capabilities nvcc 12.8 to 13.x compiles for (`nvcc --list-gpu-arch`): 12.8 has 5.0 to 12.0
# (with 10.1), 12.9 adds 10.3 and 12.1, 13.0 drops everything below 7.5, adds 8.8 and renames 10.1 to 11.0.
CAPABILITIES: tuple[tuple[int, int], ...] = (
    (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6), (8, 7), (8, 8),
    (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1),
)
# Suffixes: "a" (arch-specific features, this exact GPU) from 9.0 on; "f" (family: runs on later minors of
# the same major) from 10.0 on, nvcc >= 12.9.
_SUFFIXES_FROM: dict[str, tuple[int, int]] = {"": (0, 0), "a": (9, 0), "f": (10, 0)}
_FORMS = (
    re.compile(r"(?P<major>\d{1,2})\.(?P<minor>\d)(?P<suffix>[a-z]?)"),  # 12.0a
    re.compile(r"(?:sm|compute)_?(?P<major>\d{1,2})(?P<minor>\d)(?P<suffix>[a-z]?)"),  # sm_120a
)


@dataclass(frozen=True, order=True)
class Target:
    major: int
    minor: int
    suffix: str = ""  # "" | "a" | "f"

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}"

    @property
    def sass(self) -> str:
        return f"sm_{self.major}{self.minor}{self.suffix}"


VALID: tuple[str, ...] = tuple(
    f"{ma}.{mi}{s}" for ma, mi in CAPABILITIES for s, start in _SUFFIXES_FROM.items() if (ma, mi) >= start
)


class TargetError(ValueError):
    """Not a GPU architecture; the message names the closest valid spelling."""


def closest(text: str) -> str:
    """The valid target nearest to ``text`` (``inenv.spelling``)."""
    found = nearest(text.strip().lower(), VALID)
    assert found is not None  # VALID is never empty
    return found[0]


def parse_target(text: str) -> Target:
    """``12.0A``, ``sm_120a`` and ``12.0a`` are all ``12.0a``; anything nvcc does not know raises TargetError."""
    guess = text.strip().lower()
    for form in _FORMS:
        m = form.fullmatch(guess)
        if m:
            target = Target(int(m["major"]), int(m["minor"]), m["suffix"])
            if str(target) in VALID:
                return target
    raise TargetError(f"{text.strip()!r} is not a GPU architecture; closest valid value: {closest(text)} "
                      "(MAJOR.MINOR with an optional a or f suffix)")


def parse_targets(text: str) -> tuple[str, ...]:
    """A comma-separated list, each one normalised; duplicates dropped, order kept."""
    out: list[str] = []
    for part in text.split(","):
        if part.strip():
            name = str(parse_target(part))
            if name not in out:
                out.append(name)
    return tuple(out)


def flashinfer_sass(target: Target) -> frozenset[str]:
    """The SASS flashinfer may compile ``FLASHINFER_CUDA_ARCH_LIST=<target>`` into.

    A suffix is kept as given by every release. Without one, releases differ: up to 0.6.6 the value is
    used as is (``12.0`` -> ``sm_120``); from 0.6.7, 9.x and 10+ get ``a``, and 12.x needs nvcc >= 12.9:
    0.6.7 turns every 12.x into the family target ``sm_120f``, 0.6.8 on keep 12.1 as ``sm_121a`` and 12.0
    as ``sm_120f`` (0.7 falls back to ``sm_120a`` with nvcc 12.8). Below 9.0 there is no suffix."""
    if target.suffix:
        return frozenset({target.sass})
    plain = target.sass
    if target.major < 9:
        return frozenset({plain})
    if target.major == 12:
        return frozenset({plain, plain + "a", "sm_120f"})
    return frozenset({plain, plain + "a"})
