"""Packed rows keep attention inside each sample: a packed row's logits equal each sample's logits run alone.

lorafuse's attention reads the restarting position ids. transformers' sdpa and eager attention, given no mask,
do not (on transformers 5.23 the second sample's logits differ by 11.7): the recipe refuses packing with them,
which the "leak" case below pins, so that the refusal is dropped once transformers keeps them apart."""
import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import lorafuse.hf  # noqa: F401  (registers attn_implementation="lorafuse")
from lorafuse._paths import ASSETS
from lorafuse.train.config import DataConfig
from lorafuse.train.data import Collator, pack, tokenize

TINY = ASSETS / "tiny-llama"
ROWS = [{"instruction": "Reverse the letters of: zorbal", "input": "", "output": "labroz"},
        {"instruction": "What is 12 plus 30?", "input": "", "output": "42"},
        {"instruction": "Write this word in capital letters.", "input": "quenbit", "output": "QUENBIT"}]


@pytest.mark.parametrize("attention,apart", [("lorafuse", True), ("sdpa", False), ("eager", False)])
def test_a_packed_row_computes_each_sample_as_if_alone(attention, apart, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    samples = tokenize(datasets.Dataset.from_list(ROWS), DataConfig(path="unused"), tokenizer)
    packed = pack(samples, max_length=256)
    assert len(packed) == 1
    batch = Collator(pad_token_id=tokenizer.pad_token_id)([packed[0]])
    assert "attention_mask" not in batch and batch["input_ids"].shape[1] % 8 == 0  # padded: a 4th "sample"

    model = AutoModelForCausalLM.from_pretrained(TINY, attn_implementation=attention).eval()
    errors, start = [], 0
    with torch.no_grad():
        together = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        for sample in samples:
            ids = torch.tensor([sample["input_ids"]])
            alone = model(input_ids=ids).logits[0]
            errors.append((together[start:start + ids.shape[1]] - alone).abs().max().item())
            start += ids.shape[1]
    assert errors[0] < 1e-4  # the first sample sees nothing before it either way
    assert all(error < 1e-4 for error in errors) if apart else min(errors[1:]) > 1.0, errors
