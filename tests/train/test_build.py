"""trainstream_hf.train.model and .data on the CPU: random models built piece by piece, the 8B / 70B / 3B shapes on
the meta device, packing, mixed-precision and output-directory checks."""
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from trainstream_hf.quant import QuantLinear
from trainstream_hf.train import data, model as models, report
from trainstream_hf.train.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "models" / "tiny-llama.json")


@pytest.mark.parametrize("name, params", [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
                                          ("llama3.2-3b", 3_212_749_824)])
def test_shipped_shapes_on_the_meta_device(name, params):
    """The big shapes build as skeletons without allocating: every parameter on meta, the published parameter
    counts (Meta-Llama-3-8B 8.03 B, -70B 70.55 B, Llama-3.2-3B 3.21 B with its tied embeddings)."""
    config = models.model_config(str(ROOT / "configs" / "models" / f"{name}.json"))
    m = models.skeleton(config, torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in m.parameters())
    assert models.count_parameters(m)["parameters"] == params
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == config.tie_word_embeddings
    assert all(not b.is_meta for b in m.buffers())  # rotary tables are real, computed at construction
    # packed as nf4, the base's logical size is unchanged
    assert len(m.model.layers) == config.num_hidden_layers


def test_random_build_is_transformers_initialisation():
    """Piece-by-piece init gives what from_config gives: N(0, 0.02) linears and embedding (padding row zero),
    unit norms, the same rotary buffers, a tied head; seeded, so two builds are equal."""
    from transformers import AutoModelForCausalLM

    m = models.build_model(TINY, "random", "float32", vocab_size=59, seed=3)
    ref = AutoModelForCausalLM.from_config(models.model_config(TINY))
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for n, p in m.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32 and not p.is_meta, n
        if "norm" in n:
            assert torch.equal(p, torch.ones_like(p)), n
        else:
            assert abs(p.std().item() - 0.02) < 0.002 and abs(p.mean().item()) < 0.002, n
    assert torch.count_nonzero(m.model.embed_tokens.weight[0]) == 0  # pad_token_id 0
    assert m.lm_head.weight is m.model.embed_tokens.weight
    for n, b in ref.named_buffers():
        assert torch.equal(dict(m.named_buffers())[n], b), n
    again = models.build_model(TINY, "random", "float32", vocab_size=59, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), again.parameters()))
    ids = torch.randint(0, 59, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = m(input_ids=ids, labels=ids).loss
    assert 3.5 < loss.item() < 5.0  # ~ln(64) for an untrained model


def test_quantized_build_packs_each_block_as_it_is_built(monkeypatch):
    """With quantize, block i is packed while blocks after it are still on the meta device and blocks before it
    are packed already: the dense model never exists whole. The tied head stays dense."""
    import trainstream_hf.quant as quant

    seen = []
    real = quant.quantize_model

    def spy(module, *args, **kwargs):
        if isinstance(module, nn.Module) and hasattr(module, "self_attn"):
            layers = spy.layers
            i = next(k for k, b in enumerate(layers) if b is module)
            seen.append(i)
            assert all(p.is_meta for b in layers[i + 1:] for p in b.parameters()), i
            assert all(isinstance(b.self_attn.q_proj, QuantLinear) for b in layers[:i]), i
            assert not any(p.is_meta for p in module.parameters()), i
            dense = [weakref.ref(x.weight) for x in module.modules() if type(x) is nn.Linear]
            out = real(module, *args, **kwargs)
            gc.collect()
            assert len(dense) == 7 and all(w() is None for w in dense), i  # each dense weight freed once packed
            return out
        return real(module, *args, **kwargs)

    config = models.model_config(TINY)
    skel = models.skeleton(config, torch.float32)
    spy.layers = list(skel.model.layers)
    monkeypatch.setattr(quant, "quantize_model", spy)
    m = models.materialize(skel, device="cpu", home="cpu", quantize="nf4")
    assert seen == [0, 1, 2, 3]
    linears = [mod for name, mod in m.named_modules() if "layers." in name and "proj" in name]
    assert len(linears) == 28 and all(isinstance(x, QuantLinear) and x.fmt.name == "nf4" for x in linears)
    assert type(m.lm_head) is nn.Linear and m.lm_head.weight is m.model.embed_tokens.weight
    assert models.count_parameters(m)["parameters"] == models.count_parameters(skel)["parameters"] == 1_057_920
    ids = torch.randint(0, 59, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(m(input_ids=ids, labels=ids).loss)


def test_every_piece_goes_home():
    """Whatever the compute device, each finished piece is moved to ``home`` (here the meta device stands in for
    host RAM: nothing real may be left behind on the build device)."""
    m = models.materialize(models.skeleton(models.model_config(TINY), torch.float32), device="cpu", home="meta",
                           quantize="int8")
    assert all(p.is_meta for p in m.parameters()) and all(b.is_meta for b in m.buffers())
    assert isinstance(m.model.layers[3].mlp.down_proj, QuantLinear)


def test_home_device_rule():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert models.home_device(gpu, wrap=True, page_weights="auto", evaluate=False) == cpu
    assert models.home_device(gpu, wrap=True, page_weights=False, evaluate=False) == gpu
    assert models.home_device(gpu, wrap=True, page_weights=True, evaluate=True) == gpu  # evaluated whole first
    assert models.home_device(gpu, wrap=False, page_weights=True, evaluate=False) == gpu
    assert models.home_device(cpu, wrap=True, page_weights=True, evaluate=False) == cpu


def test_model_spec_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model: no such file or directory 'nope\.json'"):
        models.build_model("nope.json", "random", "float32", vocab_size=59, seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        models.build_model(str(tmp_path / "empty"), "pretrained", "float32", vocab_size=59, seed=0)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a JSON model config"):
        models.build_model(str(tmp_path / "bad.json"), "random", "float32", vocab_size=59, seed=0)
    (tmp_path / "small.json").write_text(json.dumps({**json.loads(Path(TINY).read_text()), "vocab_size": 32}))
    with pytest.raises(ConfigError, match="vocab_size 32 but the tokenizer has 59"):
        models.build_model(str(tmp_path / "small.json"), "random", "float32", vocab_size=59, seed=0)


def test_pack():
    rows = [{"input_ids": [1, 5, 6, 2], "labels": [-100, 5, 6, 2]}, {"input_ids": [1, 7, 2], "labels": [-100, 7, 2]},
            {"input_ids": [1, 8, 9, 2], "labels": [-100, -100, 9, 2]}]
    packed = data.pack(rows, 5)
    assert packed == [{"input_ids": [1, 5, 6, 2, 1], "labels": [-100, 5, 6, 2, -100]},
                      {"input_ids": [7, 2, 1, 8, 9], "labels": [7, 2, -100, -100, 9]}]  # tail of 1 token dropped
    with pytest.raises(ConfigError, match="data.packing: the training examples hold 11 tokens"):
        data.pack(rows, 12)
    with pytest.raises(ConfigError, match="train.batch_size=3 is larger than the 2 training sequences"):
        data.batches(packed, 3, 0, seed=0)  # at the call, not at the first batch


def test_mixed_precision_resolution():
    assert models.resolve_mixed_precision("auto", {}) == "no"
    assert models.resolve_mixed_precision("auto", {"ACCELERATE_MIXED_PRECISION": "bf16"}) == "bf16"
    assert models.resolve_mixed_precision("no", {"ACCELERATE_MIXED_PRECISION": "bf16"}) == "no"
    with pytest.raises(ConfigError, match=r"accelerate launch asks for 'fp16'.*'no' and 'bf16'"):
        models.resolve_mixed_precision("auto", {"ACCELERATE_MIXED_PRECISION": "fp16"})
    assert models.resolve_mixed_precision("bf16", {"WORLD_SIZE": "2"}) == "bf16"  # several processes: sft's business


def test_launch_environment():
    from trainstream_hf.train import processes

    assert processes.from_environment({}) == processes.Processes(0, 1, 0)
    p = processes.from_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (p.rank, p.world, p.local_rank, p.main, p.several) == (1, 2, 1, False, True)
    with pytest.raises(ConfigError, match="RANK=2 but WORLD_SIZE=2"):
        processes.from_environment({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="WORLD_SIZE='two': the launcher's environment"):
        processes.from_environment({"WORLD_SIZE": "two"})
    with pytest.raises(ConfigError, match="WORLD_SIZE=2: the dpo recipe trains in one process"):
        processes.require_single(p, "the dpo recipe")
    processes.require_single(processes.Processes(), "the dpo recipe")
    assert processes.device_for("auto", processes.Processes()) is None  # one process: the recipe resolves it
    assert processes.device_for("cpu", p) == torch.device("cpu")
    with pytest.raises(ConfigError, match="device='cuda:1': under several processes each one takes GPU LOCAL_RANK"):
        processes.device_for("cuda:1", p)
    # rank r of 2 takes batches r, r + 2, r + 4, ... of the shared seeded sequence
    shares = [processes.rank_batches(iter(range(100)), processes.Processes(r, 2, r)) for r in range(2)]
    assert [next(shares[0]) for _ in range(3)] == [0, 2, 4] and [next(shares[1]) for _ in range(3)] == [1, 3, 5]
    mem = processes.host_memory()
    assert mem["pss_bytes"] > 0 and mem["rss_bytes"] >= mem["pss_bytes"]


def test_cpu_launch_config(tmp_path):
    import yaml

    from trainstream_hf.train import processes

    path, env = processes.cpu_launch_config(tmp_path / "two.yaml", 2)
    cfg = yaml.safe_load(open(path))
    assert cfg["distributed_type"] == "MULTI_GPU" and cfg["num_processes"] == 2 and cfg["use_cpu"] is False
    assert 0 < cfg["main_process_port"] < 65536 and env["OMP_NUM_THREADS"] == "1"
    one = yaml.safe_load(open(processes.cpu_launch_config(tmp_path / "one.yaml", 1)[0]))
    assert one["distributed_type"] == "NO" and one["num_processes"] == 1
    with pytest.raises(ValueError, match="processes must be >= 1, got 0"):
        processes.cpu_launch_config(tmp_path / "none.yaml", 0)


def test_output_dir_is_checked_without_creating_it(tmp_path):
    report.check_output_dir(str(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="output_dir: .* exists and is not a directory"):
        report.check_output_dir(str(tmp_path / "file"))
    with pytest.raises(NotADirectoryError, match="cannot be created"):
        report.check_output_dir(str(tmp_path / "file" / "run"))


def test_vram_cap_is_refused_off_cuda_and_must_parse(monkeypatch):
    from trainstream_hf.train.config import ConfigError

    assert models.cap_vram(None, torch.device("cpu")) is None  # no cap: nothing to do anywhere
    with pytest.raises(ConfigError, match=r"vram_cap='24GiB' caps the CUDA allocator, but the device is cpu"):
        models.cap_vram("24GiB", torch.device("cpu"))
    with pytest.raises(ConfigError, match="vram_cap"):
        models.cap_vram("lots", torch.device("cpu"))
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 96 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    dev = torch.device("cuda", 0)
    assert models.cap_vram("24GiB", dev) == 24 * 2**30 and calls == [(0.25, dev)]
