"""Which part of an FP8 QuantLinear forward + backward blocks the host (run on the H200 at 26e3095,
2026-12-04: benchmarks/results/diag-sync-h200-26e3095.txt).

python3 scripts/diag_sync.py: for each variant, the host time of 20 calls while the GPU runs a ~1 s spin kernel
(a call that waits for the device shows ~50 ms per call), then the same calls under
torch.cuda.set_sync_debug_mode("warn"), printing the first synchronizing call's stack.
"""
import traceback
import warnings

import torch

from trainstream_hf import ops
from trainstream_hf.quant import QuantLinear, quantize

from profiling import enqueue_seconds  # scripts/profiling.py


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    q = QuantLinear(quantize(w, "fp8"), act_quant=True)
    dense = torch.nn.Linear(4096, 4096, bias=False, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16)

    class Mm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(b)
            return a @ b.t()

        @staticmethod
        def backward(ctx, g):
            (b,) = ctx.saved_tensors
            return g @ b, None

    variants = {
        "nn.Linear fwd+grad": lambda: torch.autograd.grad(dense(x), x, dy),
        "python Function mm fwd+grad": lambda: torch.autograd.grad(Mm.apply(x, w), x, dy),
        "QuantLinear fp8 fwd": lambda: q(x),
        "QuantLinear fp8 fwd+grad": lambda: torch.autograd.grad(q(x), x, dy),
        "ops.fp8_linear fwd+grad": lambda: torch.autograd.grad(
            ops.fp8_linear(x, q.weight_data, q.weight_scale), x, dy),
        "ops.fp8_linear_dgrad": lambda: ops.fp8_linear_dgrad(dy, q.weight_data, q.weight_scale),
        "fp8 fwd+grad, fresh leaf": lambda: (lambda xx: torch.autograd.grad(q(xx), xx, dy))(
            x.detach().requires_grad_()),
        "fp8 fwd + backward() into .grad": lambda: q(x).backward(dy),
    }
    for name, fn in variants.items():
        print(f"{1e3 * enqueue_seconds(fn, 20):9.3f} ms  {name}", flush=True)
    for name, fn in variants.items():
        fn()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [c for c in caught if "synchroniz" in str(c.message).lower()]
        print(f"{name}: {len(syncs)} sync warnings" + (f": {syncs[0].message} at {syncs[0].filename}:{syncs[0].lineno}"
                                                       if syncs else ""), flush=True)
    # The stack of the first sync in the fp8 fwd+grad, raised as an error.
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(q(x), x, dy)
        print("no sync raised")
    except RuntimeError:
        traceback.print_exc()
    finally:
        torch.cuda.set_sync_debug_mode(0)


if __name__ == "__main__":
    main()
