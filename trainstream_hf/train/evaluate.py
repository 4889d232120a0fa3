"""Held-out evaluation of a causal LM on prompt-completion examples: loss and greedy exact match."""
from __future__ import annotations

import math

import torch

from trainstream_hf.train.data import IGNORE, collate

__all__ = ["heldout_loss", "greedy_completions", "exact_match", "evaluate"]


@torch.no_grad()
def heldout_loss(model, rows: list[dict], *, batch_size: int, pad_id: int, device) -> float:
    """Mean cross-entropy per completion token (``<eos>`` included), teacher-forced, over ``rows``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size], pad_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=IGNORE, reduction="sum")
        total += loss.item()
        count += int((labels != IGNORE).sum())
    model.train(was_training)
    return total / count if count else math.nan


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], *, batch_size: int, max_new_tokens: int,
                       device) -> list[str]:
    """Greedy-decoded completions of ``prompts`` (left-padded batches through ``model.generate``), each cut
    at the first ``<eos>``."""
    was_training = model.training
    model.eval()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = [tokenizer(p)["input_ids"] for p in prompts[start:start + batch_size]]
        n = max(map(len, enc))
        ids = torch.tensor([[pad] * (n - len(e)) + e for e in enc], device=device)
        mask = torch.tensor([[0] * (n - len(e)) + [1] * len(e) for e in enc], device=device)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=eos)
        for row in gen[:, n:].tolist():
            if eos in row:
                row = row[:row.index(eos)]
            out.append(tokenizer.decode(row, skip_special_tokens=True))
    model.train(was_training)
    return out


def exact_match(predictions: list[str], answers: list[str]) -> float:
    """Fraction of predictions equal to their answer (after stripping surrounding whitespace)."""
    if not answers:
        return math.nan
    return sum(p.strip() == a.strip() for p, a in zip(predictions, answers)) / len(answers)


def evaluate(model, tokenizer, examples, rows: list[dict], *, batch_size: int, max_new_tokens: int,
             device) -> dict:
    """Loss and exact match on held-out ``examples`` (a dataset with prompt / completion; ``rows`` their
    tokenization). Returns ``{"loss", "exact_match", "correct", "total", "predictions"}``."""
    prompts, answers = list(examples["prompt"]), list(examples["completion"])
    preds = greedy_completions(model, tokenizer, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens,
                               device=device)
    em = exact_match(preds, answers)
    return {"loss": heldout_loss(model, rows, batch_size=batch_size, pad_id=tokenizer.pad_token_id, device=device),
            "exact_match": em, "correct": round(em * len(answers)), "total": len(answers),
            "predictions": [{"prompt": p, "answer": a, "prediction": q} for p, a, q in zip(prompts, answers, preds)]}
