"""Where the host time of bench quant's FP8 block step goes, and what the step would take without it (GPU).

python3 scripts/host_fp8.py [--cprofile]

For the Llama-3-8B block (7 layers, 2048 bf16 tokens, forward + input gradients: bench quant's block_step), four
rows: ``bf16`` (nn.Linear), ``fp8`` (QuantLinear W8A8 on torch._scaled_mm), ``fp8_cublaslt`` (the same layers on
ops.fp8_gemm_rowwise, cuBLASLt's algorithm cached per shape; the GEMM is switched with ops.set_fp8_gemm, since the FP8
layer reads TRAINSTREAM_FP8_GEMM only once) and ``fp8_cublaslt_no_wt_cache`` (that, with the layers'
fp8_transpose_cache off: the backward transposes each weight per call); for each:

* ``wall``: median seconds of a synchronised step (what bench quant reports);
* ``graph``: the same step captured once in a CUDA graph and replayed: its kernels alone, no host in the way -- the
  floor the eager step approaches when the host keeps ahead of the GPU;
* ``enqueue``: host seconds per step while the GPU is kept busy (a step is host-bound when this exceeds ``graph``),
  split into the forward (graph recorded), the forward without autograd, and the raw native calls of the path
  (fp8_linear forward, which quantizes inside, and fp8_linear_dgrad backward, with and without the transposed codes)
  with no Python layer or autograd around them.

``--cprofile`` adds Python's profile of 50 eager FP8 steps (the host functions, C++ time charged to the builtins that
call it). Prints one JSON object.
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import enqueue_seconds  # noqa: E402

from trainstream_hf import ops  # noqa: E402
from trainstream_hf.bench.common import environment  # noqa: E402
from trainstream_hf.bench.quant import _dense, block_inputs, block_linears, block_step, block_weights  # noqa: E402
from trainstream_hf.quant import QuantLinear  # noqa: E402
from trainstream_hf.quant.formats import quantize  # noqa: E402


def wall(fn, n=20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_seconds(step, n=50) -> float:
    """Median replay time of ``step`` captured in a CUDA graph (warmed up on a side stream first, as torch asks)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return wall(g.replay, n)


def main() -> None:
    dev = torch.device("cuda")
    linears = block_linears("llama3-8b")
    ws = block_weights(linears, dev, 0)
    xs, leaves, grads = block_inputs(linears, 2048, dev, 1)
    out = environment("python3 " + " ".join(["scripts/host_fp8.py"] + sys.argv[1:]))
    fp8 = [QuantLinear(quantize(w, "fp8"), act_quant=True) for w in ws]
    # fp8_cublaslt: the same layers with their GEMMs on ops.fp8_gemm_rowwise (algorithm cached per shape);
    # fp8_cublaslt_no_wt_cache: and without the kept transposed codes (the backward transposes each weight per call)
    rows = {"bf16": [_dense(w) for w in ws], "fp8": fp8, "fp8_cublaslt": fp8, "fp8_cublaslt_no_wt_cache": fp8}
    for name, layers in rows.items():
        ops.set_fp8_gemm("cublaslt" if name.startswith("fp8_cublaslt") else "torch")
        for q in fp8:
            q.fp8_transpose_cache = name != "fp8_cublaslt_no_wt_cache"
        step = block_step(layers, xs, leaves, grads)

        def forward(layers=layers):
            return [layer(x) for layer, x in zip(layers, xs)]

        def forward_no_grad(layers=layers):
            with torch.no_grad():
                return [layer(x) for layer, x in zip(layers, xs)]

        r = {"wall_ms": 1e3 * wall(step), "graph_ms": 1e3 * graph_seconds(step),
             "enqueue_step_ms": 1e3 * enqueue_seconds(step, 5), "enqueue_forward_ms": 1e3 * enqueue_seconds(forward, 5),
             "enqueue_forward_no_grad_ms": 1e3 * enqueue_seconds(forward_no_grad, 5)}
        out[name] = r
    ops.set_fp8_gemm("torch")
    for q in fp8:
        q.fp8_transpose_cache = True
    # The native calls alone, the same 7 layers: forward = quantize x + fp8_linear, backward = fp8_linear_dgrad.
    qs = rows["fp8"]
    plain = [x.detach() for x in xs]
    with torch.no_grad():
        def raw_forward():
            return [ops.fp8_linear(x, q.weight_data, q.weight_scale, reuse=False) for q, x in zip(qs, plain)]

        def raw_backward():
            return [ops.fp8_linear_dgrad(g, q.weight_data, q.weight_scale) for q, g in zip(qs, grads)]

        wts = [ops.transpose_bytes(q.weight_data) for q in qs]

        def raw_backward_cached_transpose(wts=wts, ones=[torch.ones(1, q.in_features, device=dev) for q in qs]):
            outs = []
            for q, g, wt, one in zip(qs, grads, wts, ones):
                gq, sg = ops.quantize_rows_e4m3(g, q.weight_scale)
                outs.append(torch._scaled_mm(gq, wt.t(), scale_a=sg, scale_b=one, out_dtype=g.dtype))
            return outs

        def raw_backward_w_t(wts=wts):  # the native dgrad given the kept transposed codes (QuantLinear's cache)
            return [ops.fp8_linear_dgrad(g, q.weight_data, q.weight_scale, wt) for q, g, wt in zip(qs, grads, wts)]

        for name, fn in [("raw_forward", raw_forward), ("raw_backward", raw_backward),
                         ("raw_backward_cached_transpose", raw_backward_cached_transpose),
                         ("raw_backward_w_t", raw_backward_w_t)]:
            out[name] = {"enqueue_ms": 1e3 * enqueue_seconds(fn, 5), "graph_ms": 1e3 * graph_seconds(fn)}
        xq, sx = ops.quantize_rows_e4m3(plain[0])
        ops_host = {
            "_scaled_mm": lambda: torch._scaled_mm(xq, qs[0].weight_data.t(), scale_a=sx,
                                                   scale_b=qs[0].weight_scale.view(1, -1), out_dtype=torch.bfloat16),
            "mm_bf16": lambda: torch.mm(plain[0], ws[0].t()),
            "quantize_rows_e4m3": lambda: ops.quantize_rows_e4m3(plain[0]),
            "transpose_bytes": lambda: ops.transpose_bytes(qs[0].weight_data),
            "empty": lambda: torch.empty(2048, 4096, device=dev, dtype=torch.bfloat16),
        }
        out["per_op_enqueue_us"] = {k: 1e6 * enqueue_seconds(fn, 50) for k, fn in ops_host.items()}
    if "--cprofile" in sys.argv:
        step = block_step(qs, xs, leaves, grads)
        step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out["cprofile_fp8_50_steps"] = s.getvalue()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
