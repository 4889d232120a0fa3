"""Quantized linear layers beside their peers: one transformer block's linear layers, forward + input gradient.

``python -m trainstream_hf.bench quant [--shape llama3-8b|tiny] [--seq 2048] [--warmup 3] [--repeats 10]``

One step is what a frozen base costs in LoRA / QLoRA training: the forward of every linear layer of one block
(q, k, v, o, gate, up, down of a Llama block of ``--shape``) on ``--seq`` tokens of bf16 activations that require
grad, then the input gradients (``torch.autograd.grad`` of all outputs with fixed random output gradients); no
weight gradient (the weights are frozen). The layers read their inputs as in the model (:data:`BLOCK_INPUTS`): q, k
and v one tensor, o its own, gate and up one tensor, down its own; four input tensors per step. Every row runs that
step on the same random weights and inputs, in the same process, timed by
:func:`trainstream_hf.bench.harness.measure_training` (CUDA events after warm-up, median of repeats; ``perf_counter``
on the CPU; peak memory over the timed steps):

* ``bf16``: ``nn.Linear`` with a frozen bf16 weight (cuBLAS GEMMs): the ratio ``x_bf16`` is over this row.
* ``bnb_nf4``: bitsandbytes ``Linear4bit`` NF4, double quant, bf16 compute (the QLoRA peer, built by
  :func:`trainstream_hf.train.baseline.nf4_linear`): the ratio ``x_bnb`` is over this row. Needs CUDA.
* trainstream ``QuantLinear``: int8 and nf4 (weight-only), fp8 W8A8 (``act_quant=True``: the tensor-core path on
  sm_89+), the same with ``outliers=0.01`` (what outlier protection costs), fp8 weight-only, nvfp4 weight-only
  (the path on sm_90 and the CPU: FP4 tensor cores need sm_100+) and nvfp4 W4A4 (``act_quant=True``; run only on
  a GPU of compute capability 10.0 or more, where FP4 tensor cores exist). ``path`` is the matmul path the layer
  selected on the device (its name says whether it is a tensor-core path or an emulation).

Targets (issue 4, for the H200): nf4 <= 0.8x bnb nf4; fp8 W8A8 <= 0.75x bf16; nvfp4 on sm_90 <= 1.0x bnb nf4;
dequantize kernels >= 70% of the device copy bandwidth. ``meets`` is filled on CUDA only (a CPU run is a smoke
test of the suite, not a measurement the targets speak of).

Dequantize rows: ``dequantize(q, torch.bfloat16)`` of the block's down-projection weight (hidden x intermediate,
4096 x 14336 for Llama-3-8B) per format; GB/s counts the packed bytes read plus the bf16 bytes written, against a
``dst.copy_(src)`` bandwidth (read + write bytes) measured in the same run.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Optional

import torch

from trainstream_hf import ops
from trainstream_hf.bench.common import markdown_table, median_time
from trainstream_hf.bench.harness import default_device, free_memory, measure_training, not_run
from trainstream_hf.bench.models import model_config
from trainstream_hf.bench.peers import _guarded
from trainstream_hf.quant import FORMATS, QuantLinear, dequantize, quantize

GiB, MiB = 2**30, 2**20

# key -> (format, act_quant, outliers, name) of the trainstream rows
QUANT_ROWS: dict[str, tuple[str, bool, float, str]] = {
    "int8": ("int8", False, 0.0, "trainstream int8 (weight-only)"),
    "nf4": ("nf4", False, 0.0, "trainstream nf4 (weight-only)"),
    "fp8": ("fp8", True, 0.0, "trainstream fp8 W8A8"),
    "fp8_outliers": ("fp8", True, 0.01, "trainstream fp8 W8A8, outliers 1%"),
    "fp8_wo": ("fp8", False, 0.0, "trainstream fp8 weight-only"),
    "nvfp4": ("nvfp4", False, 0.0, "trainstream nvfp4 weight-only (sm_90 path)"),
    "nvfp4_w4a4": ("nvfp4", True, 0.0, "trainstream nvfp4 W4A4"),
}
ROWS = ("bf16", "bnb_nf4") + tuple(QUANT_ROWS) + ("dequant",)
# key -> (peer row key, max ratio): issue 4's performance targets
TARGETS: dict[str, tuple[str, float]] = {"nf4": ("bnb_nf4", 0.8), "fp8": ("bf16", 0.75), "nvfp4": ("bnb_nf4", 1.0)}
DEQUANT_TARGET = 0.70  # of the measured device copy bandwidth


def block_linears(shape: str) -> list[tuple[str, int, int]]:
    """``(name, in_features, out_features)`` of the linear layers of one decoder block of ``shape``.

    Args:
        shape: a key of :data:`trainstream_hf.bench.models.SHAPES` (a Llama-style block: GQA attention, gated MLP).
    """
    c = model_config(shape)
    h, i = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (getattr(c, "head_dim", None) or h // c.num_attention_heads)
    return [("q_proj", h, h), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", h, h),
            ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def block_weights(linears, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """Random bf16 (out, in) weights of std ``in ** -0.5``, drawn on ``device`` (same seed, same weights)."""
    g = _generator(device, seed)
    return [torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16).mul_(k ** -0.5)
            for _, k, n in linears]


# Which tensor each linear layer of a block reads, as in the model: q / k / v the attention's normed hidden state,
# o_proj the attention output, gate / up the MLP's normed hidden state, down_proj the gated activation. Layers that
# read one tensor can share its quantization (the FP8 path quantizes it once); o_proj and down_proj cannot.
BLOCK_INPUTS = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
                "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_act"}


def block_inputs(linears, tokens: int, device: torch.device, seed: int = 1):
    """``(xs, leaves, grads)``: each layer's input, the leaf tensors that require grad (one per entry of
    :data:`BLOCK_INPUTS`, in order of first use; each layer in ``xs`` is given the very tensor object it reads, so q, k
    and v get one tensor, gate and up another), and one fixed random output gradient per layer; all bf16."""
    g = _generator(device, seed)
    leaves: dict[str, torch.Tensor] = {}
    for name, k, _ in linears:
        src = BLOCK_INPUTS[name]
        if src not in leaves:
            leaves[src] = torch.randn(tokens, k, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
        if leaves[src].shape[1] != k:
            raise ValueError(f"block_inputs: {name} reads {src} of {leaves[src].shape[1]} features, not {k}")
    grads = [torch.randn(tokens, n, generator=g, device=device, dtype=torch.bfloat16) for _, _, n in linears]
    return [leaves[BLOCK_INPUTS[name]] for name, _, _ in linears], list(leaves.values()), grads


def block_step(layers, xs, leaves, grads):
    """Forward of every layer, then the input gradients of all outputs (returned, not accumulated into
    ``.grad``)."""
    def step():
        outs = [layer(x) for layer, x in zip(layers, xs)]
        return torch.autograd.grad(outs, leaves, grads)
    return step


def _dense(w: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    return layer


def _measure(key: str, name: str, make_layers, *, linears, tokens, device, warmup, repeats, seed,
             fields: dict) -> dict:
    """Times :func:`block_step` over the layers ``make_layers(weights)`` builds (inside the harness's setup, so the
    layers are released before the next row); ``fields`` is read after the setup, which may add to it."""
    fields["key"] = key

    def setup():
        layers = make_layers(block_weights(linears, device, seed))
        xs, leaves, grads = block_inputs(linears, tokens, device, seed + 1)
        return block_step(layers, xs, leaves, grads), None

    return measure_training(name, setup, device=device, warmup=warmup, repeats=repeats, tokens=tokens,
                            fields=fields)


def bf16_row(linears, tokens, device, warmup, repeats, seed=0) -> dict:
    """The bf16 ``nn.Linear`` peer."""
    fields = {"fmt": "bf16", "act_quant": False, "outliers": 0.0, "path": "F.linear (bf16 GEMM)",
              "weight_bytes": 2 * sum(k * n for _, k, n in linears)}
    return _measure("bf16", "bf16 nn.Linear (frozen)", lambda ws: [_dense(w) for w in ws], linears=linears,
                    tokens=tokens, device=device, warmup=warmup, repeats=repeats, seed=seed, fields=fields)


def bnb_nf4_row(linears, tokens, device, warmup, repeats, seed=0) -> dict:
    """The bitsandbytes NF4 ``Linear4bit`` peer (double quant, bf16 compute); ``not run`` without it or CUDA."""
    name = "bitsandbytes Linear4bit nf4 (double quant, bf16 compute)"
    fields = {"fmt": "bnb nf4", "act_quant": False, "outliers": 0.0}
    if importlib.util.find_spec("bitsandbytes") is None:
        return not_run(name, "bitsandbytes not installed", key="bnb_nf4", **fields)
    if device.type != "cuda":
        return not_run(name, "requires CUDA", key="bnb_nf4", **fields)
    try:
        import bitsandbytes
    except Exception as err:  # noqa: BLE001 - a broken install is a reason, not a crash
        return not_run(name, f"bitsandbytes import failed: {type(err).__name__}: {err}", key="bnb_nf4", **fields)
    from trainstream_hf.train.baseline import nf4_linear

    fields["path"] = f"bnb.matmul_4bit (bitsandbytes {bitsandbytes.__version__})"

    def make(ws):
        layers = []
        while ws:  # quantize one at a time and drop its bf16 weight, as a QLoRA load would
            layers.append(nf4_linear(_dense(ws.pop(0)), device))
        fields["weight_bytes"] = sum(
            t.numel() * t.element_size() for layer in layers
            for t in [layer.weight, *_quant_state_tensors(layer.weight.quant_state)])
        return layers

    return _measure("bnb_nf4", name, make, linears=linears, tokens=tokens, device=device, warmup=warmup,
                    repeats=repeats, seed=seed, fields=fields)


def _quant_state_tensors(state) -> list[torch.Tensor]:
    """The tensors a bitsandbytes QuantState holds (absmax, code, and its nested double-quant state)."""
    out = [t for t in (getattr(state, "absmax", None), getattr(state, "code", None)) if torch.is_tensor(t)]
    nested = getattr(state, "state2", None)
    return out + (_quant_state_tensors(nested) if nested is not None else [])


def fp4_tensor_cores(device: torch.device) -> bool:
    """FP4 tensor cores (NVFP4 W4A4) exist on compute capability 10.0+ (Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


def quant_row(key: str, linears, tokens, device, warmup, repeats, seed=0) -> dict:
    """One trainstream ``QuantLinear`` row of :data:`QUANT_ROWS`."""
    fmt, act_quant, outliers, name = QUANT_ROWS[key]
    fields = {"fmt": fmt, "act_quant": act_quant, "outliers": outliers}
    if key == "nvfp4_w4a4" and not fp4_tensor_cores(device):
        return not_run(name, "no such GPU (FP4 tensor cores need sm_100+)", key=key, **fields)

    def make(ws):
        layers = []
        while ws:
            w = ws.pop(0)
            layers.append(QuantLinear(quantize(w, fmt), act_quant=act_quant, outliers=outliers))
            del w
        fields["path"] = layers[0].matmul_path(device).name
        fields["weight_bytes"] = sum(layer.weight.nbytes for layer in layers)
        if fields["path"] == "fp8_w8a8_scaled_mm":  # which FP8 GEMM ran, and the device bytes of the kept transposes
            fields["fp8_gemm"] = ops.fp8_gemm(device)
            fields["fp8_transpose_cache_bytes"] = sum(layer.fp8_transpose_cache_bytes(device) for layer in layers)
        return layers

    return _measure(key, name, make, linears=linears, tokens=tokens, device=device, warmup=warmup,
                    repeats=repeats, seed=seed, fields=fields)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int, warmup: int = 2) -> dict:
    """``dst.copy_(src)`` of ``nbytes`` on ``device``; GB/s counts read + written bytes (``2 * nbytes``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), repeats=repeats, warmup=warmup, cuda=device.type == "cuda")
    del src, dst
    free_memory()
    return {"bytes": nbytes, "time_s": t, "GBps": 2 * nbytes / t / 1e9, "status": "ok"}


def dequant_rows(shape: tuple[int, int], device: torch.device, copy_GBps: float, repeats: int, warmup: int,
                 seed: int = 0) -> list[dict]:
    """``dequantize(q, torch.bfloat16)`` GB/s per format for one (out, in) random weight, and its share of
    ``copy_GBps``."""
    n, k = shape
    w = torch.randn(n, k, generator=_generator(device, seed), device=device, dtype=torch.bfloat16).mul_(k ** -0.5)
    rows = []
    # Back-to-back calls between the two events, as in a training step where launches queue ahead of the GPU: one
    # call per timing would count the Python dispatch (~20 us) against a ~50 us kernel.
    inner = 20 if device.type == "cuda" else 1

    def calls(q):
        for _ in range(inner):
            dequantize(q, torch.bfloat16)

    for fmt in FORMATS:
        q = quantize(w, fmt)
        t = median_time(lambda: calls(q), repeats=repeats, warmup=warmup, cuda=device.type == "cuda") / inner
        moved = q.nbytes + 2 * n * k
        gbps = moved / t / 1e9
        rows.append({"fmt": fmt, "shape": [n, k], "packed_bytes": q.nbytes, "bytes_moved": moved, "time_s": t,
                     "GBps": gbps, "of_copy": gbps / copy_GBps, "calls_per_timing": inner,
                     "target": f">= {DEQUANT_TARGET:.0%} of copy",
                     "meets": gbps / copy_GBps >= DEQUANT_TARGET if device.type == "cuda" else None,
                     "status": "ok"})
        del q
    del w
    free_memory()
    return rows


def _ratios(rows: list[dict], cuda: bool) -> None:
    times = {r["key"]: r["step_s"] for r in rows if r.get("step_s")}
    for r in rows:
        t = r.get("step_s")
        r["x_bf16"] = t / times["bf16"] if t and "bf16" in times else None
        r["x_bnb"] = t / times["bnb_nf4"] if t and "bnb_nf4" in times else None
        if r["key"] in TARGETS:
            peer, limit = TARGETS[r["key"]]
            r["target"] = f"<= {limit}x {'bnb nf4' if peer == 'bnb_nf4' else peer}"
            ratio = r["x_bnb"] if peer == "bnb_nf4" else r["x_bf16"]
            r["meets"] = (ratio <= limit) if (cuda and ratio is not None) else None


def run(shape: Optional[str] = None, seq: Optional[int] = None, warmup: Optional[int] = None,
        repeats: Optional[int] = None, rows=None, device=None, copy_bytes: Optional[int] = None,
        quick: bool = False, seed: int = 0) -> tuple[dict, str]:
    """Runs the quant suite; returns (JSON payload, markdown report).

    Args:
        shape: the block's model shape (default llama3-8b; tiny when quick).
        seq: tokens per step (default 2048; 64 for the tiny shape).
        warmup, repeats: per row (default 3 / 10; 1 / 3 for the tiny shape).
        rows: subset of :data:`ROWS` (default all; ``dequant`` is the dequantize section).
        device: default CUDA when available, else CPU.
        copy_bytes: the copy-bandwidth buffer (default 1 GiB on CUDA, 64 MiB on the CPU).
        quick: the tiny shape and its defaults.
        seed: weights and inputs seed.

    Returns:
        ``(payload, markdown)``: ``results`` (one row per layer set: ``step_s``, ``tflops``, ``path``,
        ``weight_bytes``, ``max_allocated``, ``x_bf16``, ``x_bnb``, ``target``, ``meets``, ``status``),
        ``copy_bandwidth`` and ``dequant``.
    """
    shape = shape or ("tiny" if quick else "llama3-8b")
    small = quick or shape == "tiny"
    seq = seq or (64 if small else 2048)
    warmup = (1 if small else 3) if warmup is None else warmup
    repeats = repeats or (3 if small else 10)
    device = torch.device(device) if device is not None else default_device()
    cuda = device.type == "cuda"
    chosen = list(rows or ROWS)
    unknown = set(chosen) - set(ROWS)
    if unknown:
        raise ValueError(f"unknown rows {sorted(unknown)}; choose from {ROWS}")
    linears = block_linears(shape)
    flops = 4 * seq * sum(k * n for _, k, n in linears)  # forward 2TKN + input gradient 2TKN per layer
    kw = dict(linears=linears, tokens=seq, device=device, warmup=warmup, repeats=repeats, seed=seed)
    jobs = {"bf16": lambda: bf16_row(**kw), "bnb_nf4": lambda: bnb_nf4_row(**kw)}
    jobs.update({key: (lambda key=key: quant_row(key, **kw)) for key in QUANT_ROWS})
    payload: dict = {"suite": "quant", "quick": quick, "shape": shape, "tokens": seq, "warmup": warmup,
                     "repeats": repeats, "device": str(device), "flops_per_step": flops,
                     "linears": [{"name": nm, "in_features": k, "out_features": n} for nm, k, n in linears],
                     "targets": {"nf4": "<= 0.8x bitsandbytes nf4", "fp8": "<= 0.75x bf16 nn.Linear",
                                 "nvfp4": "<= 1.0x bitsandbytes nf4 (sm_90)",
                                 "dequant": f">= {DEQUANT_TARGET:.0%} of the device copy bandwidth"}}
    results = []
    for key in (k for k in ROWS if k in chosen and k in jobs):
        print(f"[quant] {key} ...", file=sys.stderr, flush=True)
        results.append({"key": key, **_guarded(key, jobs[key])})
    for r in results:
        r["tflops"] = flops / r["step_s"] / 1e12 if r.get("step_s") else None
    _ratios(results, cuda)
    payload["results"] = results
    if "dequant" in chosen:
        print("[quant] dequant ...", file=sys.stderr, flush=True)
        bw = copy_bandwidth(device, copy_bytes or (GiB if cuda else 64 * MiB), repeats)
        down = next((k, n) for nm, k, n in linears if nm == "down_proj")
        payload["copy_bandwidth"] = bw
        payload["dequant"] = dequant_rows((down[1], down[0]), device, bw["GBps"], repeats, warmup, seed)
    else:
        payload["copy_bandwidth"] = {"status": "not run: not selected"}
        payload["dequant"] = []

    table = [{**r, "step_ms": r["step_s"] * 1e3 if r.get("step_s") else None,
              "weight_MiB": r["weight_bytes"] / MiB if r.get("weight_bytes") else None,
              "alloc_GiB": r["max_allocated"] / GiB if r.get("max_allocated") else None} for r in results]
    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    md = [f"### Quantized linear layers, one {shape} block ({len(linears)} linear layers), {seq} tokens bf16, "
          f"forward + input gradient, {where}; median of {repeats} after {warmup}",
          markdown_table(table, ["name", "path", "status", "step_ms", "tflops", "x_bf16", "x_bnb", "target",
                                 "meets", "weight_MiB", "alloc_GiB"])]
    if payload["dequant"]:
        n, k = payload["dequant"][0]["shape"]
        md += [f"### dequantize -> bf16, {n} x {k} weight; device copy {bw['GBps']:.1f} GB/s "
               f"({bw['bytes'] / MiB:.0f} MiB, read + write)",
               markdown_table([{**r, "time_us": r["time_s"] * 1e6} for r in payload["dequant"]],
                              ["fmt", "packed_bytes", "time_us", "GBps", "of_copy", "target", "meets"])]
    return payload, "\n\n".join(md)
