"""The int8 / FP8 dequantize kernels and the per-row E4M3 activation quantizer (CPU) against their references, bit for
bit, over shapes, input and output dtypes, edge cases and thread counts; opcheck; bad input."""
import pytest
import torch

from trainstream_hf import ops
from trainstream_hf.quant import dequantize, matmul, quantize
from tests.helpers import assert_same_bits, bits, column_scale, randn_outliers

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (1, 1) and (3, 17): rows shorter than a 16-code vector and not a multiple of it; (129, 320), (64, 4096): whole ones.
SHAPES = [(1, 1), (3, 17), (37, 53), (129, 320), (64, 4096)]
ROWWISE = {
    "int8": (ops.quantize_int8_reference, ops.dequantize_int8, ops.dequantize_int8_reference),
    "fp8": (ops.quantize_fp8_reference, ops.dequantize_fp8, ops.dequantize_fp8_reference),
}


# ---------------------------------------------------------------------------------------------------------------
# dequantize_int8 / dequantize_fp8
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(ROWWISE))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_equals_reference(fmt, shape, dtype):
    quant, deq, deq_ref = ROWWISE[fmt]
    w = randn_outliers(shape, 10 * SHAPES.index(shape) + DTYPES.index(dtype), dtype)
    if shape[0] > 2:
        w[1] = 0.0  # a zero row: scale 0
        w[2] *= 1e-30 if dtype == torch.float32 else 1e-3  # small scales (subnormal in float32)
    data, scale = quant(w)
    for out in DTYPES:
        assert_same_bits(deq(data, scale, out), deq_ref(data, scale, out))


@pytest.mark.parametrize("fmt", list(ROWWISE))
def test_dequantize_views_and_all_codes(fmt):
    """Strided codes / scales, and every code value (all 256 bytes, NaN codes aside for fp8) against every scale."""
    quant, deq, deq_ref = ROWWISE[fmt]
    data, scale = quant(randn_outliers((64, 96), 1))
    assert_same_bits(deq(data.t(), scale[:96 // 2].repeat(2), torch.bfloat16),
                      deq_ref(data.t(), scale[:96 // 2].repeat(2), torch.bfloat16))
    assert_same_bits(deq(data[:, 1::3], scale, torch.float16), deq_ref(data[:, 1::3], scale, torch.float16))
    codes = torch.arange(256, dtype=torch.uint8)
    if fmt == "fp8":
        codes = codes[(codes & 0x7F) != 0x7F]  # E4M3's NaN encodings: no quantizer writes them
    codes = codes.view(torch.int8 if fmt == "int8" else torch.float8_e4m3fn).repeat(5, 1)
    scales = torch.tensor([1.0, 3.0e-3, 7.5e-41, 1.0e30, 0.0])  # includes a subnormal, an overflowing one, zero
    for out in DTYPES:
        assert_same_bits(deq(codes, scales, out), deq_ref(codes, scales, out))


@pytest.mark.parametrize("fmt", list(ROWWISE))
def test_dequantize_independent_of_thread_count(fmt):
    quant, deq, _ = ROWWISE[fmt]
    data, scale = quant(randn_outliers((512, 1024), 2))
    saved = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(deq(data, scale, torch.bfloat16))
    finally:
        torch.set_num_threads(saved)
    assert_same_bits(outs[0], outs[1])


@pytest.mark.parametrize("fmt", list(ROWWISE))
def test_formats_dequantize_takes_the_kernel(fmt, monkeypatch):
    """formats.dequantize runs the native op on the CPU (a spy on the dispatcher-level call) and gives its bits."""
    q = quantize(randn_outliers((24, 80), 3), fmt)
    calls = []
    native = ops.dequantize_int8 if fmt == "int8" else ops.dequantize_fp8
    from trainstream_hf.quant import formats
    monkeypatch.setitem(formats._NATIVE, fmt, (None, lambda *a, **k: calls.append(1) or native(*a, **k)))
    out = dequantize(q, torch.float16)
    assert calls == [1]
    assert_same_bits(out, ROWWISE[fmt][2](q.tensors["data"], q.tensors["scale"], torch.float16))


@pytest.mark.parametrize("fmt", list(ROWWISE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_opcheck(fmt, dtype):
    quant, _, _ = ROWWISE[fmt]
    op = getattr(torch.ops.trainstream, f"dequantize_{fmt}").default
    data, scale = quant(randn_outliers((33, 48), 4))
    # test_schema compares inputs with torch.allclose, which torch does not implement for float8 (the fp8 codes).
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, (data, scale, dtype), test_utils=utils[1:] if fmt == "fp8" else utils)


@pytest.mark.parametrize("fmt", list(ROWWISE))
def test_dequantize_bad_input(fmt):
    quant, deq, _ = ROWWISE[fmt]
    data, scale = quant(randn_outliers((4, 32), 5))
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
        deq(data, scale, torch.float64)
    with pytest.raises(RuntimeError, match="scale must be Float"):
        deq(data, scale.double(), torch.float32)
    with pytest.raises(RuntimeError, match="scale must have shape"):
        deq(data, scale[:3], torch.float32)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        deq(data.view(-1), scale, torch.float32)
    with pytest.raises(RuntimeError, match="data must be"):
        deq(data.view(torch.uint8), scale, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# quantize_rows_e4m3
# ---------------------------------------------------------------------------------------------------------------

ROW_SHAPES = [(1, 1), (5, 7), (9, 80), (33, 128), (64, 4096), (3, 4100)]


def _activations(shape, seed, dtype):
    x = randn_outliers(shape, seed)
    rows, cols = shape
    if rows > 4:
        x[1] = 0.0  # an all-zero token: scale 0, codes +0
        x[2, : cols // 2] = -0.0  # signed zeros in a live row keep their sign
        x[3] *= 1e-30 if dtype == torch.float32 else 1e-4  # tiny scale (subnormal codes)
        x[4] *= 60.0 if dtype == torch.float16 else 1e30  # near the top of the dtype
    x = x.to(dtype)
    assert bool(torch.isfinite(x).all())  # NaN / inf codes may differ in sign bit between devices: not compared
    return x


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_col_scale", [False, True])
def test_quantize_rows_equals_reference(shape, dtype, with_col_scale):
    x = _activations(shape, 100 + ROW_SHAPES.index(shape), dtype)
    cs = column_scale(shape[1], 7) if with_col_scale else None
    q, s = ops.quantize_rows_e4m3(x, cs)
    q_ref, s_ref = ops.quantize_rows_e4m3_reference(x, cs)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (shape[0], 1)
    assert_same_bits(q, q_ref)
    assert_same_bits(s, s_ref)
    if shape[0] > 4:
        assert float(s[1]) == 0.0 and torch.equal(bits(q[1]), torch.zeros(shape[1], dtype=torch.uint8))


def test_quantize_rows_edge_values():
    """Exact halfway points between E4M3 neighbours (ties to even), the saturation boundary, a zero col_scale entry
    and a non-contiguous input."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # all finite positive values
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    row = torch.cat([mids, -mids, torch.tensor([448.0, 447.9, -448.0])])
    x = torch.stack([row, row * 0.5, row * 2.0**-20])
    for v in (x, x.t().contiguous().t(), x[:, ::2]):
        for cs in (None, torch.linspace(0, 2, v.shape[1])):
            q, s = ops.quantize_rows_e4m3(v, cs)
            q_ref, s_ref = ops.quantize_rows_e4m3_reference(v, cs)
            assert_same_bits(q, q_ref)
            assert_same_bits(s, s_ref)


def test_quantize_rows_every_bf16_value():
    """Every finite bfloat16 value in [-448, 448] (all E4M3 normals, subnormals, ties, signed zeros, values rounding
    to 0), in rows whose last entry 448 makes the scale exactly 1: the codes are torch's E4M3 rounding of the values
    themselves. (tests/gpu checks the CUDA kernel on the same values.)"""
    v = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v[torch.isfinite(v) & (v.abs() <= 448)]
    pad = (-v.numel()) % 255
    body = torch.cat([v, v.new_zeros(pad)]).view(-1, 255)
    x = torch.cat([body, body.new_full((body.shape[0], 1), 448.0)], dim=1)
    q, s = ops.quantize_rows_e4m3(x)
    assert bool((s == 1.0).all())
    assert torch.equal(bits(q[:, :255]).reshape(-1)[: v.numel()], bits(v.to(torch.float8_e4m3fn)))
    q_ref, s_ref = ops.quantize_rows_e4m3_reference(x)
    assert_same_bits(q, q_ref)
    assert_same_bits(s, s_ref)
    assert bits(q).unique().numel() == 254  # every E4M3 code but the two NaNs


def test_quantize_rows_col_scale_is_a_float32_multiply():
    """quantize_rows_e4m3(x, cs) == quantize_rows_e4m3(float32(x) * cs): the column scale is one float32 product."""
    x = _activations((17, 96), 8, torch.bfloat16)
    cs = column_scale(96, 9)
    for a, b in zip(ops.quantize_rows_e4m3(x, cs), ops.quantize_rows_e4m3(x.float() * cs)):
        assert_same_bits(a, b)


def test_quantize_rows_nan_row():
    """A NaN poisons its own row (NaN scale, NaN codes, as torch.amax / the reference) and no other."""
    x = _activations((6, 48), 10, torch.bfloat16)
    x[3, 5] = float("nan")
    q, s = ops.quantize_rows_e4m3(x)
    q_ref, s_ref = ops.quantize_rows_e4m3_reference(x)
    assert torch.isnan(s[3]).all() and torch.isnan(q[3].float()).all() and torch.isnan(q_ref[3].float()).all()
    keep = [0, 1, 2, 4, 5]
    assert_same_bits(q[keep], q_ref[keep])
    assert_same_bits(s[keep], s_ref[keep])


def test_quantize_rows_empty_and_thread_count():
    q, s = ops.quantize_rows_e4m3(torch.zeros(0, 64, dtype=torch.bfloat16))
    assert q.shape == (0, 64) and s.shape == (0, 1)
    x = _activations((300, 512), 11, torch.bfloat16)
    saved = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(ops.quantize_rows_e4m3(x, column_scale(512, 12)))
    finally:
        torch.set_num_threads(saved)
    for a, b in zip(*outs):
        assert_same_bits(a, b)


def test_matmul_quantizer_calls_the_op(monkeypatch):
    """matmul.quantize_rows_e4m3 (what the FP8 paths call) is the native op where there is a kernel, same bits as the
    reference, and the reference where there is none."""
    x = _activations((9, 80), 13, torch.float16)
    assert_same_bits(matmul.quantize_rows_e4m3(x)[0], ops.quantize_rows_e4m3_reference(x)[0])
    calls = []
    monkeypatch.setattr(ops, "quantize_rows_e4m3", lambda *a: calls.append(1) or ops.quantize_rows_e4m3_reference(*a))
    matmul.quantize_rows_e4m3(x)
    assert calls == [1]
    monkeypatch.setattr(ops, "has_kernel", lambda op, device: False)
    matmul.quantize_rows_e4m3(x)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_col_scale", [False, True])
def test_quantize_rows_opcheck(dtype, with_col_scale):
    x = _activations((33, 128), 14, dtype)
    torch.library.opcheck(torch.ops.trainstream.quantize_rows_e4m3.default,
                          (x, column_scale(128, 15) if with_col_scale else None))


@pytest.mark.parametrize("case,exc,msg", [
    ("1d", ValueError, "must be 2-D"), ("float64", TypeError, "float32, bfloat16 or float16"),
    ("no_features", ValueError, "no features"), ("col_scale_shape", RuntimeError, "col_scale must have shape"),
    ("col_scale_dtype", RuntimeError, "col_scale must be Float"),
])
def test_quantize_rows_bad_input(case, exc, msg):
    x, cs = _activations((4, 32), 16, torch.bfloat16), None
    if case == "1d":
        x = x.view(-1)
    elif case == "float64":
        x = x.double()
    elif case == "no_features":
        x = x[:, :0]
    elif case == "col_scale_shape":
        cs = torch.ones(31)
    elif case == "col_scale_dtype":
        cs = torch.ones(32, dtype=torch.bfloat16)
    with pytest.raises(exc, match=msg):
        ops.quantize_rows_e4m3(x, cs)


# ---------------------------------------------------------------------------------------------------------------
# transpose_bytes (the FP8 backward's column-major weight)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (64, 64), (130, 200), (256, 4096)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.int8])
def test_transpose_bytes_equals_reference(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)
    out = ops.transpose_bytes(x)
    assert out.dtype == dtype and out.shape == (shape[1], shape[0]) and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), ops.transpose_bytes_reference(x).view(torch.uint8))
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8).t())


def test_transpose_bytes_opcheck_and_bad_input():
    x = torch.randint(0, 256, (33, 70), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    torch.library.opcheck(torch.ops.trainstream.transpose_bytes.default, (x,))
    with pytest.raises(ValueError, match="2-D"):
        ops.transpose_bytes(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="1-byte"):
        ops.transpose_bytes(torch.zeros(4, 4))
