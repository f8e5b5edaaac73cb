"""(Re)generates the bundled demo data and tiny model, deterministically and offline.

    python recipes/make_demo_assets.py

Writes, under lorafuse/assets/:
  demo/instruct.jsonl  alpaca-style rows {"instruction", "input", "output"}
  demo/chat.jsonl      rows {"messages": [{"role", "content"}, ...]}, some with two assistant turns
  demo/text.jsonl      rows {"text"}: short sentences about made-up creatures
  tiny-llama/          a 4-layer Llama (random weights, seed 0) with a byte-level BPE tokenizer trained on
                       the demo text and a chat template; loads with AutoTokenizer/AutoModelForCausalLM

All text is synthetic, drawn from random.Random(0): made-up words, small numbers, and tasks whose answer
follows from the prompt alone (reverse a word, add two numbers, ...), so that a tiny model can learn them
in minutes on a CPU. Running the script again rewrites the same files.
"""
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parents[1] / "lorafuse" / "assets"
DEMO, MODEL = ASSETS / "demo", ASSETS / "tiny-llama"
N_INSTRUCT, N_CHAT, N_TEXT = 3000, 1000, 1000
VOCAB_SIZE = 512

BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Each message is `<|role|>\n{content}<|end|>\n`: rendering a prefix of a conversation gives a string
# prefix of the whole rendering, which lorafuse.train.data relies on to find the assistant turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# --- made-up words and tasks -------------------------------------------------------------------

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "gr", "pl", "sk", "st"]
VOWELS = ["a", "e", "i", "o", "u"]
CODAS = ["", "", "", "n", "l", "r", "s", "x"]


def made_up_word(rng: random.Random) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.randint(2, 3)))


def numbers_text(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers))


# A task draws its argument and returns (instruction with the argument inline, instruction for a
# separate input, the argument as an input, the answer).
def reverse(rng):
    w = made_up_word(rng)
    return f"Reverse the letters of the word {w}.", "Reverse the letters of this word.", w, w[::-1]


def capitals(rng):
    w = made_up_word(rng)
    return f"Write {w} in capital letters.", "Write this word in capital letters.", w, w.upper()


def spell(rng):
    w = made_up_word(rng)
    return (f"Spell {w} with spaces between the letters.", "Spell this word with spaces between the letters.", w,
            " ".join(w))


def count_letters(rng):
    w = made_up_word(rng)
    return f"How many letters are in the word {w}?", "How many letters are in this word?", w, str(len(w))


def repeat(rng):
    w, n = made_up_word(rng), rng.randint(2, 4)
    return f"Repeat the word {w} {n} times.", f"Repeat this word {n} times.", w, " ".join([w] * n)


def add(rng):
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return f"What is {a} plus {b}?", "Add these two numbers.", f"{a} and {b}", str(a + b)


def sort_numbers(rng):
    numbers = [rng.randint(0, 20) for _ in range(rng.randint(3, 5))]
    return (f"Sort these numbers from smallest to largest: {numbers_text(numbers)}.",
            "Sort these numbers from smallest to largest.", numbers_text(numbers), numbers_text(sorted(numbers)))


def larger(rng):
    a, b = rng.sample(range(100), 2)
    return f"Which is larger, {a} or {b}?", "Which of these two numbers is larger?", f"{a} or {b}", str(max(a, b))


TASKS = [reverse, capitals, spell, count_letters, repeat, add, sort_numbers, larger]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer with the result only.", "You are a careful assistant."]


def instruct_row(rng: random.Random) -> dict:
    inline, separate, argument, answer = rng.choice(TASKS)(rng)
    if rng.random() < 0.4:
        return {"instruction": separate, "input": argument, "output": answer}
    return {"instruction": inline, "input": "", "output": answer}


def chat_row(rng: random.Random) -> dict:
    task = rng.choice(TASKS)
    question, _, _, answer = task(rng)
    messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.5 else []
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.4:  # a second turn: the same task on a new argument, asked for by reference
        _, _, argument, answer = task(rng)
        messages += [{"role": "user", "content": f"Now do the same for {argument}."},
                     {"role": "assistant", "content": answer}]
    return {"messages": messages}


# --- plain text: consistent facts about a fixed set of creatures ----------------------------------

COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
PLACES = ["forest", "river", "cave", "hill", "desert", "swamp"]
FOODS = ["leaves", "fish", "berries", "stones", "seeds", "moss"]
FACTS = ["The {name} is {color}.", "A {name} has {legs} legs.", "The {name} lives in the {place}.",
         "A {name} eats {food}."]


def creatures(rng: random.Random, n: int = 60) -> list[dict]:
    names = list(dict.fromkeys(made_up_word(rng) for _ in range(2 * n)))[:n]
    return [{"name": name, "color": rng.choice(COLORS), "legs": rng.choice([2, 4, 6, 8]),
             "place": rng.choice(PLACES), "food": rng.choice(FOODS)} for name in names]


def text_row(rng: random.Random, lexicon: list[dict]) -> dict:
    creature = rng.choice(lexicon)
    facts = rng.sample(FACTS, rng.randint(2, 3))
    return {"text": " ".join(fact.format(**creature) for fact in facts)}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {path.relative_to(ASSETS.parent.parent)}: {len(rows)} rows, {path.stat().st_size:,} bytes")


# --- tokenizer and model ----------------------------------------------------------------------------

def corpus(instruct: list[dict], chat: list[dict], text: list[dict]) -> list[str]:
    """The strings the tokenizer learns from: every field of every row, and the alpaca prompt headers."""
    strings = [value for row in instruct for value in row.values() if value]
    strings += [m["content"] for row in chat for m in row["messages"]]
    strings += [row["text"] for row in text]
    return strings + ["### Instruction:\n", "### Input:\n", "### Response:\n"]


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        extra_special_tokens=ROLE_TOKENS, model_max_length=1024)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def check_chat_template(tokenizer, conversation: list[dict]) -> None:
    """Every prefix of the conversation, and the generation prompt before each assistant turn, renders
    as a string prefix of the whole conversation."""
    def render(messages, add_generation_prompt=False):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    full = render(conversation)
    for end in range(1, len(conversation)):
        assert full.startswith(render(conversation[:end])), (conversation, end)
        if conversation[end]["role"] == "assistant":
            assert full.startswith(render(conversation[:end], add_generation_prompt=True)), (conversation, end)


def tiny_llama(tokenizer) -> LlamaForCausalLM:
    # initializer_range 0.2 (HF's default is 0.02): with a frozen random lm_head that small, the logits
    # could not grow enough for LoRA to lower the loss.
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float32)


def main() -> None:
    rng = random.Random(0)
    instruct = [instruct_row(rng) for _ in range(N_INSTRUCT)]
    chat = [chat_row(rng) for _ in range(N_CHAT)]
    lexicon = creatures(rng)
    text = [text_row(rng, lexicon) for _ in range(N_TEXT)]
    for name, rows in (("instruct", instruct), ("chat", chat), ("text", text)):
        write_jsonl(DEMO / f"{name}.jsonl", rows)

    tokenizer = train_tokenizer(corpus(instruct, chat, text))
    for row in chat:
        check_chat_template(tokenizer, row["messages"])
    tiny_llama(tokenizer).save_pretrained(MODEL)
    tokenizer.save_pretrained(MODEL)
    # What users get back: the directory must load offline, tokenizer and template included.
    reloaded = AutoTokenizer.from_pretrained(MODEL)
    assert reloaded.apply_chat_template(chat[0]["messages"], tokenize=False) == \
        tokenizer.apply_chat_template(chat[0]["messages"], tokenize=False)
    size = sum(f.stat().st_size for f in MODEL.iterdir())
    print(f"wrote {MODEL.relative_to(ASSETS.parent.parent)}/: vocab {len(tokenizer)}, {size:,} bytes "
          f"({', '.join(sorted(f.name for f in MODEL.iterdir()))})")


if __name__ == "__main__":
    main()
