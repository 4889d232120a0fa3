"""TrainStreamAccelerator on the CPU: prepare() installs the engine; training matches plain Accelerate."""
import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import get_linear_schedule_with_warmup

import trainstream_hf as ts
from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.integrations.accelerate import TrainStreamAccelerator, TrainStreamPlugin
from trainstream_hf.train.processes import cpu_launch_config
from tests.helpers import tiny_llama


def _model():
    return tiny_llama(vocab=128)

def _loop(acc, model, opt, sched, steps=5):
    for s in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s))
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()

@pytest.mark.parametrize("grads", ["device", "host"])
def test_accelerator_installs_engine_and_matches(grads):
    from accelerate import Accelerator
    ref, model = _model(), None
    model = copy.deepcopy(ref)
    acc = Accelerator(cpu=True)
    r_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    r_model, r_opt, r_sched = acc.prepare(ref, r_opt, get_linear_schedule_with_warmup(r_opt, 2, 5))
    _loop(acc, r_model, r_opt, r_sched)

    plugin = TrainStreamPlugin("on", TrainStreamConfig(offload_optimizer=True, min_offload_numel=0, grads=grads,
                                                       vram_budget="64GiB"))
    tacc = TrainStreamAccelerator(cpu=True, trainstream_plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    p_model, p_opt, p_sched = tacc.prepare(model, opt, get_linear_schedule_with_warmup(opt, 2, 5))
    assert type(p_opt.optimizer).__name__ == "OffloadedAdamW" and ts.engine_of(model) is not None
    _loop(tacc, p_model, p_opt, p_sched)
    tacc.end_training()
    assert ts.engine_of(model) is None
    diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), model.parameters()))
    assert diff < 1e-6

def test_the_plan_takes_accelerates_gradient_accumulation():
    plugin = TrainStreamPlugin("on", TrainStreamConfig(offload_optimizer=True, min_offload_numel=0,
                                                       vram_budget="64GiB"))
    acc = TrainStreamAccelerator(cpu=True, gradient_accumulation_steps=4, trainstream_plugin=plugin)
    model = _model()
    acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert ts.engine_of(model).plan.accumulation == 4
    acc.end_training()


def test_the_plan_takes_the_batch_of_a_dataloader_prepared_with_the_model(monkeypatch):
    """prepare(model, optimizer, loader): the plan is made for the loader's batch size (the length: 2048 or the model's
    context); an explicit batch_shape wins; without a loader, one sequence."""
    from trainstream_hf import planner
    planned, make = [], planner.plan

    def plan_spy(*args, **kwargs):
        planned.append(kwargs["batch_shape"])
        return make(*args, **kwargs)

    monkeypatch.setattr(planner, "plan", plan_spy)
    loader = torch.utils.data.DataLoader(torch.randint(0, 128, (24, 16)), batch_size=6)
    for config, loaders, want in ((TrainStreamConfig(vram_budget="64GiB"), [loader], (6, 32)),
                                  (TrainStreamConfig(vram_budget="64GiB", batch_shape=(2, 8)), [loader], (2, 8)),
                                  (TrainStreamConfig(vram_budget="64GiB"), [], (1, 32))):
        AcceleratorState._reset_state(reset_partial_state=True)
        acc = TrainStreamAccelerator(cpu=True, trainstream_plugin=TrainStreamPlugin("on", config))
        model = _model()  # max_position_embeddings 32
        acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), *loaders)
        assert planned[-1] == want
        acc.end_training()
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("no", None)])
def test_the_block_is_measured_in_the_prepared_forwards_precision(monkeypatch, precision, dtype):
    """prepare() measures a block under the autocast Accelerate's mixed precision runs the forward in: the
    activations the plan counts are the trained ones (and compiled blocks compile for that forward once)."""
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
    AcceleratorState._reset_state(reset_partial_state=True)  # the process's state holds one mixed precision
    plugin = TrainStreamPlugin("on", TrainStreamConfig(vram_budget="64GiB"))
    acc = TrainStreamAccelerator(cpu=True, mixed_precision=precision, trainstream_plugin=plugin)
    model = _model()
    acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert seen and set(seen) == {dtype} and not torch.is_autocast_enabled("cpu")
    # prepare() then makes the forward return its float outputs in float32: the plan counts the logits' copy
    (b, t), fp32_copy = planned[-1]
    assert fp32_copy == (b * t * model.config.vocab_size * 4 if dtype is not None else 0)
    acc.end_training()
    AcceleratorState._reset_state(reset_partial_state=True)


def test_plugin_from_env():
    p = TrainStreamPlugin.from_env({"TRAINSTREAM": "on", "TRAINSTREAM_VRAM_BUDGET": "24GiB",
                                    "TRAINSTREAM_OFFLOAD_OPTIMIZER": "true", "TRAINSTREAM_SLOTS": "3",
                                    "TRAINSTREAM_PREFETCH": "2", "TRAINSTREAM_TRACE": "/tmp/t.json"})
    assert p.active() and p.config.vram_budget == "24GiB" and p.config.offload_optimizer is True
    assert p.config.slots == 3 and p.config.prefetch == 2
    with pytest.raises(ValueError, match="unknown trainstream option"):
        TrainStreamPlugin.from_env({"TRAINSTREAM_VRAM": "1GiB"})
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        TrainStreamPlugin.from_env({"TRAINSTREAM": "yes"})
    assert not TrainStreamPlugin.from_env({"TRAINSTREAM": "off"}).active()

def test_trainstream_arguments_as_the_trainer_takes_them(monkeypatch):
    """TrainStreamAccelerator(trainstream="on", trainstream_<option>=...) as TrainStreamTrainingArguments: over the
    environment's options; a misspelt option or a plugin beside them is one line."""
    monkeypatch.setenv("TRAINSTREAM_SLOTS", "3")
    acc = TrainStreamAccelerator(cpu=True, trainstream="on", trainstream_vram_budget="64GiB",
                                 trainstream_offload_optimizer=True, trainstream_min_offload_numel=0)
    plugin = acc.trainstream_plugin
    assert plugin.active() and plugin.config.vram_budget == "64GiB" and plugin.config.slots == 3
    model = _model()
    _, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert type(opt.optimizer).__name__ == "OffloadedAdamW"
    acc.end_training()
    with pytest.raises(ValueError, match="trainstream_vram_budgt names no option .did you mean trainstream_vram_b"):
        TrainStreamAccelerator(cpu=True, trainstream_vram_budgt="8GiB")
    with pytest.raises(ValueError, match="trainstream_plugin= or trainstream= / trainstream_<option>= arguments, not"):
        TrainStreamAccelerator(cpu=True, trainstream_plugin=TrainStreamPlugin("on"), trainstream_vram_budget="8GiB")


def test_accelerate_launch_two_processes_matches_one_process(tmp_path):
    """``accelerate launch`` with 2 processes (torchrun underneath): the script's TrainStreamAccelerator(cpu=True)
    trains in 2 gloo processes (Accelerate's MULTI_CPU), DDP around the wrapped model, accumulation of 2 and
    clipping; losses and weights within 1e-5 of one process on the global batch.

    ``--cpu`` itself cannot be used: with more than one process it needs MPI (Accelerate's simple launcher starts
    one process otherwise), so the launch config asks for the multi-GPU launcher and the script for the CPU."""
    path = Path(__file__).resolve().parents[1] / "engine" / "ddp_worker.py"
    spec = importlib.util.spec_from_file_location("ddp_worker", path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    # a config file of its own: a user's default accelerate config must not leak in
    cfg, _ = cpu_launch_config(tmp_path / "two.yaml", 2)  # ddp_worker.launch sets the same environment
    accelerate = str(Path(sys.executable).parent / "accelerate")
    ranks = [r["accelerate"] for r in worker.launch([accelerate, "launch", "--config_file", str(cfg), str(path),
                                                     str(tmp_path), "accelerate"], tmp_path)]
    worker.check_matches_one_process(ranks, "full", worker.reference("accelerate"))
    info = ranks[0]["info"]
    assert info == {"ddp": True, "optimizer": "OffloadedAdamW", "grads": "device", "backend": "gloo"}
