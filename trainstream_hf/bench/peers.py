"""The peers trainstream is judged against, each timed the same way on the same random model and batch.

``python -m trainstream_hf.bench peers [--quick] [--shape llama3-8b] [--full-shape llama3.2-3b] ...``

Every peer is a function returning one result row::

    {"name", "peer", "shape", "grad_ckpt", "batch", "seq", "step_s", "tokens_per_s",
     "max_allocated", "max_reserved", "status", ...}

``status`` is ``"ok"``, ``"oom"`` or ``"not run: <reason>"``; a CUDA out-of-memory is a result, never a
crash. ``step_s`` is the median of ``repeats`` steps after ``warmup`` steps (CUDA events on CUDA,
``perf_counter`` on CPU); memory is ``torch.cuda.max_memory_*`` over the timed steps only (peak stats are
reset after warm-up), in bytes. They are timed by :func:`trainstream_hf.bench.harness.measure_training`,
which the trainstream side of the benchmark calls too.
"""
from __future__ import annotations

import atexit
import gc
import importlib.util
import logging
import os
import sys
import time
from typing import Callable, Optional

import torch

from trainstream_hf.bench.common import markdown_table, median_time
from trainstream_hf.bench.harness import Step, default_device, free_memory, measure_training, not_run
from trainstream_hf.bench.models import build_model, make_batch, model_config
from trainstream_hf.train.processes import free_port
from trainstream_hf.train.baseline import nf4_linear, quantize_linears_nf4_  # noqa: F401 (nf4_linear: bench.quant)

GiB, MiB = 2**30, 2**20
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def _common(peer: str, shape: str, grad_ckpt: bool, batch: int, seq: int, device) -> tuple[torch.device, dict]:
    device = torch.device(device) if device is not None else default_device()
    return device, dict(peer=peer, shape=shape, grad_ckpt=grad_ckpt, batch=batch, seq=seq)


def _batch(shape: str, batch: int, seq: int, device, seed: int) -> dict:
    return make_batch(batch, seq, model_config(shape).vocab_size, device, seed)


def _enable_checkpointing(model, frozen_base: bool) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if frozen_base:
        # Not needed with use_reentrant=False (it is for the reentrant variant, whose checkpointed blocks
        # must see an input that requires grad), but it is what PEFT recipes do, so the peer does it too.
        model.enable_input_require_grads()


def _plain_step(model, opt, inputs, autocast: Optional[torch.dtype] = None, accum: int = 1) -> Step:
    """One optimizer step over ``accum`` micro-batches (the same batch each time; the loss scaled by 1 / accum)."""
    dev_type = inputs["input_ids"].device.type

    def step():
        for _ in range(accum):
            with torch.autocast(dev_type, dtype=autocast, enabled=autocast is not None):
                loss = model(**inputs).loss
            (loss / accum if accum > 1 else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _lora_optimizer(model, device: torch.device):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")


def peft_lora(shape: str = "llama3-8b", grad_ckpt: bool = False, *, batch: int = 1, seq: int = 2048,
              warmup: int = 3, repeats: int = 10, device=None, vram_budget: Optional[int] = None,
              seed: int = 0) -> dict:
    """bf16 base + PEFT LoRA (r=16, alpha 32, all linear layers but the LM head), AdamW on the adapters.

    Args:
        shape: a key of :data:`trainstream_hf.bench.models.SHAPES`.
        grad_ckpt: transformers gradient checkpointing (non-reentrant) on every decoder layer.
        batch, seq: batch shape of random tokens.
        warmup, repeats: see :func:`trainstream_hf.bench.harness.measure_training`.
        device: default CUDA when available, else CPU.
        vram_budget: allocator cap in bytes (None: whole GPU).
        seed: model and batch seed.

    Returns:
        The result row, with ``trainable_params``.
    """
    device, fields = _common("peft_lora", shape, grad_ckpt, batch, seq, device)
    name = f"bf16 + PEFT LoRA r16{', grad ckpt' if grad_ckpt else ''}"

    def setup():
        from peft import LoraConfig, get_peft_model

        model = build_model(shape, torch.bfloat16, device, seed)
        if grad_ckpt:
            _enable_checkpointing(model, frozen_base=True)
        model = get_peft_model(model, LoraConfig(**LORA))
        fields["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        opt = _lora_optimizer(model, device)
        return _plain_step(model, opt, _batch(shape, batch, seq, device, seed)), None

    return measure_training(name, setup, device=device, warmup=warmup, repeats=repeats,
                            vram_budget=vram_budget, tokens=batch * seq, fields=fields)


def bnb_qlora(shape: str = "llama3-8b", grad_ckpt: bool = False, *, batch: int = 1, seq: int = 2048,
              warmup: int = 3, repeats: int = 10, device=None, vram_budget: Optional[int] = None,
              seed: int = 0, prepare_kbit: bool = False) -> dict:
    """QLoRA: bitsandbytes NF4 base (bf16 compute, double quant) + PEFT LoRA r=16 on all linear layers.

    The bf16 model is built on the GPU and quantized layer by layer before the VRAM cap applies (a small
    GPU would load a pre-quantized checkpoint instead). Embeddings, norms and the LM head stay bf16.

    ``peft.prepare_model_for_kbit_training`` is not called by default: it casts every non-4-bit
    bf16/fp16 parameter to fp32 (embeddings, LM head, norms: 1.05 B parameters, +2.1 GB, for Llama-3-8B),
    which makes the residual stream and the LM head GEMM fp32 unless the step runs under autocast. Its
    other duties (freeze the base, non-reentrant checkpointing, input grads) are done here directly.
    ``prepare_kbit=True`` calls it and runs the step under bf16 autocast, as Trainer(bf16=True) would.

    Args:
        shape, grad_ckpt, batch, seq, warmup, repeats, device, vram_budget, seed: as :func:`peft_lora`.
        prepare_kbit: use ``prepare_model_for_kbit_training`` (+ bf16 autocast) instead.

    Returns:
        The result row; ``status`` is ``"not run: ..."`` without bitsandbytes or CUDA.
    """
    device, fields = _common("bnb_qlora", shape, grad_ckpt, batch, seq, device)
    name = f"bnb NF4 + PEFT LoRA r16{', grad ckpt' if grad_ckpt else ''}{', kbit-prep' if prepare_kbit else ''}"
    if importlib.util.find_spec("bitsandbytes") is None:
        return not_run(name, "bitsandbytes not installed", **fields)
    if device.type != "cuda":
        return not_run(name, "requires CUDA", **fields)
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a broken install is a reason, not a crash
        return not_run(name, f"bitsandbytes import failed: {type(err).__name__}: {err}", **fields)
    held = {}

    def build():
        model = build_model(shape, torch.bfloat16, device, seed)
        fields["quantized_linears"] = quantize_linears_nf4_(model, device)
        held["model"] = model

    def setup():
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        model = held.pop("model")
        if prepare_kbit:
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=grad_ckpt,
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.requires_grad_(False)
            if grad_ckpt:
                _enable_checkpointing(model, frozen_base=True)
        model = get_peft_model(model, LoraConfig(**LORA))
        fields["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        opt = _lora_optimizer(model, device)
        inputs = _batch(shape, batch, seq, device, seed)
        return _plain_step(model, opt, inputs, torch.bfloat16 if prepare_kbit else None), None

    try:
        return measure_training(name, setup, build=build, device=device, warmup=warmup, repeats=repeats,
                                vram_budget=vram_budget, tokens=batch * seq, fields=fields)
    finally:
        held.clear()
        free_memory()


def torch_full(shape: str = "llama3.2-3b", grad_ckpt: bool = False, *, batch: int = 1, seq: int = 2048,
               warmup: int = 3, repeats: int = 10, device=None, vram_budget: Optional[int] = None,
               seed: int = 0, accum: int = 1) -> dict:
    """Full fine-tune in plain PyTorch: fp32 master parameters, bf16 autocast, fused AdamW on the device.

    Args:
        shape, grad_ckpt, batch, seq, warmup, repeats, device, vram_budget, seed: as :func:`peft_lora`.
        accum: micro-batches per optimizer step (gradient accumulation); tokens per step = accum x batch x seq.

    Returns:
        The result row, with ``params``.
    """
    device, fields = _common("torch_full", shape, grad_ckpt, batch, seq, device)
    fields["accum"] = accum
    name = f"torch AdamW fused, fp32 master + bf16 autocast{', grad ckpt' if grad_ckpt else ''}" + \
        (f", {accum} micro-batches" if accum > 1 else "")

    def setup():
        model = build_model(shape, torch.float32, device, seed)
        if grad_ckpt:
            _enable_checkpointing(model, frozen_base=False)
        fields["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
        return _plain_step(model, opt, _batch(shape, batch, seq, device, seed), torch.bfloat16, accum), None

    return measure_training(name, setup, device=device, warmup=warmup, repeats=repeats,
                            vram_budget=vram_budget, tokens=accum * batch * seq, fields=fields)


def _init_single_rank(deepspeed) -> None:
    """A 1-rank NCCL group over env:// (a free local port), unless one exists or a launcher set one up."""
    if torch.distributed.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False, verbose=False)
    atexit.register(torch.distributed.destroy_process_group)


def zero2_offload_config(batch: int, **overrides) -> dict:
    """DeepSpeed config: ZeRO-2, optimizer states on the CPU (pinned), bf16, AdamW from the config.

    The bucket sizes are those of the transformers DeepSpeed docs' ZeRO-2 example. With the optimizer in
    the config and ``offload_optimizer`` on, DeepSpeed builds ``DeepSpeedCPUAdam(adamw_mode=True)``.
    """
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "allgather_partitions": True, "allgather_bucket_size": int(2e8),
            "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": int(2e8),
            "contiguous_gradients": True,
        },
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    config.update(overrides)
    return config


def zero3_offload_config(batch: int, **overrides) -> dict:
    """:func:`zero2_offload_config` at ZeRO stage 3 with the parameters offloaded to pinned host memory too
    (``offload_param``), the settings of the DeepSpeed docs' ZeRO-Infinity CPU example."""
    config = zero2_offload_config(batch)
    config["zero_optimization"] = {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": int(2e8),
        "stage3_prefetch_bucket_size": int(2e8), "stage3_param_persistence_threshold": int(1e5),
    }
    config.update(overrides)
    return config


# Host bytes per trainable parameter DeepSpeed's own estimate (deepspeed.runtime.zero.stage3's
# estimate_zero3_model_states_mem_needs) counts for a CPU-offloaded optimizer: the fp32 master (4), both moments (8)
# and fp32 gradients (4); ZeRO-3's offloaded parameters add their 16-bit copy (2).
DEEPSPEED_HOST_BYTES = {2: 16, 3: 18}


def _deepspeed_host_shortfall(shape: str, stage: int, available: Optional[int] = None) -> Optional[str]:
    """Why a full fine-tune of ``shape`` under DeepSpeed ZeRO-``stage`` with CPU offload cannot fit this host's RAM
    (its estimate against ``MemAvailable``), or None where it may. Checked before the row starts: a peer that fills
    the host is killed by the kernel, and the whole suite's process with it (the 8B ZeRO-3 row on a 128 GiB host,
    benchmarks/results/gpu-round-h100-84d38cc.txt)."""
    from trainstream_hf.engine.arena import host_memory_available

    available = host_memory_available() if available is None else available
    if available is None:
        return None
    numel = sum(p.numel() for p in build_model(shape, torch.bfloat16, "meta").parameters())
    need = DEEPSPEED_HOST_BYTES[stage] * numel
    if need <= available:
        return None
    return (f"host RAM: DeepSpeed's estimate for ZeRO-{stage} with CPU offload is {DEEPSPEED_HOST_BYTES[stage]} bytes "
            f"per parameter, {need / 2**30:.0f} GiB for {numel / 1e9:.2f} B parameters, and this host has "
            f"{available / 2**30:.0f} GiB available")


def deepspeed_zero2_offload(shape: str = "llama3.2-3b", grad_ckpt: bool = False,
                            vram_budget: Optional[int] = None, *, batch: int = 1, seq: int = 2048,
                            warmup: int = 3, repeats: int = 10, device=None, seed: int = 0,
                            ds_overrides: Optional[dict] = None, lora: bool = False, accum: int = 1,
                            stage: int = 2) -> dict:
    """Full fine-tune with DeepSpeed ZeRO-2 + CPU optimizer offload (DeepSpeedCPUAdam), one process; with ``lora``,
    PEFT LoRA (the peers' r16 on every linear layer) over the frozen bf16 base instead, DeepSpeed holding the
    adapters' optimizer state in host RAM (lr 1e-4, the other LoRA rows').

    The cpu_adam op JIT-compiles with ninja on first use (about a minute); it is built before the clock
    starts, and a failed build is reported as ``"not run: ..."``.

    Args:
        shape, grad_ckpt, batch, seq, warmup, repeats, device, seed: as :func:`peft_lora`.
        vram_budget: allocator cap in bytes (the reference run uses 24 GiB).
        ds_overrides: top-level keys replacing those of :func:`zero2_offload_config`.
        accum: micro-batches per optimizer step (DeepSpeed's ``gradient_accumulation_steps``).
        stage: 2, or 3 (ZeRO-3 with the parameters offloaded to the CPU too, :func:`zero3_offload_config`: the peer of
            a full fine-tune whose weights do not fit the GPU).

    Returns:
        The result row; ``status`` is ``"not run: ..."`` without deepspeed, its op, or CUDA, and for a full
        fine-tune whose states DeepSpeed's estimate puts above the host's available RAM (the row would be killed).
    """
    device, fields = _common(f"deepspeed_zero{stage}_offload" + ("_lora" if lora else ""), shape, grad_ckpt, batch,
                             seq, device)
    if stage not in (2, 3):
        raise ValueError(f"deepspeed_zero2_offload: stage 2 or 3, got {stage!r}")
    name = (f"DeepSpeed ZeRO-{stage}{' + PEFT LoRA r16' if lora else ''}, offload_optimizer cpu"
            f"{', offload_param cpu' if stage == 3 else ''}, bf16"
            f"{', grad ckpt' if grad_ckpt else ''}" + (f", {accum} micro-batches" if accum > 1 else ""))
    fields["accum"] = accum
    if importlib.util.find_spec("deepspeed") is None:
        return not_run(name, "deepspeed not installed", **fields)
    if device.type != "cuda":
        return not_run(name, "requires CUDA", **fields)
    if importlib.util.find_spec("cpuinfo") is None:  # DeepSpeedCPUAdam imports it unconditionally
        return not_run(name, "py-cpuinfo not installed (DeepSpeedCPUAdam needs it)", **fields)
    try:
        import deepspeed
        from deepspeed.ops.op_builder import CPUAdamBuilder

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    except Exception as err:  # noqa: BLE001
        return not_run(name, f"deepspeed import failed: {type(err).__name__}: {err}", **fields)
    try:
        t0 = time.perf_counter()
        CPUAdamBuilder().load()
        fields["op_build_s"] = time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001
        return not_run(name, f"deepspeed cpu_adam op failed to build: {type(err).__name__}: {err}", **fields)
    if not lora:
        short = _deepspeed_host_shortfall(shape, stage)
        if short is not None:
            return not_run(name, short, **fields)
    try:
        _init_single_rank(deepspeed)
    except Exception as err:  # noqa: BLE001
        return not_run(name, f"1-rank process group failed: {type(err).__name__}: {err}", **fields)
    config = (zero2_offload_config if stage == 2 else zero3_offload_config)(
        batch, **{"gradient_accumulation_steps": accum, **(ds_overrides or {})})
    if lora:
        config["optimizer"]["params"]["lr"] = 1e-4

    def setup():
        model = build_model(shape, torch.bfloat16, device, seed)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(**LORA))
        if grad_ckpt:
            _enable_checkpointing(model, frozen_base=lora)
        trainable = [p for p in model.parameters() if p.requires_grad]
        fields["params"] = sum(p.numel() for p in trainable)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
        fields["optimizer"] = type(engine.optimizer.optimizer).__name__ \
            if hasattr(engine.optimizer, "optimizer") else type(engine.optimizer).__name__
        inputs = _batch(shape, batch, seq, device, seed)

        def step():
            for _ in range(accum):  # DeepSpeed scales the loss and steps the optimizer on the last micro-batch
                loss = engine(**inputs).loss
                engine.backward(loss)
                engine.step()
            return loss.detach()
        return step, engine.destroy

    return measure_training(name, setup, device=device, warmup=warmup, repeats=repeats,
                            vram_budget=vram_budget, tokens=accum * batch * seq, fields=fields)


def cpu_adamw_time(numel: int, threads: Optional[int] = None, *, repeats: int = 5, warmup: int = 1) -> dict:
    """Seconds for one torch fused CPU AdamW step over ``numel`` fp32 parameters (the optimizer alone).

    Args:
        numel: parameter count (e.g. a model's, for the offload lower bound).
        threads: torch CPU threads (None: torch's current setting); restored after.
        repeats, warmup: median of ``repeats`` after ``warmup`` steps.

    Returns:
        ``{"name", "peer", "numel", "threads", "step_s", "params_per_s", "status"}``.
    """
    saved = torch.get_num_threads()
    threads = threads or saved
    name = f"torch fused CPU AdamW, fp32, {threads} threads"
    row = {"name": name, "peer": "cpu_adamw", "numel": numel, "threads": threads, "step_s": None,
           "params_per_s": None, "status": "ok"}
    param = opt = None
    try:
        torch.set_num_threads(threads)
        # Random values made by tiling a random chunk (drawing billions of normals would take longer than
        # the steps); the slice of a contiguous 1-D tensor is contiguous, so nothing is copied twice.
        g = torch.Generator().manual_seed(0)
        chunk = min(numel, 1 << 20)
        reps = -(-numel // chunk)
        param = torch.nn.Parameter(torch.randn(chunk, generator=g).repeat(reps)[:numel])
        param.grad = (torch.randn(chunk, generator=g) * 1e-3).repeat(reps)[:numel]
        opt = torch.optim.AdamW([param], lr=1e-5, weight_decay=0.01, fused=True)
        row["step_s"] = median_time(opt.step, repeats=repeats, warmup=warmup)
        row["params_per_s"] = numel / row["step_s"]
    except (RuntimeError, MemoryError) as err:
        if not (isinstance(err, MemoryError) or "allocate" in str(err)):
            raise
        row["status"] = "oom"
    finally:
        torch.set_num_threads(saved)
        param = opt = None
        gc.collect()
    return row


def measure_pinned_bandwidth(nbytes: int = 256 * MiB, repeats: int = 10) -> dict:
    """Host<->device GB/s of ``nbytes`` pinned copies (CUDA events): the denominators of transfer bounds.

    Args:
        nbytes: bytes per copy (256 MiB+ reaches the link's plateau).
        repeats: median of this many copies each way.

    Returns:
        ``{"bytes", "h2d_GBps", "d2h_GBps", "status"}``.
    """
    if not torch.cuda.is_available():
        return {"bytes": nbytes, "h2d_GBps": None, "d2h_GBps": None, "status": "not run: requires CUDA"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = median_time(lambda: dev.copy_(host, non_blocking=True), repeats=repeats, cuda=True)
    d2h = median_time(lambda: host.copy_(dev, non_blocking=True), repeats=repeats, cuda=True)
    del host, dev
    free_memory()
    return {"bytes": nbytes, "h2d_GBps": nbytes / h2d / 1e9, "d2h_GBps": nbytes / d2h / 1e9, "status": "ok"}


PEERS = ("bandwidth", "peft", "peft_ckpt", "bnb", "bnb_ckpt", "full", "ds", "ds_ckpt", "ds3", "ds3_ckpt", "cpu_adamw")


def _guarded(name: str, fn: Callable[[], dict]) -> dict:
    """Runs one peer; an unexpected exception becomes an ``error: ...`` row so the suite goes on."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        free_memory()
        return {**not_run(name, ""), "status": f"error: {type(err).__name__}: {str(err)[:300]}"}


def offload_bounds(numel: int, bandwidth: dict, adamw_s: Optional[float]) -> dict:
    """Lower bounds on any CPU-offload step's host side: bf16 grads down, bf16 params up, CPU AdamW.

    ``serial`` adds the three; ``overlapped`` is the slowest of them (perfect overlap, full-duplex link).
    GPU forward/backward time comes on top of either. These are ideal-engine bounds, not DeepSpeed's own
    traffic (its ZeRO-2 offload copies gradients to the host as fp32).

    Args:
        numel: parameters moved and updated per step.
        bandwidth: a :func:`measure_pinned_bandwidth` result.
        adamw_s: a :func:`cpu_adamw_time` ``step_s`` over ``numel`` parameters (None: not measured).

    Returns:
        The three terms and the two bounds in seconds, or a ``not run`` status.
    """
    if bandwidth.get("status") != "ok" or adamw_s is None:
        return {"status": "not run: needs bandwidth and cpu_adamw"}
    down, up = 2 * numel / (bandwidth["d2h_GBps"] * 1e9), 2 * numel / (bandwidth["h2d_GBps"] * 1e9)
    return {"numel": numel, "grads_d2h_s": down, "params_h2d_s": up, "cpu_adamw_s": adamw_s,
            "serial_s": down + up + adamw_s, "overlapped_s": max(down, up, adamw_s), "status": "ok"}


def pcie_figures(row: dict, bandwidth: dict) -> Optional[dict]:
    """How close a wrapped row's step comes to its own PCIe traffic at the measured pinned bandwidth.

    ``bound_s`` is the time the busier direction of the (full-duplex) link needs for the bytes the engine moved
    in one step (``engine_stats``: the last timed step); ``efficiency`` = ``bound_s / step_s`` (1.0: the link
    never idles in that direction), ``x_bound`` = ``step_s / bound_s``. None when the row moved nothing or the
    bandwidth was not measured.
    """
    stats = row.get("engine_stats") or {}
    if bandwidth.get("status") != "ok" or not row.get("step_s"):
        return None
    h2d, d2h = stats.get("h2d_bytes") or 0, stats.get("d2h_bytes") or 0
    if not h2d and not d2h:
        return None
    up, down = h2d / (bandwidth["h2d_GBps"] * 1e9), d2h / (bandwidth["d2h_GBps"] * 1e9)
    bound = max(up, down)
    return {"h2d_bytes": h2d, "d2h_bytes": d2h, "h2d_s": up, "d2h_s": down, "bound_s": bound,
            "efficiency": bound / row["step_s"], "x_bound": row["step_s"] / bound}


def run(quick: bool = False, shape: Optional[str] = None, full_shape: Optional[str] = None, batch: int = 1,
        seq: Optional[int] = None, warmup: Optional[int] = None, repeats: Optional[int] = None,
        vram_budget_gib: Optional[float] = 24.0, peers=None, extra_jobs: Optional[dict] = None,
        suite: str = "peers", on_row: Optional[Callable[[dict], None]] = None, accum: int = 1) -> tuple[dict, str]:
    """Runs the peers side by side; returns (JSON payload, markdown report).

    Args:
        quick: tiny model, short sequences, few repeats (CPU-friendly smoke test).
        shape: LoRA / QLoRA model (default llama3-8b; tiny when quick).
        full_shape: full fine-tune model (default llama3.2-3b; tiny when quick).
        batch, seq: batch shape (seq default 2048; 64 when quick).
        warmup, repeats: per peer (default 3 / 10; 1 / 3 when quick).
        vram_budget_gib: cap for the DeepSpeed offload rows (the "24 GiB GPU"); None or 0: no cap.
        peers: subset of :data:`PEERS` and of ``extra_jobs``' keys (default all).
        extra_jobs: more rows for the same table, ``key -> (group, fn(shape, full_shape, budget, kw))``
            with ``kw`` = batch, seq, warmup, repeats (how the trainstream side joins the run).
        suite: the payload's ``suite`` field.
        on_row: called after each row with the payload so far (rows under ``results``, ``partial: True``), so a
            run cut short by a time limit keeps the rows it measured.
        accum: micro-batches per optimizer step of the full fine-tune rows (group ``full``; the others take one).

    Returns:
        ``(payload, markdown)``: rows under ``results`` (each with ``group``, ``key`` and ``x_first``, the
        step time over the group's first measured row), plus ``bandwidth`` and ``offload_bounds``.
    """
    shape = shape or ("tiny" if quick else "llama3-8b")
    full_shape = full_shape or ("tiny" if quick else "llama3.2-3b")
    seq = seq or (64 if quick else 2048)
    warmup = (1 if quick else 3) if warmup is None else warmup
    kw = dict(batch=batch, seq=seq, warmup=warmup, repeats=repeats or (3 if quick else 10))
    budget = int(vram_budget_gib * GiB) if vram_budget_gib else None
    extra_jobs = dict(extra_jobs or {})
    known = PEERS + tuple(extra_jobs)
    chosen = list(peers or known)
    unknown = set(chosen) - set(known)
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}; choose from {known}")
    if not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum: micro-batches per optimizer step, an int >= 1, got {accum!r}")
    kw_full = {**kw, "accum": accum}
    full_numel = sum(p.numel() for p in build_model(full_shape, device="meta").parameters())
    jobs = {
        "peft": ("lora", lambda: peft_lora(shape, False, **kw)),
        "peft_ckpt": ("lora", lambda: peft_lora(shape, True, **kw)),
        "bnb": ("lora", lambda: bnb_qlora(shape, False, **kw)),
        "bnb_ckpt": ("lora", lambda: bnb_qlora(shape, True, **kw)),
        "full": ("full", lambda: torch_full(full_shape, False, **kw_full)),
        "ds": ("full", lambda: deepspeed_zero2_offload(full_shape, False, budget, **kw_full)),
        "ds_ckpt": ("full", lambda: deepspeed_zero2_offload(full_shape, True, budget, **kw_full)),
        "ds3": ("full", lambda: deepspeed_zero2_offload(full_shape, False, budget, stage=3, **kw_full)),
        "ds3_ckpt": ("full", lambda: deepspeed_zero2_offload(full_shape, True, budget, stage=3, **kw_full)),
        "cpu_adamw": ("optimizer", lambda: cpu_adamw_time(2_000_000 if quick else full_numel,
                                                     repeats=kw["repeats"])),
    }
    for key, (group, fn) in extra_jobs.items():
        jobs[key] = (group, lambda fn=fn, group=group: fn(shape, full_shape, budget, kw_full if group == "full" else kw))
    payload: dict = {"suite": suite, "quick": quick, "shape": shape, "full_shape": full_shape,
                     "full_params": full_numel, "vram_budget": budget, "accum": accum, **kw}
    payload["bandwidth"] = measure_pinned_bandwidth(repeats=kw["repeats"]) if "bandwidth" in chosen \
        else {"status": "not run: not selected"}
    rows = []
    for key in (k for k in known if k in chosen and k in jobs):
        group, fn = jobs[key]
        print(f"[{suite}] {time.strftime('%H:%M:%S')} {key} ...", file=sys.stderr, flush=True)
        rows.append({"group": group, "key": key, **_guarded(key, fn)})
        if on_row is not None:
            on_row({**payload, "results": list(rows), "partial": True})
    groups = list(dict.fromkeys(r["group"] for r in rows))
    payload["results"] = rows = sorted(rows, key=lambda r: groups.index(r["group"]))  # stable: run order
    adamw = next((r for r in rows if r["key"] == "cpu_adamw" and r["status"] == "ok"), None)
    payload["offload_bounds"] = offload_bounds(full_numel, payload["bandwidth"], adamw and adamw["step_s"])
    for r in rows:
        fig = pcie_figures(r, payload["bandwidth"])
        if fig is not None:
            r["pcie"] = fig
    for group in groups:
        if group == "optimizer":
            continue
        base = next((r["step_s"] for r in rows if r["group"] == group and r["step_s"]), None)
        for r in rows:
            if r["group"] == group and r["step_s"] and base:
                r["x_first"] = r["step_s"] / base
    table = [{**r, "alloc_GiB": r["max_allocated"] / GiB if r.get("max_allocated") else None,
              "reserved_GiB": r["max_reserved"] / GiB if r.get("max_reserved") else None,
              "last_loss": r["losses"][-1] if r.get("losses") else None} for r in rows]
    md = [f"### Peers: LoRA on {shape}, full fine-tune on {full_shape}, batch {batch} x {seq} tokens, "
          f"median of {kw['repeats']} steps after {kw['warmup']}; x_first = step / first row of its group",
          markdown_table(table, ["group", "name", "status", "step_s", "tokens_per_s", "alloc_GiB",
                                 "reserved_GiB", "x_first", "last_loss"])]
    bw, bounds = payload["bandwidth"], payload["offload_bounds"]
    if bw["status"] == "ok":
        md.append(f"Pinned copies, {bw['bytes'] / MiB:.0f} MiB: H2D {bw['h2d_GBps']:.1f} GB/s, "
                  f"D2H {bw['d2h_GBps']:.1f} GB/s.")
    for r in rows:
        if "pcie" in r:
            f = r["pcie"]
            md.append(f"{r['key']}: PCIe per step H2D {f['h2d_bytes'] / 1e9:.2f} GB, D2H {f['d2h_bytes'] / 1e9:.2f} GB "
                      f"-> {f['bound_s']:.3f} s at the measured bandwidth; efficiency {100 * f['efficiency']:.0f}%, "
                      f"step = {f['x_bound']:.2f}x that bound.")
    if bounds["status"] == "ok":
        md.append(f"Offload host-side lower bound for {full_numel / 1e9:.2f} B params: serial "
                  f"{bounds['serial_s']:.3f} s, perfectly overlapped {bounds['overlapped_s']:.3f} s "
                  f"(+ GPU forward/backward).")
    return payload, "\n\n".join(md)
