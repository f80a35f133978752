"""The package's rooms form layers that only point down: a module imports nothing from a
room above its own or beside it, and modules never import one another in a cycle. Read
from the source (every import statement, including those inside functions and under
TYPE_CHECKING), so no module is executed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT

PACKAGE = REPO_ROOT / "torchtitan"

ROOMS: list[tuple[str, ...]] = [
    ("config",),
    ("tools",),
    ("layers",),
    ("distributed",),
    ("protocols",),
    ("data",),
    ("components",),
    ("models",),
    ("recipe",),
    ("preflight",),
    ("estimate", "generation"),
    ("train",),
]
"""Lowest first; the README's Layout section lists the same order. Rooms on one line are
peers: neither imports the other."""

SUBROOMS: dict[str, list[tuple[str, ...]]] = {
    "torchtitan.components": [
        ("adapters",),
        ("optimizers", "metrics", "quantization", "rank_timeline", "rewards"),
        ("checkpointing", "training_loss", "preference_loss", "policy_loss", "validate"),
    ],
    "torchtitan.components.checkpointing": [
        ("safe_loading", "mxfp4"),
        ("folders", "huggingface"),
        ("load_choice", "peft"),
        ("manager",),
    ],
    "torchtitan.distributed.context_parallel": [
        ("layout", "collectives"),
        ("attention", "delta_rule"),
    ],
}
"""The same rule inside the packages that group several concerns: each module or
subpackage at a level, lowest first, peers on one line."""

LAZY_EXCEPTIONS = {("torchtitan.protocols.train_spec", "torchtitan.models")}
"""The train-spec registry imports the built-in models on first use (inside a function)."""


def torchtitan_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] == "torchtitan"}


def import_graph(root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """Module -> the torchtitan modules it imports (``from torchtitan.x import y`` counts
    as importing ``torchtitan.x.y`` when that is a module, else ``torchtitan.x``)."""
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted((root / "torchtitan").rglob("*.py"))
    }
    graph = {}
    for name, path in modules.items():
        imported = {n if n in modules else n.rsplit(".", 1)[0] for n in torchtitan_imports(path)}
        graph[name] = {n for n in imported if n in modules and n != name}
    return graph


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def level_of(room: str) -> int:
    for level, rooms in enumerate(ROOMS):
        if room in rooms:
            return level
    raise AssertionError(
        f"room {room!r} is not in ROOMS: add it at its level (and to the README's Layout)"
    )


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, names in sorted(graph.items()):
        room = room_of(module)
        for name in sorted(names):
            other = room_of(name)
            if (
                other == room
                or room == "torchtitan"
                or (module, room_of_package(name)) in LAZY_EXCEPTIONS
            ):
                continue
            if level_of(other) >= level_of(room):
                found.append(f"{module} ({room}) imports {name} ({other})")
    return found


def subroom_upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Within each package of SUBROOMS: a module that imports a sibling at its own level
    or above (its siblings being the package's direct modules and subpackages)."""
    found = []
    for package, levels in SUBROOMS.items():
        level = {name: i for i, peers in enumerate(levels) for name in peers}

        def child(module: str, package: str = package) -> str | None:
            if not module.startswith(package + "."):
                return None
            return module[len(package) + 1 :].split(".")[0]

        for module, names in sorted(graph.items()):
            here = child(module)
            if here is None:
                continue
            for name in sorted(names):
                there = child(name)
                if there is None or there == here:
                    continue
                for part in (here, there):
                    assert part in level, f"{package}.{part} is not in SUBROOMS: give it a level"
                if level[there] >= level[here]:
                    found.append(f"{module} imports {name}: {there} is not below {here}")
    return found


def private_imports(root: Path = REPO_ROOT) -> list[str]:
    """``from torchtitan.x import _name``: a module reaching into another's private names."""
    found = []
    for path in sorted((root / "torchtitan").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtitan"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        where = path.relative_to(root)
                        found.append(f"{where} imports {node.module}.{alias.name}")
    return found


def room_of_package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, str] = {}
    found: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for name in sorted(graph.get(module, ())):
            if (module, room_of_package(name)) in LAZY_EXCEPTIONS:
                continue
            if state.get(name) == "open":
                found.append(" -> ".join(path[path.index(name) :] + [name]))
            elif name not in state:
                visit(name, path + [name])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_every_room_has_a_level() -> None:
    rooms = {room_of(m) for m in import_graph()} - {"torchtitan"}
    for room in sorted(rooms):
        level_of(room)


def test_no_module_imports_a_room_above_or_beside_its_own() -> None:
    assert upward_imports(import_graph()) == []


def test_inside_a_package_modules_import_only_lower_levels() -> None:
    assert subroom_upward_imports(import_graph()) == []


def test_no_module_imports_private_names_of_another() -> None:
    assert private_imports() == []


def test_modules_import_one_another_without_a_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_readme_lists_the_rooms_in_this_order() -> None:
    layout = (REPO_ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 1)[0]
    order = " < ".join(" | ".join(peers) for peers in ROOMS)
    assert f"`{order}`" in " ".join(layout.split())


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("components/optimizers/builder.py", "from torchtitan.models.llama3 import Transformer"),
        ("layers/moe.py", "from torchtitan.distributed import ParallelDims"),
        ("estimate/report.py", "from torchtitan.generation import generate"),
        ("config/parsing.py", "import torchtitan.tools.logging"),
    ],
)
def test_a_planted_upward_import_is_found(tmp_path: Path, importer: str, imported: str) -> None:
    _copy_package(tmp_path)
    _plant(tmp_path, importer, imported)
    assert upward_imports(import_graph(tmp_path)), f"{importer}: {imported!r} was not reported"


def _copy_package(tmp_path: Path) -> None:
    for path in PACKAGE.rglob("*.py"):
        copy = tmp_path / path.relative_to(REPO_ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())


def _plant(tmp_path: Path, importer: str, line: str) -> None:
    planted = tmp_path / "torchtitan" / importer
    planted.write_text(planted.read_text() + f"\n{line}\n")


@pytest.mark.parametrize(
    "importer, imported",
    [
        (
            "distributed/context_parallel/layout.py",
            "from torchtitan.distributed.context_parallel.attention import apply_cp",
        ),
        (
            "distributed/context_parallel/delta_rule.py",
            "from torchtitan.distributed.context_parallel.attention import check_cp_config",
        ),
        ("components/adapters/lora.py", "from torchtitan.components.checkpointing import manager"),
        (
            "components/checkpointing/folders.py",
            "from torchtitan.components.checkpointing.manager import CheckpointManager",
        ),
    ],
)
def test_a_planted_import_upward_inside_a_package_is_found(
    tmp_path: Path, importer: str, imported: str
) -> None:
    _copy_package(tmp_path)
    _plant(tmp_path, importer, imported)
    assert subroom_upward_imports(import_graph(tmp_path)), f"{importer}: {imported!r} not reported"


def test_a_planted_private_name_import_across_cp_modules_is_found(tmp_path: Path) -> None:
    _copy_package(tmp_path)
    _plant(
        tmp_path,
        "distributed/context_parallel/delta_rule.py",
        "from torchtitan.distributed.context_parallel.attention import _ring_forward",
    )
    assert private_imports(tmp_path) == [
        "torchtitan/distributed/context_parallel/delta_rule.py imports "
        "torchtitan.distributed.context_parallel.attention._ring_forward"
    ]


def test_a_planted_cycle_is_found() -> None:
    graph = import_graph()
    graph["torchtitan.tools.logging"] = graph["torchtitan.tools.logging"] | {
        "torchtitan.tools.peaks"
    }
    graph["torchtitan.tools.peaks"] = graph["torchtitan.tools.peaks"] | {"torchtitan.tools.logging"}
    assert cycles(graph)


def test_no_function_is_longer_than_80_lines() -> None:
    """Long functions are where a reader loses the thread; split one that grows past 80."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.end_lineno - node.lineno + 1 > 80:
                    long.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}")
    assert long == []
