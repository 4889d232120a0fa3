"""Native ops against their references and torch.optim.AdamW; opcheck for every op (CPU)."""
import pytest
import torch

from trainstream_hf import ops
from tests.helpers import randn_outliers


@pytest.mark.parametrize("n", [1, 17, 4099, 1_000_003])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_matches_reference(n, grad_dtype, maximize):
    p, m = randn_outliers(n, 1), randn_outliers(n, 2) * 0.01
    v = randn_outliers(n, 3).abs() * 0.01
    grad = randn_outliers(n, 4).to(grad_dtype)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out = torch.empty(n, dtype=torch.bfloat16)
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=7, maximize=maximize)
    ops.adamw_step_(p, m, v, grad, param_bf16=out, **kw)
    ops.adamw_step_reference(rp, rm, rv, grad, **kw)
    assert (p - rp).abs().max().item() < 1e-6
    assert (m - rm).abs().max().item() < 1e-6 and (v - rv).abs().max().item() < 1e-6
    assert torch.equal(out, p.to(torch.bfloat16))


def test_adamw_bits_are_torchs_op_order_with_a_correctly_rounded_sqrt():
    """Bit for bit: torch.optim.AdamW's single-tensor step (lerp_, addcmul_, then self + (value * m) / denom, each
    rounded: no fused multiply-add in addcdiv_), with an IEEE sqrt (numpy's; torch's CPU sqrt is not always correctly
    rounded, the one reason the kernel's bits can differ from torch's)."""
    import math

    import numpy as np
    n, lr, b1, b2, eps, wd, step = 100_003, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3
    p0, m0 = randn_outliers(n, 21), randn_outliers(n, 22) * 0.01
    v0, g = randn_outliers(n, 23).abs() * 1e-4, randn_outliers(n, 24)
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    ops.adamw_step_(p, m, v, g, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step)
    rm, rv = m0.clone().lerp_(g, 1 - b1), v0.clone().mul_(b2).addcmul_(g, g, value=1 - b2)  # torch's own ops
    assert torch.equal(m, rm) and torch.equal(v, rv)
    f32 = np.float32
    pi = p0.numpy() * f32(1 - lr * wd)
    denom = np.sqrt(rv.numpy()) / f32(math.sqrt(1 - b2 ** step)) + f32(eps)
    want = pi + (f32(-(lr / (1 - b1 ** step))) * rm.numpy()) / denom
    assert torch.equal(p, torch.from_numpy(want))


@pytest.mark.parametrize("lr,betas,eps,wd", [
    (1e-3, (0.9, 0.999), 1e-8, 0.01), (3e-2, (0.8, 0.95), 1e-6, 0.0), (1e-4, (0.95, 0.9999), 1e-10, 0.5),
])
def test_adamw_20_steps_vs_torch(lr, betas, eps, wd):
    n = 1_000_000
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(10))  # outliers are in the gradients
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 21):
        grad = randn_outliers(n, 100 + step)
        ref.grad = grad.clone()
        opt.step()
        ops.adamw_step_(p, m, v, grad, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd,
                        step=step)
    st = opt.state[ref]
    assert (p - ref.detach()).abs().max().item() < 1e-6
    # moments grow with the outliers (|g| ~ 100): compare them relatively, a few float32 ulps
    torch.testing.assert_close(m, st["exp_avg"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-6, atol=1e-7)


def test_adamw_independent_of_thread_count():
    saved = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            p, m, v = randn_outliers(300_001, 5), torch.zeros(300_001), torch.zeros(300_001)
            ops.adamw_step_(p, m, v, randn_outliers(300_001, 6), lr=1e-2, step=1)
            results.append(p)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("case,msg", [
    ("dtype", "param must be Float"), ("numel", "elements, param has"), ("noncontig", "contiguous"),
    ("step", "step counts updates from 1"), ("grad16", "grad must be float32 or bfloat16"),
])
def test_adamw_bad_input(case, msg):
    p, m, v, g = randn_outliers(64, 1), torch.zeros(64), torch.zeros(64), randn_outliers(64, 2)
    kw = dict(lr=1e-3, step=1)
    if case == "dtype":
        p = p.double()
    elif case == "numel":
        m = torch.zeros(65)
    elif case == "noncontig":
        p = randn_outliers(128, 1)[::2]
    elif case == "step":
        kw["step"] = 0
    elif case == "grad16":
        g = g.half()
    with pytest.raises(RuntimeError, match=msg):
        ops.adamw_step_(p, m, v, g, **kw)


@pytest.mark.parametrize("with_bf16", [False, True])
def test_adamw_opcheck(with_bf16):
    n = 33
    args = (randn_outliers(n, 1), torch.zeros(n), torch.zeros(n), randn_outliers(n, 2).to(torch.bfloat16),
            torch.empty(n, dtype=torch.bfloat16) if with_bf16 else None, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3, False)
    torch.library.opcheck(torch.ops.trainstream.adamw_step_.default, args)


def _supported_isas():
    from trainstream_hf import _C
    best = _C.adamw_isa()
    return ["scalar", "avx2", "avx512"][: ["scalar", "avx2", "avx512"].index(best) + 1]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_offset", [0, 1])
def test_adamw_simd_paths_bit_identical(grad_dtype, out_offset, monkeypatch):
    """Every SIMD path this CPU has (AVX-512 with masked tails, AVX2 with a scalar tail, scalar) gives the
    same bits: same operations in the same order, correctly rounded sqrt/div. out_offset=1 puts the bf16 copy 2
    bytes off a 32-byte boundary, where AVX-512 cannot stream its stores (ordinary stores instead)."""
    n = 100_003  # not a multiple of 8 or 16: exercises every tail
    results = {}
    for isa in _supported_isas():
        monkeypatch.setenv("TRAINSTREAM_CPU_ISA", isa)
        p, m, v = randn_outliers(n, 21), randn_outliers(n, 22) * 0.01, randn_outliers(n, 23).abs() * 0.01
        out = torch.empty(n + 16, dtype=torch.bfloat16)[out_offset:out_offset + n]
        assert (out.data_ptr() % 32 == 0) == (out_offset == 0)
        ops.adamw_step_(p, m, v, randn_outliers(n, 24).to(grad_dtype), lr=1e-2, weight_decay=0.1, step=3, param_bf16=out)
        results[isa] = (p, m, v, out)
    first = results["scalar"]
    for isa, r in results.items():
        for a, b in zip(first, r):
            assert torch.equal(a, b), isa


def test_adamw_bad_isa(monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError, match="TRAINSTREAM_CPU_ISA must be"):
        ops.adamw_step_(randn_outliers(8, 1), torch.zeros(8), torch.zeros(8), randn_outliers(8, 2), lr=1e-3, step=1)


def test_adamw_num_threads_does_not_change_the_bits():
    """The native pool may be capped (the engine's worker leaves the kernel-launching thread a core); every
    element's update is its own, so any thread count gives the same bits."""
    n = 1_000_003
    grad = randn_outliers(n, 11)
    results = []
    for threads in (0, 1, 3):
        p, m, v = randn_outliers(n, 1), randn_outliers(n, 2) * 0.1, randn_outliers(n, 3).abs() * 0.01
        out = torch.empty(n, dtype=torch.bfloat16)
        ops.adamw_step_(p, m, v, grad, lr=1e-3, weight_decay=0.1, step=3, param_bf16=out, num_threads=threads)
        results.append((p, m, v, out))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    with pytest.raises(RuntimeError, match="num_threads must be >= 0"):
        ops.adamw_step_(*results[0][:3], grad, lr=1e-3, step=4, num_threads=-1)


# -- adamw_step_sr_: bfloat16 moments stored by stochastic rounding ----------------------------------------------
def _sr_state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = (torch.randn(n, generator=g) * 0.01).bfloat16()
    v = (torch.rand(n, generator=g) * 1e-4).bfloat16()
    return p, m, v, (torch.randn(n, generator=g) * 3).bfloat16()


@pytest.mark.parametrize("grad_dtype,maximize,wd", [(torch.bfloat16, False, 0.1), (torch.float32, True, 0.0)])
def test_adamw_sr_matches_reference(grad_dtype, maximize, wd):
    """The moments bit for bit (the same random bits, the same float32 update); the weights to rounding."""
    p, m, v, g = _sr_state(100_003)
    g = g.to(grad_dtype)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out, rout = torch.empty_like(m), torch.empty_like(m)
    for step in range(1, 6):
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, step=step, maximize=maximize, seed=3)
        ops.adamw_step_sr_(p, m, v, g, param_bf16=out, **kw)
        ops.adamw_step_sr_reference(rp, rm, rv, g, param_bf16=rout, **kw)
    assert torch.equal(m, rm) and torch.equal(v, rv)
    assert (p - rp).abs().max() < 1e-6


def test_adamw_sr_bits_do_not_depend_on_threads_and_follow_the_seed():
    results = []
    for threads, seed in ((1, 5), (4, 5), (4, 6)):
        p, m, v, g = _sr_state(300_001)
        ops.adamw_step_sr_(p, m, v, g, lr=1e-3, step=2, seed=seed, num_threads=threads)
        results.append((m, v))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[1][1], results[2][1])


def test_adamw_sr_moments_move_where_round_to_nearest_freezes():
    """beta2 = 0.999 with g^2 = 2 v: each step adds 0.1% to v, below half a bf16 ulp (0.39%): rounded to nearest, v
    never moves; stochastically rounded, its mean follows the float32 recurrence 2 - 0.999^t."""
    n, steps = 4096, 1000
    p, g = torch.zeros(n), torch.full((n,), 2.0 ** 0.5)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    m32, v32 = torch.zeros(n), torch.ones(n)
    for step in range(1, steps + 1):
        ops.adamw_step_sr_(p, m, v, g, lr=0.0, step=step, seed=1, weight_decay=0.0)
        ops.adamw_step_(p.clone(), m32, v32, g, lr=0.0, step=step, weight_decay=0.0)
    expected = 2 - 0.999 ** steps
    assert abs(v.float().mean().item() - expected) < 0.01 * expected
    assert abs(v32.mean().item() - expected) < 1e-4
    frozen = torch.ones(n, dtype=torch.bfloat16)
    for _ in range(10):
        frozen = (frozen.float() * 0.999 + 0.001 * 2.0).bfloat16()
    assert torch.equal(frozen, torch.ones(n, dtype=torch.bfloat16))  # round-to-nearest: stuck at 1.0


def test_adamw_sr_bad_input():
    p, m, v, g = _sr_state(64)
    with pytest.raises(RuntimeError, match="exp_avg and exp_avg_sq must be bfloat16"):
        ops.adamw_step_sr_(p, m.float(), v.float(), g, lr=1e-3, step=1)
    with pytest.raises(RuntimeError, match="elements, param has 64"):
        ops.adamw_step_sr_(p, m[:32], v[:32], g, lr=1e-3, step=1)
    with pytest.raises(RuntimeError, match="step counts updates from 1"):
        ops.adamw_step_sr_(p, m, v, g, lr=1e-3, step=0)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adamw_sr_simd_paths_bit_identical(grad_dtype, monkeypatch):
    """The bf16-moment loop, compiled for each instruction set this CPU has (the compiler vectorizes it), writes the
    same bits in each: the same operations in the same order, specials (inf, NaN) included."""
    n = 100_003
    results = {}
    for isa in _supported_isas():
        monkeypatch.setenv("TRAINSTREAM_CPU_ISA", isa)
        p, m, v, g = _sr_state(n, seed=4)
        g = g.to(grad_dtype)
        g[:3] = torch.tensor([float("inf"), float("nan"), 1e30])
        out = torch.empty(n, dtype=torch.bfloat16)
        ops.adamw_step_sr_(p, m, v, g, lr=1e-2, weight_decay=0.1, step=3, seed=9, param_bf16=out)
        results[isa] = (p, m, v, out)
    first = results["scalar"]
    for isa, r in results.items():
        for a, b in zip(first, r):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32)), isa
