"""Calibrate the glm4_moe router of a dense-to-MoE conversion for sparse top-k routing.

With all experts routed the router is irrelevant (every weight is exactly 1.0). With top_k < E
it decides which slices of the dense MLP a token keeps, and an all-zero router would pick the
same arbitrary slices for every token. There is no router in the dense model to copy, so we fit
one: run the converted model (all experts on, hence the dense model) over a short built-in text,
record each MoE layer's input x [T, H] and each expert's output norm ||expert_e(x)|| [T, E],
and fit a linear map x -> log ||expert_e(x)|| by ridge regression. Routing then keeps, per
token, the k slices predicted to contribute most.

Fitting it into glm4_moe's router (sigmoid scores, selection on score + e_score_correction_bias,
weights from the scores alone, normalised, times routed_scaling_factor):
  - the fitted logits z = x W + b are scaled by a small alpha so sigmoid(alpha z) stays within
    a few percent of 0.5; the top-k order is unchanged and the normalised weights are ~1/k,
    so with routed_scaling_factor = k each kept slice counts ~once, as in the dense sum;
  - the intercept b goes into e_score_correction_bias as alpha * b / 4 (the slope of sigmoid
    at 0), since glm4_moe's router has no bias of its own but selection adds this one.

The quality of the sparse model is measured on the calibration tokens (relative error of the
MoE output against the dense MLP output, against a random choice of k experts as a baseline)
and recorded in tiermoe_import.json. This is a cheap, data-light approximation, not a trained
router: the exact all-experts conversion is the default.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tiermoe.importers.moeify import ExpertPlan

CALIBRATION_TEXT = [
    "The city council met on Tuesday to discuss the new budget. Several members argued that the"
    " money for road repairs should come before the plans for a new library, while others said"
    " that schools and public transport needed more support after a difficult winter.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide"
    " to make glucose and oxygen. It takes place mostly in the leaves, inside small structures"
    " called chloroplasts, which contain the pigment chlorophyll.",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            result.append(a[i]); i += 1\n        else:\n"
    "            result.append(b[j]); j += 1\n    return result + a[i:] + b[j:]\n",
    "Once upon a time, a young fox lived at the edge of a quiet forest. Every morning she walked"
    " to the river to watch the fish, and every evening she told the owls what she had seen.",
    "To convert a temperature from Celsius to Fahrenheit, multiply by nine, divide by five and"
    " add thirty-two. For example, 20 degrees Celsius is 68 degrees Fahrenheit, and 100 degrees"
    " Celsius, the boiling point of water at sea level, is 212 degrees Fahrenheit.",
]
CALIBRATION_CHATS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    (
        "Give me three tips for sleeping better.",
        "Keep a regular schedule, avoid screens before bed, and keep your room cool and dark.",
    ),
    ("Translate 'good morning' into Spanish.", "'Good morning' in Spanish is 'buenos días'."),
    ("How many legs does a spider have?", "A spider has eight legs."),
]
SIGMOID_SPAN = 0.05  # max |alpha * z| on the calibration tokens
RIDGE = 1e-2  # relative to the mean eigenvalue of X^T X


def _calibration_ids(tokenizer, vocab_size: int) -> list[list[int]]:
    """Token ids of the built-in calibration text; random ids when the file had no tokenizer."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (128,), generator=gen).tolist() for _ in range(4)]
    seqs = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in CALIBRATION_TEXT]
    if getattr(tokenizer, "chat_template", None):
        for question, answer in CALIBRATION_CHATS:
            msgs = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            text = tokenizer.apply_chat_template(msgs, tokenize=False)
            seqs.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [s for s in seqs if s]


@torch.no_grad()
def _expert_norms(mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert outputs' norms [T, E], the routed outputs [E, T, H] and the shared output [T, H]."""
    gate_up = mlp.experts.gate_up_proj.float()  # [E, 2w, H]
    down = mlp.experts.down_proj.float()  # [E, H, w]
    g, u = torch.einsum("th,eih->eti", x, gate_up).chunk(2, dim=-1)  # [E, T, w] each
    outs = torch.einsum("eti,ehi->eth", F.silu(g) * u, down)  # [E, T, H]
    shared = mlp.shared_experts(x)  # [T, H]
    return outs.norm(dim=-1).T, outs, shared


def _rel_err(chosen: torch.Tensor, outs: torch.Tensor, shared: torch.Tensor) -> float:
    """Mean over tokens of ||sparse - dense|| / ||dense|| for a [T, k] choice of experts."""
    dense = outs.sum(0) + shared  # [T, H]
    picked = torch.gather(outs.permute(1, 0, 2), 1, chosen[..., None].expand(-1, -1, outs.shape[-1]))  # [T, k, H]
    sparse = picked.sum(1) + shared
    return ((sparse - dense).norm(dim=-1) / dense.norm(dim=-1).clamp_min(1e-12)).mean().item()


def calibrate(model_dir: Path, router_shard: str, plan: ExpertPlan, provenance: dict) -> None:
    """Fit every layer's router for `plan.top_k` and rewrite `router_shard` in `model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    e, k = plan.routed, plan.top_k
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir)) if (model_dir / "tokenizer.json").is_file() else None
    # Load with all experts on: the MoE then equals the dense model whose activations we record.
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, num_experts_per_tok=e, routed_scaling_factor=float(e)
    ).eval()
    layers = model.model.layers
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]

    def keep_input(i: int):
        # The MLP's input x [B, S, H] is the router's input: kept flattened to [B * S, H].
        return lambda _module, args: inputs[i].append(args[0].reshape(-1, args[0].shape[-1]))

    hooks = [layer.mlp.register_forward_pre_hook(keep_input(i)) for i, layer in enumerate(layers)]
    with torch.no_grad():
        for ids in _calibration_ids(tokenizer, model.config.vocab_size):
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()

    tensors = load_file(str(model_dir / router_shard))
    gen = torch.Generator().manual_seed(0)
    errs_fit, errs_rand, errs_oracle = [], [], []
    for i, layer in enumerate(layers):
        x = torch.cat(inputs[i]).float()  # [T, H]
        norms, outs, shared = _expert_norms(layer.mlp, x)  # [T, E], [E, T, H], [T, H]
        y = torch.log(norms + 1e-6)  # [T, E]
        xm, ym = x.mean(0), y.mean(0)
        xc, yc = x - xm, y - ym
        gram = xc.T @ xc  # [H, H]
        lam = RIDGE * gram.diagonal().mean().clamp_min(1e-12)
        w = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0]), xc.T @ yc)  # [H, E]
        b = ym - xm @ w  # [E]
        z = x @ w  # [T, E]
        alpha = SIGMOID_SPAN / z.abs().max().clamp_min(1e-12).item()
        prefix = f"model.layers.{i}.mlp.gate"
        tensors[f"{prefix}.weight"] = (alpha * w.T).contiguous().float()  # [E, H]
        tensors[f"{prefix}.e_score_correction_bias"] = (alpha * b / 4).float()  # [E]
        # What the router now selects (same arithmetic as glm4_moe's router) vs a random choice.
        scores = torch.sigmoid(alpha * z) + alpha * b / 4
        errs_fit.append(_rel_err(scores.topk(k, dim=-1).indices, outs, shared))
        rand = torch.rand(x.shape[0], e, generator=gen).topk(k, dim=-1).indices
        errs_rand.append(_rel_err(rand, outs, shared))
        errs_oracle.append(_rel_err(norms.topk(k, dim=-1).indices, outs, shared))  # best a norm ranking can do
    save_file(tensors, str(model_dir / router_shard), metadata={"format": "pt"})
    provenance["moe_from_dense"]["calibration"] = {
        "tokens": int(sum(t.shape[0] for t in inputs[0])),
        "text": "built-in" if tokenizer is not None else "random token ids (no tokenizer)",
        "mlp_rel_error_fitted_router": round(sum(errs_fit) / len(errs_fit), 4),
        "mlp_rel_error_random_experts": round(sum(errs_rand) / len(errs_rand), 4),
        "mlp_rel_error_true_norm_ranking": round(sum(errs_oracle) / len(errs_oracle), 4),
        "sigmoid_span": SIGMOID_SPAN,
    }
