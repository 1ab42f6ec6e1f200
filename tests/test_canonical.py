"""The canonical spelling hashes of project text use (common.canonical): names and paths of every package
written one way, import blocks in sorted order of that spelling."""

from __future__ import annotations

from common.canonical import spell, spell_source

# The canonical package names, kept out of literal module paths so that a tool rewriting those leaves them.
C, P = "checks", "provision"


def test_spell_writes_every_package_the_flat_way() -> None:
    cases = {
        "from inenv.kit import _dist": f"from {C}.probes import _dist",
        "inenv/kit/_elf.py and inenv/probes/fi_jit.py": f"{C}/probes/_elf.py and {C}/probes/fi_jit.py",
        "python -m inenv.worker": f"python -m {C}.worker",
        "from inenv import dists": f"from {C} import dists",
        "inenv/selfcheck.py, inenv.selfcheck": f"{P}/selfcheck.py, {P}.selfcheck",
        "common/catalog.yaml, common.cellid": f"{P}/catalog.yaml, {P}.cellid",
        "common/reasons.yaml, common.progress, common.memlock": f"{C}/reasons.yaml, {C}.progress, {C}.memlock",
        "checks.run.runner.pick, checks/report/templates/x.j2": f"{C}.runner.pick, {C}/templates/x.j2",
        "checks.results.provenance": f"{C}.provenance",
        "checks.report.report.build_model": f"{C}.report.build_model",
    }
    assert {k: spell(k) for k in cases} == cases


def test_spell_leaves_other_text_alone() -> None:
    text = "the common case; inenvironment; results/cpu-1/x.json; provision.render.CELL_LABEL; checks.cli\n"
    assert spell(text) == text


def test_spell_source_sorts_import_blocks_in_the_canonical_spelling() -> None:
    new = ("import os\nfrom typing import Any\n\nfrom inenv.kit import _dist\nfrom inenv.probe import outcome\n\n"
           "def f():\n    from inenv.kit import _b\n    from inenv import toolkit\n    return 1\n")
    flat = (f"import os\nfrom typing import Any\n\nfrom {C}.probe import outcome\nfrom {C}.probes import _dist\n\n"
            f"def f():\n    from {C} import toolkit\n    from {C}.probes import _b\n    return 1\n")
    assert spell_source(new) == flat
    assert spell_source(flat) == flat
