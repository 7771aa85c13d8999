"""A random-weight Qwen3-MoE model written directly in 4-bit (or 3-bit) form for tiermoe and llama.cpp.

`tiermoe bench make-qwen3moe OUT` writes the same weights twice: a packed int4 store
(OUT/store, docs/store-format.md) and a GGUF with Q4_0 experts (OUT/model.gguf, llama.cpp's
`qwen3moe`), so the two engines can be compared on one model; with `--quant int3`, an int3
store and a GGUF with Q3_K experts. The default shape is
Qwen3-235B-A22B's per layer (hidden 4096, 128 routed experts of intermediate 1536, top-8,
64 query / 4 KV heads of 128) with fewer layers; the vocabulary is the project's small
byte-level BPE tokenizer (tiny_tokenizer), carried in both formats.

Why codes first: at full size the experts are ~58 G weights, too many for a bf16
intermediate on the benchmark host. So the int4 codes and scales are drawn directly and mapped
to each format without rounding: ours is group-wise symmetric int4 (q in -8..7, bf16 scale per
group of G = 32 by default), Q4_0 is 32-weight blocks with an fp16 scale and q + 8 nibbles.
Every scale is m * 2^e with m in 8..15, exact in bf16 and fp16, and |q * m| < 128, so each
dequantized weight is exact in fp32, bf16 and fp16: both engines see bit-identical experts.
int3 is the same with q in -4..3 (our bit planes, quant.py) against Q3_K's 256-weight blocks,
whose 16-weight sub-blocks hold each group's scale as d * (sc - 32) with a power-of-two d
(synthetic_gguf.to_q3_k); its groups must be multiples of 16 and, for the GGUF, the hidden and
intermediate sizes multiples of 256.
Non-expert weights are bf16 in both (norms and routers F32-stored bf16 values in the GGUF).

Output rows of the LM head for special tokens and for tokens that are not valid UTF-8 on
their own are zero: with logits of the other rows spread around 0, greedy decoding never
picks them, so random-weight streams neither stop early nor emit broken UTF-8 in either server.

Generation is deterministic per (seed, device type): `--formats store` and `--formats gguf`
in two runs give the same weights; each run records a digest of the canonical weights in
OUT/synthetic-<format>.json so a script can prove it.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tiermoe.errors import UserError

STORE_DIR = "store"
GGUF_FILE = "model.gguf"
FORMATS = ("store", "gguf")
QUANTS = ("int4", "int3")
CODE_RMS = {"int4": 4.61, "int3": 2.35}  # root mean square of uniform codes: -8..7, -4..3
DEFAULT_GROUP = {"int4": 32, "int3": 64}  # Q4_0's block (equal bytes); pack's int3 default


@dataclass(frozen=True)
class SyntheticSpec:
    """Model shape and generation options (defaults: Qwen3-235B-A22B's MoE layer shape)."""

    layers: int = 24
    hidden: int = 4096
    experts: int = 128
    moe_intermediate: int = 1536
    top_k: int = 8
    heads: int = 64
    kv_heads: int = 4
    head_dim: int = 128
    group_size: int = 32
    quant: str = "int4"  # expert kind: int4 (GGUF Q4_0) or int3 (GGUF Q3_K)
    vocab: int = 0  # filled from the tokenizer
    dense_intermediate: int = 12288  # config field only (every layer is MoE)
    max_position: int = 40960
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    seed: int = 0

    def check(self, formats=FORMATS) -> None:
        for name in ("layers", "hidden", "experts", "moe_intermediate", "top_k", "heads", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive")
        if self.top_k > self.experts:
            raise UserError(f"--top-k {self.top_k} exceeds --experts {self.experts}")
        if self.heads % self.kv_heads:
            raise UserError(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")
        g = self.group_size
        if self.quant not in QUANTS:
            raise UserError(f"--quant {self.quant!r}: choose one of {', '.join(QUANTS)}")
        if self.quant == "int4" and (g % 32 or self.hidden % g or self.moe_intermediate % g):
            raise UserError(
                f"--group-size {g}: must be a multiple of 32 (Q4_0's block) dividing hidden and intermediate"
            )
        if self.quant == "int3" and (g <= 0 or g % 16 or self.hidden % g or self.moe_intermediate % g):
            raise UserError(
                f"--group-size {g}: must be a multiple of 16 (Q3_K's sub-block) dividing hidden and intermediate"
            )
        if self.quant == "int3" and "gguf" in formats and (self.hidden % 256 or self.moe_intermediate % 256):
            raise UserError(
                f"--quant int3 with a GGUF: hidden {self.hidden} and intermediate {self.moe_intermediate} must be "
                "multiples of 256 (Q3_K's block; or --formats store)"
            )


def store_bytes_per_expert(spec: SyntheticSpec) -> int:
    from tiermoe.store.records import RecordLayout

    return RecordLayout.build(spec.quant, spec.hidden, spec.moe_intermediate, spec.group_size).length


def gguf_bytes_per_expert(spec: SyntheticSpec) -> int:
    from tiermoe.bench.synthetic_gguf import q3_k_bytes_per_expert, q4_0_bytes_per_expert

    per = q3_k_bytes_per_expert if spec.quant == "int3" else q4_0_bytes_per_expert
    return per(spec.hidden, spec.moe_intermediate)


def _dense_params(spec: SyntheticSpec) -> int:
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    per_layer = (
        2 * q * spec.hidden + 2 * kv * spec.hidden + spec.experts * spec.hidden + 2 * spec.hidden + 2 * spec.head_dim
    )
    return spec.layers * per_layer + 2 * spec.vocab * spec.hidden + spec.hidden


def sizes(spec: SyntheticSpec) -> dict:
    """Bytes per expert and per format (what `make` will write)."""
    n_exp = spec.layers * spec.experts
    dense = _dense_params(spec) * 2
    s, g = store_bytes_per_expert(spec), gguf_bytes_per_expert(spec)
    return {
        "weights_per_expert": 3 * spec.hidden * spec.moe_intermediate,
        "store_bytes_per_expert": s,
        "gguf_bytes_per_expert": g,
        "store_bytes": n_exp * s + dense,
        "gguf_bytes": n_exp * g + dense + 2 * 2**20,
        "dense_bytes": dense,
    }


# ----------------------------------------------------------------------------- weights
def _generator(spec: SyntheticSpec, key: str, device):
    import torch

    h = hashlib.blake2b(f"{spec.seed}/{key}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(h, "little") & (2**63 - 1))
    return g


def _normal(spec, key, shape, std, device, mean=0.0):
    """bf16 [shape] ~ mean + std * N(0, 1), drawn on `device`, returned on the CPU."""
    import torch

    x = torch.randn(shape, generator=_generator(spec, key, device), device=device, dtype=torch.float32)
    return x.mul_(std).add_(mean).to(torch.bfloat16).cpu()


def _scale_exponent(k: int, code_rms: float = CODE_RMS["int4"]) -> int:
    """e with codes (rms ~4.6 for int4, ~2.3 for int3) * m/8 (mean ~1.44) * 2^e ~ 1/sqrt(k):
    fan-in scaled weights."""
    return round(math.log2(1.0 / (math.sqrt(k) * code_rms * 1.44)))


def expert_codes(spec: SyntheticSpec, layer: int, device) -> dict:
    """One layer's experts as our int4 (or int3) sections, on the CPU.

    {proj: (q uint8 [E, N, K/2] (int3: [E, N, 3K/8]), s bf16 [E, N, K/G])} for proj in gate, up
    ([I, H]) and down ([H, I]). Codes are uniform random bytes (every byte is valid nibbles or
    bit planes); scales are m * 2^(e-3), m in 8..15.
    """
    import torch

    from tiermoe.store.quant import packed_cols

    e, h, i, g = spec.experts, spec.hidden, spec.moe_intermediate, spec.group_size
    bits = 3 if spec.quant == "int3" else 4
    out = {}
    for proj, (n, k) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        gen = _generator(spec, f"experts/{layer}/{proj}", device)
        cols = packed_cols(k, bits)
        nbytes = e * n * cols
        words = torch.randint(-(2**63), 2**63 - 1, (-(-nbytes // 8),), generator=gen, device=device,
                              dtype=torch.int64)
        q = words.view(torch.uint8)[:nbytes].view(e, n, cols)
        m = torch.randint(8, 16, (e, n, k // g), generator=gen, device=device, dtype=torch.int32)
        s = (m.to(torch.float32) * 2.0 ** (_scale_exponent(k, CODE_RMS[spec.quant]) - 3)).to(torch.bfloat16)
        out[proj] = (q.cpu(), s.cpu())
    return out


def silenced_tokens(tok) -> list[int]:
    """Ids greedy decoding must never pick: special tokens and lone invalid-UTF-8 bytes."""
    bad = set(tok.all_special_ids)
    for tid in range(len(tok)):
        if "\ufffd" in tok.convert_tokens_to_string([tok.convert_ids_to_tokens(tid)]):
            bad.add(tid)
    return sorted(bad)


def global_tensors(spec: SyntheticSpec, tok, device) -> dict:
    """GGUF name -> bf16 tensor for the embedding, final norm and LM head."""
    h, v = spec.hidden, spec.vocab
    head = _normal(spec, "lm_head", (v, h), 1.0 / math.sqrt(h), device)
    head[silenced_tokens(tok)] = 0
    return {
        "token_embd.weight": _normal(spec, "embed", (v, h), 1.0, device),
        "output_norm.weight": _normal(spec, "norm", (h,), 0.1, device, mean=1.0),
        "output.weight": head,
    }


def layer_tensors(spec: SyntheticSpec, layer: int, device) -> dict:
    """GGUF name -> bf16 tensor for one layer's attention, norms and router."""
    h, q, kv, d = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.head_dim
    b = f"blk.{layer}"
    return {
        f"{b}.attn_norm.weight": _normal(spec, f"{b}/attn_norm", (h,), 0.1, device, mean=1.0),
        f"{b}.attn_q.weight": _normal(spec, f"{b}/q", (q, h), 1.0 / math.sqrt(h), device),
        f"{b}.attn_k.weight": _normal(spec, f"{b}/k", (kv, h), 1.0 / math.sqrt(h), device),
        f"{b}.attn_v.weight": _normal(spec, f"{b}/v", (kv, h), 1.0 / math.sqrt(h), device),
        f"{b}.attn_output.weight": _normal(spec, f"{b}/o", (h, q), 1.0 / math.sqrt(q), device),
        f"{b}.attn_q_norm.weight": _normal(spec, f"{b}/q_norm", (d,), 0.1, device, mean=1.0),
        f"{b}.attn_k_norm.weight": _normal(spec, f"{b}/k_norm", (d,), 0.1, device, mean=1.0),
        f"{b}.ffn_norm.weight": _normal(spec, f"{b}/ffn_norm", (h,), 0.1, device, mean=1.0),
        f"{b}.ffn_gate_inp.weight": _normal(spec, f"{b}/router", (spec.experts, h), 1.0 / math.sqrt(h), device),
    }


class _Digest:
    """sha256 over the canonical tensors in generation order (format-independent)."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool, self.parts = pool, []

    def add(self, tensors) -> None:
        import torch

        views = [t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in tensors]
        self.parts += list(self.pool.map(lambda a: hashlib.sha256(a).hexdigest(), views))

    def hexdigest(self) -> str:
        return hashlib.sha256("".join(self.parts).encode()).hexdigest()


# ----------------------------------------------------------------------------- config
def hf_config(spec: SyntheticSpec, tok) -> dict:
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.dense_intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position,
        rms_norm_eps=spec.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        moe_intermediate_size=spec.moe_intermediate,
        num_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3MoeForCausalLM"]
    d["dtype"] = "bfloat16"
    return d


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here")
    return torch.device(device)


# ----------------------------------------------------------------------------- make
def make_synthetic(
    out: str | Path,
    spec: SyntheticSpec,
    formats=FORMATS,
    device: str = "auto",
    force: bool = False,
    progress: bool = True,
    log=print,
) -> dict:
    """Write the selected formats of the model under `out`; returns the summary dict also
    written to OUT/synthetic-<format>.json."""
    import torch
    from tqdm import tqdm

    from tiermoe.bench.real_routing import STATS_NAME, write_real_stats
    from tiermoe.bench.synthetic_gguf import GGUFSink
    from tiermoe.bench.synthetic_store import StoreSink
    from tiermoe.models.tiny_tokenizer import build_tokenizer

    formats = tuple(dict.fromkeys(formats))
    if not formats or any(f not in FORMATS for f in formats):
        raise UserError(f"--formats: choose from {', '.join(FORMATS)}")
    tok = build_tokenizer()
    spec = replace(spec, vocab=len(tok))
    spec.check(formats)
    out = Path(out)
    targets = {"store": out / STORE_DIR, "gguf": out / GGUF_FILE}
    partial = {f: t.with_name(t.name + ".partial") for f, t in targets.items()}
    for f in formats:
        if targets[f].exists() and not force:
            raise UserError(f"{targets[f]}: exists (use --force to replace it)")
    for f in formats:  # the summary goes first, so a half-written model is never taken for a finished one
        for p in (out / f"synthetic-{f}.json", targets[f], partial[f]):
            _remove(p)
    sz = sizes(spec)
    need = sum(sz[f"{f}_bytes"] for f in formats)
    out.mkdir(parents=True, exist_ok=True)
    if need > _free_bytes(out):
        raise UserError(
            f"{out}: needs {need / 2**30:.1f} GiB for {'+'.join(formats)}, "
            f"{_free_bytes(out) / 2**30:.1f} GiB free (lower --layers)"
        )
    dev = _resolve_device(device)
    config = hf_config(spec, tok)
    t0 = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=max(2, min(16, torch.get_num_threads())))
    digest = _Digest(pool)
    name = f"qwen3moe-synthetic-L{spec.layers}" + ("-int3" if spec.quant == "int3" else "")
    sinks = {}
    if "store" in formats:
        sinks["store"] = StoreSink(partial["store"], spec, config, tok, pool)
    if "gguf" in formats:
        sinks["gguf"] = GGUFSink(partial["gguf"], spec, tok, name)
    try:
        glob = global_tensors(spec, tok, dev)
        digest.add(glob.values())
        for sink in sinks.values():
            for n, t in glob.items():
                sink.write_dense(n, t)
        bar = tqdm(range(spec.layers), desc=f"layers ({'+'.join(formats)})", unit="layer", disable=not progress)
        for layer in bar:
            dense = layer_tensors(spec, layer, dev)
            codes = expert_codes(spec, layer, dev)
            digest.add(list(dense.values()) + [t for q_s in codes.values() for t in q_s])
            for sink in sinks.values():
                for n, t in dense.items():
                    sink.write_dense(n, t)
            if "store" in sinks:
                sinks["store"].write_experts(layer, codes)
            if "gguf" in sinks:
                _gguf_experts(sinks["gguf"], layer, codes, dev, spec.quant)
        for sink in sinks.values():
            sink.close()
    except BaseException:
        for f in sinks:
            _remove(partial[f])
        raise
    finally:
        pool.shutdown()
    for f in formats:
        partial[f].rename(targets[f])
    summary = {
        "spec": asdict(spec),
        "sizes": sz,
        "weights_sha256": digest.hexdigest(),
        "device": dev.type,
        "seconds": round(time.monotonic() - t0, 1),
        "served_name": name,
    }
    summary["routing_stats"] = str(write_real_stats(out / STATS_NAME, list(range(spec.layers)), spec.experts))
    for f in formats:
        summary_f = dict(summary, format=f, path=str(targets[f]))
        (out / f"synthetic-{f}.json").write_text(json.dumps(summary_f, indent=1) + "\n")
        log(
            f"wrote {targets[f]} ({sz[f'{f}_bytes'] / 2**30:.1f} GiB, {sz[f'{f}_bytes_per_expert']:,} bytes per expert)"
        )
    log(f"weights sha256 {summary['weights_sha256'][:16]}... in {summary['seconds']} s on {dev.type}")
    return summary


def _gguf_experts(sink, layer: int, codes: dict, dev, quant: str = "int4") -> None:
    """Three Q4_0 stacks [E, N, K/32*18] (int3: Q3_K, [E, N, K/256*110]) from our codes (converted on `dev`)."""
    from tiermoe.bench.synthetic_gguf import to_q3_k, to_q4_0

    convert = to_q3_k if quant == "int3" else to_q4_0
    for proj in ("gate", "up", "down"):
        q, s = codes[proj]
        blocks = convert(q.to(dev), s.to(dev)).cpu()
        sink.write(f"blk.{layer}.ffn_{proj}_exps.weight", blocks.numpy())


# ----------------------------------------------------------------------------- CLI
def register(sub) -> None:
    d = SyntheticSpec()
    p = sub.add_parser("make-qwen3moe",
                       help="random-weight Qwen3-MoE as an int4 store and a Q4_0 GGUF (same weights; or int3 and Q3_K)")
    p.add_argument("out", help="output directory (gets store/, model.gguf, synthetic-*.json)")
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers (all MoE)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size")
    p.add_argument("--experts", type=int, default=d.experts, help="routed experts per layer")
    p.add_argument("--moe-intermediate", type=int, default=d.moe_intermediate, help="intermediate size of one expert")
    p.add_argument("--top-k", type=int, default=d.top_k, help="routed experts per token")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="dimension of one head")
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="group size of the store: int4 default 32 (Q4_0's block, equal bytes; 64/128 share a scale across "
        "blocks); int3 default 64 (pack's; multiples of 16, Q3_K's sub-block; 32 is closest to Q3_K's bytes)",
    )
    p.add_argument("--max-position", type=int, default=d.max_position, help="context length of the config")
    p.add_argument("--quant", choices=QUANTS, default="int4",
                   help="expert format: int4 (int4 store / Q4_0 GGUF) or int3 (int3 store / Q3_K GGUF)")
    p.add_argument("--formats", default=",".join(FORMATS), help="store, gguf or both (default both)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random weights")
    p.add_argument("--device", default="auto", help="where codes are drawn and converted: auto, cpu, cuda")
    p.add_argument("--force", action="store_true", help="replace existing outputs")
    p.add_argument("--sizes-only", action="store_true", help="print the sizes as JSON and write nothing")
    p.set_defaults(handler=_run_make)

    c = sub.add_parser("check-qwen3moe", help="check a synthetic store and GGUF decode to identical weights")
    c.add_argument("out", help="directory written by make-qwen3moe")
    c.add_argument("--samples", type=int, default=4, help="experts compared per checked layer")
    c.add_argument("--layers", default="first,last", help="layers to check: first,last or all or a list 0,5")
    c.set_defaults(handler=_run_check)


def _spec_from_args(a) -> SyntheticSpec:
    return SyntheticSpec(
        layers=a.layers,
        hidden=a.hidden,
        experts=a.experts,
        moe_intermediate=a.moe_intermediate,
        top_k=a.top_k,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        group_size=a.group_size or DEFAULT_GROUP[a.quant],
        quant=a.quant,
        max_position=a.max_position,
        seed=a.seed,
    )


def _run_make(args) -> int:
    spec = _spec_from_args(args)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if args.sizes_only:
        from tiermoe.models.tiny_tokenizer import build_tokenizer

        spec = replace(spec, vocab=len(build_tokenizer()))
        spec.check(formats)
        print(json.dumps(sizes(spec), indent=1))
        return 0
    make_synthetic(args.out, spec, formats, device=args.device, force=args.force)
    return 0


def _run_check(args) -> int:
    from tiermoe.bench.synthetic_check import check_synthetic

    report = check_synthetic(args.out, samples=args.samples, layers=args.layers)
    for line in report["lines"]:
        print(line)
    return 0 if report["ok"] else 1
