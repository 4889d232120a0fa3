"""A model whose weights something else places or shards is refused in one line saying what to do, before anything
changes: Accelerate's device_map over several devices, FSDP (2), tensor-parallel DTensor parameters, a DeepSpeed
engine; and a Trainer or Accelerator set up for FSDP or DeepSpeed."""
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch import nn

import trainstream_hf as ts
from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.integrations.accelerate import TrainStreamAccelerator, TrainStreamPlugin
from trainstream_hf.integrations.transformers import refuse_sharded_training
from tests.helpers import tiny_llama

WRAP = dict(device="cpu", vram_budget="8GiB", host_arena=None)


def _llama():
    return tiny_llama(2, vocab=128, positions=64, seed=0)


def _unchanged(model, before):
    assert ts.engine_of(model) is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def one_rank_mesh():
    """A one-process gloo group and its CPU mesh (FSDP2 and DTensors need one); destroyed after the module."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_device_map_over_several_devices_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    _llama().save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", offload_folder=str(tmp_path / "off"), device_map={
        "model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
        "lm_head": "disk"})
    with pytest.raises(ValueError, match=r"loaded with a device_map over cpu, disk: .* load it without device_map "
                                         r".* pass device='cuda' to wrap"):
        ts.wrap(model, None, **WRAP)
    assert ts.engine_of(model) is None
    one = _llama()
    one.hf_device_map = {"": "cpu"}  # one device: nothing moves at a forward, nothing to refuse
    ts.wrap(one, None, **WRAP)
    ts.unwrap(one)


def test_fsdp2_and_dtensor_parameters_are_refused(one_rank_mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=one_rank_mesh)
    with pytest.raises(ValueError, match="is sharded by FSDP: .* wrap the unsharded model"):
        ts.wrap(model, torch.optim.AdamW(model.parameters()), **WRAP)
    assert ts.engine_of(model) is None

    model = _llama()
    up = model.model.layers[0].mlp.up_proj
    up.weight = nn.Parameter(distribute_tensor(up.weight.data, one_rank_mesh, [Shard(0)]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"has sharded \(DTensor\) parameters, e.g. model.layers.0.mlp.up_proj.weight"):
        ts.wrap(model, None, **WRAP)
    _unchanged(model, before)


def test_a_deepspeed_engine_is_refused():
    class DeepSpeedEngine(nn.Module):  # (the class deepspeed.initialize returns, by name: no import of deepspeed)
        def __init__(self, module):
            super().__init__()
            self.module = module

    inner = _llama()
    before = {n: p.detach().clone() for n, p in inner.named_parameters()}
    with pytest.raises(ValueError, match="is a DeepSpeed engine: .* wrap the plain model"):
        ts.wrap(DeepSpeedEngine(inner), None, **WRAP)
    _unchanged(inner, before)


@pytest.mark.parametrize("args, used", [
    (SimpleNamespace(fsdp=True, deepspeed=None), "FSDP"),
    (SimpleNamespace(fsdp=["full_shard"], deepspeed=None), "FSDP"),
    (SimpleNamespace(fsdp=None, deepspeed="ds_config.json"), "DeepSpeed"),
    (SimpleNamespace(fsdp=None, deepspeed=None,
                     distributed_state=SimpleNamespace(distributed_type=DistributedType.FSDP)), "FSDP"),
    (SimpleNamespace(fsdp=None, deepspeed=None,
                     distributed_state=SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)), "DeepSpeed"),
])
def test_a_trainer_with_fsdp_or_deepspeed_is_refused(args, used):
    with pytest.raises(ValueError, match=f"TrainStreamCallback: the Trainer runs with {used}, .* use one"):
        refuse_sharded_training(args, "TrainStreamCallback")
    refuse_sharded_training(SimpleNamespace(fsdp=None, deepspeed=None, distributed_state=SimpleNamespace(
        distributed_type=DistributedType.MULTI_GPU)), "TrainStreamCallback")  # DDP: the engine's own way


def test_the_callback_refuses_before_wrapping(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    args.deepspeed = "ds_config.json"  # (set after: TrainingArguments would import deepspeed, not installed here)
    model = _llama()
    callback = ts.TrainStreamCallback(vram_budget="8GiB", host_arena=None)
    with pytest.raises(ValueError, match="the Trainer runs with DeepSpeed"):
        callback.install(args, model, torch.optim.AdamW(model.parameters()))
    assert ts.engine_of(model) is None


def test_an_accelerator_with_fsdp_is_refused(monkeypatch):
    monkeypatch.setattr(TrainStreamAccelerator, "distributed_type", property(lambda self: DistributedType.FSDP))
    acc = TrainStreamAccelerator(cpu=True, trainstream_plugin=TrainStreamPlugin("on", TrainStreamConfig(
        vram_budget="8GiB", host_arena=None)))
    model = _llama()
    with pytest.raises(ValueError, match="TrainStreamAccelerator: Accelerate runs with FSDP, .* use one"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))
    assert ts.engine_of(model) is None
