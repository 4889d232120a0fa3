"""What every part of :mod:`trainstream_hf.ops` shares: the loaded library, the kernel query, the formats' constants
and code tables, and the input checks of the quantizers."""
from __future__ import annotations

import torch

from trainstream_hf import _C  # noqa: F401  (loads the library: registers torch.ops.trainstream)


def built_with_cuda() -> bool:
    """True when the native extension was compiled with CUDA support."""
    return bool(_C.built_with_cuda())


_HAS_KERNEL: dict[tuple[str, str], bool] = {}  # (op, device type) -> answer


def has_kernel(op: str, device: torch.device | str) -> bool:
    """True when ``torch.ops.trainstream.<op>`` has a kernel for ``device``'s type (CPU always; CUDA in a CUDA build).

    torch has no public "is there a kernel for this op on this device" query; this private one has been stable since
    torch 1.10. Callers use it to fall back to the ``<op>_reference`` where a build has no kernel for the device.
    The answer is cached per (op, device type): the library registers its kernels once, when ``_C`` loads, and the
    dispatcher query costs ~10 us, which the FP8 matmul path would otherwise pay twice per layer call.
    """
    dev_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    hit = _HAS_KERNEL.get((op, dev_type))
    if hit is None:
        key = {"cpu": "CPU", "cuda": "CUDA"}.get(dev_type)
        hit = key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"trainstream::{op}", key)
        _HAS_KERNEL[(op, dev_type)] = hit
    return hit


def div_scalar(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` correctly rounded on every device. CUDA divides a tensor by a Python scalar as a multiplication by
    the scalar's float32 reciprocal, one ulp off for some inputs (found on the H200: a different NVFP4 tensor scale
    than the CPU's); a divisor that lives on the tensor's device takes the true division."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


# --------------------------------------------------------------------------------------------
# Frozen-weight formats (layouts: trainstream_hf/quant/formats.py)
# --------------------------------------------------------------------------------------------

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
NF4_BLOCK, NF4_GROUP, NVFP4_BLOCK = 64, 256, 16

# QLoRA's NormalFloat-4 code (Dettmers et al. 2023, arXiv:2305.14314), exactly as bitsandbytes stores it:
# bitsandbytes/backends/utils.py, _NF4_QUANT_TABLE (bitsandbytes-foundation/bitsandbytes @ 0155ecc6).
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
    1.0], dtype=torch.float32)
_NF4_MIDPOINTS = (NF4_CODE[:-1] + NF4_CODE[1:]) * 0.5

# E2M1 (FP4) code -> value; bit 3 is the sign (OCP Microscaling Formats spec v1.0, FP4 E2M1).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)

_DEVICE_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` (one of the constant code tables above) on ``device``, copied once per device and kept.

    A pageable host-to-device copy synchronises with the host; caching it keeps the CUDA fallbacks (and the
    QuantLinear forward built on them) free of host syncs after the first call.
    """
    if device.type == "cpu":
        return table
    key = (id(table), device)
    cached = _DEVICE_TABLES.get(key)
    if cached is None:
        cached = _DEVICE_TABLES[key] = table.to(device)
    return cached


def check_weight(op: str, weight: torch.Tensor, multiple: int = 1) -> None:
    """Raises ValueError / TypeError unless ``weight`` can be quantized by ``op``.

    Args:
        op: name used in the message.
        weight: the (out_features, in_features) weight.
        multiple: in_features must be a multiple of this (the format's block size).
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{op}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{op}: weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if weight.numel() == 0:
        raise ValueError(f"{op}: weight is empty (shape {tuple(weight.shape)})")
    if weight.shape[1] % multiple:
        raise ValueError(f"{op}: in_features must be a multiple of {multiple}, got {weight.shape[1]}; pad the "
                         f"weight's columns (and the input's features) with zeros")


def _check_finite(op: str, absmax: torch.Tensor) -> None:
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError(f"{op}: weight contains inf or NaN")


def _check_out_dtype(op: str, dtype: torch.dtype) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{op}: dtype must be float32, bfloat16 or float16, got {dtype}")


def _safe_div(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x / d where d != 0, else 0 (a zero scale means an all-zero block)."""
    return torch.where(d != 0, x / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(x))
