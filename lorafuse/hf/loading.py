"""What the training recipe asks of transformers and PEFT: a causal LM and its tokenizer from a Hub id or a local
directory, LoRA on it (fused or PEFT's own), and the merged model at the end.

Loading errors name what was asked for and why it failed, so that the recipe can report them as a
config error at start-up instead of a traceback from deep inside transformers.
"""
import os
from pathlib import Path

import peft
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .._paths import looks_local
from .decoding import BASE
from .model import fuse, get_peft_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model or tokenizer that cannot be loaded: the message says which and why."""


def check_exists(name_or_path: str) -> None:
    """Fails at once for a local path that is not there: no download is attempted for it."""
    if looks_local(name_or_path) and not Path(name_or_path).expanduser().exists():
        raise ModelLoadError(f"{name_or_path!r} does not exist (a local directory, or a Hub id such as "
                             "'meta-llama/Llama-3.2-1B', is expected)")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    check_exists(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"no tokenizer could be loaded from {name_or_path!r}: {err}") from err
    if tokenizer.pad_token_id is None:  # Llama-3 and others ship none; padding never carries loss
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name_or_path: str, *, dtype: torch.dtype, attn_implementation: str, random_init: bool = False,
                   config_overrides: dict | None = None, trust_remote_code: bool = False,
                   seed: int = 0) -> PreTrainedModel:
    """The model at `name_or_path` with weights in `dtype`; with `random_init`, its config only, with weights drawn
    from `seed` (benchmarks and machines without the weights). `config_overrides` replace config fields."""
    check_exists(name_or_path)
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                            **(config_overrides or {}))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"no model config could be loaded from {name_or_path!r}: {err}") from err
    if random_init:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                trust_remote_code=trust_remote_code)
    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path, config=config, dtype=dtype,
                                                    attn_implementation=attn_implementation,
                                                    trust_remote_code=trust_remote_code)
    except OSError as err:
        raise ModelLoadError(f"no weights could be loaded from {name_or_path!r} ({err}); "
                             "model.random_init=true builds the model from its config instead") from err


def add_lora(model: PreTrainedModel, *, fused: bool, attention: bool, model_kernels: bool = True,
             loss_kernels: bool = True, **lora_config) -> peft.PeftModel:
    """A PeftModel with `peft.LoraConfig(task_type="CAUSAL_LM", **lora_config)`; with `fused`, its LoRA layers run
    lorafuse's kernels, with `attention` too its attention, with `model_kernels` its RMSNorms and SwiGLU MLPs, with
    `loss_kernels` its training loss (no full logits). Without `fused`: PEFT's own."""
    config = peft.LoraConfig(task_type="CAUSAL_LM", **lora_config)
    if not fused:
        return peft.get_peft_model(model, config)
    return get_peft_model(model, config, attention=attention, model_kernels=model_kernels, loss_kernels=loss_kernels)


def save_merged(base: PreTrainedModel, adapter_dir: str | os.PathLike, out_dir: str | os.PathLike,
                tokenizer: PreTrainedTokenizerBase) -> None:
    """`base` with the adapter saved in `adapter_dir` folded into its weights, saved as a plain transformers model."""
    merged = peft.PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def save_adapter(model: peft.PeftModel, out_dir: str | os.PathLike, state_dict: dict) -> None:
    """`model`'s adapter in PEFT's format, taken from `state_dict` (the gathered one under FSDP)."""
    # save_embedding_layers=False: LoRA leaves the embeddings frozen, but PEFT's "auto" would save them whole
    # whenever the vocabulary differs from the base config's (config_overrides, resized embeddings).
    model.save_pretrained(out_dir, state_dict=state_dict, save_embedding_layers=False)


def parameter_counts(model: peft.PeftModel) -> tuple[int, int]:
    """(trainable, total) parameters."""
    return model.get_nb_trainable_parameters()


def load_adapter(model: PreTrainedModel, adapter: str | os.PathLike, attention: bool,
                 others: dict[str, str] | None = None) -> peft.PeftModel:
    """The adapter saved in `adapter` (by PEFT or lorafuse) on `model`, active as "default", and the adapters of
    `others` (name: directory) beside it, with fused LoRA layers and, with `attention`, lorafuse attention."""
    check_exists(str(adapter))
    peft_model = peft.PeftModel.from_pretrained(model, adapter)
    for name, directory in (others or {}).items():
        if name in peft_model.peft_config or name == BASE:
            raise ModelLoadError(f"model.adapters: the name {name!r} is taken (by model.adapter, or PEFT's name for "
                                 "no adapter); pick another")
        check_exists(str(directory))
        peft_model.load_adapter(directory, adapter_name=name)
    return fuse(peft_model, attention=attention)
