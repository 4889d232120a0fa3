"""Packed storage formats for frozen linear weights: int8, NF4, FP8 (E4M3) and NVFP4.

A weight is ``(out_features, in_features)`` (``nn.Linear`` layout, ``y = x W^T``), quantized from float32, bfloat16
or float16 on any device, and held as a :class:`QuantizedTensor`: a dict of plain tensors (packed codes first,
then scales) that the engine can page as bytes. ``N = out_features``, ``K = in_features``.

======  =====================================================================  ============  ===============
format  tensors (dtype, shape)                                                 K multiple    bits / weight
======  =====================================================================  ============  ===============
int8    data (int8, N x K); scale (f32, N): per-row max|w| / 127                any           8 + 32 / K
nf4     data (u8, N x K/2); absmax_q (e4m3, NK/64); absmax_scale                64            ~4.127
        (f32, ceil(NK/64/256)); absmax_offset (f32, scalar)
fp8     data (float8_e4m3fn, N x K); scale (f32, N): per-row max|w| / 448       any           8 + 32 / K
nvfp4   data (u8, N x K/2); block_scale (e4m3, N x K/16); tensor_scale          16            ~4.5
        (f32, scalar) = max|w| / (448 * 6)
======  =====================================================================  ============  ===============

Layouts:

* **int8**: ``w ~ data * scale[:, None]``; codes in [-127, 127] (symmetric, -128 unused).
* **nf4**: QLoRA's NormalFloat-4 (Dettmers et al. 2023, arXiv:2305.14314) with bitsandbytes' 16 code values
  (:data:`trainstream_hf.ops.NF4_CODE`). The weight is flattened row-major into blocks of 64 (K % 64 == 0, so a
  block never straddles rows); block ``b`` decodes as ``NF4[code] * d_b`` with
  ``d_b = float(absmax_q[b]) * absmax_scale[b // 256] + absmax_offset``: the per-block absmax is double-quantised,
  its mean subtracted and the rest coded in E4M3 with one float32 scale per 256 blocks. Two codes per byte,
  element ``2j`` in the **high** nibble and ``2j + 1`` in the low one (bitsandbytes' order). The 16 code values,
  block size, nibble order and ``absmax - mean`` offset follow bitsandbytes; the 8-bit absmax code does not
  (bitsandbytes uses its own 8-bit dynamic map), so the packed bytes are *not* interchangeable with
  bitsandbytes'. 4 + 8/64 + 32/(64*256) = 4.127 bits per weight.
* **fp8**: ``w ~ float(data) * scale[:, None]``, E4M3 (``torch.float8_e4m3fn``) rounded to nearest even and
  saturated at +-448; ``data`` and ``scale`` are the weight operand and its row-wise scale for ``torch._scaled_mm``.
* **nvfp4**: NVIDIA's NVFP4 ("Introducing NVFP4 for Efficient and Accurate Low-Precision Inference", NVIDIA
  technical blog, June 2025): E2M1 codes (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), one E4M3
  scale per 16 consecutive weights along K, one float32 scale per tensor; ``w[n, k] ~ E2M1[code] *
  float(block_scale[n, k // 16]) * tensor_scale``. Two codes per byte, element ``2j`` in the **low** nibble and
  ``2j + 1`` in the high one, which is ``torch.float4_e2m1fn_x2``'s order: ``data.view(torch.float4_e2m1fn_x2)``
  is the FP4 operand as torch and cuBLAS read it. ``block_scale`` is stored row-major (N, K/16); the FP4
  tensor-core GEMM (``torch._scaled_mm`` with float4_e2m1fn_x2 operands, sm_100+) wants it rearranged into
  cuBLAS' 128x4-tile block-scaling layout, which :func:`nvfp4_blocked_scales` produces, and ``tensor_scale``
  applied to the output: ``torch._scaled_mm(x_fp4, data.view(torch.float4_e2m1fn_x2).t(),
  nvfp4_blocked_scales(x_scale), nvfp4_blocked_scales(block_scale), out_dtype=torch.bfloat16) * (x_ts * ts)``
  (the call torchao's NVFP4Tensor makes; not run here: no sm_100 GPU).

in_features that is not a multiple of the format's block (64 for nf4, 16 for nvfp4) is rejected with a
ValueError that names the multiple; pad the weight's columns (and the input's features) with zeros to use it.
Non-finite weights are rejected too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainstream_hf import ops

__all__ = ["QuantFormat", "QuantizedTensor", "FORMATS", "get_format", "quantize", "dequantize", "packed_nbytes",
           "packed_layout", "nvfp4_blocked_scales"]


@dataclass(frozen=True)
class QuantFormat:
    """What a format stores and what it asks of the weight."""

    name: str
    tensor_names: tuple[str, ...] = field(metadata={"help": "tensors of a QuantizedTensor, packed codes first"})
    block_size: int = field(metadata={"help": "weights sharing one scale along in_features (0: a whole row)"})
    in_features_multiple: int = field(metadata={"help": "in_features must be a multiple of this"})
    native: tuple[str | None, str | None] = field(
        metadata={"help": "(quantize op, dequantize op) in torch.ops.trainstream; None for a direction whose "
                          "pure-PyTorch reference in trainstream_hf.ops is the implementation on every device"})
    summary: str

    def packed_nbytes(self, shape: tuple[int, int]) -> int:
        """Bytes of the packed weight and all its scales for a (out_features, in_features) weight."""
        rows, cols = shape
        numel = rows * cols
        if self.name in ("int8", "fp8"):
            return numel + 4 * rows
        if self.name == "nf4":
            blocks = numel // ops.NF4_BLOCK
            return numel // 2 + blocks + 4 * ((blocks + ops.NF4_GROUP - 1) // ops.NF4_GROUP) + 4
        if self.name == "nvfp4":
            return numel // 2 + numel // ops.NVFP4_BLOCK + 4
        raise AssertionError(self.name)

    def bits_per_weight(self, shape: tuple[int, int]) -> float:
        return 8.0 * self.packed_nbytes(shape) / (shape[0] * shape[1])


INT8 = QuantFormat("int8", ("data", "scale"), 0, 1, (None, "dequantize_int8"), "int8, per-row absmax scale")
NF4 = QuantFormat("nf4", ("data", "absmax_q", "absmax_scale", "absmax_offset"), ops.NF4_BLOCK, ops.NF4_BLOCK,
                  ("quantize_nf4", "dequantize_nf4"), "4-bit NormalFloat, blocks of 64, E4M3 double-quantised absmax")
FP8 = QuantFormat("fp8", ("data", "scale"), 0, 1, (None, "dequantize_fp8"), "float8 E4M3, per-row scale")
NVFP4 = QuantFormat("nvfp4", ("data", "block_scale", "tensor_scale"), ops.NVFP4_BLOCK, ops.NVFP4_BLOCK,
                    ("quantize_nvfp4", "dequantize_nvfp4"), "FP4 E2M1, E4M3 scale per 16, fp32 tensor scale")
FORMATS: dict[str, QuantFormat] = {f.name: f for f in (INT8, NF4, FP8, NVFP4)}

# name -> (quantize, dequantize): the native ops (used where this build has a kernel for the device; None where
# there is none) and the pure-PyTorch references.
_NATIVE = {"int8": (None, ops.dequantize_int8), "nf4": (ops.quantize_nf4, ops.dequantize_nf4),
           "fp8": (None, ops.dequantize_fp8), "nvfp4": (ops.quantize_nvfp4, ops.dequantize_nvfp4)}
_REFERENCE = {
    "int8": (ops.quantize_int8_reference, ops.dequantize_int8_reference),
    "nf4": (ops.quantize_nf4_reference, ops.dequantize_nf4_reference),
    "fp8": (ops.quantize_fp8_reference, ops.dequantize_fp8_reference),
    "nvfp4": (ops.quantize_nvfp4_reference, ops.dequantize_nvfp4_reference),
}


def get_format(fmt: str | QuantFormat) -> QuantFormat:
    """The :class:`QuantFormat` named ``fmt`` (``int8``, ``nf4``, ``fp8`` or ``nvfp4``); formats pass through."""
    if isinstance(fmt, QuantFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


@dataclass
class QuantizedTensor:
    """A frozen weight held in a :class:`QuantFormat`: packed codes plus the scales that decode them."""

    fmt: QuantFormat
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor]
    dtype: torch.dtype = field(default=torch.bfloat16, metadata={
        "help": "the weight's logical dtype: the dtype it was quantized from, reported as ``.dtype`` the way "
                "``nn.Linear.weight.dtype`` is (PEFT sizes LoRA adapters by it); the stored dtypes are in tensors"})

    @property
    def data(self) -> torch.Tensor:
        return self.tensors["data"]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes actually held (codes and scales); equals ``fmt.packed_nbytes(shape)``."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedTensor:
        return QuantizedTensor(self.fmt, self.shape, {k: t.to(device, non_blocking=non_blocking)
                                                      for k, t in self.tensors.items()}, self.dtype)


def _impl(fmt: QuantFormat, device: torch.device) -> tuple:
    """``(quantize, dequantize)`` for ``fmt`` on ``device``: each the native op where this build has a kernel for the
    device, else the reference (same bits)."""
    return tuple(native if op is not None and ops.has_kernel(op, device) else reference
                 for op, native, reference in zip(fmt.native, _NATIVE[fmt.name], _REFERENCE[fmt.name]))


def quantize(weight: torch.Tensor, fmt: str | QuantFormat) -> QuantizedTensor:
    """Quantizes a (out_features, in_features) weight; the result stays on the weight's device.

    NF4 and NVFP4 run the native kernel where this build has one for the device, the pure-PyTorch reference
    (same bits) elsewhere; int8 and FP8 run the reference everywhere (their dequantize has native kernels).

    Args:
        weight: float32, bfloat16 or float16, 2-D, finite; in_features a multiple of ``fmt``'s block
            (64 for nf4, 16 for nvfp4).
        fmt: ``"int8"``, ``"nf4"``, ``"fp8"``, ``"nvfp4"`` or a :class:`QuantFormat`.

    Returns:
        The :class:`QuantizedTensor`, its ``dtype`` the weight's.

    Raises:
        ValueError: unknown format, weight not 2-D or empty, in_features not a multiple of the block, inf / NaN.
        TypeError: weight dtype other than float32 / bfloat16 / float16.
    """
    f = get_format(fmt)
    ops.check_weight(f"quantize_{f.name}", weight, f.in_features_multiple)
    outs = _impl(f, weight.device)[0](weight)
    return QuantizedTensor(f, (int(weight.shape[0]), int(weight.shape[1])), dict(zip(f.tensor_names, outs)),
                           weight.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The (out_features, in_features) weight ``q`` decodes to, in ``dtype`` (float32, bfloat16 or float16).

    Every format runs its fused native kernel where this build has one for the device (CPU always, CUDA in a CUDA
    build), the pure-PyTorch reference (same bits) elsewhere.
    """
    if dtype not in ops.WEIGHT_DTYPES:
        raise TypeError(f"dequantize: dtype must be float32, bfloat16 or float16, got {dtype}")
    return _impl(q.fmt, q.device)[1](*(q.tensors[n] for n in q.fmt.tensor_names), dtype=dtype)


def packed_nbytes(fmt: str | QuantFormat, shape: tuple[int, int]) -> int:
    """Bytes a (out_features, in_features) weight takes in ``fmt``, codes and scales, without quantizing it."""
    f = get_format(fmt)
    if len(shape) != 2:
        raise ValueError(f"packed_nbytes: shape must be (out_features, in_features), got {tuple(shape)}")
    if shape[1] % f.in_features_multiple:
        raise ValueError(f"packed_nbytes: {f.name} needs in_features to be a multiple of {f.in_features_multiple}, "
                         f"got {shape[1]}")
    return f.packed_nbytes((int(shape[0]), int(shape[1])))


def packed_layout(fmt: str | QuantFormat, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{tensor name: (shape, dtype)}`` of the tensors :func:`quantize` makes for a (out_features, in_features)
    weight, in ``fmt.tensor_names`` order, without quantizing anything (the table in the module docstring). A
    checkpoint loader allocates these empty and reads the packed tensors into them.

    Raises:
        ValueError: as :func:`packed_nbytes`.
    """
    f = get_format(fmt)
    packed_nbytes(f, shape)  # the same checks
    n, k = int(shape[0]), int(shape[1])
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    if f.name == "int8":
        layout = [((n, k), torch.int8), ((n,), f32)]
    elif f.name == "fp8":
        layout = [((n, k), e4m3), ((n,), f32)]
    elif f.name == "nf4":
        blocks = n * k // ops.NF4_BLOCK
        layout = [((n, k // 2), torch.uint8), ((blocks,), e4m3), ((-(-blocks // ops.NF4_GROUP),), f32), ((), f32)]
    elif f.name == "nvfp4":
        layout = [((n, k // 2), torch.uint8), ((n, k // ops.NVFP4_BLOCK), e4m3), ((), f32)]
    else:
        raise AssertionError(f.name)
    return dict(zip(f.tensor_names, layout))


def nvfp4_blocked_scales(block_scale: torch.Tensor) -> torch.Tensor:
    """Rearranges NVFP4 block scales from row-major (rows, K/16) into cuBLAS' block-scaling-factor layout.

    The layout the FP4 tensor-core GEMM reads (``torch._scaled_mm`` with float4_e2m1fn_x2 operands, sm_100+):
    rows padded to a multiple of 128 and scale columns to a multiple of 4 (with zeros), cut into 128x4 tiles laid
    out tile-row-major; inside a tile, the scale of (row r, column c) sits at ``(r % 32) * 16 + (r // 32) * 4 + c``.
    See the cuBLAS documentation, "1D Block Scaling Factors Layout", and ``to_blocked`` in torchao
    (torchao/prototype/mx_formats/utils.py), whose arrangement this reproduces.

    Args:
        block_scale: (rows, K/16) float8_e4m3fn, as :func:`quantize` stores it.

    Returns:
        A flat tensor of ``ceil(rows/128)*128 * ceil(K/16/4)*4`` scales, same dtype.
    """
    rows, cols = block_scale.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros((row_tiles * 128, col_tiles * 4), dtype=block_scale.dtype, device=block_scale.device)
    padded[:rows, :cols] = block_scale
    tiles = padded.view(row_tiles, 128, col_tiles, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)
