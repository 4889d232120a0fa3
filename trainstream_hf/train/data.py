"""Local prompt-completion data: reading (every line checked), tokenizing, batching; the preference pairs and the
prompts the dpo and grpo recipes derive from it.

Examples are ``{"prompt": ..., "completion": ...}`` JSON lines (TRL's prompt-completion format). A training
sequence is ``tokenizer(prompt) + tokenizer(completion, no specials) + <eos>``; the loss is taken on the
completion and the ``<eos>`` only (prompt positions are labelled -100). :func:`pack` concatenates such sequences
into fixed-length ones (``data.packing``), for runs measured at a given number of tokens per step.

:func:`preference_pairs` makes TRL's preference format from the same files (``chosen`` = the completion,
``rejected`` = the completion corrupted by one of :data:`CORRUPT`, seeded), and :func:`prompts_with_answers` TRL's
prompt-only format with the completion kept as ``answer`` for the reward functions. Both are made at load time,
deterministically, so no second copy of the data is shipped.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Callable, Iterator

import torch

from trainstream_hf.train.config import ConfigError, MissingFileError

__all__ = ["load_tokenizer", "load_examples", "read_jsonl", "tokenize", "pack", "collate", "batches", "CORRUPT",
           "fill_context",
           "preference_pairs", "tokenize_pairs", "prompts_with_answers", "check_prompt_lengths"]

IGNORE = -100


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """A tokenizer from a local directory (no hub). It must define ``eos_token`` and ``pad_token``."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"data.tokenizer: no tokenizer directory {path!r}; point it at the directory your "
                                "model's tokenizer was saved to (the demo's is data/tokenizer)")
    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        raise ConfigError(f"data.tokenizer: {path!r} holds no tokenizer ({', '.join(_TOKENIZER_FILES)}); save "
                          "your model's tokenizer there (tokenizer.save_pretrained(dir)) or point at the directory "
                          "that has it")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.eos_token_id is None:
        raise ConfigError(f"data.tokenizer: {path!r} defines no eos_token; completions must end with one")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


FIELDS = ("prompt", "completion")
FORMAT = ('one JSON object per line with "prompt" and "completion" strings, e.g. '
          '{"prompt": "rev(abc)=", "completion": "cba"}')


def load_examples(path: str, *, option: str = "data.train_file", limit: int = 0):
    """The JSON-lines file at ``path`` as a ``datasets.Dataset`` with ``prompt`` and ``completion`` columns.

    Every line is checked here, before ``datasets`` sees the file (its errors name neither the file nor the line, and
    an empty file gives a bare StopIteration); other keys of a line are ignored.

    Args:
        path: a local .jsonl file.
        option: the config option that named it, for error messages.
        limit: keep only the first ``limit`` rows (0: all); the whole file is checked all the same.

    Raises:
        MissingFileError: no such file.
        ConfigError: the file is empty or blank, or a line is not a JSON object with ``prompt`` and ``completion``
            strings; naming the option, the file, the (1-based) line and the format expected.
    """
    from datasets import Dataset

    columns = read_jsonl(path, option=option)
    if limit:
        columns = {k: v[:limit] for k, v in columns.items()}
    return Dataset.from_dict(columns)


def _json_kind(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def read_jsonl(path: str, *, option: str = "data.train_file", fields: tuple[str, ...] = FIELDS
               ) -> dict[str, list[str]]:
    """The ``fields`` of every line of a JSON-lines file, as columns; blank lines are skipped.

    Raises:
        MissingFileError, ConfigError: as :func:`load_examples` says.
    """
    p = Path(path)
    where = f"{option}: {str(path)!r}"
    if p.is_dir():
        raise ConfigError(f"{where} is a directory; expected a JSON-lines file: {FORMAT}")
    if not p.is_file():
        raise MissingFileError(f"{option}: no such file {str(path)!r}; expected a JSON-lines file: {FORMAT}")
    columns: dict[str, list[str]] = {f: [] for f in fields}
    n = 0
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{where} line {n} is not UTF-8 text; expected {FORMAT}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where} line {n} is not valid JSON ({e.msg} at column {e.colno}); "
                                  f"expected {FORMAT}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where} line {n} is a JSON {_json_kind(row)}, not an object; expected {FORMAT}")
            missing = [k for k in fields if k not in row]
            if missing:
                names = " or ".join(f'"{k}"' for k in missing)
                pairs = ("; preference pairs (chosen / rejected) are not read by the recipes, which derive their own: "
                         "train on yours with TrainStreamDPOTrainer") if {"chosen", "rejected"} <= set(row) else ""
                if "messages" in row:
                    pairs = ("; conversational rows (messages) are not read by the recipes: render each with your "
                             "tokenizer's chat template into a prompt (every turn but the last) and a completion (the "
                             "last assistant turn), or train on them with TRL's SFTTrainer and the Trainer flag "
                             "(TrainStreamTrainingArguments / TRAINSTREAM=on)")
                raise ConfigError(f"{where} line {n} has no {names} (its keys: {', '.join(row) or 'none'}); "
                                  f"expected {FORMAT}{pairs}")
            for k in fields:
                if not isinstance(row[k], str):
                    raise ConfigError(f'{where} line {n}: "{k}" is a {_json_kind(row[k])}, not a string; '
                                      f"expected {FORMAT}")
                columns[k].append(row[k])
    if not columns[fields[0]]:
        what = "is empty" if n == 0 else f"holds only blank lines ({n})"
        raise ConfigError(f"{where} {what}; expected {FORMAT}")
    return columns


def tokenize(ds, tokenizer, max_length: int) -> list[dict[str, list[int]]]:
    """Token ids and labels (prompt masked with -100) for every example.

    Raises:
        ConfigError: an example is longer than ``max_length`` tokens.
    """
    prompts = tokenizer(list(ds["prompt"]))["input_ids"]
    completions = tokenizer(list(ds["completion"]), add_special_tokens=False)["input_ids"]
    rows = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = p + c + [tokenizer.eos_token_id]
        if len(ids) > max_length:
            raise ConfigError(f"data.max_length: example {i} has {len(ids)} tokens > {max_length}; raise "
                             "data.max_length")
        rows.append({"input_ids": ids, "labels": [IGNORE] * len(p) + ids[len(p):]})
    return rows


def pack(rows: list[dict[str, list[int]]], length: int) -> list[dict[str, list[int]]]:
    """The rows' tokens and labels concatenated in order and cut into sequences of exactly ``length`` tokens (an
    example may straddle two sequences; the incomplete tail is dropped).

    Raises:
        ConfigError: fewer than ``length`` tokens in all.
    """
    ids = [t for r in rows for t in r["input_ids"]]
    labels = [t for r in rows for t in r["labels"]]
    if len(ids) < length:
        raise ConfigError(f"data.packing: the training examples hold {len(ids)} tokens in all, fewer than one "
                         f"sequence of data.max_length={length}")
    return [{"input_ids": ids[i:i + length], "labels": labels[i:i + length]}
            for i in range(0, len(ids) - length + 1, length)]


def collate(rows: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` tensors."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k] = torch.tensor(r["input_ids"])
        labels[i, :k] = torch.tensor(r["labels"])
        mask[i, :k] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batches(rows: list[dict], batch_size: int, pad_id: int, *, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless shuffled batches: each epoch a fresh permutation from a generator seeded with ``seed``; the
    last partial batch of an epoch is dropped (every step sees ``batch_size`` examples).

    Raises:
        ConfigError: fewer rows than ``batch_size`` (at the call, not at the first batch).
    """
    if len(rows) < batch_size:
        raise ConfigError(f"train.batch_size={batch_size} is larger than the {len(rows)} training sequences "
                          "(examples, or packed sequences with data.packing)")
    return _endless(rows, batch_size, pad_id, seed)


def _endless(rows: list[dict], batch_size: int, pad_id: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(rows), generator=g).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield collate([rows[j] for j in order[start:start + batch_size]], pad_id)


# -- preference pairs (dpo) and prompts (grpo) ------------------------------------------------------------------------
def _alphabet(c: str) -> str:
    for chars in (string.ascii_lowercase, string.ascii_uppercase, string.digits):
        if c in chars:
            return chars
    return string.ascii_lowercase


def _swap(s: str, rng: random.Random) -> str | None:
    """Two different adjacent characters exchanged (None if there are none: 'aaa')."""
    spots = [i for i in range(len(s) - 1) if s[i] != s[i + 1]]
    if not spots:
        return None
    i = rng.choice(spots)
    return s[:i] + s[i + 1] + s[i] + s[i + 2:]


def _substitute(s: str, rng: random.Random) -> str:
    """One character replaced by another of its kind (a lowercase letter by a lowercase letter, ...)."""
    i = rng.randrange(len(s))
    return s[:i] + rng.choice(_alphabet(s[i]).replace(s[i], "")) + s[i + 1:]


def _drop(s: str, rng: random.Random) -> str | None:
    """One character deleted (None for a one-character string: nothing would be left)."""
    if len(s) < 2:
        return None
    i = rng.randrange(len(s))
    return s[:i] + s[i + 1:]


def _repeat(s: str, rng: random.Random) -> str:
    """One character written twice."""
    i = rng.randrange(len(s))
    return s[:i + 1] + s[i:]


# name -> corruption; each returns a string different from its input, or None where it cannot (then the pair is
# made by "substitute", which always can). The names are schema.CORRUPTIONS.
CORRUPT: dict[str, Callable[[str, random.Random], str | None]] = {
    "swap": _swap, "substitute": _substitute, "drop": _drop, "repeat": _repeat}


def preference_pairs(examples, corruptions: list[str], *, seed: int, option: str = "data.train_file"):
    """TRL's preference format made from prompt-completion examples: ``chosen`` is the completion, ``rejected`` the
    completion corrupted by a kind drawn (seeded) from ``corruptions``; ``corruption`` names the kind used.

    Args:
        examples: a dataset with ``prompt`` and ``completion`` columns (:func:`load_examples`).
        corruptions: names from :data:`CORRUPT`.
        seed: the pairs are a pure function of the examples, ``corruptions`` and ``seed``.
        option: the config option naming the file, for error messages.

    Returns:
        A ``datasets.Dataset`` with ``prompt``, ``chosen``, ``rejected`` and ``corruption`` columns.

    Raises:
        ConfigError: an empty completion (nothing to corrupt).
    """
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for i, (prompt, chosen) in enumerate(zip(examples["prompt"], examples["completion"])):
        if not chosen:
            raise ConfigError(f"{option}: example {i} has an empty completion; a preference pair needs one to corrupt")
        kind = corruptions[rng.randrange(len(corruptions))]
        rejected = CORRUPT[kind](chosen, rng)
        if rejected is None:
            kind, rejected = "substitute", _substitute(chosen, rng)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "corruption": kind})
    return Dataset.from_list(rows)


def fill_context(pairs, examples, tokenizer, max_length: int):
    """``pairs`` with solved ``examples`` (``prompt + completion``, one per line) put ahead of each prompt, the
    examples after the pair's own in file order (wrapping around), as many as keep the pair's longer sequence, as
    :func:`tokenize_pairs` builds it, within ``max_length`` tokens.

    Raises:
        ConfigError: a pair alone is longer than ``max_length`` tokens, or there are fewer than two examples.
    """
    from datasets import Dataset

    lines = [f"{p}{c}\n" for p, c in zip(examples["prompt"], examples["completion"])]
    if len(lines) < 2:
        raise ConfigError("dpo.fill_context: needs at least two training examples (one to fill the other's context)")
    line_tokens = [len(ids) for ids in tokenizer(lines, add_special_tokens=False)["input_ids"]]

    def longer(prompt: str, chosen: str, rejected: str) -> int:
        p = tokenizer(prompt)["input_ids"]
        c, r = tokenizer([chosen, rejected], add_special_tokens=False)["input_ids"]
        return len(p) + max(len(c), len(r)) + 1  # + <eos>

    rows = []
    for i, row in enumerate(pairs):
        own = longer(row["prompt"], row["chosen"], row["rejected"])
        if own > max_length:
            raise ConfigError(f"data.max_length: pair {i} alone has {own} tokens > {max_length}; raise data.max_length")
        taken, total, j = [], own, (i + 1) % len(lines)
        while j != i % len(lines) and total + line_tokens[j] <= max_length:  # an estimate: tokens may merge
            taken.append(lines[j])
            total += line_tokens[j]
            j = (j + 1) % len(lines)
        while taken and longer("".join(taken) + row["prompt"], row["chosen"], row["rejected"]) > max_length:
            taken.pop()
        rows.append({**row, "prompt": "".join(taken) + row["prompt"]})
    return Dataset.from_list(rows)


def tokenize_pairs(pairs, tokenizer, max_length: int) -> tuple[list[dict], list[dict]]:
    """(chosen rows, rejected rows) as :func:`tokenize` makes them: the sequences TRL's DPOTrainer builds from the
    pairs (prompt and completion tokenized together, ``<eos>`` appended), prompt positions labelled -100.

    Raises:
        ConfigError: a sequence is longer than ``max_length`` tokens.
    """
    def view(column: str):
        return {"prompt": pairs["prompt"], "completion": pairs[column]}

    return tokenize(view("chosen"), tokenizer, max_length), tokenize(view("rejected"), tokenizer, max_length)


def prompts_with_answers(examples):
    """TRL's prompt-only format for GRPO: ``prompt``, and the completion as ``answer`` (TRL passes the dataset's
    other columns to the reward functions by name, and keeps ``completion`` for its own use)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": list(examples["prompt"]), "answer": list(examples["completion"])})


def check_prompt_lengths(prompts: list[str], tokenizer, max_new_tokens: int, max_length: int,
                         option: str = "grpo.max_completion_length") -> int:
    """The longest tokenized prompt, after checking that each one plus ``max_new_tokens`` fits in ``max_length``.

    Raises:
        ConfigError: naming ``data.max_length`` and ``option``.
    """
    lengths = [len(ids) for ids in tokenizer(list(prompts))["input_ids"]]
    longest = max(lengths)
    if longest + max_new_tokens > max_length:
        i = lengths.index(longest)
        raise ConfigError(f"data.max_length: prompt {i} has {longest} tokens, plus {option}={max_new_tokens} is "
                          f"{longest + max_new_tokens} > {max_length}; raise data.max_length or lower {option}")
    return longest
