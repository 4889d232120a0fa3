"""PEFT: LoRA over :class:`~trainstream_hf.quant.linear.QuantLinear` with PEFT's standard calls (peft 0.21).

A ``QuantLinear`` is an ``nn.Linear`` subclass without a dense weight (as bitsandbytes' ``Linear4bit`` is), so PEFT
treats it as a linear layer: ``target_modules="all-linear"`` selects it (``_maybe_include_all_linear_layers``) and
PEFT's default dispatcher (``peft.tuners.lora.layer.dispatch_default``) wraps it in its LoRA ``Linear``. That layer
then becomes a :class:`QuantLoraLinear` as it takes the ``QuantLinear`` as its ``base_layer`` (before any adapter is
made: :func:`follow_base`, run by a torch module-registration hook installed with ``QuantLinear``). Nothing is
registered on the ``LoraConfig``, so the same holds for every route into PEFT's dispatch, saved adapters included::

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=TrainStreamQuantizationConfig("nf4"))
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    model.save_pretrained(adapter_dir)
    model = PeftModel.from_pretrained(quantized_base, adapter_dir)   # or AutoPeftModelForCausalLM.from_pretrained

or over a model packed in memory::

    model = quantize_model(base, "nf4")
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    ...                                       # train; model.disable_adapter() gives the base's outputs
    model.save_pretrained(path)               # a standard PEFT adapter (adapter_config.json + safetensors)
    model = PeftModel.from_pretrained(quantize_model(fresh_base, "nf4"), path)
    merged = model.merge_and_unload()         # plain nn.Linear layers: dequantized base + LoRA delta

:func:`register_quant_lora` (PEFT's custom-module dispatch, ``LoraConfig._register_custom_module``) gives the same
layer and is no longer needed.

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

Anything else takes PEFT's forward. ``fan_in_fan_out`` is forced off (a Conv1D quantized by ``quantize_model`` is in
nn.Linear layout); LoRA variants (DoRA & co.) and initialisations that decompose the base weight (PiSSA, OLoRA, LoftQ,
...) need the dense weight and raise, for every adapter added (the checks are in :meth:`QuantLoraLinear.update_layer`).

The switch of class: PEFT's ``lora.Linear.__init__`` stores ``base_layer`` first, then reads the features and makes
the adapters (``update_layer``); the switch happens at that store, so those steps already run as this class's.
``QuantLoraLinear`` adds methods only, no state of its own, so an instance made either way (switched, or built by
the custom-module dispatch) is the same object. The rule is: PEFT's exact ``lora.Linear`` (not its bitsandbytes,
torchao, ... subclasses) is a ``QuantLoraLinear`` exactly while its base is a ``QuantLinear``. So packing the base of
an existing PEFT model (``quantize_frozen_base``, ``wrap(quantize=...)``) gives ``QuantLoraLinear`` layers too, and
putting the dense layer back (``wrap`` does when it fails after packing) gives PEFT's ``lora.Linear`` again.

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

:func:`quant_lora_config` and :func:`load_quant_lora` are the older spelling of the same (a ``LoraConfig`` with
PEFT's custom-module mapping registered, and a loader that registers it again); they still work and give the same
layers, and are kept for code written against them.
"""
from __future__ import annotations

import os
import warnings

from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Linear as _LoraLinear
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from trainstream_hf import ops
from trainstream_hf.quant.linear import QuantLinear, _is_conv1d

__all__ = ["QuantLoraLinear", "follow_base", "register_quant_lora", "quant_lora_config", "load_quant_lora"]


# init_lora_weights values that do not read the dense base weight (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA, MiCA do: they
# decompose it, which a packed base cannot offer).
_SUPPORTED_INITS = (True, False, "gaussian", "orthogonal")


class QuantLoraLinear(_LoraLinear):
    """PEFT LoRA layer over a frozen :class:`QuantLinear` base (see the module)."""

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs) -> None:
        """PEFT's ``update_layer`` (makes the adapter ``adapter_name``), after refusing what a packed base cannot do.

        Raises:
            NotImplementedError: an ``init_lora_weights`` that reads the dense base weight.
        """
        init = config.init_lora_weights
        if not any(init is v or (isinstance(v, str) and init == v) for v in _SUPPORTED_INITS):
            raise NotImplementedError(f"QuantLoraLinear: init_lora_weights={init!r} reads the dense base weight, which "
                                      f"a quantized base does not hold: make such an adapter over the dense model "
                                      f"(wrap(quantize=...) then packs the base it leaves), and load a saved one onto "
                                      f"the base it was trained with; else use one of {_SUPPORTED_INITS}")
        if getattr(config, "use_dora", False):
            raise NotImplementedError("QuantLoraLinear: DoRA (use_dora=True) needs the dense base weight, which a "
                                      "quantized base does not hold; use plain LoRA (use_dora=False), or a dense base")
        if config.fan_in_fan_out:
            warnings.warn("fan_in_fan_out is set but the target is a QuantLinear (nn.Linear layout, also for a "
                          "quantized Conv1D); setting fan_in_fan_out to False.", stacklevel=2)
            config.fan_in_fan_out = False
        self.fan_in_fan_out = False
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

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
        # PEFT's own merge arithmetic, on the dense copy. Stored in _modules directly: through setattr the
        # registration hook would make this layer a plain lora.Linear for the time being (follow_base).
        self._modules["base_layer"] = dense
        try:
            super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
        finally:
            self._modules["base_layer"] = quant
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


def follow_base(layer: nn.Module, base: nn.Module | None) -> None:
    """Gives ``layer`` the class its new ``base_layer`` calls for: PEFT's exact ``lora.Linear`` (peft 0.21) taking a
    :class:`QuantLinear` becomes a :class:`QuantLoraLinear`; a ``QuantLoraLinear`` taking anything else becomes PEFT's
    ``lora.Linear`` again. Called by the module-registration hook of :mod:`trainstream_hf.quant.linear` before the
    base is stored; PEFT's subclasses of ``lora.Linear`` (bitsandbytes, torchao, ... layers) are left as they are.
    """
    quant = isinstance(base, QuantLinear)
    if quant and type(layer) is _LoraLinear:
        layer.__class__ = QuantLoraLinear
    elif not quant and type(layer) is QuantLoraLinear:
        layer.__class__ = _LoraLinear


def register_quant_lora(config: LoraConfig) -> LoraConfig:
    """Registers :class:`QuantLoraLinear` as the LoRA layer for :class:`QuantLinear` targets in ``config``.

    Optional: PEFT's default dispatch gives a ``QuantLinear`` target the same layer (see the module); kept for code
    written before that.

    Args:
        config: the ``peft.LoraConfig`` to pass to ``get_peft_model``; modified in place.

    Returns:
        ``config``.
    """
    config._register_custom_module({QuantLinear: QuantLoraLinear})
    return config


def quant_lora_config(model: nn.Module | None = None, **kwargs) -> LoraConfig:
    """A ``peft.LoraConfig(**kwargs)`` with :class:`QuantLoraLinear` registered for ``QuantLinear`` targets.

    Args:
        model: the (quantized) model; needed only for ``target_modules="all-linear"``, which is expanded here to the
            qualified names of its ``QuantLinear``, ``nn.Linear`` and ``Conv1D`` layers except the output embedding.
        **kwargs: ``LoraConfig`` fields.

    Returns:
        The config, to pass to ``get_peft_model``.
    """
    target = kwargs.get("target_modules")
    if isinstance(target, str) and target.lower() == "all-linear":
        if model is None:
            raise ValueError("quant_lora_config: target_modules='all-linear' needs the model (PEFT's own expansion "
                             "does not see QuantLinear layers): quant_lora_config(model, target_modules='all-linear')")
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        kwargs["target_modules"] = sorted(
            name for name, m in model.named_modules()
            if (isinstance(m, (QuantLinear, nn.Linear)) or _is_conv1d(m)) and m is not head)
    return register_quant_lora(LoraConfig(**kwargs))


def load_quant_lora(model: nn.Module, path: str | os.PathLike, adapter_name: str = "default",
                    is_trainable: bool = False, **kwargs) -> PeftModel:
    """Loads a LoRA adapter saved with ``save_pretrained`` onto a base whose linears are ``QuantLinear``.

    Args:
        model: the base (e.g. ``quantize_model(AutoModelForCausalLM.from_pretrained(...), "nf4")``), or a
            ``PeftModel`` to which the adapter is added as ``adapter_name``.
        path: the directory ``save_pretrained`` wrote (``adapter_config.json`` + adapter weights).
        adapter_name: the name the adapter gets.
        is_trainable: keep training the adapter (default: frozen, inference mode), as in PEFT.
        **kwargs: passed on to ``PeftModel.from_pretrained`` / ``PeftModel.load_adapter``
            (``autocast_adapter_dtype``, ``torch_device``, ...).

    Returns:
        The ``PeftModel`` (``model`` itself when it was one).

    Raises:
        ValueError: ``path`` holds no LoRA adapter.
    """
    config = LoraConfig.from_pretrained(path)
    if config.peft_type != "LORA":  # PeftType is a str enum
        raise ValueError(f"load_quant_lora: {path} holds a {config.peft_type} adapter, not LoRA")
    register_quant_lora(config)
    config.inference_mode = not is_trainable
    if isinstance(model, PeftModel):
        # load_adapter builds its config from the file unless the adapter name is already known: add it first.
        model.add_adapter(adapter_name, config, low_cpu_mem_usage=kwargs.get("low_cpu_mem_usage", False))
        model.load_adapter(path, adapter_name, is_trainable=is_trainable, **kwargs)
        return model
    return PeftModel.from_pretrained(model, path, adapter_name=adapter_name, is_trainable=is_trainable, config=config,
                                     **kwargs)
