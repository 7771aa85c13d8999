"""glm5_next behind the serving engine's model interface (the family entry points).

The registry imports this package and calls `build_spec(hf_config, path)` for sizing and
`build_model(path, hf_config, device=, dtype=, expert_backend=)` for the model, which then
behaves like the generic decoder: `forward(ForwardBatch, kv_caches) -> hidden [T, H]`,
`logits(hidden) -> [N, V] fp32`, `cache_shapes()`, `moe_layers()`, `expert_backend`.

MLA latent and indexer rows live in the engine's paged KV cache (per-token shapes from
`cache_shapes`; KDA layers need none). KDA conv/recurrent state lives here, in static
[num_slots, ...] tensors sized once for the engine's slots (`reserve_slots`) and indexed by
the batch's `seq_slots` tensor: a sequence must start at token 0 or continue where its slot
stopped, so prefix caching cannot be used with this family (a resume from cached pages raises).

Decode CUDA graphs (runner/decode_graph.py): a pure decode step is captured whenever the
expert backend allows (`decode_graph_unsupported`); `prepare_decode_step` does the step's host
bookkeeping before each replay, `decode_step` is the recorded device work, and each MLA
layer's rows + DSA selection + attention run eagerly between the graph pieces (mla.py).

Speculative decoding hooks (ServingModel's, used by tiermoe.runner.speculative when the engine
runs with `num_speculative_tokens`): `draft_head_unsupported()` loads the MTP layer
(`enable_mtp`), `mtp_cache_shapes()` sizes its paged rows, `verify_forward(..., keep_states=[per
sequence])` records KDA states for verification, `rollback(slot, length)` drops rejected
tokens' KDA state, `mtp_forward` / `mtp_logits` draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tiermoe.models.batch import ForwardBatch
from tiermoe.models.families_common import ConfigReader
from tiermoe.models.serving import ServingModel
from tiermoe.models.spec import MLASpec, ModelSpec

from .cache import KDAStates, SeqBatch
from .config import Glm5NextConfig, load_config
from .kda import KDA_CHUNK
from .loader import detect_prefix, load_model
from .model import Glm5NextModel
from .moe import moe_spec
from .weights import Checkpoint


@dataclass(frozen=True)
class Glm5NextSpec(ModelSpec):
    """ModelSpec whose checkpoint keys carry the detected prefix (model.language_model. for the
    multimodal checkpoint layout)."""

    key_prefix: str = "model."

    def expert_keys(self, layer: int, expert: int) -> tuple[str, str, str]:
        base = f"{self.key_prefix}layers.{layer}.mlp.experts.{expert}"
        return (f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight")


def build_spec(hf_config, path: str) -> Glm5NextSpec:
    """Engine-facing summary of a glm5_next checkpoint (`path` names its config.json)."""
    model_dir = Path(path).parent
    cfg = load_config(model_dir)
    text = getattr(hf_config, "text_config", None) or hf_config
    return Glm5NextSpec(
        arch="glm5_next",
        hf_config=hf_config,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        rms_norm_eps=cfg.rms_norm_eps,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_attention_heads,
        head_dim=cfg.qk_head_dim,
        attention="mla",
        mla=MLASpec(cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, 0, cfg.v_head_dim, False),
        dense_intermediate_size=cfg.intermediate_size,
        moe=moe_spec(cfg),
        moe_layers=tuple(i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)),
        tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_ids=ConfigReader(text, path).eos_ids() or ConfigReader(hf_config, path).eos_ids(),
        max_position_embeddings=cfg.max_position_embeddings,
        # KDA prefill works in 64-token blocks (kda.kda_chunked): prompts are cut on block edges.
        recurrent_state=True,
        prefill_chunk_multiple=KDA_CHUNK,
        key_prefix=detect_prefix(Checkpoint(model_dir)),
    )


# Longest context for which pure decode steps attend through block tables (paged_decode_attention_unsupported).
STATIC_DECODE_MAX_LEN = 65536


class _PagedRows:
    """MLA rows in the engine's paged KV cache, addressed through a ForwardBatch: the row store
    of the attention cores. Its only per-step state is the step's decode tables, computed once for
    all MLA layers and keyed by the step, so a decode graph keeps the one it was recorded with and
    hands the core each replayed step's ForwardBatch."""

    def __init__(self, kv_caches: list[dict[str, torch.Tensor]] | dict[int, dict[str, torch.Tensor]]):
        self.kv = kv_caches
        self._tables: tuple[ForwardBatch, tuple[torch.Tensor, torch.Tensor]] | None = None  # (step, its tables)

    @staticmethod
    def segments(fb: ForwardBatch) -> list[tuple[int, int, int]]:
        """Per sequence: (first row in the flat tokens, tokens already held, new tokens)."""
        return [(s.q_start, s.ctx_len - s.q_len, s.q_len) for s in fb.seqs]

    def mla_rows(self, name: str, layer: int, fb: ForwardBatch, b: int, rows: torch.Tensor) -> torch.Tensor:
        cache = self.kv[layer][name]
        flat = cache.view(-1, cache.shape[-1])  # [pages * page_size, W]
        s = fb.seqs[b]
        flat[fb.slot_mapping[s.q_start:s.q_start + s.q_len]] = rows.to(flat.dtype)
        return flat[s.kv_index]

    def decode_tables(self, layer: int, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A pure decode step that carries block tables (the runner's paged decode attention):
        (seq_lens [B], the cache row of every table position [B, blocks * page_size], page 0's rows
        past a sequence's length), built on the device from the step's static tensors, so the MLA
        layers attend with shapes set by B alone and a decode graph needs no eager core. Else None."""
        if fb.block_table is None:
            return None
        if self._tables is None or self._tables[0] is not fb:  # once a step, for every MLA layer
            page = self.kv[layer]["latent"].shape[1]
            offsets = torch.arange(page, device=fb.block_table.device)
            self._tables = (fb, (fb.seq_lens, (fb.block_table.long()[:, :, None] * page + offsets).flatten(1)))
        return self._tables[1]

    def decode_rows(self, name: str, layer: int, fb: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """Store a decode step's rows [B, W] (one a sequence) and return the layer's flat cache [slots, W]."""
        cache = self.kv[layer][name]
        flat = cache.view(-1, cache.shape[-1])  # [pages * page_size, W]
        flat[fb.slot_mapping] = rows.to(flat.dtype)
        return flat


class _PagedView:
    """The cache interface of the glm5_next layers over the engine's paged KV cache."""

    def __init__(self, kda: KDAStates, kv_caches, fb: ForwardBatch):
        self.kda, self.rows, self.fb = kda, _PagedRows(kv_caches), fb

    def check(self, batch: SeqBatch, mtp: bool = False) -> None:
        pass  # capacity and page ownership are the scheduler's

    def commit(self, batch: SeqBatch, mtp: bool = False) -> None:
        pass

    def attention_step(self, batch: SeqBatch) -> tuple[ForwardBatch, _PagedRows]:
        return self.fb, self.rows


class Glm5NextEngineModel(ServingModel):
    """Adapter: engine ForwardBatch + paged KV cache -> Glm5NextModel."""

    def __init__(self, model: Glm5NextModel, spec: Glm5NextSpec, device: torch.device, dtype: torch.dtype,
                 model_dir: Path | None = None):
        super().__init__()
        self.model, self.spec = model, spec
        self.device, self.dtype = torch.device(device), dtype
        self.kda = KDAStates(model.cfg, 1, self.device, dtype)  # grows until reserve_slots fixes it
        self.model_dir = model_dir

    @property
    def expert_backend(self):
        return self.model.expert_backend

    def cache_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        cfg: Glm5NextConfig = self.model.cfg
        out = []
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda(i):
                out.append({})
            elif cfg.shares_topk(i):
                out.append({"latent": (cfg.kv_lora_rank,)})
            else:
                out.append({"latent": (cfg.kv_lora_rank,), "index": (2 * cfg.index_head_dim,)})
        return out

    def moe_layers(self) -> list:
        return self.model.moe_layers()

    def reserve_slots(self, num_slots: int) -> None:
        """KDA state rows for the engine's slots, at addresses that stay (see KDAStates)."""
        self.kda.reserve(num_slots)

    def slot_state_bytes(self) -> int:
        """Every KDA layer's conv window and fp32 delta state of one slot."""
        return KDAStates.bytes_per_slot(self.model.cfg, self.dtype)

    def decode_graph_unsupported(self) -> str | None:
        """Capturable whenever the expert backend is: KDA state is static and slot-indexed, MLA's
        per-step part is a graph break; the rest (mHC, norms, projections, router, shared
        expert) has static shapes and no host sync."""
        return self.model.expert_backend.graph_unsupported()

    def paged_decode_attention_unsupported(self, max_model_len: int) -> str | None:
        """Block tables let the MLA layers attend a decode step with static shapes (no eager core
        between graph pieces), but their DSA indexer then pools every table position each step:
        work and workspace grow with max_model_len rather than with each sequence's length, so
        past STATIC_DECODE_MAX_LEN the per-sequence cores are kept."""
        if max_model_len > STATIC_DECODE_MAX_LEN:
            return (f"--max-model-len {max_model_len} > {STATIC_DECODE_MAX_LEN}: the static MLA decode path would "
                    "pool every table position each step; MLA layers keep their per-sequence cores")
        return None

    @staticmethod
    def _seq_batch(batch: ForwardBatch, keep_states: list[bool] | None = None) -> SeqBatch:
        seqs = batch.seqs
        sb = SeqBatch([s.slot for s in seqs], [s.ctx_len - s.q_len for s in seqs], [s.q_len for s in seqs],
                      keep_states=keep_states if keep_states is not None else False, slot_ids=batch.seq_slots)
        if sb.cu[:-1] != [s.q_start for s in seqs]:
            raise ValueError("ForwardBatch sequences are not laid out back to back")
        return sb

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]],
                keep_states: list[bool] | None = None) -> torch.Tensor:
        """hidden [T, H]. keep_states: per sequence, record KDA states so `rollback` can drop
        some of this forward's tokens (speculative verification)."""
        sb = self._seq_batch(batch, keep_states)
        return self.model(batch.input_ids, sb, _PagedView(self.kda, kv_caches, batch))

    def prepare_decode_step(self, batch: ForwardBatch) -> None:
        """The host half of `forward` for a replayed decode step: continuity checked, fresh
        slots' KDA rows zeroed, slot lengths advanced."""
        sb = self._seq_batch(batch)
        view = _PagedView(self.kda, [], batch)
        self.model.begin(batch.input_ids, sb, view)
        self.model.commit(sb, view)

    @torch.inference_mode()
    def decode_step(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The device half: reads slots through `batch.seq_slots`, never the host list."""
        view = _PagedView(self.kda, kv_caches, batch)
        return self.model.layers_forward(batch.input_ids, self._seq_batch(batch), view)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden).float()

    # -- speculative decoding (MTP) ---------------------------------------------------------
    def enable_mtp(self) -> bool:
        """Load the MTP layer (once); False when the checkpoint has none."""
        from .loader import attach_mtp

        if self.model_dir is None:
            return self.model.mtp is not None
        return attach_mtp(self.model, self.model_dir)

    def draft_head_unsupported(self) -> str | None:
        return None if self.enable_mtp() else "the checkpoint has no MTP layer weights"

    def verify_forward(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]],
                       keep_states: list[bool]) -> torch.Tensor:
        return self.forward(batch, kv_caches, keep_states=keep_states)

    @property
    def mtp_layer(self) -> int:
        return self.model.cfg.mtp_layer_idx

    def mtp_cache_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-token rows of the MTP layer's MLA cache (paged like the trunk's, by position)."""
        cfg: Glm5NextConfig = self.model.cfg
        shapes = {"latent": (cfg.kv_lora_rank,)}
        if not cfg.shares_topk(cfg.mtp_layer_idx):
            shapes["index"] = (2 * cfg.index_head_dim,)
        return shapes

    @torch.inference_mode()
    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` tokens of the slot's KDA state (after a keep_states forward).
        MLA rows need nothing: rows past a sequence's length are never read."""
        self.kda.rollback(slot, length)

    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, mtp_kv: dict[str, torch.Tensor],
                    prev_hidden: torch.Tensor) -> torch.Tensor:
        """One MTP pass. batch: entries (t_{i+1} as input ids, positions = entry index i) laid out
        like a trunk batch over the MTP paged rows `mtp_kv`; prev_hidden [T, H]: h_i of each
        entry (trunk output, or an MTP hidden for a chained draft) -> MTP hidden [T, H]."""
        sb = self._seq_batch(batch)
        view = _PagedView(self.kda, {self.model.cfg.mtp_layer_idx: mtp_kv}, batch)
        return self.model.mtp_forward(batch.input_ids, prev_hidden, sb, view)

    @torch.inference_mode()
    def mtp_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.mtp_logits(mtp_hidden).float()


def build_model(model_dir, hf_config=None, *, device="cpu", dtype=None, expert_backend=None) -> Glm5NextEngineModel:
    """Load a glm5_next checkpoint (or packed store directory) for the engine."""
    model_dir = Path(model_dir)
    if hf_config is None:
        from tiermoe.models.registry import load_hf_config

        hf_config = load_hf_config(model_dir)
    spec = build_spec(hf_config, str(model_dir / "config.json"))
    dtype = dtype or torch.float32
    model = load_model(model_dir, dtype=dtype, device=device, expert_backend=expert_backend, mtp=False)
    return Glm5NextEngineModel(model, spec, torch.device(device), dtype, model_dir).eval()
