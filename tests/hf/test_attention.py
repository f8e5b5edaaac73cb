"""attn_implementation="lorafuse" on tiny stock models: logits and every gradient against sdpa and eager (padding,
packing, sliding windows, KV-cache decoding), registration, and the logged fallbacks."""
import copy
import importlib
import logging

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
                          StaticCache, masking_utils)
from transformers.modeling_utils import AttentionInterface

import lorafuse
import lorafuse.hf
from lorafuse.ops.attention.windows import AttentionWindows
from tests.lora_check import relative_error

attention = importlib.import_module("lorafuse.hf.attention")

VOCAB = 97
CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
KINDS = list(CONFIGS)


def tiny_config(kind: str, **overrides):
    """hidden 64, 4 query heads sharing 2 key/value heads of dim 16, 2 layers."""
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
    args.update(overrides)
    return CONFIGS[kind](**args) if kind in CONFIGS else kind(**args)


def tiny_model(kind: str, attn_implementation="sdpa", **overrides):
    """Random fp32 weights, large enough that attention is far from uniform."""
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), attn_implementation=attn_implementation)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.15)
    return model.float()


def padded_batch(padding: str, lengths=(9, 6, 3, 8), n: int = 9):
    """input_ids [B, n] and attention_mask [B, n]: rows of `lengths` real tokens, padded on `padding`'s side.
    Padding positions hold random token ids (not the pad id), which must not reach real positions."""
    ids = torch.randint(3, VOCAB, (len(lengths), n))
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for row, length in enumerate(lengths):
        if padding == "left":
            mask[row, n - length:] = 1
        else:
            mask[row, :length] = 1
    return ids, mask


def logits_and_grads(model, impl: str, loss_mask: torch.Tensor | None = None, **inputs):
    """Logits and every parameter's gradient of a fixed random projection of the logits at loss_mask's positions."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    if loss_mask is not None:
        weights = weights * loss_mask[..., None]
    (logits * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5):
    error = relative_error(got, want)
    assert error < tol, f"{what}: relative error {error:.2e} (allowed < {tol:g})"


def assert_grads_close(got: dict, want: dict, tol: float = 1e-5):
    assert got.keys() == want.keys() and got
    for name in want:
        assert torch.isfinite(got[name]).all(), f"{name}: gradient not finite"
        assert_close(got[name], want[name], f"gradient of {name}", tol)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Shapes and arguments of every call of the flash-attention op from the attention function."""
    real, calls = attention.flash_attention, []

    def counted(q, k, v, causal=False, scale=None, windows=None, **kwargs):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), causal=causal, windows=windows))
        return real(q, k, v, causal=causal, scale=scale, windows=windows, **kwargs)

    monkeypatch.setattr(attention, "flash_attention", counted)
    return calls



def messages(log, level=logging.WARNING):
    return [r.getMessage() for r in log.records if r.name == "lorafuse" and r.levelno >= level]


# ---------------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------------

def test_registered_and_idempotent():
    assert AttentionInterface._global_mapping["lorafuse"] is attention.lorafuse_attention_forward
    assert masking_utils.AttentionMaskInterface._global_mapping["lorafuse"] is attention.lorafuse_mask
    lorafuse.register_attention()
    lorafuse.hf.register_attention()
    assert AttentionInterface._global_mapping["lorafuse"] is attention.lorafuse_attention_forward
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["lorafuse"] is attention.lorafuse_mask


def test_mask_function_is_compact():
    """No N x N mask for causal / sliding / packed patterns; the dense one for anything else, equal to sdpa's."""
    pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    full = torch.ones(2, 4, dtype=torch.bool)
    causal = masking_utils.causal_mask_function
    sliding = masking_utils.sliding_window_causal_mask_function(2)
    args = dict(batch_size=2, q_length=4, kv_length=4)
    assert attention.lorafuse_mask(**args, mask_function=causal, attention_mask=None) is None
    assert attention.lorafuse_mask(**args, mask_function=causal, attention_mask=full) is None
    assert torch.equal(attention.lorafuse_mask(**args, mask_function=causal, attention_mask=pad), pad)
    assert torch.equal(attention.lorafuse_mask(**args, mask_function=sliding, attention_mask=pad), pad)
    # a sliding layer's cache holds the last kv_length keys: the mask is cut to them
    cut = attention.lorafuse_mask(batch_size=2, q_length=1, kv_length=3, kv_offset=1, mask_function=sliding,
                                  attention_mask=pad)
    assert torch.equal(cut, pad[:, -3:])
    # a static cache: 6 slots, 3 filled
    static = attention.lorafuse_mask(batch_size=2, q_length=1, kv_length=6, q_offset=2, mask_function=causal)
    assert torch.equal(static, torch.ones(2, 3, dtype=torch.bool))
    # packed sequences, as create_causal_mask builds their mask function (transformers 5.17 / >= 5.18)
    position_ids = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])
    sequences = masking_utils.find_packed_sequence_indices(position_ids)
    compatible = getattr(masking_utils, "packed_sequence_compatibility_function", None)
    for base in (causal, sliding):
        packed = (compatible(base, position_ids, sequences) if compatible else
                  masking_utils.and_masks(base, masking_utils.packed_sequence_mask_function(sequences)))
        assert attention.lorafuse_mask(**args, mask_function=packed, attention_mask=None) is None
    # an encoder's padding (bidirectional): the keep-mask too
    bidirectional = masking_utils.bidirectional_mask_function
    assert torch.equal(attention.lorafuse_mask(**args, mask_function=bidirectional, attention_mask=pad), pad)
    assert attention.lorafuse_mask(**args, mask_function=bidirectional, attention_mask=full) is None
    # anything else: the dense mask sdpa would get
    extra = masking_utils.or_masks(causal, lambda b, h, q, kv: kv == 0)
    for mask_function in (extra, masking_utils.chunked_causal_mask_function(2, torch.zeros(2, dtype=torch.long))):
        dense = attention.lorafuse_mask(**args, mask_function=mask_function, attention_mask=pad)
        want = masking_utils.sdpa_mask(**args, mask_function=mask_function, attention_mask=pad,
                                       allow_is_causal_skip=False)
        assert dense.shape == (2, 1, 4, 4) and torch.equal(dense, want)


# ---------------------------------------------------------------------------------------------------------------
# Against sdpa and eager
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("kind", KINDS)
def test_padded_batch_matches_sdpa_and_eager(kind, padding, kernel_calls, fallback_log):
    model = tiny_model(kind)
    ids, mask = padded_batch(padding)
    real = mask.bool()
    results = {impl: logits_and_grads(model, impl, real, input_ids=ids, attention_mask=mask)
               for impl in ("sdpa", "eager")}
    kernel_calls.clear()
    logits, grads = logits_and_grads(model, "lorafuse", real, input_ids=ids, attention_mask=mask)
    # causal with windows: the compact mask (a dense one would come as causal=False)
    assert [(c["causal"], c["windows"] is not None) for c in kernel_calls] == [(True, True)] * 2
    assert kernel_calls[0]["k"][1] == 2  # grouped-query heads: K/V not repeated
    assert not messages(fallback_log)
    assert torch.isfinite(logits).all()  # padding queries attend nothing and output zeros, not NaN
    for impl, (want_logits, want_grads) in results.items():
        assert_close(logits[real], want_logits[real], f"logits vs {impl}")
        assert_grads_close(grads, want_grads)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_unpadded_batch_runs_causal_over_whole_rows(kind, kernel_calls):
    # Windows come from the position ids, built on the device without asking whether they restart (no host sync):
    # for rows of one sequence each, every query's window is the whole row, narrowed by causality in the kernel.
    model = tiny_model(kind)
    ids = torch.randint(3, VOCAB, (2, 7))
    want = logits_and_grads(model, "sdpa", input_ids=ids)
    got = logits_and_grads(model, "lorafuse", input_ids=ids, attention_mask=torch.ones_like(ids))
    assert [c["causal"] for c in kernel_calls] == [True] * 2
    for call in kernel_calls:
        windows = call["windows"]
        assert windows is None or (windows.key_lo.eq(0).all() and windows.key_hi.eq(7).all())
    assert_close(got[0], want[0], "logits")
    assert_grads_close(got[1], want[1])


def test_padding_inputs_do_not_reach_real_positions():
    model = tiny_model("llama")
    ids, mask = padded_batch("left")
    real = mask.bool()
    other = torch.where(real, ids, torch.randint(3, VOCAB, ids.shape))
    logits, grads = logits_and_grads(model, "lorafuse", real, input_ids=ids, attention_mask=mask)
    logits_other, grads_other = logits_and_grads(model, "lorafuse", real, input_ids=other, attention_mask=mask)
    assert torch.equal(logits[real], logits_other[real])
    embed = "model.embed_tokens.weight"
    assert_grads_close({k: v for k, v in grads_other.items() if k != embed}, {k: v for k, v in grads.items()
                                                                              if k != embed})
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_padding_check_runs_once_per_forward(monkeypatch, kernel_calls):
    """The host-side checks of the mask are memoised on it: once per forward, not once per layer."""
    checks = []
    real_check = attention.padding_mask_is_contiguous
    monkeypatch.setattr(attention, "padding_mask_is_contiguous", lambda m: checks.append(1) or real_check(m))
    model = tiny_model("llama", attn_implementation="lorafuse", num_hidden_layers=3)
    ids, mask = padded_batch("right")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids, attention_mask=mask)
    assert len(kernel_calls) == 6 and len(checks) == 2


# ---------------------------------------------------------------------------------------------------------------
# Packed sequences, sliding windows
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences_attend_only_within_themselves(kind, kernel_calls):
    """Two sequences in one row, position ids restarting, no mask (as DataCollatorWithFlattening packs them)."""
    model = tiny_model(kind)
    first, second = torch.randint(3, VOCAB, (1, 5)), torch.randint(3, VOCAB, (1, 6))
    packed = torch.cat([first, second], 1)
    position_ids = torch.cat([torch.arange(5), torch.arange(6)])[None]
    # use_cache=False, as in training: transformers then also detects the packing (its mask function sees it)
    logits, grads = logits_and_grads(model, "lorafuse", input_ids=packed, position_ids=position_ids, use_cache=False)
    assert [(c["causal"], c["windows"] is not None) for c in kernel_calls] == [(True, True)] * 2
    kernel_calls.clear()
    with torch.no_grad():  # with a cache (generate's prefill) transformers does not split; flash_attention_2 does
        assert torch.equal(model(input_ids=packed, position_ids=position_ids).logits, logits)
    assert [(c["causal"], c["windows"] is not None) for c in kernel_calls] == [(True, True)] * 2

    # separately: the same loss, summed over the two sequences
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    separate = [model(input_ids=first).logits, model(input_ids=second).logits]
    (separate[0] * weights[:, :5]).sum().add((separate[1] * weights[:, 5:]).sum()).backward()
    want_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert_close(logits, torch.cat(separate, 1).detach(), "packed logits vs separate")
    assert_grads_close(grads, want_grads)
    # and sdpa, which transformers splits by position ids too when there is no cache (training)
    want_logits, _ = logits_and_grads(model, "sdpa", input_ids=packed, position_ids=position_ids, use_cache=False)
    assert_close(logits, want_logits, "packed logits vs sdpa")


def test_packed_rows_in_a_batch_and_flash_varlen_kwargs(kernel_calls):
    model = tiny_model("qwen2", attn_implementation="lorafuse")
    lengths = [(4, 3, 2), (2, 7)]
    rows = [torch.randint(3, VOCAB, (1, 9)) for _ in lengths]
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    with torch.no_grad():
        batch = model(input_ids=torch.cat(rows), position_ids=position_ids).logits
        for r, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = model(input_ids=rows[r][:, start:start + n]).logits
                assert_close(batch[r, start:start + n], alone[0], f"row {r} sequence at {start}")
                start += n
        assert all(c["windows"] is not None for c in kernel_calls[:2])
        # flash-attention's varlen kwargs alone (no position ids: RoPE is relative, so only the split matters)
        kernel_calls.clear()
        cu = torch.tensor([0, 4, 7, 9], dtype=torch.int32)
        varlen = model(input_ids=rows[0], cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=4,
                       max_length_k=4).logits
    assert_close(varlen[0], batch[0], "cu_seq_lens vs position ids")
    assert all(c["windows"] is not None for c in kernel_calls)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_matches_sdpa(kind, padding, kernel_calls):
    """Mistral with a window of 4 on every layer; Qwen2 with a sliding second layer (a full and a sliding mask)."""
    overrides = dict(sliding_window=4)
    if kind == "qwen2":
        overrides.update(use_sliding_window=True, max_window_layers=1)
    model = tiny_model(kind, **overrides)
    if kind == "qwen2":
        assert model.config.layer_types == ["full_attention", "sliding_attention"]
    ids, mask = padded_batch(padding if padding != "none" else "left", lengths=(11, 7, 10), n=11)
    if padding == "none":
        mask = torch.ones_like(mask)
    real = mask.bool()
    want_logits, want_grads = logits_and_grads(model, "sdpa", real, input_ids=ids, attention_mask=mask)
    logits, grads = logits_and_grads(model, "lorafuse", real, input_ids=ids, attention_mask=mask)
    # every layer gets windows (padding, or the position ids' whole rows), narrowed on the sliding layers
    assert [(c["causal"], c["windows"] is not None) for c in kernel_calls] == [(True, True)] * 2
    assert_close(logits[real], want_logits[real], "logits vs sdpa")
    assert_grads_close(grads, want_grads)


def test_sliding_windows_are_memoised_with_the_position_ids(monkeypatch, kernel_calls):
    """Narrowed to the sliding window once per forward, not once per layer; anew when the position ids change in
    place (packed there), with the logits of a fresh tensor holding the same ids."""
    built = []
    real_narrowing = attention.with_sliding_window
    monkeypatch.setattr(attention, "with_sliding_window", lambda *args: built.append(1) or real_narrowing(*args))
    model = tiny_model("mistral", attn_implementation="lorafuse", num_hidden_layers=3, sliding_window=4)
    ids = torch.randint(3, VOCAB, (2, 9))
    position_ids = torch.arange(9).repeat(2, 1)
    with torch.no_grad():
        model(input_ids=ids, position_ids=position_ids, use_cache=False)
        assert len(kernel_calls) == 3 and len(built) == 1
        position_ids[1, 5:] = torch.arange(4)
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        assert len(kernel_calls) == 6 and len(built) == 2
        want = model(input_ids=ids, position_ids=position_ids.clone(), use_cache=False).logits
    assert torch.equal(logits, want)


# ---------------------------------------------------------------------------------------------------------------
# Loading, switching, generating
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_from_config_and_switching(kind, tmp_path, kernel_calls):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path)
    ids, mask = padded_batch("left")
    real = mask.bool()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="lorafuse", dtype=torch.float32)
        assert loaded.config._attn_implementation == "lorafuse"
        assert_close(loaded(input_ids=ids, attention_mask=mask).logits[real], want[real], "from_pretrained")
        assert len(kernel_calls) == 2

        built = AutoModelForCausalLM.from_config(model.config, attn_implementation="lorafuse")
        assert built.config._attn_implementation == "lorafuse"
        built.load_state_dict(model.state_dict())
        assert_close(built(input_ids=ids, attention_mask=mask).logits[real], want[real], "from_config")
        assert len(kernel_calls) == 4

        model.set_attn_implementation("lorafuse")
        assert model.config._attn_implementation == "lorafuse"
        assert_close(model(input_ids=ids, attention_mask=mask).logits[real], want[real], "set to lorafuse")
        assert len(kernel_calls) == 6
        model.set_attn_implementation("sdpa")
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, want)
        assert len(kernel_calls) == 6


@pytest.mark.parametrize("kind, overrides", [("llama", {}), ("qwen3", {}), ("mistral", dict(sliding_window=4))],
                         ids=["llama", "qwen3", "mistral-window4"])
def test_generate_with_kv_cache_matches_sdpa(kind, overrides, kernel_calls):
    """Greedy decoding of a left-padded batch through a dynamic cache (past the sliding window for Mistral)."""
    model = tiny_model(kind, **overrides)
    ids, mask = padded_batch("left", lengths=(6, 4, 2), n=6)
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True,
                pad_token_id=0)
    want = model.generate(**args)
    model.set_attn_implementation("lorafuse")
    got = model.generate(**args)
    assert torch.equal(got, want)
    decode = [c for c in kernel_calls if c["q"][2] == 1]
    assert len(decode) == 2 * 4 and decode[0]["windows"] is not None  # the first step still sees padding


def test_static_cache_generate_matches_sdpa(kernel_calls):
    """A static cache holds unused slots: only the filled ones are attended."""
    model = tiny_model("llama")
    ids, mask = padded_batch("left", lengths=(5, 3), n=5)
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                cache_implementation="static")
    want = model.generate(**args)
    model.set_attn_implementation("lorafuse")
    assert torch.equal(model.generate(**args), want)
    assert kernel_calls and all(c["k"][2] <= 5 + 3 for c in kernel_calls)

    # without attention_mask: prefill sees the 5 filled slots; the decode step's mask is dense (the cache's
    # offset is a tensor) and still runs the kernel, as windows
    logits = {}
    for impl in ("sdpa", "lorafuse"):
        model.set_attn_implementation(impl)
        cache = StaticCache(config=model.config, max_cache_len=12)
        with torch.no_grad():
            logits[impl] = [model(input_ids=ids, past_key_values=cache).logits,
                            model(input_ids=ids[:, :1], past_key_values=cache).logits]
    for step, (got, want) in enumerate(zip(logits["lorafuse"], logits["sdpa"], strict=True)):
        assert_close(got, want, f"static cache, step {step}")
    assert [c["k"][2] for c in kernel_calls[-4:]] == [5, 5, 12, 12]


# ---------------------------------------------------------------------------------------------------------------
# Masks and fallbacks
# ---------------------------------------------------------------------------------------------------------------

def causal_padding_mask_4d(mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The additive [B, 1, N, N] mask of causal attention over real keys, as eager builds it."""
    n = mask.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]
    return torch.where(allowed, 0.0, torch.finfo(dtype).min)[:, None].to(dtype)


def test_4d_interval_mask_runs_the_kernel(kernel_calls, fallback_log):
    model = tiny_model("llama")
    ids, mask = padded_batch("right")
    real = mask.bool()
    dense = causal_padding_mask_4d(mask)
    want_logits, want_grads = logits_and_grads(model, "sdpa", real, input_ids=ids, attention_mask=mask)
    for custom in (dense, dense == 0):  # additive float, and bool
        logits, grads = logits_and_grads(model, "lorafuse", real, input_ids=ids, attention_mask=custom)
        assert_close(logits[real], want_logits[real], f"logits, {custom.dtype} 4-D mask")
        assert_grads_close(grads, want_grads)
    assert len(kernel_calls) == 4 and all(not c["causal"] and c["windows"] is not None for c in kernel_calls)
    assert not messages(fallback_log)


@pytest.mark.parametrize("case", ["holes", "biases", "non-contiguous padding"])
def test_masks_without_windows_fall_back_to_sdpa(case, kernel_calls, fallback_log):
    model = tiny_model("qwen2")
    ids, mask = padded_batch("right")
    if case == "non-contiguous padding":
        mask[0, 3] = 0
        custom = mask
    else:
        custom = causal_padding_mask_4d(mask)
        if case == "holes":
            custom[:, :, 6:, 2] = torch.finfo(torch.float32).min  # key 2 hidden from the late queries only
        else:
            custom = custom + 0.5 * torch.randn(custom.shape[-2:]).tril()
    real = mask.bool()
    want = logits_and_grads(model, "sdpa", real, input_ids=ids, attention_mask=custom)
    for _ in range(2):
        logits, grads = logits_and_grads(model, "lorafuse", real, input_ids=ids, attention_mask=custom)
    assert not kernel_calls
    assert len(messages(fallback_log)) == 1 and "sdpa attention runs" in messages(fallback_log)[0]
    assert_close(logits[real], want[0][real], "logits")
    assert_grads_close(grads, want[1])


def test_dropout_falls_back_to_sdpa(kernel_calls, fallback_log):
    model = tiny_model("llama", attention_dropout=0.3).train()
    ids, mask = padded_batch("left")
    real = mask.bool()
    torch.manual_seed(5)
    want = logits_and_grads(model, "sdpa", real, input_ids=ids, attention_mask=mask)
    torch.manual_seed(5)
    got = logits_and_grads(model, "lorafuse", real, input_ids=ids, attention_mask=mask)
    assert not kernel_calls and "attention dropout 0.3" in messages(fallback_log)[0]
    assert_close(got[0][real], want[0][real], "logits, same dropout draws")
    assert_grads_close(got[1], want[1])
    model.eval()  # no dropout: the kernel again
    logits_and_grads(model, "lorafuse", real, input_ids=ids, attention_mask=mask)
    assert len(kernel_calls) == 2 and len(messages(fallback_log)) == 1


def test_output_attentions_falls_back_to_eager(kernel_calls, fallback_log):
    model = tiny_model("mistral")
    ids, mask = padded_batch("left")
    real = mask.bool()
    with torch.no_grad():
        want = model.set_attn_implementation("eager") or model(input_ids=ids, attention_mask=mask,
                                                                output_attentions=True)
        model.set_attn_implementation("lorafuse")
        got = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert not kernel_calls and "output_attentions" in messages(fallback_log)[0]
    assert_close(got.logits[real], want.logits[real], "logits")
    for layer, (a, b) in enumerate(zip(got.attentions, want.attentions, strict=True)):
        assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], f"attention weights of layer {layer}")


def test_softcap_falls_back_to_the_models_eager(kernel_calls, fallback_log):
    """Gemma2 softcaps attention logits: sdpa cannot, so its own eager attention runs."""
    overrides = dict(sliding_window=4, query_pre_attn_scalar=16, attn_logit_softcapping=2.0)
    model = tiny_model(Gemma2Config, attn_implementation="eager", **overrides)
    ids, mask = padded_batch("left")
    real = mask.bool()
    want = logits_and_grads(model, "eager", real, input_ids=ids, attention_mask=mask)
    got = logits_and_grads(model, "lorafuse", real, input_ids=ids, attention_mask=mask)
    assert not kernel_calls and "eager attention runs because of softcapping" in messages(fallback_log)[0]
    assert len(messages(fallback_log)) == 1
    assert_close(got[0][real], want[0][real], "logits")
    assert_grads_close(got[1], want[1])


def test_attention_sinks_fall_back_to_the_models_eager(kernel_calls, fallback_log):
    """gpt-oss passes its learned sinks as s_aux: its own eager attention runs, never sdpa (which would drop them)."""
    gpt_oss = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
    config = gpt_oss.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_hidden_layers=2, sliding_window=4)
    config._attn_implementation = "eager"
    module = gpt_oss.GptOssAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        module.sinks.normal_()
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    keep = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    eager_mask = causal_padding_mask_4d(keep)
    want, _ = gpt_oss.eager_attention_forward(module, q, k, v, eager_mask, scaling=0.25)
    got, _ = attention.lorafuse_attention_forward(module, q, k, v, keep, scaling=0.25, s_aux=module.sinks)
    assert not kernel_calls and "attention sinks" in messages(fallback_log)[0]
    assert_close(got[keep], want[keep], "output")


def test_attention_function_shapes_and_empty_windows(kernel_calls):
    """Called directly: [B, Nq, Hq, D] out; a padded query (empty window) outputs zeros; decode against a cache."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    keep = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out, weights = attention.lorafuse_attention_forward(module, q, k, v, keep, scaling=0.25)
    assert out.shape == (2, 6, 4, 16) and weights is None and out.is_contiguous()
    assert torch.equal(out[0, :2], torch.zeros(2, 4, 16)) and out[0, 2:].abs().min() > 0
    want = torch.nn.functional.scaled_dot_product_attention(
        q[1:], k[1:].repeat_interleave(2, 1), v[1:].repeat_interleave(2, 1), is_causal=True, scale=0.25)
    assert_close(out[1:], want.transpose(1, 2), "unpadded row")
    # one query against 6 keys: sees all of its row's real keys
    step, _ = attention.lorafuse_attention_forward(module, q[:, :, -1:], k, v, keep, scaling=0.25)
    assert_close(step, out[:, -1:], "decode step")
    assert isinstance(kernel_calls[-1]["windows"], AttentionWindows)


def test_nan_in_padding_stays_there(kernel_calls):
    """Query, key and value rows of padding may hold anything, NaN included: real rows and gradients stay finite
    and equal to those of clean padding."""
    module = torch.nn.Module()
    module.is_causal = True
    keep = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    clean = [torch.randn(2, h, 7, 16) for h in (4, 2, 2)]
    poisoned = [torch.where(keep[:, None, :, None], t, torch.nan) for t in clean]
    grad_out = torch.randn(2, 7, 4, 16) * keep[:, :, None, None]
    results = []
    for inputs in (clean, poisoned):
        inputs = [t.clone().requires_grad_() for t in inputs]
        out, _ = attention.lorafuse_attention_forward(module, *inputs, keep, scaling=0.3)
        out.backward(grad_out)
        results.append([out] + [t.grad for t in inputs])
    assert len(kernel_calls) == 2
    for (want, got), what in zip(zip(*results), ["output", "dq", "dk", "dv"]):
        if what != "output":  # [B, H, N, D] -> [B, N, H, D], as the output
            want, got = want.transpose(1, 2), got.transpose(1, 2)
        assert torch.isfinite(got[keep]).all(), what
        assert_close(got[keep], want[keep], what)


def test_memo_follows_the_tensor():
    memo, computed = attention._Memo(size=2), []
    mask = torch.ones(2, 3)
    assert memo.get(mask, ("a",), lambda: computed.append(1) or 7) == 7
    assert memo.get(mask, ("a",), lambda: computed.append(1) or 8) == 7 and len(computed) == 1
    mask[0, 0] = 0  # changed in place: recomputed
    assert memo.get(mask, ("a",), lambda: computed.append(1) or 9) == 9 and len(computed) == 2
    other = copy.deepcopy(mask)
    assert memo.get(other, ("a",), lambda: 10) == 10
    del mask, other
    assert not memo._entries  # dropped with their tensors


def test_windows_keyword_refuses_a_sliding_window_layer_and_wrong_shapes():
    # The windows must say the whole relation: a sliding window on top is not applied, so it is refused.
    from lorafuse.hf.attention import WINDOWS_KWARG, lorafuse_attention_forward
    from lorafuse.ops.attention.windows import windows_of_one_query
    q, kv = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16)
    windows = windows_of_one_query(torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding-window layer"):
        lorafuse_attention_forward(torch.nn.Module(), q, kv, kv, None, sliding_window=4, **{WINDOWS_KWARG: windows})
    with pytest.raises(ValueError, match=r"key windows for \(2, 1\) queries, the call has \[B, Nq\] = \[2, 3\]"):
        lorafuse_attention_forward(torch.nn.Module(), torch.randn(2, 4, 3, 16), kv, kv, None,
                                   **{WINDOWS_KWARG: windows})
