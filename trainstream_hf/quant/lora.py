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
packed base needs, and native forwards for the common case (one active vanilla adapter, dropout off, no hooks on the
adapter modules; a Llama-3-8B LoRA over all linear layers runs 224 adapters per step, and PEFT's ~9 autograd nodes
and ~14 ops per adapter made that step host-bound on the H200):

* over a weight-only base without bias, where base and adapter compute in one dtype (bf16 autocast, the recipes'
  case, or x in the adapters' dtype): ``ops.lora_dequant_linear``, base and adapter in one C++ node, the adapter's
  product accumulated into the base GEMM's output and its input gradient into the base's (no separate multiply or add
  over activation-sized tensors). One rounding fewer than PEFT's graph: within 1e-6 of it in fp32, and no further
  from the float64 result under bf16 autocast (tests/quant/test_lora.py);
* otherwise (a bias, an activation-quantized base, fp32 adapters on bf16 x outside autocast): ``ops.lora_add``, the
  adapter's term as one C++ node with PEFT's numbers, bit for bit in the dtype regimes tested (tests/quant/test_lora.py,
  tests/gpu/test_lora_cuda.py).

Anything else takes PEFT's forward. In/out features are read from the layer (PEFT's generic lookup would warn
"Unsupported layer type"), ``fan_in_fan_out`` is forced off (a Conv1D quantized by ``quantize_model`` is in nn.Linear
layout); LoRA variants (DoRA & co.) and initialisations that decompose the base weight (PiSSA, OLoRA, LoftQ, ...) need
the dense weight and raise.

Merging: ``merge_and_unload()`` replaces each ``QuantLoraLinear`` by a plain ``nn.Linear`` holding the dequantized
base weight plus the LoRA delta (``unload_and_optionally_merge_module``, the per-layer hook PEFT's unload loop calls),
so the merged model is dense, in the base's logical dtype; the merge arithmetic is PEFT's own ``lora.Linear.merge``
run on that dense layer, so the result is what PEFT gives for an ``nn.Linear`` holding the dequantized weight.
``unload()`` gives the ``QuantLinear`` back. ``merge()`` in place (``merge_adapter()``, which keeps the adapters
around for ``unmerge``) stays refused: it would have to re-quantize the base (lossy, not reversible).

What PEFT 0.21's LoRA reads from the base layer (peft/tuners/lora/layer.py, tuners_utils.py, lora/model.py):
``in_features`` / ``out_features`` (through ``_get_in_out_features``, overridden here); ``weight.device`` (where the
adapters go: ``_replace_module``, ``_move_adapter_to_device_of_base_layer``); ``weight.dtype`` (the adapters' dtype,
then upcast from bf16 / fp16 to fp32 by ``get_peft_model(autocast_adapter_dtype=True)``, as for any base); ``bias``
(``lora_bias``); ``weight.data`` only in merging and in the decomposing initialisations, both refused here.
``QuantLinear.weight`` answers ``.device``, ``.dtype`` (the logical dtype) and ``.shape`` without decoding anything.
"""
from __future__ import annotations

import warnings

from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as _LoraLinear

from trainstream_hf import ops
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

    def forward(self, x, *args, **kwargs):
        # The common case -- one active vanilla adapter, dropout off, not merged nor disabled, no per-call adapter
        # names, no hooks on the adapter modules -- natively (module docstring): base and adapter in one node where
        # the base allows, else the adapter's term in one node with PEFT's numbers; anything else is PEFT's forward.
        name = self._fast_adapter(args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        a, b, scaling = self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
        base = self.base_layer
        operands = getattr(base, "fused_lora_operands", None)
        fused = operands(x, a) if operands is not None and not _hooked(base) else None
        if fused is not None:  # weight-only base: base and adapter in one node, the sums inside its GEMMs
            return ops.lora_dequant_linear(x, *fused, a, b, scaling)
        return ops.lora_add(base(x), x, a, b, scaling)

    def _fast_adapter(self, args, kwargs) -> str | None:
        """The adapter :meth:`forward` may run natively, or None."""
        if args or kwargs or self.disable_adapters or self.merged or not getattr(self, "cast_input_dtype_enabled",
                                                                                  True):
            return None
        active = self.active_adapters
        if len(active) != 1:
            return None
        name = active[0]
        if name not in self.lora_A or name in self.lora_variant or name in self.lora_magnitude_vector:
            return None
        a, b, dropout = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        if type(dropout) is not nn.Identity or type(a) is not nn.Linear or type(b) is not nn.Linear:
            return None
        if a.bias is not None or b.bias is not None or not isinstance(self.scaling[name], (int, float)):
            return None
        if _hooked(a) or _hooked(b) or _hooked(dropout):
            return None
        return name

    @property
    def lora_variants(self):
        return {(): None}  # vanilla LoRA only: the variants (DoRA, ...) need the dense base weight

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        if isinstance(self.base_layer, QuantLinear):
            raise NotImplementedError("QuantLoraLinear: merging a LoRA adapter into a quantized base in place would "
                                      "re-quantize it (lossy, not reversible); use merge_and_unload(), which replaces "
                                      "the layer by an nn.Linear holding the dequantized weight plus the LoRA delta")
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def dequantized_base(self) -> nn.Linear:
        """A new ``nn.Linear`` holding the decoded base weight (in its logical dtype) and a copy of the bias."""
        base = self.get_base_layer()
        w = base.dequantize_weight()
        dense = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None, device=w.device,
                          dtype=w.dtype)
        dense.weight = nn.Parameter(w, requires_grad=False)
        if base.bias is not None:  # copied: the QuantLinear's bias may share storage with the original model's
            dense.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=False)
        return dense

    def unload_and_optionally_merge_module(self, merge: bool, safe_merge: bool, adapter_names) -> nn.Module:
        """What ``merge_and_unload()`` / ``unload()`` put in this layer's place (peft 0.21's per-layer unload hook).

        Args:
            merge: fold the adapters in: returns an ``nn.Linear`` with ``dequantize(W) + delta`` (the packed base
                is left untouched). False: returns the ``QuantLinear`` base.
            safe_merge: check the merged weight for NaNs / infs first (PEFT's ``safe_merge``).
            adapter_names: adapters to fold in (default: the active ones).

        Returns:
            The module to put in this layer's place.
        """
        if not merge:
            return self.get_base_layer()
        quant, dense = self.base_layer, self.dequantized_base()
        self.base_layer = dense  # PEFT's own merge arithmetic, on the dense copy
        try:
            super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
        finally:
            self.base_layer = quant
            self.merged_adapters = []
        return dense

    def unmerge(self) -> None:
        if isinstance(self.base_layer, QuantLinear):
            raise NotImplementedError("QuantLoraLinear: nothing is merged into a quantized base, so nothing unmerges")
        super().unmerge()


def _hooked(m: nn.Module) -> bool:
    """Whether calling m could run more than its forward: module hooks (forward, backward), global forward hooks, or
    an Accelerate hook (``_hf_hook``: device placement, offload). The native paths never call the adapter modules,
    and the fused one not the base either."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or _global_forward_hooks or _global_forward_pre_hooks or hasattr(m, "_hf_hook"))


def register_quant_lora(config: LoraConfig) -> LoraConfig:
    """Registers :class:`QuantLoraLinear` as the LoRA layer for :class:`QuantLinear` targets in ``config``.

    Args:
        config: the ``peft.LoraConfig`` to pass to ``get_peft_model``; modified in place.

    Returns:
        ``config``.
    """
    config._register_custom_module({QuantLinear: QuantLoraLinear})
    return config
