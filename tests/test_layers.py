"""The floors of `deployments/` and of `molora_runtime/engine/` hold: every import runs down a floor,
never up (docs/architecture.md; the engine package's docstring).

Each module's imports are read with `ast`, so nothing is imported or run: an import inside a
function or under `TYPE_CHECKING` counts as much as one at the top. A module stands on the floor
of its folder (`api/`) or, directly under the package, of its own file (`app.py`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Layers:
    """A package whose folders and top-level modules stand on floors, listed bottom to top."""

    name: str  # dotted, as imports name it
    floors: tuple[str, ...]  # bottom to top; a module may import its own floor and those below
    doc: Path  # where the floors are drawn, top to bottom, in a ```text block
    no_code: frozenset[str] = frozenset({"__init__.py"})  # entries that hold no floor's modules

    @property
    def root(self) -> Path:
        return ROOT.joinpath(*self.name.split("."))


DEPLOYMENTS = Layers(
    "deployments",
    (
        "protocol/",
        "config.py",
        "catalog/",
        "access/",
        "telemetry/",
        "placement/",
        "replica/",
        "api/",
        "app.py",
        "ops/",
    ),
    ROOT / "docs" / "architecture.md",
    # the package's docstring; adapter files, no code
    frozenset({"__init__.py", "default_store/"}),
)
ENGINE = Layers(
    "molora_runtime.engine",
    (
        "structured/",
        "speculation/",
        "types.py",
        "sampling/",
        "sequence.py",
        "route_stats/",
        "runner/",
        "scheduling/",
        "outputs/",
        "device.py",
        "request_check.py",
        "engine.py",
        "llm.py",
        "async_engine.py",
    ),
    ROOT / "molora_runtime" / "engine" / "__init__.py",
)
PACKAGE = DEPLOYMENTS.root
DOC = DEPLOYMENTS.doc
FLOORS = DEPLOYMENTS.floors
PACKAGES = pytest.mark.parametrize("layers", [DEPLOYMENTS, ENGINE], ids=lambda p: p.name)


def _unit(layers: Layers, first: str) -> str | None:
    """The floor name of `<package>.<first>`: a folder, a module file, or None (not a module)."""
    if first == "__pycache__":
        return None
    if (layers.root / first).is_dir():
        return f"{first}/"
    if (layers.root / f"{first}.py").is_file():
        return f"{first}.py"
    return None


def _targets(
    layers: Layers, node: ast.Import | ast.ImportFrom, module: list[str], is_package: bool
) -> list[str]:
    """The `<package>.*` modules an import statement names, as dotted names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolved against the importing module's package
        package = module if is_package else module[:-1]
        base = package[: len(package) - (node.level - 1)]
        named = ".".join([*base, *([node.module] if node.module else [])])
    else:
        named = node.module or ""
    if named == layers.name:  # `from deployments import app, config`
        return [f"{layers.name}.{alias.name}" for alias in node.names]
    return [named]


@cache
def imports(layers: Layers = DEPLOYMENTS) -> tuple[tuple[str, int, str, str], ...]:
    """(importing file, line, its floor, the imported floor) for every import between floors."""
    out = []
    prefix = layers.name.split(".")
    for path in sorted(layers.root.rglob("*.py")):
        rel = path.relative_to(layers.root)
        if rel == Path("__init__.py"):
            continue  # the package's own docstring
        source = _unit(layers, rel.parts[0].removesuffix(".py"))
        module = [*prefix, *rel.with_suffix("").parts]
        is_package = module[-1] == "__init__"
        if is_package:
            module = module[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _targets(layers, node, module, is_package):
                parts = name.split(".")
                if parts[: len(prefix)] != prefix or len(parts) <= len(prefix):
                    continue
                target = _unit(layers, parts[len(prefix)])
                if target is not None and target != source:
                    out.append((str(path.relative_to(ROOT)), node.lineno, source, target))
    return tuple(out)


@PACKAGES
def test_every_module_stands_on_a_floor(layers: Layers) -> None:
    units = {_unit(layers, p.name.removesuffix(".py")) for p in layers.root.glob("*")}
    units.discard(None)
    units -= layers.no_code
    missing = sorted(units - set(layers.floors))
    assert not missing, f"give {missing} a floor in FLOORS and {layers.doc.relative_to(ROOT)}"
    assert imports(layers), "no import between floors was read: the scan is broken"


@PACKAGES
def test_no_import_runs_up_a_floor(layers: Layers) -> None:
    floors = layers.floors
    up = [
        f"{file}:{line}: {source} imports {target} (floor {floors.index(target) + 1} > "
        f"{floors.index(source) + 1})"
        for file, line, source, target in imports(layers)
        if floors.index(target) > floors.index(source)
    ]
    assert not up, "imports that run up a floor:\n" + "\n".join(up)


@PACKAGES
def test_no_two_floors_import_each_other(layers: Layers) -> None:
    pairs = {(source, target) for _, _, source, target in imports(layers)}
    both = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
    assert not both, f"floors importing each other: {both}"


@PACKAGES
def test_the_documented_floors_are_these(layers: Layers) -> None:
    """The floors are drawn top to bottom (docs/architecture.md, the engine's docstring); they
    must be the floors, reversed."""
    block = layers.doc.read_text().split("```text\n", 1)[1].split("```", 1)[0]
    drawn = [
        m.group(1)
        for line in block.splitlines()
        if (m := re.match(r"^(?:top|bottom|\s*\|)?\s+([a-z_]+/|[a-z_]+\.py)\s", line))
    ]
    assert drawn == list(reversed(layers.floors))
