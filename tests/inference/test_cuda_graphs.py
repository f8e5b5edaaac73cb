"""Captured decoding on a GPU: for every bucket, replaying the captured decode steps gives the tokens and the logits
of the same engine stepping eagerly (greedy and seeded sampling), with the adapter unmerged - before and after
swapping it in place - and merged, with rows of one batch on different adapters (an adapter bank), and with
transformers' forward as the step; nothing falls back from lorafuse's kernels during capture.

Needs CUDA; on the GPU machine run it with the kernels compiled (not interpreted):
    TRITON_INTERPRET=0 python -m pytest -q tests/inference/test_cuda_graphs.py
"""
import dataclasses
import os

import pytest
import torch

import lorafuse
from lorafuse.inference import Engine, SamplingParams
from tests.inference.helpers import tiny_llama, with_lora

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("CUDA graphs need a GPU and compiled Triton kernels (TRITON_INTERPRET=0)", allow_module_level=True)

NEW = 20
MAX_LENGTH = 64
# bf16 logits of two runs of the same kernels: equal but for cuBLAS choosing other algorithms under capture
LOGITS_TOLERANCE = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-4, atol=1e-4)}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for name, seed, rank in (("A", 1, 8), ("B", 2, 4)):
        with_lora(tiny_llama(), seed, r=rank, lora_alpha=16, target_modules="all-linear").save_pretrained(root / name)
    return root


def fused_model(adapters, dtype):
    base = tiny_llama().to("cuda", dtype)
    return lorafuse.from_pretrained(base, adapters / "A").eval()  # fused LoRA layers, lorafuse attention


def prompts_for(size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (size,), generator=generator)
    return [torch.randint(3, 500, (int(n),), generator=generator).tolist() for n in lengths]


def assert_replay_equals_eager(graphs: Engine, eager: Engine, params: SamplingParams, dtype, seed: int,
                               names: tuple[str, ...] | None = None):
    # names: the rows' adapters in turn (an adapter bank), or None: every row the active adapter
    for size in graphs.buckets:
        for rows in sorted({size, max(1, size - 1)}):  # a full bucket, and one padded with a dummy row
            prompts = prompts_for(rows, seed + 100 * size + rows)
            adapters = None if names is None else [names[(i + size) % len(names)] for i in range(rows)]
            replayed = graphs.generate(prompts, params, adapters=adapters)
            stepped = eager.generate(prompts, params, adapters=adapters)
            assert replayed == stepped, f"bucket {size}, {rows} rows"
            torch.testing.assert_close(graphs.last_logits(), eager.last_logits(), **LOGITS_TOLERANCE[dtype],
                                       msg=lambda m: f"bucket {size}, {rows} rows: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_replay_equals_eager_unmerged_and_after_swap(adapters, dtype, fallback_log):
    model = fused_model(adapters, dtype)
    graphs = Engine(model, max_length=MAX_LENGTH)
    eager = Engine(model, max_length=MAX_LENGTH, cuda_graphs=False)  # the same model: swaps reach both
    assert graphs.buckets == (1, 2, 4, 8, 16, 32) and graphs.capture_seconds > 0
    greedy = SamplingParams(max_new_tokens=NEW)
    before = graphs.generate(prompts_for(4, 0), greedy)
    assert_replay_equals_eager(graphs, eager, greedy, dtype, seed=0)
    graphs.swap_adapter(adapters / "B")
    assert graphs.generate(prompts_for(4, 0), greedy) != before  # the swap reached the captured steps
    assert_replay_equals_eager(graphs, eager, greedy, dtype, seed=1)
    fallbacks = [r.message for r in fallback_log.records
                 if "runs because of" in r.message or "runs the PyTorch reference" in r.message]
    assert not fallbacks


def test_seeded_sampling_replay_equals_eager(adapters):
    model = fused_model(adapters, torch.bfloat16)
    graphs = Engine(model, max_length=MAX_LENGTH, buckets=(1, 8))
    eager = Engine(model, max_length=MAX_LENGTH, buckets=(1, 8), cuda_graphs=False)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    assert_replay_equals_eager(graphs, eager, params, torch.bfloat16, seed=2)
    other_seed = graphs.generate(prompts_for(8, 0), dataclasses.replace(params, seed=8))
    assert other_seed != graphs.generate(prompts_for(8, 0), params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_replay_equals_eager_with_rows_on_different_adapters(adapters, dtype):
    model = fused_model(adapters, dtype)
    model.load_adapter(adapters / "B", adapter_name="second")
    graphs = Engine(model, max_length=MAX_LENGTH, buckets=(1, 4, 8))
    eager = Engine(model, max_length=MAX_LENGTH, buckets=(1, 4, 8), cuda_graphs=False)
    assert graphs.fused_step_reason is None and graphs.mixes_adapters
    greedy = SamplingParams(max_new_tokens=NEW)
    assert_replay_equals_eager(graphs, eager, greedy, dtype, seed=4, names=("default", "second", "__base__"))
    mixed = graphs.generate(prompts_for(3, 0), greedy, adapters=["default", "second", "__base__"])
    assert mixed != graphs.generate(prompts_for(3, 0), greedy)  # the rows' choices reach the captured steps


def test_merged_replay_equals_eager(adapters):
    graphs = Engine(fused_model(adapters, torch.bfloat16), max_length=MAX_LENGTH, merge=True)
    eager = Engine(graphs.model, max_length=MAX_LENGTH, cuda_graphs=False)
    assert_replay_equals_eager(graphs, eager, SamplingParams(max_new_tokens=NEW), torch.bfloat16, seed=3)


def test_transformers_step_replay_equals_eager(adapters):
    # transformers' forward as the captured step (fused_step=False), lorafuse attention on windows built by one kernel
    # launch (decoding.decode_attention_kwargs). In fp32: eager decode calls of the fused LoRA layer take its
    # launch-bound route (ops/lora/linear.py, lora_decode), captured ones not, and in bf16 their roundings differ
    # enough to flip a near-tie of this random model within 20 tokens
    graphs = Engine(fused_model(adapters, torch.float32), max_length=MAX_LENGTH, buckets=(1, 4), fused_step=False)
    eager = Engine(graphs.model, max_length=MAX_LENGTH, buckets=(1, 4), cuda_graphs=False, fused_step=False)
    assert graphs.fused_step_reason is not None and graphs.capture_seconds > 0
    assert_replay_equals_eager(graphs, eager, SamplingParams(max_new_tokens=NEW), torch.float32, seed=5)
