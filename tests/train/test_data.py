"""The data pipeline: loading files and splits, labels per format, truncation, packing, collation, and the
errors users see, with the bundled tiny-llama tokenizer (its chat template writes `<|role|>\\n...<|end|>\\n`)."""
import json
import logging
from pathlib import Path

import datasets
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from lorafuse.train.config import DataConfig, DataFormat
from lorafuse.train.data import (Collator, DataError, build_datasets, count_loss_tokens, count_sample_tokens,
                                 load_splits, pack, tokenize)

ASSETS = Path(__file__).resolve().parents[2] / "lorafuse" / "assets"
IGNORE = -100
ROWS = [{"instruction": f"What is {i} plus {i + 1}?", "input": "" if i % 2 else f"{i} and {i + 1}",
         "output": str(2 * i + 1)} for i in range(20)]


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path_factory, monkeypatch):
    # Loaded and mapped datasets are cached in a fresh folder: no test reads what another run left.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")


@pytest.fixture
def plain_tokenizer():
    """The same tokenizer without a chat template."""
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    tokenizer.chat_template = None
    return tokenizer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config(path, **overrides) -> DataConfig:
    return DataConfig(path=str(path), **{"eval_fraction": 0.0, **overrides})


def tokenized(rows: list[dict], tokenizer, **overrides) -> list[dict]:
    return tokenize(datasets.Dataset.from_list(rows), config("unused", **overrides), tokenizer).to_list()


def labelled_text(tokenizer, sample: dict) -> str:
    return tokenizer.decode([label for label in sample["labels"] if label != IGNORE])


def labelled_runs(labels: list[int]) -> int:
    """How many runs of consecutive loss-bearing labels."""
    flags = [label != IGNORE for label in labels]
    return sum(flag and not before for flag, before in zip(flags, [False] + flags))


# --- loading ------------------------------------------------------------------------------------------

WRITERS = {
    "json": lambda frame, path: frame.to_json(path, orient="records"),
    "jsonl": lambda frame, path: frame.to_json(path, orient="records", lines=True),
    "csv": lambda frame, path: frame.to_csv(path, index=False),
    "parquet": lambda frame, path: frame.to_parquet(path, index=False),
}


@pytest.mark.parametrize("extension", WRITERS)
def test_every_file_type_loads_the_rows_as_written(tmp_path, extension):
    path = tmp_path / f"data.{extension}"
    WRITERS[extension](pd.DataFrame(ROWS), path)
    train, evaluation = load_splits(config(path), seed=0)
    assert evaluation is None
    # Text stays text in every type: "3" is not read as a number, nor an empty CSV cell as missing.
    assert train.to_list() == ROWS


def test_a_directory_loads_all_its_data_files_in_name_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", ROWS[10:])
    write_jsonl(tmp_path / "a.jsonl", ROWS[:10])
    (tmp_path / "README.md").write_text("not data")
    train, _ = load_splits(config(tmp_path), seed=0)
    assert train.to_list() == ROWS


def test_a_hub_name_goes_to_load_dataset_with_the_split(monkeypatch):
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: calls.append((args, kwargs)) or
                        datasets.Dataset.from_list(ROWS))
    train, _ = load_splits(config("someone/some-dataset", split="train[:50%]"), seed=0)
    assert calls == [(("someone/some-dataset",), {"split": "train[:50%]", "cache_dir": None})]
    assert len(train) == len(ROWS)


def test_the_rows_and_all_derived_from_them_are_cached_in_cache_dir(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    cache_dir = tmp_path / "cache"
    train, evaluation = build_datasets(config(path, eval_fraction=0.25, packing=True, cache_dir=str(cache_dir)),
                                       tokenizer, seed=0)
    cached = [Path(f["filename"]) for rows in (train, evaluation) for f in rows.cache_files]
    assert cached and all(cache_dir in file.parents for file in cached)
    assert list(Path(datasets.config.HF_DATASETS_CACHE).iterdir()) == []


def test_eval_fraction_holds_out_the_same_rows_for_the_same_seed(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    train, evaluation = load_splits(config(path, eval_fraction=0.25), seed=0)
    again_train, again_evaluation = load_splits(config(path, eval_fraction=0.25), seed=0)
    _, other_evaluation = load_splits(config(path, eval_fraction=0.25), seed=1)
    assert (len(train), len(evaluation)) == (15, 5)
    assert sorted(list(train["output"]) + list(evaluation["output"]), key=int) == [row["output"] for row in ROWS]
    assert (again_train.to_list(), again_evaluation.to_list()) == (train.to_list(), evaluation.to_list())
    assert other_evaluation.to_list() != evaluation.to_list()


def test_eval_path_is_the_eval_split(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:15])
    eval_path = write_jsonl(tmp_path / "eval.jsonl", ROWS[15:])
    train, evaluation = load_splits(config(path, eval_path=str(eval_path), eval_fraction=0.25), seed=0)
    assert (train.to_list(), evaluation.to_list()) == (ROWS[:15], ROWS[15:])


def test_max_samples_caps_the_train_rows_only(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    train, _ = load_splits(config(path, max_samples=7), seed=0)
    assert train.to_list() == ROWS[:7]
    full_train, full_evaluation = load_splits(config(path, eval_fraction=0.25), seed=0)
    capped_train, capped_evaluation = load_splits(config(path, eval_fraction=0.25, max_samples=7), seed=0)
    assert capped_train.to_list() == full_train.to_list()[:7]
    assert capped_evaluation.to_list() == full_evaluation.to_list()


# --- labels per format ------------------------------------------------------------------------------------

def test_instruction_through_the_chat_template_labels_the_response_and_its_end_token(tokenizer):
    row = {"instruction": "Reverse the letters of this word.", "input": "nisfar", "output": "rafsin"}
    [sample] = tokenized([row], tokenizer)
    assert tokenizer.decode(sample["input_ids"]) == ("<|bos|><|user|>\nReverse the letters of this word.\n\nnisfar"
                                                     "<|end|>\n<|assistant|>\nrafsin<|end|>\n")
    assert labelled_text(tokenizer, sample) == "rafsin<|end|>"
    assert labelled_runs(sample["labels"]) == 1
    assert sample["labels"][-1] == IGNORE  # the newline after <|end|> is the template's, not the answer's


def test_instruction_without_chat_template_uses_the_alpaca_prompt(plain_tokenizer):
    rows = [{"instruction": "Add these two numbers.", "input": "3 and 4", "output": "7"},
            {"instruction": "What is 3 plus 4?", "input": "", "output": "7"}]
    with_input, without_input = tokenized(rows, plain_tokenizer)
    assert plain_tokenizer.decode(with_input["input_ids"]) == (
        "<|bos|>### Instruction:\nAdd these two numbers.\n\n### Input:\n3 and 4\n\n### Response:\n7<|end|>")
    assert plain_tokenizer.decode(without_input["input_ids"]) == (
        "<|bos|>### Instruction:\nWhat is 3 plus 4?\n\n### Response:\n7<|end|>")
    for sample in (with_input, without_input):
        assert labelled_text(plain_tokenizer, sample) == "7<|end|>"
        assert labelled_runs(sample["labels"]) == 1


def test_train_on_prompt_labels_every_token_but_the_first(tokenizer, plain_tokenizer):
    row = {"instruction": "What is 3 plus 4?", "input": "", "output": "7"}
    for tok in (tokenizer, plain_tokenizer):
        [sample] = tokenized([row], tok, train_on_prompt=True)
        assert sample["labels"] == [IGNORE] + sample["input_ids"][1:]


def test_text_labels_every_token_after_bos_and_ends_with_eos(tokenizer):
    [sample] = tokenized([{"text": "The vono is red. A vono has 8 legs."}], tokenizer, format=DataFormat.text)
    assert sample["input_ids"][0] == tokenizer.bos_token_id
    assert sample["input_ids"][-1] == tokenizer.eos_token_id
    assert sample["labels"] == [IGNORE] + sample["input_ids"][1:]
    assert labelled_text(tokenizer, sample) == "The vono is red. A vono has 8 legs.<|end|>"


def test_multi_turn_chat_labels_both_assistant_turns_and_nothing_else(tokenizer):
    messages = [{"role": "system", "content": "Answer with the result only."},
                {"role": "user", "content": "Reverse the letters of the word nisfar."},
                {"role": "assistant", "content": "rafsin"},
                {"role": "user", "content": "Now do the same for kexli."},
                {"role": "assistant", "content": "ilxek"}]
    [sample] = tokenized([{"messages": messages}], tokenizer, format=DataFormat.chat)
    assert tokenizer.decode(sample["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert labelled_text(tokenizer, sample) == "rafsin<|end|>ilxek<|end|>"
    assert labelled_runs(sample["labels"]) == 2


def test_a_token_reaching_from_the_prompt_into_the_response_is_labelled(plain_tokenizer):
    # The generation prompt ends in a space, and byte-level BPE glues that space to the answer's first
    # word (" rafsin"): the token overlaps the response, so it carries loss.
    plain_tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
                                     "{% else %}A: {{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
                                     "{% if add_generation_prompt %}A: {% endif %}")
    messages = [{"role": "user", "content": "Reverse nisfar."}, {"role": "assistant", "content": "rafsin"}]
    [sample] = tokenized([{"messages": messages}], plain_tokenizer, format=DataFormat.chat)
    assert labelled_text(plain_tokenizer, sample) == " rafsin<|end|>"


def test_chat_with_train_on_prompt_labels_system_and_user_text_too(tokenizer):
    messages = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7"}]
    [sample] = tokenized([{"messages": messages}], tokenizer, format=DataFormat.chat, train_on_prompt=True)
    assert labelled_text(tokenizer, sample) == "<|user|>\nWhat is 3 plus 4?<|end|>\n<|assistant|>\n7<|end|>\n"


def test_truncation_keeps_the_first_max_length_tokens_logs_the_cut_and_drops_samples_without_loss(tokenizer, caplog):
    long_row = {"instruction": "Repeat the word zorbal 2 times.", "input": "", "output": "zorbal zorbal"}
    [full] = tokenized([long_row], tokenizer)
    prompt_length = full["labels"].index(next(label for label in full["labels"] if label != IGNORE))
    caplog.set_level(logging.WARNING, logger="lorafuse")
    [cut] = tokenized([long_row, {**long_row, "instruction": long_row["instruction"] * 3}], tokenizer,
                      max_length=prompt_length + 2)
    assert cut == {"input_ids": full["input_ids"][:prompt_length + 2], "labels": full["labels"][:prompt_length + 2]}
    max_length, lost = prompt_length + 2, len(full["input_ids"]) - prompt_length - 2
    assert [record.getMessage() for record in caplog.records] == [
        f"dropped 1 of 2 samples: no token left to take loss on (data.max_length={max_length}, or no response in "
        "the sample)",
        f"data.max_length={max_length} truncated 1 of 1 samples, cutting {lost} tokens off their ends; raise "
        "data.max_length to keep them"]


# --- packing and collation ----------------------------------------------------------------------------------

def test_packing_is_greedy_in_order_restarts_positions_and_keeps_the_labels(tokenizer):
    texts = ["The vono is red.", "A zorbal has 3 legs. The zorbal lives in the cave.", "A kexli eats moss.",
             "The nisfar is blue. A nisfar has 2 legs.", "The runal lives in the river."]
    samples = tokenize(datasets.Dataset.from_list([{"text": t} for t in texts]),
                       config("unused", format=DataFormat.text), tokenizer)
    lengths = [len(ids) for ids in samples["input_ids"]]
    max_length = lengths[0] + lengths[1] + 1
    packed = pack(samples, max_length).to_list()

    expected_rows, row = [], []
    for i, length in enumerate(lengths):  # greedy, in order
        if row and sum(lengths[j] for j in row) + length > max_length:
            expected_rows.append(row)
            row = []
        row.append(i)
    expected_rows.append(row)
    assert len(packed) == len(expected_rows) > 1
    for packed_row, members in zip(packed, expected_rows):
        assert packed_row["input_ids"] == sum((samples[i]["input_ids"] for i in members), [])
        assert packed_row["labels"] == sum((samples[i]["labels"] for i in members), [])
        assert packed_row["position_ids"] == sum((list(range(lengths[i])) for i in members), [])
        starts = [p for p, position in enumerate(packed_row["position_ids"]) if position == 0]
        assert len(starts) == len(members)
        assert all(packed_row["labels"][start] == IGNORE for start in starts)  # no sample's first token
    assert sum(count_loss_tokens(torch.tensor([r["labels"]])) for r in packed) == \
        sum(count_loss_tokens(torch.tensor([s["labels"]])) for s in samples)


def test_collator_pads_unpacked_rows_with_an_attention_mask():
    items = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
             {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "labels": [IGNORE, 2, 3, 4, 5, 6, 7, 8, 9]}]
    batch = Collator(pad_token_id=2, pad_to_multiple_of=8)(items)
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
    assert all(t.dtype == torch.int64 and t.shape == (2, 16) for t in batch.values())
    assert batch["input_ids"][0].tolist() == [5, 6, 7] + [2] * 13
    assert batch["labels"][0].tolist() == [IGNORE, 6, 7] + [IGNORE] * 13
    assert batch["attention_mask"].tolist() == [[1] * 3 + [0] * 13, [1] * 9 + [0] * 7]
    assert batch["labels"][1].tolist() == items[1]["labels"] + [IGNORE] * 7


def test_collator_gives_packed_padding_its_own_positions_and_no_attention_mask():
    items = [{"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE, 6, IGNORE, 8, 9], "position_ids": [0, 1, 0, 1, 2]},
             {"input_ids": [1, 2], "labels": [IGNORE, 2], "position_ids": [0, 1]}]
    batch = Collator(pad_token_id=0, pad_to_multiple_of=4)(items)
    assert sorted(batch) == ["input_ids", "labels", "position_ids"]
    assert all(t.dtype == torch.int64 and t.shape == (2, 8) for t in batch.values())
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, IGNORE, 8, 9] + [IGNORE] * 3, [IGNORE, 2] + [IGNORE] * 6]


def test_count_sample_tokens_leaves_the_padding_out():
    packed = [{"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE, 6, IGNORE, 8, 9], "position_ids": [0, 1, 0, 1, 2]},
              {"input_ids": [1, 2], "labels": [IGNORE, 2], "position_ids": [0, 1]},
              # as long as the batch: no padding, and its last sample's last labels are -100 (a chat template's tail)
              {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "labels": [IGNORE, 2, 3, IGNORE, IGNORE, 6, IGNORE, IGNORE],
               "position_ids": [0, 1, 2, 0, 1, 2, 3, 4]}]
    batch = Collator(pad_token_id=0, pad_to_multiple_of=4)(packed)
    assert batch["input_ids"].shape == (3, 8)
    assert count_sample_tokens(batch) == 5 + 2 + 8
    unpacked = Collator(pad_token_id=0, pad_to_multiple_of=4)([{k: item[k] for k in ("input_ids", "labels")}
                                                                for item in packed])
    assert count_sample_tokens(unpacked) == 5 + 2 + 8


def test_count_loss_tokens_skips_the_first_column():
    labels = torch.tensor([[4, IGNORE, 5, 6], [7, 8, IGNORE, IGNORE]])
    assert count_loss_tokens(labels) == 3


@pytest.mark.parametrize("name, data_format", [("instruct", "instruction"), ("chat", "chat"), ("text", "text")])
@pytest.mark.parametrize("packing", [False, True])
def test_the_demo_data_builds_short_samples_that_collate(tokenizer, name, data_format, packing):
    cfg = DataConfig(path=str(ASSETS / "demo" / f"{name}.jsonl"), format=DataFormat(data_format), max_samples=64,
                     eval_fraction=0.1, max_length=128, packing=packing)
    train, evaluation = build_datasets(cfg, tokenizer, seed=0)
    unpacked, _ = build_datasets(DataConfig(**{**cfg.__dict__, "packing": False, "max_length": 1024}),
                                 tokenizer, seed=0)
    assert max(len(ids) for ids in unpacked["input_ids"]) < 128  # nothing is cut at max_length 128
    assert len(evaluation) > 0 and (len(train) < 64 if packing else len(train) == 64)
    batch = Collator(tokenizer.pad_token_id)(train.to_list())
    assert count_loss_tokens(batch["labels"]) == \
        sum(count_loss_tokens(torch.tensor([labels])) for labels in unpacked["labels"])


# --- errors users see --------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["path", "eval_path"])
def test_a_missing_file_names_the_key_and_the_path(tmp_path, key):
    existing = write_jsonl(tmp_path / "data.jsonl", ROWS)
    missing = tmp_path / "nowhere" / "data.jsonl"
    paths = {"path": missing, "eval_path": existing} if key == "path" else {"path": existing, "eval_path": missing}
    with pytest.raises(DataError) as error:
        load_splits(config(paths["path"], eval_path=str(paths["eval_path"])), seed=0)
    assert str(error.value) == f"data.{key}: no such file or directory: {missing}"


def test_a_missing_column_names_the_file_the_column_the_columns_found_and_the_key(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"instruction": "What is 1 plus 2?", "answer": "3"}])
    with pytest.raises(DataError) as error:
        load_splits(config(path), seed=0)
    assert str(error.value) == (f"{path}: data.format=instruction needs column(s) ['output'], found columns "
                                "['instruction', 'answer']; if yours is named otherwise, "
                                "set data.output_column=<your column>")


def test_a_directory_of_mixed_file_types_is_refused(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    pd.DataFrame(ROWS).to_csv(tmp_path / "b.csv", index=False)
    with pytest.raises(DataError, match=r"^data.path: the directory .* mixes file types \(csv, json\)"):
        load_splits(config(tmp_path), seed=0)


def test_chat_format_without_a_chat_template_suggests_another_format(plain_tokenizer):
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    with pytest.raises(DataError, match=r"data.format=chat needs a tokenizer with a chat template.*"
                                        r"use data.format=instruction \(alpaca prompt\) or data.format=text"):
        tokenized(rows, plain_tokenizer, format=DataFormat.chat)


def test_a_chat_template_that_renders_prefixes_differently_is_refused(plain_tokenizer):
    # The message count up front changes as messages are added: a prefix is not the start of the whole.
    plain_tokenizer.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    with pytest.raises(DataError, match="does not render the first messages of a conversation as the start"):
        tokenized(rows, plain_tokenizer, format=DataFormat.chat)


@pytest.mark.parametrize("second_row, found", [
    ({"text": None}, "found null (an empty cell, or no such key in that row)"),
    ({"other": "no text key"}, "found null (an empty cell, or no such key in that row)"),
    ({"text": 123}, "found int 123"),
    ({"text": ["The vono", "is red."]}, "found list ['The vono', 'is red.']"),
])
def test_a_text_row_without_a_string_names_the_file_the_row_and_the_column(tmp_path, second_row, found):
    # A plain-text row is the whole sample: a null or a number there is broken data, not an empty sample.
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "The vono is red."}, second_row, {"text": "Bye."}])
    with pytest.raises(DataError) as error:
        load_splits(config(path, format=DataFormat.text, eval_fraction=0.5), seed=0)
    assert str(error.value) == (f"{path}: row 2, column 'text' (data.text_column): expected a string, {found}; "
                                "fix or remove that row")


def test_a_text_column_of_numbers_names_its_first_row(tmp_path):
    path = tmp_path / "corpus.parquet"
    pd.DataFrame({"text": [1.5, 2.5]}).to_parquet(path, index=False)
    with pytest.raises(DataError, match=r"corpus.parquet: row 1, column 'text' \(data.text_column\): expected a "
                                        r"string, found float 1.5"):
        load_splits(config(path, format=DataFormat.text), seed=0)


HELLO = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
NO_ROLE = {"messages": [{"content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


def test_a_chat_message_without_a_role_names_the_file_and_the_row(tmp_path):
    # Checked as loaded: the row named is the row of the files, not of a shuffled split.
    write_jsonl(tmp_path / "a.jsonl", [HELLO, HELLO])
    write_jsonl(tmp_path / "b.jsonl", [HELLO, NO_ROLE])
    with pytest.raises(DataError) as error:
        load_splits(config(tmp_path, format=DataFormat.chat, eval_fraction=0.5), seed=0)
    assert str(error.value).startswith(
        f"{tmp_path}: row 4 (counting the rows of its files in name order), column 'messages' (data.messages_column): "
        "each message needs a \"role\" and a \"content\" string, found {'role': None, 'content': 'Hi'}")


def test_chat_rows_given_to_tokenize_directly_are_checked_too(tokenizer):
    with pytest.raises(DataError, match=r"^unused: data.messages_column=messages: each message needs a \"role\""):
        tokenized([HELLO, NO_ROLE], tokenizer, format=DataFormat.chat)


@pytest.mark.parametrize("name, content, message", [
    ("data.jsonl", b'{"instruction": "a", "output": "b"}\n[1, 2]\n',
     "{path} could not be read as json: line 2: expected a JSON object, found list"),
    ("data.json", b'[\n{"instruction": "a", "output": "b"},\n{"instruction": "a" "output": "b"}\n]\n',
     "{path} could not be read as json: line 3: Expecting ',' delimiter (column 21)"),
    ("data.json", b" [ ]\n", "{path} holds no rows (an empty JSON array)"),
    ("data.csv", "instruction,input,output\nSay hi,,café\n".encode("latin-1"),
     "{path}, line 2: not UTF-8 text (byte 0xe9); save the file as UTF-8"),
    ("data.csv", b"instruction,input,output\n\n", "{path} holds no rows (data.csv: a CSV header only)"),
], ids=["jsonl-line-not-an-object", "json-array-malformed", "json-array-empty", "csv-latin-1", "csv-header-only"])
def test_an_unreadable_json_or_csv_file_is_named_with_its_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as error:
        load_splits(config(path), seed=0)
    assert str(error.value).startswith("data.path: " + message.format(path=path))
