"""Rows of one batch with different LoRA adapters (the issue's stretch): a PeftModel holding several adapters gets
them all stacked in the fused decode step, and each row runs the one it names, or none ("__base__"). On CPU
(Triton's interpreter) against the engine stepping through transformers' forward (PEFT's own per-row routing) and
against PEFT's generate of each prompt alone; after a swap into one of the adapters too; bad names are refused."""
import pytest
import torch
from peft import get_peft_model

from lorafuse.inference import Engine, SamplingParams
from tests.hf.families import VOCAB, lora_config, tiny_model
from tests.inference.helpers import hf_greedy, prompts

NEW = 4
PROMPTS = prompts(3, vocab=VOCAB)  # bucket 4: one dummy row
ROWS = ["first", "second", "__base__"]


def bank_model():
    """A tiny Llama with two adapters of different ranks, scales and targets ("second" misses k_proj, o_proj and the
    MLP's gate), random non-zero weights; "first" active."""
    torch.manual_seed(3)
    model = get_peft_model(tiny_model("llama").eval(), lora_config("llama", r=8, lora_alpha=16), adapter_name="first")
    model.add_adapter("second", lora_config("llama", r=4, lora_alpha=2,
                                            target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    return model.eval()


def engines(model):
    fused = Engine(model, max_length=16, buckets=(4,), check_every=2, fused_step=True)
    assert fused.fused_step_reason is None and fused.adapter_names == ("first", "second")
    return fused, Engine(fused.model, max_length=16, buckets=(4,), check_every=2, fused_step=False)


def test_rows_run_their_own_adapters():
    model = bank_model()
    fused, stepped = engines(model)
    params = SamplingParams(max_new_tokens=NEW)
    tokens = fused.generate(PROMPTS, params, adapters=ROWS)
    mixed_logits = fused.last_logits()
    assert tokens == stepped.generate(PROMPTS, params, adapters=ROWS)
    torch.testing.assert_close(mixed_logits, stepped.last_logits(), rtol=1e-5, atol=1e-5)
    for prompt, adapter, made in zip(PROMPTS, ROWS, tokens):  # each prompt alone through PEFT, with its adapter
        assert made == hf_greedy(model, [prompt], NEW, adapter_names=[adapter])[0]
    # the rows really differ: all on "first" gives other logits on the rows that ran "second" and none
    assert fused.generate(PROMPTS, params) == fused.generate(PROMPTS, params, adapters=["first"] * 3)
    same = fused.last_logits()
    assert torch.allclose(same[0], mixed_logits[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(same[1], mixed_logits[1], rtol=1e-3, atol=1e-3)
    assert not torch.allclose(same[2], mixed_logits[2], rtol=1e-3, atol=1e-3)


def test_swap_into_an_adapter_of_the_bank(tmp_path):
    donor = bank_model()
    with torch.no_grad():  # other weights for "second", saved in PEFT's format
        for name, param in donor.named_parameters():
            if "lora_" in name and ".second." in name:
                param.normal_(0.0, 0.3)
    donor.save_pretrained(tmp_path, selected_adapters=["second"])
    fused, stepped = engines(bank_model())
    fused.swap_adapter(tmp_path / "second", name="second")
    params = SamplingParams(max_new_tokens=NEW)
    assert fused.generate(PROMPTS, params, adapters=ROWS) == stepped.generate(PROMPTS, params, adapters=ROWS)
    torch.testing.assert_close(fused.last_logits(), stepped.last_logits(), rtol=1e-5, atol=1e-5)


def test_a_swap_reaches_a_second_engine_on_the_model(tmp_path):
    # the bank's lora_B are PEFT's own parameters (column blocks of one buffer), not copies: a swap through one
    # engine, or adapter_swap directly, reaches every engine on the model
    donor = bank_model()
    with torch.no_grad():
        for name, param in donor.named_parameters():
            if "lora_" in name and ".second." in name:
                param.normal_(0.0, 0.3)
    donor.save_pretrained(tmp_path, selected_adapters=["second"])
    model = bank_model()
    first, stepped = engines(model)
    second = Engine(model, max_length=16, buckets=(4,), check_every=2, fused_step=True)
    first.swap_adapter(tmp_path / "second", name="second")
    params = SamplingParams(max_new_tokens=NEW)
    assert second.generate(PROMPTS, params, adapters=ROWS) == stepped.generate(PROMPTS, params, adapters=ROWS)
    torch.testing.assert_close(second.last_logits(), stepped.last_logits(), rtol=1e-5, atol=1e-5)


def test_names_that_do_not_fit_are_refused():
    fused, _ = engines(bank_model())
    with pytest.raises(ValueError, match=r"\['third'\] are not among the model's \(first, second"):
        fused.generate(PROMPTS, SamplingParams(max_new_tokens=1), adapters=["first", "third", None])
    with pytest.raises(ValueError, match="2 adapters for 3 prompts"):
        fused.generate(PROMPTS, SamplingParams(max_new_tokens=1), adapters=["first", None])
    single = get_peft_model(tiny_model("llama").eval(), lora_config("llama")).eval()
    one = Engine(single, max_length=16, buckets=(4,), fused_step=True)
    with pytest.raises(ValueError, match="only adapter"):
        one.generate(PROMPTS, SamplingParams(max_new_tokens=1), adapters=["__base__", None, None])
    assert one.generate(PROMPTS, SamplingParams(max_new_tokens=1), adapters=["default"] * 3)  # its own: fine
    plain = Engine(tiny_model("llama").eval(), max_length=16, buckets=(4,), fused_step=True)
    assert plain.generate(PROMPTS, SamplingParams(max_new_tokens=1), adapters=["__base__"] * 3)  # it is the base
    with pytest.raises(ValueError, match="not among the model's \\(none"):
        plain.generate(PROMPTS, SamplingParams(max_new_tokens=1), adapters=["first", None, None])


def test_a_bank_too_wide_for_the_kernels_is_declined(fallback_log):
    # ranks 48 + 32 on the same projections: the fused step declines, saying why; transformers' step runs
    model = get_peft_model(tiny_model("llama").eval(), lora_config("llama", r=48), adapter_name="first")
    model.add_adapter("second", lora_config("llama", r=32))
    engine = Engine(model.eval(), max_length=16, buckets=(4,), fused_step=True)
    assert "add up to rank 80 > 64" in engine.fused_step_reason and engine.mixes_adapters  # eager: PEFT routes rows
    assert any("add up to rank 80" in record.getMessage() for record in fallback_log.records)
