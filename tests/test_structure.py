"""The package's imports point one way: no cycles between modules, none between the folders at any level,
and no module imports a package that holds it (its ``__init__`` re-exports would pull the caller back in)."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules() -> dict[str, pathlib.Path]:
    files = [p for d in ("autofit", "strategies") for p in sorted((ROOT / d).rglob("*.py"))]
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth of the file (lazy imports in functions too)."""
    edges = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    assert _cycles(_imports(_modules())) == []


def test_no_import_cycles_between_folders_at_any_level():
    """Inside every package, its children (sub-packages and modules) import one another one way only:
    e.g. planning/'s memory, speed, search and verify never import each other in a circle."""
    edges = _imports(_modules())
    by_parent: dict[str, dict[str, set[str]]] = {}
    for source, targets in edges.items():
        for target in targets:
            a, b = source.split("."), target.split(".")
            depth = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if depth is None or depth == 0:  # an ancestor (checked below), or across the two top packages
                continue
            children = by_parent.setdefault(".".join(a[:depth]), {})
            children.setdefault(a[depth], set()).add(b[depth])
    assert {parent: cycles for parent, children in by_parent.items() if (cycles := _cycles(children))} == {}


def test_no_module_imports_a_package_that_holds_it():
    upward = [
        f"{source} -> {target}"
        for source, targets in _imports(_modules()).items()
        for target in targets
        if source.startswith(target + ".")
    ]
    assert upward == []


def test_planning_is_housed_by_concern():
    planning = ROOT / "autofit" / "planning"
    rooms = {p.name for p in planning.iterdir() if (p / "__init__.py").exists()}
    assert {"memory", "speed", "search", "verify"} <= rooms


def test_no_test_module_imports_another():
    """Shared helpers live in tests/helpers or conftest: importing a test module runs its collection-time code twice
    and ties the two modules' fixtures together."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            imported = [name for name in names if name.startswith("tests.")]
            found += [f"{path.relative_to(ROOT)}: {n}" for n in imported if n.rpartition(".")[2].startswith("test_") or n == "tests.conftest"]
    assert found == []


def test_no_module_imports_a_private_name_of_another():
    """A ``_name`` is its module's own: others go through its public names (torch's private API only through
    ``autofit._torch_private``, whose own names are public)."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules and node.module != name:
                found += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_no_test_imports_a_private_name():
    """Tests read the code through the names its modules offer (#51): a test of a private helper ties the test to how
    the module is cut, not to what it does."""
    modules = _modules()
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


MAX_FUNCTION_LINES = 80
ONE_ORDERED_STORY = {"autofit.apply.apply_config", "autofit.training.loop._train_epochs"}
"""The two functions allowed to be longer: each reads top to bottom as one ordered story (the strategies applied in
their order; the training loop), and their docstrings say so."""


def _function_lengths() -> dict[str, int]:
    """Every function and method of autofit/ and strategies/ (not those nested in a function: they count within
    it) -> its lines from its ``def`` to its last line."""
    lengths = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{prefix}.{child.name}"] = child.end_lineno - child.lineno + 1
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            else:
                visit(child, prefix)

    for name, path in _modules().items():
        visit(ast.parse(path.read_text()), name)
    return lengths


def test_no_function_is_over_80_lines():
    """A function a reader takes in at once; a longer one is split by meaning into named pieces (and typed records)."""
    lengths = _function_lengths()
    over = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES and name not in ONE_ORDERED_STORY}
    assert over == {}


def test_the_long_functions_say_why_they_stay_one_story():
    for name in ONE_ORDERED_STORY:
        module, _, function = name.rpartition(".")
        tree = ast.parse(_modules()[module].read_text())
        node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
        assert "one ordered story" in " ".join((ast.get_docstring(node) or "").split()), name


def test_the_package_s_lazy_exports_are_what_type_checkers_see():
    """``autofit/__init__`` imports its exports on first use; its TYPE_CHECKING block names the same ones, so that an
    editor completes ``autofit.`` and a type checker knows what each is."""
    import importlib
    import inspect

    import autofit

    tree = ast.parse((ROOT / "autofit" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {alias.asname or alias.name: (node.module, alias.name) for node in block.body for alias in node.names}
    assert sorted(seen) == autofit.__all__
    for name, (module, original) in seen.items():
        assert inspect.unwrap(getattr(autofit, name)) is getattr(importlib.import_module(module), original), name
