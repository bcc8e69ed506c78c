"""The architecture, checked: imports only point down the layer stack, and the runtime
stays small enough to read (a line budget, as tinygrad keeps one)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bottom to top; a module may import its own layer and the layers below it
LAYERS = ["runtime", "ops", "comm", "scheduler", "graphs", "megaloom"]
RUNTIME_LINE_BUDGET = 2600


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


def test_runtime_line_budget():
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (ROOT / "runtime").rglob("*.py"))
    assert lines <= RUNTIME_LINE_BUDGET, f"runtime/ has {lines} lines, budget {RUNTIME_LINE_BUDGET}"
