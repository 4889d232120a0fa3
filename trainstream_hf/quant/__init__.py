"""Quantized frozen weights: storage formats (:mod:`trainstream_hf.quant.formats`)."""
from trainstream_hf.quant.formats import (  # noqa: F401
    FORMATS,
    QuantFormat,
    QuantizedTensor,
    dequantize,
    get_format,
    nvfp4_blocked_scales,
    packed_nbytes,
    quantize,
)

__all__ = ["FORMATS", "QuantFormat", "QuantizedTensor", "dequantize", "get_format", "nvfp4_blocked_scales",
           "packed_nbytes", "quantize"]
