"""The CUDA AdamW kernel and OffloadedAdamW's device share (resident and streamed parameters) on the GPU.

The kernel applies the CPU kernel's float operations in the same order, so every comparison here is torch.equal:
a parameter gets the same bits whichever share steps it.
"""
import copy

import pytest
import torch
from torch import nn

from trainstream_hf import ops
from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.optimizer import OffloadedAdamW
from trainstream_hf.engine.streams import TransferStreams


def _state(n, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.01
    v = torch.rand(n, generator=g) * 1e-4
    grad = torch.randn(n, generator=g) * torch.where(torch.rand(n, generator=g) < 0.02, 30.0, 1.0)
    return p, m, v, grad


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("maximize,wd", [(False, 0.0), (False, 0.1), (True, 0.01)])
@pytest.mark.parametrize("n", [1, 1000, 3_000_017])
def test_cuda_kernel_bit_identical_to_cpu_kernel(grad_dtype, maximize, wd, n):
    cpu = [t.clone() for t in _state(n, 0)]
    cpu[3] = cpu[3].to(grad_dtype)
    gpu = [t.cuda() for t in cpu]
    out_c, out_g = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for step in range(1, 6):
        kw = dict(lr=1e-3 * step, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd, step=step, maximize=maximize)
        ops.adamw_step_(*cpu, param_bf16=out_c, **kw)
        ops.adamw_step_(*gpu, param_bf16=out_g, **kw)
    for a, b in zip(cpu[:3] + [out_c], gpu[:3] + [out_g]):
        assert torch.equal(a, b.cpu())


def test_cuda_kernel_checks_devices():
    p, m, v, g = (t.cuda() for t in _state(64, 1))
    with pytest.raises(RuntimeError, match="must be on cuda"):
        ops.adamw_step_(p, m.cpu(), v, g, lr=1e-3, step=1)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(512, 256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256),
                         nn.LayerNorm(256), nn.Linear(256, 512)).cuda().to(torch.bfloat16)


def _train(model, opt, steps=8, clip=True):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randint(0, 512, (4, 64), generator=g).cuda()
        opt.wait_for(model.parameters())  # wrap's hooks do this per block; here once for all
        loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        loss.backward()
        if clip:
            opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    torch.cuda.synchronize()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("grads", ["device", "host"])
def test_device_share_same_bits_as_cpu_share(overlap, grads):
    """Resident (embedding), streamed (the first two linear layers, in chunks of 100k with a ring that wraps) and
    CPU-stepped parameters train a bf16 model to the same bits as every parameter on the CPU kernel."""
    ref, model = _model(), _model()
    big = lambda m: [m[0].weight, m[1].weight, m[3].weight, m[5].weight]  # noqa: E731
    streams = TransferStreams("cuda")

    def make(m, **kw):
        return OffloadedAdamW(torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1), big(m),
                              arena=HostArena(slab_bytes="16MiB"), streams=streams, grads=grads,
                              overlap_step=overlap, **kw)

    ref_opt = make(ref)
    opt = make(model, resident=[model[0].weight], streamed=[model[1].weight, model[3].weight],
               device_chunk_numel=100_000)
    _train(ref, ref_opt)
    _train(model, opt)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    a, b = ref_opt.state_dict(), opt.state_dict()
    for i in a["state"]:
        assert all(torch.equal(a["state"][i][k].cpu(), b["state"][i][k].cpu()) for k in a["state"][i])
    st = opt.stats()
    assert st["resident_numel"] == 512 * 256 and st["streamed_numel"] == 2 * 256 * 1024
    assert b["state"][0]["exp_avg"].is_cuda and not b["state"][1]["exp_avg"].is_cuda


def test_streamed_overlaps_next_forward():
    """Every parameter streamed, overlap_step on: step() returns with the copies queued and the next forward waits
    for each new weight on the device (wait_for), reading the same values as a serial CPU-stepped run."""
    model = _model()
    ref = copy.deepcopy(model)
    ps = [model[0].weight, model[1].weight, model[3].weight, model[5].weight]
    opt = OffloadedAdamW(torch.optim.AdamW(model.parameters(), lr=1e-3), ps, arena=HostArena(slab_bytes="16MiB"),
                         streams=TransferStreams("cuda"), overlap_step=True, streamed=ps, device_chunk_numel=50_000)
    ref_opt = OffloadedAdamW(torch.optim.AdamW(ref.parameters(), lr=1e-3),
                             [ref[0].weight, ref[1].weight, ref[3].weight, ref[5].weight],
                             arena=HostArena(slab_bytes="16MiB"), streams=TransferStreams("cuda"), overlap_step=False)
    _train(model, opt, clip=False)
    _train(ref, ref_opt, clip=False)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_device_share_in_backward_same_bits():
    """optimizer_in_backward: resident and streamed updates start from their gradient hooks on the device share's
    streams while backward runs; the result equals a serial CPU-stepped run bit for bit."""
    ref, model = _model(), _model()
    big = lambda m: [m[0].weight, m[1].weight, m[3].weight, m[5].weight]  # noqa: E731
    ref_opt = OffloadedAdamW(torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1), big(ref),
                             arena=HostArena(slab_bytes="16MiB"), streams=TransferStreams("cuda"))
    opt = OffloadedAdamW(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), big(model),
                         arena=HostArena(slab_bytes="16MiB"), streams=TransferStreams("cuda"), grads="host",
                         overlap_step=True, optimizer_in_backward=True, resident=[model[0].weight],
                         streamed=[model[1].weight, model[5].weight], device_chunk_numel=60_000)
    _train(ref, ref_opt, clip=False)
    _train(model, opt, clip=False)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
