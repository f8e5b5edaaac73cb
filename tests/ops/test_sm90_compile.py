"""The training step's kernels compile for Hopper (sm_90) with the installed Triton, on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which neither compiles them nor runs their inline PTX (the
dropout mask's paired compare): a Triton release that broke compilation would pass them. sm90_kernels.py compiles
each variant that the launchers pass (tests/ops/sm90_kernels.py says which) in a process without TRITON_INTERPRET.
"""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = {"_shrink_fwd", "_shrink_bwd", "_expand_fwd", "_expand_bwd", "_rms_norm_fwd", "_rms_norm_bwd",
           "_silu_mul_fwd", "_silu_mul_bwd", "_rope_kernel", "_cross_entropy_rows"}


def test_training_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.ops.sm90_kernels"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    assert {key.split("[")[0] for key in sizes} == KERNELS
    assert all(size > 0 for size in sizes.values())
    # the variants that only compiled code runs: the dropout mask's PTX, float32 adapters on bf16 pieces
    assert any(key.startswith("_shrink_fwd") and "('HAS_DROPOUT', 'True')" in key for key in sizes)
    assert any(key.startswith("_shrink_bwd") and "('ON_PIECES', 'True')" in key and "('HAS_DROPOUT', 'True')" in key
               for key in sizes)
    assert any(key.startswith("_expand_bwd") and "('ON_PIECES', 'True')" in key for key in sizes)
