"""The user-facing classes at the top level, loaded only when asked for (issue: `from trainstream_hf import
TrainStreamQuantizationConfig` was an AttributeError)."""
import subprocess
import sys

import pytest

import trainstream_hf

NAMES = ["TrainStreamQuantizationConfig", "TrainStreamTrainer", "TrainStreamTrainingArguments", "TrainStreamCallback",
         "TrainStreamAccelerator", "TrainStreamCache", "PagedKVCache", "TrainStreamDPOTrainer", "TrainStreamDPOConfig",
         "TrainStreamGRPOTrainer", "TrainStreamGRPOConfig"]


@pytest.mark.parametrize("name", NAMES)
def test_importable_from_the_top_level(name):
    cls = getattr(trainstream_hf, name)
    assert cls.__name__ in (name, "PagedKVCache") and name in trainstream_hf.__all__ and name in dir(trainstream_hf)


def test_import_stays_light_and_unknown_names_are_attribute_errors():
    code = ("import sys, trainstream_hf; heavy = [m for m in ('transformers', 'accelerate', 'trl') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        trainstream_hf.Nope


def test_grpo_given_a_model_path_without_peft_is_refused_with_the_reason(tmp_path):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), beta=0.04, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="beta=0.04 needs a reference policy.*peft_config=LoraConfig"):
        trainstream_hf.TrainStreamGRPOTrainer(model="some/model-path", reward_funcs=lambda **k: [0.0], args=args)


def test_the_trainer_route_says_what_it_installed(tmp_path, caplog):
    import logging

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 100, (4, 16))]
    args = trainstream_hf.TrainStreamTrainingArguments(
        output_dir=str(tmp_path), trainstream="on", trainstream_vram_budget="64GiB", max_steps=1,
        per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    with caplog.at_level(logging.INFO, logger="trainstream_hf"):
        trainstream_hf.TrainStreamTrainer(model=model, args=args, train_dataset=rows).train()
    said = caplog.text
    assert "TrainStreamTrainer installed the engine in LlamaForCausalLM: TrainStream plan: budget" in said
    assert "| block |" in said  # the table, at info level


@pytest.mark.parametrize("route", ["trainer", "callback"])
def test_engine_figures_go_to_step_logs_not_to_train_metrics(tmp_path, route):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 100, (4, 16))]
    common = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                  save_strategy="no", disable_tqdm=True, logging_steps=1)
    if route == "trainer":
        trainer = trainstream_hf.TrainStreamTrainer(
            model=model, train_dataset=rows, args=trainstream_hf.TrainStreamTrainingArguments(
                trainstream="on", trainstream_vram_budget="64GiB", **common))
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=rows,
                          callbacks=[trainstream_hf.TrainStreamCallback(vram_budget="64GiB")])
    metrics = trainer.train().metrics
    assert "train_runtime" in metrics and not any(k.startswith("trainstream/") for k in metrics)
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2 and all("trainstream/step_seconds" in h and "trainstream/python_gc_seconds" in h
                                   for h in steps)


def test_reporting_callbacks_before_ours_see_the_figures(tmp_path):
    """report_to's callbacks (TensorBoard, W&B) are added before the user's: TrainStreamCallback puts itself first, so
    a callback listed before it still receives trainstream/* in each step's log."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class Recorder(TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 100, (4, 16))]
    recorder = Recorder()
    trainer = Trainer(model=model, train_dataset=rows, args=TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, logging_steps=1),
        callbacks=[recorder, trainstream_hf.TrainStreamCallback(vram_budget="64GiB")])
    trainer.train()
    steps = [log for log in recorder.logs if "loss" in log]
    assert len(steps) == 2 and all("trainstream/h2d_GBps" in log for log in steps)


def test_tensorboard_event_file_holds_the_engine_figures(tmp_path, monkeypatch):
    """With report_to=["tensorboard"] (transformers' own TensorBoardCallback and writer), the event file holds the
    engine's per-step figures beside the loss."""
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # (transformers >= 5.2x: no logging_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 100, (4, 16))]
    trainer = Trainer(model=model, train_dataset=rows, args=TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=["tensorboard"],
        use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1),
        callbacks=[trainstream_hf.TrainStreamCallback(vram_budget="64GiB")])
    trainer.train()
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    # (trainstream/peak_allocated_GiB and peak_reserved_GiB come from CUDA's allocator: not on the CPU)
    for name in ("loss", "trainstream/h2d_GBps", "trainstream/predicted_peak_GiB", "trainstream/step_seconds",
                 "trainstream/python_gc_seconds"):
        assert f"train/{name}" in tags, [t for t in sorted(tags) if "trainstream" in t]
        assert [e.step for e in events.Scalars(f"train/{name}")] == [1, 2]
