"""Quantized frozen weights: storage formats (:mod:`~trainstream_hf.quant.formats`), the ``QuantLinear`` layer
(:mod:`~trainstream_hf.quant.linear`), its matmul paths (:mod:`~trainstream_hf.quant.matmul`), outlier-channel
protection (:mod:`~trainstream_hf.quant.outliers`) and ``quantize_model`` (:mod:`~trainstream_hf.quant.model`).
LoRA over ``QuantLinear`` with PEFT: :mod:`trainstream_hf.integrations.peft` (imports peft, so not imported here)."""
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
from trainstream_hf.quant.linear import QuantLinear  # noqa: F401
from trainstream_hf.quant.model import quantize_frozen_base, quantize_model  # noqa: F401

__all__ = ["FORMATS", "QuantFormat", "QuantizedTensor", "QuantLinear", "dequantize", "get_format",
           "nvfp4_blocked_scales", "packed_nbytes", "quantize", "quantize_frozen_base", "quantize_model"]
