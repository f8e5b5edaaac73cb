"""Prompts as token ids: plain text, or chat messages through the tokenizer's chat template; and reading them from
the generate recipe's config or file."""
import json
from pathlib import Path


class PromptError(ValueError):
    """Prompts that cannot be read: the message names the key or file and what was expected."""


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """[{role, content}, ...] through the chat template, ending with the assistant's generation prompt."""
    if not tokenizer.chat_template:
        raise PromptError("the tokenizer has no chat template: send plain prompts (chat=false, /v1/completions)")
    # return_dict=False: transformers 5 returns a BatchEncoding otherwise.
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    return encode_messages(tokenizer, [{"role": "user", "content": text}]) if chat else tokenizer.encode(text)


def read_prompts(prompts: list[str], prompts_file: str | None) -> tuple[list[str], list[str | None]]:
    """(`prompts`, then those of `prompts_file`: a line each (.txt), or each line's "prompt" field (.jsonl); each
    prompt's adapter: a .jsonl line's optional "adapter" field, else None, the model's active adapter)."""
    found = list(prompts)
    adapters: list[str | None] = [None] * len(found)
    if prompts_file is not None:
        path = Path(prompts_file).expanduser()
        if not path.is_file():
            raise PromptError(f"prompts_file: no such file: {prompts_file}")
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if path.suffix == ".jsonl":
            for number, line in enumerate(lines, 1):
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise PromptError(f"{prompts_file}:{number}: each line needs a \"prompt\" string, got {line:.80}")
                if not isinstance(row.get("adapter", ""), str):
                    raise PromptError(f"{prompts_file}:{number}: \"adapter\" must be an adapter's name, got "
                                      f"{row['adapter']!r}")
                found.append(row["prompt"])
                adapters.append(row.get("adapter"))
        else:
            found += lines
            adapters += [None] * len(lines)
    if not found:
        raise PromptError("no prompts: give prompts='[\"...\"]' or prompts_file=<file>")
    return found, adapters
