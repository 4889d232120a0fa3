"""Weight formats (int8, NF4, FP8, NVFP4): native kernels bit-exact against the references, round-trip error
bounds, SQNR on N(0, 1) 4096x4096, packed sizes, opcheck, bad input (CPU)."""
import math

import pytest
import torch

from trainstream_hf import ops
from trainstream_hf.quant import formats
from trainstream_hf.quant.formats import dequantize, get_format, packed_nbytes, quantize
from tests.helpers import assert_same_bits, bits, randn_outliers

NATIVE = {
    "nf4": (ops.quantize_nf4, ops.quantize_nf4_reference, ops.dequantize_nf4, ops.dequantize_nf4_reference),
    "nvfp4": (ops.quantize_nvfp4, ops.quantize_nvfp4_reference, ops.dequantize_nvfp4,
              ops.dequantize_nvfp4_reference),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------------------------------------------------------
# Native kernels equal the references bit for bit
# ---------------------------------------------------------------------------------------------------------------

# (129, 320): 645 NF4 blocks, so the last group of 256 is partial; (300, 4096): 75 whole groups.
SHAPES = [(1, 64), (7, 192), (129, 320), (300, 4096)]


@pytest.mark.parametrize("fmt", list(NATIVE))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_equals_reference(fmt, shape, dtype):
    quant, quant_ref, deq, deq_ref = NATIVE[fmt]
    w = randn_outliers(shape, 10 * list(NATIVE).index(fmt) + SHAPES.index(shape), dtype)
    q = quant(w)
    assert_same_bits(q, quant_ref(w))
    for out in DTYPES:
        assert torch.equal(bits(deq(*q, dtype=out)), bits(deq_ref(*q, dtype=out)))


@pytest.mark.parametrize("fmt", list(NATIVE))
@pytest.mark.parametrize("case", ["zeros", "zero_rows", "tiny", "transposed"])
def test_native_equals_reference_edge_cases(fmt, case):
    quant, quant_ref, deq, deq_ref = NATIVE[fmt]
    w = randn_outliers((64, 256), 3)
    if case == "zeros":
        w = torch.zeros(64, 256)
    elif case == "zero_rows":
        w[::3] = 0.0
        w[1, :128] = -0.0
    elif case == "tiny":  # subnormal block scales and absmax values near the bottom of float32
        w[:32] *= 1e-30
        w[40] *= 1e-6
    elif case == "transposed":  # a non-contiguous view
        w = randn_outliers((256, 64), 4).t()
    q = quant(w)
    assert_same_bits(q, quant_ref(w))
    assert torch.equal(bits(deq(*q, dtype=torch.float32)), bits(deq_ref(*q, dtype=torch.float32)))
    if case == "zeros":
        assert torch.equal(bits(deq(*q, dtype=torch.float32)), bits(torch.zeros(64, 256)))


@pytest.mark.parametrize("fmt", list(NATIVE))
def test_native_independent_of_thread_count(fmt):
    quant, _, deq, _ = NATIVE[fmt]
    w = randn_outliers((512, 1024), 5)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        q = quant(w)
        results.append((*q, deq(*q, dtype=torch.bfloat16)))
    torch.set_num_threads(1)
    assert_same_bits(results[0], results[1])


def test_e2m1_ties_round_to_even():
    """Values exactly halfway between E2M1 neighbours go to the even code (0, 1, 1, 2, 2, 4, 4), both signs."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.26])
    w = torch.zeros(2, 16)
    w[0, :9], w[1, :9] = ties, -ties
    # amax 6: ts = 6 / 2688 and the block scale 448 give t == 1 exactly, so w / t is w
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5])
    for quant, deq in ((ops.quantize_nvfp4, ops.dequantize_nvfp4),
                       (ops.quantize_nvfp4_reference, ops.dequantize_nvfp4_reference)):
        data, block_scale, ts = quant(w)
        assert float(ts * block_scale[0, 0].float()) == 1.0
        out = deq(data, block_scale, ts, dtype=torch.float32)
        assert torch.equal(out[0, :9], expected) and torch.equal(out[1, :9], -expected)


def test_nibble_order():
    """NF4: element 2j in the high nibble (bitsandbytes); NVFP4: in the low nibble (torch.float4_e2m1fn_x2)."""
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 63] = -1.0, 1.0  # NF4 codes 0 and 15; NVFP4 codes 0xF (-6) and 0x7 (6)
    data = quantize(w, "nf4").data
    assert data[0, 0].item() >> 4 == 0 and data[0, 31].item() & 0xF == 15
    data = quantize(w, "nvfp4").data
    assert data[0, 0].item() & 0xF == 0xF and data[0, 31].item() >> 4 == 0x7


# ---------------------------------------------------------------------------------------------------------------
# Round trips on weights with outliers: per-element error bounds that follow from each format's definition
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_int8(dtype):
    w = randn_outliers((96, 320), 11, dtype).float()
    q = quantize(w, "int8")
    assert q.data.dtype == torch.int8 and int(q.data.abs().max()) <= 127
    scale = w.abs().amax(dim=1) / 127
    err = (dequantize(q, torch.float32) - w).abs()
    assert bool((err <= scale[:, None] * (0.5 + 1e-5)).all())


def test_round_trip_fp8():
    w = randn_outliers((96, 320), 12)
    q = quantize(w, "fp8")
    scale = q.tensors["scale"][:, None]
    err = (dequantize(q, torch.float32) - w).abs()
    # E4M3 has 3 mantissa bits: half an ulp is <= 2^-4 of the value; below 2^-6 the subnormal step is 2^-9.
    assert bool((err <= w.abs() * (2 ** -4 + 1e-6) + scale * 2 ** -10).all())
    assert float(err.max()) > 0  # it did quantize


def test_round_trip_nf4():
    w = randn_outliers((96, 320), 13)
    q = quantize(w, "nf4")
    t = q.tensors
    x = w.view(-1, 64)
    absmax = x.abs().amax(dim=1)
    d = t["absmax_q"].float() * t["absmax_scale"].repeat_interleave(256)[: absmax.numel()] + t["absmax_offset"]
    scale = t["absmax_scale"].repeat_interleave(256)[: absmax.numel()]
    # E4M3 double quantisation: |d - absmax| within half an E4M3 ulp of |absmax - offset| (or a subnormal step).
    assert bool(((d - absmax).abs() <= (absmax - t["absmax_offset"]).abs() * 2 ** -4 * 1.0001 + scale * 2 ** -10).all())
    # Nearest NF4 code: within half the widest gap (-1 .. -0.696) of d, plus any clipping where |w| > d.
    half_gap = float((ops.NF4_CODE[1:] - ops.NF4_CODE[:-1]).max()) / 2
    err = (dequantize(q, torch.float32).view(-1, 64) - x).abs()
    bound = half_gap * d.abs() + (absmax - d.abs()).clamp(min=0)
    assert bool((err <= bound[:, None] * 1.0001 + 1e-6).all())


def test_round_trip_nvfp4():
    w = randn_outliers((96, 320), 14)
    q = quantize(w, "nvfp4")
    t = (q.tensors["tensor_scale"] * q.tensors["block_scale"].float()).repeat_interleave(16, dim=1)
    bmax = w.view(96, -1, 16).abs().amax(dim=-1).repeat_interleave(16, dim=1)
    assert torch.equal(q.tensors["tensor_scale"], w.abs().max() / 2688.0)
    # E2M1's gap around v is <= max(0.5, |v| / 2): error <= max(t / 4, |w| / 4), plus clipping above 6t.
    err = (dequantize(q, torch.float32) - w).abs()
    bound = torch.maximum(t / 4, w.abs() / 4) + (bmax - 6 * t).clamp(min=0)
    assert bool((err <= bound * 1.0001 + 1e-30).all())


# ---------------------------------------------------------------------------------------------------------------
# SQNR on N(0, 1) 4096 x 4096 (no outliers), the figures the issue sets
# ---------------------------------------------------------------------------------------------------------------

SQNR_MIN_DB = {"int8": 40.0, "fp8": 31.0, "nf4": 20.0, "nvfp4": 20.0}


@pytest.fixture(scope="module")
def gaussian_4096():
    return torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fmt", list(SQNR_MIN_DB))
def test_sqnr_gaussian_4096(fmt, gaussian_4096):
    w = gaussian_4096
    err = dequantize(quantize(w, fmt), torch.float32).sub_(w)
    sqnr = 10 * math.log10(float(w.square().sum(dtype=torch.float64)) / float(err.square_().sum(dtype=torch.float64)))
    print(f"SQNR {fmt}: {sqnr:.2f} dB")
    assert sqnr >= SQNR_MIN_DB[fmt]


# ---------------------------------------------------------------------------------------------------------------
# Packed size
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,bits", [("int8", 8 + 32 / 4096), ("fp8", 8 + 32 / 4096),
                                      ("nf4", 4 + 8 / 64 + 32 / (64 * 256) + 32 / 4096 ** 2),
                                      ("nvfp4", 4 + 8 / 16 + 32 / 4096 ** 2)])
def test_bits_per_weight(fmt, bits):
    f = get_format(fmt)
    assert abs(f.bits_per_weight((4096, 4096)) - bits) < 1e-6
    assert packed_nbytes(fmt, (4096, 4096)) == f.packed_nbytes((4096, 4096))


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
@pytest.mark.parametrize("shape", [(3, 64), (129, 320), (64, 4096)])
def test_packed_nbytes_matches_tensors(fmt, shape):
    q = quantize(randn_outliers(shape, 21), fmt)
    assert q.nbytes == packed_nbytes(fmt, shape)
    assert q.shape == shape and tuple(q.tensors) == get_format(fmt).tensor_names
    assert q.data.shape[0] == shape[0]


def test_quantize_keeps_bf16_input_exact_path():
    """A bf16 weight quantizes as its float32 upcast does (all maths is float32)."""
    w = randn_outliers((64, 128), 22, torch.bfloat16)
    for fmt in ("int8", "nf4", "fp8", "nvfp4"):
        a, b = quantize(w, fmt), quantize(w.float(), fmt)
        assert_same_bits(list(a.tensors.values()), list(b.tensors.values()))


# ---------------------------------------------------------------------------------------------------------------
# NVFP4 scale layout for the FP4 tensor-core GEMM
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,cols", [(128, 4), (130, 5), (300, 24)])
def test_nvfp4_blocked_scales_follow_cublas_layout(rows, cols):
    scales = torch.arange(rows * cols, dtype=torch.int32).view(rows, cols)
    blocked = formats.nvfp4_blocked_scales(scales)
    col_tiles = -(-cols // 4)
    assert blocked.numel() == (-(-rows // 128)) * 128 * col_tiles * 4
    # cuBLAS "1D Block Scaling Factors Layout": offset of scale (r, c) in the flat array.
    for r in range(rows):
        for c in range(cols):
            offset = 512 * ((r // 128) * col_tiles + c // 4) + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert int(blocked[offset]) == int(scales[r, c])
    e4m3 = formats.nvfp4_blocked_scales(torch.ones(rows, cols, dtype=torch.float8_e4m3fn))
    assert e4m3.dtype == torch.float8_e4m3fn and float(e4m3.float().sum()) == rows * cols


# ---------------------------------------------------------------------------------------------------------------
# opcheck for every native op
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(NATIVE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(fmt, dtype):
    quant_op = getattr(torch.ops.trainstream, f"quantize_{fmt}").default
    deq_op = getattr(torch.ops.trainstream, f"dequantize_{fmt}").default
    w = randn_outliers((33, 128), 31, dtype)
    torch.library.opcheck(quant_op, (w,))
    # test_schema compares inputs before and after the call with torch.allclose, which torch does not implement
    # for float8 (the scales): every other check runs.
    torch.library.opcheck(deq_op, (*quant_op(w), dtype),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------

def test_unknown_format():
    with pytest.raises(ValueError, match="unknown quantization format 'nf3': choose one of int8, nf4, fp8, nvfp4"):
        quantize(randn_outliers((4, 64), 1), "nf3")
    with pytest.raises(ValueError, match="unknown quantization format"):
        packed_nbytes("int4", (4, 64))


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
@pytest.mark.parametrize("case,exc,msg", [
    ("3d", ValueError, "must be 2-D"), ("1d", ValueError, "must be 2-D"), ("empty", ValueError, "empty"),
    ("float64", TypeError, "float32, bfloat16 or float16"), ("int", TypeError, "float32, bfloat16 or float16"),
    ("nan", ValueError, "inf or NaN"), ("inf", ValueError, "inf or NaN"),
])
def test_bad_weight(fmt, case, exc, msg):
    w = randn_outliers((4, 64), 2)
    w = {"3d": w.view(2, 2, 64), "1d": w.view(-1), "empty": w[:0], "float64": w.double(),
         "int": w.to(torch.int32)}.get(case, w)
    if case in ("nan", "inf"):
        w[1, 5] = float(case)
    with pytest.raises(exc, match=msg):
        quantize(w, fmt)


@pytest.mark.parametrize("fmt,multiple", [("nf4", 64), ("nvfp4", 16)])
def test_in_features_not_a_multiple_of_the_block(fmt, multiple):
    w = randn_outliers((4, multiple + 8), 3)
    with pytest.raises(ValueError, match=f"in_features must be a multiple of {multiple}, got {multiple + 8}"):
        quantize(w, fmt)
    with pytest.raises(ValueError, match=f"multiple of {multiple}"):
        packed_nbytes(fmt, (4, multiple + 8))


@pytest.mark.parametrize("fmt", list(NATIVE))
@pytest.mark.parametrize("case,exc,msg", [
    ("3d", ValueError, "must be 2-D"), ("float64", TypeError, "float32, bfloat16 or float16"),
    ("multiple", ValueError, "in_features must be a multiple of"), ("nan", ValueError, "inf or NaN"),
])
def test_native_op_bad_weight(fmt, case, exc, msg):
    """The native ops raise the same exception types as the references (TORCH_CHECK_VALUE / _TYPE)."""
    quant, quant_ref, _, _ = NATIVE[fmt]
    w = randn_outliers((4, 64), 4)
    w = {"3d": w.view(2, 2, 64), "float64": w.double(), "multiple": w[:, :40]}.get(case, w)
    if case == "nan":
        w[0, 0] = float("nan")
    for fn in (quant, quant_ref):
        with pytest.raises(exc, match=msg):
            fn(w)


@pytest.mark.parametrize("fmt", list(NATIVE))
def test_dequantize_bad_input(fmt):
    _, _, deq, deq_ref = NATIVE[fmt]
    q = quantize(randn_outliers((4, 64), 5), fmt)
    args = list(q.tensors.values())
    for fn in (deq, deq_ref):
        with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
            fn(*args, dtype=torch.float64)
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
        dequantize(q, torch.int8)
    bad = list(args)
    bad[1] = bad[1].float()  # scales in the wrong dtype
    with pytest.raises(RuntimeError, match="must be Float8_e4m3fn"):
        deq(*bad, dtype=torch.float32)
    bad = list(args)
    bad[0] = bad[0][:, :-1]  # codes for a different shape than the scales
    with pytest.raises(RuntimeError, match="must be a multiple of|must have shape"):
        deq(*bad, dtype=torch.float32)


def test_quantize_picks_native_kernel_where_registered():
    """Each direction takes the native op where this build has a kernel for the device: NF4 / NVFP4 both ways, int8 /
    FP8 dequantize only (their quantizers are the references everywhere)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key("trainstream::dequantize_fp8", "CUDA")
    for fmt in ("nf4", "nvfp4"):
        assert formats._impl(get_format(fmt), cpu) == formats._NATIVE[fmt]
        assert formats._impl(get_format(fmt), cuda) == (formats._NATIVE if has_cuda else formats._REFERENCE)[fmt]
    for fmt in ("int8", "fp8"):
        ref_q, ref_d = formats._REFERENCE[fmt]
        assert formats._impl(get_format(fmt), cpu) == (ref_q, formats._NATIVE[fmt][1])
        assert formats._impl(get_format(fmt), cuda) == (ref_q, formats._NATIVE[fmt][1] if has_cuda else ref_d)
