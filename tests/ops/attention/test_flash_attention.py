"""flash_attention: output, dq, dk and dv against a float64 oracle written here (explicit softmax
under a dense boolean mask built from the definitions in test_windows.py), and
attention_reference against the same oracle.

docs/design.md's rule: fp32 relative error < 1e-5; bf16 / fp16 at most 2x the error of PyTorch's own
attention in that dtype (scaled_dot_product_attention with the same boolean mask, and the
gradients of its backward). Padding in q, k, v is filled with NaN: it must reach nothing.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from triton.tools.tensor_descriptor import TensorDescriptor

from lorafuse.ops.attention import flash_attention as attention_module
from lorafuse.ops.attention.windows import (windows_from_padding_mask, windows_from_position_ids,
                                            with_sliding_window)
from lorafuse.ops.attention.flash_attention import attention_reference, flash_attention
from tests.ops._helpers import DTYPES, FP32_TOL, HALF_FLOOR, assert_close, dtype_id, rel_err
from tests.ops.attention.test_windows import (causal_relation, packed_relation, padding_relation,
                                              sliding_relation)

GRADS = ("dq", "dk", "dv")


# ----------------------------------------------------------------------------------------------
# Oracle, PyTorch's own attention, and the kernel, each run forward and backward.

def dense_mask(b, n_q, n_k, causal, relation=None) -> torch.Tensor:
    """[B, Nq, Nk] bool: which keys each query attends."""
    allowed = torch.ones(b, n_q, n_k, dtype=torch.bool)
    if causal:
        allowed = allowed & causal_relation(n_q, n_k)
    if relation is not None:
        allowed = allowed & relation
    return allowed


def _sanitize(q, k, v, allowed):
    # queries without keys and keys nobody sees (padding, maybe NaN) are replaced by zeros
    a = allowed[:, None]                                  # [B, 1, Nq, Nk]
    has_key, seen = a.any(-1, keepdim=True), a.any(-2)[..., None]
    return torch.where(has_key, q, 0), torch.where(seen, k, 0), torch.where(seen, v, 0), has_key


def oracle(q, k, v, allowed, scale):
    """Float64 attention, written out: exp(s - max) / sum over the allowed keys, 0 without any."""
    # q: [B, Hq, Nq, D], k, v: [B, Hkv, Nk, D], allowed: [B, Nq, Nk]
    q, k, v = q.double(), k.double(), v.double()
    kv_head = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])  # query head h reads K/V head h // group
    k, v = k[:, kv_head], v[:, kv_head]
    q, k, v, _ = _sanitize(q, k, v, allowed)
    s = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    s = s.masked_fill(~allowed[:, None], -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, 0)
    e = torch.exp(s - m)
    p = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.einsum("bhij,bhjd->bhid", p, v)


def plain(q, k, v, allowed, scale):
    """PyTorch's attention in the inputs' dtype, masked the same way (rows without keys: 0)."""
    q, k, v, has_key = _sanitize(q, k, v, allowed)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None] | ~has_key, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return torch.where(has_key, out, 0)


def run(fn, q, k, v, grad_out):
    """{'out', 'dq', 'dk', 'dv'} of fn(q, k, v) with grad_out; q, k, v keep their strides."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return dict(out=out.detach(), dq=dq, dk=dk, dv=dv)


def compare(got: dict, exact: dict, dtype, plain_results: dict | None = None, tol: float | None = None,
            what: str = "flash_attention"):
    """docs/design.md's tolerance rule on each entry. An entry whose exact value is 0 (dq, dk with one key per
    query) is measured against the largest exact entry of the case instead of itself."""
    size = max(torch.linalg.vector_norm(t.double()).item() for t in exact.values())
    for name, want in exact.items():
        have = got[name]
        label = f"{what} {name}"
        assert have.shape == want.shape, f"{label}: shape {tuple(have.shape)} != {tuple(want.shape)}"
        if tol is None:
            assert have.dtype == dtype, f"{label}: dtype {have.dtype} != {dtype}"
        if size == 0:  # nothing attends anything: exactly zero
            assert torch.equal(have, torch.zeros_like(have)), f"{label}: not all zero"
            continue
        if torch.linalg.vector_norm(want).item() > 0:
            if tol is not None:
                err = rel_err(have, want)
                assert err < tol, f"{label}: relative error {err:.3e} (allowed < {tol:.0e})"
            else:
                assert_close(have, want, dtype, None if plain_results is None else plain_results[name], label)
            continue
        err = torch.linalg.vector_norm(have.double()).item() / size
        if tol is not None or dtype == torch.float32:
            bound = tol or FP32_TOL
            assert err < bound, f"{label}: error {err:.3e} of the case's size (allowed < {bound:.0e})"
        else:
            plain_err = torch.linalg.vector_norm(plain_results[name].double()).item() / size
            bound = 2 * plain_err + HALF_FLOOR
            assert err <= bound, f"{label}: error {err:.3e} > 2 x PyTorch's {plain_err:.3e} (+{HALF_FLOOR:.0e})"


def check(q, k, v, causal=False, scale=None, windows=None, relation=None, grad_out=None, check_reference=True):
    """flash_attention(q, k, v, causal, scale, windows) forward and backward against the oracle under
    the mask `relation` (& causal); the rows and keys without any partner must be exact zeros.
    Returns the kernel's results and the exact ones."""
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    dtype = q.dtype
    allowed = dense_mask(b, n_q, n_k, causal, relation)
    if grad_out is None:
        grad_out = torch.randn(b, hq, n_q, d).to(dtype)
    sm_scale = 1 / math.sqrt(d) if scale is None else scale
    exact = run(lambda q, k, v: oracle(q, k, v, allowed, sm_scale), q.double(), k.double(), v.double(),
                grad_out.double())
    got = run(lambda q, k, v: flash_attention(q, k, v, causal=causal, scale=scale, windows=windows),
              q, k, v, grad_out)
    plain_results = run(lambda q, k, v: plain(q, k, v, allowed, sm_scale), q, k, v, grad_out)
    for name, t in got.items():
        assert torch.isfinite(t).all(), f"flash_attention {name}: {(~torch.isfinite(t)).sum().item()} non-finite"
    compare(got, exact, dtype, plain_results)
    # queries without keys output exact zeros and get zero dq; keys nobody sees get zero dk, dv
    no_key = ~allowed.any(-1)                                       # [B, Nq]
    unseen = ~allowed.any(-2)                                       # [B, Nk]
    assert torch.all(got["out"].transpose(1, 2)[no_key] == 0), "rows without keys must output 0"
    assert torch.all(got["dq"].transpose(1, 2)[no_key] == 0), "rows without keys must get dq = 0"
    assert torch.all(got["dk"].transpose(1, 2)[unseen] == 0), "keys nobody sees must get dk = 0"
    assert torch.all(got["dv"].transpose(1, 2)[unseen] == 0), "keys nobody sees must get dv = 0"
    if check_reference:
        # the module's own reference (float64) is the same computation as the oracle
        ref = run(lambda q, k, v: attention_reference(q, k, v, causal, scale, windows), q.double(), k.double(),
                  v.double(), grad_out.double())
        compare(ref, exact, torch.float64, tol=1e-12, what="attention_reference")
    return got, exact


def qkv(b, hq, hkv, n_q, n_k, d, dtype):
    return torch.randn(b, hq, n_q, d).to(dtype), torch.randn(b, hkv, n_k, d).to(dtype), \
        torch.randn(b, hkv, n_k, d).to(dtype)


def fill_padding(q, k, v, mask, q_len, value=math.nan):
    """q, k, v with `value` at the positions the keep-mask [B, Nk] marks as padding."""
    pad_k = ~mask.bool()                   # [B, Nk]
    pad_q = pad_k[:, -q_len:]              # queries are the last q_len positions
    q, k, v = q.clone(), k.clone(), v.clone()
    q.transpose(1, 2)[pad_q] = value
    k.transpose(1, 2)[pad_k] = value
    v.transpose(1, 2)[pad_k] = value
    return q, k, v


def left_right_mask(n, real_counts, left):
    return torch.tensor([[int(t >= n - c) if is_left else int(t < c) for t in range(n)]
                         for c, is_left in zip(real_counts, left)])


# ----------------------------------------------------------------------------------------------
# The oracle itself

def test_oracle_is_softmax_attention():
    # unmasked, no GQA: the textbook formula, in float64
    q, k, v = qkv(2, 3, 3, 5, 9, 16, torch.float64)
    want = torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v
    assert rel_err(oracle(q, k, v, dense_mask(2, 5, 9, False), 0.25), want) < 1e-14
    # causal, GQA 3: query head h reads K/V head h // 3; rows see keys j <= i + 4
    q, k, v = qkv(1, 6, 2, 5, 9, 16, torch.float64)
    out = oracle(q, k, v, dense_mask(1, 5, 9, True), 0.25)
    for h in range(6):
        for i in range(5):
            kk, vv = k[0, h // 3, : i + 5], v[0, h // 3, : i + 5]
            assert rel_err(out[0, h, i], torch.softmax(kk @ q[0, h, i] / 4, 0) @ vv) < 1e-14


# ----------------------------------------------------------------------------------------------
# Lengths, causal, GQA

# (B, Hq, Hkv, Nq, Nk, D)
SMALL = [(1, 1, 1, 1, 1, 16), (2, 4, 1, 1, 1, 32), (2, 2, 2, 7, 33, 16), (1, 4, 1, 7, 33, 32),
         (1, 8, 1, 7, 33, 16), (2, 8, 2, 7, 33, 32), (1, 2, 2, 33, 7, 16)]
LARGE = [(1, 2, 1, 113, 203, 32), (1, 1, 1, 128, 217, 16)]


def case_id(case):
    return "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*case)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", SMALL, ids=case_id)
def test_attention(case, dtype, causal):
    b, hq, hkv, n_q, n_k, d = case
    check(*qkv(*case, dtype), causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("case", LARGE, ids=case_id)
def test_attention_long(case, dtype, causal):
    check(*qkv(*case, dtype), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_head_dims(d, dtype):
    check(*qkv(1, 2, 1, 9, 20, d, dtype), causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("scale, causal", [(0.3, False), (2.0, True), (0.01, True)])
def test_scale(scale, causal, dtype):
    q, k, v = qkv(1, 2, 1, 17, 40, 32, dtype)
    check(q, k, v, causal=causal, scale=scale)


def test_scale_is_used():
    # a wrong scale must be visible: the default and 0.3 give different outputs
    q, k, v = qkv(1, 1, 1, 7, 9, 16, torch.float32)
    assert rel_err(flash_attention(q, k, v, scale=0.3), flash_attention(q, k, v)) > 1e-3


# ----------------------------------------------------------------------------------------------
# Strided inputs

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("layout", ["bnhd", "fused_qkv", "last_dim_strided"])
def test_strided_inputs(layout, dtype):
    b, hq, hkv, n, d = 2, 4, 2, 33, 32
    if layout == "bnhd":  # Hugging Face: [B, N, H, D] projections, transposed to [B, H, N, D]
        q = torch.randn(b, n, hq, d).to(dtype).transpose(1, 2)
        k = torch.randn(b, n, hkv, d).to(dtype).transpose(1, 2)
        v = torch.randn(b, n, hkv, d).to(dtype).transpose(1, 2)
    elif layout == "fused_qkv":  # one [B, N, (Hq + 2 Hkv), D] projection, split
        qkv_ = torch.randn(b, n, hq + 2 * hkv, d).to(dtype)
        q, k, v = (t.transpose(1, 2) for t in qkv_.split([hq, hkv, hkv], 2))
    else:  # head dim not unit-stride
        q = torch.randn(b, hq, d, n).to(dtype).transpose(2, 3)
        k = torch.randn(b, hkv, d, n).to(dtype).transpose(2, 3)
        v = torch.randn(b, hkv, d, n).to(dtype).transpose(2, 3)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    got, _ = check(q, k, v, causal=True)
    # the same values, contiguous, give the same output, bit for bit
    with torch.no_grad():
        again = flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(again, got["out"])


# ----------------------------------------------------------------------------------------------
# Padding, decode, packed sequences, sliding windows

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_batch_with_nan_padding(causal, dtype):
    # rows: right padding, left padding, none; the padding of q, k and v is NaN
    b, hq, hkv, n, d = 3, 4, 2, 33, 32
    mask = left_right_mask(n, [20, 25, 33], [False, True, False])
    q, k, v = fill_padding(*qkv(b, hq, hkv, n, n, d, dtype), mask, n)
    windows = windows_from_padding_mask(mask, n)
    got, _ = check(q, k, v, causal, windows=windows, relation=padding_relation(mask, n))
    pad = ~mask.bool()
    assert torch.all(got["out"].transpose(1, 2)[pad] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_padded_batch_long(dtype):
    b, hq, hkv, n, d = 2, 2, 1, 113, 16
    mask = left_right_mask(n, [70, 101], [True, False])
    q, k, v = fill_padding(*qkv(b, hq, hkv, n, n, d, dtype), mask, n)
    check(q, k, v, True, windows=windows_from_padding_mask(mask, n), relation=padding_relation(mask, n))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n_q", [1, 4])
def test_decode_left_padded(n_q, causal, dtype):
    # a decode step (1 query) or a short chunk against a 37-key cache; rows padded on the left by
    # 0, 5 and 36 - n_q... positions (the last row has only its query tokens real)
    b, hq, hkv, n_k, d = 3, 4, 1, 37, 32
    mask = left_right_mask(n_k, [37, 32, n_q], [True, True, True])
    q, k, v = fill_padding(*qkv(b, hq, hkv, n_q, n_k, d, dtype), mask, n_q)
    check(q, k, v, causal, windows=windows_from_padding_mask(mask, n_q), relation=padding_relation(mask, n_q))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fully_masked_rows(dtype):
    # an all-padding row beside a real one, and causal rows before the first key (Nq > Nk)
    b, hq, hkv, n, d = 2, 2, 1, 20, 16
    mask = torch.tensor([[0] * n, [0] * 4 + [1] * (n - 4)])
    q, k, v = fill_padding(*qkv(b, hq, hkv, n, n, d, dtype), mask, n)
    got, _ = check(q, k, v, True, windows=windows_from_padding_mask(mask, n), relation=padding_relation(mask, n))
    assert torch.all(got["out"][0] == 0) and torch.all(got["dq"][0] == 0)
    assert torch.all(got["dk"][0] == 0) and torch.all(got["dv"][0] == 0)
    got, _ = check(*qkv(1, 2, 1, 30, 9, 16, dtype), causal=True)  # rows 0..20 see no key
    assert torch.all(got["out"][:, :, :21] == 0) and torch.any(got["out"][:, :, 21:] != 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_everything_masked(dtype):
    # no query has a key: output and gradients are exact zeros (not NaN), whatever q, k, v hold
    b, hq, hkv, n, d = 2, 2, 2, 17, 16
    mask = torch.zeros(b, n, dtype=torch.long)
    q, k, v = fill_padding(*qkv(b, hq, hkv, n, n, d, dtype), mask, n)
    for causal in (False, True):
        got = run(lambda q, k, v: flash_attention(q, k, v, causal, windows=windows_from_padding_mask(mask, n)),
                  q, k, v, torch.randn(b, hq, n, d))
        for name, t in got.items():
            assert torch.equal(t, torch.zeros_like(t)), f"{name} (causal={causal}) is not all zero"


PACKED_ROWS = [[10, 17, 13], [25, 9]]  # sequence lengths; row 1 ends in 6 padding tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_sequences_equal_each_alone(causal, dtype):
    b, hq, hkv, n, d = 2, 2, 1, 40, 16
    position_ids = torch.zeros(b, n, dtype=torch.long)
    mask = torch.zeros(b, n, dtype=torch.long)
    spans = []
    for r, lengths in enumerate(PACKED_ROWS):
        t = 0
        for length in lengths:
            position_ids[r, t:t + length] = torch.arange(length)
            mask[r, t:t + length] = 1
            spans.append((r, t, t + length))
            t += length
    q, k, v = fill_padding(*qkv(b, hq, hkv, n, n, d, dtype), mask, n)
    grad_out = torch.randn(b, hq, n, d).to(dtype)
    windows = windows_from_position_ids(position_ids, mask)
    got, exact = check(q, k, v, causal, windows=windows, relation=packed_relation(position_ids, mask),
                       grad_out=grad_out)
    # each sequence alone, without windows: the kernel's results, pieced together, and the oracle's
    alone = {name: torch.zeros_like(t) for name, t in got.items()}
    alone_exact = {name: torch.zeros_like(t) for name, t in exact.items()}
    for r, s, e in spans:
        piece = [t[r:r + 1, :, s:e] for t in (q, k, v, grad_out)]
        one = run(lambda q, k, v: flash_attention(q, k, v, causal), *piece)
        one_exact = run(lambda q, k, v: oracle(q, k, v, dense_mask(1, e - s, e - s, causal), 1 / math.sqrt(d)),
                        *(t.double() for t in piece))
        for name in got:
            alone[name][r:r + 1, :, s:e] = one[name]
            alone_exact[name][r:r + 1, :, s:e] = one_exact[name]
    compare(alone_exact, exact, torch.float64, tol=1e-12, what="oracle per sequence vs packed")
    plain_results = None
    if dtype != torch.float32:
        allowed = dense_mask(b, n, n, causal, packed_relation(position_ids, mask))
        plain_results = run(lambda q, k, v: plain(q, k, v, allowed, 1 / math.sqrt(d)), q, k, v, grad_out)
    compare(alone, exact, dtype, plain_results, what="flash_attention per sequence")
    if dtype == torch.float32:
        for name in got:
            err = rel_err(got[name], alone[name])
            assert err < FP32_TOL, f"{name}: packed vs each sequence alone, relative difference {err:.3e}"


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # masked-out scores only
@pytest.mark.parametrize("dtype, shift", [(torch.float32, -110.0), (torch.bfloat16, -110.0), (torch.float16, -20.0),
                                          (torch.float16, -12.0)], ids=lambda x: dtype_id(x) if
                         isinstance(x, torch.dtype) else f"shift{x:g}")
def test_negative_scores_after_a_tile_without_keys(dtype, shift):
    # Softmax is shift-invariant: `shift` added to every score of every row changes nothing (q and
    # k get an extra component c and -c). The second packed sequence starts 70 keys in, so its
    # first query rows share a query tile with the first sequence's rows and pass key tiles
    # (16 wide here, 32-64 on a GPU) that hold none of their keys before their own. A running max
    # not kept at -inf there clamps at 0: P = exp(score) then underflows (fp16 P below 2^-24, fp32
    # exp below 2^-149) and those rows come out as zeros.
    b, hq, hkv, n, d, scale = 1, 1, 1, 120, 16, 0.25
    position_ids = torch.cat([torch.arange(70), torch.arange(50)])[None]
    q, k, v = qkv(b, hq, hkv, n, n, d, torch.float32)
    c = math.sqrt(-shift / scale)
    q[..., -1], k[..., -1] = c, -c
    q, k, v = (t.to(dtype) for t in (q, k, v))
    check(q, k, v, True, scale, windows=windows_from_position_ids(position_ids),
          relation=packed_relation(position_ids), check_reference=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("window", [1, 7, 16, 64])
@pytest.mark.parametrize("n_q, n_k", [(40, 40), (12, 40)])
def test_sliding_window(n_q, n_k, window, dtype):
    # causal sliding window on a left-padded batch (a full row and a padded one)
    b, hq, hkv, d = 2, 2, 1, 16
    mask = left_right_mask(n_k, [n_k, n_k - 9], [True, True])
    q, k, v = fill_padding(*qkv(b, hq, hkv, n_q, n_k, d, dtype), mask, n_q)
    windows = with_sliding_window(windows_from_padding_mask(mask, n_q), window, n_q, n_k)
    relation = sliding_relation(padding_relation(mask, n_q), window)
    check(q, k, v, True, windows=windows, relation=relation)


# ----------------------------------------------------------------------------------------------
# Determinism, fallbacks, validation

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_deterministic(dtype):
    b, hq, hkv, n, d = 2, 2, 1, 40, 32
    mask = left_right_mask(n, [40, 21], [True, True])
    q, k, v = qkv(b, hq, hkv, n, n, d, dtype)
    windows = windows_from_padding_mask(mask, n)
    grad_out = torch.randn(b, hq, n, d).to(dtype)
    with torch.no_grad():
        first = flash_attention(q, k, v, True, windows=windows)
        second = flash_attention(q, k, v, True, windows=windows)
    assert torch.equal(first, second), "two forward calls differ"
    one = run(lambda q, k, v: flash_attention(q, k, v, True, windows=windows), q, k, v, grad_out)
    two = run(lambda q, k, v: flash_attention(q, k, v, True, windows=windows), q, k, v, grad_out)
    # the inference path (no log-sum-exp stored) and the training path give the same output
    assert torch.equal(one["out"], first), "forward with and without autograd differ"
    for name in one:
        assert torch.equal(one[name], two[name]), f"two backward calls differ in {name}"


@pytest.mark.parametrize("d, dtype", [(32, torch.bfloat16), (32, torch.float32), (40, torch.float32)],
                         ids=["bf16", "fp32", "fallback"])
def test_transposed_output(d, dtype):
    # transposed=True: [B, Nq, Hq, D], contiguous from the kernels; the same values and gradients (a double backward
    # too) as the default layout, on the kernels' path and on SDPA's (head dim 40)
    mask = left_right_mask(12, [12, 7], [True, False])
    q, k, v = qkv(2, 4, 2, 12, 12, d, dtype)
    windows = windows_from_padding_mask(mask, 12)
    grad_out = torch.randn(2, 12, 4, d).to(dtype)
    want = run(lambda q, k, v: flash_attention(q, k, v, True, windows=windows), q, k, v, grad_out.transpose(1, 2))
    got = run(lambda q, k, v: flash_attention(q, k, v, True, windows=windows, transposed=True), q, k, v, grad_out)
    assert got["out"].shape == (2, 12, 4, d) and torch.equal(got["out"], want["out"].transpose(1, 2))
    if d != 40:
        assert got["out"].is_contiguous()  # the kernels' memory
    for name in GRADS:
        assert torch.equal(got[name], want[name]), name
    with torch.no_grad():
        assert torch.equal(flash_attention(q, k, v, True, windows=windows, transposed=True), got["out"])
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    twice = [torch.autograd.grad(flash_attention(q, k, v, True, windows=windows, transposed=transposed), q,
                                 grad_out if transposed else grad_out.transpose(1, 2), create_graph=True)[0]
             for transposed in (True, False)]
    assert twice[0].requires_grad and torch.equal(*twice)


def test_descriptors_share_a_layout_not_a_tensor():
    # the descriptors' layout checks are cached per layout; each descriptor binds the tensor it was made for
    first, second = (torch.randn(2, 8, 4, 32, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    one, two = attention_module._descriptor(first, 16, 32), attention_module._descriptor(second, 16, 32)
    assert one.base is first and two.base is second
    made = TensorDescriptor(second, list(second.shape), list(second.stride()), [1, 1, 16, 32])
    assert vars(two) == vars(made)
    misaligned = torch.randn(2, 4, 8, 36, dtype=torch.bfloat16)[..., :32]  # rows 72 bytes apart
    with pytest.raises(AssertionError, match="16-byte aligned"):
        attention_module._descriptor(misaligned, 16, 32)


def fallback_messages(caplog, words):
    return [r.getMessage() for r in caplog.records if r.name == "lorafuse" and words in r.getMessage()]


@pytest.mark.parametrize("d, dtype", [(40, torch.float32), (40, torch.bfloat16), (8, torch.float32),
                                      (32, torch.float64)], ids=["d40-fp32", "d40-bf16", "d8-fp32", "d32-fp64"])
def test_fallback(d, dtype, fallback_log):
    # head dims the kernel does not cover, and float64: SDPA, still with padding (NaN), GQA and causal
    b, hq, hkv, n = 2, 4, 2, 19
    mask = left_right_mask(n, [19, 11], [True, False])
    q, k, v = fill_padding(*qkv(b, hq, hkv, n, n, d, dtype), mask, n)
    windows = windows_from_padding_mask(mask, n)
    check(q, k, v, True, windows=windows, relation=padding_relation(mask, n), check_reference=False)
    with torch.no_grad():
        flash_attention(q, k, v, True, windows=windows)
    words = f"head dim {d}" if dtype != torch.float64 else "dtype torch.float64"
    said = fallback_messages(fallback_log, words)
    assert len(said) == 1, f"the fallback must be logged once, got {said}"
    assert "SDPA" in said[0] or "scaled_dot_product_attention" in said[0]


def test_kernel_path_does_not_log(fallback_log):
    q, k, v = qkv(1, 2, 1, 5, 9, 32, torch.float32)
    flash_attention(q, k, v)
    assert not [r for r in fallback_log.records if r.name == "lorafuse"]


def test_fallback_on_cpu_without_interpreter(monkeypatch, fallback_log):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with torch.device("cpu"):  # CPU tensors in the suite's GPU mode too
        check(*qkv(1, 4, 2, 7, 33, 32, torch.float32), causal=True, check_reference=False)
    said = fallback_messages(fallback_log, "not on a CUDA device")
    assert len(said) == 1, said


def _bad(name):
    q, k, v = qkv(2, 4, 2, 7, 9, 16, torch.float32)
    windows = None
    if name == "q_3d":
        q = q[0]
    elif name == "k_v_shapes":
        v = v[:, :, :5]
    elif name == "batch":
        k, v = k[:1], v[:1]
    elif name == "head_dim":
        q = torch.randn(2, 4, 7, 32)
    elif name == "heads_not_multiple":
        q = torch.randn(2, 3, 7, 16)
    elif name == "dtypes":
        k = k.bfloat16()
    elif name == "v_dtype":
        v = v.half()
    elif name == "windows_shapes":
        windows = windows_from_padding_mask(torch.ones(2, 9), 9)  # built for 9 queries, not 7
    elif name == "windows_batch":
        windows = windows_from_padding_mask(torch.ones(1, 9), 7)
    return q, k, v, windows


@pytest.mark.parametrize("name, words", [
    ("q_3d", r"\[B, H, N, D\]"),
    ("k_v_shapes", r"k and v must match"),
    ("batch", r"batch"),
    ("head_dim", r"head dim"),
    ("heads_not_multiple", r"multiple"),
    ("dtypes", r"dtypes differ"),
    ("v_dtype", r"dtypes differ"),
    ("windows_shapes", r"windows"),
    ("windows_batch", r"windows"),
])
def test_invalid_inputs(name, words):
    q, k, v, windows = _bad(name)
    with pytest.raises(ValueError, match=words):
        flash_attention(q, k, v, windows=windows)
