"""Decoding speed: lorafuse's static-cache engine (CUDA graphs per bucket) against transformers' generate, with the
adapter merged and unmerged, beside the GPU's copy bandwidth (batch-1 decoding reads every weight per token).

    python benchmarks/bench_decode.py [--quick] [--out DIR]

First a check: on the bundled tiny Llama, every bucket's graph replay gives the tokens of the same engine run
eagerly, before and after an adapter swap. Then Llama-3.2-1B-shaped models with random bf16 weights and a LoRA
adapter (r=16, all linear layers), a 128-token prompt and 256 new tokens (--quick: 64 new tokens, batch 1,
no compiled transformers). EOS is switched off so that every run makes all its tokens. Rows: <out>/decode.csv.
"""
import argparse
import os
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import lorafuse
from lorafuse._paths import ASSETS
from lorafuse.inference import Engine, SamplingParams

from common import environment, write_rows

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0)


def lora_model(config_overrides: dict, dtype: torch.dtype, seed: int = 0):
    """A random-weight Llama on the GPU with a LoRA adapter whose B is non-zero (so that it changes the output)."""
    config = AutoConfig.from_pretrained(ASSETS / "tiny-llama", **config_overrides)
    config.eos_token_id = None  # every run makes all its tokens
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return lorafuse.fuse(peft_model).eval()  # fused LoRA layers, lorafuse attention (unfuse: PEFT's, sdpa)


def check_graphs_against_eager(out_dir: str) -> None:
    """Every bucket: graph replay tokens == eager tokens (greedy, bf16), and again after swapping the adapter."""
    model = lora_model({}, torch.bfloat16)
    other = lora_model({}, torch.bfloat16, seed=1)
    swapped = os.path.join(out_dir, "other_adapter")
    other.save_pretrained(swapped)
    eager = Engine(model, max_length=96, cuda_graphs=False)
    graphs = Engine(model, max_length=96, cuda_graphs=True)
    params = SamplingParams(max_new_tokens=24)
    generator = torch.Generator().manual_seed(0)
    for stage in ("adapter A", "after swapping to adapter B"):
        for size in graphs.buckets:
            prompts = [torch.randint(3, 500, (int(n),), generator=generator).tolist()
                       for n in torch.randint(1, 40, (size,), generator=generator)]
            assert graphs.generate(prompts, params) == eager.generate(prompts, params), (stage, size)
        print(f"check: graph replay == eager for buckets {graphs.buckets} ({stage}); "
              f"capture {graphs.capture_seconds:.2f} s")
        graphs.swap_adapter(swapped)  # the eager engine shares the model: both now run adapter B


def copy_bandwidth_gbps(n_bytes: int = 2 << 30) -> float:
    source = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    target = torch.empty_like(source)
    ms = triton_ms(lambda: target.copy_(source))
    return 2 * n_bytes / ms / 1e6  # read + write


def triton_ms(fn) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5])[0]


def seconds(fn, repeats: int = 3) -> float:
    """Median wall time of fn() (it synchronises itself: generate returns tokens on the host)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_decode"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    check_graphs_against_eager(args.out)

    prompt_len, new = 128, 64 if args.quick else 256
    batches = (1,) if args.quick else (1, 8)
    tags, rows, table = environment(), [], []
    bandwidth = copy_bandwidth_gbps()
    rows.append(dict(tags, bench="decode", shape="copy_2GiB", provider="copy", mode="copy", median_ms="",
                     p20_ms="", p80_ms="", metric="GBps", value=bandwidth, baseline="", ratio=""))
    model = lora_model(LLAMA_1B, torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.get_base_model().parameters())
    for batch in batches:
        shape = f"llama1B_B{batch}_P{prompt_len}_G{new}"
        prompts = torch.randint(3, 120000, (batch, prompt_len)).tolist()
        params = SamplingParams(max_new_tokens=new)
        one = SamplingParams(max_new_tokens=1)
        ids = torch.tensor(prompts, device="cuda")
        results = {}
        hf = lambda n: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,  # noqa: E731
                                      min_new_tokens=n, do_sample=False)
        lorafuse.unfuse(model)  # transformers' own model, as users run it: sdpa attention, no adapter
        with model.disable_adapter():
            results["hf_eager"] = (seconds(lambda: hf(new), 1 if args.quick else 3), seconds(lambda: hf(1)), None)
        lorafuse.fuse(model)
        for provider, merge in (("lorafuse_unmerged", False), ("lorafuse_merged", True)):
            source = model if not merge else lora_model(LLAMA_1B, torch.bfloat16)
            engine = Engine(source, max_length=prompt_len + new, merge=merge, buckets=(1, 2, 4, 8, 16, 32))
            engine.generate(prompts, params)  # warm-up
            results[provider] = (seconds(lambda: engine.generate(prompts, params)),
                                 seconds(lambda: engine.generate(prompts, one)), engine.capture_seconds)
        for provider, (total, first, capture) in results.items():
            decode_s = (total - first) / (new - 1)  # per decode step, prefill left out
            gbps = weight_bytes / decode_s / 1e9
            common = dict(tags, bench="decode", shape=shape, provider=provider, mode="decode",
                          median_ms=1000 * decode_s, p20_ms="", p80_ms="", baseline="hf_eager",
                          ratio=decode_s / ((results["hf_eager"][0] - results["hf_eager"][1]) / (new - 1)))
            rows.append(dict(common, metric="tokens_per_s", value=batch * new / total))
            rows.append(dict(common, metric="GBps", value=gbps))
            if capture is not None:
                rows.append(dict(common, metric="capture_s", value=capture))
            table.append((shape, provider, batch * new / total, 1000 * decode_s, gbps, gbps / bandwidth, capture))
    write_rows(rows, "decode", [args.out])
    print(f"\ncopy bandwidth {bandwidth:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB")
    print(f"{'shape':24s} {'provider':18s} {'tok/s':>8s} {'ms/step':>8s} {'GB/s':>7s} {'of copy':>8s} {'capture s':>9s}")
    for shape, provider, tps, ms, gbps, frac, capture in table:
        print(f"{shape:24s} {provider:18s} {tps:8.0f} {ms:8.3f} {gbps:7.0f} {frac:8.2f} "
              f"{'' if capture is None else f'{capture:9.2f}'}")


if __name__ == "__main__":
    main()
