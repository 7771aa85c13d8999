"""Importers: turn model files the engine cannot load directly into HF checkpoint directories.

`gguf_to_hf` converts a GGUF file (dense llama/qwen2/qwen3 into glm4_moe with experts cut
from each MLP; qwen3moe into qwen3_moe). See README.md in this directory.
"""

from tiermoe.importers.gguf import gguf_to_hf

__all__ = ["gguf_to_hf"]
