"""Distil a glm5_next checkpoint's MTP layer from its own trunk (seconds on a CPU).

A random MTP layer drafts tokens the trunk almost never agrees with, so speculative decoding
on a tiny random checkpoint would only measure the cost of drafting. This trains the MTP
layer alone (its attention, norms, `eh_proj`, router, shared and routed experts; never the
trunk, the embeddings or the lm_head) to say what the trunk will say next:

    teacher data: random prompts -> the trunk's greedy continuation; one trunk forward over
                  each whole sequence gives h_i (final normed hidden) and logits_{i+1}
    MTP entry i:  (h_i, t_{i+1}) -> distribution of logits_{i+1}, i.e. the trunk's
                  next-next token (soft targets: cross-entropy to softmax(logits_{i+1}))

Agreement (MTP argmax == trunk argmax at i+1) is measured on held-out prompts' continuation
positions before and after, so the report says what a draft would actually hit. The trained
tensors replace the MTP layer's tensors in the checkpoint's safetensors file(s).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tiermoe.errors import UserError

from .cache import SeqBatch, SequenceRows
from .loader import layer_key_candidates, load_model
from .model import Glm5NextModel
from .speculative import greedy_generate


@dataclass
class DistillReport:
    steps: int
    seconds: float
    train_positions: int
    loss_first: float
    loss_last: float
    agreement_before: float  # held-out continuation positions: MTP top-1 == trunk's next-next
    agreement_after: float
    files: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


class _TrainRows(SequenceRows):
    """Cache stand-in for whole fresh sequences: the rows of a sequence are exactly the rows of
    this forward (start 0), returned as they are so gradients flow through attention."""

    kda = None

    def attention_step(self, batch: SeqBatch) -> tuple[SeqBatch, "_TrainRows"]:
        return batch, self

    def mla_rows(self, name: str, layer: int, batch: SeqBatch, b: int, rows: torch.Tensor) -> torch.Tensor:
        if batch.starts[b] != 0:
            raise ValueError("training rows: sequences must start at 0")
        return rows


@dataclass
class _Data:
    hidden: list[torch.Tensor]  # per sequence [L-1, D]: trunk h_i
    tokens: list[torch.Tensor]  # per sequence [L-1]: t_{i+1}
    target: list[torch.Tensor]  # per sequence [L-1, V]: log-softmax of the trunk's logits_{i+1}
    first_cont: list[int]  # per sequence: first entry whose target is a continuation token


@torch.no_grad()
def _teacher(model: Glm5NextModel, prompts: list[list[int]], gen_len: int) -> _Data:
    conts, _ = greedy_generate(model, prompts, gen_len)
    seqs = [p + c for p, c in zip(prompts, conts)]
    cache = model.new_cache(len(seqs), max(len(s) for s in seqs))
    batch = SeqBatch(list(range(len(seqs))), [0] * len(seqs), [len(s) for s in seqs])
    dev = model.embed_tokens.weight.device
    hidden = model(torch.tensor([t for s in seqs for t in s], device=dev), batch, cache)  # [T, D]
    data = _Data([], [], [], [])
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        h = hidden[batch.cu[b]: batch.cu[b + 1]].float()  # [L, D]
        data.hidden.append(h[:-1].clone())
        data.tokens.append(torch.tensor(s[1:], device=dev))
        data.target.append(model.logits(h[1:]).float().log_softmax(-1))
        data.first_cont.append(len(p) - 2)  # entry i targets position i+2 >= len(p)
    return data


def _mtp_logits(model: Glm5NextModel, data: _Data, idx: list[int]) -> torch.Tensor:
    """MTP logits [N, V] over all entries of sequences `idx` (differentiable in the MTP layer)."""
    batch = SeqBatch(list(range(len(idx))), [0] * len(idx), [data.tokens[i].shape[0] for i in idx])
    emb = F.embedding(torch.cat([data.tokens[i] for i in idx]), model.embed_tokens.weight)  # [N, D]
    h = model.mtp(emb, torch.cat([data.hidden[i] for i in idx]), batch, _TrainRows())
    return model.lm_head(model.mtp.shared_head.norm(h)).float()


@torch.no_grad()
def _agreement(model: Glm5NextModel, data: _Data, idx: list[int]) -> float:
    logits = _mtp_logits(model, data, idx)
    hit = total = start = 0
    for i in idx:
        n = data.tokens[i].shape[0]
        lo = start + max(data.first_cont[i], 0)
        hit += int((logits[lo:start + n].argmax(-1) == data.target[i][lo - start:].argmax(-1)).sum())
        total += start + n - lo
        start += n
    return hit / max(total, 1)


def distill_mtp(
    model_dir: str | Path, *, steps: int = 300, lr: float = 3e-3, num_prompts: int = 64,
    prompt_len: tuple[int, int] = (6, 24), gen_len: int = 48, batch_seqs: int = 16, held_out: int = 8, seed: int = 0,
    time_budget_s: float = 50.0, log=None,
) -> DistillReport:
    """Train the MTP layer of the fp32 checkpoint in `model_dir` in place (see module docstring).

    Stops after `steps` Adam steps or `time_budget_s` seconds of training, whichever comes
    first. Returns the figures; the checkpoint's MTP tensors are overwritten."""
    t0 = time.perf_counter()
    model = load_model(model_dir, dtype=torch.float32, device="cpu")
    if model.mtp is None:
        raise UserError(f"{model_dir}: config.json declares no MTP layer (num_nextn_predict_layers)")
    layer = model.cfg.mtp_layer_idx
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    lo, hi = prompt_len
    prompts = [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(num_prompts + held_out)]
    data = _teacher(model, prompts, gen_len)
    train_idx, test_idx = list(range(num_prompts)), list(range(num_prompts, num_prompts + held_out))
    if log:
        log(f"teacher data: {num_prompts} + {held_out} held-out sequences in {time.perf_counter() - t0:.1f} s")

    params = {f"mtp.{n}": p for n, p in model.mtp.named_parameters() if not n.endswith("e_score_correction_bias")}
    gate_up, down = model.expert_backend.layers[layer]
    gate_up, down = gate_up.detach().clone(), down.detach().clone()  # [E, 2I, H], [E, H, I]
    model.expert_backend.add_layer(layer, gate_up, down)
    trained = [*params.values(), gate_up, down]
    for p in trained:
        p.requires_grad_(True)
    before = _agreement(model, data, test_idx)
    opt = torch.optim.Adam(trained, lr=lr)
    t_train, losses, step = time.perf_counter(), [], 0
    while step < steps and time.perf_counter() - t_train < time_budget_s:
        pick = torch.randperm(num_prompts, generator=gen)[:batch_seqs].tolist()
        logits = _mtp_logits(model, data, pick)  # [N, V]
        target = torch.cat([data.target[i] for i in pick])  # [N, V] log-probs
        loss = -(target.exp() * logits.log_softmax(-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if log and step % 50 == 0:
            log(f"step {step}: loss {losses[-1]:.3f}")
    for p in trained:
        p.requires_grad_(False)
    after = _agreement(model, data, test_idx)
    files = _write_back(Path(model_dir), model, layer, {n: p.detach() for n, p in params.items()}, gate_up, down)
    first_loss, last_loss = (round(losses[0], 4), round(losses[-1], 4)) if losses else (float("nan"), float("nan"))
    return DistillReport(step, round(time.perf_counter() - t0, 2), sum(int(data.tokens[i].shape[0]) for i in train_idx),
                         first_loss, last_loss, round(before, 4), round(after, 4), files)


def _write_back(model_dir: Path, model: Glm5NextModel, layer: int, params: dict[str, torch.Tensor],
                gate_up: torch.Tensor, down: torch.Tensor) -> list[str]:
    """Replace the MTP layer's tensors wherever the checkpoint keeps them (same keys, dtypes)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from .loader import expert_weight_keys

    prefix = model.checkpoint_prefix
    inter = model.cfg.moe_intermediate_size
    new: dict[str, torch.Tensor] = {}
    wanted: dict[str, list[str]] = {}  # parameter -> candidate keys (hub layout first)
    for name in params:
        wanted[name] = layer_key_candidates(prefix, layer, name[len("mtp."):])
    files = sorted(model_dir.glob("*.safetensors"))
    present: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                present[k] = f
    for name, value in params.items():
        key = next((k for k in wanted[name] if k in present), None)
        if key is None:
            raise UserError(f"{model_dir}: no tensor for MTP parameter '{name}' ({wanted[name][0]})")
        new[key] = value
    fused = f"{prefix}layers.{layer}.mlp.experts.gate_up_proj"
    if fused in present:
        new[fused] = gate_up
        new[f"{prefix}layers.{layer}.mlp.experts.down_proj"] = down
    else:
        for e in range(gate_up.shape[0]):
            keys = expert_weight_keys(prefix, layer, e)
            new[keys["gate_proj"]], new[keys["up_proj"]] = gate_up[e, :inter], gate_up[e, inter:]
            new[keys["down_proj"]] = down[e]
    touched = []
    for f in files:
        mine = {k: v for k, v in new.items() if present.get(k) == f}
        if not mine:
            continue
        state = load_file(str(f))
        for k, v in mine.items():
            state[k] = v.to(state[k].dtype).contiguous().clone()
        save_file(state, str(f), metadata={"format": "pt"})
        touched.append(f.name)
    return touched
