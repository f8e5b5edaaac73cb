"""rope_cache_write (LoRA expand, Qwen3's q/k norms, rotary embedding, q and KV-cache writes in one kernel) against
its reference in float64, and the reference against transformers' rotation."""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from lorafuse.ops.decode.rope_cache_write import rope_cache_write, rope_cache_write_reference, rotated
from tests.ops._helpers import DTYPES, assert_close, bank_row_scales, dtype_id, poison

SCALES = (1.7, 0.5, 2.0)
EPS = 1e-6
LENGTH = 9  # cache slots
# (rows, query heads, key/value heads, head dim, ranks of q, k, v: None = no adapter)
CASES = [(1, 4, 2, 16, (None, None, None)), (3, 3, 1, 12, (1, None, 16)), (2, 4, 4, 20, (16, 16, 16))]


def case_id(case):
    rows, hq, hkv, d, ranks = case
    return f"B{rows}_Hq{hq}_Hkv{hkv}_D{d}_r{'-'.join(str(r or 0) for r in ranks)}"


def random_inputs(rows, hq, hkv, d, ranks, qk_norm, deferred=False, per_row=False):
    """The GEMM row [q | k | v | s...], adapters, rope tables of random positions, norms, a slot, the buffers; with
    deferred also a bias and a deferred norm of the GEMM's input (partial sums of squares of 3 programs); with per_row
    each row's own scales of the s columns (an adapter bank)."""
    widths = (hq * d, hkv * d, hkv * d)
    angles = torch.rand(rows, d // 2) * 40
    angles = torch.cat([angles, angles], -1)  # as transformers' rotary_emb: the two halves share frequencies
    return {"qkv": torch.randn(rows, sum(widths) + sum(r or 0 for r in ranks)),
            "lora_B": tuple(None if r is None else torch.randn(w, r) / r**0.5 for w, r in zip(widths, ranks)),
            "scales": SCALES, "cos": angles.cos(), "sin": angles.sin(),
            "q_norm": torch.rand(d) + 0.5 if qk_norm else None, "k_norm": torch.rand(d) + 0.5 if qk_norm else None,
            "eps": EPS, "slot": torch.tensor([LENGTH - 3]), "q_out": torch.empty(rows, hq, 1, d),
            "k_cache": torch.randn(rows, hkv, LENGTH, d), "v_cache": torch.randn(rows, hkv, LENGTH, d),
            **({"bias": torch.randn(sum(widths)), "row_norm": (torch.rand(rows, 3) * 40 + 1, 50, EPS)} if deferred
               else {}),
            **({"row_scales": bank_row_scales(rows, sum(r or 0 for r in ranks))} if per_row else {})}


def in_dtype(inputs, dtype):
    """Copies of the inputs with every float tensor in `dtype` (buffers too: each run writes its own); row_scales
    stay float32, as the kernel takes them."""
    def cast(t):
        return t.to(dtype).clone() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return {name: tuple(map(cast, t)) if name == "lora_B" else t if name == "row_scales" else cast(t)
            for name, t in inputs.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("per_row", [False, True], ids=["", "row_scales"])
@pytest.mark.parametrize("deferred", [False, True], ids=["", "bias_deferred_norm"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk_norm"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_writes_match_reference(case, qk_norm, deferred, per_row, dtype):
    inputs = random_inputs(*case, qk_norm, deferred, per_row)
    got, exact = in_dtype(inputs, dtype), in_dtype(inputs, torch.float64)
    poison(got["q_out"])
    rope_cache_write(**got)
    rope_cache_write_reference(**exact)
    plain = None
    if dtype != torch.float32:
        plain = in_dtype(inputs, dtype)
        rope_cache_write_reference(**plain)
    slot = int(inputs["slot"])
    for name, written in (("q_out", slice(None)), ("k_cache", slot), ("v_cache", slot)):
        assert_close(got[name][:, :, written], exact[name][:, :, written], dtype,
                     None if plain is None else plain[name][:, :, written], name)
    for name in ("k_cache", "v_cache"):  # the other slots are untouched
        others = [s for s in range(LENGTH) if s != slot]
        assert torch.equal(got[name][:, :, others], inputs[name][:, :, others].to(dtype)), name


def test_rotation_is_transformers():
    x, angles = torch.randn(2, 3, 10).double(), torch.rand(2, 5).double() * 9
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)  # x: [B, H, D], cos: [B, D] (it unsqueezes dim 1)
    torch.testing.assert_close(rotated(x, cos, sin), expected)


def test_shapes_that_do_not_fit_are_refused():
    inputs = random_inputs(*CASES[1], qk_norm=False)
    inputs["qkv"] = inputs["qkv"][:, 1:]
    with pytest.raises(ValueError, match=r"qkv \(3, 76\) .* must be \[B, \(Hq \+ 2 Hkv\) \* D \+ ranks\] = "
                                         r"\[3, 77\]"):
        rope_cache_write(**inputs)
