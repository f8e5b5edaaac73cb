"""Choosing the next token on the device: greedy, or a seeded draw after temperature, top-k and top-p.

`sample` takes its settings as tensors, so that one captured decode step serves every setting, and it never
reads a value on the host nor makes a shape that depends on the data: it can run inside a CUDA graph.
"""
from dataclasses import dataclass

import torch

from ..ops.decode.argmax import argmax_rows


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings. temperature=0 is greedy (argmax; top_k, top_p and seed then play no part);
    top_k=0 and top_p=1 turn those filters off; seed=None draws a fresh seed per call. A row ends at an EOS token,
    after the token that completes one of the `stop` strings (both kept), or after `max_new_tokens` tokens."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        # A single string is one stop string, not its characters; lists become tuples (hashable, frozen).
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        wanted = {
            "max_new_tokens": ("an int >= 1", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1),
            "temperature": (">= 0", self.temperature >= 0),
            "top_k": ("an int >= 0", isinstance(self.top_k, int) and self.top_k >= 0),
            "top_p": ("in (0, 1]", 0 < self.top_p <= 1),
            "stop": ("non-empty strings", all(isinstance(s, str) and s for s in self.stop)),
        }
        bad = [f"{name}={getattr(self, name)!r} ({want})" for name, (want, ok) in wanted.items() if not ok]
        if bad:
            raise ValueError(f"SamplingParams: {'; '.join(bad)}")


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """`logits` divided by the temperature, -inf outside each row's top-k and then outside its nucleus (the fewest
    most likely tokens whose probability, after top-k, reaches top_p), as transformers' warpers do in that order.
    Ties with the k-th value stay in, as in transformers. Rows at temperature 0 are scaled by 1 (greedy ignores
    them)."""
    # logits: [B, V]; temperature, top_p: float [B]; top_k: int64 [B] (0: off) -> float32 [B, V]
    vocab = logits.shape[-1]
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    ranked, order = scaled.sort(-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranked = ranked.masked_fill(ranked < ranked.gather(-1, k[:, None] - 1), -torch.inf)
    probs = ranked.softmax(-1)
    before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
    # top_p=1 turns the filter off exactly: a cumulative sum that rounds to 1 early must not drop the tail.
    outside = (before >= top_p[:, None]) & (top_p[:, None] < 1)
    ranked = ranked.masked_fill(outside, -torch.inf)
    return torch.empty_like(scaled).scatter_(-1, order, ranked)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row: the argmax where temperature is 0, else a draw from `filter_logits`'s
    distribution with `generator`. No host synchronisation, static shapes."""
    # logits: [B, V]; temperature, top_p: float [B]; top_k: int64 [B] -> int64 [B]
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    # torch.multinomial(probs, 1) draws exactly this (for one sample it divides by Exp(1) noise and takes the
    # argmax: same generator, same token), but it first checks the probabilities with a host sync.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    drawn = argmax_rows(probs / noise)
    return torch.where(temperature > 0, drawn, argmax_rows(logits))
