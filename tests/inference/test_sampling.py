"""lorafuse.inference.sampling: the kept token sets of top-k / top-p on hand-made logits and against transformers'
warpers, seeded draws, and the greedy limits (temperature 0, top_k=1, temperature -> 0)."""
import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from lorafuse.inference import SamplingParams, filter_logits, sample


def settings(rows: int, temperature=1.0, top_k=0, top_p=1.0):
    """The per-row tensors `sample` takes, the same setting on every row."""
    return (torch.full((rows,), float(temperature)), torch.full((rows,), top_k, dtype=torch.long),
            torch.full((rows,), float(top_p)))


def kept(logits: torch.Tensor, **setting) -> list[set[int]]:
    filtered = filter_logits(logits, *settings(logits.shape[0], **setting))
    return [set(torch.nonzero(row.isfinite()).flatten().tolist()) for row in filtered]


# softmax([5, 4, 3, 2, 1, 0]) = 0.636, 0.234, 0.086, 0.032, 0.012, 0.004: cumulative 0.636, 0.870, 0.956, ...
# The second row is the first with its tokens shuffled, so that the sets are read back in vocabulary order.
LOGITS = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0],
                       [1.0, 5.0, 0.0, 3.0, 4.0, 2.0]])


@pytest.mark.parametrize("setting, expected", [
    ({}, [{0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5}]),
    ({"top_k": 3}, [{0, 1, 2}, {1, 3, 4}]),
    ({"top_k": 1}, [{0}, {1}]),
    ({"top_k": 99}, [{0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5}]),
    ({"top_p": 0.5}, [{0}, {1}]),             # the first token alone already holds 0.636
    ({"top_p": 0.8}, [{0, 1}, {1, 4}]),       # 0.636 < 0.8 <= 0.870
    ({"top_p": 0.9}, [{0, 1, 2}, {1, 3, 4}]),  # 0.870 < 0.9 <= 0.956
    ({"top_k": 2, "top_p": 0.99}, [{0, 1}, {1, 4}]),
    # top-p after top-k: among the top 3 the cumulative probabilities are 0.665, 0.910 (0.636 / 0.956, 0.870 / 0.956)
    ({"top_k": 3, "top_p": 0.9}, [{0, 1}, {1, 4}]),
    ({"top_k": 3, "top_p": 0.66}, [{0}, {1}]),
    ({"top_k": 3, "top_p": 0.67}, [{0, 1}, {1, 4}]),
    # temperature 2 flattens: softmax([2.5, 2, 1.5, 1, 0.5, 0]) cumulates to 0.414, 0.665, 0.818 (at 1: 0.636, 0.870)
    ({"temperature": 2.0, "top_p": 0.7}, [{0, 1, 2}, {1, 3, 4}]),
    ({"temperature": 1.0, "top_p": 0.7}, [{0, 1}, {1, 4}]),
])
def test_top_k_and_top_p_keep_exactly_the_expected_tokens(setting, expected):
    assert kept(LOGITS, **setting) == expected


def test_the_nucleus_is_the_fewest_tokens_reaching_top_p():
    # Four equal logits: probabilities 0.25 each, exactly; two of them reach top_p=0.5, as in transformers.
    logits = torch.zeros(1, 4)
    assert len(kept(logits, top_p=0.5)[0]) == 2 == TopPLogitsWarper(0.5)(None, logits.clone()).isfinite().sum()
    assert len(kept(logits, top_p=0.51)[0]) == 3


def test_ties_with_the_kth_value_stay_in_as_in_transformers():
    assert kept(torch.tensor([[3.0, 1.0, 3.0, 3.0, 2.0]]), top_k=2) == [{0, 2, 3}]


def test_kept_logits_are_the_scaled_logits():
    filtered = filter_logits(LOGITS, *settings(2, temperature=0.5, top_k=4))
    keep = filtered.isfinite()
    torch.testing.assert_close(filtered[keep], (LOGITS * 2)[keep], rtol=0, atol=0)
    assert (filtered[~keep] == -torch.inf).all() and keep.sum().item() == 8


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 12, 0.6)])
def test_filter_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 40) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = filter_logits(logits, *settings(6, temperature, top_k, top_p))
    assert torch.equal(ours.isfinite(), expected.isfinite())
    torch.testing.assert_close(ours[ours.isfinite()], expected[expected.isfinite()])


def draw(logits: torch.Tensor, seed: int, **setting) -> torch.Tensor:
    return sample(logits, *settings(logits.shape[0], **setting), torch.Generator().manual_seed(seed))


def test_seeded_draws_repeat_and_equal_torch_multinomial():
    logits = torch.randn(64, 100)
    first = draw(logits, seed=7, temperature=1.0)
    assert torch.equal(first, draw(logits, seed=7, temperature=1.0))
    assert not torch.equal(first, draw(logits, seed=8, temperature=1.0))
    probs = logits.softmax(-1)
    expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(7))[:, 0]
    assert torch.equal(first, expected)


def test_draws_stay_in_the_kept_set():
    logits = torch.randn(200, 30)
    for seed in range(5):
        tokens = draw(logits, seed, temperature=1.5, top_k=4, top_p=0.7)
        allowed = filter_logits(logits, *settings(200, 1.5, 4, 0.7)).isfinite()
        assert allowed.gather(-1, tokens[:, None]).all()


def test_greedy_limits():
    logits = torch.randn(32, 50) * 2
    greedy = logits.argmax(-1)
    assert torch.equal(draw(logits, seed=0, temperature=0.0), greedy)
    assert torch.equal(draw(logits, seed=0, temperature=1.0, top_k=1), greedy)
    # Logits 0.05 apart at least: at temperature 1e-3 the runner-up has odds below exp(-50).
    spaced = torch.randperm(50).float().repeat(32, 1) * 0.05
    for seed in range(3):
        assert torch.equal(draw(spaced, seed, temperature=1e-3), spaced.argmax(-1))
    assert not torch.equal(draw(spaced, 0, temperature=1.0), spaced.argmax(-1))


def test_rows_take_their_own_settings():
    logits = torch.randn(2, 50)
    temperature, top_k, top_p = torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), torch.tensor([1.0, 1.0])
    tokens = sample(logits, temperature, top_k, top_p, torch.Generator().manual_seed(0))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_sampling_params_are_checked_and_stop_strings_kept_whole():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(ValueError, match=r"max_new_tokens=0 .*temperature=-1 .*top_k=-2 .*top_p=0 .*stop=\('',\)"):
        SamplingParams(max_new_tokens=0, temperature=-1, top_k=-2, top_p=0, stop=[""])
