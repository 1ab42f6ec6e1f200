"""The package layout, checked from the sources: the import graph of inenv/, common/, provision/ and
checks/ (every import, those inside functions too, and those in a package's ``__init__.py``, which counts as a
module of that package's layer), read with ast.

- no import circles;
- a layer order (LAYERS): inenv, common, provision and checks.results, checks.report and checks.share,
  checks.run, the command line; no package imports one above it or beside it, and common no private helper;
- provision and checks do not import each other; common imports neither;
- inenv (the in-environment side) imports only the standard library, itself and the libraries under test;
- every folder of these packages holds fewer than 25 modules;
- nothing outside inenv (host side, benchmarks, tools) imports a private helper of the probe kit
  (``inenv.kit._*``) or names one as code to run: the kit's public face (``inenv/kit/__init__.py``) does;
- on the host side (common/, provision/, checks/) project modules are imported at module top; an import
  inside a function carries a ``# lazy:`` comment (on its line or the line above) saying what importing it
  at the top would cost a command's start.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

from tests.checks_helpers import ROOT

PACKAGES = ("inenv", "common", "provision", "checks")
# What the probes and the self-check may import inside an environment besides the standard library.
LIBRARIES_UNDER_TEST = frozenset({"torch", "flashinfer", "sgl_kernel", "triton", "numpy", "cuda", "pynvml"})
FORBIDDEN = {"provision": {"checks"}, "checks": {"provision"}, "common": {"checks", "provision"}}
MAX_MODULES = 25
HOST_SIDE = ("common", "provision", "checks")
LAZY_MARK = "# lazy:"


def module_of(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(root: Path = ROOT) -> dict[str, Path]:
    return {module_of(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))
            if "__pycache__" not in p.parts}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from pkg import mod`` names ``pkg.mod`` when that is a
    module), wherever in the file the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known)
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    src = sources(root)
    known = set(src)
    edges: dict[str, set[str]] = {}
    for name, path in src.items():
        found = set()
        for mod in imports(path, name, known):
            while mod and mod not in known:  # `import checks.run.plan.x` -> the module that holds it
                mod = mod.rpartition(".")[0]
            # a package's own __init__ runs before any of its modules: an edge from a module to its
            # enclosing packages says nothing; one to another package's __init__ is an import like any other
            if mod and mod != name and not name.startswith(mod + "."):
                found.add(mod)
        edges[name] = found
    return edges


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[tuple[str, ...]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circles() -> None:
    found = cycles(graph())
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


# The layers, lowest first: a package imports only its own layer's modules and those of layers below, never a
# sibling of its layer. (inenv's own subpackages are one layer; its helpers and probes import each other.)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("inenv",),
    ("common",),
    ("provision", "checks.results"),
    ("checks.report", "checks.share"),
    ("checks.run",),
    ("checks",),  # the command line
)


LAYER_PACKAGES = frozenset(pkg for layer in LAYERS for pkg in layer)


def layer_package(module: str) -> str:
    """The package of the layer table a module belongs to; a package's ``__init__`` (named like the package,
    ``checks.results``) belongs to that package's layer."""
    parts = module.split(".")
    two = ".".join(parts[:2])
    return two if two in LAYER_PACKAGES else parts[0]


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Each import of a layer above the importer's or beside it, as one line."""
    rank = {pkg: n for n, layer in enumerate(LAYERS) for pkg in layer}
    wrong = []
    for mod, targets in edges.items():
        a = layer_package(mod)
        for target in targets:
            b = layer_package(target)
            if a != b and rank[b] >= rank[a]:
                wrong.append(f"{mod} -> {target} ({a} is layer {rank[a]}, {b} layer {rank[b]})")
    return sorted(wrong)


def test_no_package_imports_one_above_it_or_beside_it() -> None:
    wrong = layer_violations(graph())
    assert wrong == [], "\n".join(wrong)


def _planted(tmp_path: Path, file: str, text: str) -> Path:
    """A copy of the packages' sources under ``tmp_path`` with ``text`` added to ``file``."""
    for path in sources().values():
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    with (tmp_path / file).open("a") as f:
        f.write(text)
    return tmp_path


def test_the_layer_check_sees_an_import_in_a_package_init(tmp_path: Path) -> None:
    """A layer violation written in a package's ``__init__.py`` fails the layer test like one in any module,
    and so does an import of another package's ``__init__`` from below it."""
    root = _planted(tmp_path / "a", "checks/results/__init__.py", "from checks.run import session\n")
    assert layer_violations(graph(root)) == [  # the package checks.run (its __init__) and the module
        "checks.results -> checks.run (checks.results is layer 2, checks.run layer 4)",
        "checks.results -> checks.run.session (checks.results is layer 2, checks.run layer 4)"]
    root = _planted(tmp_path / "b", "common/cellid.py", "import checks.report\n")
    assert layer_violations(graph(root)) == ["common.cellid -> checks.report (common is layer 1, "
                                             "checks.report layer 3)"]


def test_the_layer_check_sees_an_import_from_above() -> None:
    rank = {pkg: n for n, layer in enumerate(LAYERS) for pkg in layer}
    assert rank[layer_package("checks.results.store")] < rank[layer_package("checks.run.session")]
    assert layer_package("checks.cli") == "checks" and layer_package("inenv.kit._elf") == "inenv"


def test_the_host_side_reaches_no_private_helper_of_inenv_from_common() -> None:
    private = sorted(f"{m} -> {t}" for m, ts in graph().items() if m.startswith("common.")
                     for t in ts if any(part.startswith("_") for part in t.split(".")))
    assert private == []


def test_provision_and_checks_do_not_import_each_other() -> None:
    bad = sorted(f"{a} -> {b}" for a, deps in graph().items() for b in deps
                 if b.split(".")[0] in FORBIDDEN.get(a.split(".")[0], set()))
    assert bad == []


def test_inenv_imports_only_the_standard_library_itself_and_the_libraries_under_test() -> None:
    src = sources()
    allowed = set(sys.stdlib_module_names) | {"__future__", "inenv"} | LIBRARIES_UNDER_TEST
    bad = []
    for name, path in src.items():
        if name.split(".")[0] != "inenv":
            continue
        for mod in sorted(imports(path, name, set(src))):
            if mod.split(".")[0] not in allowed:
                bad.append(f"{name} -> {mod}")
    assert bad == []


def test_every_folder_holds_fewer_than_25_modules() -> None:
    folders: dict[Path, int] = {}
    for path in sources().values():
        folders[path.parent] = folders.get(path.parent, 0) + 1
    assert {str(f.relative_to(ROOT)): n for f, n in folders.items() if n >= MAX_MODULES} == {}


def test_the_graph_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The reader finds an import in a function body and a `from pkg import module` form."""
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from checks.run import plan\n    import common.cellid\n")
    found = imports(mod, "checks.x", {"checks.run.plan"})
    assert {"checks.run.plan", "common.cellid"} <= found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]


def test_containers_get_every_package_the_in_environment_side_imports() -> None:
    """The docker executor mounts inenv/ read-only, and inenv imports no other package of this checkout."""
    from checks.run.container import MOUNT_ROOT, DockerExecutor

    volumes = DockerExecutor(image="stackprobe/x:1")._config(["true"])["volumes"]
    mounted = {Path(host).name for host, spec in volumes.items()
               if spec["mode"] == "ro" and spec["bind"] == f"{MOUNT_ROOT}/{Path(host).name}"}
    edges = graph()
    needed = {dep.split(".")[0] for mod, deps in edges.items() if mod.split(".")[0] == "inenv" for dep in deps}
    assert needed == {"inenv"} and needed <= mounted


def unexplained_function_imports(path: Path) -> list[int]:
    """Lines of ``path`` where a function imports a project module (or a relative one) with no comment
    starting with ``# lazy:`` on that line or on a comment line right above it."""
    text = path.read_text()
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT}
    lines = text.splitlines()
    bad: set[int] = set()
    for fn in ast.walk(ast.parse(text)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." if node.level else node.module or ""]
            else:
                continue
            if not any(n == "." or n.split(".")[0] in PACKAGES for n in names):
                continue
            above = node.lineno - 1
            own = comments.get(node.lineno, "")
            before = comments.get(above, "") if above >= 1 and lines[above - 1].lstrip().startswith("#") else ""
            if not (own.startswith(LAZY_MARK) or before.startswith(LAZY_MARK)):
                bad.add(node.lineno)
    return sorted(bad)


def test_host_side_imports_project_modules_at_module_top_unless_a_lazy_comment_says_why() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line}" for name, path in sources().items()
           if name.split(".")[0] in HOST_SIDE for line in unexplained_function_imports(path)]
    assert bad == [], ("project imports inside functions without a `# lazy: <what importing it at the top costs, "
                       "measured>` comment (move them to the module top): " + ", ".join(bad))


def test_the_lazy_import_check_sees_an_unexplained_import(tmp_path: Path) -> None:
    """An import of a project module in a function fails the check unless a `# lazy:` comment sits on its line
    or the comment line above; a standard-library or third-party import, a module-level one, another comment
    and a code line in between do not count."""
    mod = tmp_path / "m.py"
    mod.write_text(
        "import checks.cli\n"
        "def f():\n"
        "    import json\n"
        "    import rich\n"
        "    from common import cellid\n"                                   # 5: bad
        "    # lazy: provision.doctor costs 20 ms at start\n"
        "    from provision import doctor\n"                                # 7: ok (line above)
        "    from checks.share import exchange  # lazy: 17 ms at start\n"   # 8: ok (own line)
        "    x = '# lazy: not a comment'\n"
        "    from inenv import atomic\n"                                    # 10: bad (code line above)
        "    # a comment that gives no reason\n"
        "    from . import sibling\n"                                       # 12: bad (relative)
        "    async def g():\n"
        "        from checks.report import diff\n"                          # 14: bad (nested)
    )
    assert unexplained_function_imports(mod) == [5, 10, 12, 14]


OUTSIDE_INENV = ("common", "provision", "checks", "benchmarks", "tools")
_KIT_PRIVATE = "inenv.kit._"


def private_kit_uses(path: Path) -> list[str]:
    """Where ``path`` imports a private helper of the probe kit (``inenv.kit._x``, ``from inenv.kit import _x``,
    anywhere in the file) or names one as code to run in a string (``"inenv.kit._x"``, ``"from inenv.kit._x
    import y"``): one ``line: what`` each."""
    out: dict[int, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip()  # a module to run, or one line of code; prose (a docstring) is neither
            code = text.startswith(_KIT_PRIVATE) and " " not in text or "import" in text and "\n" not in text
            names = [text] if code else []
        else:
            continue
        out.update((node.lineno, n) for n in names if _KIT_PRIVATE in n)
    return [f"{line}: {what}" for line, what in sorted(out.items())]


def test_nothing_outside_inenv_reaches_a_private_helper_of_the_probe_kit() -> None:
    """The host side and the benchmarks use the kit through its public face (inenv/kit/__init__.py): its names
    and its ``launch`` entries."""
    bad = [f"{p.relative_to(ROOT)}:{use}" for top in OUTSIDE_INENV for p in sorted((ROOT / top).rglob("*.py"))
           if "__pycache__" not in p.parts for use in private_kit_uses(p)]
    assert bad == []


def test_the_private_kit_check_sees_each_form(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text(
        '"""A docstring naming inenv.kit._elf is prose."""\n'
        "from inenv import kit\n"
        "from inenv.kit import _elf\n"                                          # 3
        "import inenv.kit._fatbin\n"                                            # 4
        "def f():\n"
        "    from inenv.kit._carried import kernel_set\n"                       # 6
        "    cmd = ['python', '-m', 'inenv.kit._fi_carry']\n"                   # 7
        "    code = \"from inenv.kit._carried import aot_dir; print(aot_dir())\"\n"  # 8
        "    return kit.runs_on, kit.launch('fi-carry')\n")
    assert [u.split(":")[0] for u in private_kit_uses(mod)] == ["3", "4", "6", "7", "8"]


def test_the_kit_public_names_and_entries_resolve() -> None:
    """Every name the kit's public face offers is there in its helper, and every launch entry names a helper
    module that exists: a rename in a helper fails here, not on a host."""
    import inenv.kit as kit

    for name in kit.PUBLIC:
        assert getattr(kit, name) is not None, name
    for entry, args in kit.ENTRIES.items():
        flag, what = args
        module = what if flag == "-m" else what.split()[1]
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), entry
        assert kit.launch(entry, "x")[-1] == "x"
