"""What the compile probes build for: on a host with a GPU only that GPU unless --target-arch asks for more; on a
host without one the cross targets 12.0a and 12.0f. Decided once, from the command line and the host's GPUs, where
the backend learns them, and said in one line of the plan."""

from __future__ import annotations

from typing import Any

import pytest

from checks.cli import parser, run_options, target_archs
from checks.results import hostfacts
from checks.run import session
from checks.run.backends import HostBackend
from checks.run.options import RunOptions, UsageError, compile_targets
from checks.run.plan import CellTarget
from inenv.probes import fi_jit


@pytest.mark.parametrize(("asked", "gpus", "capability", "archs", "says"), [
    (None, 1, "9.0", (), "compile targets: the local GPU (compute capability 9.0) only, this host's own; cross "
                         "targets only when asked (--target-arch 12.0a,12.0f)"),
    (None, 8, "10.0", (), "compile targets: the local GPU (compute capability 10.0) only"),
    (None, 0, None, ("12.0a", "12.0f"), "compile targets: 12.0a, 12.0f (no GPU here: the cross targets GPU hosts "
                                        "are given to carry; --target-arch names others)"),
    (("12.0a", "12.0f"), 1, "9.0", ("12.0a", "12.0f"),
     "compile targets: 12.0a, 12.0f (--target-arch), and the local GPU (compute capability 9.0)"),
    (("9.0a",), 0, None, ("9.0a",), "compile targets: 9.0a (--target-arch)"),
    ((), 0, None, (), "compile targets: none (--target-arch)"),
])
def test_the_default_targets_are_the_hosts_own_gpu_and_a_flag_is_taken_as_given(
        asked: tuple[str, ...] | None, gpus: int, capability: str | None, archs: tuple[str, ...], says: str) -> None:
    decided = compile_targets(asked, gpus, capability)
    assert decided.archs == archs
    assert decided.why.startswith(says), decided.why


@pytest.mark.parametrize(("given", "archs"), [
    (None, None), ("none", ()), ("NONE", ()), ("12.0A,sm_120f", ("12.0a", "12.0f")), ("9.0a,9.0a", ("9.0a",)),
])
def test_the_flag_is_read_once_into_the_options(given: str | None, archs: tuple[str, ...] | None) -> None:
    assert target_archs(given) == archs
    argv = ["run", "--all", *(["--target-arch", given] if given is not None else [])]
    assert run_options(parser().parse_args(argv), argv).target_archs == archs


@pytest.mark.parametrize(("given", "says"), [
    ("", "checks run: --target-arch: give targets such as 12.0a,12.0f, or none"),
    ("12.x", "checks run: --target-arch: "),
])
def test_a_bad_flag_is_one_line(given: str, says: str) -> None:
    with pytest.raises(UsageError) as err:
        target_archs(given)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def _targets(monkeypatch: pytest.MonkeyPatch, gpus: int, asked: tuple[str, ...] | None) -> Any:
    facts = {"host_id": "h-1", "gpu_count": gpus, "compute_capability": "9.0" if gpus else None,
             "gpu_name": "NVIDIA H200" if gpus else None}
    monkeypatch.setattr(hostfacts, "gpu_facts", lambda env=None: dict(facts))
    cell = CellTarget("cu130-torch2.11.0-sgl0.4.2-fi0.7.4", "resolved", image_status="built")
    backend = HostBackend("local", lambda opts, n: ([cell], {}))
    return backend.targets(RunOptions(all_probes=True, target_archs=asked))


@pytest.mark.parametrize(("gpus", "asked", "planned"), [
    (1, None, ["local"]),
    (1, ("12.0a", "12.0f"), ["local", "12.0a", "12.0f"]),
    (0, None, ["local", "12.0a", "12.0f"]),  # local is planned as a skip on a host without a GPU
])
def test_the_backend_decides_the_targets_from_its_host_and_fi_jit_plans_them(
        monkeypatch: pytest.MonkeyPatch, gpus: int, asked: tuple[str, ...] | None, planned: list[str]) -> None:
    targets = _targets(monkeypatch, gpus, asked)
    got = session.plan(RunOptions(all_probes=True, target_archs=asked), {"fi-jit": fi_jit}, targets, {})
    archs = list(dict.fromkeys(it.variant.param("arch") for it in got.items))
    assert archs == planned
    skipped = {it.variant.param("arch") for it in got.items if it.variant.skip is not None}
    assert skipped == (set() if gpus else {"local"})


def test_the_plan_says_what_it_compiles_for(monkeypatch: pytest.MonkeyPatch) -> None:
    targets = _targets(monkeypatch, 1, None)
    assert session.compile_line(targets, {"fi-jit": fi_jit}) == (
        "  compile targets: the local GPU (compute capability 9.0) only, this host's own; cross targets only when "
        "asked (--target-arch 12.0a,12.0f)")
    assert session.compile_line(targets, {}) == ""
