"""ModelRunner: owns the KV cache tensors, turns scheduled requests into a ForwardBatch,
runs the model and samples.

The KV cache is one set of tensors per layer, [pages, page_size, *per-token shape], sized once
at start-up; pages are handed out by the scheduler's KVPages.
"""

from __future__ import annotations

import torch

from tiermoe.models.batch import build_forward_batch
from tiermoe.runner.sampler import SampleResult, SampleRow, sample
from tiermoe.scheduler.request import Request


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    per = 0
    for shapes in model.cache_shapes():
        for shp in shapes.values():
            n = 1
            for d in shp:
                n *= d
            per += n
    return per * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model, num_pages: int, page_size: int, seed: int | None = None):
        self.model, self.page_size = model, page_size
        self.device, self.dtype = model.device, model.dtype
        self.kv_caches = [
            {name: torch.zeros(num_pages, page_size, *shp, dtype=self.dtype, device=self.device) for name, shp in s.items()}
            for s in model.cache_shapes()
        ]
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(seed if seed is not None else torch.seed())

    def generator_for(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None or req.params.greedy:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(req.params.seed)
            self.generators[req.request_id] = gen
        return gen

    def release(self, req: Request) -> None:
        self.generators.pop(req.request_id, None)

    def forward(self, items: list[tuple[Request, int]], all_logits: bool = False) -> torch.Tensor:
        """Run the model over the scheduled tokens; logits [N, V] fp32 at the requested rows."""
        chunks = [
            (req.all_ids[req.num_computed : req.num_computed + n], req.num_computed, req.pages, req.slot)
            for req, n in items
        ]
        batch = build_forward_batch(chunks, self.page_size, self.device, all_logits=all_logits)
        backend = getattr(self.model, "expert_backend", None)
        if hasattr(backend, "begin_step"):
            backend.begin_step(batch.num_tokens, decode=all(n == 1 for _, n in items))
        hidden = self.model(batch, self.kv_caches)
        return self.model.logits(hidden[batch.logits_index])

    def execute(self, items: list[tuple[Request, int]], eos_ids: tuple[int, ...]) -> tuple[list[Request], SampleResult | None]:
        """Forward + sample for the requests whose every known token is computed after this step."""
        logits = self.forward(items)
        done = [i for i, (req, n) in enumerate(items) if req.num_computed + n == req.num_tokens]
        if not done:
            return [], None
        reqs = [items[i][0] for i in done]
        rows = [SampleRow(r.params, r.prompt_ids, r.output_ids, self.generator_for(r), eos_ids) for r in reqs]
        idx = torch.tensor(done, dtype=torch.long, device=logits.device)
        return reqs, sample(logits.index_select(0, idx), rows, self.default_generator)
