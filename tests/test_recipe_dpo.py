"""recipes/dpo.py end to end on the CPU, in-process, on small overrides of its tiny config."""
import json
import math
from pathlib import Path

import pytest

from trainstream_hf.train.config import ConfigError
from tests.helpers import png_panels, run_script

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ["--config", "configs/dpo-tiny-cpu.yaml"]
SMALL = ["--train.batch_size", "8", "--train.warmup_steps", "2", "--train.log_every", "2", "--eval.examples", "24",
         "--eval.batch_size", "24", "--eval.show", "2", "--device", "cpu"]


@pytest.fixture
def dpo(recipe):
    return recipe("dpo")


def test_dpo_trains_through_the_engine_and_writes_the_summary(dpo, tmp_path):
    out = tmp_path / "run"
    summary = dpo(CONFIG + SMALL + ["--train.steps", "6", "--output_dir", str(out)])
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("recipe", "command", "date", "torch", "transformers", "device", "config", "model", "steps", "pairs",
                "heldout", "train", "timing", "peak_memory", "trainstream", "pairs_after"):
        assert key in on_disk, key
    assert on_disk["recipe"] == "dpo" and on_disk["steps"] == 6 and on_disk["config"]["train"]["steps"] == 6
    assert on_disk["command"].startswith("python recipes/dpo.py --config configs/dpo-tiny-cpu.yaml --train.batch_size")
    assert on_disk["pairs"] == {"train": 5000, "heldout": 24}
    # LoRA r=8 on every linear layer of the 4 blocks; only the adapters train.
    m = summary["model"]
    assert m["lora_r"] == 8 and m["trainable"] == 4 * 8 * (4 * (128 + 128) + 3 * (128 + 512))
    assert m["parameters"] > 1_000_000 + m["trainable"]
    # Before training the policy is its reference (LoRA B = 0): no margin, DPO loss ln 2, no pair ranked right.
    before, after = summary["heldout"]["before"], summary["heldout"]["after"]
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-6) and before["reward_margin"] == 0.0
    assert before["reward_accuracy"] == 0.0 and 0.0 <= before["logp_accuracy"] <= 1.0
    assert set(before["by_corruption"]) <= {"swap", "substitute", "drop", "repeat"}
    assert sum(v["pairs"] for v in before["by_corruption"].values()) == 24
    # Six steps move the objective on held-out pairs (seeded).
    assert after["loss"] < before["loss"] - 0.01 and after["reward_margin"] > 0.02 and after["reward_accuracy"] > 0.5
    curves = summary["train"]["curves"]
    assert [s for s, _ in curves["loss"]] == [1, 2, 4, 6]
    assert curves["loss"][0][1] == pytest.approx(math.log(2), abs=1e-5) and curves["loss"][-1][1] < math.log(2)
    assert summary["train"]["last"]["rewards/margins"] > 0
    assert len(summary["pairs_after"]) == 2
    assert {"chosen", "rejected", "reward_margin"} <= set(summary["pairs_after"][0])
    # The engine ran for every step: all blocks paged and offloaded, bytes both ways, two forward passes per step
    # (the reference's, the policy's).
    ts = summary["trainstream"]
    assert ts["plan"]["paged_blocks"] == [0, 1, 2, 3] == ts["plan"]["offloaded_activation_blocks"]
    assert ts["steps_measured"] == 6  # every optimizer step, its reference pass included
    assert ts["h2d_bytes_per_step"] > 0 and ts["d2h_bytes_per_step"] > 0
    t = summary["timing"]
    assert t["median_step_seconds"] > 0 and t["tokens_per_second"] > 0 and summary["peak_memory"]["bytes"] > 0
    assert png_panels(out, on_disk) == 3  # loss, reward accuracy, the engine's GB/s


def test_engine_gives_the_plain_trainer_figures(dpo, tmp_path):
    """The engine changes where tensors live, not the numbers: TRL's logged loss and margins over a few steps and
    the held-out figures after match the plain model's (wrap=false)."""
    args = CONFIG + SMALL + ["--train.steps", "3", "--train.log_every", "1", "--eval.examples", "8"]
    ts = dpo(args + ["--output_dir", str(tmp_path / "ts")])
    plain = dpo(args + ["--output_dir", str(tmp_path / "plain"), "--wrap", "false", "--save_model", "true"])
    assert plain["trainstream"] is None and ts["trainstream"]["steps_measured"] == 3
    assert png_panels(tmp_path / "plain", plain) == 2  # no engine, no GB/s panel
    for key in ("loss", "rewards/margins", "logps/chosen"):
        a, b = ts["train"]["curves"][key], plain["train"]["curves"][key]
        assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b)), key
    assert ts["heldout"]["after"]["loss"] == pytest.approx(plain["heldout"]["after"]["loss"], abs=1e-5)
    assert ts["heldout"]["after"]["reward_margin"] != 0.0
    assert (tmp_path / "plain" / "model" / "adapter_config.json").is_file()  # save_model: the adapters
    assert (tmp_path / "plain" / "model" / "tokenizer.json").is_file()


def test_stock_trl_baseline_gives_the_same_figures(dpo, tmp_path):
    """trainer 'trl': stock TRL DPOTrainer with PEFT and ref_model None (the issue's baseline, here over the bf16 base):
    TRL's logged loss and margins as through trainstream."""
    args = CONFIG + SMALL + ["--train.steps", "2", "--train.log_every", "1", "--eval.enabled", "false"]
    ts = dpo(args + ["--output_dir", str(tmp_path / "ts")])
    stock = dpo(args + ["--output_dir", str(tmp_path / "stock"), "--trainer", "trl"])
    assert stock["trainer"] == "trl" and stock["trainstream"] is None and ts["trainstream"]["steps_measured"] == 2
    for key in ("loss", "rewards/margins"):
        a, b = ts["train"]["curves"][key], stock["train"]["curves"][key]
        assert [s for s, _ in a] == [s for s, _ in b] == [1, 2]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b)), key
    assert "median_generation_seconds" not in stock["timing"]  # DPO samples nothing
    assert "generation_seconds" not in stock["timing"] and len(stock["timing"]["step_seconds"]) == 2


@pytest.mark.parametrize("args, error, match", [
    (["--dpo.corruptions", "[swap, flip]"], ConfigError,
     r"dpo\.corruptions\[1\]: expected 'swap' \| 'substitute' \| 'drop' \| 'repeat', got 'flip'"),
    (["--dpo.corruptions", "[]"], ConfigError, r"dpo: corruptions: at least one of 'swap', 'substitute'"),
    (["--dpo.corruptions", "[drop, drop]"], ConfigError, r"dpo: corruptions: each of .* at most once"),
    (["--dpo.loss_type", "ipo"], ConfigError, r"dpo\.loss_type: expected 'sigmoid' \| 'hinge', got 'ipo'"),
    (["--dpo.beta", "0"], ConfigError, r"dpo: beta: must be > 0, got 0"),
    (["--dpo.betta", "0.1"], ConfigError, r"unknown option dpo\.betta \(did you mean dpo\.beta\?\)"),
    (["--lora.r", "null"], ConfigError, r"lora\.r: null would train every parameter.*set lora\.r"),
    (["--data.packing", "true"], ConfigError, r"unknown option data\.packing; the options of data are: train_file"),
    (["--eval.max_new_tokens", "8"], ConfigError, r"unknown option eval\.max_new_tokens; the options of eval are"),
    (["--data.max_length", "12"], ConfigError, r"data\.max_length: example \d+ has \d+ tokens > 12"),
    (["--data.train_file", "nope.jsonl"], FileNotFoundError, r"data\.train_file: no such file 'nope\.jsonl'"),
    (["--data.test_file", "nope.jsonl"], FileNotFoundError, r"data\.test_file: no such file 'nope\.jsonl'"),
    (["--data.tokenizer", "nope"], FileNotFoundError, r"data\.tokenizer: no tokenizer directory 'nope'"),
    (["--model", "configs/models/nope.json"], FileNotFoundError, r"model: no such file or directory"),
])
def test_bad_input_is_named_and_nothing_is_written(dpo, tmp_path, args, error, match):
    out = tmp_path / "run"
    with pytest.raises(error, match=match):
        dpo(CONFIG + ["--device", "cpu"] + args + ["--output_dir", str(out)])
    assert not out.exists()


def test_help_lists_the_dpo_options(dpo, capsys):
    with pytest.raises(SystemExit) as e:
        dpo(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("Direct preference optimisation")
    for option in ("--dpo.beta  (float; default 0.1)", "--dpo.corruptions  (a list ['swap' | 'substitute' |",
                   "--lora.r  (int or null; default 8)", "--trainstream.page_weights", "--eval.show"):
        assert option in text, option


def test_command_line_errors_are_one_line(tmp_path):
    out = tmp_path / "run"
    r = run_script("recipes/dpo.py", *CONFIG, "--dpo.loss_type", "ipo", "--output_dir", str(out), cwd=ROOT,
                   logs=tmp_path / "logs")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("recipes/dpo.py: error: dpo.loss_type: expected 'sigmoid' | 'hinge', "
                                                  "got 'ipo'")
    assert not out.exists()
