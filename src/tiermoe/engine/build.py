"""Build an LLMEngine from a model path (Hugging Face checkpoint or packed expert store).

    flags (argparse, defaults from config.EngineArgs) -> EngineArgs.from_options
        -> engine/settle.settle_config (every "auto" decided once) -> EngineConfig
        -> build_engine: routing hooks planned, expert backend opened (moe/backends.py), model
           loaded with it, KV pages sized, decode attention and CUDA graphs switched on

So the CLI (`generate`, `eval`, `bench`) and the server all start models the same way;
`build_engine_core` is that chain in one call for callers holding a CLI namespace.
"""

from __future__ import annotations

import argparse
import logging
import math
from argparse import Namespace
from typing import Any, Mapping

from tiermoe.config import DEFAULTS, EngineArgs, EngineConfig, lane_share
from tiermoe.config import PAGE_SIZE as PAGE_SIZE
from tiermoe.engine.settle import is_packed_store as is_packed_store
from tiermoe.engine.settle import resolve_device as resolve_device
from tiermoe.engine.settle import settle_config
from tiermoe.errors import UserError
from tiermoe.store.formats import STATS_FORMAT

log = logging.getLogger("tiermoe.engine")

KV_CAP_BYTES = {"cpu": 2 * 2**30, "cuda": 8 * 2**30}  # default KV budget when --kv-cache-gb is not given


def add_engine_args(p, model_positional: bool = False) -> None:
    """Flags shared by every command that runs a model."""
    if not model_positional:
        p.add_argument("--model", default=None,
                       help="checkpoint directory, packed store, .gguf file or Hugging Face repo id org/model "
                            "(default: the embedded model)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face repo id MODEL (default: main)")
    p.add_argument("--device", default=DEFAULTS.device, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=DEFAULTS.dtype, help="auto (checkpoint dtype), bfloat16, float16, float32")
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
    g.add_argument("--routing-replay-seed", type=int, default=DEFAULTS.routing_replay_seed,
                   help=f"seed of the draws from a counts FILE (default {DEFAULTS.routing_replay_seed})")
    if record:
        g.add_argument("--record-routing", default=None, metavar="FILE",
                       help="write every forward token's picks per MoE layer to FILE (.npz routing trace, for "
                            "`tiermoe sim --trace` and --routing-replay)")
        g.add_argument("--record-routing-max-tokens", type=int, default=DEFAULTS.record_routing_max_tokens,
                       help=f"tokens recorded at most (default {DEFAULTS.record_routing_max_tokens}; later ones "
                            "are not recorded)")


def add_sizing_args(p, max_num_seqs: int = DEFAULTS.max_num_seqs) -> None:
    """Context, batch, KV-cache, seed and drafting flags; one definition for serve and the rest."""
    p.add_argument("--max-model-len", type=int, default=None, help="context length in tokens (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="sequences decoded together per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per engine step (chunked prefill; default 512 on a CPU, 2048 on CUDA)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="GiB for KV pages, MTP draft rows and per-sequence recurrent state (KDA) included "
                        "(default: sized by the engine)")
    p.add_argument("--seed", type=int, default=None, help="engine seed for unseeded sampling")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay decode steps from CUDA graphs (default: captured where the model allows)")
    p.add_argument("--decode-attention", choices=("auto", "sdpa", "paged"), default=DEFAULTS.decode_attention,
                   help="attention of decode steps: paged (through block tables, static shapes: a whole decode step "
                        "in one CUDA graph; a Triton kernel for grouped-query attention, batched torch ops for "
                        "glm5_next's MLA up to a 65536-token --max-model-len; not deepseek_v3's MLA), sdpa (torch, "
                        "per sequence) or auto (default: paged on a CUDA device where the model allows, else sdpa)")
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULTS.num_speculative_tokens, choices=(0, 1, 2),
                   help="MTP draft tokens verified per greedy decode step (0: off; models with an MTP head)")


def _check_kv_cache_gb(value: float | None) -> None:
    if value is not None and not 0 < value < math.inf:  # nan, inf: no byte count
        raise UserError(f"--kv-cache-gb must be a finite number > 0, got {value}")


def check_sizing_args(args) -> None:
    """Refuse add_sizing_args values with no meaning, before any model loads: settle_config reads 0 as "the
    default" (`or`) and generate fixes its batch at 1, so 0 or a negative would otherwise be taken silently
    where `plan` and `serve` refuse it."""
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UserError("--max-model-len must be at least 2")
    if args.max_num_seqs < 1:
        raise UserError("--max-num-seqs must be at least 1")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise UserError("--max-num-batched-tokens must be at least 1")
    _check_kv_cache_gb(args.kv_cache_gb)


def add_store_args(p, with_mode: bool = True) -> None:
    """Expert-store flags (read only for packed stores); one definition for every command."""
    g = p.add_argument_group("expert store (packed stores only)")
    g.add_argument("--gpu-expert-gb", type=float, default=None,
                   help="GiB of GPU memory for the expert slot cache (default: free VRAM minus a reserve)")
    g.add_argument("--host-expert-gb", type=float, default=None,
                   help="GiB of (pinned) host RAM for the warm tier (default: the memory limit minus a margin)")
    g.add_argument("--expert-policy", choices=("lru", "lfu", "clock", "static"), default=None,
                   help="the store's slot replacement policy (default lfu; the device cache decides its own)")
    g.add_argument("--expert-stats", default=None, metavar="FILE",
                   help=f"routing statistics that choose the experts loaded into the tiers at start: {STATS_FORMAT} "
                        "(default: experts in record order)")
    g.add_argument("--no-direct-io", action="store_true", help="allow a filesystem without O_DIRECT")
    g.add_argument("--expert-kernel", choices=("auto", "torch", "triton"), default=None,
                   help="routed-expert compute: auto (Triton on CUDA when the store allows it), torch, triton "
                        "(default: $TIERMOE_EXPERT_KERNEL, else auto)")
    g.add_argument("--device-cache", choices=("auto", "on", "off"), default=None,
                   help="decide the GPU slot cache on the device, no host sync per MoE layer (auto: with the Triton "
                        "kernel when host RAM holds every expert)")
    g.add_argument("--prefill-staging-gb", type=float, default=None,
                   help="device cache: GPU memory that prefill chunks copy their layer's misses into (default: one "
                        "layer's non-resident experts; twice that: large chunks copy one layer ahead, overlapping "
                        "compute; 0: read them in place)")
    g.add_argument("--prefill-borrow-slots", action=argparse.BooleanOptionalAction, default=None,
                   help="device cache: large prefill chunks copy one layer ahead into a second staging buffer lent "
                        "by expert slots (a few per layer), whose experts are copied back before the next decode "
                        "step; both buffers get that share of rows more than --prefill-staging-gb's one buffer "
                        "(default on; --no-prefill-borrow-slots: one buffer, copies and compute take turns)")
    if with_mode:
        g.add_argument("--mode", choices=("exact", "fast"), default=DEFAULTS.mode,
                       help="exact: bit-identical (default); fast: the CPU lane computes cold experts")
    g.add_argument("--cpu-lane-experts", type=int, default=DEFAULTS.cpu_lane_experts,
                   help="most experts per layer the CPU lane computes; beside a GPU the cost model measures "
                        "bandwidths at start and takes fewer (default: top_k x 4 beside a GPU, 4 on a CPU)")
    g.add_argument("--cpu-lane-share", type=_lane_share_arg, default=DEFAULTS.cpu_lane_share, metavar="auto|SHARE",
                   help="beside a GPU, the share (0 to 1) of each layer's misses the CPU lane computes, at most "
                        "--cpu-lane-experts, instead of the one the cost model measures at start (default: auto, "
                        "measured); on a CPU device the lane takes its fixed count")
    g.add_argument("--cpu-lane-threads", type=int, default=None, help="torch threads of the CPU lane")


def _lane_share_arg(text: str) -> float | None:
    """--cpu-lane-share's value: refused while parsing, as a usage error naming the flag."""
    try:
        return lane_share(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config(model: str | None = None, *, device: str | None = None, dtype: str | None = None,
                  max_model_len: int | None = None, max_num_seqs: int = DEFAULTS.max_num_seqs,
                  options: Mapping[str, Any] | Namespace | None = None) -> EngineConfig:
    """The settled configuration for a CLI namespace (or its vars) and the explicit arguments,
    which win over the namespace's values of the same name."""
    args = EngineArgs.from_options(options, model=model, device=device, dtype=dtype, max_model_len=max_model_len,
                                   max_num_seqs=max_num_seqs)
    return settle_config(args)


def build_engine_core(model: str | None, *, device: str | None = None, dtype: str | None = None,
                      max_model_len: int | None = None, max_num_seqs: int = DEFAULTS.max_num_seqs,
                      options: Mapping[str, Any] | Namespace | None = None):
    """engine_config + build_engine in one call."""
    return build_engine(engine_config(model, device=device, dtype=dtype, max_model_len=max_model_len,
                                      max_num_seqs=max_num_seqs, options=options))


def build_engine(cfg: EngineConfig):
    """An LLMEngine for a settled configuration."""
    from transformers import AutoTokenizer

    from tiermoe.engine.llm_engine import LLMEngine
    from tiermoe.models.loader import load_model, load_spec
    from tiermoe.runner.model_runner import kv_bytes_per_token

    path = cfg.model
    spec = load_spec(path)
    routing = None
    if cfg.routing is not None:  # benchmarking; files checked before loading
        from tiermoe.moe.replay import plan_routing

        routing = plan_routing(spec, cfg.routing, model_name=path.name, max_step_tokens=cfg.max_batched_tokens)
    backend = None
    if cfg.experts is not None:
        from tiermoe.moe.backends import open_expert_backend

        backend = open_expert_backend(cfg.experts)
    try:
        lm = load_model(path, device=cfg.device, dtype=cfg.dtype, expert_backend=backend)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:
            raise UserError(f"{path}: cannot load the tokenizer ({str(exc).splitlines()[0]})") from None
        state = lm.slot_state_bytes() * cfg.max_num_seqs  # recurrent state of every slot, paid before pages
        num_pages = _kv_pages(cfg, kv_bytes_per_token(lm, cfg.dtype, cfg.num_speculative_tokens), state)
    except BaseException:
        if backend is not None:
            backend.close()
        raise
    log.info("model %s (%s) on %s %s: context %d, %d KV pages of %d tokens, %d seqs%s", path, spec.arch, cfg.device,
             str(cfg.dtype).replace("torch.", ""), cfg.max_model_len, num_pages, cfg.page_size, cfg.max_num_seqs,
             f", {state / 2**30:.2f} GiB of per-sequence state" if state else "")
    engine = LLMEngine(lm, tokenizer, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                       max_batched_tokens=cfg.max_batched_tokens, num_pages=num_pages, page_size=cfg.page_size,
                       model_info={"arch": spec.arch, "name": path.name}, seed=cfg.seed,
                       num_speculative_tokens=cfg.num_speculative_tokens)
    if routing is not None:
        engine.runner.routing = routing.attach(lm)
    if cfg.experts is not None and cfg.experts.parallel is not None:  # the ranks' engines kept in step
        from tiermoe.engine.ranks import RankGroup

        engine.ranks = RankGroup(cfg.experts.parallel)
    if cfg.decode_attention == "paged":
        why = engine.runner.use_paged_decode_attention(cfg.max_model_len)
        if why is not None and cfg.paged_attention_required:
            raise UserError(f"--decode-attention paged: {why}")
        log.info("decode attention: %s", "paged kernel" if why is None else f"sdpa ({why})")
    if cfg.decode_graphs:
        why = engine.runner.enable_decode_graphs(cfg.max_num_seqs)
        log.info("decode steps: %s", "CUDA graphs" if why is None else f"eager ({why})")
    return engine


def _kv_pages(cfg: EngineConfig, per_token: int, state_bytes: int = 0) -> int:
    """KV pages for --kv-cache-gb, else one context per sequence within a byte cap; per_token:
    bytes of one token position (the MTP draft rows included when drafting is on: they share the
    page count, so they share the byte budget); state_bytes: per-sequence state of every slot
    (a recurrent family's KDA state), which the budget pays for first, as vLLM counts a hybrid
    model's state in its cache budget."""
    page = cfg.page_size
    pages_one_seq = math.ceil(cfg.max_model_len / page) + 1
    _check_kv_cache_gb(cfg.kv_cache_gb)  # callers that skip check_sizing_args (engine_config from options)
    if cfg.kv_cache_gb:
        num_pages = max(0, int((cfg.kv_cache_gb * 2**30 - state_bytes) / (per_token * page) + 1e-6))
    else:
        cap = KV_CAP_BYTES["cpu" if cfg.device == "cpu" else "cuda"] - state_bytes
        num_pages = min(pages_one_seq * cfg.max_num_seqs, max(pages_one_seq, cap // (per_token * page)))
    if num_pages < pages_one_seq:
        state = f" after {state_bytes / 2**30:.2f} GB of per-sequence state for {cfg.max_num_seqs} sequences" \
            if state_bytes else ""
        raise UserError(f"--kv-cache-gb: too small for one {cfg.max_model_len}-token sequence "
                        f"({pages_one_seq * page * per_token / 2**30:.2f} GB needed{state})")
    return num_pages
