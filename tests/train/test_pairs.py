"""trainstream_hf.train.data's derived datasets: preference pairs (dpo) and prompts with answers (grpo)."""
import random
import typing
from pathlib import Path

import pytest

from trainstream_hf.train import data
from trainstream_hf.train.config import ConfigError
from trainstream_hf.train.schema import CORRUPTIONS, DPOArgs

ROOT = Path(__file__).resolve().parents[2]


def test_schema_names_every_corruption():
    hint = typing.get_type_hints(DPOArgs)["corruptions"]
    assert typing.get_args(typing.get_args(hint)[0]) == CORRUPTIONS == tuple(data.CORRUPT)


def _words(n, seed):
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(n)]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_each_corruption_changes_the_string_as_named(kind):
    rng = random.Random(1)
    for s in _words(300, 2) + ["aaa", "a", "zz"]:
        out = data.CORRUPT[kind](s, rng)
        if out is None:
            assert (kind == "swap" and len(set(s)) == 1) or (kind == "drop" and len(s) == 1), (kind, s)
            continue
        assert out != s, (kind, s)
        if kind == "swap":
            assert len(out) == len(s) and sorted(out) == sorted(s)
            diff = [i for i in range(len(s)) if s[i] != out[i]]
            assert len(diff) == 2 and diff[1] == diff[0] + 1  # two adjacent characters exchanged
        elif kind == "substitute":
            diff = [i for i in range(len(s)) if s[i] != out[i]]
            assert len(out) == len(s) and len(diff) == 1
            i = diff[0]
            assert (s[i].islower(), s[i].isupper(), s[i].isdigit()) == \
                (out[i].islower(), out[i].isupper(), out[i].isdigit())  # same kind of character
        elif kind == "drop":
            assert len(out) == len(s) - 1 and any(s[:i] + s[i + 1:] == out for i in range(len(s)))
        else:
            assert len(out) == len(s) + 1 and any(s[:i + 1] + s[i:] == out for i in range(len(s)))


def test_preference_pairs_are_seeded_and_use_the_kinds_asked():
    ex = data.load_examples(str(ROOT / "data" / "test.jsonl"))
    a = data.preference_pairs(ex, list(CORRUPTIONS), seed=0)
    assert a.column_names == ["prompt", "chosen", "rejected", "corruption"] and len(a) == len(ex)
    assert a.to_list() == data.preference_pairs(ex, list(CORRUPTIONS), seed=0).to_list()  # deterministic
    assert a["rejected"] != data.preference_pairs(ex, list(CORRUPTIONS), seed=1)["rejected"]
    assert a["prompt"] == ex["prompt"] and a["chosen"] == ex["completion"]
    assert all(r["rejected"] != r["chosen"] for r in a)
    counts = {k: a["corruption"].count(k) for k in CORRUPTIONS}
    assert all(c > len(ex) / 8 for c in counts.values()), counts  # each kind drawn
    only = data.preference_pairs(ex, ["drop"], seed=0)
    assert set(only["corruption"]) == {"drop"} and all(len(r) + 1 == len(c) for r, c in
                                                       zip(only["rejected"], only["chosen"]))


def test_a_kind_that_cannot_apply_falls_back_to_substitute():
    from datasets import Dataset

    ex = Dataset.from_dict({"prompt": ["p", "q"], "completion": ["aaa", "b"]})
    pairs = data.preference_pairs(ex, ["swap"], seed=0).to_list()
    assert [p["corruption"] for p in pairs] == ["substitute", "substitute"]  # "aaa" and "b" have no swap
    assert all(len(p["rejected"]) == len(p["chosen"]) != 0 and p["rejected"] != p["chosen"] for p in pairs)
    with pytest.raises(ConfigError, match=r"data\.test_file: example 1 has an empty completion"):
        data.preference_pairs(Dataset.from_dict({"prompt": ["p", "q"], "completion": ["a", ""]}), ["drop"], seed=0,
                              option="data.test_file")


def test_pairs_tokenize_as_trl_builds_them():
    """prompt + completion tokenized together, <eos> appended; the prompt masked out of the scored positions."""
    tok = data.load_tokenizer(str(ROOT / "data" / "tokenizer"))
    ex = data.load_examples(str(ROOT / "data" / "test.jsonl"), limit=8)
    pairs = data.preference_pairs(ex, list(CORRUPTIONS), seed=0)
    chosen, rejected = data.tokenize_pairs(pairs, tok, 32)
    for row, c, r in zip(pairs, chosen, rejected):
        for text, seq in ((row["chosen"], c), (row["rejected"], r)):
            assert seq["input_ids"] == tok(row["prompt"] + text + tok.eos_token)["input_ids"]
            n = len(tok(row["prompt"])["input_ids"])
            assert seq["labels"][:n] == [data.IGNORE] * n and seq["labels"][n:] == seq["input_ids"][n:]
    with pytest.raises(ConfigError, match=r"data\.max_length: example \d+ has \d+ tokens > 10"):
        data.tokenize_pairs(pairs, tok, 10)


def test_prompts_with_answers_and_their_lengths():
    tok = data.load_tokenizer(str(ROOT / "data" / "tokenizer"))
    ex = data.load_examples(str(ROOT / "data" / "train.jsonl"))
    ds = data.prompts_with_answers(ex)
    assert ds.column_names == ["prompt", "answer"] and ds["answer"] == ex["completion"]
    longest = data.check_prompt_lengths(ds["prompt"], tok, 8, 32)
    assert longest == max(len(p) for p in ds["prompt"]) + 1  # one token per character, plus <bos>
    with pytest.raises(ConfigError, match=rf"data\.max_length: prompt \d+ has {longest} tokens, plus "
                                          rf"grpo\.max_completion_length=8 is {longest + 8} > 16"):
        data.check_prompt_lengths(ds["prompt"], tok, 8, 16)


def test_fill_context_brings_every_pair_to_the_length_it_allows():
    """Solved examples ahead of each prompt: the longer sequence of each pair within max_length and no more than
    one example's line short of it; the completions and the pair's own prompt unchanged at the end."""
    tok = data.load_tokenizer(str(ROOT / "data" / "tokenizer"))
    examples = data.load_examples(str(ROOT / "data" / "train.jsonl"), limit=60)
    pairs = data.preference_pairs(examples, list(CORRUPTIONS), seed=0)
    filled = data.fill_context(pairs, examples, tok, 256)
    assert len(filled) == len(pairs)
    chosen, rejected = data.tokenize_pairs(filled, tok, 256)  # raises if any were longer
    line = max(len(ids) for ids in tok([f"{p}{c}\n" for p, c in zip(examples["prompt"], examples["completion"])],
                                       add_special_tokens=False)["input_ids"])
    for a, b, before, after in zip(chosen, rejected, pairs, filled):
        assert 256 - line - 2 <= max(len(a["input_ids"]), len(b["input_ids"])) <= 256
        assert after["prompt"].endswith(before["prompt"]) and after["prompt"] != before["prompt"]
        assert (after["chosen"], after["rejected"]) == (before["chosen"], before["rejected"])
    with pytest.raises(ConfigError, match="data.max_length"):
        data.fill_context(pairs, examples, tok, 4)
