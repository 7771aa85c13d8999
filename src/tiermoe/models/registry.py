"""Architecture string (config.json's model_type) -> family module, imported lazily.

A family module exposes `build_spec(hf_config, path) -> ModelSpec` for the generic decoder,
or `build_model(path, hf_config, ...)` for families with their own structure.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from tiermoe.errors import UserError

FAMILIES: dict[str, str] = {
    "qwen3_moe": "tiermoe.models.qwen3_moe",
    "qwen2_moe": "tiermoe.models.qwen3_moe",
    "olmoe": "tiermoe.models.qwen3_moe",
    "mixtral": "tiermoe.models.qwen3_moe",
    "glm4_moe": "tiermoe.models.glm4_moe",
    "deepseek_v3": "tiermoe.models.deepseek_v3",
    "glm5_next": "tiermoe.models.glm5_next",
}


# Families `tiermoe tiny` can write (torch-free constant so the CLI parser stays light).
TINY_ARCHS = ("qwen3_moe", "glm4_moe", "deepseek_v3", "glm5_next", "qwen2_moe", "olmoe", "mixtral")


def read_config_json(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).exists():
        raise UserError(f"{model_dir}: no such file or directory")
    if not path.is_file():
        raise UserError(f"{path}: not found (a model directory needs config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: expected a JSON object")
    return cfg


def family_module(model_type: str | None, config_path: str):
    if not model_type:
        raise UserError(f"{config_path}: missing field 'model_type'")
    if model_type not in FAMILIES:
        raise UserError(
            f"{config_path}: unsupported architecture '{model_type}' (field 'model_type'); "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return importlib.import_module(FAMILIES[model_type])


def load_hf_config(model_dir: str | Path):
    """Parse config.json with transformers' own config class (defaults, rope parameters)."""
    from transformers import AutoConfig

    cfg = read_config_json(model_dir)
    config_path = str(Path(model_dir) / "config.json")
    family_module(cfg.get("model_type"), config_path)
    try:
        return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for bad fields
        raise UserError(f"{config_path}: invalid config ({str(exc).splitlines()[0]})") from None
