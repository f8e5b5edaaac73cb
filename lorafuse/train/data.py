"""The fine-tuning data pipeline: rows from files or the Hub -> tokenized samples with loss masks -> packed rows ->
batches.

Built on `datasets`. The tokenizer is used duck-typed (a Hugging Face fast tokenizer: `__call__` with
`return_offsets_mapping`, `apply_chat_template`, `chat_template`, `bos_token_id`, `eos_token_id`), so this
module imports neither transformers nor peft.

Labels follow Hugging Face's convention: aligned with input_ids (the model shifts them), -100 where no
loss is taken. A sample's first token never carries a label: in a packed row it would otherwise be
predicted from the end of the previous sample.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets.fingerprint import Hasher

from .._logging import logger
from .._paths import looks_local
from .config import DataConfig, DataFormat

IGNORE = -100
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
REQUIRED_COLUMNS = {  # the config keys naming the columns each format needs
    DataFormat.instruction: ("instruction_column", "output_column"),
    DataFormat.chat: ("messages_column",),
    DataFormat.text: ("text_column",),
}


class DataError(ValueError):
    """A problem with the user's data or data config; the message names the file or config key."""


# --- loading --------------------------------------------------------------------------------------

def load_splits(cfg: DataConfig, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Raw train and eval rows.

    cfg.path (and cfg.eval_path) is a .json/.jsonl/.csv/.parquet file, a directory of files of one of
    these types, or else a Hub dataset name, loaded with split=cfg.split (local files have one split).
    datasets caches them, and everything derived from them, under cfg.cache_dir (None: datasets' default).
    Without cfg.eval_path, cfg.eval_fraction of the rows is held out (shuffled with `seed`; 0: no eval).
    cfg.max_samples then caps the train rows, so the eval rows do not depend on it.
    """
    if not 0 <= cfg.eval_fraction < 1:
        raise DataError(f"data.eval_fraction must be in [0, 1), got {cfg.eval_fraction}")
    train = _load_checked(cfg.path, "data.path", cfg)
    if cfg.eval_path:
        evaluation = _load_checked(cfg.eval_path, "data.eval_path", cfg)
    elif cfg.eval_fraction > 0:
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=seed)
        train, evaluation = split["train"], split["test"]
    else:
        evaluation = None
    if cfg.max_samples is not None:
        train = train.select(range(min(cfg.max_samples, len(train))))
    return train, evaluation


def _load_checked(path: str, key: str, cfg: DataConfig) -> datasets.Dataset:
    rows = _load(path, key, cfg)
    if len(rows) == 0:  # a Hub split without rows (datasets refuses local files without rows)
        raise DataError(f"{key}: {path} holds no rows")
    _check_columns(rows, path, cfg)
    if DataFormat(cfg.format) is DataFormat.text:
        _check_text_cells(rows, path, cfg.text_column)
    if DataFormat(cfg.format) is DataFormat.chat:
        _check_chat_cells(rows, path, cfg.messages_column)
    return rows


def _load(path: str, key: str, cfg: DataConfig) -> datasets.Dataset:
    local = Path(path).expanduser()
    if local.is_file():
        return _load_files([local], key, path, cfg.cache_dir)
    if local.is_dir():
        files = sorted(f for f in local.iterdir() if f.suffix.lower() in BUILDERS)
        return _load_files(files, key, path, cfg.cache_dir)
    if _looks_local(path):
        raise DataError(f"{key}: no such file or directory: {path}")
    try:
        return datasets.load_dataset(path, split=cfg.split, cache_dir=cfg.cache_dir)
    except Exception as err:  # noqa: BLE001 - offline, no such dataset or split, ...: the user is told which key
        raise DataError(f"{key}={path}: no local file or directory of that name, and the Hub dataset {path!r} "
                        f"(split {cfg.split!r}) could not be loaded: {type(err).__name__}: {err}") from err


def _looks_local(path: str) -> bool:
    # A data file's extension marks a local path too ("mydata.jsonl" is no Hub dataset).
    return looks_local(path) or Path(path).suffix.lower() in BUILDERS


def _load_files(files: list[Path], key: str, path: str, cache_dir: str | None) -> datasets.Dataset:
    allowed = ", ".join(BUILDERS)
    if not files:
        raise DataError(f"{key}: the directory {path} holds no data file ({allowed})")
    builders = {BUILDERS.get(f.suffix.lower()) for f in files}
    if None in builders:
        raise DataError(f"{key}: {path} is not a supported data file; allowed extensions: {allowed}")
    if len(builders) > 1:
        raise DataError(f"{key}: the directory {path} mixes file types ({', '.join(sorted(builders))}); "
                        "keep files of one type")
    builder = builders.pop()
    for file in files:
        if file.stat().st_size == 0:
            raise DataError(f"{key}: {path} holds no rows ({file.name}: an empty file)")
        if builder != "parquet":
            _check_text_file(file, key, path)
    try:
        options = _csv_options(files[0]) if builder == "csv" else {}
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", cache_dir=cache_dir,
                                     **options)
    except Exception as err:  # noqa: BLE001 - a malformed file: its name, and what the reader said
        malformed = _first_json_error(files) if builder == "json" else None
        if malformed:
            raise DataError(f"{key}: {malformed}") from err
        cause = err.__cause__ or err  # datasets wraps the reader's error in a DatasetGenerationError
        raise DataError(f"{key}: {path} could not be read as {builder}: {type(cause).__name__}: {cause}") from err


def _check_text_file(file: Path, key: str, path: str) -> None:
    """A JSON or CSV file is UTF-8 text with a row in it: not blank lines only, nor a CSV header only. datasets'
    readers name neither the file nor the line, and pyarrow's JSON reader takes bytes that are not UTF-8 in as text,
    to fail only when tokenizing."""
    text_lines, line = 0, 1  # lines with more than whitespace, counted up to 2
    with file.open("rb") as stream:
        while chunk := stream.read(1 << 24) + stream.readline():  # whole lines: no character split between chunks
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError as err:
                line += chunk.count(b"\n", 0, err.start)
                raise DataError(f"{key}: {file}, line {line}: not UTF-8 text (byte {chunk[err.start]:#04x}); save "
                                "the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if text_lines < 2 and (content := chunk.strip()):
                text_lines += 1 + (b"\n" in content)
            line += chunk.count(b"\n")
    if text_lines == 0:
        raise DataError(f"{key}: {path} holds no rows ({file.name}: blank lines only)")
    if text_lines == 1 and BUILDERS[file.suffix.lower()] == "csv":
        raise DataError(f"{key}: {path} holds no rows ({file.name}: a CSV header only)")


def _first_json_error(files: list[Path]) -> str | None:
    """The file and line of the first malformed JSON in `files` (pyarrow's reader names a byte position only), or an
    empty JSON array; None where Python's json reads them all."""
    for file in files:
        with file.open(encoding="utf-8-sig") as lines:  # -sig: a leading byte order mark is no JSON error
            if lines.read(4096).lstrip().startswith("["):  # one JSON array, not JSON Lines
                lines.seek(0)
                try:
                    rows = json.load(lines)
                except json.JSONDecodeError as err:
                    return f"{file} could not be read as json: line {err.lineno}: {err.msg} (column {err.colno})"
                if not rows:
                    return f"{file} holds no rows (an empty JSON array)"
                continue
            lines.seek(0)
            for number, text in enumerate(lines, 1):
                problem = _json_line_problem(text)
                if problem:
                    return f"{file} could not be read as json: line {number}: {problem}"
    return None


def _json_line_problem(text: str) -> str | None:
    """What is wrong with one line of a JSON Lines file: each holds an object, or nothing."""
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return f"{err.msg} (column {err.colno})"
    return None if isinstance(value, dict) else f"expected a JSON object, found {type(value).__name__}"


def _csv_options(first_file: Path) -> dict:
    # CSV cells are text in every format: read "45" as a string and an empty cell as "", where pandas
    # would infer a number and NaN.
    columns = pd.read_csv(first_file, nrows=0).columns
    return {"features": datasets.Features({name: datasets.Value("string") for name in columns}),
            "keep_default_na": False}


def _check_columns(rows: datasets.Dataset, source: str, cfg: DataConfig) -> None:
    keys = REQUIRED_COLUMNS[DataFormat(cfg.format)]
    if DataFormat(cfg.format) is DataFormat.instruction and cfg.input_column != DataConfig.input_column:
        keys += ("input_column",)  # optional under its default name; a name the user set must be there
    missing = {getattr(cfg, key): f"data.{key}" for key in keys if getattr(cfg, key) not in rows.column_names}
    if missing:
        renames = ", ".join(f"{key}=<your column>" for key in missing.values())
        raise DataError(f"{source}: data.format={DataFormat(cfg.format).value} needs column(s) {list(missing)}, "
                        f"found columns {rows.column_names}; if yours is named otherwise, set {renames}")


def _check_text_cells(rows: datasets.Dataset, source: str, column: str) -> None:
    """Every row of a plain-text column holds a string. Checked as loaded, before any split or shuffle, so that the
    row named is the row of the file.

    Unlike the instruction format, which reads a missing cell as "" (its input column is optional by design), a
    plain-text row's text is the whole sample: a null one comes from a broken export or a misnamed key, and is
    refused rather than trained on as an empty sample.
    """
    if rows.features[column] in (datasets.Value("string"), datasets.Value("large_string")):
        cells = rows.data.column(column)
        if cells.null_count == 0:  # Arrow's count: no pass over the text
            return
        row = pc.index(pc.is_null(cells), True).as_py()
    else:  # numbers, lists, or mixed types (datasets' Json feature): the first cell that is not a string
        row = next((i for i, value in enumerate(rows[column]) if not isinstance(value, str)), None)
        if row is None:
            return
    value = rows[row][column]
    found = "null (an empty cell, or no such key in that row)" if value is None else \
        f"{type(value).__name__} {value!r:.100}"
    raise DataError(f"{source}: {_row_name(row, source)}, column {column!r} (data.text_column): expected a string, "
                    f"found {found}; fix or remove that row")


def _check_chat_cells(rows: datasets.Dataset, source: str, column: str) -> None:
    """Every row of the messages column holds {role, content} messages. Checked as loaded, as _check_text_cells is,
    so that the row named is the row of the file."""
    if _messages_all_set(rows.data.column(column)):
        return
    for row, messages in enumerate(rows[column]):
        problem = _messages_problem(messages)
        if problem:
            raise DataError(f"{source}: {_row_name(row, source)}, column {column!r} (data.messages_column): "
                            f"{problem}; fix or remove that row")


def _messages_all_set(cells: pa.ChunkedArray) -> bool:
    """Whether every cell is a list of messages with a role and a content string, from Arrow's types and null counts
    (no pass in Python). False for other types too: datasets' Json type for messages of mixed keys, say."""
    if not (pa.types.is_list(cells.type) or pa.types.is_large_list(cells.type)):
        return False
    message, text = cells.type.value_type, (pa.string(), pa.large_string())
    fields = {field.name: field.type for field in message} if pa.types.is_struct(message) else {}
    if not (fields.get("role") in text and fields.get("content") in text):
        return False
    messages = pc.list_flatten(cells)
    return cells.null_count == messages.null_count == 0 and all(
        pc.struct_field(messages, key).null_count == 0 for key in ("role", "content"))


def _row_name(row: int, source: str) -> str:
    """Row `row` (from 0) of the rows loaded from `source`, as a user counts them."""
    where = " (counting the rows of its files in name order)" if Path(source).expanduser().is_dir() else ""
    return f"row {row + 1}{where}"


# --- tokenizing -------------------------------------------------------------------------------------

def tokenize(rows: datasets.Dataset, cfg: DataConfig, tokenizer, source: str | None = None) -> datasets.Dataset:
    """Rows of {"input_ids", "labels"}, at most cfg.max_length tokens each; `source` (cfg.path by default) is the
    file or dataset the rows came from, named in errors.

    instruction: a user/assistant conversation through the tokenizer's chat template when it has one, else
    the alpaca prompt; chat: the messages through the chat template; text: bos + text + eos. Loss on the
    responses (assistant messages with their end token) only, unless cfg.train_on_prompt; on every token
    for text. Samples left with no loss-bearing token (after truncation) are dropped. Both are logged, once per
    call: how many samples were dropped, and how many were truncated and by how many tokens. None left: DataError.
    """
    source = source or cfg.path
    render = _renderer(cfg, tokenizer, source)
    tokenized = _map(rows, _tokenize_batch, "Tokenizing", render=render, tokenizer=tokenizer,
                     train_on_prompt=cfg.train_on_prompt, max_length=cfg.max_length)
    if len(tokenized) == 0:
        raise DataError(f"{source}: no sample left after tokenizing ({len(rows)} rows read, 0 left): none keeps a "
                        f"token to take loss on within data.max_length={cfg.max_length}; raise data.max_length, or "
                        "check that the rows hold responses")
    dropped = len(rows) - len(tokenized)
    if dropped:
        logger.warning(f"dropped {dropped} of {len(rows)} samples: no token left to take loss on "
                       f"(data.max_length={cfg.max_length}, or no response in the sample)")
    _log_truncation([cut for cut in tokenized["cut_tokens"] if cut], len(tokenized), cfg.max_length)
    return tokenized.remove_columns("cut_tokens")


def _log_truncation(cuts: list[int], samples: int, max_length: int) -> None:
    # logger, not log_once: log_once says a message once per process, and a Hydra multirun trains its jobs in one
    # process, each with a log of its own that must say what its data lost.
    if cuts:
        logger.warning(f"data.max_length={max_length} truncated {len(cuts)} of {samples} samples, cutting "
                       f"{sum(cuts)} tokens off their ends; raise data.max_length to keep them")


# datasets names a map's cache file by a hash of the function's name, not of its code: this module's source
# goes into the name too, so that a changed lorafuse does not reuse a stale cache.
_SOURCE = Path(__file__).read_bytes()


def _map(rows: datasets.Dataset, function, desc: str, **kwargs) -> datasets.Dataset:
    """rows.map(function) over batches, into new columns only."""
    fingerprint = Hasher.hash([rows._fingerprint, _SOURCE, function.__name__, kwargs])
    return rows.map(function, batched=True, remove_columns=rows.column_names, fn_kwargs=kwargs,
                    new_fingerprint=fingerprint, desc=desc)


def _renderer(cfg: DataConfig, tokenizer, source: str):
    data_format = DataFormat(cfg.format)
    if data_format is DataFormat.text:
        return partial(_render_text, column=cfg.text_column)
    if data_format is DataFormat.instruction:
        columns = (cfg.instruction_column, cfg.input_column, cfg.output_column)
        return partial(_render_instruction, columns=columns, tokenizer=tokenizer)
    if not tokenizer.chat_template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"data.format=chat needs a tokenizer with a chat template, and {name} has none; "
                        "use data.format=instruction (alpaca prompt) or data.format=text, "
                        "or a tokenizer that has a chat template")
    return partial(_render_chat, column=cfg.messages_column, tokenizer=tokenizer, source=source)


def _tokenize_batch(batch: dict[str, list], render, tokenizer, train_on_prompt: bool,
                    max_length: int) -> dict[str, list]:
    rendered = [render(dict(zip(batch, values))) for values in zip(*batch.values())]
    # The rendered text holds its special tokens already (a chat template writes bos), so add none.
    encodings = tokenizer([r.text for r in rendered], add_special_tokens=False, return_offsets_mapping=True)
    # cut_tokens: how many tokens truncation took off each sample, a column of its own (removed once counted) so that
    # the count comes back with the rest from datasets' cache
    out = {"input_ids": [], "labels": [], "cut_tokens": []}
    for sample, ids, offsets in zip(rendered, encodings["input_ids"], encodings["offset_mapping"]):
        ids, labels = _label(sample, ids, offsets, tokenizer, train_on_prompt)
        cut = max(len(ids) - max_length, 0)
        ids, labels = ids[:max_length], labels[:max_length]
        if any(label != IGNORE for label in labels):
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["cut_tokens"].append(cut)
    return out


def _overlaps(offset: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    # Overlap, not containment: a token that starts in the prompt but reaches into the response (a word
    # piece with its leading space) is part of the answer.
    begin, end = offset
    return any(begin < span_end and end > span_begin for span_begin, span_end in spans)


def _label(sample: _Rendered, ids: list[int], offsets: list[tuple[int, int]], tokenizer,
           train_on_prompt: bool) -> tuple[list[int], list[int]]:
    labels = [token if train_on_prompt or _overlaps(offset, sample.spans) else IGNORE
              for token, offset in zip(ids, offsets)]
    bos = [tokenizer.bos_token_id] if sample.bos and tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if sample.eos and tokenizer.eos_token_id is not None else []
    ids, labels = bos + ids + eos, [IGNORE] * len(bos) + labels + eos
    labels[0] = IGNORE
    return ids, labels


# --- rendering: each row becomes a text and the character ranges that carry loss -----------------------

@dataclass
class _Rendered:
    text: str
    spans: list[tuple[int, int]]  # [start, end) character ranges whose tokens carry loss
    bos: bool = False             # prepend the tokenizer's bos token (no loss)
    eos: bool = False             # append the tokenizer's eos token (with loss: the model learns to stop)


def _render_text(row: dict, column: str) -> _Rendered:
    text = row[column]
    return _Rendered(text, [(0, len(text))], bos=True, eos=True)


def _render_instruction(row: dict, columns: tuple[str, str, str], tokenizer) -> _Rendered:
    values = (row.get(column) for column in columns)  # the input column may be absent
    instruction, input_, output = ("" if value is None else str(value) for value in values)
    if tokenizer.chat_template:
        prompt = f"{instruction}\n\n{input_}" if input_ else instruction
        return _render_conversation([{"role": "user", "content": prompt},
                                     {"role": "assistant", "content": output}], tokenizer)
    prompt = f"### Instruction:\n{instruction}\n\n"
    prompt += f"### Input:\n{input_}\n\n" if input_ else ""
    prompt += "### Response:\n"
    return _Rendered(prompt + output, [(len(prompt), len(prompt) + len(output))], bos=True, eos=True)


def _render_chat(row: dict, column: str, tokenizer, source: str) -> _Rendered:
    messages = row[column]
    problem = _messages_problem(messages)  # checked at loading too, for rows given to tokenize directly
    if problem:
        raise DataError(f"{source}: data.messages_column={column}: {problem}")
    return _render_conversation(messages, tokenizer)


def _messages_problem(messages) -> str | None:
    """What makes a cell of the messages column unusable, or None."""
    if not isinstance(messages, list):
        return f"expected a list of {{role, content}} messages, found {type(messages).__name__}: {messages!r:.200}"
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return (f"each message needs a \"role\" and a \"content\" string, found {message!r:.200} "
                    f"in {messages!r:.300}")
    return None


def _render_conversation(messages: list[dict], tokenizer) -> _Rendered:
    """The whole conversation through the chat template, with loss on each assistant message: from the end
    of the generation prompt before it to the end of its rendering (its content and end-of-turn token),
    found by rendering the conversation's prefixes."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(_render_prefix(messages[:i], tokenizer, full, add_generation_prompt=True))
            end = len(_render_prefix(messages[:i + 1], tokenizer, full).rstrip())
            spans.append((start, end))
    return _Rendered(full, spans)


def _render_prefix(prefix: list[dict], tokenizer, full: str, add_generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(prefix, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not full.startswith(text):
        raise DataError("the tokenizer's chat template does not render the first messages of a conversation as "
                        f"the start of the whole one, so the assistant turns cannot be found; in {full!r:.300}")
    return text


# --- packing and batching ------------------------------------------------------------------------------

def pack(rows: datasets.Dataset, max_length: int) -> datasets.Dataset:
    """Greedy packing, in order: samples are appended to a row while it stays within max_length tokens.

    Each row gets position_ids that restart at 0 where a sample starts, which is how the attention keeps
    each sample to itself. Batches of 1000 samples are packed independently (bounded memory; at most one
    partly filled row per batch more than packing all at once).
    """
    return _map(rows, _pack_batch, "Packing", max_length=max_length)


def _pack_batch(batch: dict[str, list], max_length: int) -> dict[str, list]:
    packed = {"input_ids": [], "labels": [], "position_ids": []}
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        if len(ids) > max_length:
            raise ValueError(f"a sample of {len(ids)} tokens does not fit in a packed row of {max_length}: "
                             "tokenize with the same max_length")
        if not packed["input_ids"] or len(packed["input_ids"][-1]) + len(ids) > max_length:
            for column in packed.values():
                column.append([])
        packed["input_ids"][-1] += ids
        packed["labels"][-1] += labels
        packed["position_ids"][-1] += range(len(ids))
    return packed


@dataclass
class Collator:
    """Pads a batch on the right to its longest row (or to pad_to_length, where set: one shape for every batch),
    rounded up to pad_to_multiple_of; int64 [B, T] tensors.

    Unpacked rows: input_ids, labels (-100 on padding), attention_mask (0 on padding). Packed rows (with
    position_ids): input_ids, labels, position_ids and no attention_mask; the padding continues with
    position_ids 0, 1, ..., so it is one more packed sequence, attending only to itself.
    """
    pad_token_id: int
    pad_to_multiple_of: int = 8
    pad_to_length: int | None = None  # data.max_length with data.pad_to_max_length (or a captured packed step)

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(self.pad_to_length or 0, *(len(item["input_ids"]) for item in items))
        width = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        packed = "position_ids" in items[0]
        batch = {"input_ids": [], "labels": [], "position_ids" if packed else "attention_mask": []}
        for item in items:
            length = len(item["input_ids"])
            padding = width - length
            batch["input_ids"].append(item["input_ids"] + [self.pad_token_id] * padding)
            batch["labels"].append(item["labels"] + [IGNORE] * padding)
            if packed:
                batch["position_ids"].append(item["position_ids"] + list(range(padding)))
            else:
                batch["attention_mask"].append([1] * length + [0] * padding)
        return {name: torch.tensor(rows, dtype=torch.long) for name, rows in batch.items()}


# --- the whole pipeline ----------------------------------------------------------------------------------

def build_datasets(cfg: DataConfig, tokenizer, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """load_splits -> tokenize -> pack (when cfg.packing), train and eval alike; rows are plain Python lists."""
    train, evaluation = load_splits(cfg, seed)
    eval_source = cfg.eval_path or f"{cfg.path} (its eval rows, data.eval_fraction={cfg.eval_fraction})"
    return (_prepare(train, cfg, tokenizer, cfg.path),
            None if evaluation is None else _prepare(evaluation, cfg, tokenizer, eval_source))


def _prepare(rows: datasets.Dataset, cfg: DataConfig, tokenizer, source: str) -> datasets.Dataset:
    tokenized = tokenize(rows, cfg, tokenizer, source)
    return pack(tokenized, cfg.max_length) if cfg.packing else tokenized


def count_sample_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens of a Collator batch that belong to its samples: every one but the padding."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    # Packed rows: a row's padding is its last sequence (its positions restart at 0), and the only sequence without
    # a loss-bearing label, since tokenize drops the samples that have none.
    positions, labelled = batch["position_ids"], batch["labels"] != IGNORE  # [B, T] each
    columns = torch.arange(positions.shape[1])
    last = columns >= torch.where(positions == 0, columns, 0).amax(dim=1, keepdim=True)  # each row's last sequence
    padding = last & ~(labelled & last).any(dim=1, keepdim=True)
    return positions.numel() - int(padding.sum())


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Label tokens that carry loss after the causal shift (label t is predicted at position t-1)."""
    return int((labels[:, 1:] != IGNORE).sum())
