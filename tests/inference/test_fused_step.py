"""The fused decode step (lorafuse.hf.fused_decode) in lorafuse.inference.Engine on CPU (Triton's interpreter): its
greedy tokens and last logits are those of the engine stepping through transformers' forward, for Llama, Mistral,
Qwen2 and Qwen3, merged and unmerged, after swap_adapter; the weights it lays out stay where they are for later
engines; models it does not cover step through transformers' forward and say why once."""
import copy

import pytest
import torch
from peft import PeftModel, get_peft_model

from lorafuse.hf import decoding, model_kernels
from lorafuse.hf.fused_decode import stack_rows, stacked_rows
from lorafuse.inference import Engine, SamplingParams
from tests.hf.families import VOCAB, lora_config, tiny_model
from tests.inference.helpers import hf_greedy, prompts

NEW = 5
PROMPTS = prompts(3, vocab=VOCAB)  # bucket 4: one dummy row
CASES = {  # id: (family, config overrides, LoRA overrides or None for no adapter)
    "llama": ("llama", {}, {}),
    "mistral": ("mistral", {"sliding_window": None}, {}),
    "qwen2": ("qwen2", {}, {}),  # q/k/v biases
    "qwen3": ("qwen3", {}, {}),  # per-head q/k norms
    # biases on o_proj and the MLP; adapters on some projections only, of ranks 1 and 16
    "llama-biases-some-adapters": ("llama", {"attention_bias": True, "mlp_bias": True},
                                   {"target_modules": ["q_proj", "v_proj", "o_proj", "up_proj"], "r": 16,
                                    "rank_pattern": {"v_proj": 1}}),
    "qwen3-no-adapter": ("qwen3", {}, None),
}


def with_random_biases(model):
    """transformers initialises biases to zero, which would hide a bias added twice or never: random ones."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.3)
    return model


def engines(model, **kwargs) -> tuple[Engine, Engine]:
    """A fused-step engine on `model`, then one stepping through transformers' forward on the same model (built
    second: the first lays the weights out, the second leaves them)."""
    fused = Engine(model, max_length=16, buckets=(4,), check_every=2, fused_step=True, **kwargs)
    assert fused.fused_step_reason is None
    return fused, Engine(fused.model, max_length=16, buckets=(4,), check_every=2, fused_step=False)


def assert_same_generation(fused: Engine, stepped: Engine) -> list[list[int]]:
    tokens = fused.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    assert tokens == stepped.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    torch.testing.assert_close(fused.last_logits(), stepped.last_logits(), rtol=1e-5, atol=1e-5)
    return tokens


@pytest.mark.parametrize("case, merge", [pytest.param(case, merge, id=f"{case}-{'merged' if merge else 'unmerged'}")
                                         for case, (_, _, lora) in CASES.items() for merge in (False, True)
                                         if lora is not None or not merge])
def test_fused_step_equals_transformers_step(case, merge):
    family, overrides, lora = CASES[case]
    model = with_random_biases(tiny_model(family, **overrides).eval())
    if lora is not None:
        model = get_peft_model(model, lora_config(family, **lora)).eval()
    fused, stepped = engines(model, merge=merge)
    assert_same_generation(fused, stepped)


@pytest.mark.parametrize("bucket", [1, 2, 16])
@pytest.mark.parametrize("case", ["llama-biases-some-adapters", "qwen2"])
def test_other_buckets_equal_transformers_step(case, bucket):
    # ops.gemv runs the GEMMs and lm_head of buckets up to 16 rows (biases in the GEMM, or after a deferred norm):
    # one row on its own kernel, 2 the fewest rows of the tensor-core tile, 16 all of it (the prompts padded up)
    family, overrides, lora = CASES[case]
    model = get_peft_model(with_random_biases(tiny_model(family, **overrides).eval()), lora_config(family, **lora))
    fused = Engine(model.eval(), max_length=16, buckets=(bucket,), check_every=2, fused_step=True)
    assert fused.fused_step_reason is None
    stepped = Engine(fused.model, max_length=16, buckets=(bucket,), check_every=2, fused_step=False)
    prompts = PROMPTS[:bucket]
    tokens = fused.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert tokens == stepped.generate(prompts, SamplingParams(max_new_tokens=NEW))
    torch.testing.assert_close(fused.last_logits(), stepped.last_logits(), rtol=1e-5, atol=1e-5)


def test_models_on_lorafuse_kernels_take_the_fused_step():
    # training set-ups give norms and MLPs lorafuse's kernel forwards (instance forwards): not hooks
    model = get_peft_model(tiny_model("llama").eval(), lora_config("llama")).eval()
    assert model_kernels.use_model_kernels(model) > 0
    stepped = Engine(model, max_length=16, buckets=(4,), check_every=2, fused_step=False, stack_adapters=False)
    reference = stepped.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    fused = Engine(copy.deepcopy(model), max_length=16, buckets=(4,), check_every=2, fused_step=True)
    assert fused.fused_step_reason is None
    assert fused.generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) == reference


def test_hooked_modules_step_through_transformers(fallback_log):
    model = tiny_model("llama").eval()
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out)
    engine = Engine(model, max_length=16, buckets=(4,), fused_step=True)
    assert engine.fused_step_reason.startswith("decoder layer 1: LlamaMLP with ")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two Llama adapters on all linear layers, saved: rank 4, and rank 2 with another alpha."""
    root = tmp_path_factory.mktemp("adapters")
    for name, rank, alpha, seed in (("A", 4, 8, 1), ("B", 2, 5, 2)):
        torch.manual_seed(seed)
        get_peft_model(tiny_model("llama"), lora_config("llama", r=rank, lora_alpha=alpha)).save_pretrained(root / name)
    return root


def test_swap_reaches_the_fused_step_and_nothing_moves(adapters, fallback_log):
    model = PeftModel.from_pretrained(tiny_model("llama"), adapters / "A").eval()
    fused, stepped = engines(model)
    attention = model.base_model.model.model.layers[0].self_attn
    qkv = [attention.get_submodule(name) for name in ("q_proj", "k_proj", "v_proj")]
    assert stacked_rows([m.base_layer.weight for m in qkv] + [m.lora_A["default"].weight for m in qkv]) is not None
    addresses = [param.data_ptr() for param in model.parameters()]
    with_A = assert_same_generation(fused, stepped)
    fused.swap_adapter(adapters / "B")
    with_B = assert_same_generation(fused, stepped)
    assert with_B != with_A
    reference = PeftModel.from_pretrained(tiny_model("llama"), adapters / "B").eval()
    assert with_B == hf_greedy(reference, PROMPTS, NEW)
    # Another fused engine finds the layout made: the first one's captured steps hold these addresses.
    Engine(model, max_length=16, buckets=(1,), fused_step=True)
    assert [param.data_ptr() for param in model.parameters()] == addresses
    assert not fallback_log.records


def test_weights_in_another_buffer_are_not_moved(adapters, fallback_log):
    # weights that are views into a larger buffer (laid out by someone else, whose code may hold the buffer) stay
    # where they are: the fused step declines, said once, and the transformers' step (which moves nothing) runs
    model = PeftModel.from_pretrained(tiny_model("llama"), adapters / "A").eval()
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    q.base_layer.weight.data, q.lora_A["default"].weight.data = stack_rows(
        [q.base_layer.weight, q.lora_A["default"].weight], q.base_layer.weight.dtype)
    addresses = [param.data_ptr() for param in model.parameters()]
    for _ in range(2):
        engine = Engine(model, max_length=16, buckets=(1,), fused_step=True)
        assert "laid out or captured by another engine" in engine.fused_step_reason
    assert [param.data_ptr() for param in model.parameters()] == addresses
    said = [r.getMessage() for r in fallback_log.records if "not the fused step" in r.getMessage()]
    assert len(said) == 1 and "q_proj, k_proj, v_proj laid out or captured by another engine" in said[0]


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_weights_that_another_engine_captured_are_not_moved(adapters, fallback_log, lora):
    # an engine that captured its step (on a GPU) marks the model: its graphs read the weights where they are, so
    # the fused step's layout may not move them later
    model = tiny_model("llama").eval()
    if lora:
        model = PeftModel.from_pretrained(model, adapters / "A").eval()
    reference = hf_greedy(model, PROMPTS, 3)
    decoding.mark_captured(model)
    addresses = [param.data_ptr() for param in model.parameters()]
    fused = Engine(model, max_length=16, buckets=(4,), fused_step=True)
    stepped = Engine(model, max_length=16, buckets=(4,), fused_step=False)
    assert "laid out or captured by another engine" in fused.fused_step_reason
    assert [param.data_ptr() for param in model.parameters()] == addresses
    for engine in (fused, stepped):
        assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=3)) == reference


@pytest.mark.parametrize("overrides, lora, reason", [
    ({"hidden_act": "gelu"}, None, "decoder layer 0: an MLP LlamaMLP that does not compute as LlamaMLP with SiLU"),
    ({}, {"use_dora": True}, "decoder layer 0: q_proj: a DoRA adapter"),
])
def test_models_it_does_not_cover_step_through_transformers(fallback_log, overrides, lora, reason):
    model = tiny_model("llama", **overrides).eval()
    if lora is not None:
        model = get_peft_model(model, lora_config("llama", **lora)).eval()
    reference = hf_greedy(model, PROMPTS, 3)
    engine = Engine(model, max_length=16, buckets=(4,), fused_step=True)
    Engine(model, max_length=16, buckets=(4,), fused_step=True)
    assert engine.fused_step_reason.startswith(reason)
    said = [r.getMessage() for r in fallback_log.records if "not the fused step" in r.getMessage()]
    assert len(said) == 1 and reason in said[0]
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=3)) == reference


def test_stacked_rows_only_when_adjacent_and_alike():
    weight, lora_A = stack_rows([torch.randn(6, 10), torch.randn(2, 10, dtype=torch.float64)], torch.float32)
    assert lora_A.dtype == torch.float32 and torch.equal(stacked_rows([weight, lora_A])[6:], lora_A)
    assert stacked_rows([weight, lora_A.clone()]) is None                     # elsewhere in memory
    assert stacked_rows([weight[:5], lora_A]) is None                         # a gap between them
    assert stacked_rows([weight.bfloat16(), lora_A.bfloat16()]) is None       # copies, not adjacent
    both = torch.randn(8, 10)
    assert stacked_rows([both[:6], both[6:].t().contiguous().t()]) is None    # not row-major
    # two storages that happen to touch in memory: not stacked (a view across both would run past the first)
    buffer = torch.randn(80)
    first, second = torch.empty(0), torch.empty(0)
    first.set_(buffer.untyped_storage()[:6 * 10 * 4], 0, (6, 10))
    second.set_(buffer.untyped_storage()[6 * 10 * 4:], 0, (2, 10))
    assert second.data_ptr() == first.data_ptr() + 6 * 10 * 4
    assert stacked_rows([first, second]) is None
