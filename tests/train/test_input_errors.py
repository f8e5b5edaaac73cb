"""Bad recipe input stops the set-up with one message, naming the file and its line or row, or the key and the keys
allowed, before the model's weights load: in this process on the bundled tiny model (the set-up is
lorafuse.train.Finetune), and through recipes/finetune.py for its exit code and its one line."""
import json

import pytest

from lorafuse._paths import ASSETS
from lorafuse.hf import loading
from lorafuse.train import register_configs
from lorafuse.train.data import DataError

from ..recipes.finetune_run import run_recipe
from .test_trainer import end_job, finetune

DEMO = ASSETS / "demo" / "instruct.jsonl"  # the default data; test_trainer's finetune reads its first 32 rows
ROW = {"instruction": "Reverse the letters of the word nisfar.", "input": "", "output": "rafsin"}
CHAT = {"messages": [{"role": "user", "content": "Reverse nisfar."}, {"role": "assistant", "content": "rafsin"}]}
NO_ROLE = {"messages": [{"content": "Reverse nisfar."}, {"role": "assistant", "content": "rafsin"}]}
LATIN_1 = json.dumps({**ROW, "output": "café"}, ensure_ascii=False).encode("latin-1")


@pytest.fixture(autouse=True)
def _recipe_process(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    register_configs()
    yield
    end_job()


class ModelLoaded(Exception):
    """The set-up got as far as loading the model's weights."""


@pytest.fixture
def model_loads(monkeypatch) -> list[str]:
    """The model loads the set-up attempts: each recorded, and stopped there."""
    calls = []

    def load_causal_lm(name_or_path, **kwargs):
        calls.append(name_or_path)
        raise ModelLoaded(name_or_path)

    monkeypatch.setattr(loading, "load_causal_lm", load_causal_lm)
    return calls


def json_lines(*rows: dict) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def test_the_data_is_tokenized_before_the_model_loads(tmp_path, model_loads):
    run_dir = tmp_path / "run"
    with pytest.raises(ModelLoaded):
        finetune(run_dir)
    assert model_loads == [str(ASSETS / "tiny-llama")]
    assert list((run_dir / "cache").rglob("cache-*.arrow"))  # the tokenized samples, in datasets' cache


@pytest.mark.parametrize("name, content, data_format, expected", [
    ("latin1.jsonl", json_lines(ROW, ROW) + LATIN_1, "instruction",
     "data.path: {file}, line 3: not UTF-8 text (byte 0xe9); save the file as UTF-8"),
    ("broken.jsonl", json_lines(ROW, ROW, ROW) + b'{"instruction": "x", "output": \n', "instruction",
     "data.path: {file} could not be read as json: line 4: Expecting value (column 1)"),
    ("chats.jsonl", json_lines(CHAT, CHAT, NO_ROLE, CHAT), "chat",
     "{file}: row 3, column 'messages' (data.messages_column): each message needs a \"role\" and a \"content\" "
     "string, found {{'content': 'Reverse nisfar.'}}"),
    ("blank.jsonl", b"\n\n  \n", "instruction", "data.path: {file} holds no rows (blank.jsonl: blank lines only)"),
], ids=["latin-1", "malformed-json-line", "chat-message-without-role", "blank-lines"])
def test_bad_data_names_the_file_and_the_line_or_row_before_the_model_loads(tmp_path, model_loads, name, content,
                                                                            data_format, expected):
    data = tmp_path / name
    data.write_bytes(content)
    with pytest.raises(DataError) as error:
        finetune(tmp_path / "run", f"data.path={data}", f"data.format={data_format}", "data.eval_fraction=0")
    assert str(error.value).startswith(expected.format(file=data))
    assert model_loads == []


@pytest.mark.parametrize("split", ["train", "eval"])
def test_data_that_truncation_leaves_empty_names_the_file_max_length_and_the_counts(tmp_path, model_loads, split):
    # Every sample's prompt is longer than max_length: no response token, no loss, every sample dropped.
    if split == "train":
        source, rows, max_length, overrides = DEMO, 32, 8, []
    else:
        source, rows, max_length = tmp_path / "eval.jsonl", 3, 64
        source.write_bytes(json_lines(*[{**ROW, "instruction": "Reverse " + "zorbal " * 64}] * rows))
        overrides = [f"data.eval_path={source}"]
    with pytest.raises(DataError) as error:
        finetune(tmp_path / "run", f"data.max_length={max_length}", *overrides)
    assert str(error.value).startswith(f"{source}: no sample left after tokenizing ({rows} rows read, 0 left): none "
                                       f"keeps a token to take loss on within data.max_length={max_length}; ")
    assert model_loads == []


def test_the_recipe_refuses_a_key_added_with_plus_in_one_line_with_exit_code_2(tmp_path):
    run = run_recipe("+train.foo=1", f"run_dir={tmp_path / 'run'}", check=False, timeout=120)
    assert run.returncode == 2
    [line] = run.stderr.splitlines()
    assert line.startswith("ConfigError: train.foo: Key 'foo' not in 'TrainConfig'; the keys of train are seed, "
                           "max_steps, batch_size, ")
    assert not (tmp_path / "run").exists()


def test_the_recipe_stops_on_data_that_truncation_leaves_empty_in_one_line_with_exit_code_2(tmp_path):
    run = run_recipe("data.max_length=8", "data.max_samples=32", f"run_dir={tmp_path / 'run'}", check=False,
                     timeout=120)
    output = run.stdout + run.stderr
    errors = [line for line in output.splitlines() if "Error" in line]
    assert run.returncode == 2 and "Traceback" not in output, output[-2000:]
    assert len(errors) == 1
    assert f"DataError: {DEMO}: no sample left after tokenizing (32 rows read, 0 left)" in errors[0]
    assert "trainable of" not in output  # the model's log line: it never loaded
