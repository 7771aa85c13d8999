"""The KDA decode-step kernels (kernels/triton/kda_decode.py) against their plain-torch twins
(kernels/reference_kda.py, the code models/blocks/kda.py runs on CPU), through Triton's interpreter on CPU.

Not bit for bit: the interpreter's exp and log are numpy's where torch's CPU kernels use their own
vectorised ones (each within an ulp or two of exact, not always the same rounding), and the kernels sum
in a fixed order (conv taps in order, the dk contractions and the l2norm / RMS sums as Triton reduces)
that torch's vectorised CPU reductions do not take. Tolerances:
  - fp32 values: |got - want| <= 1e-5 * |want| + 4e-6 * max|want| over the tensor. Every state and
    output element is a sum of products over dk (or the conv taps) whose terms are bounded by the
    tensor's scale, and the sum may cancel, so an element's own magnitude says little about its
    rounding error: the bound is about 32 float32 ulps of the tensor's largest element (observed: at
    most 4) plus a relative part for well-conditioned elements;
  - model-dtype (bf16) outputs additionally allow one bf16 ulp (rtol 2^-7): a float32 difference of an
    ulp can carry a value across a bf16 rounding boundary. beta is rounded to bf16 inside the step as
    well; a flip there would move a state element by 2^-8 of its update term, which the data here does
    not hit (a crossing needs the float32 sigmoids to straddle a bf16 midpoint, ~2^-16 per value).
The window shift copies values, so the conv rows must match exactly; slots outside slot_ids must not
change at all (the kernels write state rows in place, no gather or scatter).
"""

import pytest
import torch

from tiermoe.kernels.reference_kda import kda_conv_step_ref, kda_recurrent_step_ref
from tiermoe.kernels.triton.kda_decode import MAX_HEAD_DIM, kda_conv_step, kda_recurrent_step

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # softplus of f > 20
RTOL, ATOL_SCALE = 1e-5, 4e-6
BF16_ULP = 2.0**-7
SLOTS = 7
IDS = {1: [4], 3: [5, 0, 3]}  # batch size -> slot ids (non-contiguous, not in order, among SLOTS slots)


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, name
    rtol = BF16_ULP if want.dtype == torch.bfloat16 else RTOL
    atol = ATOL_SCALE * want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _conv_inputs(b: int, ch: int, kernel: int, dtype: torch.dtype, device, seed: int = 0):
    """qkv [B, 3C], conv_rows [SLOTS, 3C, K-1], slot_ids [B], weight [3C, 1, K] fp32."""
    gen = _gen(seed + 31 * b + ch + kernel)
    qkv = (torch.randn(b, ch, generator=gen) * 2).to(dtype)
    rows = (torch.randn(SLOTS, ch, kernel - 1, generator=gen) * 2).to(dtype)
    weight = torch.randn(ch, 1, kernel, generator=gen) * 0.5
    ids = torch.tensor(IDS[b], dtype=torch.long)
    return qkv.to(device), rows.to(device), ids.to(device), weight.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [4, 2])
@pytest.mark.parametrize("b", [1, 3])
def test_conv_step_matches_twin(b, kernel, dtype, device):
    qkv, rows, ids, weight = _conv_inputs(b, 3 * 32, kernel, dtype, device)
    got_rows, want_rows = rows.clone(), rows.clone()
    got = kda_conv_step(qkv, got_rows, ids, weight)
    want = kda_conv_step_ref(qkv, want_rows, ids, weight)
    _close(got, want, "y")
    assert torch.equal(got_rows, want_rows)  # the window shifted by one column, in place
    others = [s for s in range(SLOTS) if s not in IDS[b]]
    assert torch.equal(got_rows[others], rows[others])
    assert torch.equal(got_rows[ids, :, -1], qkv) and torch.equal(got_rows[ids, :, :-1], rows[ids, :, 1:])


def test_conv_step_at_glm5_next_width(device):
    """3C = 24576 channels (96 programs of CONV_BLOCK per token), a view of a wider row as qkv."""
    qkv, rows, ids, weight = _conv_inputs(3, 3 * 8192, 4, torch.bfloat16, device)
    wide = torch.cat([qkv, qkv[:, :5]], dim=1)[:, :qkv.shape[1]]  # rows strided by 3C + 5
    got_rows, want_rows = rows.clone(), rows.clone()
    _close(kda_conv_step(wide, got_rows, ids, weight), kda_conv_step_ref(qkv, want_rows, ids, weight), "y")
    assert torch.equal(got_rows, want_rows)


def _step_inputs(b: int, h: int, d: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """Keyword arguments of kda_recurrent_step: q, k, v as views of one [B, 3C] conv output (as the model
    passes them); f rows of magnitude 1, 30 and 3 in turn (30: the softplus form's threshold branch)."""
    gen = _gen(seed + 101 * b + 7 * h + d)
    c = h * d
    qkv = (torch.randn(b, 3 * c, generator=gen) * 2).to(dtype)
    q, k, v = (z.reshape(b, h, d) for z in qkv.split(c, dim=-1))
    mag = torch.tensor([1.0, 30.0, 3.0]).repeat(b)[:b, None]
    args = dict(
        q=q, k=k, v=v,
        f=(torch.randn(b, c, generator=gen) * mag).to(dtype),
        dt_bias=torch.randn(c, generator=gen),
        a_log=torch.randn(h, generator=gen),
        beta_logits=(torch.randn(b, h, generator=gen) * 3).to(dtype),
        gate=(torch.randn(b, c, generator=gen) * 2).to(dtype),
        ssm_rows=torch.randn(SLOTS, h, d, d, generator=gen) * 0.3,
        slot_ids=torch.tensor(IDS[b], dtype=torch.long),
        norm_weight=(torch.rand(d, generator=gen) + 0.5).to(dtype),
        eps=1e-5,
    )
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in args.items()}


def _check_step(b: int, h: int, d: int, lower_bound: float | None, dtype: torch.dtype, device) -> None:
    args = _step_inputs(b, h, d, dtype, device)
    rows = args.pop("ssm_rows")
    got_rows, want_rows = rows.clone(), rows.clone()
    got = kda_recurrent_step(**args, lower_bound=lower_bound, ssm_rows=got_rows)
    want = kda_recurrent_step_ref(**args, lower_bound=lower_bound, ssm_rows=want_rows)
    assert got.shape == (b, h * d)
    _close(got, want, "y")
    _close(got_rows, want_rows, "state")  # updated in place at the slot ids
    others = [s for s in range(SLOTS) if s not in IDS[b]]
    assert torch.equal(got_rows[others], rows[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("b", [1, 3])
def test_recurrent_step_matches_twin(b, lower_bound, dtype, device):
    _check_step(b, 2, 16, lower_bound, dtype, device)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_recurrent_step_at_head_dim_128(lower_bound, device):
    _check_step(3, 2, 128, lower_bound, torch.bfloat16, device)


def test_recurrent_step_at_glm5_next_size(device):
    """One decode token of a glm5_next layer: 64 heads of 128 x 128 (a few seconds interpreted)."""
    _check_step(1, 64, 128, -5.0, torch.bfloat16, device)


def test_head_dim_not_a_power_of_two(device):
    """Padded lanes (d < the block) must not leak into the norms or the state contractions."""
    _check_step(3, 3, 24, -5.0, torch.float32, device)


def test_successive_steps_stay_close(device):
    """Several steps on the same rows: the kernel's state feeds its next step (errors do not grow)."""
    args = _step_inputs(3, 2, 16, torch.float32, device)
    rows = args.pop("ssm_rows")
    got_rows, want_rows = rows.clone(), rows.clone()
    for _ in range(4):
        got = kda_recurrent_step(**args, lower_bound=-5.0, ssm_rows=got_rows)
        want = kda_recurrent_step_ref(**args, lower_bound=-5.0, ssm_rows=want_rows)
    _close(got, want, "y")
    _close(got_rows, want_rows, "state")


def test_no_tokens(device):
    qkv, rows, ids, weight = _conv_inputs(1, 3 * 32, 4, torch.float32, device)
    before = rows.clone()
    assert kda_conv_step(qkv[:0], rows, ids[:0], weight).shape == (0, 3 * 32)
    args = _step_inputs(1, 2, 16, torch.float32, device)
    args = {n: (t[:0] if n in ("q", "k", "v", "f", "beta_logits", "gate", "slot_ids") else t) for n, t in args.items()}
    state = args["ssm_rows"].clone()
    assert kda_recurrent_step(**args, lower_bound=-5.0).shape == (0, 32)
    assert torch.equal(rows, before) and torch.equal(args["ssm_rows"], state)


def test_rejects_what_it_cannot_compute(device):
    args = _step_inputs(1, 2, 16, torch.float32, device)
    with pytest.raises(ValueError, match="ssm_rows"):
        kda_recurrent_step(**{**args, "ssm_rows": args["ssm_rows"].double()}, lower_bound=-5.0)
    with pytest.raises(ValueError, match="slot_ids"):
        kda_recurrent_step(**{**args, "slot_ids": args["slot_ids"].float()}, lower_bound=-5.0)
    with pytest.raises(ValueError, match="head_dim"):
        d = 2 * MAX_HEAD_DIM
        q = torch.zeros(1, 1, d, device=device)
        kda_recurrent_step(q, q, q, q[0], args["dt_bias"], args["a_log"], -5.0, args["beta_logits"], q[0],
                           torch.zeros(1, 1, d, d, device=device), args["slot_ids"], q[0, 0], 1e-5)
    qkv, rows, ids, weight = _conv_inputs(1, 3 * 32, 4, torch.float32, device)
    with pytest.raises(ValueError, match="weight"):
        kda_conv_step(qkv, rows, ids, weight[:, :, :3])
    with pytest.raises(ValueError, match="conv_rows"):
        kda_conv_step(qkv, rows.transpose(1, 2).contiguous(), ids, weight)


# ----------------------------------------------------------------------------- through the model's block


class _Batch:
    """A pure decode batch in KDABatch's layout: sequence b is token b, in slot slots[b]."""

    def __init__(self, slots: list[int], device):
        self.slots, self.lens, self.keep = slots, [1] * len(slots), [False] * len(slots)
        self.cu = list(range(len(slots) + 1))
        self.slot_ids = torch.tensor(slots, dtype=torch.long, device=device)


class _Store:
    """KDAStateStore rows for one layer (the pure decode path reads only conv_rows and ssm_rows)."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor):
        self.conv_rows, self.ssm_rows = {0: conv}, {0: ssm}


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_block_decode_step_takes_the_kernels(lower_bound, device, monkeypatch):
    """models/blocks/kda.py wires its weights and the store's rows into the kernels as into the twins:
    the same decode steps with the kernels forced on (as on CUDA) and off give the same outputs and rows."""
    from tiermoe.models.blocks.kda import KDAttention

    hid, h, d, kernel = 48, 2, 16, 4
    gen = _gen(5)
    block = KDAttention(0, hid, h, d, kernel, 1e-5, lower_bound)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    block.to(device)
    conv = torch.randn(SLOTS, 3 * h * d, kernel - 1, generator=gen).to(device)
    ssm = (torch.randn(SLOTS, h, d, d, generator=gen) * 0.3).to(device)
    xs = [torch.randn(3, hid, generator=gen).to(device) for _ in range(3)]
    outs, rows = {}, {}
    for fused in (True, False):
        monkeypatch.setattr(KDAttention, "_fused", lambda self, x, fused=fused: fused)
        store = _Store(conv.clone(), ssm.clone())
        with torch.no_grad():
            outs[fused] = [block(x, _Batch(IDS[3], device), store) for x in xs]
        rows[fused] = store
    for j, (got, want) in enumerate(zip(outs[True], outs[False])):
        _close(got, want, f"step {j}")
    assert torch.equal(rows[True].conv_rows[0], rows[False].conv_rows[0])
    _close(rows[True].ssm_rows[0], rows[False].ssm_rows[0], "state")


def test_block_takes_the_kernels_only_on_cuda_without_gradients():
    from tiermoe.models.blocks.kda import KDAttention

    block = KDAttention(0, 48, 2, 16, 4, 1e-5, -5.0)
    with torch.no_grad():
        assert not block._fused(torch.zeros(1, 48))  # CPU: the twins
    if torch.cuda.is_available():
        block.cuda()
        x = torch.zeros(1, 48, device="cuda")
        assert not block._fused(x)  # parameters that need a gradient
        with torch.no_grad():
            assert block._fused(x)
        block.requires_grad_(False)
        assert block._fused(x) and not block._fused(x.requires_grad_())
