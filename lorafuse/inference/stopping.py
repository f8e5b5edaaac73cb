"""Where each row ends, decided on the host from the tokens read back every few decode steps.

The device keeps decoding every row of a batch until the host next looks (a row that ended makes tokens
nobody keeps), so that no step has to wait for the host; `StopChecker` cuts each row at its first EOS token,
at the token that completes a stop string, or at the token budget, and keeps a row that ended from growing.
"""
from collections.abc import Callable, Iterable, Sequence


class StopChecker:
    """The tokens each of `rows` rows keeps, fed the tokens made since the last check."""

    def __init__(self, rows: int, max_new_tokens: int, eos_token_ids: Iterable[int], stop: Sequence[str] = (),
                 decode: Callable[[list[int]], str] | None = None):
        if stop and decode is None:
            raise ValueError(f"stop strings {list(stop)} need a tokenizer to decode the tokens: pass one")
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop, self.decode = tuple(stop), decode
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.done = [False] * rows

    @property
    def all_done(self) -> bool:
        return all(self.done)

    def add(self, new: Sequence[Sequence[int]]) -> dict[int, list[int]]:
        """Takes the tokens each row made since the last call ([rows][n]); returns, for the rows that kept any,
        the tokens they keep."""
        kept = {}
        for row, ids in enumerate(new):
            if self.done[row] or not ids:
                continue
            ids = self._until_end(row, list(ids))
            self.tokens[row] += ids
            if ids:
                kept[row] = ids
        return kept

    def _until_end(self, row: int, ids: list[int]) -> list[int]:
        budget = self.max_new_tokens - len(self.tokens[row])
        end = next((i + 1 for i, token in enumerate(ids[:budget]) if token in self.eos_token_ids), None)
        if end is None and len(ids) >= budget:
            end = budget
        if self.stop:
            end = self._stop_end(self.tokens[row], ids[:end]) or end
        if end is not None:
            self.done[row] = True
        return ids[:end]

    def _stop_end(self, before: list[int], ids: list[int]) -> int | None:
        """How many of `ids` to keep so that the text ends with the first stop string completed, or None."""
        # One decode per row and check in the common case (no stop string yet); the search runs once per row.
        if not self._has_stop(before + ids):
            return None
        return next(end for end in range(1, len(ids) + 1) if self._has_stop(before + ids[:end]))

    def _has_stop(self, tokens: list[int]) -> bool:
        text = self.decode(tokens)
        return any(stop in text for stop in self.stop)
