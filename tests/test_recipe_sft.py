"""recipes/sft.py end to end on the CPU, in-process, on small overrides of the demo config."""
import importlib.util
import json
import os
from pathlib import Path

import pytest

from trainstream_hf.train.config import ConfigError
from tests.helpers import png_panels, run_script

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ["--config", "configs/sft-tiny-cpu.yaml"]
SMALL = ["--train.batch_size", "16", "--train.warmup_steps", "2", "--train.log_every", "5", "--eval.examples", "24",
         "--eval.batch_size", "24", "--eval.show", "2", "--device", "cpu"]


@pytest.fixture
def sft(recipe):
    return recipe("sft")


def test_sft_trains_through_the_engine_and_writes_the_summary(sft, tmp_path):
    out = tmp_path / "run"
    summary = sft(CONFIG + SMALL + ["--train.steps", "25", "--output_dir", str(out)])
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("command", "date", "torch", "transformers", "device", "config", "model", "steps", "loss",
                "exact_match", "train_loss", "timing", "peak_memory", "trainstream", "predictions_after"):
        assert key in on_disk, key
    assert on_disk["command"].startswith("python recipes/sft.py --config configs/sft-tiny-cpu.yaml --train.batch_size")
    assert on_disk["steps"] == 25 and on_disk["config"]["train"]["steps"] == 25 and on_disk["device"] == "cpu"
    # Learning, seeded: held-out loss per completion token starts near ln(vocab) = ln(64) and falls.
    assert 3.5 < summary["loss"]["before"] < 5.0
    assert summary["loss"]["after"] < summary["loss"]["before"] - 0.5
    curve = summary["train_loss"]["curve"]
    assert [s for s, _ in curve] == [5, 10, 15, 20, 25] and curve[-1][1] < curve[0][1] - 0.5
    em = summary["exact_match"]
    assert em["total"] == 24 and 0 <= em["correct_before"] <= 24 and 0.0 <= em["after"] <= 1.0
    assert len(summary["predictions_after"]) == 2
    # The engine really ran: every block paged, every block's activations offloaded, bytes moved both ways.
    ts = summary["trainstream"]
    assert ts["plan"]["paged_blocks"] == [0, 1, 2, 3] == ts["plan"]["offloaded_activation_blocks"]
    assert ts["plan"]["offloaded_optimizer_params"] > 0
    assert ts["h2d_bytes_per_step"] > 0 and ts["d2h_bytes_per_step"] > 0 and ts["steps_measured"] == 25
    assert summary["timing"]["median_step_seconds"] > 0 and summary["peak_memory"]["bytes"] > 0
    assert png_panels(out, on_disk) == 3  # loss, exact match, the engine's GB/s


def test_engine_gives_the_plain_loop_losses(sft, tmp_path):
    """The demo's engine options change where tensors live, not the numbers: same seeded losses as the plain
    model (wrap=false) over a few steps, and the same held-out loss after."""
    args = CONFIG + SMALL + ["--train.steps", "5", "--train.log_every", "1", "--eval.examples", "8"]
    ts = sft(args + ["--output_dir", str(tmp_path / "ts")])
    plain = sft(args + ["--output_dir", str(tmp_path / "plain"), "--wrap", "false", "--save_model", "true"])
    assert plain["trainstream"] is None
    assert png_panels(tmp_path / "plain", plain) == 2  # no engine, no GB/s panel
    assert [s for s, _ in ts["train_loss"]["curve"]] == [1, 2, 3, 4, 5]
    for (_, a), (_, b) in zip(ts["train_loss"]["curve"], plain["train_loss"]["curve"]):
        assert abs(a - b) < 1e-4
    assert abs(ts["loss"]["after"] - plain["loss"]["after"]) < 1e-4
    assert ts["loss"]["before"] == plain["loss"]["before"]
    assert (tmp_path / "plain" / "model" / "config.json").is_file()
    assert (tmp_path / "plain" / "model" / "tokenizer.json").is_file()


def test_bf16_moments_follow_the_exact_loss_curve(sft, tmp_path):
    """trainstream.optimizer_moments bfloat16 (opt-in approximation) against exact AdamW on the demo's engine options:
    the loss curves stay together and both learn (the full demo's figures are in benchmarks/NOTES.md)."""
    args = CONFIG + SMALL + ["--train.steps", "40", "--eval.examples", "24"]
    exact = sft(args + ["--output_dir", str(tmp_path / "exact")])
    approx = sft(args + ["--output_dir", str(tmp_path / "bf16"), "--trainstream.optimizer_moments", "bfloat16"])
    assert approx["config"]["trainstream"]["optimizer_moments"] == "bfloat16"
    a, b = exact["train_loss"]["curve"], approx["train_loss"]["curve"]
    assert [s for s, _ in a] == [s for s, _ in b] and a[-1][1] < a[0][1] - 0.5
    assert a[0][1] == pytest.approx(b[0][1], abs=1e-4)  # before the moments matter
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 0.15
    assert approx["loss"]["after"] == pytest.approx(exact["loss"]["after"], rel=0.1)


def test_stale_optimizer_against_exact_on_the_demo(sft, tmp_path):
    """trainstream.optimizer_staleness 1 (opt-in approximation: the CPU share's update one step late) against exact
    AdamW on the demo's engine options, weights not paged (a paged trainable weight cannot be delayed): the first
    step sees the same weights, from the third the delayed run is behind, and it still learns. It learns more slowly
    than exact on this task (the full demo's curves are in benchmarks/NOTES.md, 2026-12-06 night)."""
    args = CONFIG + SMALL + ["--train.steps", "40", "--train.log_every", "1", "--eval.examples", "24",
                             "--trainstream.page_weights", "false"]
    exact = sft(args + ["--output_dir", str(tmp_path / "exact")])
    stale = sft(args + ["--output_dir", str(tmp_path / "stale"), "--trainstream.optimizer_staleness", "1"])
    assert stale["config"]["trainstream"]["optimizer_staleness"] == 1
    a, b = exact["train_loss"]["curve"], stale["train_loss"]["curve"]
    assert [s for s, _ in a] == [s for s, _ in b] and a[-1][1] < a[0][1] - 0.5 and b[-1][1] < b[0][1] - 0.5
    assert a[0][1] == pytest.approx(b[0][1], abs=1e-5)  # (the second step differs only by the norms' updates)
    assert a[2][1] != pytest.approx(b[2][1], abs=1e-5)  # from the third, the delayed run is one update behind
    assert stale["loss"]["after"] < stale["loss"]["before"] - 0.5


def test_trainer_loop_trains_through_the_engine_and_writes_the_same_summary(sft, tmp_path):
    """loop: trainer runs the steps in transformers' Trainer (TrainStreamTrainer), the engine installed; the summary
    has the plain loop's fields, per-step losses and times, and the engine's figures of every step."""
    out = tmp_path / "run"
    summary = sft(CONFIG + SMALL + ["--loop", "trainer", "--train.steps", "20", "--output_dir", str(out)])
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary)) and on_disk["config"]["loop"] == "trainer"
    # the Trainer wrote nothing of its own there
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "summary.json"]
    assert png_panels(out, on_disk) == 3
    plain_keys = ("command", "date", "config", "model", "steps", "loss", "exact_match", "train_loss", "timing",
                  "peak_memory", "trainstream", "predictions_after")
    assert all(k in on_disk for k in plain_keys)
    assert summary["steps"] == 20 and [s for s, _ in summary["train_loss"]["curve"]] == [5, 10, 15, 20]
    assert summary["train_loss"]["first"] > summary["train_loss"]["last"] + 0.5
    assert 3.5 < summary["loss"]["before"] < 5.0 and summary["loss"]["after"] < summary["loss"]["before"] - 0.5
    assert summary["timing"]["median_step_seconds"] > 0 and summary["timing"]["tokens_per_second"] > 0
    ts = summary["trainstream"]
    assert ts["plan"]["paged_blocks"] == [0, 1, 2, 3] == ts["plan"]["offloaded_activation_blocks"]
    assert ts["h2d_bytes_per_step"] > 0 and ts["d2h_bytes_per_step"] > 0 and ts["steps_measured"] == 20


@pytest.mark.parametrize("schedule", [
    ["--train.scheduler", "constant_with_warmup", "--train.warmup_steps", "0"],
    ["--train.warmup_steps", "2"],  # the schedule reaches the device-resident parameters after prepare's load
])
def test_trainer_loop_gives_the_plain_loop_losses(sft, tmp_path, schedule):
    """The two loops train the same: the Trainer's first epoch draws the batches data.batches draws (a permutation
    from a generator seeded with the seed), its AdamW takes the same hyper-parameters (weight decay 0: it leaves
    norms out of decay), and its clipping (on from the first step) counts the gradients the engine keeps in host RAM
    for paged trainable weights."""
    args = CONFIG + SMALL + ["--train.steps", "5", "--train.log_every", "1", "--eval.examples", "8",
                             "--train.weight_decay", "0"] + schedule
    plain = sft(args + ["--output_dir", str(tmp_path / "plain")])
    trainer = sft(args + ["--output_dir", str(tmp_path / "trainer"), "--loop", "trainer"])
    assert trainer["trainstream"]["plan"]["grads"] == "host"
    for (_, a), (_, b) in zip(plain["train_loss"]["curve"], trainer["train_loss"]["curve"]):
        assert abs(a - b) < 1e-4
    assert abs(plain["loss"]["after"] - trainer["loss"]["after"]) < 1e-4


@pytest.mark.parametrize("args, error, match", [
    (["--loop", "bogus"], ConfigError, r"loop: expected 'plain' \| 'trainer', got 'bogus'"),
    (["--train.step", "5"], ConfigError, r"unknown option train\.step \(did you mean train\.steps\?\)"),
    (["--mixed_precision", "fp16"], ConfigError, r"mixed_precision: expected 'auto' \| 'no' \| 'bf16', got 'fp16'"),
    (["--lora.rank", "8"], ConfigError, r"unknown option lora\.rank; the options of lora are: r, alpha"),
    (["--trainstream.quantize", "nf4"], ConfigError, r"packs the base weights.*set lora\.r"),
    (["--trainstream.quantize", "nf5", "--lora.r", "4"], ConfigError,
     r"quantize: unknown format 'nf5'; choose one of None, 'int8', 'nf4', 'fp8', 'nvfp4'"),
    (["--data.train_file", "nope.jsonl"], FileNotFoundError, r"data\.train_file: no such file 'nope\.jsonl'"),
    (["--data.test_file", "nope.jsonl"], FileNotFoundError, r"data\.test_file: no such file 'nope\.jsonl'"),
    (["--data.tokenizer", "nope"], FileNotFoundError, r"data\.tokenizer: no tokenizer directory 'nope'"),
    (["--data.tokenizer", "configs"], ConfigError, r"data\.tokenizer: 'configs' holds no tokenizer .*save_pretrained"),
    (["--model", "nope/", "--init", "pretrained"], FileNotFoundError, r"model: no such file or directory 'nope/'"),
    (["--model", "configs/models/nope.json"], FileNotFoundError,
     r"model: no such file or directory 'configs/models/nope\.json'"),
    (["--model", "data", "--init", "pretrained"], FileNotFoundError, r"model: 'data' holds no config\.json"),
    (["--train.batch_size", "100", "--data.packing", "true", "--data.max_length", "2048"], ConfigError,
     r"train\.batch_size=100 is larger than the 41 training sequences"),
])
def test_bad_input_is_named_and_nothing_is_written(sft, tmp_path, args, error, match):
    """Each mistake fails before the model is built or trained, with the option's name (and what it accepts), and
    leaves no output directory behind."""
    out = tmp_path / "run"
    with pytest.raises(error, match=match):
        sft(CONFIG + args + ["--output_dir", str(out)])
    assert not out.exists()


def test_a_yaml_typo_is_one_line_naming_the_file_and_place(sft, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps 250\n  lr: 0.01\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: line 3, column 5: not valid YAML"):
        sft(["--config", str(bad), "--output_dir", str(tmp_path / "run")])


def test_unwritable_output_dir_fails_first(sft, tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(NotADirectoryError, match="output_dir: .* exists and is not a directory"):
        sft(CONFIG + ["--data.train_file", "nope.jsonl", "--output_dir", str(tmp_path / "taken")])


def test_command_line_errors_are_one_line(tmp_path):
    """Run as a script, a bad option is a one-line error naming it (exit status 1), not a traceback."""
    out = tmp_path / "run"
    r = run_script("recipes/sft.py", *CONFIG, "--trainstream.grads", "sideways", "--output_dir", str(out), cwd=ROOT,
                   logs=tmp_path / "logs")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("recipes/sft.py: error: trainstream: grads: 'auto', 'device' or "
                                                  "'host', got 'sideways'")
    assert not out.exists()


def test_lora_over_a_quantized_base_packed_sequences_bf16(sft, tmp_path, monkeypatch):
    """The benchmark configs' path on the tiny model: random base packed as nf4 while built, LoRA r=4, 64-token
    packed sequences, no evaluation, bf16 autocast taken from accelerate launch's variable; the engine runs and
    only the adapters train."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    out = tmp_path / "run"
    summary = sft(CONFIG + ["--device", "cpu", "--lora.r", "4", "--lora.alpha", "8", "--trainstream.quantize", "nf4",
                            "--data.packing", "true", "--data.max_length", "64", "--train.batch_size", "2",
                            "--train.steps", "4", "--train.log_every", "1", "--train.lr", "0.01",
                            "--eval.enabled", "false", "--output_dir", str(out)])
    assert summary["mixed_precision"] == "bf16" and summary["loss"] is None and summary["exact_match"] is None
    m = summary["model"]
    assert m["quantize"] == "nf4" and m["lora_r"] == 4 and m["parameters"] > 1_057_920  # base + adapters
    assert m["trainable"] == 4 * 4 * (4 * (128 + 128) + 3 * (128 + 512))  # layers x r x (q k v o, gate up down)
    assert summary["timing"]["tokens_per_second"] > 0
    ts = summary["trainstream"]
    assert ts["plan"]["paged_blocks"] == [0, 1, 2, 3] and ts["steps_measured"] == 4
    losses = [loss for _, loss in summary["train_loss"]["curve"]]
    assert len(losses) == 4 and all(3.0 < x < 5.5 for x in losses)
    assert json.loads((out / "summary.json").read_text())["model"]["quantize"] == "nf4"


def test_shipped_data_is_what_the_generator_makes(tmp_path):
    """data/make_data.py is seeded: rerunning it reproduces the committed splits byte for byte, and a tokenizer
    with the same vocabulary and encodings (its files' bytes may vary with the tokenizers version)."""
    from trainstream_hf.train.data import load_tokenizer

    spec = importlib.util.spec_from_file_location("make_data", ROOT / "data" / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path)])
    for rel in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / rel).read_bytes() == (ROOT / "data" / rel).read_bytes(), rel
    new, old = load_tokenizer(str(tmp_path / "tokenizer")), load_tokenizer(str(ROOT / "data" / "tokenizer"))
    assert new.get_vocab() == old.get_vocab() and len(old) == 59
    text = "sort(qzx)=qxzup(ab)=AB"
    ids = old(text)["input_ids"]
    assert new(text)["input_ids"] == ids == [old.bos_token_id] + [old.get_vocab()[c] for c in text]
    assert old.decode(ids, skip_special_tokens=True) == text
    assert old("a b")["input_ids"][2] == old.unk_token_id  # one token per character; unknown ones -> <unk>


def test_held_out_words_never_occur_in_training():
    def words(name):
        rows = [json.loads(line) for line in (ROOT / "data" / name).read_text().splitlines()]
        return {r["prompt"].split("(", 1)[1].rstrip(")=") for r in rows}, rows

    train, train_rows = words("train.jsonl")
    test, test_rows = words("test.jsonl")
    assert not train & test and len(test) >= 50 and len(test_rows) == 300
    assert len({r["prompt"] for r in train_rows}) == len(train_rows)  # no duplicate examples
    ops = {r["prompt"].split("(", 1)[0] for r in test_rows}
    assert ops == {"rev", "sort", "up"}


@pytest.mark.parametrize("loop", ["plain", "trainer"])
def test_two_processes_train_data_parallel(tmp_path, loop):
    """``accelerate launch`` with 2 processes (torchrun underneath, gloo on the CPU): either loop trains a replica
    per process over an nf4 base paged by the engine (the adapters stay on the device: DDP cannot reduce paged
    trainable parameters), DDP around it (built by the plain loop, or by the Trainer's Accelerate after the engine
    went in), the replicas equal at the end; rank 0 alone evaluates and writes the summary,
    which holds both processes' step times and host memory, and the processes share one host copy of the packed
    base (peer: auto). The launch config asks for the multi-GPU launcher and the recipe for the CPU, as in
    tests/integrations/test_accelerate.py."""
    import subprocess
    import sys

    from trainstream_hf.train.processes import cpu_launch_config

    cfg, extra = cpu_launch_config(tmp_path / "two.yaml", 2)
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSTREAM")}
    env.update(extra)
    accelerate = str(Path(sys.executable).parent / "accelerate")
    r = subprocess.run([accelerate, "launch", "--config_file", str(cfg), "recipes/sft.py", *CONFIG, "--device", "cpu",
                        "--loop", loop,
                        "--lora.r", "4", "--lora.alpha", "8", "--trainstream.quantize", "nf4",
                        "--trainstream.peer", "auto", "--trainstream.min_offload_numel", "1000000",
                        "--train.batch_size", "8", "--train.steps", "4",
                        "--train.log_every", "1", "--train.lr", "0.01", "--eval.examples", "8",
                        "--eval.batch_size", "8", "--output_dir", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    summary = json.loads((out / "summary.json").read_text())
    procs = summary["processes"]
    assert procs["world"] == 2 and [p["rank"] for p in procs["per_process"]] == [0, 1]
    assert all(p["device"] == "cpu" and p["median_step_seconds"] > 0 for p in procs["per_process"])
    shared = [p["host_shared_bytes"] for p in procs["per_process"]]
    assert shared[0] == shared[1] > 0  # one copy of the packed nf4 base, mapped by both
    sums = [p["trainable_checksum"] for p in procs["per_process"]]
    assert sums[0] == sums[1] != 0.0  # DDP kept the replicas identical
    assert procs["host_pss_bytes"] == sum(p["pss_bytes"] for p in procs["per_process"]) > 0
    losses = [loss for _, loss in summary["train_loss"]["curve"]]
    assert len(losses) == 4 and all(3.0 < x < 5.5 for x in losses)
    assert summary["exact_match"]["total"] == 8 and summary["loss"]["after"] < summary["loss"]["before"]
    assert "2 processes (data parallel" in r.stdout + r.stderr
    assert png_panels(out, summary) == 3  # written once, by rank 0
