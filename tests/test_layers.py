"""The floors of `deployments/` hold: every import runs down a floor, never up (docs/architecture.md).

Each module's imports are read with `ast`, so nothing is imported or run: an import inside a
function or under `TYPE_CHECKING` counts as much as one at the top. A module stands on the floor
of its folder (`api/`) or, directly under `deployments/`, of its own file (`app.py`).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deployments"
DOC = ROOT / "docs" / "architecture.md"

# Bottom to top; a module may import its own floor's and the floors below it, nothing above.
FLOORS: tuple[str, ...] = (
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
)


def _unit(first: str) -> str | None:
    """The floor name of `deployments.<first>`: a folder, a module file, or None (not a module)."""
    if (PACKAGE / first).is_dir():
        return f"{first}/"
    if (PACKAGE / f"{first}.py").is_file():
        return f"{first}.py"
    return None


def _targets(node: ast.Import | ast.ImportFrom, module: list[str], is_package: bool) -> list[str]:
    """The `deployments.*` modules an import statement names, as dotted names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolved against the importing module's package
        package = module if is_package else module[:-1]
        base = package[: len(package) - (node.level - 1)]
        named = ".".join([*base, *([node.module] if node.module else [])])
    else:
        named = node.module or ""
    if named == "deployments":  # `from deployments import app, config`
        return [f"deployments.{alias.name}" for alias in node.names]
    return [named]


@cache
def imports() -> tuple[tuple[str, int, str, str], ...]:
    """(importing file, line, its floor, the imported floor) for every import between floors."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel == Path("__init__.py"):
            continue  # the package's own docstring
        source = _unit(rel.parts[0].removesuffix(".py"))
        module = ["deployments", *rel.with_suffix("").parts]
        is_package = module[-1] == "__init__"
        if is_package:
            module = module[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _targets(node, module, is_package):
                parts = name.split(".")
                if parts[0] != "deployments" or len(parts) < 2:
                    continue
                target = _unit(parts[1])
                if target is not None and target != source:
                    out.append((str(path.relative_to(ROOT)), node.lineno, source, target))
    return tuple(out)


def test_every_module_stands_on_a_floor() -> None:
    units = {_unit(p.relative_to(PACKAGE).parts[0].removesuffix(".py")) for p in PACKAGE.glob("*")}
    units.discard(None)
    units -= {"__init__.py", "default_store/"}  # the package's docstring; adapter files, no code
    missing = sorted(units - set(FLOORS))
    assert not missing, f"give {missing} a floor in FLOORS and docs/architecture.md"
    assert imports(), "no import between floors was read: the scan is broken"


def test_no_import_runs_up_a_floor() -> None:
    up = [
        f"{file}:{line}: {source} imports {target} (floor {FLOORS.index(target) + 1} > "
        f"{FLOORS.index(source) + 1})"
        for file, line, source, target in imports()
        if FLOORS.index(target) > FLOORS.index(source)
    ]
    assert not up, "imports that run up a floor:\n" + "\n".join(up)


def test_no_two_floors_import_each_other() -> None:
    pairs = {(source, target) for _, _, source, target in imports()}
    both = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
    assert not both, f"floors importing each other: {both}"


def test_the_documented_floors_are_these() -> None:
    """docs/architecture.md draws the floors top to bottom; they must be FLOORS, reversed."""
    block = DOC.read_text().split("```text\n", 1)[1].split("```", 1)[0]
    drawn = [
        m.group(1)
        for line in block.splitlines()
        if (m := re.match(r"^(?:top|bottom|\s*\|)?\s+([a-z_]+/|[a-z_]+\.py)\s", line))
    ]
    assert drawn == list(reversed(FLOORS))
