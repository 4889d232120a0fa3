"""Local prompt-completion data: loading with ``datasets``, tokenizing, batching.

Examples are ``{"prompt": ..., "completion": ...}`` JSON lines (TRL's prompt-completion format). A training
sequence is ``tokenizer(prompt) + tokenizer(completion, no specials) + <eos>``; the loss is taken on the
completion and the ``<eos>`` only (prompt positions are labelled -100). :func:`pack` concatenates such sequences
into fixed-length ones (``data.packing``), for runs measured at a given number of tokens per step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from trainstream_hf.train.config import ConfigError

__all__ = ["load_tokenizer", "load_examples", "tokenize", "pack", "collate", "batches"]

IGNORE = -100


def load_tokenizer(path: str):
    """A tokenizer from a local directory (no hub). It must define ``eos_token`` and ``pad_token``."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"data.tokenizer: no tokenizer directory {path!r} (make one with "
                                "data/make_data.py, or point at a local model's directory)")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.eos_token_id is None:
        raise ConfigError(f"data.tokenizer: {path!r} defines no eos_token; completions must end with one")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_examples(path: str, *, option: str = "data.train_file", limit: int = 0):
    """The JSON-lines file at ``path`` as a ``datasets.Dataset`` with ``prompt`` and ``completion`` columns.

    Args:
        path: a local .jsonl file.
        option: the config option that named it, for error messages.
        limit: keep only the first ``limit`` rows (0: all).
    """
    from datasets import load_dataset

    if not Path(path).is_file():
        raise FileNotFoundError(f"{option}: no such file {path!r}")
    ds = load_dataset("json", data_files=str(path), split="train")
    missing = {"prompt", "completion"} - set(ds.column_names)
    if missing:
        raise ConfigError(f"{option}: {path!r} lacks the column(s) {sorted(missing)}; each line needs 'prompt' "
                         f"and 'completion' (found {ds.column_names})")
    if limit and limit < len(ds):
        ds = ds.select(range(limit))
    return ds


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
