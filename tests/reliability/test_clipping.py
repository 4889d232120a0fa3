"""Every Trainer route clips as a plain Trainer does, with paged trainable weights (whose gradients live in host RAM):
the logged grad_norm is the true norm, and max_grad_norm changes the training."""
import pytest
import transformers.trainer
from transformers import Trainer, TrainerCallback, TrainingArguments

import trainstream_hf as ts
from trainstream_hf.auto import _add_default_callback
from trainstream_hf.integrations.transformers import (TrainStreamCallback, TrainStreamTrainer,
                                                      TrainStreamTrainingArguments)
from tiny import tiny_llama, token_rows

OPTIONS = dict(page_weights=True, offload_optimizer=True, min_offload_numel=0, vram_budget="64GiB")
COMMON = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, weight_decay=0.1, logging_steps=1,
              report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)


def _model():
    return tiny_llama()


def _data():
    return token_rows(12)


class _Engine(TrainerCallback):
    """What the engine was doing at the end of each step: paged blocks and where the offloaded gradients went."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        engine = ts.engine_of(model)
        self.seen.append(None if engine is None else (engine.plan.paged_blocks, engine.plan.grads,
                                                      type(optimizer.optimizer).__name__))


def _train(route, tmp_path, max_grad_norm, monkeypatch):
    """(grad_norm, loss) of each step, and what the engine did, for one route."""
    spy = _Engine()
    out = str(tmp_path / f"{route}-{max_grad_norm}")
    if route == "plain":
        trainer = Trainer(model=_model(), args=TrainingArguments(output_dir=out, max_grad_norm=max_grad_norm,
                                                                 **COMMON), train_dataset=_data(), callbacks=[spy])
    elif route == "trainer":
        args = TrainStreamTrainingArguments(
            output_dir=out, max_grad_norm=max_grad_norm, trainstream="on", trainstream_page_weights="true",
            trainstream_offload_optimizer="true", trainstream_min_offload_numel=0, trainstream_vram_budget="64GiB",
            **COMMON)
        trainer = TrainStreamTrainer(model=_model(), args=args, train_dataset=_data(), callbacks=[spy])
    elif route == "callback":
        trainer = Trainer(model=_model(), args=TrainingArguments(output_dir=out, max_grad_norm=max_grad_norm,
                                                                 **COMMON),
                          train_dataset=_data(), callbacks=[TrainStreamCallback(**OPTIONS), spy])
    else:
        # TRAINSTREAM=on (python -m trainstream_hf.auto): the launcher's one change, the environment's callback in
        # transformers' default callbacks, made here in-process on a copy of the list; the stock Trainer reads the
        # TRAINSTREAM_* variables itself.
        for name, value in {"TRAINSTREAM": "on", "TRAINSTREAM_PAGE_WEIGHTS": "true",
                            "TRAINSTREAM_OFFLOAD_OPTIMIZER": "true", "TRAINSTREAM_MIN_OFFLOAD_NUMEL": "0",
                            "TRAINSTREAM_VRAM_BUDGET": "64GiB"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(transformers.trainer, "DEFAULT_CALLBACKS", list(transformers.trainer.DEFAULT_CALLBACKS))
        _add_default_callback(transformers.trainer)
        trainer = Trainer(model=_model(), args=TrainingArguments(output_dir=out, max_grad_norm=max_grad_norm,
                                                                 **COMMON), train_dataset=_data(), callbacks=[spy])
        assert "TrainStreamEnvCallback" in [type(c).__name__ for c in trainer.callback_handler.callbacks]
    trainer.train()
    logged = [(h["grad_norm"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == COMMON["max_steps"]
    return logged, spy.seen


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return {m: _train("plain", tmp_path_factory.mktemp("plain"), m, None)[0] for m in (1.0, 0.01)}


@pytest.mark.parametrize("route", ["trainer", "callback", "env"])
def test_every_route_clips_like_a_plain_trainer(route, plain, tmp_path, monkeypatch):
    """grad_norm at every step is the plain Trainer's (rel 1e-5), the losses follow it, and max_grad_norm 1.0 and
    0.01 (both below the true norm, ~1.7-2.6) train differently."""
    runs = {}
    for max_grad_norm in (1.0, 0.01):
        logged, seen = _train(route, tmp_path, max_grad_norm, monkeypatch)
        # the engine ran every step with both blocks paged, their gradients in host RAM
        assert seen == [([0, 1], "host", "OffloadedAdamW")] * COMMON["max_steps"]
        for (norm, loss), (ref_norm, ref_loss) in zip(logged, plain[max_grad_norm]):
            assert norm == pytest.approx(ref_norm, rel=1e-5) and norm > 1.0
            assert loss == pytest.approx(ref_loss, rel=1e-5)
        runs[max_grad_norm] = [loss for _, loss in logged]
    assert runs[1.0][0] == runs[0.01][0]  # the first loss comes before any update
    assert abs(runs[1.0][2] - runs[0.01][2]) > 1e-4


def test_host_gradients_with_clipping(tmp_path):
    """grads='host' without paging (gradients leave the device during backward) is no longer refused with
    max_grad_norm: the Trainer clips them as it clips device ones."""
    ref = Trainer(model=_model(), args=TrainingArguments(output_dir=str(tmp_path / "a"), max_grad_norm=0.5, **COMMON),
                  train_dataset=_data())
    ref.train()
    cb = TrainStreamCallback(offload_optimizer=True, min_offload_numel=0, grads="host", vram_budget="64GiB")
    trainer = Trainer(model=_model(), args=TrainingArguments(output_dir=str(tmp_path / "b"), max_grad_norm=0.5,
                                                             **COMMON), train_dataset=_data(), callbacks=[cb])
    trainer.train()
    assert cb.last["optimizer"]["grads"] == "host"
    got = [(h["grad_norm"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    want = [(h["grad_norm"], h["loss"]) for h in ref.state.log_history if "loss" in h]
    assert len(got) == len(want) == COMMON["max_steps"]
    for (n, l), (rn, rl) in zip(got, want):
        assert n == pytest.approx(rn, rel=1e-5) and l == pytest.approx(rl, rel=1e-5)


def test_optimizer_in_backward_with_clipping_is_refused_before_training(tmp_path):
    """Its updates run during backward, before any clip: with max_grad_norm set that is an error at train begin,
    with the fix, not a failure at the first step's clip."""
    model = _model()
    from trainstream_hf.config import TrainStreamConfig

    config = TrainStreamConfig(offload_optimizer=True, min_offload_numel=0, optimizer_in_backward=True,
                               vram_budget="64GiB")
    args = TrainingArguments(output_dir=str(tmp_path), max_grad_norm=1.0, **COMMON)
    trainer = TrainStreamTrainer(model=model, args=args, train_dataset=_data(), trainstream_config=config)
    with pytest.raises(ValueError, match="optimizer_in_backward=True updates each weight during backward.*"
                                         "max_grad_norm=0"):
        trainer.train()
    assert ts.engine_of(model) is None
