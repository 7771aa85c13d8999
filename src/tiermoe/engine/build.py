"""Build an LLMEngine from a model path (Hugging Face checkpoint or packed expert store).

This is the one place that decides device, dtype, context length and KV-cache size, so the
CLI (`generate`, `eval`, `bench`) and the server all start models the same way.
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

from tiermoe.errors import UserError

log = logging.getLogger("tiermoe.engine")

PAGE_SIZE = 16


def add_engine_args(p, model_positional: bool = False) -> None:
    """Flags shared by every command that runs a model."""
    if not model_positional:
        p.add_argument("--model", default=None,
                       help="Hugging Face checkpoint directory or packed store (default: the embedded model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto (checkpoint dtype), bfloat16, float16, float32")
    add_sizing_args(p)
    add_store_args(p)
    add_routing_args(p)


def add_routing_args(p, record: bool = True) -> None:
    """Routing replay and recording (benchmarking; moe/replay.py): one definition for every command."""
    g = p.add_argument_group("routing (benchmarking)")
    g.add_argument("--routing-replay", default=None, metavar="FILE",
                   help="replace every MoE layer's top-k with picks from FILE (per-layer pick counts JSON, as "
                        "--expert-stats, drawn per token; or a --record-routing trace, replayed in order), keeping "
                        "the router's cost and its weights for those ids (default: the model's own routing)")
    g.add_argument("--routing-replay-seed", type=int, default=0,
                   help="seed of the draws from a counts FILE (default 0)")
    if record:
        g.add_argument("--record-routing", default=None, metavar="FILE",
                       help="write every forward token's picks per MoE layer to FILE (.npz routing trace, for "
                            "`tiermoe sim --trace` and --routing-replay)")
        g.add_argument("--record-routing-max-tokens", type=int, default=200_000,
                       help="tokens recorded at most (default 200000; later ones are not recorded)")


def add_sizing_args(p, max_num_seqs: int = 8) -> None:
    """Context, batch, KV-cache, seed and drafting flags; one definition for serve and the rest."""
    p.add_argument("--max-model-len", type=int, default=None, help="context length in tokens (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="sequences decoded together per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per engine step (chunked prefill)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="GiB for KV pages, MTP draft rows included (default: sized by the engine)")
    p.add_argument("--seed", type=int, default=None, help="engine seed for unseeded sampling")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay decode steps from CUDA graphs (default: captured where the model allows)")
    p.add_argument("--decode-attention", choices=("auto", "sdpa", "paged"), default="auto",
                   help="attention of decode steps: paged (Triton kernel over block tables, static shapes: a whole "
                        "decode step in one CUDA graph; grouped-query attention only), sdpa (torch, per sequence) "
                        "or auto (default: paged on a CUDA device where the model allows, else sdpa)")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=int, default=0, choices=(0, 1, 2),
                   help="MTP draft tokens verified per greedy decode step (0: off; models with an MTP head)")


def add_store_args(p, with_mode: bool = True) -> None:
    """Expert-store flags (read only for packed stores); one definition for every command."""
    g = p.add_argument_group("expert store (packed stores only)")
    g.add_argument("--gpu-expert-gb", type=float, default=None,
                   help="GiB of GPU memory for the expert slot cache (default: free VRAM minus a reserve)")
    g.add_argument("--host-expert-gb", type=float, default=None,
                   help="GiB of (pinned) host RAM for the warm tier (default: the memory limit minus a margin)")
    g.add_argument("--expert-policy", choices=("lru", "lfu", "clock", "static"), default=None,
                   help="slot cache replacement policy (default lfu)")
    g.add_argument("--expert-stats", default=None, help="routing statistics file for the cache warm start")
    g.add_argument("--no-direct-io", action="store_true", help="allow a filesystem without O_DIRECT")
    g.add_argument("--expert-kernel", choices=("auto", "torch", "triton"), default=None, help="routed-expert compute: auto (Triton on CUDA when the store allows it), torch, triton")
    g.add_argument("--device-cache", choices=("auto", "on", "off"), default=None,
                   help="decide the GPU slot cache on the device, no host sync per MoE layer (auto: with the Triton "
                        "kernel when host RAM holds every expert)")  # fmt: skip
    g.add_argument("--prefill-staging-gb", type=float, default=None,
                   help="device cache: GPU memory that prefill chunks copy their layer's misses into (default: one "
                        "layer's non-resident experts; twice that: large chunks copy one layer ahead, overlapping "
                        "compute; 0: read them in place)")  # fmt: skip
    g.add_argument("--prefill-borrow-slots", action=argparse.BooleanOptionalAction, default=None,
                   help="device cache: large prefill chunks copy one layer ahead into a second staging buffer lent "
                        "by expert slots (a few per layer), whose experts are copied back before the next decode "
                        "step; both buffers get that share of rows more than --prefill-staging-gb's one buffer "
                        "(default on; --no-prefill-borrow-slots: one buffer, copies and compute take turns)")  # fmt: skip
    if with_mode:
        g.add_argument("--mode", choices=("exact", "fast"), default="exact",
                       help="exact: bit-identical (default); fast: the CPU lane computes cold experts")
    g.add_argument("--cpu-lane-experts", type=int, default=4, help="most experts per layer the CPU lane computes")
    g.add_argument("--cpu-lane-threads", type=int, default=None, help="torch threads of the CPU lane")
    g.add_argument("--cpu-lane-cache-gb", type=float, default=None,
                   help="memory for repacked lane experts (default 1)")


def resolve_device(name: str | None) -> str:
    import torch

    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here")
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"--device: unknown device '{name}' (use cpu or cuda)")
    return name


def is_packed_store(path: Path) -> bool:
    return (path / "manifest.json").is_file() and (path / "experts.bin").exists()


def _expert_backend(path: Path, device: str, dtype, options: dict):
    """A tiered expert backend when `path` is a packed store, else None (resident experts)."""
    if not is_packed_store(path):
        return None
    from tiermoe.moe.tiered import TieredExperts

    return TieredExperts.open(path, device=device, dtype=dtype, options=options)


def build_engine_core(model: str | None, *, device: str | None = None, dtype: str | None = None,
                      max_model_len: int | None = None, max_num_seqs: int = 8, options: dict | None = None):
    import torch
    from transformers import AutoTokenizer

    from tiermoe.engine.llm_engine import LLMEngine
    from tiermoe.models.loader import checkpoint_dtype, load_model, load_spec, parse_dtype
    from tiermoe.runner.model_runner import kv_bytes_per_token

    options = dict(options or {})
    if model is None:
        from tiermoe.default_model import ensure_default_model

        model = str(ensure_default_model())
    path = Path(model)
    spec = load_spec(path)
    dev = resolve_device(device)
    torch_dtype = parse_dtype(dtype, default=checkpoint_dtype(spec.hf_config))
    options.setdefault("max_num_seqs", max(1, int(max_num_seqs or 8)))  # the device cache sizes its staging rows
    budget = options.get("max_num_batched_tokens") or (512 if dev == "cpu" else 2048)
    routing = None
    if options.get("routing_replay") or options.get("record_routing"):  # benchmarking; files checked before loading
        from tiermoe.moe.replay import plan_routing

        routing = plan_routing(spec, options, model_name=path.name, max_step_tokens=budget)
    backend = _expert_backend(path, dev, torch_dtype, options)
    lm = load_model(path, device=dev, dtype=torch_dtype, expert_backend=backend)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise UserError(f"{path}: cannot load the tokenizer ({str(exc).splitlines()[0]})") from None

    ctx = spec.max_position_embeddings
    if max_model_len is not None:
        if max_model_len < 2 or max_model_len > ctx:
            raise UserError(f"--max-model-len {max_model_len}: must be between 2 and the model's {ctx}")
        ctx = max_model_len
    max_num_seqs = max(1, int(max_num_seqs or 8))
    # the MTP draft rows (drafting on) share the page count, so they share the byte budget
    per_token = kv_bytes_per_token(lm, torch_dtype, options.get("num_speculative_tokens") or 0)
    pages_one_seq = math.ceil(ctx / PAGE_SIZE) + 1
    if options.get("kv_cache_gb"):
        num_pages = int(options["kv_cache_gb"] * 2**30 / (per_token * PAGE_SIZE) + 1e-6)
    else:
        cap = (2 * 2**30) if dev == "cpu" else (8 * 2**30)  # bytes
        num_pages = min(pages_one_seq * max_num_seqs, max(pages_one_seq, cap // (per_token * PAGE_SIZE)))
    if num_pages < pages_one_seq:
        raise UserError(f"--kv-cache-gb: too small for one {ctx}-token sequence "
                        f"({pages_one_seq * PAGE_SIZE * per_token / 2**30:.2f} GB needed)")
    log.info("model %s (%s) on %s %s: context %d, %d KV pages of %d tokens, %d seqs", path, spec.arch, dev,
             str(torch_dtype).replace("torch.", ""), ctx, num_pages, PAGE_SIZE, max_num_seqs)
    engine = LLMEngine(lm, tokenizer, max_model_len=ctx, max_num_seqs=max_num_seqs, max_batched_tokens=budget,
                       num_pages=num_pages, page_size=PAGE_SIZE, model_info={"arch": spec.arch, "name": path.name},
                       seed=options.get("seed"), num_speculative_tokens=options.get("num_speculative_tokens") or 0)
    if routing is not None:
        engine.runner.routing = routing.attach(lm)
    attention = options.get("decode_attention") or "auto"
    if attention not in ("auto", "sdpa", "paged"):
        raise UserError(f"--decode-attention {attention!r}: choose auto, sdpa or paged")
    if attention == "paged" or (attention == "auto" and dev != "cpu"):
        why = engine.runner.use_paged_decode_attention(ctx)
        if why is not None and attention == "paged":
            raise UserError(f"--decode-attention paged: {why}")
        log.info("decode attention: %s", "paged kernel" if why is None else f"sdpa ({why})")
    if not options.get("enforce_eager") and dev != "cpu":
        why = engine.runner.enable_decode_graphs(max_num_seqs)
        log.info("decode steps: %s", "CUDA graphs" if why is None else f"eager ({why})")
    return engine
