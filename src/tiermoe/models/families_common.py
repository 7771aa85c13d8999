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


def sigmoid_noaux_moe(r: ConfigReader):
    """MoESpec of the GLM-4.x / DeepSeek-V3 routed block: sigmoid scores + correction bias
    (noaux_tc), group-limited top-k, routed_scaling_factor, n_shared_experts shared experts."""
    from tiermoe.models.spec import MoESpec

    num_experts = r.require("n_routed_experts")
    n_group = r.get("n_group", 1) or 1
    if num_experts % n_group:
        raise r.unsupported("n_group", "n_routed_experts must be divisible by n_group")
    inter = r.require("moe_intermediate_size")
    return MoESpec(
        num_experts=num_experts,
        top_k=r.require("num_experts_per_tok"),
        intermediate_size=inter,
        scoring="sigmoid_noaux",
        norm_topk_prob=bool(r.get("norm_topk_prob", True)),
        routed_scaling_factor=float(r.get("routed_scaling_factor", 1.0)),
        n_group=n_group,
        topk_group=r.get("topk_group", 1) or 1,
        shared_intermediate_size=inter * (r.get("n_shared_experts", 1) or 0),
    )
