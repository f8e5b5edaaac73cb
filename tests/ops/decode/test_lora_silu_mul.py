"""lora_silu_mul (the gate and up adapters' expand, then silu(gate) * up, in one kernel) against its reference in
float64."""
import pytest
import torch

from lorafuse.ops.decode.lora_silu_mul import lora_silu_mul, lora_silu_mul_reference
from tests.ops._helpers import DTYPES, assert_close, bank_row_scales, dtype_id, poison

SCALES = (1.7, 0.6)
CASES = [(1, 100, (None, None)), (7, 1100, (1, 16)), (2, 48, (None, 5)), (3, 36, (16, None))]  # (rows, width, ranks)


def case_id(case):
    m, width, ranks = case
    return f"M{m}_I{width}_r{'-'.join(str(r or 0) for r in ranks)}"


def run(fn, inputs, dtype):
    proj, lora_B = inputs["proj"].to(dtype), tuple(None if B is None else B.to(dtype) for B in inputs["lora_B"])
    out = poison(torch.empty(proj.shape[0], inputs["width"], dtype=dtype))
    bias = inputs.get("bias")
    fn(proj, lora_B, SCALES, out, bias=None if bias is None else bias.to(dtype), row_norm=inputs.get("row_norm"),
       row_scales=inputs.get("row_scales"))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("per_row", [False, True], ids=["", "row_scales"])
@pytest.mark.parametrize("deferred", [False, True], ids=["", "bias_deferred_norm"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_output_matches_reference(case, deferred, per_row, dtype):
    # deferred: a bias and a deferred norm of the GEMM's input (partial sums of squares of 3 programs); per_row: each
    # row's own scales of the s columns (an adapter bank) instead of SCALES
    m, width, ranks = case
    inputs = {"proj": torch.randn(m, 2 * width + sum(r or 0 for r in ranks)) * 2, "width": width,
              "lora_B": tuple(None if r is None else torch.randn(width, r) / r**0.5 for r in ranks)}
    if deferred:
        inputs.update(bias=torch.randn(2 * width), row_norm=(torch.rand(m, 3) * 40 + 1, 50, 1e-6))
    if per_row:
        inputs["row_scales"] = bank_row_scales(m, sum(r or 0 for r in ranks))
    plain = run(lora_silu_mul_reference, inputs, dtype) if dtype != torch.float32 else None
    assert_close(run(lora_silu_mul, inputs, dtype), run(lora_silu_mul_reference, inputs, torch.float64), dtype, plain)
