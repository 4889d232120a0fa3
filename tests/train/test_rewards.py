"""trainstream_hf.train.rewards: the grpo recipe's reward functions, and the names the schema accepts."""
import typing

import pytest

from trainstream_hf.train import rewards
from trainstream_hf.train.schema import REWARDS, GRPOArgs


def test_schema_names_every_reward():
    hint = typing.get_type_hints(GRPOArgs)["rewards"]
    assert typing.get_args(typing.get_args(hint)[0]) == REWARDS == tuple(rewards.SCORES)


@pytest.mark.parametrize("completion, answer, overlap, position, exact", [
    ("abc", "abc", 1.0, 1.0, 1.0),
    (" abc\n", "abc", 1.0, 1.0, 1.0),  # surrounding whitespace ignored
    ("cba", "abc", 1.0, 1 / 3, 0.0),  # the same letters in another order
    ("abcd", "abc", 6 / 7, 3 / 4, 0.0),  # one extra letter
    ("aab", "abb", 2 * 2 / 6, 2 / 3, 0.0),  # counted with multiplicity: a, b shared once each
    ("xyz", "abc", 0.0, 0.0, 0.0),
    ("", "abc", 0.0, 0.0, 0.0),
    ("ABC", "abc", 0.0, 0.0, 0.0),  # case matters
])
def test_scores(completion, answer, overlap, position, exact):
    assert rewards.char_overlap(completion, answer) == pytest.approx(overlap)
    assert rewards.char_position(completion, answer) == pytest.approx(position)
    assert rewards.exact_match(completion, answer) == exact


def test_scores_are_one_exactly_at_equality():
    import random

    rng = random.Random(0)
    for _ in range(200):
        a = "".join(rng.choice("abcAB") for _ in range(rng.randint(1, 6)))
        c = "".join(rng.choice("abcAB") for _ in range(rng.randint(0, 6)))
        for name, score in rewards.SCORES.items():
            v = score(c, a)
            assert 0.0 <= v <= 1.0, name
            assert (v == 1.0) == (c == a) or name == "char_overlap", name  # overlap ignores order
        assert (rewards.char_overlap(c, a) == 1.0) == (sorted(c) == sorted(a))


def test_reward_functions_as_trl_calls_them():
    """TRL 1.16 calls f(prompts=..., completions=..., completion_ids=..., <dataset columns>..., trainer_state=...)
    and logs rewards/<f.__name__>/mean."""
    fs = rewards.reward_functions(["exact_match", "char_overlap"])
    assert [f.__name__ for f in fs] == ["exact_match", "char_overlap"]
    kwargs = dict(prompts=["rev(ab)=", "up(ab)="], completions=["ba", "Ab"], completion_ids=[[1], [2]],
                  answer=["ba", "AB"], trainer_state=None)
    assert fs[0](**kwargs) == [1.0, 0.0]
    assert fs[1](**kwargs) == [1.0, 0.5]
    assert rewards.mean_scores(["exact_match", "char_position"], ["ba", "Ab"], ["ba", "AB"]) == \
        {"exact_match": 0.5, "char_position": 0.75}
