"""Helpers family files share: reading config fields with clear errors."""

from __future__ import annotations

from tiermoe.errors import UserError


class ConfigReader:
    """Reads fields of a transformers config; every failure names config.json and the field."""

    def __init__(self, hf_config, path: str):
        self.c, self.path = hf_config, path

    def get(self, name: str, default=None):
        return getattr(self.c, name, default)

    def require(self, name: str):
        value = getattr(self.c, name, None)
        if value is None:
            raise UserError(f"{self.path}: missing required field '{name}'")
        return value

    def unsupported(self, name: str, why: str) -> UserError:
        return UserError(f"{self.path}: field '{name}' = {getattr(self.c, name, None)!r} is not supported ({why})")

    def rope_type(self) -> str:
        params = getattr(self.c, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in ("dynamic", "longrope"):
            raise UserError(f"{self.path}: field 'rope_parameters.rope_type' = {rope_type!r} is not supported")
        return rope_type

    def eos_ids(self) -> tuple[int, ...]:
        eos = getattr(self.c, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
