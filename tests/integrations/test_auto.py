"""TRAINSTREAM=on|auto|off: a stock Trainer script, unchanged, gets the engine (trainstream_hf.auto) - or, unset,
nothing at all. The scripts run in subprocesses, as users run them: through the launcher, accelerate launch, and the
.pth start-up hook."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

import trainstream_hf as ts
from trainstream_hf.auto import env_config, parse_value
from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.integrations.transformers import TrainStreamCallback, TrainStreamEnvCallback
from tests.helpers import run_script, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

STOCK = '''"""A stock Trainer script: nothing of trainstream_hf in it."""
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=32))
g = torch.Generator().manual_seed(7)
data = [{"input_ids": r, "labels": r} for r in torch.randint(0, 128, (16, 16), generator=g)]
args = TrainingArguments(output_dir=sys.argv[1], max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                         report_to="none", use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print("RESULT " + json.dumps({"log_history": trainer.state.log_history,
                              "callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks],
                              "weight_sum": sum(p.double().sum().item() for p in model.parameters())}))
'''

ENGINE = {"TRAINSTREAM": "on", "TRAINSTREAM_OFFLOAD_OPTIMIZER": "true", "TRAINSTREAM_MIN_OFFLOAD_NUMEL": "0",
          "TRAINSTREAM_VRAM_BUDGET": "64GiB"}


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    d = tmp_path_factory.mktemp("stock")
    (d / "stock.py").write_text(STOCK)
    return d / "stock.py"


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSTREAM")}
    env.update(extra)
    return env


def _run(cmd, extra, cwd) -> tuple[dict | None, subprocess.CompletedProcess]:
    r = subprocess.run(cmd, cwd=cwd, env=_env(extra), capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    return (json.loads(lines[-1][7:]) if lines else None), r


def _warm(script, args, extra, cwd, logs, module=False) -> tuple[dict | None, subprocess.CompletedProcess]:
    """:func:`_run` forked from the warm server (tests.helpers.run_script): for runs that do not test what happens
    before torch is imported."""
    r = run_script(str(script), *map(str, args), cwd=cwd, logs=logs, env=extra, module=module)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    return (json.loads(lines[-1][7:]) if lines else None), r


def _engine_ran(result: dict) -> bool:
    logged = [h for h in result["log_history"] if "loss" in h]
    return len(logged) == 4 and all("trainstream/h2d_GBps" in h for h in logged[1:])  # step 1 closes at step 2


@pytest.fixture(scope="module")
def plain(script):
    """The script as it is, no variables: the reference run."""
    result, r = _warm(script, [script.parent / "out"], {}, script.parent, script.parent / "plain-logs")
    assert r.returncode == 0, r.stderr
    return result


@pytest.mark.slow
def test_unset_changes_nothing(script, plain, tmp_path):
    """With the .pth start-up hook installed but TRAINSTREAM unset (or off), the launcher and the hook leave the
    script exactly as it was: same callbacks, no figures, same weights."""
    assert plain["callbacks"] == ["DefaultFlowCallback", "PrinterCallback"]
    assert not any(k.startswith("trainstream/") for h in plain["log_history"] for k in h)
    site = tmp_path / "site"
    subprocess.run([PY, "-m", "trainstream_hf.auto", "--install", "--site-dir", str(site)], check=True, cwd=ROOT,
                   env=_env({}), capture_output=True)
    boot = f"import site, runpy, sys; site.addsitedir({str(site)!r}); sys.argv = sys.argv[1:]; " \
           "assert 'trainstream_hf_autostart' not in sys.modules; runpy.run_path(sys.argv[0], run_name='__main__')"
    # unset (options alone do nothing) through the start-up hook; off (options not even read) through the launcher
    hooked = _run([PY, "-c", boot, str(script), str(tmp_path / "out")], {"TRAINSTREAM_VRAM_BUDGET": "1GiB"}, ROOT)
    launched = _warm("trainstream_hf.auto", [script, tmp_path / "out"],
                     {"TRAINSTREAM": "off", "TRAINSTREAM_BOGUS": "x"}, ROOT, tmp_path / "logs", module=True)
    for result, r in (hooked, launched):
        assert r.returncode == 0, r.stderr
        assert result["callbacks"] == plain["callbacks"] and result["weight_sum"] == plain["weight_sum"]
        assert "trainstream_hf" not in r.stderr


@pytest.mark.slow
def test_accelerate_launch_installs_the_engine(script, plain, tmp_path):
    """TRAINSTREAM=on with a stock accelerate config: the Trainer gets TrainStreamEnvCallback, the engine
    trains (figures in the log history), the log says so, and the weights match the plain run."""
    cfg = tmp_path / "cpu.yaml"
    cfg.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: 'no'\n"
                   "num_machines: 1\nnum_processes: 1\nuse_cpu: true\n")
    accelerate = str(Path(PY).parent / "accelerate")
    result, r = _run([accelerate, "launch", "--config_file", str(cfg), "-m", "trainstream_hf.auto", str(script),
                      str(tmp_path / "out")], ENGINE, ROOT)
    assert r.returncode == 0, r.stderr
    # first after train begin: the reporting callbacks see its figures (TrainStreamCallback._go_first)
    assert result["callbacks"] == ["TrainStreamEnvCallback", "DefaultFlowCallback", "PrinterCallback"]
    assert _engine_ran(result)
    assert "trainstream_hf: TRAINSTREAM=on installed the engine in LlamaForCausalLM" in r.stderr
    assert "offload_optimizer=True" in r.stderr
    assert abs(result["weight_sum"] - plain["weight_sum"]) < 1e-3
    losses = [h["loss"] for h in result["log_history"] if "loss" in h]
    assert all(abs(a - b["loss"]) < 1e-4 for a, b in zip(losses, [h for h in plain["log_history"] if "loss" in h]))


@pytest.mark.slow
def test_accelerate_launch_two_processes(script, tmp_path):
    """TRAINSTREAM=on under a 2-process launch (torchrun underneath, gloo: the script asks for the CPU): the env
    callback installs the engine in each process at the first step, after Accelerate built DDP around the model; the
    engine sees the process group (gradients stay on the device for DDP to average) and steps the optimizer on the
    host. Both processes end with the same weights, and the same losses and weights as the plain 2-process run; both
    exit cleanly (the engine's exit handler lets gloo's worker threads finish with the interpreter alive:
    engine/distributed.py, settle_collectives_at_exit)."""
    from trainstream_hf.train.processes import cpu_launch_config

    cfg, extra = cpu_launch_config(tmp_path / "two.yaml", 2)
    accelerate = str(Path(PY).parent / "accelerate")
    # The reference run, without trainstream, aborts at exit in ~1 of 3 runs here from that same torch race (measured:
    # "the plain run" failed 2 of 6): it runs through a wrapper with the engine's mitigation, a GIL-free pause at exit.
    plain = tmp_path / "plain.py"
    plain.write_text("import atexit, runpy, sys, time\natexit.register(time.sleep, 0.1)\n"
                     "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    runs = {}
    for name, launch, env in (("plain", [str(plain), str(script)], extra),
                              ("engine", ["-m", "trainstream_hf.auto", str(script)], {**ENGINE, **extra})):
        r = subprocess.run([accelerate, "launch", "--config_file", cfg, *launch, str(tmp_path / name)],
                           cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"the {name} run: {r.stderr[-4000:]}"
        # both processes print: their lines may interleave, so read the numbers, not the JSON
        runs[name] = ([float(v) for v in re.findall(r'"loss": ([0-9.e+-]+)', r.stdout)],
                      [float(v) for v in re.findall(r'"weight_sum": ([0-9.e+-]+)', r.stdout)], r.stderr)
    (plain_losses, plain_sums, _), (losses, sums, err) = runs["plain"], runs["engine"]
    # gradients stay on the device for DDP to average (the plan's first line says where they are)
    assert err.count("TRAINSTREAM=on installed the engine") == 2 and err.count("gradients on device") == 2
    assert len(sums) == 2 and sums[0] == sums[1]  # the replicas agree
    assert len(plain_sums) == 2 and abs(sums[0] - plain_sums[0]) < 1e-6 * abs(plain_sums[0])
    assert len(losses) == len(plain_losses) == 8
    assert max(abs(a - b) for a, b in zip(sorted(losses), sorted(plain_losses))) < 1e-4


@pytest.mark.slow
def test_startup_hook_installs_the_engine(script, tmp_path):
    """After `--install`, a plain `python script.py` (here: a site dir processed as at start-up) with TRAINSTREAM=on
    gets the engine; `--uninstall` removes the files."""
    site = tmp_path / "site"
    subprocess.run([PY, "-m", "trainstream_hf.auto", "--install", "--site-dir", str(site)], check=True, cwd=ROOT,
                   env=_env({}), capture_output=True)
    assert sorted(p.name for p in site.iterdir()) == ["trainstream_hf_autostart.pth", "trainstream_hf_autostart.py"]
    boot = f"import site, runpy, sys; site.addsitedir({str(site)!r}); sys.argv = sys.argv[1:]; " \
           "assert 'torch' not in sys.modules and 'trainstream_hf' not in sys.modules; " \
           "runpy.run_path(sys.argv[0], run_name='__main__')"
    result, r = _run([PY, "-c", boot, str(script), str(tmp_path / "out")], ENGINE, script.parent)
    assert r.returncode == 0, r.stderr
    assert "TrainStreamEnvCallback" in result["callbacks"] and _engine_ran(result)
    # a bad variable stops the Trainer, naming it and what it accepts
    _, r = _run([PY, "-c", boot, str(script), str(tmp_path / "out")], {**ENGINE, "TRAINSTREAM_GRADS": "sideways"},
                script.parent)
    assert r.returncode != 0
    assert "TRAINSTREAM_GRADS='sideways': grads: 'auto', 'device' or 'host', got 'sideways'" in r.stderr
    subprocess.run([PY, "-m", "trainstream_hf.auto", "--uninstall", "--site-dir", str(site)], check=True, cwd=ROOT,
                   env=_env({}), capture_output=True)
    assert list(site.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    ({"TRAINSTREAM": "yes"}, "TRAINSTREAM='yes': 'auto', 'on' or 'off'"),
    ({"TRAINSTREAM": "on", "TRAINSTREAM_VRAM": "1GiB"},
     "TRAINSTREAM_VRAM: unknown trainstream option 'vram' (did you mean TRAINSTREAM_VRAM_BUDGET?); the options are "
     "TRAINSTREAM_QUANTIZE, TRAINSTREAM_OUTLIERS, TRAINSTREAM_VRAM_BUDGET"),
])
def test_launcher_refuses_bad_variables_before_the_script(script, tmp_path, extra, message):
    _, r = _warm("trainstream_hf.auto", [script, tmp_path / "out"], extra, ROOT, tmp_path / "logs", module=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith(f"trainstream_hf.auto: {message}")
    assert not (tmp_path / "out").exists()  # the script never started


# -- in-process: the variables and the callback ----------------------------------------------------------------
def test_env_config_parsing():
    assert env_config({}) == ("off", None)
    assert env_config({"TRAINSTREAM": "off", "TRAINSTREAM_NOPE": "1"}) == ("off", None)  # off: options not read
    mode, cfg = env_config({"TRAINSTREAM": " Auto ", "TRAINSTREAM_VRAM_BUDGET": "24GiB", "TRAINSTREAM_QUANTIZE": "nf4",
                            "TRAINSTREAM_OFFLOAD_OPTIMIZER": "true", "TRAINSTREAM_SLOTS": "3",
                            "TRAINSTREAM_BATCH_SHAPE": "1,2048", "TRAINSTREAM_HOST_ARENA": "none",
                            "TRAINSTREAM_OUTLIERS": "0.01", "TRAINSTREAM_TRACE": "/tmp/t.json",
                            "TRAINSTREAM_CUDA": "1", "TRAINSTREAM_CPU_ISA": "avx2", "TRAINSTREAM_FP8_GEMM": "cublaslt"})
    assert mode == "auto"
    assert cfg == TrainStreamConfig(vram_budget="24GiB", quantize="nf4", offload_optimizer=True, slots=3,
                                    batch_shape=(1, 2048), host_arena=None, outliers=0.01)
    assert parse_value("0.5") == 0.5 and parse_value("FALSE") is False and parse_value("2GiB") == "2GiB"
    assert env_config({"TRAINSTREAM_VRAM_BUDGET": "1GiB"}, default="auto")[1].vram_budget == "1GiB"
    # 1 / 0 switch an option that takes a bool; a number stays a number elsewhere
    _, cfg = env_config({"TRAINSTREAM": "on", "TRAINSTREAM_FUSED_NORMS": "1", "TRAINSTREAM_COMPILE_BLOCKS": "1",
                         "TRAINSTREAM_PAGE_WEIGHTS": "0", "TRAINSTREAM_SLOTS": "1", "TRAINSTREAM_PREFETCH": "0"})
    assert (cfg.fused_norms, cfg.compile_blocks, cfg.page_weights, cfg.slots, cfg.prefetch) == (True, True, False, 1, 0)
    assert env_config({"TRAINSTREAM": "on", "TRAINSTREAM_COMPILE_BLOCKS": "aot_eager"})[1].compile_blocks == "aot_eager"


@pytest.mark.parametrize("env, match", [
    ({"TRAINSTREAM_QUANTIZE": "int3"},
     r"TRAINSTREAM_QUANTIZE='int3': quantize: unknown format 'int3'; "
     r"choose one of None, 'int8', 'nf4', 'fp8', 'nvfp4'"),
    ({"TRAINSTREAM_PAGE_WEIGHTS": "maybe"}, r"TRAINSTREAM_PAGE_WEIGHTS='maybe': page_weights: 'auto', True or False"),
    ({"TRAINSTREAM_VRAM_BUDGET": "lots"}, r"TRAINSTREAM_VRAM_BUDGET='lots': vram_budget: cannot parse 'lots'"),
    ({"TRAINSTREAM_SLOTS": "0"}, r"TRAINSTREAM_SLOTS='0': slots: an int >= 1, got 0"),
    ({"TRAINSTREAM_PAGE_WEIGHT": "true"}, r"TRAINSTREAM_PAGE_WEIGHT: unknown trainstream option 'page_weight' "
                                          r"\(did you mean TRAINSTREAM_PAGE_WEIGHTS\?\)"),
])
def test_env_config_names_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        env_config({"TRAINSTREAM": "on", **env})
    with pytest.raises(ValueError, match=match):  # the callback checks when the Trainer builds it
        TrainStreamEnvCallback({"TRAINSTREAM": "on", **env})


def _model():
    return tiny_llama(vocab=128)


def _data():
    g = torch.Generator().manual_seed(7)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, 128, (16, 16), generator=g)]


ARGS = dict(max_steps=3, per_device_train_batch_size=4, logging_steps=1, report_to="none", use_cpu=True,
            save_strategy="no", disable_tqdm=True, learning_rate=1e-2)


def test_the_scripts_own_callback_wins(tmp_path):
    """A Trainer that installs the engine itself keeps its own options: the environment's callback (first in the
    list, as DEFAULT_CALLBACKS puts it) waits for the first step and finds the engine installed."""
    env_cb = TrainStreamEnvCallback({"TRAINSTREAM": "on", "TRAINSTREAM_OFFLOAD_OPTIMIZER": "false"})
    own = TrainStreamCallback(offload_optimizer=True, min_offload_numel=0, vram_budget="64GiB")
    model = _model()
    seen = {}

    class Spy(TrainStreamCallback.__mro__[1]):
        def on_step_end(self, args, state, control, model=None, **kw):
            seen.setdefault("config", ts.engine_of(model).config)

    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **ARGS), train_dataset=_data(),
                      callbacks=[env_cb, own, Spy()])
    trainer.train()
    assert env_cb.model is None and seen["config"].offload_optimizer is True
    assert own.last["optimizer"]["offloaded_params"] > 0 and ts.engine_of(model) is None


def test_quantize_packs_a_peft_models_frozen_base(tmp_path):
    """TRAINSTREAM_QUANTIZE=nf4 on a stock PEFT script: the frozen base linears are packed in place at the first
    step (adapters and head untouched), the adapters train, and the Trainer's optimizer keeps working."""
    from peft import LoraConfig, get_peft_model

    from trainstream_hf.quant import QuantLinear

    model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    cb = TrainStreamEnvCallback({"TRAINSTREAM": "on", "TRAINSTREAM_QUANTIZE": "nf4",
                                 "TRAINSTREAM_VRAM_BUDGET": "64GiB"})
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **ARGS), train_dataset=_data(),
                      callbacks=[cb])
    trainer.train()
    assert len(cb.quantized) == 14  # 2 layers x 7 linears: q/v through their LoRA base_layer
    attn = model.base_model.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj.base_layer, QuantLinear) and isinstance(attn.k_proj, QuantLinear)
    assert type(attn.q_proj.lora_A["default"]) is torch.nn.Linear
    assert type(model.base_model.model.lm_head) is torch.nn.Linear
    moved = max((p - before[n]).abs().max().item() for n, p in model.named_parameters() if p.requires_grad)
    assert moved > 1e-4
    assert any("trainstream/step_seconds" in h for h in trainer.state.log_history)


@pytest.mark.parametrize("way_back", ["merge", "dequantize"])
def test_after_quantize_the_users_model_dequantizes_merges_and_saves(tmp_path, way_back):
    """TRAINSTREAM_QUANTIZE packs the user's model in place; after train() it is a quantized transformers model like
    a loaded one: merge_and_unload() then save_pretrained gives a quantized checkpoint that reloads exactly (the
    layers without adapters stay packed) and, after dequantize(), a plain one stock transformers loads; or
    dequantize() first gives dense layers back (equal to the packed weights decoded) and the adapters save."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainstream_hf.quant import QuantLinear

    model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    cb = TrainStreamEnvCallback({"TRAINSTREAM": "on", "TRAINSTREAM_QUANTIZE": "nf4",
                                 "TRAINSTREAM_VRAM_BUDGET": "64GiB"})
    Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **ARGS), train_dataset=_data(),
            callbacks=[cb]).train()
    base = model.get_base_model()
    assert base.is_quantized and base.config.quantization_config.quantize == "nf4"
    assert base.config._is_quantized and base.is_loaded_in_8bit  # as transformers' postprocess_model leaves a loaded one
    assert base.hf_quantizer.targets == {n for n, m in base.named_modules() if isinstance(m, QuantLinear)}
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(4))
    if way_back == "merge":
        merged = model.merge_and_unload()  # q/v dense with their LoRA delta; the layers without adapters stay packed
        assert isinstance(merged.model.layers[0].self_attn.k_proj, QuantLinear)
        with torch.no_grad():
            want = merged.eval()(ids).logits
        merged.save_pretrained(tmp_path / "packed")  # those packed, as a quantized checkpoint
        with torch.no_grad():
            assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "packed").eval()(ids).logits, want)
        merged.dequantize()  # and now every layer dense: a plain checkpoint
        assert not any(isinstance(m, QuantLinear) for m in merged.modules())
        with torch.no_grad():
            want = merged(ids).logits
        merged.save_pretrained(tmp_path / "merged")
        assert "quantization_config" not in (tmp_path / "merged" / "config.json").read_text()
        with torch.no_grad():
            assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits, want)
    else:
        packed = model.base_model.model.model.layers[0].self_attn.k_proj
        decoded = packed.dequantize_weight()
        base.dequantize()
        dense = model.base_model.model.model.layers[0].self_attn.k_proj
        assert type(dense) is torch.nn.Linear and torch.equal(dense.weight, decoded)
        assert not any(isinstance(m, QuantLinear) for m in model.modules()) and not base.is_quantized
        model.save_pretrained(tmp_path / "adapters")
        assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()


def test_quantize_needs_a_frozen_base(tmp_path):
    cb = TrainStreamEnvCallback({"TRAINSTREAM": "on", "TRAINSTREAM_QUANTIZE": "int8"})
    trainer = Trainer(model=_model(), args=TrainingArguments(output_dir=str(tmp_path), **ARGS), train_dataset=_data(),
                      callbacks=[cb])
    with pytest.raises(ValueError, match="packs frozen linear layers, and this model has none"):
        trainer.train()


def test_auto_is_off_without_a_gpu():
    cb = TrainStreamEnvCallback({"TRAINSTREAM": "auto"})
    assert cb.active() == torch.cuda.is_available()


def test_every_option_has_one_trainer_argument_and_one_variable_with_one_parser():
    """The Trainer arguments and the environment variables are made from TrainStreamConfig's fields and read by one
    parser: the same text gives the same option through both routes."""
    from dataclasses import fields

    from trainstream_hf import TrainStreamConfig
    from trainstream_hf.integrations.transformers import TrainStreamTrainingArguments

    names = [f.name for f in fields(TrainStreamConfig)]
    assert all(f"trainstream_{n}" in TrainStreamTrainingArguments.__dataclass_fields__ for n in names)
    text = {"vram_budget": "0.5", "batch_shape": "1,2048", "offload_optimizer": "false", "prefetch": "0",
            "min_activation_bytes": "2MiB", "quantize": "nvfp4", "outliers": "0.01", "fused_loss": "true"}
    args = TrainStreamTrainingArguments(output_dir="out", use_cpu=True, report_to=[],
                                        **{f"trainstream_{k}": v for k, v in text.items()})
    _, from_env = env_config({"TRAINSTREAM": "on", **{f"TRAINSTREAM_{k.upper()}": v for k, v in text.items()}})
    assert args.trainstream_config() == from_env
    assert from_env.vram_budget == 0.5 and from_env.batch_shape == (1, 2048) and from_env.fused_loss is True
    with pytest.raises(ValueError, match=r"trainstream_prefetch='9': prefetch: an int in \[0, slots - 1\]"):
        TrainStreamTrainingArguments(output_dir="out", use_cpu=True, report_to=[], trainstream_prefetch="9")
