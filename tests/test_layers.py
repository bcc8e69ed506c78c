"""The architecture, checked: imports only point down the layer stack, and each layer
stays small enough to read (a budget of code lines per layer, as tinygrad keeps one)."""
import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# bottom to top; a module may import its own layer and the layers below it
LAYERS = ["runtime", "ops", "comm", "scheduler", "graphs", "megaloom"]
# code lines per layer: docstrings, comments and blank lines are free (never golf them away)
LINE_BUDGETS = {"runtime": 2816, "ops": 2199, "comm": 1235, "scheduler": 2682, "graphs": 2425, "megaloom": 3190}
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
             tokenize.ENDMARKER}


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "megaloom" and parts[1] in LAYERS[:-1] else "megaloom"


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def test_imports_point_down_the_layer_stack():
    bad = []
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            for line, module in _imports(path):
                if module.split(".")[0] in LAYERS[:-1]:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports bare {module!r}; use megaloom.{module}")
                elif module.startswith("megaloom") and LAYERS.index(_layer_of(module)) > LAYERS.index(layer):
                    bad.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {module} from a layer above")
    assert not bad, "\n".join(bad)


def code_lines(text: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring (a string
    literal standing alone as a statement, as module, class, function and attribute docs do)."""
    docs: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docs.update(range(node.lineno, node.end_lineno + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in _NOT_CODE:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - docs)


def test_code_lines_skip_docstrings_comments_and_blanks():
    text = '''"""Module doc
over two lines."""
import os  # a comment after code counts


# a comment alone
def f(x):
    """Doc."""
    s = """a string value
    spanning lines"""
    return x

X = 1
"""Attribute doc."""
'''
    assert code_lines(text) == 6  # import, def, the two lines of s, return, X


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_line_budget(layer):
    lines = sum(code_lines(p.read_text(encoding="utf-8")) for p in (ROOT / layer).rglob("*.py"))
    assert lines <= LINE_BUDGETS[layer], f"{layer}/ has {lines} code lines, budget {LINE_BUDGETS[layer]}"
