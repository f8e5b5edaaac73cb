"""The fused training loss of Llama-style causal LMs (hf/causal_lm_loss.py) against transformers' own loss on the
same model: the loss and every gradient, ignored labels, shift_labels, num_items_in_batch across micro-batches;
where it falls back (eval, an lm_head with LoRA) and what it says; unfuse; the forward's signature."""
import copy

import pytest
import torch
from peft import LoraConfig

import lorafuse
from lorafuse.hf.causal_lm_loss import LossForward
from lorafuse.ops.model import linear_cross_entropy as lce_module
from lorafuse.train.trainer import accepts_loss_kwargs
from tests.hf.families import VOCAB, batch, lora_config, tiny_model
from tests.lora_check import assert_fp32_close, relative_error

LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")


def fused_and_full(family: str, **config):
    """The same LoRA model twice: with the fused loss, and with transformers' (loss_kernels=False)."""
    fused = lorafuse.get_peft_model(tiny_model(family), lora_config(family, **config))
    full = lorafuse.unfuse(copy.deepcopy(fused))
    return fused, lorafuse.fuse(full, loss_kernels=False)


def loss_and_grads(model, **inputs) -> dict:
    out = model.train()(**inputs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return {"loss": out.loss.detach(), **grads}


def loss_kernel_forwards(model) -> int:
    return sum(isinstance(vars(m).get("forward"), LossForward) for m in model.modules())


@pytest.mark.parametrize("family", LLAMA_STYLE)
def test_loss_and_grads_equal_transformers_loss(family):
    fused, full = fused_and_full(family)
    inputs = batch(family)
    inputs["labels"] = inputs["labels"].clone()
    inputs["labels"][0, :3] = -100  # a prompt's tokens carry no loss
    assert loss_kernel_forwards(fused) == 1 and loss_kernel_forwards(full) == 0
    assert_fp32_close(loss_and_grads(fused, **inputs), loss_and_grads(full, **inputs))
    assert fused.train()(**inputs).logits is None


def test_the_head_skips_ignored_positions(monkeypatch):
    rows_seen, forward = [], lce_module._forward
    monkeypatch.setattr(lce_module, "_forward", lambda hidden, *args: rows_seen.append(len(hidden)) or
                        forward(hidden, *args))
    fused, full = fused_and_full("llama")
    inputs = batch("llama")
    inputs["labels"] = inputs["labels"].clone()
    inputs["labels"][:, :4] = -100  # prompts
    assert_fp32_close(loss_and_grads(fused, **inputs), loss_and_grads(full, **inputs))
    rows, length = inputs["labels"].shape
    assert rows_seen == [rows * (length - 4)]  # positions 3 to length - 2: the next token of each is labelled


def test_autocast_runs_the_fused_loss(monkeypatch, fallback_log):
    # accelerate's mixed precision (the recipe's, HF Trainer's bf16=True) wraps the forward in autocast: the fused loss
    # runs there too, in autocast's dtype, with the same loss and gradients up to bfloat16 rounding
    from lorafuse.ops.model import linear_cross_entropy as lce_module
    launches = []
    real = lce_module._launch_rows
    monkeypatch.setattr(lce_module, "_launch_rows", lambda *args: launches.append(1) or real(*args))
    fused, full = fused_and_full("llama")
    inputs = batch("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = loss_and_grads(fused, **inputs), loss_and_grads(full, **inputs)
    assert launches and not [r for r in fallback_log.records if "linear_cross_entropy" in r.getMessage()]
    for name in want:
        error = relative_error(got[name], want[name])
        assert error < 2e-2, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("how", ["num_items_in_batch", "shift_labels"])
def test_loss_arguments_are_taken_as_transformers_takes_them(how):
    # two micro-batches whose losses are divided by the global label count, as the recipe and HF's Trainer pass it;
    # or labels shifted by the caller (context parallelism)
    fused, full = fused_and_full("llama")
    ids = torch.randint(3, VOCAB, (4, 7))
    results = []
    for model in (fused, full):
        model.train()
        if how == "num_items_in_batch":
            for rows in (slice(0, 1), slice(1, 4)):
                model(input_ids=ids[rows], labels=ids[rows], num_items_in_batch=torch.tensor(4 * 6)).loss.backward()
            loss = torch.tensor(1.0)  # the gradients carry the check
        else:
            shifted = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
            loss = model(input_ids=ids, labels=ids, shift_labels=shifted).loss
            loss.backward()
        results.append({"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()
                                                  if p.requires_grad}})
    assert_fp32_close(*results)


def test_eval_and_no_label_calls_return_logits_silently(fallback_log):
    fused, full = fused_and_full("llama")
    inputs = batch("llama")
    with torch.no_grad():
        fused.eval(), full.eval()
        assert_fp32_close({"logits": fused(**inputs).logits}, {"logits": full(**inputs).logits})
        fused.train()
        assert fused(input_ids=inputs["input_ids"]).logits is not None
        assert fused(**inputs).logits is not None  # no gradients: transformers' forward
    assert fallback_log.records == []


def test_lora_on_the_lm_head_falls_back_and_says_why(fallback_log):
    fused, full = fused_and_full("llama", target_modules=["q_proj", "lm_head"])
    inputs = batch("llama")
    for _ in range(2):
        got = loss_and_grads(fused, **inputs)
    assert_fp32_close(got, loss_and_grads(full, **inputs))
    said = [r.getMessage() for r in fallback_log.records if "full logits" in r.getMessage()]
    assert len(said) == 1 and "lm_head" in said[0], said


def test_unfuse_gives_transformers_forward_back():
    fused, _ = fused_and_full("llama")
    lorafuse.unfuse(fused)
    assert loss_kernel_forwards(fused) == 0
    assert fused.train()(**batch("llama")).logits is not None


def test_forward_shows_transformers_signature_and_pickles(tmp_path):
    # HF's Trainer keeps the dataset columns its model's forward names, and passes num_items_in_batch when it can
    fused = lorafuse.get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"]))
    import inspect
    names = inspect.signature(fused.get_base_model().forward).parameters
    assert {"input_ids", "attention_mask", "labels", "kwargs"} <= set(names)
    assert accepts_loss_kwargs(fused)
    torch.save(fused, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loss_kernel_forwards(loaded) == 1
    inputs = batch("llama")
    assert torch.equal(loaded.train()(**inputs).loss, fused.train()(**inputs).loss)
