"""Trainer integration on the CPU: the engine inside a real transformers Trainer gives the same model."""
import copy

import pytest
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments

import trainstream_hf as ts
from trainstream_hf.integrations.transformers import (TrainStreamCallback, TrainStreamTrainer,
                                                      TrainStreamTrainingArguments)
from tests.helpers import tiny_llama


def _model():
    return tiny_llama(vocab=128)


def _data(n=24, t=16):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (n, t), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


COMMON = dict(max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3, weight_decay=0.1,
              logging_steps=2, report_to=[], use_cpu=True, save_strategy="no", seed=0, max_grad_norm=1.0,
              lr_scheduler_type="linear", warmup_steps=2, dataloader_num_workers=0)


@pytest.mark.parametrize("page_weights", ["auto", "true"])
def test_trainstream_trainer_matches_plain_trainer(tmp_path, page_weights):
    """Paged trainable weights send their gradients to host RAM whatever ``grads`` says: the Trainer's clipping
    (max_grad_norm=1.0, active from the first step) must count them too."""
    ref = _model()
    model = copy.deepcopy(ref)
    Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **COMMON),
            train_dataset=_data()).train()
    args = TrainStreamTrainingArguments(
        output_dir=str(tmp_path / "b"), trainstream="on", trainstream_offload_optimizer="true",
        trainstream_offload_activations="true", trainstream_min_offload_numel=0,
        trainstream_min_activation_bytes="0", trainstream_vram_budget="64GiB", trainstream_host_arena="auto",
        trainstream_page_weights=page_weights, **COMMON)
    trainer = TrainStreamTrainer(model=model, args=args, train_dataset=_data())
    seen = {}

    class Spy(TrainStreamCallback.__mro__[1]):  # a plain TrainerCallback
        def on_step_end(self, args, state, control, optimizer=None, model=None, **kw):
            seen["opt"] = type(optimizer.optimizer).__name__
            seen["engine"] = ts.engine_of(model) is not None

    trainer.add_callback(Spy())
    trainer.train()
    assert seen == {"opt": "OffloadedAdamW", "engine": True}
    assert ts.engine_of(model) is None  # unwrapped at train end
    diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), model.parameters()))
    assert diff < 1e-6
    logged = [h for h in trainer.state.log_history if "trainstream/h2d_GBps" in h]
    assert logged and all(h["trainstream/arena_used_GiB"] > 0 for h in logged)


@pytest.mark.parametrize("grads", ["device", "host"])
def test_accumulating_trainer_matches_plain_trainer(tmp_path, grads):
    """Two micro-batches per step, the plan told by the Trainer, clipping on: the plain Trainer's weights."""
    ref = _model()
    model = copy.deepcopy(ref)
    common = {**COMMON, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}
    Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "a"), **common), train_dataset=_data()).train()
    args = TrainStreamTrainingArguments(
        output_dir=str(tmp_path / "b"), trainstream="on", trainstream_offload_optimizer="true",
        trainstream_min_offload_numel=0, trainstream_vram_budget="64GiB", trainstream_grads=grads, **common)
    trainer = TrainStreamTrainer(model=model, args=args, train_dataset=_data())
    plans = []

    class Spy(TrainStreamCallback.__mro__[1]):
        def on_step_end(self, args, state, control, model=None, **kw):
            plans.append(ts.engine_of(model).plan.accumulation)

    trainer.add_callback(Spy())
    trainer.train()
    assert plans and set(plans) == {2}
    diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), model.parameters()))
    assert diff < 1e-6


def test_engine_left_installed_after_train(tmp_path):
    """trainstream_unwrap_at_end=False: the engine stays in after train() (a paged model never has to fit on the
    device whole); unwrapping it later gives the weights an unwrapping at train end gives."""
    def run(unwrap_at_end):
        model = _model()
        args = TrainStreamTrainingArguments(output_dir=str(tmp_path), trainstream="on",
                                            trainstream_offload_optimizer="true", trainstream_min_offload_numel=0,
                                            trainstream_page_weights="true", trainstream_vram_budget="64GiB",
                                            **COMMON)
        TrainStreamTrainer(model=model, args=args, train_dataset=_data(),
                           trainstream_unwrap_at_end=unwrap_at_end).train()
        return model

    ended, left = run(True), run(False)
    assert ts.engine_of(ended) is None and ts.engine_of(left) is not None
    assert left.trainstream_plan.paged_blocks == [0, 1]
    ts.unwrap(left)
    for p, q in zip(ended.parameters(), left.parameters()):
        assert torch.equal(p, q)


def test_callback_on_a_plain_trainer(tmp_path):
    model = _model()
    cb = TrainStreamCallback(offload_optimizer=True, min_offload_numel=0, vram_budget="64GiB")
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **COMMON),
                      train_dataset=_data(), callbacks=[cb])
    trainer.train()
    assert cb.last["optimizer"]["offloaded_params"] > 0 and ts.engine_of(model) is None
    # a plain Trainer's log history carries the figures too (logged at steps 2, 4, 6: step 1 closed at step 2)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and all("trainstream/step_seconds" in h for h in logged)


def test_command_line_flags():
    (args,) = HfArgumentParser(TrainStreamTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/x", "--trainstream", "on", "--trainstream_vram_budget", "24GiB",
         "--trainstream_offload_optimizer", "true", "--trainstream_quantize", "nf4", "--use_cpu", "true"])
    cfg = args.trainstream_config()
    assert args.trainstream_enabled() and cfg.vram_budget == "24GiB" and cfg.offload_optimizer is True
    assert cfg.quantize == "nf4" and cfg.grads == "auto"  # the Trainer clips host gradients too (p.grad shows them)
    frac = HfArgumentParser(TrainStreamTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/x", "--trainstream_vram_budget", "0.5", "--use_cpu", "true"])[0]
    assert frac.trainstream_config().vram_budget == 0.5


@pytest.mark.parametrize("kw,msg", [({"trainstream": "maybe"}, "'auto', 'on' or 'off'"),
                                    ({"trainstream_quantize": "int3"}, "unknown format"),
                                    ({"trainstream_vram_budget": "lots"}, "cannot parse")])
def test_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TrainStreamTrainingArguments(output_dir="/tmp/x", use_cpu=True, **kw)


def test_the_switch_reads_as_the_environment_variable_does():
    assert TrainStreamTrainingArguments(output_dir="/tmp/x", use_cpu=True, trainstream=" ON").trainstream == "on"


def test_checkpoint_resume_is_bit_identical(tmp_path):
    """save at step 3, resume from it: the same weights as 6 uninterrupted steps (host optimizer state
    goes through the Trainer's checkpoint and back)."""
    def args(out, **kw):
        return TrainStreamTrainingArguments(
            output_dir=str(out), trainstream="on", trainstream_offload_optimizer="true",
            trainstream_min_offload_numel=0, trainstream_vram_budget="64GiB",
            **{**COMMON, "save_strategy": "steps", "save_steps": 3, **kw})

    full = _model()
    TrainStreamTrainer(model=full, args=args(tmp_path / "full"), train_dataset=_data()).train()

    first = _model()
    TrainStreamTrainer(model=first, args=args(tmp_path / "run"), train_dataset=_data()).train()
    resumed = _model()
    TrainStreamTrainer(model=resumed, args=args(tmp_path / "run"), train_dataset=_data()).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_engine_installed_when_the_optimizer_is_created(tmp_path):
    """Before Accelerate's prepare (which moves the whole model): a model larger than the GPU can wait in host RAM
    for the engine to place it. create_optimizer returns the engine's optimizer, and the scheduler is built on it."""
    model = _model()
    args = TrainStreamTrainingArguments(output_dir=str(tmp_path), trainstream="on", trainstream_vram_budget="64GiB",
                                        trainstream_offload_optimizer="true", trainstream_min_offload_numel=0,
                                        **COMMON)
    trainer = TrainStreamTrainer(model=model, args=args, train_dataset=_data())
    assert ts.engine_of(model) is None
    opt = trainer.create_optimizer()
    assert ts.engine_of(model) is not None and type(opt).__name__ == "OffloadedAdamW" and trainer.optimizer is opt
    assert trainer.create_optimizer() is opt  # a second call (a second train()) installs nothing more
    assert ts.engine_of(model).plan.accumulation == 1
    ts.unwrap(model)


@pytest.mark.parametrize("bf16", [True, False])
def test_the_block_is_measured_in_the_trainers_precision(tmp_path, monkeypatch, bf16):
    """With bf16=True the Trainer's forward runs under autocast; the engine measures its block under the same
    autocast when it installs, so the plan counts the activations training saves."""
    from trainstream_hf import planner

    seen, measure = [], planner.measure_block

    def spy(*args, **kwargs):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return measure(*args, **kwargs)

    monkeypatch.setattr(planner, "measure_block", spy)
    planned, make = [], planner.plan

    def plan_spy(*args, **kwargs):
        planned.append((kwargs["batch_shape"], kwargs["output_fp32_bytes"]))
        return make(*args, **kwargs)

    monkeypatch.setattr(planner, "plan", plan_spy)
    model = _model()
    args = TrainStreamTrainingArguments(output_dir=str(tmp_path), trainstream="on", trainstream_vram_budget="64GiB",
                                        bf16=bf16, **COMMON)
    TrainStreamTrainer(model=model, args=args, train_dataset=_data()).create_optimizer()
    assert seen and set(seen) == {torch.bfloat16 if bf16 else None} and not torch.is_autocast_enabled("cpu")
    # and with mixed precision Accelerate returns the logits in float32 too: the plan counts that copy
    (b, t), fp32_copy = planned[-1]
    assert fp32_copy == (b * t * model.config.vocab_size * 4 if bf16 else 0)
    ts.unwrap(model)


def test_the_plan_takes_the_trainers_gradient_accumulation(tmp_path):
    model = _model()
    args = TrainStreamTrainingArguments(output_dir=str(tmp_path), trainstream="on", trainstream_vram_budget="64GiB",
                                        trainstream_offload_optimizer="true", trainstream_min_offload_numel=0,
                                        **{**COMMON, "gradient_accumulation_steps": 3})
    TrainStreamTrainer(model=model, args=args, train_dataset=_data()).create_optimizer()
    plan = ts.engine_of(model).plan
    assert plan.accumulation == 3 and "3 micro-batches per step" in str(plan)
    ts.unwrap(model)
    # trainstream's own count may only agree with the Trainer's, which decides the micro-batches
    model = _model()
    args = TrainStreamTrainingArguments(output_dir=str(tmp_path), trainstream="on", trainstream_vram_budget="64GiB",
                                        trainstream_gradient_accumulation_steps=2,
                                        **{**COMMON, "gradient_accumulation_steps": 3})
    with pytest.raises(ValueError, match="differs from the Trainer's gradient_accumulation_steps=3"):
        TrainStreamTrainer(model=model, args=args, train_dataset=_data()).create_optimizer()
    assert ts.engine_of(model) is None


def test_trainer_leaves_a_model_that_does_not_fit_to_the_engine(monkeypatch, tmp_path):
    """The Trainer's own move of the whole model is skipped when the model outgrows the device's free memory (the
    engine places it, paged blocks in host RAM); a model that fits moves as before."""
    from trainstream_hf.integrations import transformers as integ

    model = _model()
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need // 2, 80 << 30))
    assert integ._does_not_fit(model, "cuda:0")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need * 4, 80 << 30))
    assert not integ._does_not_fit(model, "cuda:0")
    assert not integ._does_not_fit(model, "cpu")
    moved = []
    monkeypatch.setattr(Trainer, "_move_model_to_device", lambda self, m, d: moved.append(d))
    monkeypatch.setattr(integ, "_does_not_fit", lambda m, d: True)
    args = TrainStreamTrainingArguments(output_dir=str(tmp_path), trainstream="on", **COMMON)
    TrainStreamTrainer(model=model, args=args, train_dataset=_data())
    assert moved == []
    monkeypatch.setattr(integ, "_does_not_fit", lambda m, d: False)
    TrainStreamTrainer(model=model, args=args, train_dataset=_data())
    assert len(moved) == 1


@pytest.mark.parametrize("trainstream", ["on", "off"])
def test_quantized_model_without_adapters_is_refused(tmp_path, trainstream):
    """Packed linear layers cannot train; without PEFT adapters only embeddings and norms would: a clear error with
    the fix, from the engine trainers (engine on or off) and from the callback on a stock Trainer."""
    from trainstream_hf.quant import quantize_model

    model = quantize_model(_model(), "nf4")
    args = TrainStreamTrainingArguments(output_dir=str(tmp_path), trainstream=trainstream, max_steps=1,
                                        per_device_train_batch_size=2, report_to="none", use_cpu=True,
                                        save_strategy="no")
    with pytest.raises(ValueError, match=r"packed \(QuantLinear.*no PEFT adapters.*get_peft_model\(model, peft.LoraConfig"):
        TrainStreamTrainer(model=model, args=args, train_dataset=[])
    with pytest.raises(ValueError, match=r"TrainStreamCallback: the model's linear layers are packed"):
        TrainStreamCallback(vram_budget="64GiB").install(args, model, torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad]))



def test_the_trainers_default_batch_shape_is_not_the_models_context():
    """Without batch_shape the plan is made for the per-device batch times the sequences per example, at the longer of
    2048 tokens and TRL's max_length, never past the model's context (Llama 3.1's 131072 would plan, and measure a
    block, at 64x the usual sequence)."""
    from types import SimpleNamespace

    from trainstream_hf.integrations.transformers import trainer_batch_shape

    def model(context):
        return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context))

    args = SimpleNamespace(per_device_train_batch_size=4)
    assert trainer_batch_shape(args, model(131072)) == (4, 2048)
    assert trainer_batch_shape(args, model(64)) == (4, 64)
    long = SimpleNamespace(per_device_train_batch_size=2, max_length=8192)
    assert trainer_batch_shape(long, model(131072)) == (2, 8192)
    assert trainer_batch_shape(SimpleNamespace(per_device_train_batch_size=2, max_length=1024), model(131072),
                               rows=2) == (4, 2048)  # DPO: chosen and rejected
    unnamed = SimpleNamespace(per_device_train_batch_size=2, max_length=None)
    assert trainer_batch_shape(unnamed, model(None)) == (2, 2048)


def test_the_trainer_plans_for_its_default_batch_shape(tmp_path, monkeypatch):
    from trainstream_hf import planner

    planned, make = [], planner.plan

    def plan_spy(*args, **kwargs):
        planned.append(kwargs["batch_shape"])
        return make(*args, **kwargs)

    monkeypatch.setattr(planner, "plan", plan_spy)
    model = tiny_llama(vocab=128, positions=131072)
    args = TrainStreamTrainingArguments(output_dir=str(tmp_path), trainstream="on", trainstream_vram_budget="64GiB",
                                        **COMMON)
    TrainStreamTrainer(model=model, args=args, train_dataset=_data()).create_optimizer()
    assert planned[-1] == (args.per_device_train_batch_size, 2048)
    ts.unwrap(model)


@pytest.mark.parametrize("route", ["trainer", "callback"])
def test_a_second_train_goes_on_as_a_plain_trainers(tmp_path, route, monkeypatch):
    """``train()`` twice on one Trainer: the engine taken out at the end of the first goes back in over the user's
    optimizer with the moments and step counts the first left, as a plain Trainer's optimizer goes on (constant
    learning rate: the second run trains). The control: the same run with the moments dropped ends elsewhere."""
    kw = dict(COMMON, max_steps=3, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1)

    def run(trainer_cls, args_cls, **extra):
        model = _model()
        ts_args = {"callbacks": [TrainStreamCallback(offload_optimizer=True, min_offload_numel=0,
                                                      vram_budget="64GiB")]} if route == "callback" else {}
        args = args_cls(output_dir=str(tmp_path / trainer_cls.__name__), **kw, **extra)
        trainer = trainer_cls(model=model, args=args, train_dataset=_data(), **ts_args)
        trainer.train()
        trainer.train()
        return trainer, model

    _, ref = run(Trainer, TrainingArguments)
    engine_args = {} if route == "callback" else dict(trainstream="on", trainstream_offload_optimizer="true",
                                                        trainstream_min_offload_numel=0,
                                                        trainstream_vram_budget="64GiB")
    cls, args_cls = (Trainer, TrainingArguments) if route == "callback" else (TrainStreamTrainer,
                                                                                TrainStreamTrainingArguments)
    trainer, model = run(cls, args_cls, **engine_args)
    assert type(trainer.optimizer.optimizer).__name__ == "OffloadedAdamW" and ts.engine_of(model) is None
    assert trainer.state.global_step == 3  # (each train() counts its own steps)
    diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), model.parameters()))
    assert diff < 1e-6

    from trainstream_hf.engine.optimizer import OffloadedAdamW
    monkeypatch.setattr(OffloadedAdamW, "handed_back", lambda self: (self._user_optimizer, {
        "state": {}, "param_groups": self.state_dict()["param_groups"]}))
    _, fresh = run(cls, args_cls, **engine_args)
    assert max((p - q).abs().max().item() for p, q in zip(ref.parameters(), fresh.parameters())) > 1e-4
