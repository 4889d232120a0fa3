"""Rewards of a completion against the prompt's reference answer, for the grpo recipe and its evaluation.

Each score maps (completion, answer) to [0, 1], and is 1 exactly when the two are equal (surrounding whitespace
ignored):

* ``char_overlap``: the F1 of the characters the two share, counted with multiplicity, in any order
  (``2 |C & A| / (|C| + |A|)`` over multisets). Dense: a completion that has some of the answer's letters scores.
* ``char_position``: the positions where they hold the same character, over the longer length. Order matters.
* ``exact_match``: 1 if equal, else 0.

:func:`reward_functions` gives them in the form TRL 1.16's ``GRPOTrainer`` calls (``completions`` plus the dataset's
``answer`` column, one float per completion), named so that TRL logs ``rewards/<name>/mean``.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

__all__ = ["char_overlap", "char_position", "exact_match", "SCORES", "reward_functions", "mean_scores"]


def char_overlap(completion: str, answer: str) -> float:
    """``2 |C & A| / (|C| + |A|)`` for the character multisets C, A of the two strings (0 when both are empty)."""
    c, a = completion.strip(), answer.strip()
    if not c and not a:
        return 1.0
    shared = sum((Counter(c) & Counter(a)).values())
    return 2 * shared / (len(c) + len(a))


def char_position(completion: str, answer: str) -> float:
    """The number of positions i with ``completion[i] == answer[i]``, over the longer of the two lengths."""
    c, a = completion.strip(), answer.strip()
    if not c and not a:
        return 1.0
    return sum(x == y for x, y in zip(c, a)) / max(len(c), len(a))


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the two are equal after stripping surrounding whitespace, else 0.0."""
    return float(completion.strip() == answer.strip())


# name -> score; the names are schema.REWARDS.
SCORES: dict[str, Callable[[str, str], float]] = {
    "char_overlap": char_overlap, "char_position": char_position, "exact_match": exact_match}


def reward_functions(names: list[str]) -> list[Callable[..., list[float]]]:
    """TRL reward functions for ``names`` (keys of :data:`SCORES`): ``f(completions, answer, **kwargs)`` -> one
    float per completion, ``__name__`` = the name."""
    def make(name: str):
        score = SCORES[name]

        def reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
            return [score(c, a) for c, a in zip(completions, answer)]

        reward.__name__ = name
        return reward

    return [make(n) for n in names]


def mean_scores(names: list[str], completions: list[str], answers: list[str]) -> dict[str, float]:
    """``{name: mean score over the pairs}`` for each of ``names``."""
    n = max(len(answers), 1)
    return {name: sum(SCORES[name](c, a) for c, a in zip(completions, answers)) / n for name in names}
