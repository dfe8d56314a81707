"""The tree of ``jdls/``: each folder imports only the floors below it, and no import circles.

The map is docs/contributing.md ("The tree"). Every import counts, at the top of a module, in
a function (a lazy import) or under ``TYPE_CHECKING``: a circle that only type checkers see is
still a circle for a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jdls

ROOT = Path(jdls.__file__).parent

#: The floors, bottom to top; "" is the top of ``jdls/``: the public faces (``jdls``,
#: ``jdls.linen``, ``jdls.nnx``, ``jdls.equinox``).
FLOORS = [
    "_numerics",
    "_floats",
    "rules",
    "_sites",
    "_scales",
    "_transforms",
    "presets",
    "_frameworks",
    "fp8",
    "",
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The jdls modules ``path`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jdls"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "jdls":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if _is_module(sub) else node.module)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOORS) else ""


def test_the_top_of_the_package_holds_the_faces_and_the_folders() -> None:
    """No private module lies loose at the top: each belongs to a folder. A private folder
    (its name starts with an underscore) holds modules without one; a public folder's
    private modules carry it."""
    loose = sorted(p.name for p in ROOT.glob("_*.py") if p.name != "__init__.py")
    assert loose == []
    doubled = sorted(
        str(p.relative_to(ROOT)) for p in ROOT.glob("_*/_*.py") if p.name != "__init__.py"
    )
    assert doubled == []
    folders = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert folders == sorted(f for f in FLOORS if f)


def test_each_folder_imports_only_the_floors_below() -> None:
    graph = _graph()
    assert "jdls._scales.scale" in graph["jdls._transforms.wrap"]
    upward = sorted(
        f"{module} ({_floor(module) or 'top'}) imports {target} ({_floor(target) or 'top'})"
        for module, targets in graph.items()
        for target in targets
        if FLOORS.index(_floor(target)) > FLOORS.index(_floor(module))
    )
    assert upward == []


def test_no_import_circles() -> None:
    graph = _graph()
    circles: list[str] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []
