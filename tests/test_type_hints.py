"""Every public function in elastic/ has type hints (issue 25, item 6).

mypy (`make lint`) checks the hints that exist; this test makes sure they exist. Public
means a function or method whose name has no leading underscore, in a class whose name has
none either; ``__init__`` counts, for its parameters. ``self`` and ``cls`` need no hint."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "elastic"

def _public(name):
    return not name.startswith("_") or name == "__init__"


def unhinted(source):
    """Names of the public functions in ``source`` that lack a parameter or return hint."""
    missing = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(node.name):
                a = node.args
                params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
                bare = [p.arg for p in params if p.annotation is None and p.arg not in ("self", "cls")]
                if bare or (node.returns is None and node.name != "__init__"):
                    missing.append(prefix + node.name)
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(source).body, "")
    return missing


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_the_check_finds_a_missing_parameter_or_return_hint():
    source = ("def a(x: int) -> int: ...\n"
              "def b(x) -> int: ...\n"
              "def c(x: int): ...\n"
              "def _private(x): ...\n"
              "class K:\n"
              "    def __init__(self, y): ...\n"
              "    def m(self, *args: int, **kw) -> None: ...\n"
              "    def ok(self) -> None: ...\n"
              "class _Hidden:\n"
              "    def m(self, x): ...\n")
    assert unhinted(source) == ["b", "c", "K.__init__", "K.m"]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_public_function_has_hints(path):
    assert unhinted(path.read_text()) == []
