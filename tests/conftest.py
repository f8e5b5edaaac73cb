import os

# Triton reads this when it is imported: kernels then run on CPU tensors in its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from . import triton_interpreter  # noqa: E402,F401  (bf16 in the interpreter computes as on a GPU)

# GPU mode of the op tests: `LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest tests/ops` creates the
# tensors that tests make without a device on the GPU, so the same tests check the compiled kernels. (The other
# suites build models and generators on the CPU: they run without it.)
if os.environ.get("LORAFUSE_TEST_DEVICE"):
    torch.set_default_device(os.environ["LORAFUSE_TEST_DEVICE"])


@pytest.fixture(autouse=True)
def _seed_torch():
    # Every test draws its own fresh inputs, reproducibly and independently of test order.
    torch.manual_seed(0)

