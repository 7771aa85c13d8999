"""Importers: turn model files the engine cannot load directly into HF checkpoint directories.

`gguf_to_hf` converts a GGUF file (dense llama/qwen2/qwen3 into glm4_moe with experts cut
from each MLP; qwen3moe into qwen3_moe). See README.md in this directory. Importing this
package is cheap (torch and gguf load on first conversion), so callers that only check a cache
pay nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Recorded in every converted directory (tiermoe_import.json); bump when output files change.
CONVERTER_VERSION = 2  # 2: generation_config.json carries sampling defaults (general.sampling.*)

if TYPE_CHECKING:
    from tiermoe.importers.gguf import gguf_to_hf

__all__ = ["CONVERTER_VERSION", "gguf_to_hf"]


def __getattr__(name: str):
    if name == "gguf_to_hf":
        from tiermoe.importers.gguf import gguf_to_hf

        return gguf_to_hf
    raise AttributeError(name)
