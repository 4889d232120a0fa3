"""The trainstream side of the engine benchmark: wrap() under a VRAM budget, timed like every peer.

``python -m trainstream_hf.bench engine`` runs these rows beside the peers of :mod:`peers` in one process
(same model shapes, batch, harness), so every ratio in its table is against a peer measured in the same run.
"""
from __future__ import annotations

from typing import Optional

import torch

import trainstream_hf as ts
from trainstream_hf.bench.harness import measure_training
from trainstream_hf.bench.models import build_model, model_config
from trainstream_hf.bench.peers import LORA, _batch, _common, _plain_step

__all__ = ["trainstream_lora", "trainstream_quant", "trainstream_full", "trainstream_paged", "recipe_sft", "JOBS"]


def _engine_fields(model, fields: dict) -> None:
    eng = ts.engine_of(model)
    pl = eng.plan
    fields.update(predicted_peak=pl.predicted_peak(), paged_blocks=len(pl.paged_blocks),
                  offloaded_activation_blocks=len(pl.offloaded_activation_blocks), grads=pl.grads,
                  offloaded_optimizer_params=pl.offload_numel, resident_optimizer_params=pl.resident_numel,
                  streamed_optimizer_params=pl.streamed_numel, plan_step_floor=pl.predicted_step_floor(),
                  plan_pcie_bytes=pl.pcie_bytes(), plan_host_bytes=pl.host_bytes(),
                  plan_cpu_adam_pps=pl.cpu_adam_pps, plan_accumulation=pl.accumulation,
                  plan_recomputed_blocks=len(pl.recomputed_blocks), plan=str(pl).splitlines()[0])


def _with_stats(model, step, fields: dict):
    """The step, recording the engine's figures of the last completed step into the row."""
    def run():
        loss = step()
        fields["engine_stats"] = model.trainstream_stats()
        return loss
    return run


def _measure_wrapped(name: str, fields: dict, run_device, build, *, shape: str, batch: int, seq: int, seed: int,
                     warmup: int, repeats: int, vram_budget: Optional[int], accum: int = 1,
                     plan_budget: Optional[int] = None, **wrap_options) -> dict:
    """Times ``build()``'s (model, optimizer) wrapped with ``vram_budget`` (or ``plan_budget``, the plan's own
    budget under the cap ``vram_budget``), with the peers' training step (``accum`` micro-batches per optimizer
    step)."""
    if plan_budget is not None:
        fields["plan_budget"] = plan_budget

    def setup():
        model, opt = build()
        model, opt = ts.wrap(model, opt, vram_budget=plan_budget or vram_budget or "auto", batch_shape=(batch, seq),
                             gradient_accumulation_steps=accum, **wrap_options)
        _engine_fields(model, fields)
        return _with_stats(model, _plain_step(model, opt, _batch(shape, batch, seq, run_device, seed),
                                              accum=accum), fields), lambda: ts.unwrap(model)

    return measure_training(name, setup, device=run_device, warmup=warmup, repeats=repeats,
                            vram_budget=vram_budget, tokens=accum * batch * seq, fields=fields)


def _lora_model(shape: str, build_device, seed: int):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(build_model(shape, torch.bfloat16, build_device, seed), LoraConfig(**LORA))


def _built_in_place(shape: str, device: torch.device, seed: int, *, home, quantize: Optional[str] = None,
                    outliers: float = 0.0):
    """A random-weight bf16 model of ``shape`` built the way the recipes build one: piece by piece, each decoder
    block initialised on ``device`` (transformers' ``_init_weights``), packed when ``quantize`` is set, then moved
    to ``home`` (see :func:`trainstream_hf.train.model.materialize`). On a GPU, far faster than initialising a 32B
    model on the CPU, and never more than one dense block on the device."""
    from trainstream_hf.train.model import materialize, skeleton

    torch.manual_seed(seed)
    model = materialize(skeleton(model_config(shape), torch.bfloat16), device=device, home=home, quantize=quantize,
                        outliers=outliers)
    return model.train()


def trainstream_lora(shape: str = "llama3-8b", vram_budget: Optional[int] = 24 * 2**30, *, batch: int = 1,
                     seq: int = 2048, warmup: int = 3, repeats: int = 10, device=None, seed: int = 0,
                     **options) -> dict:
    """bf16 base + PEFT LoRA (the peers' settings), wrapped with ``vram_budget``; the loop is the peers'."""
    device, fields = _common("trainstream_lora", shape, False, batch, seq, device)
    name = f"trainstream bf16 + LoRA r16, budget {vram_budget / 2**30:.0f} GiB" if vram_budget else "trainstream"

    def build():
        model = _lora_model(shape, device, seed)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                        fused=device.type == "cuda")

    return _measure_wrapped(name, fields, device, build, shape=shape, batch=batch, seq=seq, seed=seed,
                            warmup=warmup, repeats=repeats, vram_budget=vram_budget, **options)


def trainstream_quant(shape: str = "llama3-8b", vram_budget: Optional[int] = 24 * 2**30, *, quantize: str = "nf4",
                      outliers: float = 0.0, batch: int = 1, seq: int = 2048, warmup: int = 3, repeats: int = 10,
                      device=None, seed: int = 0, **options) -> dict:
    """A quantized base (``quantize``, packed as it is built with ``outliers`` of the input channels kept in bf16;
    ``lm_head`` stays bf16) + LoRA r16 on all linear layers (the recipes' adapter:
    :func:`trainstream_hf.train.model.add_lora`), wrapped with ``vram_budget``; the loop is the peers'. The row to
    set beside bitsandbytes' QLoRA (``bnb``, ``bnb_ckpt``) in one run."""
    from trainstream_hf.train.model import add_lora

    device, fields = _common(f"trainstream_{quantize}", shape, False, batch, seq, device)
    fmt = f"{quantize}, {outliers:.0%} outliers" if outliers else quantize
    name = f"trainstream {fmt} + LoRA r16, budget {vram_budget / 2**30:.0f} GiB" if vram_budget \
        else f"trainstream {fmt} + LoRA r16"
    name += options.pop("name_suffix", "")

    def build():
        base = _built_in_place(shape, device, seed, home=device, quantize=quantize, outliers=outliers)
        model = add_lora(base, r=LORA["r"], alpha=LORA["lora_alpha"], dropout=LORA["lora_dropout"],
                         target_modules=LORA["target_modules"])
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                        fused=device.type == "cuda")

    return _measure_wrapped(name, fields, device, build, shape=shape, batch=batch, seq=seq, seed=seed,
                            warmup=warmup, repeats=repeats, vram_budget=vram_budget, **options)


def trainstream_full(shape: str = "llama3.2-3b", vram_budget: Optional[int] = 24 * 2**30, *, batch: int = 1,
                     seq: int = 2048, warmup: int = 2, repeats: int = 5, device=None, seed: int = 0, accum: int = 1,
                     **options) -> dict:
    """Full fine-tune: bf16 device weights, fp32 masters + AdamW moments offloaded (the plan splits their steps
    between the CPU AdamW and the device share); ``accum`` micro-batches per optimizer step."""
    device, fields = _common("trainstream_full", shape, False, batch, seq, device)
    fields["accum"] = accum
    if shape == "tiny":  # every tensor of the tiny model is below the default size limit: offload them anyway
        options.setdefault("min_offload_numel", 0)
    name = f"trainstream full FT, budget {vram_budget / 2**30:.0f} GiB" if vram_budget else "trainstream full FT"
    name += options.pop("name_suffix", "") + (f", {accum} micro-batches" if accum > 1 else "")

    def build():
        model = build_model(shape, torch.bfloat16, device, seed)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)

    return _measure_wrapped(name, fields, device, build, shape=shape, batch=batch, seq=seq, seed=seed,
                            warmup=warmup, repeats=repeats, vram_budget=vram_budget, offload_optimizer=True,
                            accum=accum, **options)


def trainstream_paged(shape: str = "qwen2.5-32b", vram_budget: Optional[int] = 24 * 2**30, *, batch: int = 1,
                      seq: int = 2048, warmup: int = 1, repeats: int = 3, device=None, seed: int = 0,
                      **options) -> dict:
    """bf16 base larger than the budget, built in host RAM, LoRA r16, wrapped onto the GPU: the plan pages
    block weights from the arena (and checkpoints or offloads activations as it sees fit)."""
    device, fields = _common("trainstream_paged", shape, False, batch, seq, device)
    name = f"trainstream bf16 paged + LoRA r16, budget {vram_budget / 2**30:.0f} GiB"

    def build():
        from peft import LoraConfig, get_peft_model

        # on a GPU each block is initialised there and moved to host RAM; on a CPU, built in place
        base = _built_in_place(shape, device, seed, home="cpu") if device.type == "cuda" \
            else build_model(shape, torch.bfloat16, "cpu", seed)
        model = get_peft_model(base, LoraConfig(**LORA))
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    return _measure_wrapped(name, fields, device, build, shape=shape, batch=batch, seq=seq, seed=seed,
                            warmup=warmup, repeats=repeats, vram_budget=vram_budget, device=device, **options)


RECIPE_CONFIGS = {"llama3-8b": "configs/llama3-8b-lora-nf4-24gib.yaml", "tiny": "configs/sft-tiny-cpu.yaml"}


def recipe_sft(shape: str, *, warmup: int, repeats: int, launcher: Optional[list] = None, **_) -> dict:
    """The nf4 LoRA recipe as a user runs it, ``accelerate launch --config_file configs/accelerate/single_gpu.yaml
    recipes/sft.py --config <config>``, in a child process of this run (so a ratio against the peers of the same
    run is a same-run ratio): its ``summary.json``'s median step over ``warmup + repeats`` steps, with bf16 autocast,
    clipping, the scheduler and a real data loader (the bench rows have none of these); ``losses``: the training
    losses it logged (every ``train.log_every`` steps). Needs the repository checkout (recipes/, configs/, data/).

    Args:
        shape: ``llama3-8b`` (configs/llama3-8b-lora-nf4-24gib.yaml) or ``tiny`` (configs/sft-tiny-cpu.yaml).
        warmup, repeats: their sum is the recipe's ``train.steps``.
        launcher: the command before ``recipes/sft.py`` (default the single-GPU accelerate launch).
    """
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    recipe = root / "recipes" / "sft.py"
    if shape not in RECIPE_CONFIGS:
        raise ValueError(f"recipe_sft: no recipe config for shape {shape!r}; known: {sorted(RECIPE_CONFIGS)}")
    if not recipe.exists():
        raise FileNotFoundError(f"recipe_sft needs the repository checkout: {recipe} not found")
    if launcher is None:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    str(root / "configs" / "accelerate" / "single_gpu.yaml")]
    with tempfile.TemporaryDirectory(prefix="bench-recipe-") as out:
        cmd = [*launcher, str(recipe), "--config", str(root / RECIPE_CONFIGS[shape]),
               "--train.steps", str(warmup + repeats), "--output_dir", out]
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise RuntimeError(f"recipe exited with status {done.returncode}:\n{tail}")
        summary = json.loads((Path(out) / "summary.json").read_text())
    peak = summary.get("peak_memory", {})
    step = summary["timing"]["median_step_seconds"]
    return {"name": f"recipes/sft.py {Path(RECIPE_CONFIGS[shape]).name} (accelerate launch, "
                    f"{summary.get('mixed_precision')} autocast)", "peer": "trainstream_recipe", "shape": shape,
            "status": "ok", "step_s": step, "tokens_per_s": summary["timing"].get("tokens_per_second"),
            "max_allocated": peak.get("bytes"), "max_reserved": peak.get("reserved_bytes"),
            "recipe_command": " ".join(cmd),
            "recipe_steps": summary.get("steps"),
            "losses": [v for _, v in summary.get("train_loss", {}).get("curve", [])]}


# key -> (group, function(shape, full_shape, budget, kw)) for the engine suite
JOBS = {
    "ts_lora": ("lora", lambda shape, full_shape, budget, kw: trainstream_lora(shape, budget, **kw)),
    "ts_nf4": ("lora", lambda shape, full_shape, budget, kw: trainstream_quant(shape, budget, quantize="nf4", **kw)),
    # the same with the Llama RMSNorms fused (fused_norms: same maths, not the same bits)
    "ts_nf4_fused_norms": ("lora", lambda shape, full_shape, budget, kw: trainstream_quant(
        shape, budget, quantize="nf4", fused_norms=True, name_suffix=", fused norms", **kw)),
    # the nf4 recipe itself, launched as a user launches it (a child process of this run)
    "recipe_nf4": ("lora", lambda shape, full_shape, budget, kw: recipe_sft(shape, **kw)),
    "ts_full": ("full", lambda shape, full_shape, budget, kw: trainstream_full(full_shape, budget, **kw)),
    # every offloaded parameter stepped by the CPU AdamW: no resident or streamed share (the plan before 2026-12-06)
    "ts_full_cpu": ("full", lambda shape, full_shape, budget, kw: trainstream_full(
        full_shape, budget, optimizer_resident=False, optimizer_streamed=False, name_suffix=", CPU AdamW only", **kw)),
    # the CPU share's moments in bf16, stochastically rounded (opt-in): the 8B full fine-tune's state in a 128 GiB host
    "ts_full_bf16m": ("full", lambda shape, full_shape, budget, kw: trainstream_full(
        full_shape, budget, optimizer_moments="bfloat16", name_suffix=", bf16 moments", **kw)),
    # the same with device gradients (the Trainer's setting: its clipping needs them), overlapped and serial steps
    "ts_full_devgrads": ("full", lambda shape, full_shape, budget, kw: trainstream_full(
        full_shape, budget, grads="device", name_suffix=", device grads", **kw)),
    "ts_full_serial": ("full", lambda shape, full_shape, budget, kw: trainstream_full(
        full_shape, budget, grads="device", overlap_step=False, name_suffix=", device grads, serial step", **kw)),
    # the CPU share's update applied one step late (optimizer_staleness=1, opt-in): it runs during the next step's
    # micro-batches instead of between steps
    "ts_full_stale": ("full", lambda shape, full_shape, budget, kw: trainstream_full(
        full_shape, budget, optimizer_staleness=1, name_suffix=", CPU share one step stale (opt-in)", **kw)),
    # each CPU AdamW update starts from backward's gradient hook instead of at step()
    "ts_full_inbwd": ("full", lambda shape, full_shape, budget, kw: trainstream_full(
        full_shape, budget, grads="host", optimizer_in_backward=True, name_suffix=", optimizer in backward", **kw)),
    # every block recomputed: the freed activation memory holds more resident optimizer state (less CPU and PCIe work)
    "ts_full_inbwd_rc": ("full", lambda shape, full_shape, budget, kw: trainstream_full(
        full_shape, budget, grads="host", optimizer_in_backward=True, recompute=True,
        name_suffix=", optimizer in backward, every block recomputed", **kw)),
    # the 32B shape is fixed: it is the "larger than the GPU budget" case of issue 3
    "ts_paged": ("paged", lambda shape, full_shape, budget, kw: trainstream_paged(
        "tiny" if shape == "tiny" else "qwen2.5-32b", budget,
        **{**kw, "warmup": min(kw["warmup"], 1), "repeats": min(kw["repeats"], 3)})),
}
