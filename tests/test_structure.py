"""The package's shape: no import cycles, no reaching into another module's private
names, the worker side never imports the driver, no module over 500 lines of code."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "elastic"
SOURCES = sorted(PACKAGE.rglob("*.py"))
CHECKED = SOURCES + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
WORKER_SIDE = ("elastic.worker", "elastic.state", "elastic.checkpoint", "elastic.training",
               "elastic.launching.worker", "elastic.torch")


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node):
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path):
    """(module, line) for every import that runs (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found += [(a.name, child.lineno) for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.module, child.lineno))
                # `from elastic.worker import runtime` imports a module too
                found += [(f"{child.module}.{a.name}", child.lineno) for a in child.names]
            stack.append(child)
    return found


def _graph():
    names = {module_name(p) for p in SOURCES}
    graph = {}
    for path in SOURCES:
        graph[module_name(path)] = {m for m, _ in imports(path) if m in names} - {module_name(path)}
    return graph


def _packages(graph):
    return {m for m in graph if (ROOT / m.replace(".", "/") / "__init__.py").exists()}


def _cycles(edges):
    """Every cycle the depth-first walk of ``edges`` closes (each as its path)."""
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ re-exporting its parts is not a cycle of logic.
    packages = _packages(graph)
    cycles = _cycles({m: {d for d in deps if d not in packages} for m, deps in graph.items()})
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def package_of(module, packages):
    """The subpackage of elastic a module belongs to (elastic.state.snapshot:
    elastic.state); a top-level module (elastic.protocol) stands for itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module in packages else module


def test_no_import_cycles_between_packages():
    """Packages depend one way: state and checkpoint, say, never import each other,
    even through a module each. (``elastic/__init__.py`` is the public API's list of
    re-exports, above everything.)"""
    graph = _graph()
    packages = _packages(graph)
    edges, why = {}, {}
    for module, deps in graph.items():
        for dep in deps - {"elastic"}:
            a, b = package_of(module, packages), package_of(dep, packages)
            if module != "elastic" and a != b:
                edges.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{module} imports {dep}")
    cycles = _cycles(edges)
    assert not cycles, "package cycles: " + "; ".join(
        " -> ".join(c) + " (" + ", ".join(why[a, b] for a, b in zip(c, c[1:])) + ")"
        for c in cycles)


def test_worker_side_never_imports_the_driver():
    bad = [f"{module_name(p)}:{line} imports {m}" for p in SOURCES
           if module_name(p).startswith(WORKER_SIDE)
           for m, line in imports(p) if m.startswith("elastic.runner")]
    assert not bad, bad


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_names_of_other_modules(path):
    tree = ast.parse(path.read_text(), str(path))
    modules = set()        # local names bound to modules of this project
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("elastic"):
            for alias in node.names:
                if _private(alias.name):
                    bad.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("elastic"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


OUTSIDE = [p for p in CHECKED if not p.is_relative_to(PACKAGE)]


@pytest.mark.parametrize("path", OUTSIDE, ids=lambda p: str(p.relative_to(ROOT)))
def test_tests_and_benchmarks_use_public_attributes(path):
    """Tests and benchmarks drive the package through its public seams: no ``obj._x``."""
    tree = ast.parse(path.read_text(), str(path))
    other_modules = set()   # stdlib and third-party modules may keep their _names (os._exit)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            other_modules.update((a.asname or a.name.split(".")[0]) for a in node.names
                                 if not a.name.startswith("elastic"))
    bad = [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
           if isinstance(node, ast.Attribute) and _private(node.attr)
           and not (isinstance(node.value, ast.Name)
                    and node.value.id in {"self", "cls"} | other_modules)]
    assert not bad, bad


def code_lines(source):
    """Lines that hold code: not blank, not comments, not docstrings. The 500-line rule
    is about how much a module does; the docstrings that say why stay free."""
    tree = ast.parse(source)
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if number not in docs and line.strip() and not line.strip().startswith("#"))


def test_code_lines_leave_out_docstrings_comments_and_blanks():
    source = 'def f():\n    """Why.\n\n    More why."""\n    # a comment\n\n    return 1\n'
    assert code_lines(source) == 2
    assert code_lines('x = """not a docstring\nbut a value"""\n') == 2


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path):
    assert code_lines(path.read_text()) <= 500


# remote.py runs with the standard library only, so it cannot import ElasticError;
# policy._Done ends a tick early inside decide() and never leaves it.
# StopTraining is a SystemExit(0) on purpose: stopping is not an error (issue 10).
OUTSIDE_THE_TREE = {"elastic.runner.remote.SpecError", "elastic.runner.policy._Done",
                    "elastic.exceptions.StopTraining"}


def test_every_error_derives_from_elastic_error():
    from elastic.exceptions import ElasticError
    names = sorted(module_name(p) for p in SOURCES if not module_name(p).endswith("__main__"))
    strays = []
    for name in names:
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if (cls.__module__ == name and issubclass(cls, BaseException)
                    and not issubclass(cls, ElasticError)
                    and f"{name}.{cls_name}" not in OUTSIDE_THE_TREE):
                strays.append(f"{name}.{cls_name}")
    assert not strays, strays


TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"
TEST_FOLDERS = {"support", "workloads", "data"}   # shared helpers, scripts jobs run, inputs


def test_tests_hold_test_modules_and_their_folders_only():
    """A helper among the test files is easy to take for a test and to import under a
    second name: what tests share lives in tests/support/."""
    strays = sorted(p.name for p in TESTS.iterdir()
                    if not p.name.startswith((".", "__pycache__"))
                    and not (p.is_dir() and p.name in TEST_FOLDERS)
                    and not (p.is_file() and p.suffix == ".py"
                             and (p.name == "conftest.py" or p.name.startswith("test_"))))
    assert not strays, f"move these to tests/support/: {strays}"


def test_helpers_are_imported_as_support_modules():
    """One name per helper (``support.jobs``, never ``jobs`` or ``tests.support.jobs``), so a
    helper is loaded once and conftest's patch of ``Job.start`` sees every job."""
    helpers = {p.stem for p in SUPPORT.glob("*.py")} - {"__init__"}
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in OUTSIDE
           for name, line in imports(path)
           if name.split(".")[0] in helpers | {"tests"}]
    assert not bad, bad


def test_nothing_imports_a_test_module():
    """What two test files share is a helper in tests/support/, not one test file imported
    by another (which runs its module-level set-up again and hides where the helper lives)."""
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in OUTSIDE
           for name, line in imports(path)
           if any(part.startswith("test_") for part in name.split(".")[:2])]
    assert not bad, bad


def test_the_ssh_bootstrap_uses_the_standard_library_only():
    """remote.py runs under ``python -I`` on hosts that may lack torch; its copy of the
    contract's names is checked against protocol.py in tests/test_remote.py."""
    modules = {m.split(".")[0] for m, _ in imports(PACKAGE / "runner" / "remote.py")}
    assert not modules & {"elastic", "torch", "numpy", "cloudpickle"}, modules
