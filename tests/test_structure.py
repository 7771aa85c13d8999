"""Structure rules of the source tree, read from the files themselves (nothing is imported).

Each rule is one test over the parsed sources (`package_files()`), so a further rule, such as a
limit on line length or file size, is one more function beside them.

Layering: the top-level units of `tiermoe` (subpackages such as `engine/`, modules such as
`protocol.py`) import one another in one direction only, following the data flow in
docs/architecture.md. Two units in a cycle cannot be read, tested or replaced one without the
other, so every `import tiermoe.X` and `from tiermoe.X import ...` counts, including imports
inside functions: a lazy import defers the cost, not the dependency. The `tiermoe` command's
table of subcommand modules (cli.py) holds module names as strings: the command sits above
every unit, so that table is no edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tiermoe"

# Edges that still close a cycle because the code on one side belongs to work in progress
# elsewhere: (importing unit, imported unit) -> why the edge is tolerated. An entry whose
# imports are gone fails test_allowed_edges_are_still_needed, so this list only shrinks.
ALLOWED_EDGES: dict[tuple[str, str], str] = {}

Graph = dict[str, dict[str, list[str]]]  # importing unit -> imported unit -> ["file.py:line", ...]


def package_files() -> list[Path]:
    """Every Python source file of the package, sorted so that messages are stable."""
    return sorted(PACKAGE.rglob("*.py"))


def top_level_units() -> set[str]:
    """Names of the package's subpackages and top-level modules (`engine`, `protocol`, ...)."""
    units = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    return units | {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def imported_modules(source: str, package: str) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of every import in `source`, at any depth.

    `package` is the dotted package holding the file, against which relative imports resolve.
    For `from M import a` the name is `M.a`: `a` may be a module (`from tiermoe import engine`).
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return sorted(found, key=lambda item: item[1])


def import_graph() -> Graph:
    """Edges between distinct top-level units, each with the places that create it."""
    units = top_level_units()
    graph: Graph = {}
    for path in package_files():
        relative = path.relative_to(PACKAGE)
        unit = relative.parts[0].removesuffix(".py")
        package = ".".join(["tiermoe", *relative.parent.parts])
        for module, line in imported_modules(path.read_text(encoding="utf-8"), package):
            parts = module.split(".")
            if len(parts) > 1 and parts[0] == "tiermoe" and parts[1] in units and parts[1] != unit:
                places = graph.setdefault(unit, {}).setdefault(parts[1], [])
                if f"{relative}:{line}" not in places:
                    places.append(f"{relative}:{line}")
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """Groups of units that all reach one another (Tarjan's strongly connected components of
    two or more units): each group holds at least one import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for target in graph.get(unit, {}):
            if target not in index:
                visit(target)
                low[unit] = min(low[unit], low[target])
            elif target in stack:
                low[unit] = min(low[unit], index[target])
        if low[unit] == index[unit]:
            group = []
            while not group or group[-1] != unit:
                group.append(stack.pop())
            groups.append(sorted(group))

    for unit in sorted(graph):
        if unit not in index:
            visit(unit)
    return [group for group in groups if len(group) > 1]


def without_allowed_edges(graph: Graph) -> Graph:
    return {source: {target: places for target, places in targets.items() if (source, target) not in ALLOWED_EDGES}
            for source, targets in graph.items()}


def test_no_import_cycle_between_top_level_units():
    graph = without_allowed_edges(import_graph())
    found = cycles(graph)
    edges = [f"{source} -> {target}: {', '.join(graph[source][target])}"
             for group in found for source in group for target in group if target in graph.get(source, {})]
    assert not found, "import cycles between top-level units of tiermoe:\n" + "\n".join(edges)


def test_kernels_import_nothing_else_from_the_package():
    """Kernels sit at the bottom: a kernel and its torch twin are testable on their own."""
    assert import_graph().get("kernels", {}) == {}


def test_allowed_edges_are_still_needed():
    graph = import_graph()
    gone = [edge for edge in ALLOWED_EDGES if edge[1] not in graph.get(edge[0], {})]
    assert not gone, f"these ALLOWED_EDGES entries have no import left; remove them: {gone}"


def test_reader_sees_relative_and_function_level_imports():
    """The rules above are only as good as the reader: check it on a known text."""
    source = "import tiermoe.store.sim\nfrom ..moe import experts\n\ndef f():\n    from tiermoe.kernels import x\n"
    assert imported_modules(source, "tiermoe.models.blocks") == [
        ("tiermoe.store.sim", 1), ("tiermoe.models.moe.experts", 2), ("tiermoe.kernels.x", 5)]


def test_cycle_finder_on_a_known_graph():
    graph = {"a": {"b": ["a.py:1"]}, "b": {"c": ["b.py:1"]}, "c": {"a": ["c.py:1"]}, "d": {"a": ["d.py:1"]}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b": []}, "b": {}}) == []


MAX_FILE_LINES = 500
MAX_LINE_COLUMNS = 120
BENCHMARKS = PACKAGE.parents[1] / "benchmarks"


def source_files() -> list[Path]:
    """The product package and the benchmarks package beside it."""
    return package_files() + sorted(BENCHMARKS.rglob("*.py"))


def test_no_file_over_500_lines():
    """Small files: a module past this size holds more than one idea and is split."""
    long = [f"{p}: {n} lines" for p in source_files() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, long


def test_no_line_over_120_columns_and_no_format_escape():
    """Lines fit a side-by-side review; `fmt: skip` markers were how long lines got past that before."""
    bad = []
    for p in source_files():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if len(line) > MAX_LINE_COLUMNS or "fmt: skip" in line:
                bad.append(f"{p}:{i}")
    assert not bad, bad


def family_modules() -> set[str]:
    """Dotted names of the model families: subpackages of `models/` other than `blocks/`, and the
    `models/*.py` modules that define a family entry point (`def build_spec`)."""
    models = PACKAGE / "models"
    found = {f"tiermoe.models.{p.name}" for p in models.iterdir()
             if (p / "__init__.py").is_file() and p.name != "blocks"}
    for path in models.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.FunctionDef) and node.name == "build_spec" for node in tree.body):
            found.add(f"tiermoe.models.{path.stem}")
    return found


def test_blocks_import_no_model_family():
    """Shared blocks sit below the families that build from them (a block takes plain sizes, not a
    family's config class), so a further family reuses a block without pulling in another one."""
    families = family_modules()
    assert "tiermoe.models.glm5_next" in families
    bad = []
    for path in sorted((PACKAGE / "models" / "blocks").rglob("*.py")):
        for module, line in imported_modules(path.read_text(encoding="utf-8"), "tiermoe.models.blocks"):
            if any(module == f or module.startswith(f + ".") for f in families):
                bad.append(f"{path.relative_to(PACKAGE)}:{line}: {module}")
    assert not bad, bad
