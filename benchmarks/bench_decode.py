"""Decoding speed: lorafuse's static-cache engine (one CUDA graph per batch bucket) against transformers' generate,
with the LoRA adapter merged and unmerged, beside the GPU's copy bandwidth (batch-1 decoding reads every weight per
token).

    python benchmarks/bench_decode.py [--quick] [--shapes 1B,8B] [--profile] [--hf-step] [--bank N] [--out DIR]

Models: Llama shapes with random bf16 weights built from a config (no download), attn_implementation "sdpa" for
transformers and "lorafuse" for lorafuse; a LoRA adapter r=16 on all linear layers with B drawn N(0, 0.02) so that
it changes the output. EOS is switched off so that every run makes all its tokens. A 128-token prompt and 256 new
tokens (--quick: 64 new tokens, batch 1, 1B only, no compiled transformers); batches 1 and 8.

Providers:
  hf_eager            transformers' generate on the base model (dynamic cache, eager) - the baseline
  hf_static_compiled  the same with cache_implementation="static" (transformers compiles the decode step on the
                      first call; that call's time is the row's capture_s)
  lorafuse_merged     Engine(merge=True): the adapter folded into the weights, decode steps replayed from graphs
                      (the fused decode step, lorafuse.hf.fused_decode)
  lorafuse_unmerged   Engine(merge=False): the unmerged adapter inside the fused step's kernels, same graphs
  lorafuse_*_hf_step  (--hf-step) the same with Engine(fused_step=False): transformers' forward as the decode step,
                      fused LoRA layers on the unmerged adapter (each on a model of its own: two more in memory)
  lorafuse_bankN      (--bank N) N adapters of the same shape in one PeftModel (an adapter bank), the rows of each
                      batch on the adapters in turn (batch 1: the first): the cost of serving several at once
  copy                a 2 GiB device-to-device copy (read + write bytes per second): the bandwidth yardstick

Per decode step, the prefill left out: lorafuse's engines, the time from a call's first token on the host to its
last / (G - 1) (the engine streams its tokens); transformers, (time of G new tokens - time of 1 new token) /
(G - 1), the two calls alternating. Each the fastest of 5 timed calls after a warm-up call (hf_eager: one timed
call of each). The engines are not timed by that difference: the unmerged engine's eager prefill would make it
jitter (older rows of decode.csv were taken so, as the median of 3 calls). GBps = bytes of the base weights
(embedding counted once, tied as the lm_head) / time per step. Rows: <out>/decode.csv (bench and mode
`decode`, shape `llama1B_B1_P128_G256`, metrics tokens_per_s = batch * G / time of the G-token call, GBps,
capture_s), baseline hf_eager, ratio = time per step / hf_eager's.
Correctness of the replayed graphs: tests/inference/test_cuda_graphs.py.
"""
import argparse
import os
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import LogWatch, environment, print_profile, write_rows  # noqa: E402

import lorafuse  # noqa: E402
from lorafuse._paths import ASSETS  # noqa: E402
from lorafuse.inference import Engine, SamplingParams  # noqa: E402

SHAPES = {
    "1B": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0),
}
PROMPT = 128


def base_model(shape: str):
    """A random-weight bf16 Llama of `shape` on the GPU, attn_implementation="sdpa", EOS off; the same weights on
    every call."""
    config = AutoConfig.from_pretrained(ASSETS / "tiny-llama", **SHAPES[shape], max_position_embeddings=4096)
    config.eos_token_id = None
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    return model.eval()


def lora_model(shape: str, adapters: int = 1):
    """base_model(shape) with `adapters` LoRA adapters (r=16, all linear layers, non-zero B; "default", "bank1",
    ...), fused: lorafuse's LoRA layers and attention."""
    def config():
        return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    peft_model = get_peft_model(base_model(shape), config())
    for i in range(1, adapters):
        peft_model.add_adapter(f"bank{i}", config())
    generator = torch.Generator("cuda").manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=generator)
    return lorafuse.fuse(peft_model).eval()


def copy_gbps(n_bytes: int = 2 << 30) -> float:
    import triton
    source = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), warmup=25, rep=200, return_mode="median")
    return 2 * n_bytes / ms / 1e6  # read + write


def fastest_seconds(many, one, rounds: int) -> tuple[float, float]:
    """(fastest wall time of many(), of one()) over `rounds` rounds, the two calls alternating (each returns tokens
    on the host: it has synchronised); the caller has warmed them up. The fastest, not the median: what varies
    between calls is host time (Python, prefill launches, the allocator) that only ever adds, and with 64 new tokens
    a median of three let it move the per-step figure markedly."""
    times = {many: [], one: []}
    for _ in range(rounds):
        for fn in (many, one):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[fn].append(time.perf_counter() - start)
    return min(times[many]), min(times[one])


def hf_provider(model, ids, new: int, compiled: bool):
    """(time of `new` tokens, time per decode step, first-call seconds when compiled) for transformers' greedy
    generate; per step = (time of `new` tokens - time of 1 token) / (new - 1). Eager generate is slow and steady:
    timed once."""
    extra = {"cache_implementation": "static"} if compiled else {}

    def run(n):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, **extra)
    start = time.perf_counter()
    run(new)  # warm-up; with a static cache it compiles the decode step
    run(1)
    torch.cuda.synchronize()
    first_call = time.perf_counter() - start
    many, one = fastest_seconds(lambda: run(new), lambda: run(1), rounds=5 if compiled else 1)
    return many, (many - one) / (new - 1), first_call if compiled else None


def decode_seconds(engine: Engine, prompts, params: SamplingParams, adapters) -> tuple[float, float]:
    """(seconds of a whole generate call, seconds from its first token on the host to its last). The engine yields
    the first token right after the prefill, then every `check_every` steps (each yield has read the tokens, so the
    GPU is done with them): the second figure holds the new - 1 decode steps and their host reads, no prefill."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    first = None
    for _ in engine.stream(prompts, params, adapters):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return end - start, end - first


def engine_provider(engine: Engine, prompts, new: int):
    """(time of `new` tokens, time per decode step, capture seconds) for lorafuse's engine, greedy; with an adapter
    bank the rows take its adapters in turn. Per step: the decode phase of a call (`decode_seconds`) / (new - 1),
    the fastest of 5 calls. The prefill is left out by timing, not by subtracting a 1-token call: an unmerged
    adapter's prefill runs eagerly on the host, and its jitter moved the difference markedly in 64-token runs."""
    params = SamplingParams(max_new_tokens=new)
    names = engine.adapter_names
    adapters = [names[i % len(names)] for i in range(len(prompts))] if len(names) > 1 else None
    decode_seconds(engine, prompts, params, adapters)  # warm-up
    calls = [decode_seconds(engine, prompts, params, adapters) for _ in range(5)]
    return min(total for total, _ in calls), min(steps for _, steps in calls) / (new - 1), engine.capture_seconds


def bench_shape(shape: str, batches, new: int, compiled: bool, profile: bool, hf_step: bool, bank: int, tags: dict,
                bandwidth: float):
    rows, table = [], []
    base = base_model(shape)
    weight_bytes = sum(p.numel() * p.element_size() for p in base.parameters())  # tied embedding counted once
    unmerged = lora_model(shape)
    merged = lora_model(shape)
    engines = {"lorafuse_merged": Engine(merged, max_length=PROMPT + new, merge=True),
               "lorafuse_unmerged": Engine(unmerged, max_length=PROMPT + new)}
    if hf_step:
        engines |= {"lorafuse_merged_hf_step": Engine(lora_model(shape), max_length=PROMPT + new, merge=True,
                                                      fused_step=False),
                    "lorafuse_unmerged_hf_step": Engine(lora_model(shape), max_length=PROMPT + new, fused_step=False)}
    if bank > 1:
        engines[f"lorafuse_bank{bank}"] = Engine(lora_model(shape, bank), max_length=PROMPT + new)
    for batch in batches:
        key = f"llama{shape}_B{batch}_P{PROMPT}_G{new}"
        prompts = torch.randint(3, 120000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).tolist()
        ids = torch.tensor(prompts, device="cuda")
        results = {"hf_eager": hf_provider(base, ids, new, compiled=False)}
        if compiled:
            results["hf_static_compiled"] = hf_provider(base, ids, new, compiled=True)
        for provider, engine in engines.items():
            results[provider] = engine_provider(engine, prompts, new)
        per_step = {p: step for p, (_, step, _) in results.items()}
        for provider, (total, _, capture) in results.items():
            common = dict(tags, bench="decode", shape=key, provider=provider, mode="decode",
                          median_ms=1000 * per_step[provider], p20_ms="", p80_ms="", baseline="hf_eager",
                          ratio=per_step[provider] / per_step["hf_eager"])
            gbps = weight_bytes / per_step[provider] / 1e9
            rows += [dict(common, metric="tokens_per_s", value=batch * new / total),
                     dict(common, metric="GBps", value=gbps)]
            if capture is not None:
                rows.append(dict(common, metric="capture_s", value=capture))
            table.append((key, provider, batch * new / total, 1000 * per_step[provider], gbps, gbps / bandwidth,
                          capture))
        if profile and batch == batches[0]:
            for provider, engine in engines.items():
                # eager steps run the graphs' kernels; 1-token prompts make the prefill one more decode-sized step
                eager = Engine(engine.model, max_length=32, buckets=(batch,), cuda_graphs=False,
                               fused_step=engine.fused_step_reason is None)
                eager.generate([[5]] * batch, SamplingParams(max_new_tokens=16))
                print_profile(f"{key} {provider}: 16 tokens from 1-token prompts (times per 16 tokens)",
                              lambda: eager.generate([[5]] * batch, SamplingParams(max_new_tokens=16)), steps=1,
                              kernels=25)
    print(f"  {shape}: weights {weight_bytes / 1e9:.2f} GB")
    del base, unmerged, merged, engines
    torch.cuda.empty_cache()
    return rows, table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", default="1B,8B", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--profile", action="store_true", help="print the largest GPU kernels of decode steps")
    parser.add_argument("--hf-step", action="store_true",
                        help="also time the engine with transformers' forward as its decode step (fused_step=False)")
    parser.add_argument("--bank", type=int, default=0, help="also time an engine over N adapters (N >= 2, r=16: "
                        "N <= 4 keeps the fused step)")
    parser.add_argument("--out", default=None, help="directory of decode.csv (default: benchmarks/results and $OUT)")
    args = parser.parse_args()
    shapes = ["1B"] if args.quick else args.shapes.split(",")
    new, batches = (64, (1,)) if args.quick else (256, (1, 8))
    watch, tags = LogWatch(), environment()
    bandwidth = copy_gbps()
    rows = [dict(tags, bench="decode", shape="copy_2GiB", provider="copy", mode="copy", median_ms="", p20_ms="",
                 p80_ms="", metric="GBps", value=bandwidth, baseline="", ratio="")]
    table = []
    for shape in shapes:
        shape_rows, shape_table = bench_shape(shape, batches, new, not args.quick, args.profile, args.hf_step,
                                              args.bank, tags,
                                              bandwidth)
        rows += shape_rows
        table += shape_table
    out_dirs = [args.out] if args.out else [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")] + (
        [os.environ["OUT"]] if os.environ.get("OUT") else [])
    write_rows(rows, "decode", out_dirs)
    # the engine says when it casts PEFT's fp32 adapters to the model's dtype: expected here, not a fallback
    fallbacks = [m for m in watch.messages if "LoRA adapters cast in place" not in m]
    if fallbacks:
        print(f"\nWARNING: lorafuse fell back {len(fallbacks)} time(s): rows may not time its kernels")
    print(f"\ncopy bandwidth {bandwidth:.0f} GB/s")
    print(f"{'shape':22s} {'provider':19s} {'tok/s':>8s} {'ms/step':>8s} {'GB/s':>7s} {'of copy':>8s} "
          f"{'capture s':>9s}")
    for key, provider, tps, ms, gbps, fraction, capture in table:
        capture = "" if capture is None else f"{capture:9.2f}"
        print(f"{key:22s} {provider:19s} {tps:8.0f} {ms:8.3f} {gbps:7.0f} {fraction:8.2f} {capture:>9s}")


if __name__ == "__main__":
    main()
