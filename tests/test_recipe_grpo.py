"""recipes/grpo.py end to end on the CPU, in-process, on small overrides of its tiny config."""
import json
from pathlib import Path

import pytest

from trainstream_hf.train.config import ConfigError
from tests.helpers import png_panels, run_script

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ["--config", "configs/grpo-tiny-cpu.yaml"]
# 2 prompts x 8 completions of at most 4 tokens per step
SMALL = ["--train.batch_size", "16", "--train.warmup_steps", "1", "--train.log_every", "2",
         "--grpo.max_completion_length", "4", "--eval.max_new_tokens", "4", "--eval.examples", "16",
         "--eval.batch_size", "16", "--eval.show", "2", "--device", "cpu"]


@pytest.fixture
def grpo(recipe):
    return recipe("grpo")


def test_grpo_trains_through_the_engine_and_writes_the_summary(grpo, tmp_path):
    out = tmp_path / "run"
    summary = grpo(CONFIG + SMALL + ["--train.steps", "4", "--grpo.rewards", "[char_overlap, exact_match]",
                                     "--output_dir", str(out)])
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("recipe", "command", "date", "torch", "transformers", "device", "config", "model", "steps", "heldout",
                "train", "timing", "peak_memory", "trainstream", "predictions_after"):
        assert key in on_disk, key
    assert on_disk["recipe"] == "grpo" and on_disk["steps"] == 4 and on_disk["config"]["grpo"]["num_generations"] == 8
    assert on_disk["command"].startswith("python recipes/grpo.py --config configs/grpo-tiny-cpu.yaml "
                                         "--train.batch_size")
    m = summary["model"]
    assert m["lora_r"] == 8 and m["trainable"] == 4 * 8 * (4 * (128 + 128) + 3 * (128 + 512))
    # Held-out prompts completed greedily and scored by each reward, before and after.
    for when in ("before", "after"):
        h = summary["heldout"][when]
        assert set(h["rewards"]) == {"char_overlap", "exact_match"} and h["total"] == 16
        assert all(0.0 <= v <= 1.0 for v in h["rewards"].values())
        assert h["rewards"]["exact_match"] == h["exact_match"]
    assert len(summary["predictions_after"]) == 2
    # TRL's logged figures, per log: the mean sampled reward (the sum of the two rewards), each reward, the KL term.
    curves = summary["train"]["curves"]
    assert [s for s, _ in curves["reward"]] == [1, 2, 4]
    for (_, total), (_, overlap), (_, exact) in zip(curves["reward"], curves["rewards/char_overlap/mean"],
                                                   curves["rewards/exact_match/mean"]):
        assert total == pytest.approx(overlap + exact) and 0.0 < overlap < 1.0
    assert curves["kl"][0][1] == 0.0 and curves["kl"][-1][1] > 0  # the policy left its reference (adapters off)
    assert all(0 < length <= 4 for _, length in curves["completions/mean_length"])
    # The engine ran for every step; each step's forward passes: the prompt, the generated tokens, the reference's
    # and the policy's.
    ts = summary["trainstream"]
    assert ts["plan"]["paged_blocks"] == [0, 1, 2, 3] == ts["plan"]["offloaded_activation_blocks"]
    assert ts["steps_measured"] == 4  # every optimizer step, generation and reference pass included
    assert ts["h2d_bytes_per_step"] > 0 and ts["d2h_bytes_per_step"] > 0
    t = summary["timing"]
    assert t["median_step_seconds"] > 0 and t["tokens_per_second"] > 0 and summary["peak_memory"]["bytes"] > 0
    assert png_panels(out, on_disk) == 3  # loss, rewards, the engine's GB/s


def test_engine_samples_and_scores_as_the_plain_trainer(grpo, tmp_path):
    """Same seeded samples, rewards and (to float rounding) losses with the engine as without it (wrap=false)."""
    args = CONFIG + SMALL + ["--train.steps", "3", "--train.log_every", "1", "--eval.enabled", "false"]
    ts = grpo(args + ["--output_dir", str(tmp_path / "ts")])
    plain = grpo(args + ["--output_dir", str(tmp_path / "plain"), "--wrap", "false"])
    assert plain["trainstream"] is None and ts["trainstream"]["steps_measured"] == 3
    assert png_panels(tmp_path / "plain", plain) == 2  # no engine, no GB/s panel
    assert ts["heldout"] is None and ts["predictions_after"] == []
    a, b = ts["train"]["curves"], plain["train"]["curves"]
    assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
    for key in ("loss", "kl"):
        assert [s for s, _ in a[key]] == [1, 2, 3]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a[key], b[key])), key
    # Sampling through TrainStreamCache, half the layers' K/V in host pages: the same samples (exact on the CPU).
    paged = grpo(args + ["--output_dir", str(tmp_path / "paged"), "--grpo.generation_cache", "0.5"])
    c = paged["train"]["curves"]
    assert paged["config"]["grpo"]["generation_cache"] == 0.5
    assert c["reward"] == a["reward"] and c["completions/mean_length"] == a["completions/mean_length"]


def test_stock_trl_baseline_samples_as_trainstream_and_times_generation(grpo, tmp_path):
    """trainer 'trl': stock TRL GRPOTrainer with PEFT (no engine), the issue's baseline: the same seeded samples and
    rewards as through trainstream; each step's generate() time is reported beside the rest of the step."""
    args = CONFIG + SMALL + ["--train.steps", "2", "--train.log_every", "1", "--eval.enabled", "false"]
    ts = grpo(args + ["--output_dir", str(tmp_path / "ts")])
    stock = grpo(args + ["--output_dir", str(tmp_path / "stock"), "--trainer", "trl"])
    assert stock["trainer"] == "trl" and ts["trainer"] == "trainstream" and stock["trainstream"] is None
    assert stock["model"]["quantize"] is None
    a, b = ts["train"]["curves"], stock["train"]["curves"]
    assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
    for run in (ts, stock):
        t = run["timing"]
        assert 0 < t["median_generation_seconds"] < t["median_step_seconds"]
        assert t["median_train_seconds"] > 0
        # every step's figures too (a compiled decode step's first one holds its compilation)
        assert len(t["step_seconds"]) == len(t["generation_seconds"]) == 2
        assert all(0 < g < s for g, s in zip(t["generation_seconds"], t["step_seconds"]))
    # TRL's own generation path only: trainstream's paged cache is refused, as is a bitsandbytes base on the CPU
    with pytest.raises(ConfigError, match="grpo.generation_cache=0.5 samples through trainstream's TrainStreamCache"):
        grpo(args + ["--output_dir", str(tmp_path / "x"), "--trainer", "trl", "--grpo.generation_cache", "0.5"])
    with pytest.raises(ConfigError, match="trainer='trl_bnb': bitsandbytes' NF4 layers run on CUDA"):
        grpo(args + ["--output_dir", str(tmp_path / "y"), "--trainer", "trl_bnb"])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_full_fine_tune_without_kl(grpo, tmp_path):
    """lora.r null trains every parameter, which TRL allows without a reference: grpo.beta 0."""
    summary = grpo(CONFIG + SMALL + ["--train.steps", "2", "--lora.r", "null", "--grpo.beta", "0",
                                     "--eval.enabled", "false", "--output_dir", str(tmp_path / "run")])
    m = summary["model"]
    assert m["lora_r"] is None and m["trainable"] == m["parameters"]
    assert "kl" not in summary["train"]["last"] and summary["steps"] == 2


@pytest.mark.parametrize("args, error, match", [
    (["--grpo.rewards", "[bleu]"], ConfigError,
     r"grpo\.rewards\[0\]: expected 'char_overlap' \| 'char_position' \| 'exact_match', got 'bleu'"),
    (["--grpo.rewards", "exact_match"], ConfigError, r"grpo\.rewards: expected a list"),
    (["--grpo.rewards", "[]"], ConfigError, r"grpo: rewards: at least one of 'char_overlap'"),
    (["--grpo.loss_type", "ppo"], ConfigError,
     r"grpo\.loss_type: expected 'grpo' \| 'dapo' \| 'dr_grpo' \| 'bnpo', got 'ppo'"),
    (["--grpo.scale_rewards", "true"], ConfigError, r"grpo\.scale_rewards: expected 'group' \| 'batch' \| 'none'"),
    (["--grpo.num_generations", "1"], ConfigError, r"grpo: num_generations: at least 2"),
    (["--grpo.temperature", "0"], ConfigError, r"grpo: temperature: must be > 0"),
    (["--train.batch_size", "12"], ConfigError,
     r"train\.batch_size=12 must be a multiple of grpo\.num_generations=8"),
    (["--lora.r", "null"], ConfigError, r"grpo\.beta=0\.04 needs a reference.*set lora\.r .*or grpo\.beta 0"),
    (["--data.max_length", "16"], ConfigError,
     r"data\.max_length: prompt \d+ has 14 tokens, plus grpo\.max_completion_length=8 is 22 > 16"),
    (["--eval.max_new_tokens", "30"], ConfigError, r"plus eval\.max_new_tokens=30 is \d+ > 32"),
    (["--data.train_file", "nope.jsonl"], FileNotFoundError, r"data\.train_file: no such file 'nope\.jsonl'"),
    (["--device", "cuda:1"], ConfigError, r"device='cuda:1'"),
    (["--grpo.compiled_generation", "true", "--trainer", "trl"], ConfigError,
     r"grpo\.compiled_generation is trainstream's trainer's"),
])
def test_bad_input_is_named_and_nothing_is_written(grpo, tmp_path, args, error, match):
    out = tmp_path / "run"
    with pytest.raises(error, match=match):
        grpo(CONFIG + ["--device", "cpu"] + args + ["--output_dir", str(out)])
    assert not out.exists()


def test_command_line_errors_are_one_line(tmp_path):
    out = tmp_path / "run"
    r = run_script("recipes/grpo.py", *CONFIG, "--train.batch_size", "20", "--output_dir", str(out), cwd=ROOT,
                   logs=tmp_path / "logs")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "recipes/grpo.py: error: train.batch_size=20 must be a multiple of grpo.num_generations=8 (completions per "
        "step = prompts x completions per prompt)")
    assert not out.exists()
