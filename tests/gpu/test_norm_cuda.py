"""Fused RMSNorm on the GPU (csrc/cuda/norm.cu): transformers' LlamaRMSNorm maths within the rounding of another
reduction order, no host sync, and its time beside the module's at the Llama-3-8B shape (printed)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from trainstream_hf import ops
from tests.helpers import cuda_median_ms, rel_err

TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048, 4096), (3, 100, 8192), (7, 64)])
def test_rms_norm_cuda_matches_the_module(dtype, shape):
    torch.manual_seed(0)
    m = LlamaRMSNorm(shape[-1], eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        m.weight.normal_(1.0, 0.2)
    x = (torch.randn(*shape, device="cuda") * 3).to(dtype).requires_grad_()
    y = m(x)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, m.weight), dy)
    x2 = x.detach().clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y2 = ops.rms_norm(x2, m.weight, 1e-5)
        dx2, dw2 = torch.autograd.grad(y2, (x2, m.weight), dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want, what in ((y2, y, "y"), (dx2, dx, "dx"), (dw2, dw, "dw")):
        assert rel_err(got, want) <= TOL[dtype], (what, rel_err(got, want))


def test_rms_norm_cuda_time_beside_the_module():
    m = LlamaRMSNorm(4096, eps=1e-5).to("cuda", torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    module = cuda_median_ms(lambda: torch.autograd.grad(m(x), x, dy))
    fused = cuda_median_ms(lambda: torch.autograd.grad(ops.rms_norm(x, m.weight, 1e-5), x, dy))
    print(f"RMSNorm 2048 x 4096 bf16, forward + dx: module {module:.3f} ms, fused {fused:.3f} ms")
    assert fused < module  # one kernel each way against eight ops
