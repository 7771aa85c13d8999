"""Every module of tiermoe.kernels serves the product, and kernel imports run one way.

A kernel module that only a benchmark uses is a second assembly of the product's path that
can drift from it unseen; benchmarks build on the product's own modules instead (benchmarks/).
Checked on the source (imports read with ast), so nothing here needs Triton.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
KERNELS = SRC / "tiermoe" / "kernels"


def _module(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Modules `path` imports, at any depth of the file (lazy imports included).

    `from a.b import c` counts as importing a.b and a.b.c (c may be a module or a name in a.b).
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_every_kernel_module_has_a_user_in_the_product():
    kernels = {_module(p): p for p in KERNELS.rglob("*.py") if p.name != "__init__.py"}
    product = [p for p in (SRC / "tiermoe").rglob("*.py") if KERNELS not in p.parents]
    used = set().union(*(_imports(p) for p in product))
    reached = {m for m in kernels if m in used}
    while True:  # kernel modules that a used kernel module imports (moe_gemv through fused_moe)
        more = {m for m in kernels if m not in reached and any(m in _imports(kernels[u]) for u in reached)}
        if not more:
            break
        reached |= more
    assert sorted(set(kernels) - reached) == []


def test_moe_kernel_imports_run_one_way():
    """fused_moe.py (the entry point) may import moe_gemv.py; neither imports the other's
    internals the other way round: shared helpers live in triton/common.py."""
    gemv = _imports(KERNELS / "triton" / "moe_gemv.py")
    assert not any(m.startswith("tiermoe.kernels.triton.fused_moe") for m in gemv)
    for name in ("fused_moe.py", "moe_gemv.py"):
        assert "tiermoe.kernels.triton.common" in _imports(KERNELS / "triton" / name), name


def test_kernels_import_no_other_tiermoe_package():
    for path in KERNELS.rglob("*.py"):
        outside = {m for m in _imports(path) if m.startswith("tiermoe.") and not m.startswith("tiermoe.kernels")}
        assert outside == set(), path
