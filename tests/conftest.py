import os

# Triton reads this when it is imported: kernels then run on CPU tensors in its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

# `pytest -n N` runs N workers on this machine's cores: each worker's torch, and each recipe it starts in a
# subprocess (they inherit the variable), gets its share of the cores. With every process at one thread per core,
# 2 workers and a recipe run on 2 cores spun 6 threads against each other, and the default fine-tuning run
# passed its 600 s limit on CI.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import lorafuse._logging  # noqa: E402

from . import triton_interpreter  # noqa: E402,F401  (bf16 in the interpreter computes as on a GPU)

if "OMP_NUM_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# GPU mode of the op tests: `LORAFUSE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest tests/ops` creates the
# tensors that tests make without a device on the GPU, so the same tests check the compiled kernels. (The other
# suites build models and generators on the CPU: they run without it.)
if os.environ.get("LORAFUSE_TEST_DEVICE"):
    torch.set_default_device(os.environ["LORAFUSE_TEST_DEVICE"])


@pytest.fixture(autouse=True)
def _seed_torch():
    # Every test draws its own fresh inputs, reproducibly and independently of test order.
    torch.manual_seed(0)


@pytest.fixture
def fallback_log(monkeypatch, caplog):
    """The once-per-process fallback messages, forgotten before the test so it sees its own."""
    monkeypatch.setattr(lorafuse._logging, "_said", set())
    caplog.set_level(logging.INFO, logger="lorafuse")
    return caplog
