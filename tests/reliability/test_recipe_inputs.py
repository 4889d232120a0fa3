"""The recipes' inputs fail loudly and early: a broken data file, an output directory that cannot be written and a
run with no --config each give one line saying what is wrong and what to do, before any model is built."""
import os
from pathlib import Path

import pytest

from trainstream_hf.train import report
from trainstream_hf.train.config import ConfigError
from tests.helpers import run_script

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"sft": "configs/sft-tiny-cpu.yaml", "dpo": "configs/dpo-tiny-cpu.yaml", "grpo": "configs/grpo-tiny-cpu.yaml"}
FORMAT = r'one JSON object per line with "prompt" and "completion" strings'
GOOD = '{"prompt": "rev(abc)=", "completion": "cba"}\n'


def _fails(recipe, name, tmp_path, *args):
    """Runs recipe ``name`` on its tiny config with ``args``; returns the ConfigError it raises (there must be one, and
    no output directory)."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        recipe(name)(["--config", CONFIGS[name], "--device", "cpu", "--output_dir", str(out), *args])
    assert not out.exists()
    assert "\n" not in str(info.value)
    return str(info.value)


def _jsonl(tmp_path, text: str, name: str = "examples.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
@pytest.mark.parametrize("option", ["data.train_file", "data.test_file"])
def test_malformed_line_names_file_line_and_format(recipe, tmp_path, name, option):
    path = _jsonl(tmp_path, GOOD * 2 + '{"prompt": "rev(abc)=", "completion": }\n' + GOOD)
    message = _fails(recipe, name, tmp_path, f"--{option}", str(path))
    assert message.startswith(f"{option}: ")
    assert f"{str(path)!r} line 3 is not valid JSON" in message and FORMAT in message


def test_line_that_is_not_an_object_is_named(recipe, tmp_path):
    path = _jsonl(tmp_path, GOOD + '["rev(abc)=", "cba"]\n')
    message = _fails(recipe, "sft", tmp_path, "--data.train_file", str(path))
    assert f"{str(path)!r} line 2 is a JSON array, not an object" in message and FORMAT in message


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_row_missing_a_field_is_named(recipe, tmp_path, name):
    path = _jsonl(tmp_path, GOOD * 3 + '{"prompt": "rev(abc)="}\n' + GOOD)
    message = _fails(recipe, name, tmp_path, "--data.train_file", str(path))
    assert f"{str(path)!r} line 4 has no \"completion\"" in message and FORMAT in message


def test_preference_pairs_are_named_as_such(recipe, tmp_path):
    path = _jsonl(tmp_path, '{"prompt": "rev(abc)=", "chosen": "cba", "rejected": "abc"}\n')
    message = _fails(recipe, "dpo", tmp_path, "--data.train_file", str(path))
    assert "has no \"completion\"" in message and "train on yours with TrainStreamDPOTrainer" in message


def test_conversational_rows_are_named_as_such(recipe, tmp_path):
    path = _jsonl(tmp_path, '{"messages": [{"role": "user", "content": "rev(abc)="}, '
                            '{"role": "assistant", "content": "cba"}]}\n')
    message = _fails(recipe, "sft", tmp_path, "--data.train_file", str(path))
    assert 'has no "prompt" or "completion" (its keys: messages)' in message and "chat template" in message


def test_field_that_is_not_a_string_is_named(recipe, tmp_path):
    path = _jsonl(tmp_path, GOOD + '{"prompt": "rev(abc)=", "completion": 17}\n')
    message = _fails(recipe, "sft", tmp_path, "--data.train_file", str(path))
    assert f"{str(path)!r} line 2: \"completion\" is a number, not a string" in message and FORMAT in message


def test_empty_file_is_named(recipe, tmp_path):
    path = _jsonl(tmp_path, "")
    message = _fails(recipe, "sft", tmp_path, "--data.train_file", str(path))
    assert message == f"data.train_file: {str(path)!r} is empty; expected " + FORMAT + ", e.g. " + GOOD.strip()


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_blank_file_is_named(recipe, tmp_path, name):
    path = _jsonl(tmp_path, "\n  \n\t\n")
    message = _fails(recipe, name, tmp_path, "--data.train_file", str(path))
    assert f"data.train_file: {str(path)!r} holds only blank lines (3)" in message and FORMAT in message


def test_missing_file_is_a_config_error_naming_the_format(recipe, tmp_path):
    path = tmp_path / "nope.jsonl"
    message = _fails(recipe, "sft", tmp_path, "--data.test_file", str(path))
    assert message.startswith(f"data.test_file: no such file {str(path)!r}; expected a JSON-lines file: {FORMAT}")


def test_script_without_config_says_which_it_runs_and_a_bad_line_is_one_line(tmp_path):
    """Run as a script with no --config (only overrides, read from sys.argv): the first line on stderr names the demo
    config it runs; a broken data file then ends it with a one-line error (exit status 1), not a datasets traceback,
    before anything is written."""
    path = _jsonl(tmp_path, GOOD + "{oops\n")
    out = tmp_path / "run"
    r = run_script("recipes/sft.py", "--data.train_file", str(path), "--output_dir", str(out), cwd=ROOT,
                   logs=tmp_path / "logs")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines[0] == ("recipes/sft.py: no --config given; running configs/sft-tiny-cpu.yaml (the demo). Pass "
                        "--config <file> to choose another.")
    assert lines[-1].startswith(f"recipes/sft.py: error: data.train_file: {str(path)!r} line 2 is not valid JSON")
    assert not out.exists()


@pytest.mark.parametrize("where", ["/proc/trainstream-out", "/proc/trainstream-out/run"])
def test_unwritable_output_dir_fails_before_training(recipe, tmp_path, where):
    """/proc refuses new files even to root (for whom permission bits do not stop writes): found before the model is
    built, one line naming the path."""
    if not Path("/proc").is_dir():
        pytest.skip("requires /proc (Linux)")
    with pytest.raises(ConfigError, match=rf"output_dir: {where!r} cannot be written"):
        report.check_output_dir(where)
    with pytest.raises(ConfigError, match=rf"output_dir: {where!r} cannot be written .*; pass --output_dir"):
        # With the check broken this trains one step and fails only when writing the summary.
        recipe("sft")(["--config", CONFIGS["sft"], "--device", "cpu", "--output_dir", where, "--train.steps", "1",
                       "--eval.enabled", "false"])


def test_read_only_output_dir_is_found_as_whoever_runs(recipe, tmp_path):
    """A directory without write permission: refused before the model is built for a normal user; root writes through
    permission bits, so for root the check passes (it really can write there) and leaves the directory as it was."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.geteuid() == 0:
            report.check_output_dir(str(ro / "run"))
            assert not any(ro.iterdir())
        else:
            with pytest.raises(ConfigError, match=rf"output_dir: {str(ro / 'run')!r} cannot be written .*Permission"):
                recipe("sft")(["--config", CONFIGS["sft"], "--device", "cpu", "--output_dir", str(ro / "run")])
            assert not any(ro.iterdir())
    finally:
        ro.chmod(0o755)


def test_output_dir_check_leaves_nothing_behind(tmp_path):
    """The probe proves the directory writable and is gone afterwards, and so is any directory made for it."""
    (tmp_path / "kept").mkdir()
    report.check_output_dir(str(tmp_path / "kept"))
    report.check_output_dir(str(tmp_path / "new" / "run"))
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and not any((tmp_path / "kept").iterdir())


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_no_config_says_which_it_runs(recipe, monkeypatch, capsys, name):
    """No arguments at all: the recipe says which config it runs (its demo) before it starts, then runs it. Stopped
    at the output check, before anything is built."""
    seen = []

    def stop(output_dir):
        seen.append(output_dir)
        raise ConfigError("stopped")

    monkeypatch.setattr(report, "check_output_dir", stop)
    with pytest.raises(ConfigError, match="stopped"):
        recipe(name)([])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"recipes/{name}.py: no --config given; running {CONFIGS[name]} (the demo). Pass --config <file> "
                   "to choose another."]
    assert seen == [f"build/{'demo' if name == 'sft' else name}"]  # the demo config's, not the built-in default
