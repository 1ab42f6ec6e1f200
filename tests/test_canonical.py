"""The one spelling every hash of project text uses (common.canonical): probe hashes, image tags and lock keys
see each project module name and path as the module's own name, so no folder of the layout reaches them."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from common import canonical
from common.api import resolve_all
from common.canonical import layout_free, layout_free_source
from provision import build, cellrecord, lock
from tests.checks_helpers import ROOT

# The project's package names, kept out of literal module paths so that a tool rewriting those leaves them.
E, C, P, M = "inenv", "checks", "provision", "common"


def test_canonical_has_one_spelling() -> None:
    public = {n for n, f in inspect.getmembers(canonical, inspect.isfunction)
              if f.__module__ == canonical.__name__ and not n.startswith("_")}
    # one spelling (layout_free, and layout_free_source for Python source); statements only walks a parsed module
    assert public == {"layout_free", "layout_free_source", "statements"}


def test_layout_free_writes_every_project_name_as_its_own() -> None:
    cases = {
        f"from {E}.kit import _dist": "from . import _dist",
        f"{E}/kit/_elf.py and {E}/probes/fi_jit.py": "_elf.py and fi_jit.py",
        f"python -m {E}.worker": "python -m worker",
        f"{E}/selfcheck.py, {E}.selfcheck": "selfcheck.py, selfcheck",
        f"{M}/catalog.yaml, {M}.cellid, {P}/catalog.yaml": "catalog.yaml, cellid, catalog.yaml",
        f"{C}.run.runner, {C}/report/templates/x.j2": "runner, x.j2",
        "the common case; inenvironment; results/cpu-1/x.json": "the common case; inenvironment; results/cpu-1/x.json",
    }
    assert {k: layout_free(k) for k in cases} == cases


def test_layout_free_source_sorts_import_blocks_by_module_then_names() -> None:
    text = (f"import os\nfrom typing import Any\n\nfrom {E}.probe import outcome\nfrom {E}.kit import _dist\n\n"
            f"def f():\n    from {E} import toolkit\n    from {M}.x import _b\n    return 1\n")
    want = ("import os\nfrom typing import Any\n\nfrom . import _dist\nfrom . import outcome\n\n"
            "def f():\n    from . import _b\n    from . import toolkit\n    return 1\n")
    assert layout_free_source(text) == want


@pytest.fixture
def resolved() -> lock.Resolved:
    return next(r for r in resolve_all(ROOT / "matrix.yaml", offline=True) if r.status == "resolved")


def test_the_lock_key_does_not_depend_on_where_the_catalog_sits(resolved: lock.Resolved,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell's requirements.in names the catalog's path; in whichever folder the catalog sits, the lock keys
    (inputs_hash, and an engine cell's own torch layer) are one, and a changed requirement changes them."""
    body = "".join(f"{s.requirement}\n" for s in resolved.sources)
    keys = set()
    for folder in (M, P, f"{E}/data"):
        monkeypatch.setattr(lock, "requirements_in", lambda r, f=folder: f"# {r.cell_id}: from {f}/catalog.yaml\n"
                                                                          + body)
        keys.add((lock.inputs_hash(resolved, "0.13.9"), lock.own_layer_key(resolved)))
    assert len(keys) == 1
    monkeypatch.setattr(lock, "requirements_in", lambda r: f"# {r.cell_id}: from {M}/catalog.yaml\n{body}x==1\n")
    assert lock.inputs_hash(resolved, "0.13.9") not in {k for k, _ in keys}
    assert lock.own_layer_key(resolved) not in {k for _, k in keys}


def _selfcheck(tmp: Path, package: str, helpers: str, value: int) -> list[tuple[Path, str]]:
    main, shared = tmp / "selfcheck.py", tmp / "dists.py"
    tmp.mkdir(parents=True)
    main.write_text(f"from {package} import dists\nfrom {package}.{helpers} import _x\n\nprint(dists.TABLE)\n")
    shared.write_text(f"TABLE = {value}  # read by {package.replace('.', '/')}/{helpers}/_x.py\n")
    return [(main, "/opt/x/selfcheck.py"), (shared, "/opt/x/dists.py")]


def test_the_image_tag_does_not_depend_on_where_the_self_checks_modules_sit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The self-check's files as the tag hashes them: the same code with its modules in other folders gives
    the same tag; a changed value gives another."""
    folder = ROOT / "envs" / "cu128-torch2.9.1-sgl0.4.1-fi0.6.17"
    tags = []
    for n, (package, helpers, value) in enumerate(((E, "kit", 1), (f"{M}.env", "helpers", 1), (E, "kit", 2))):
        files = _selfcheck(tmp_path / str(n), package, helpers, value)
        monkeypatch.setattr(cellrecord, "selfcheck_files", lambda files=files: files)
        tags.append(build.build_hash("FROM x\n", folder, "sha256:base", {}))
    assert tags[0] == tags[1] and tags[2] != tags[0]
