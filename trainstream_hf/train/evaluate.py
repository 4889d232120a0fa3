"""Held-out evaluation of a causal LM on prompt-completion examples: loss and greedy exact match (sft), the same
plus rewards of the greedy completions (grpo), and the DPO figures of preference pairs (dpo)."""
from __future__ import annotations

import math

import torch

from trainstream_hf.train import rewards as reward_scores
from trainstream_hf.train.data import IGNORE, collate

__all__ = ["heldout_loss", "greedy_completions", "exact_match", "evaluate", "evaluate_rewards", "preferences"]


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


def evaluate_rewards(model, tokenizer, examples, rewards: list[str], *, batch_size: int, max_new_tokens: int,
                     device) -> dict:
    """Greedy completions of held-out ``examples`` (prompt / completion) scored by each reward of ``rewards`` (names
    of :data:`trainstream_hf.train.rewards.SCORES`) against the completion. Returns ``{"rewards": {name: mean},
    "exact_match", "correct", "total", "predictions"}``."""
    prompts, answers = list(examples["prompt"]), list(examples["completion"])
    preds = greedy_completions(model, tokenizer, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens,
                               device=device)
    em = exact_match(preds, answers)
    return {"rewards": reward_scores.mean_scores(rewards, preds, answers), "exact_match": em,
            "correct": round(em * len(answers)), "total": len(answers),
            "predictions": [{"prompt": p, "answer": a, "prediction": q} for p, a, q in zip(prompts, answers, preds)]}


@torch.no_grad()
def preferences(model, pairs, chosen_rows: list[dict], rejected_rows: list[dict], *, beta: float, loss_type: str,
                batch_size: int, pad_id: int, device, chunk_tokens: int = 1024) -> dict:
    """The DPO figures of held-out preference pairs, as TRL's DPOTrainer computes them for a training batch.

    The policy is ``model`` (a PEFT model) and the reference the same model with its adapters switched off
    (:func:`~trainstream_hf.integrations.huggingface.reference_logprobs`); sequence log-probabilities are summed
    over the completion and ``<eos>`` (:func:`~trainstream_hf.losses.sequence_logprobs`).

    Args:
        model: the policy.
        pairs: the pairs' dataset (``prompt``, ``chosen``, ``rejected``, ``corruption``), for the per-pair records.
        chosen_rows, rejected_rows: their tokenization (:func:`~trainstream_hf.train.data.tokenize_pairs`).
        beta, loss_type: as :func:`~trainstream_hf.losses.dpo_loss`.

    Returns:
        ``{"loss": mean DPO loss, "reward_accuracy": fraction with chosen reward > rejected reward, "reward_margin":
        mean of the difference, "logp_accuracy": fraction where the policy gives chosen the higher log-probability,
        "by_corruption": {kind: {"pairs", "reward_accuracy", "logp_accuracy"}}, "pairs": per-pair records}``.
    """
    from trainstream_hf.integrations.huggingface import reference_logprobs
    from trainstream_hf.losses import dpo_loss, sequence_logprobs

    def batch(rows):
        b = {k: v.to(device) for k, v in collate(rows, pad_id).items()}
        return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                "labels_mask": (b["labels"] != IGNORE).long()}

    was_training = model.training
    model.eval()
    losses, records = [], []
    for start in range(0, len(chosen_rows), batch_size):
        c, r = batch(chosen_rows[start:start + batch_size]), batch(rejected_rows[start:start + batch_size])
        pc = sequence_logprobs(model, c["input_ids"], c["attention_mask"], c["labels_mask"], chunk_tokens=chunk_tokens)
        pr = sequence_logprobs(model, r["input_ids"], r["attention_mask"], r["labels_mask"], chunk_tokens=chunk_tokens)
        rc, rr = reference_logprobs(model, c, r, chunk_tokens=chunk_tokens)
        loss, reward_c, reward_r = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type)
        losses.append(loss.item() * len(pc))
        for i in range(len(pc)):
            row = pairs[start + i]
            records.append({**{k: row[k] for k in ("prompt", "chosen", "rejected", "corruption")},
                            "logp_chosen": pc[i].item(), "logp_rejected": pr[i].item(),
                            "reward_margin": (reward_c[i] - reward_r[i]).item()})
    model.train(was_training)
    n = max(len(records), 1)

    def rates(rs):
        m = max(len(rs), 1)
        return {"pairs": len(rs), "reward_accuracy": sum(x["reward_margin"] > 0 for x in rs) / m,
                "logp_accuracy": sum(x["logp_chosen"] > x["logp_rejected"] for x in rs) / m}

    kinds = sorted({x["corruption"] for x in records})
    return {"loss": sum(losses) / n, **{k: v for k, v in rates(records).items() if k != "pairs"},
            "reward_margin": sum(x["reward_margin"] for x in records) / n,
            "by_corruption": {k: rates([x for x in records if x["corruption"] == k]) for k in kinds},
            "pairs": records}
