"""tiermoe.store: where each routed expert lives and how it reaches the compute.

Public entry points (imported lazily so `tiermoe --help` does not load torch):
    ExpertStore     facade.ExpertStore, the MoE layer's only door into the store
    pack            pack.pack, checkpoint -> store
    verify_store    verify.verify_store
    build_plan      planner.build_plan, the tier plan table
See README.md in this directory.
"""

from __future__ import annotations

_EXPORTS = {
    "ExpertStore": ("tiermoe.store.facade", "ExpertStore"),
    "pack": ("tiermoe.store.pack", "pack"),
    "verify_store": ("tiermoe.store.verify", "verify_store"),
    "build_plan": ("tiermoe.store.planner", "build_plan"),
    "load_manifest": ("tiermoe.store.records", "load_manifest"),
    "StoreIOError": ("tiermoe.store.disk", "StoreIOError"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        mod, attr = _EXPORTS[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'tiermoe.store' has no attribute {name!r}")
