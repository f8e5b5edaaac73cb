"""Streamed text from token ids: whole characters only, and the text ending before the first stop string, however
the tokens cut the characters and the stop strings."""
import pytest
from transformers import AutoTokenizer

from lorafuse._paths import ASSETS
from lorafuse.inference.detokenize import REPLACEMENT, TextStream, completion_text

TEXT = "price: 5€ and naïve 日本, then the end"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")


def streamed(tokenizer, ids, stop, step):
    stream = TextStream(tokenizer, stop)
    pieces = [stream.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces + [stream.finish()], stream.stopped


@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("stop, expected", [
    ((), TEXT),
    (("naïve",), "price: 5€ and "),
    (("日",), "price: 5€ and naïve "),
    (("then", "€"), "price: 5"),  # the first in the text, not in the list
    (("e end", " the end"), "price: 5€ and naïve 日本, then"),  # overlapping: the one that begins first
    (("not there",), TEXT),
])
def test_stream_sends_whole_characters_and_ends_before_the_first_stop_string(tokenizer, stop, expected, step):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces, stopped = streamed(tokenizer, ids, stop, step)
    assert "".join(pieces) == expected
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert stopped == (expected != TEXT)
    assert completion_text(tokenizer, ids, stop) == (expected, stopped)


def test_the_tokenizer_does_split_characters_across_tokens(tokenizer):
    # what the test above guards against: some prefix of the tokens decodes to a replacement character
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(tokenizer.decode(ids[:n]).endswith(REPLACEMENT) for n in range(1, len(ids)))


def test_text_that_may_begin_a_stop_string_is_held_until_it_does_not(tokenizer):
    stream = TextStream(tokenizer, ["STOP"])
    assert stream.add(tokenizer.encode("go ST", add_special_tokens=False)) == "go "
    assert stream.add(tokenizer.encode("ay", add_special_tokens=False)) == "STay"
    assert stream.add(tokenizer.encode(" STO", add_special_tokens=False)) == " "
    assert stream.finish() == "STO" and not stream.stopped
