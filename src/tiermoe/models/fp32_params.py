"""Which parameters stay in fp32 when a checkpoint is loaded in bf16 or fp16.

transformers keeps some parameters in fp32 whatever the load dtype, by two mechanisms: a class's
`_keep_in_fp32_modules_strict` (bf16 and fp16) / `_keep_in_fp32_modules` (fp16 only), and
parameters a module creates with an explicit fp32 dtype. Both change between versions: 5.17
creates glm4_moe's and deepseek_v3's router weight in the default dtype (rounded to bf16),
5.24 creates it in fp32 and lists it. A router weight on the other side of that choice flips
expert picks, so exactness against the installed reference needs the installed reference's
choice. It is read off the reference itself: the model skeleton built on the meta device at the
load dtype (no memory, no weights), with the class's lists applied the way transformers applies
them (each entry a regular expression, `*` as `.*`, searched in the parameter name).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

# Families whose causal-LM head lives in a class AutoModelForCausalLM does not map.
REFERENCE_CLASSES = {"glm5_next": "Glm5NextForConditionalGeneration"}


def reference_class(model_type: str):
    """The transformers model class that defines `model_type` (None when it has none)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = REFERENCE_CLASSES.get(model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


def _pattern(names) -> re.Pattern | None:
    names = list(names)
    return re.compile("|".join(f"(?:{n.replace('*', '.*')})" for n in names)) if names else None


class Fp32Plan:
    """plan(name) -> True when the reference holds parameter `name` in fp32 at `dtype`.

    Names are ours; they match the reference's either exactly or as a dotted suffix (families
    that drop a prefix such as `model.language_model.`). Names the reference lacks (e.g. the
    MTP layer, which transformers does not load) fall back to the lists' patterns, then to the
    family's own `fallback` list when transformers has no usable class for the checkpoint.
    """

    def __init__(self, model_dir: str | Path, model_type: str, dtype: torch.dtype, fallback: tuple[str, ...] = ()):
        self.suffixes: dict[str, bool] = {}
        self.pattern = None
        if dtype == torch.float32:
            return
        cls = reference_class(model_type)
        skeleton = self._skeleton(cls, model_dir, dtype)
        if skeleton is None:  # no usable reference: the family's own list
            self.pattern = _pattern(fallback)
            return
        self.pattern = _pattern(self._lists(skeleton, dtype))
        for name, tensor in [*skeleton.named_parameters(), *skeleton.named_buffers()]:
            fp32 = tensor.dtype == torch.float32 or (self.pattern is not None and self.pattern.search(name) is not None)
            parts = name.split(".")
            for i in range(len(parts)):  # every dotted suffix; a clash keeps the first seen
                self.suffixes.setdefault(".".join(parts[i:]), fp32)

    @staticmethod
    def _lists(model, dtype) -> list[str]:
        """The reference's keep-in-fp32 entries at `dtype` (an instance also counts the lists of
        its sub-models, as transformers does)."""
        if hasattr(model, "_get_dtype_plan"):
            return list(model._get_dtype_plan(dtype))
        names = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        if dtype == torch.float16:
            names += list(getattr(model, "_keep_in_fp32_modules", None) or [])
        return names

    @staticmethod
    def _skeleton(cls, model_dir, dtype):
        """The reference model on the meta device at `dtype`, or None when transformers cannot
        build it for this checkpoint (an older version that lacks or rejects the config)."""
        if cls is None:
            return None
        import transformers

        try:
            config = transformers.AutoConfig.from_pretrained(str(model_dir))
            with torch.device("meta"):
                return cls._from_config(config, dtype=dtype)
        except (ValueError, KeyError, TypeError, AttributeError, ImportError, OSError):
            return None

    def __call__(self, name: str) -> bool:
        if name in self.suffixes:
            return self.suffixes[name]
        return self.pattern is not None and self.pattern.search(name) is not None
