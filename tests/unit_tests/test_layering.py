"""config/ is the bottom layer: its modules import nothing else from torchtitan, and they
import one another without a cycle. Read from the source (every import statement, including
those inside functions), so no module is executed."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.launcher import REPO_ROOT

CONFIG = REPO_ROOT / "torchtitan" / "config"
# Entry points and re-exports that are not part of the layer:
# __main__.py dispatches `python -m torchtitan.config --world-size N` (run_train.sh) to
# torchtitan.preflight; preflight.py re-exports it for scripts/generate/test_generate.py
# until that script imports torchtitan.preflight.
NOT_IN_LAYER = {"__main__.py", "preflight.py"}


def torchtitan_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] == "torchtitan"}


def config_graph() -> dict[str, set[str]]:
    return {
        f"torchtitan.config.{path.stem}".removesuffix(".__init__"): torchtitan_imports(path)
        for path in sorted(CONFIG.glob("*.py")) if path.name not in NOT_IN_LAYER
    }


def test_config_imports_nothing_above_it() -> None:
    upward = {module: sorted(n for n in names if not n.startswith("torchtitan.config"))
              for module, names in config_graph().items()}
    assert {m: names for m, names in upward.items() if names} == {}


def test_config_modules_import_one_another_without_a_cycle() -> None:
    graph = config_graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for name in sorted(graph.get(module, ())):
            if state.get(name) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path + [name]))
            if name in graph and name not in state:
                visit(name, path + [name])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
