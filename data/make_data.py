"""Generates the demo task: string transformations of short made-up words, with a held-out split.

Each example is a prompt and a completion (TRL's prompt-completion format)::

    {"prompt": "rev(kblqe)=",  "completion": "eqlbk"}     reverse
    {"prompt": "sort(kblqe)=", "completion": "bekloq"}    sort the letters
    {"prompt": "up(kblqe)=",   "completion": "KBLQE"}     upper-case

Words are random lowercase strings of 3-6 letters. The test split's words never occur in the training
split (under any operation), so held-out exact match measures whether the model learned the operations,
not the words. Also writes the character-level tokenizer (``tokenizer/``: tokenizer.json +
tokenizer_config.json, loadable with ``AutoTokenizer.from_pretrained`` or ``PreTrainedTokenizerFast``).

    python data/make_data.py            # rewrites data/train.jsonl, data/test.jsonl, data/tokenizer/

The output is a pure function of the arguments (seeded), so the committed files can be checked by
running it again and diffing.
"""
from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

# Short operation names: with long ones ("reverse(", "upper(") the same model learned about 3x slower
# (31% vs 89% held-out exact match after 200 steps, measured), as the word sits further from the start.
OPS = {
    "rev": lambda w: w[::-1],
    "sort": lambda w: "".join(sorted(w)),
    "up": str.upper,
}
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = string.ascii_lowercase + string.ascii_uppercase + "()="


def make_words(rng: random.Random, n: int, min_len: int, max_len: int) -> list[str]:
    """``n`` distinct random lowercase words, in generation order."""
    words: dict[str, None] = {}
    while len(words) < n:
        k = rng.randint(min_len, max_len)
        words["".join(rng.choice(string.ascii_lowercase) for _ in range(k))] = None
    return list(words)


def examples(words: list[str], n: int, rng: random.Random) -> list[dict]:
    """``n`` distinct (operation, word) examples over ``words``, operations balanced."""
    ops = list(OPS)
    pairs = [(op, w) for w in words for op in ops]
    rng.shuffle(pairs)
    if n > len(pairs):
        raise ValueError(f"asked for {n} examples but {len(words)} words give only {len(pairs)}")
    return [{"prompt": f"{op}({w})=", "completion": OPS[op](w)} for op, w in pairs[:n]]


def save_tokenizer(path: Path, max_length: int) -> None:
    """A character-level tokenizer: one token per character of ``CHARS``, ``<bos>`` prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=max_length)
    fast.save_pretrained(str(path))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent), help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=5000, help="training examples")
    ap.add_argument("--test", type=int, default=300, help="held-out examples")
    ap.add_argument("--min_len", type=int, default=3)
    ap.add_argument("--max_len", type=int, default=6)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    n_ops = len(OPS)
    # Enough words that each split draws its examples from its own words; every test word is used.
    n_test_words = -(-args.test // n_ops)
    n_train_words = args.train // n_ops * 2
    words = make_words(rng, n_train_words + n_test_words, args.min_len, args.max_len)
    test_words, train_words = words[:n_test_words], words[n_test_words:]
    splits = {"train": examples(train_words, args.train, rng), "test": examples(test_words, args.test, rng)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    # Prompt + completion + <bos> + <eos>, with room to spare.
    save_tokenizer(out / "tokenizer", max_length=2 * (max(map(len, OPS)) + len("()=") + 2 * args.max_len + 2))
    print(f"wrote {out}/train.jsonl ({len(splits['train'])}), test.jsonl ({len(splits['test'])}), tokenizer/")


if __name__ == "__main__":
    main()
