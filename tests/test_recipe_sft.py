"""recipes/sft.py end to end on the CPU, in-process, on small overrides of the demo config."""
import importlib.util
import json
from pathlib import Path

import pytest

from trainstream_hf.train.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ["--config", "configs/sft-tiny-cpu.yaml"]
SMALL = ["--train.batch_size", "16", "--train.warmup_steps", "2", "--train.log_every", "5", "--eval.examples", "24",
         "--eval.batch_size", "24", "--eval.show", "2", "--device", "cpu"]


@pytest.fixture
def sft(monkeypatch):
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository root
    spec = importlib.util.spec_from_file_location("recipe_sft", ROOT / "recipes" / "sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


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
    assert ts["h2d_bytes_per_step"] > 0 and ts["d2h_bytes_per_step"] > 0 and ts["steps_measured"] == 24
    assert summary["timing"]["median_step_seconds"] > 0 and summary["peak_memory"]["bytes"] > 0


def test_engine_gives_the_plain_loop_losses(sft, tmp_path):
    """The demo's engine options change where tensors live, not the numbers: same seeded losses as the plain
    model (wrap=false) over a few steps, and the same held-out loss after."""
    args = CONFIG + SMALL + ["--train.steps", "5", "--train.log_every", "1", "--eval.examples", "8"]
    ts = sft(args + ["--output_dir", str(tmp_path / "ts")])
    plain = sft(args + ["--output_dir", str(tmp_path / "plain"), "--wrap", "false", "--save_model", "true"])
    assert plain["trainstream"] is None
    assert [s for s, _ in ts["train_loss"]["curve"]] == [1, 2, 3, 4, 5]
    for (_, a), (_, b) in zip(ts["train_loss"]["curve"], plain["train_loss"]["curve"]):
        assert abs(a - b) < 1e-4
    assert abs(ts["loss"]["after"] - plain["loss"]["after"]) < 1e-4
    assert ts["loss"]["before"] == plain["loss"]["before"]
    assert (tmp_path / "plain" / "model" / "config.json").is_file()
    assert (tmp_path / "plain" / "model" / "tokenizer.json").is_file()


def test_bad_input_is_named_before_training(sft, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown option train\.step \(did you mean train\.steps\?\)"):
        sft(CONFIG + ["--train.step", "5"])
    with pytest.raises(FileNotFoundError, match=r"data\.train_file: no such file 'nope\.jsonl'"):
        sft(CONFIG + ["--data.train_file", "nope.jsonl", "--output_dir", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match=r"model: no such file or directory 'nope/'"):
        sft(CONFIG + ["--model", "nope/", "--init", "pretrained", "--output_dir", str(tmp_path)])
    assert not (tmp_path / "summary.json").exists()


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
