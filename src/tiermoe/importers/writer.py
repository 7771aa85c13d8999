"""Sharded safetensors writer for converted checkpoints.

Converted models can be far larger than RAM (a 30B GGUF dequantises to 60 GB of bf16), so
tensors are streamed into shards of bounded size and only the shard being filled is held in
memory. The layout is the Hugging Face one: `model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json` mapping every key to its shard, which transformers and our own
loader both read. A single-shard checkpoint is still written with an index so readers need
one code path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

DEFAULT_SHARD_BYTES = 2 << 30  # 2 GiB


class ShardWriter:
    """Collect tensors, flush a shard whenever it reaches `shard_bytes`, then write the index.

    Shards are first written under temporary names because their final names contain the
    total count, which is only known at `close()`.
    """

    def __init__(self, out_dir: Path, shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.out_dir = Path(out_dir)
        self.shard_bytes = shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []  # (temporary path, keys)
        self._seen: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ValueError(f"duplicate tensor name {name}")
        self._seen.add(name)
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        """End the current shard now (so the next tensors start a shard of their own)."""
        self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        tmp = self.out_dir / f".shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(tmp), metadata={"format": "pt"})
        self._shards.append((tmp, list(self._pending)))
        self._pending = {}
        self._pending_bytes = 0

    def close(self) -> list[Path]:
        """Flush, give shards their final names, write the index; returns the shard paths."""
        self._flush()
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        final: list[Path] = []
        for i, (tmp, keys) in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tmp.rename(self.out_dir / name)
            final.append(self.out_dir / name)
            for key in keys:
                weight_map[key] = name
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return final
