"""Write the quickstart assets of veomni-train: templated chat data and a byte-level BPE tokenizer trained on it.

Usage: ``uv run python tools/make_quickstart_data.py [--out DIR]`` (default: the package's
``veomni/train/assets/quickstart``). The output is a pure function of this file: a seeded ``random.Random``
writes the rows, and the tokenizer is trained single-threaded on them, so running it again reproduces the
committed files byte for byte (tests/train/test_quickstart_assets.py checks that).

What is written:
    train.jsonl, eval.jsonl   one ``{"messages": [{"role", "content"[, "loss_mask"]}, ...]}`` object per line.
                              Short templated tasks (arithmetic, word games, a small table of made-up facts)
                              that a ~2M-parameter model learns within a minute, so the loss visibly falls.
    pairs.jsonl               preference pairs (``quickstart_dpo``): one-question train rows as ``{"prompt",
                              "chosen", "rejected"}``, the rejected answer another question's.
    tokenizer/                byte-level BPE (vocab `VOCAB_SIZE`) with ChatML-style role tokens and a chat
                              template; ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it offline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "packages/veomni-train/src/veomni/train/assets/quickstart"
SEED = 20260821
N_TRAIN, N_EVAL = 600, 48
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML: every message is "<|im_start|>{role}\n{content}<|im_end|>\n". Rendering a prefix of a conversation
# gives a prefix of the full rendering, which is what the data pipeline needs to attribute tokens to messages.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "garden",
    "silver",
    "pencil",
    "window",
    "market",
    "candle",
    "orange",
    "forest",
    "rocket",
    "yellow",
    "planet",
    "bridge",
    "winter",
    "summer",
    "basket",
    "guitar",
    "dragon",
    "island",
    "lemon",
    "mirror",
    "rabbit",
    "shadow",
    "tomato",
    "violin",
    "wallet",
    "anchor",
    "butter",
    "carpet",
    "doctor",
    "engine",
    "falcon",
    "gentle",
    "hammer",
    "jacket",
    "kettle",
    "ladder",
    "meadow",
    "needle",
    "pepper",
    "quartz",
    "saddle",
    "tunnel",
    "velvet",
    "wizard",
    "zipper",
]
# Made-up facts: a lookup table the model can only learn by memorising it.
FACTS = {
    "zorblat": "blue",
    "quimble": "green",
    "fennik": "red",
    "yarrow": "purple",
    "drizzle": "orange",
    "tolvane": "white",
    "mebbet": "black",
    "skorn": "golden",
    "plinth": "silver",
    "wumple": "pink",
    "gastor": "brown",
    "orvid": "grey",
}
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a careful calculator.", "Answer briefly."]


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."


def _subtraction(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(10, 99)
    b = rng.randint(0, a)
    return f"What is {a} - {b}?", f"{a} - {b} = {a - b}."


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Reverse the word '{word}'.", f"'{word}' reversed is '{word[::-1]}'."


def _upper(rng: random.Random) -> tuple[str, str]:
    words = " ".join(rng.sample(WORDS, 2))
    return f"Write '{words}' in capital letters.", words.upper()


def _length(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"How many letters are in '{word}'?", f"'{word}' has {len(word)} letters."


def _fact(rng: random.Random) -> tuple[str, str]:
    thing = rng.choice(sorted(FACTS))
    return f"What colour is a {thing}?", f"A {thing} is {FACTS[thing]}."


def _sort(rng: random.Random) -> tuple[str, str]:
    nums = [rng.randint(0, 50) for _ in range(rng.randint(3, 5))]
    return f"Sort these numbers: {', '.join(map(str, nums))}.", ", ".join(map(str, sorted(nums)))


TASKS = [_addition, _subtraction, _reverse, _upper, _length, _fact, _sort]


def _conversation(rng: random.Random) -> dict:
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    turns = 1 if rng.random() < 0.7 else rng.randint(2, 3)
    # A few multi-turn rows keep an earlier answer as context only (per-message loss_mask 0), to exercise the
    # per-message override of the assistant-only default.
    context_only = turns > 1 and rng.random() < 0.25
    for turn in range(turns):
        question, answer = rng.choice(TASKS)(rng)
        messages.append({"role": "user", "content": question})
        reply: dict = {"role": "assistant", "content": answer}
        if context_only and turn == 0:
            reply["loss_mask"] = 0
        messages.append(reply)
    return {"messages": messages}


def make_rows(n: int, rng: random.Random) -> list[dict]:
    """``n`` conversations drawn from ``rng``."""
    return [_conversation(rng) for _ in range(n)]


def make_pairs(rows: list[dict], rng: random.Random) -> list[dict]:
    """Preference pairs from the one-question ``rows``: the prompt and the right answer (chosen), and the answer of
    another question drawn from ``rng`` (rejected)."""
    single = [r["messages"] for r in rows if len(r["messages"]) - (r["messages"][0]["role"] == "system") == 2]
    pairs = []
    for messages in single:
        wrong = rng.choice(single)[-1]["content"]
        while wrong == messages[-1]["content"]:
            wrong = rng.choice(single)[-1]["content"]
        pairs.append({
            "prompt": messages[:-1],
            "chosen": [{"role": "assistant", "content": messages[-1]["content"]}],
            "rejected": [{"role": "assistant", "content": wrong}],
        })  # fmt: skip
    return pairs


def _tokenizer_corpus(rows: list[dict]) -> Iterator[str]:
    # Message text and role names only: the role markers are special tokens and must not grow merges.
    for row in rows:
        for message in row["messages"]:
            yield message["role"]
            yield message["content"]


def train_tokenizer(rows: list[dict], out_dir: Path) -> None:
    """Train byte-level BPE on ``rows`` and save it with the chat template as an HF tokenizer in ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(rows), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    hf.save_pretrained(out_dir)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    args = parser.parse_args(argv)
    # The BPE trainer counts pairs in parallel; one thread keeps ties, and so the merges, reproducible.
    os.environ["RAYON_NUM_THREADS"] = "1"
    rng = random.Random(SEED)
    train, evaluation = make_rows(N_TRAIN, rng), make_rows(N_EVAL, rng)
    out: Path = args.out
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "eval.jsonl", evaluation)
    # Its own generator: the rows and the tokenizer above stay what they were before pairs existed.
    _write_jsonl(out / "pairs.jsonl", make_pairs(train, random.Random(SEED + 1)))
    train_tokenizer(train, out / "tokenizer")
    print(
        f"wrote {len(train)} train rows, {len(evaluation)} eval rows and a {VOCAB_SIZE}-token tokenizer to {out}"
    )


if __name__ == "__main__":
    main()
