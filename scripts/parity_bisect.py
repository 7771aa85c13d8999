"""Find the first operation where our engine and the transformers reference part ways.

Runs one prompt through both models (one prefill chunk, so every matrix has the same shape on
both sides) and, for every module the two share by name (model.layers.N.self_attn.q_proj, ...),
compares our module's input and output with the reference's. After the comparison the hook
hands the reference's output on, so every module is measured on identical inputs: a module
whose output differs while its input agrees is the culprit; an input that differs although the
previous module agreed points at the code between them (attention kernel, residual add,
routing).

Usage: PYTHONPATH=src python3 scripts/parity_bisect.py ARCH [--device cuda] [--dtype bfloat16]
       [--prompt N] [--limit 40]
Prints one line per module in execution order (max |diff| of input and output) and the first
module whose output differs on identical input.
"""

from __future__ import annotations

import argparse
import tempfile

import torch


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for item in x:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


def _router_parts(out):
    """(ids, weights) from either side's router output (ours: (ids, w); reference: a tuple
    holding logits, weights and integer indices in an order that varies by version)."""
    ids = next(t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point())
    floats = [t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == ids.shape]
    return ids, floats[-1]


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return "-"
    if a.numel() != b.numel():
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    d = (a.reshape(-1).double() - b.reshape(-1).double()).abs().max().item()
    return "0" if d == 0 else f"{d:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("arch")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=4, help="index into the parity prompt set")
    ap.add_argument("--limit", type=int, default=60, help="lines to print")
    args = ap.parse_args()

    import transformers

    from tiermoe.engine.build import build_engine_core
    from tiermoe.eval.parity import engine_logits, parity_prompts
    from tiermoe.models.fp32_params import reference_class
    from tiermoe.models.tiny import write_tiny

    tmp = tempfile.mkdtemp(prefix="bisect-")
    write_tiny(args.arch, tmp)
    engine = build_engine_core(tmp, device=args.device, dtype=args.dtype, max_num_seqs=1)
    ours = engine.model
    dtype = ours.dtype if hasattr(ours, "dtype") else getattr(torch, args.dtype)
    ids = parity_prompts(engine.tokenizer, engine.vocab_size)[args.prompt]

    config = transformers.AutoConfig.from_pretrained(tmp)
    cls = reference_class(config.model_type) or transformers.AutoModelForCausalLM
    ref = (
        cls.from_pretrained(tmp, dtype=getattr(torch, args.dtype), experts_implementation="eager")
        .to(args.device)
        .eval()
    )

    ours_mods = dict(ours.named_modules())
    ref_mods = dict(ref.named_modules())

    # The reference may nest the language model one level deeper (model.language_model.layers...).
    def ref_name(name: str) -> str | None:
        for cand in (name, name.replace("model.", "model.language_model.", 1), "model.language_model." + name):
            if cand in ref_mods:
                return cand
        return None

    shared = [(n, ref_name(n)) for n in ours_mods if n and ref_name(n) is not None]
    record: dict[str, dict] = {}
    order: list[str] = []

    def ref_hook(name):
        def hook(mod, inputs, output):
            record.setdefault(name, {})["in"] = (
                _first_tensor(inputs).detach().clone() if _first_tensor(inputs) is not None else None
            )
            record[name]["out"] = output

        return hook

    handles = [ref_mods[r].register_forward_hook(ref_hook(n)) for n, r in shared]
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids], device=args.device)).logits[0].float()
    for h in handles:
        h.remove()

    rows = []

    def our_hook(name):
        def hook(mod, inputs, output):
            if name not in record:
                return None
            rec = record[name]
            order.append(name)
            in_d = _diff(_first_tensor(inputs), rec.get("in"))
            if isinstance(output, tuple) and name.endswith(".gate") and len(output) == 2:
                if not isinstance(rec["out"], (tuple, list)):
                    rows.append((name, in_d, "reference router returns logits only; not compared"))
                    return None
                o_ids, o_w = output
                r_ids, r_w = _router_parts(rec["out"])
                same_ids = torch.equal(o_ids.sort(-1)[0], r_ids.reshape(o_ids.shape).sort(-1)[0])
                rows.append(
                    (
                        name,
                        in_d,
                        f"ids {'same' if same_ids else 'DIFFER'}; weights (ref order) "
                        + _diff(
                            o_w.gather(1, o_ids.argsort(-1)),
                            r_w.reshape(o_w.shape).gather(1, r_ids.reshape(o_ids.shape).argsort(-1)),
                        ),
                    )
                )
                return (r_ids.reshape(o_ids.shape).to(o_ids.dtype), r_w.reshape(o_w.shape).to(o_w.dtype))
            r_out = _first_tensor(rec["out"])
            o_out = _first_tensor(output)
            rows.append((name, in_d, _diff(o_out, r_out)))
            if isinstance(output, torch.Tensor) and r_out is not None and r_out.numel() == output.numel():
                return r_out.reshape(output.shape).to(output.dtype)
            return None

        return hook

    handles = [ours_mods[n].register_forward_hook(our_hook(n)) for n, _ in shared]
    ours_logits = engine_logits(engine, ids, chunk=len(ids))
    for h in handles:
        h.remove()
    # A clean run without substitution, for the end-to-end figure.
    clean = engine_logits(engine, ids, chunk=len(ids))

    print(
        f"{args.arch} {args.dtype} {args.device}: prompt {args.prompt} ({len(ids)} tokens); "
        f"end to end max|dlogit| {_diff(clean, ref_logits.cpu())}, "
        f"with substitution {_diff(ours_logits, ref_logits.cpu())}"
    )
    culprit = None
    for name, in_d, out_d in rows[: args.limit]:
        print(f"  {name:55s} in {in_d:>12s}   out {out_d}")
    for name, in_d, out_d in rows:
        if in_d in ("0", "-") and out_d not in ("0",) and not out_d.startswith("ids same; weights (ref order) 0"):
            culprit = (name, out_d)
            break
    first_in = next(((n, i) for n, i, _ in rows if i not in ("0", "-")), None)
    print(f"first module differing on identical input: {culprit}")
    print(f"first module whose input differs (code between modules): {first_in}")


if __name__ == "__main__":
    main()
