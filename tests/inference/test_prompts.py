"""read_prompts: prompts from the config and from a file, with each .jsonl line's optional adapter."""
import json

import pytest

from lorafuse.inference.prompts import PromptError, read_prompts


def test_prompts_and_their_adapters_from_config_and_files(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a", "adapter": "b"}) + "\n\n" + json.dumps({"prompt": "c"}) + "\n")
    text = tmp_path / "p.txt"
    text.write_text("d\n\ne\n")
    assert read_prompts(["x"], str(jsonl)) == (["x", "a", "c"], [None, "b", None])
    assert read_prompts([], str(text)) == (["d", "e"], [None, None])


@pytest.mark.parametrize("line, message", [
    ({"prompt": 3}, "each line needs a \"prompt\" string"),
    ({"prompt": "a", "adapter": 7}, "\"adapter\" must be an adapter's name, got 7"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, line, message):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(PromptError, match=f"p.jsonl:2: {message}"):
        read_prompts([], str(jsonl))
