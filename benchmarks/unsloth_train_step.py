"""Unsloth's LoRA training step, timed as bench_train_step times its providers; bench_train_step runs it (provider
`unsloth`) in a process of its own, because `import unsloth` patches transformers for the whole process.

    PYTHONPATH=/tmp/unsloth_site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \\
        UNSLOTH_DISABLE_STATISTICS=1 python benchmarks/unsloth_train_step.py --model DIR --adapters FILE --config JSON \\
        [--first-step FILE]

DIR: a model saved with save_pretrained beside a tokenizer; FILE: {LoRA parameter name: tensor}, PEFT's names
(bench_train_step saves its peft provider's base model with the bundled tiny Llama's tokenizer, and its adapters, so
that Unsloth trains the same weights and adapters). JSON: {"batch", "seq", "vocab", "warmup", "steps", "lr", "lora":
peft.LoraConfig's r, lora_alpha, lora_dropout (0), target_modules} and, optionally:
  "gradient_checkpointing"  Unsloth's use_gradient_checkpointing: false (the default), true, or "unsloth" (its
                            offloaded checkpointing)
  "host_gpu"                time_training's host_gpu (default true)
  "contexts"                [[batch, seq], ...] instead of batch and seq (bench_memory): each stepped in turn on the
                            one model (max_seq_length their longest seq), no first step; a context that runs out of
                            memory ends the list. The JSON line is then {"contexts": [a time_training dict with
                            reserved_GiB (max_memory_reserved over the timed steps), or {"oom": message}, ...]}
The wheels: shared/gpu-wheels-unsloth/README.md.

Method, bench_train_step's: FastLanguageModel.from_pretrained(DIR, load_in_4bit=False, dtype=bfloat16,
max_seq_length=seq), FastLanguageModel.get_peft_model with the LoRA config, bias "none" and the gradient
checkpointing of the config (none by default), its LoRA parameters then copied from --adapters; bench_train_step's
batch (common.token_ids). One training forward+backward, its loss and LoRA gradients saved to --first-step
(torch.save) for bench_train_step's check against peft; then common.adamw_step timed by common.time_training: warm-up
steps (Unsloth compiles each decoder block in its first steps), CUDA events between the timed steps, peak memory over
them, host and GPU ms.
Prints its log (Unsloth's banner says which kernels it patched), then one JSON line: the time_training dict.
"""
import argparse
import gc
import json
import os
import sys

import torch
from unsloth import FastLanguageModel  # before transformers, peft and trl are imported: it patches them

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import adamw_step, first_step, time_training, token_ids  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model folder with a tokenizer")
    parser.add_argument("--adapters", required=True, help="torch.save of {LoRA parameter name: tensor}")
    parser.add_argument("--config", required=True,
                        help="JSON: batch, seq (or contexts), vocab, warmup, steps, lr, lora[, gradient_checkpointing, "
                             "host_gpu]")
    parser.add_argument("--first-step", help="torch.save the first step's {'loss', 'grads'} here")
    args = parser.parse_args()
    config = json.loads(args.config)
    checkpointing = config.get("gradient_checkpointing", False)
    contexts = config.get("contexts", [[config.get("batch"), config.get("seq")]])
    model, _ = FastLanguageModel.from_pretrained(args.model, max_seq_length=max(seq for _, seq in contexts),
                                                 dtype=torch.bfloat16, load_in_4bit=False,
                                                 use_gradient_checkpointing=checkpointing)
    model = FastLanguageModel.get_peft_model(model, **config["lora"], bias="none",
                                             use_gradient_checkpointing=checkpointing)
    copy_adapters(model, torch.load(args.adapters))
    FastLanguageModel.for_training(model, use_gradient_checkpointing=checkpointing)
    device = next(model.parameters()).device  # where Unsloth put it: the GPU
    if "contexts" in config:
        print(json.dumps({"contexts": step_contexts(model, config, device)}))
        return
    ids = token_ids(config["vocab"], config["batch"], config["seq"], device)
    loss, grads = first_step(model, ids)
    if args.first_step:
        torch.save({"loss": loss, "grads": grads}, args.first_step)
    step = adamw_step(model, ids, config["lr"])
    print(json.dumps(time_training(step, config["warmup"], config["steps"], device,
                                   host_gpu=config.get("host_gpu", True))))


def step_contexts(model, config, device):
    """time_training's dict, reserved_GiB added, of each of config's contexts in turn, up to the first that runs out
    of memory: {"oom": its message} for that one, nothing after it."""
    results = []
    for batch, seq in config["contexts"]:
        try:
            step = adamw_step(model, token_ids(config["vocab"], batch, seq, device), config["lr"])
            result = time_training(step, config["warmup"], config["steps"], device,
                                   host_gpu=config.get("host_gpu", True))
            result["reserved_GiB"] = torch.cuda.max_memory_reserved() / 2 ** 30
        except torch.OutOfMemoryError as exc:
            result = {"oom": str(exc).splitlines()[0][:160]}
        step = None  # this context's optimizer state and batch freed before the next one's
        gc.collect()
        torch.cuda.empty_cache()
        results.append(result)
        if "oom" in result:
            break
    return results


def copy_adapters(model, adapters):
    """The LoRA parameters of `model` set to `adapters`' tensors, matched by name: every one, or SystemExit."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if params.keys() != adapters.keys():
        raise SystemExit(f"Unsloth's LoRA parameters are not PEFT's: {sorted(params.keys() - adapters.keys())[:4]} "
                         f"only here, {sorted(adapters.keys() - params.keys())[:4]} only in the file")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(adapters[name])


if __name__ == "__main__":
    main()
