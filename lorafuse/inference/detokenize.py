"""Token ids to text as they come: what a stream may send so far, and where the text ends at a stop string.

The engine keeps the token that completes a stop string (it decides on tokens; a stop string may end inside one).
The text a user gets ends before the stop string, as OpenAI's API and vLLM return it. While streaming, text is
held back where it may still change: a character whose bytes are split across tokens (byte-level BPE decodes its
first bytes to U+FFFD) and an end that could be the start of a stop string.
"""
from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class TextStream:
    """The text of one row's new tokens, fed as they come (`add`), ending before its first stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.sent = 0  # characters of the text handed out so far
        self.stopped = False  # a stop string was found: the text is final

    def add(self, ids: Sequence[int]) -> str:
        """The text that may be sent now, after the tokens `ids`."""
        if self.stopped:
            return ""
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        end = self._stop_at(text)
        if end is not None:
            self.stopped = True
        else:
            end = len(text.rstrip(REPLACEMENT))
            end -= self._stop_prefix(text[:end])
        return self._send(text, end)

    def finish(self) -> str:
        """The rest of the text once the row has ended: what was held back in case a stop string began there."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._send(text, len(text))

    def _send(self, text: str, end: int) -> str:
        new = text[self.sent:end]
        self.sent = max(self.sent, end)
        return new

    def _stop_at(self, text: str) -> int | None:
        """Where the first stop string begins in `text`, or None."""
        return min((at for at in map(text.find, self.stop) if at >= 0), default=None)

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of `text` that a stop string begins with (it may yet be completed)."""
        return max((n for stop in self.stop for n in range(len(stop) - 1, 0, -1) if text.endswith(stop[:n])),
                   default=0)


def completion_text(tokenizer, ids: Sequence[int], stop: Sequence[str] = ()) -> tuple[str, bool]:
    """(The text of a row's new tokens, ending before its first stop string; whether one was found.)"""
    stream = TextStream(tokenizer, stop)
    text = stream.add(ids) + stream.finish()
    return text, stream.stopped
