"""Sampling values for the fields a request leaves out, as vLLM's `--generation-config` sets them.

    auto     the model's generation_config.json (default): its temperature, top_p, top_k, min_p
             and repetition_penalty; what it does not set takes the neutral value below
    vllm     the neutral values only, whatever the model's file says
    FOLDER   generation_config.json from FOLDER instead of the model's

Neutral values: temperature 1.0, top_p 1.0, top_k off, min_p 0, repetition_penalty 1.0. A model
whose file sets none of them (a tiny test model, a GGUF without `general.sampling.*`; the
importer copies those, and the embedded default model gets its model card's) therefore samples
at temperature 1.0, which is the default of the OpenAI and Anthropic APIs and of vLLM, so a
client written against any of them gets what it expects: `n=2` gives two samples, and a request
that wants greedy decoding says `temperature: 0`, as it must there. Greedy by default would make
small models loop and every `n>1` answer identical, with nothing in the response saying why.

As in vLLM, `do_sample` is not read (a file that means greedy says `temperature: 0`), and
values a request gives always win, per field, on every route (chat, completions, responses,
Anthropic messages; ServerContext.sampling_params applies them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from tiermoe.errors import UserError

FILE = "generation_config.json"
MODES = ("auto", "vllm")


@dataclass(frozen=True)
class SamplingDefaults:
    """The values a request's left-out sampling fields take; `source` says where they came from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "neutral defaults"

    def values(self) -> dict[str, float | int]:
        """The sampling fields (not `source`), by SamplingParams' names."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}

    def describe(self) -> str:
        """One line for the start-up log: the values that differ from neutral, and their source."""
        neutral = SamplingDefaults().values()
        changed = {k: v for k, v in self.values().items() if v != neutral[k]}
        shown = ", ".join(f"{k} {v:g}" for k, v in changed.items()) or "temperature 1"
        return f"{shown} (from {self.source})"


def load_sampling_defaults(mode: str, model_dir: Path | None) -> SamplingDefaults:
    """The defaults for `--generation-config mode` (module doc) and the model in `model_dir`."""
    if mode == "vllm":
        return SamplingDefaults()
    if mode == "auto":
        if model_dir is None or not (Path(model_dir) / FILE).is_file():
            return SamplingDefaults(source=f"neutral defaults: the model has no {FILE}")
        return from_file(Path(model_dir) / FILE)
    folder = Path(mode).expanduser()
    if not (folder / FILE).is_file():
        raise UserError(f"--generation-config {mode}: not auto, vllm or a folder holding {FILE}")
    return from_file(folder / FILE)


def from_file(path: Path) -> SamplingDefaults:
    """The sampling fields of one generation_config.json; a value no sampler accepts is a
    one-line error at start-up, not a 400 on every request that leaves the field out."""
    hint = "(--generation-config vllm ignores the file)"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not readable JSON ({exc}) {hint}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a JSON object {hint}")
    found: dict[str, float | int] = {}
    for name in SamplingDefaults().values():
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{path}: {name} must be a number, not {value!r} {hint}")
        if name == "top_k":
            if not float(value).is_integer() or value < -1:
                raise UserError(f"{path}: top_k must be an integer >= -1 {hint}")
            value = max(0, int(value))  # -1 and 0 both mean off
        found[name] = value if name == "top_k" else float(value)
    checks = {"temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1, "min_p": lambda v: 0 <= v <= 1,
              "repetition_penalty": lambda v: v > 0}
    for name, ok in checks.items():
        if name in found and not ok(found[name]):
            raise UserError(f"{path}: {name} {found[name]:g} is out of range {hint}")
    if not found:
        return SamplingDefaults(source=f"neutral defaults: {FILE} sets no sampling field")
    return SamplingDefaults(**found, source=str(path))
