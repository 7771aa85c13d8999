"""GLM-5.3-Flash (`glm5_next`): KDA + NoPE-MLA/DSA hybrid with mHC, sigmoid MoE and MTP.

Public API: see README.md in this directory.
"""

from .cache import Glm5NextCache, SeqBatch
from .config import Glm5NextConfig, load_config
from .loader import expert_weight_keys, load_model
from .model import Glm5NextModel

__all__ = [
    "Glm5NextCache",
    "Glm5NextConfig",
    "Glm5NextModel",
    "SeqBatch",
    "expert_weight_keys",
    "load_config",
    "load_model",
]

# Family entry points for tiermoe.models.registry.
from .engine import build_model, build_spec  # noqa: E402

__all__ += ["build_model", "build_spec"]
