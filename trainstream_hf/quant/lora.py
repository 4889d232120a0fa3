"""LoRA over :class:`~trainstream_hf.quant.linear.QuantLinear` through PEFT's custom-module dispatch (peft 0.21).

PEFT's LoRA does not wrap a ``QuantLinear`` out of the box: its default dispatcher
(``peft.tuners.lora.layer.dispatch_default``) wants an ``nn.Linear`` (or ``Conv1D``, ``Embedding``, ...), and
``QuantLinear`` is deliberately not one (its weight is not a tensor that ``F.linear`` or weight-init code could use),
so ``get_peft_model`` raises "Target module ... is not supported". PEFT's public extension point for this is
``LoraConfig._register_custom_module({layer type: LoRA layer type})`` (experimental, documented in PEFT's "Custom
models" guide); :func:`register_quant_lora` registers :class:`QuantLoraLinear` for ``QuantLinear``::

    model = quantize_model(model, "nf4")
    config = register_quant_lora(LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    model = get_peft_model(model, config)

:class:`QuantLoraLinear` is PEFT's own ``lora.Linear`` (``y = base(x) + B(A(dropout(x))) * scaling``) with what a
packed base needs: in/out features read from the layer (PEFT's generic lookup would warn "Unsupported layer type"),
``fan_in_fan_out`` forced off (a Conv1D quantized by ``quantize_model`` is in nn.Linear layout); merging into the base,
LoRA variants (DoRA & co.) and initialisations that decompose the base weight (PiSSA, OLoRA, LoftQ, ...) need the dense
weight and raise.

What PEFT 0.21's LoRA reads from the base layer (peft/tuners/lora/layer.py, tuners_utils.py, lora/model.py):
``in_features`` / ``out_features`` (through ``_get_in_out_features``, overridden here); ``weight.device`` (where the
adapters go: ``_replace_module``, ``_move_adapter_to_device_of_base_layer``); ``weight.dtype`` (the adapters' dtype,
then upcast from bf16 / fp16 to fp32 by ``get_peft_model(autocast_adapter_dtype=True)``, as for any base); ``bias``
(``lora_bias``); ``weight.data`` only in merging and in the decomposing initialisations, both refused here.
``QuantLinear.weight`` answers ``.device``, ``.dtype`` (the logical dtype) and ``.shape`` without decoding anything.
"""
from __future__ import annotations

import warnings

from peft import LoraConfig
from peft.tuners.lora.layer import Linear as _LoraLinear

from trainstream_hf.quant.linear import QuantLinear

__all__ = ["QuantLoraLinear", "register_quant_lora"]


# init_lora_weights values that do not read the dense base weight (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA, MiCA do: they
# decompose it, which a packed base cannot offer).
_SUPPORTED_INITS = (True, False, "gaussian", "orthogonal")


class QuantLoraLinear(_LoraLinear):
    """PEFT LoRA layer over a frozen :class:`QuantLinear` base."""

    def __init__(self, base_layer, adapter_name: str, config: LoraConfig, **kwargs) -> None:
        init = config.init_lora_weights
        if not any(init is v or (isinstance(v, str) and init == v) for v in _SUPPORTED_INITS):
            raise NotImplementedError(f"QuantLoraLinear: init_lora_weights={init!r} reads the dense base weight, which "
                                      f"a quantized base does not hold; use one of {_SUPPORTED_INITS}")
        if config.fan_in_fan_out:
            warnings.warn("fan_in_fan_out is set but the target is a QuantLinear (nn.Linear layout, also for a "
                          "quantized Conv1D); setting fan_in_fan_out to False.", stacklevel=2)
            config.fan_in_fan_out = False
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    @property
    def lora_variants(self):
        return {(): None}  # vanilla LoRA only: the variants (DoRA, ...) need the dense base weight

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError("QuantLoraLinear: merging a LoRA adapter into a quantized base would re-quantize "
                                  "it (lossy, not reversible); keep the adapter separate, or merge into the original "
                                  "bf16 model")

    def unmerge(self) -> None:
        raise NotImplementedError("QuantLoraLinear: nothing can be merged into a quantized base, so nothing unmerges")


def register_quant_lora(config: LoraConfig) -> LoraConfig:
    """Registers :class:`QuantLoraLinear` as the LoRA layer for :class:`QuantLinear` targets in ``config``.

    Args:
        config: the ``peft.LoraConfig`` to pass to ``get_peft_model``; modified in place.

    Returns:
        ``config``.
    """
    config._register_custom_module({QuantLinear: QuantLoraLinear})
    return config
