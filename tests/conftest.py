import os

# Triton reads this when it is imported: kernels then run on CPU tensors in its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from . import triton_interpreter  # noqa: E402,F401  (bf16 in the interpreter computes as on a GPU)


@pytest.fixture(autouse=True)
def _seed_torch():
    # Every test draws its own fresh inputs, reproducibly and independently of test order.
    torch.manual_seed(0)

