"""lorafuse.inference.Engine on CPU (eager decode steps): greedy tokens equal transformers' generate on each prompt
alone whatever the batch, its padding and its bucket; EOS and stop strings end rows where they should; streaming;
seeded sampling; the families it covers; transformers' generate for the others."""
import copy

import pytest
import torch
from transformers import AutoTokenizer

from lorafuse.hf import model_kernels
from lorafuse.inference import Engine, SamplingParams
from tests.hf.families import VOCAB, tiny_model
from tests.inference.helpers import TINY_LLAMA, hf_greedy, prompts, tiny_llama

NEW = 9  # new tokens per row: with check_every=4 the host reads after the prefill, then after 4, 8 and 9 tokens
PROMPTS = prompts(11)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, max_length=24, buckets=(1, 2, 4, 8), check_every=4)


@pytest.fixture(scope="module")
def reference(model):
    return hf_greedy(model, PROMPTS, NEW)


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 11])  # buckets 1, 2, 4 (one dummy row), 8 (two), 8 + 4 (two batches)
def test_greedy_equals_generate_on_each_prompt_alone(engine, reference, rows):
    out = engine.generate(PROMPTS[:rows], SamplingParams(max_new_tokens=NEW))
    assert out == reference[:rows]


def test_transformers_step_on_lorafuse_attention_equals_generate(reference):
    # transformers' step (no fused step) with attn_implementation="lorafuse" passes the attention its windows
    # (decoding.decode_attention_kwargs, ops.decode_windows): left padding and unwritten slots stay out
    model = tiny_llama("lorafuse")
    engine = Engine(model, max_length=24, buckets=(4,), check_every=4, fused_step=False)
    assert engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=NEW)) == reference[:3]


def test_greedy_does_not_depend_on_the_batch(engine, reference):
    # The same prompts in another order, with other companions, in another bucket.
    order = [7, 0, 3]
    assert engine.generate([PROMPTS[i] for i in order], SamplingParams(max_new_tokens=NEW)) == \
        [reference[i] for i in order]


def test_eos_ends_its_row_and_the_others_continue(model, reference):
    # An EOS id that row 0 makes as its 4th token and row 1 never makes: row 0 ends there, row 1 runs on.
    eos = reference[0][3]
    assert eos not in reference[0][:3] and eos not in reference[1]
    expected = [ids[:ids.index(eos) + 1] if eos in ids else ids for ids in reference[:4]]
    assert len(expected[0]) == 4 and len(expected[1]) == NEW
    stopping = copy.deepcopy(model)
    stopping.generation_config.eos_token_id = eos
    assert hf_greedy(stopping, PROMPTS[:4], NEW) == expected
    for check_every in (1, 3, 16):
        engine = Engine(stopping, max_length=24, buckets=(4,), check_every=check_every)
        assert engine.generate(PROMPTS[:4], SamplingParams(max_new_tokens=NEW)) == expected


@pytest.mark.parametrize("check_every", [1, 4])  # 1: "h d" below spans two reads
def test_stop_strings_end_rows_after_the_completing_token(model, reference, check_every):
    # Row 0's text is 'istant\x19 ston\ufffd m this...': " this" is completed by its 6th token; row 2's is
    # '\ufffd with do...': "h d" is completed by its 3rd (" do"), across two tokens. No other row holds either.
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    engine = Engine(model, tokenizer, max_length=24, buckets=(8,), check_every=check_every)
    out = engine.generate(PROMPTS[:6], SamplingParams(max_new_tokens=NEW, stop=["h d", " this"]))
    assert [len(ids) for ids in out] == [6, NEW, 3, NEW, NEW, NEW]
    assert out == [ids[:len(kept)] for ids, kept in zip(reference, out)]
    assert tokenizer.decode(out[0]).endswith(" this") and tokenizer.decode(out[2]).endswith("h do")


def test_stream_yields_each_rows_new_tokens_in_order_and_nothing_after_its_end(model, reference):
    eos = reference[0][1]  # row 0 ends on its 2nd token, inside the second read; rows 1 and 2 never make it
    assert eos != reference[0][0] and eos not in reference[1] + reference[2]
    stopping = copy.deepcopy(model)
    stopping.generation_config.eos_token_id = eos
    engine = Engine(stopping, max_length=24, buckets=(4,), check_every=4)
    chunks = list(engine.stream(PROMPTS[:3], SamplingParams(max_new_tokens=NEW)))
    # Reads after the prefill and after 4 and 8 more tokens: 1 + 4 + 4 tokens per row, fewer for row 0.
    assert [{row: len(ids) for row, ids in chunk.items()} for chunk in chunks] == \
        [{0: 1, 1: 1, 2: 1}, {0: 1, 1: 4, 2: 4}, {1: 4, 2: 4}]
    assert [[token for chunk in chunks for token in chunk.get(row, [])] for row in range(3)] == \
        [reference[0][:2], reference[1], reference[2]]
    calls = []
    assert engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=NEW), on_tokens=lambda *c: calls.append(c)) \
        == [reference[0][:2], reference[1], reference[2]]
    assert calls == [(row, ids) for chunk in chunks for row, ids in chunk.items()]


def test_seeded_sampling_repeats_and_top_k_1_is_greedy(engine, reference):
    sampled = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=3)
    first = engine.generate(PROMPTS[:3], sampled)
    assert engine.generate(PROMPTS[:3], sampled) == first
    assert engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=4)) != first
    assert first != reference[:3]
    assert engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=1, seed=3)) == \
        reference[:3]


def test_requests_beyond_the_cache_are_refused(engine):
    with pytest.raises(ValueError, match=r"longest prompt \(11 tokens\) plus max_new_tokens \(14\) exceed "
                                         r"max_length=24"):
        engine.generate([PROMPTS[8]], SamplingParams(max_new_tokens=14))
    with pytest.raises(ValueError, match="non-empty token id lists"):
        engine.generate([[]])


@pytest.mark.parametrize("family, overrides", [("llama", {}), ("mistral", {"sliding_window": None}), ("qwen2", {}),
                                               ("qwen3", {})])
def test_families_equal_generate(family, overrides):
    model = tiny_model(family, **overrides).eval()
    batch = prompts(5, vocab=VOCAB)
    reference = hf_greedy(model, batch, 8)  # before the engine gives the norms lorafuse's kernel
    engine = Engine(model, max_length=20, buckets=(8,), check_every=3)
    assert engine.fallback_reason is None
    assert engine.generate(batch, SamplingParams(max_new_tokens=8)) == reference
    # every RMSNorm can run the kernel: two per layer and the final one, and Qwen3's per-head q_norm and k_norm
    layers = model.config.num_hidden_layers
    assert len(engine._norms) == 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)
    assert all(type(m).__name__.endswith("RMSNorm") for m in engine._norms)


def test_rms_norms_run_the_kernel_in_the_engine_only(monkeypatch):
    calls = []
    real = model_kernels.rms_norm
    monkeypatch.setattr(model_kernels, "rms_norm", lambda *args: calls.append(1) or real(*args))
    model = tiny_llama()
    engine = Engine(model, max_length=8, buckets=(1,))
    engine.generate([[5, 6]], SamplingParams(max_new_tokens=3))
    assert len(calls) == 3 * 9  # prefill and two decode steps, nine norms each
    # outside the engine's forwards the modules are transformers' own: differentiable, no kernel
    assert not [m for m in model.modules() if "forward" in vars(m)]
    x = torch.randn(2, 3, model.config.hidden_size, requires_grad=True)
    assert model.model.norm(x).grad_fn is not None
    with torch.no_grad():
        model(torch.tensor([[5, 6]]))
    assert len(calls) == 27


@pytest.mark.parametrize("family, overrides, reason", [
    ("gpt2", {}, "model type 'gpt2'"),
    ("mistral", {}, "sliding-window layers"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type 'dynamic'"),
])
def test_other_models_fall_back_to_generate_and_say_why_once(fallback_log, family, overrides, reason):
    model = tiny_model(family, **overrides).eval()
    batch = prompts(3, vocab=VOCAB)
    engine = Engine(model, max_length=20)
    Engine(model, max_length=20)
    assert reason in engine.fallback_reason
    said = [r.getMessage() for r in fallback_log.records if "runs transformers' generate" in r.getMessage()]
    assert len(said) == 1 and reason in said[0]
    assert engine.generate(batch, SamplingParams(max_new_tokens=6)) == hf_greedy(model, batch, 6)
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    assert engine.generate(batch, sampled) == engine.generate(batch, sampled)


def test_last_logits_are_the_latest_chunks_and_the_prefills_with_one_token(model):
    engine = Engine(model, max_length=16, buckets=(1, 2))
    batch = PROMPTS[:3]  # two chunks: two prompts, then one
    engine.generate(batch, SamplingParams(max_new_tokens=1))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([batch[2]])).logits[:, -1]
    torch.testing.assert_close(engine.last_logits(), expected, rtol=1e-5, atol=1e-5)
    engine.last_logits().zero_()  # a copy: the engine's buffer is untouched
    torch.testing.assert_close(engine.last_logits(), expected, rtol=1e-5, atol=1e-5)
