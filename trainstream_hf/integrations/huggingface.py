"""transformers: a quantizer registered as ``"trainstream"``, so ``from_pretrained`` loads straight into QuantLinear.

::

    import trainstream_hf.integrations.huggingface  # registers "trainstream" with transformers
    from trainstream_hf.integrations.huggingface import TrainStreamQuantizationConfig
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 quantization_config=TrainStreamQuantizationConfig(quantize="nf4"))

Extension points (public in transformers 5.24, present in the 5.x line this package targets, 5.17-5.24):
``transformers.quantizers.register_quantization_config`` / ``register_quantizer`` (the registry
``AutoHfQuantizer.from_config`` looks ``quant_method`` up in), ``HfQuantizer`` with
``_process_model_before_weight_loading``, ``param_needs_quantization`` / ``get_quantize_ops`` (the 5.x weight-loading
hook: ``core_model_loading.convert_and_load_state_dict_in_model`` attaches ``get_quantize_ops()`` to each checkpoint
tensor for which ``param_needs_quantization`` is true and calls its ``convert`` right after the tensor is read) and
``_process_model_after_weight_loading``. Only the 5.24 signatures were run here; 5.17 is not installed on this machine.

How a weight is loaded, layer by layer:

1. Before loading (the model is a skeleton on the meta device), :class:`TrainStreamHfQuantizer` picks the target layers
   exactly as :func:`~trainstream_hf.quant.quantize_model` does (``nn.Linear`` and ``Conv1D``, not ``skip``-ed, not
   tied to the embeddings; a width the format cannot take is an error naming every such layer). The layers stay
   ``nn.Linear`` skeletons, so that the checkpoint's ``<layer>.weight`` keys still match.
2. When a target's weight has been read from the checkpoint (on the device ``device_map`` gives it, in the load
   dtype), the quantize op packs it and puts a :class:`~trainstream_hf.quant.QuantLinear` in the layer's place,
   sharing its bias; the dense tensor is dropped there and then. So the dense model is never whole in memory: at most
   the tensors transformers has read ahead (one at a time unless its parallel loading is switched on).
3. After loading, a target whose weight the checkpoint lacked (transformers initialised it and reports it missing)
   is quantized as it is.

The packed weights are bit-identical to ``quantize_model`` applied to the same model loaded in the same dtype.
The weights go where ``device_map`` puts them; placing them in the engine's host arena is ``wrap``'s job afterwards
(not done at load time yet). ``save_pretrained`` of a model loaded this way is refused with an error that says what to
do (:data:`NOT_SERIALIZABLE`): the packed layout is this package's own; save the adapters (PEFT) or the original
checkpoint. Adapters added through transformers' own PEFT integration (``model.add_adapter``) are saved as usual.
Checkpoints saved with a ``quantization_config`` of this kind are not loadable as pre-quantized either.

What PEFT and TRL see (:data:`KBIT_FLAG`): transformers sets ``is_quantized``, ``quantization_method`` ("trainstream")
and ``hf_quantizer`` on every quantized model; PEFT's ``prepare_model_for_kbit_training`` and TRL's QLoRA branches
(``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ... in TRL 1.16) test ``is_loaded_in_8bit`` / ``is_loaded_in_4bit``
instead, so the loaded model also gets ``is_loaded_in_8bit = True``, for every format: they then turn on gradient
checkpointing and input gradients, freeze the base, upcast the remaining bf16 / fp16 parameters (the packed tensors
are uint8, int8, float8 or float32, so nothing packed is cast), and TRL keeps the adapters in bf16, as for
bitsandbytes. The PEFT LoRA layer over each packed layer is :class:`~trainstream_hf.quant.lora.QuantLoraLinear`
without any registration (:mod:`trainstream_hf.quant.lora`).
"""
from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.quant import outliers as _outliers
from trainstream_hf.quant.formats import FORMATS, get_format, quantize
from trainstream_hf.quant.linear import QuantLinear, _is_conv1d
from trainstream_hf.quant.model import _is_target, _skipped

__all__ = ["TrainStreamQuantizationConfig", "TrainStreamHfQuantizer", "LoadedQuantLinear", "QUANT_METHOD",
           "NOT_SERIALIZABLE", "KBIT_FLAG"]

QUANT_METHOD = "trainstream"

# The model attribute PEFT (prepare_model_for_kbit_training, peft 0.21) and TRL (1.16) read as "a k-bit quantized base"
# (they test is_loaded_in_8bit or is_loaded_in_4bit and nothing else: not is_quantized). The 8-bit name for the 4-bit
# formats too: transformers 5.25's PreTrainedModel.num_parameters imports bitsandbytes whenever is_loaded_in_4bit is
# set, and Trainer calls it at every step (floating_point_ops), so without bitsandbytes installed a 4-bit flag would
# break training; the other readers do the same for either name where the layers are not bitsandbytes'.
KBIT_FLAG = "is_loaded_in_8bit"

NOT_SERIALIZABLE = (
    "trainstream: save_pretrained cannot write this model: its linear layers are packed ({fmt}) in trainstream_hf's "
    "own layout, which no checkpoint format holds. Save what was trained instead: the adapters "
    "(peft_model.save_pretrained(dir), or save_pretrained on a model given adapters with model.add_adapter(...)); for "
    "full weights, load the original checkpoint without quantization_config, apply the adapters "
    "(PeftModel.from_pretrained(model, dir).merge_and_unload()) and save that")

logger = logging.getLogger("trainstream_hf")


class TrainStreamQuantizationConfig(QuantizationConfigMixin):
    """``quantization_config=`` for ``from_pretrained``: frozen linear weights packed as trainstream's QuantLinear.

    Args:
        quantize: ``"int8"``, ``"nf4"``, ``"fp8"`` or ``"nvfp4"``.
        outliers: fraction of input channels kept out of the activation quantization, in [0, 0.5] (see QuantLinear).
        act_quant: quantize activations on the fly (fp8 / nvfp4 only); default per format (see QuantLinear).
        skip: module names left unquantized; an entry matches a module whose name equals it or ends with
            ``"." + entry``. Default ``["lm_head"]``.
    """

    def __init__(self, quantize: str = "nf4", outliers: float = 0.0, act_quant: bool | None = None,
                 skip: list[str] | tuple[str, ...] | str | None = ("lm_head",), **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD
        if quantize not in FORMATS:
            raise ValueError(f"TrainStreamQuantizationConfig: quantize={quantize!r}; choose one of "
                             f"{', '.join(FORMATS)}")
        self.quantize = quantize
        self.outliers = _outliers.check_outliers(outliers)
        self.act_quant = act_quant
        self.skip = [skip] if isinstance(skip, str) else list(skip or ())
        if kwargs:
            raise ValueError(f"TrainStreamQuantizationConfig: unknown options {sorted(kwargs)}; the options are "
                             f"quantize, outliers, act_quant, skip")

    @classmethod
    def from_trainstream_config(cls, config: TrainStreamConfig, **kwargs: Any) -> TrainStreamQuantizationConfig:
        """The quantization part of a :class:`TrainStreamConfig` (its ``quantize`` must be set)."""
        if config.quantize is None:
            raise ValueError("TrainStreamQuantizationConfig: the TrainStreamConfig has quantize=None; set a format")
        return cls(quantize=config.quantize, outliers=config.outliers, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "quantize": self.quantize, "outliers": self.outliers,
                "act_quant": self.act_quant, "skip": list(self.skip)}

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        d = {k: v for k, v in dict(config_dict).items() if k != "quant_method"}
        config = cls(**d)
        return (config, kwargs) if return_unused_kwargs else config


class LoadedQuantLinear(QuantLinear):
    """A :class:`QuantLinear` put in place while loading; it differs only in telling transformers its weight is
    initialised.

    transformers 5.24 runs the model's ``_init_weights`` over every module after loading and skips modules and tensors
    flagged ``_is_hf_initialized`` (``transformers.initialization``); QuantLinear carries the module flag, but some
    models' init reaches into a child's ``.weight`` directly (GPT-2's scaled ``c_proj`` init), which for a QuantLinear
    is a fresh :class:`QuantizedTensor` each time, so the flag has to ride on it too.
    """

    _is_hf_initialized = True

    @property
    def weight(self):
        q = super().weight
        q._is_hf_initialized = True
        return q

    @weight.setter
    def weight(self, value) -> None:
        QuantLinear.weight.fset(self, value)  # refused, with QuantLinear's message


class _QuantizeOnLoad(ConversionOps):
    """The op transformers runs on a target layer's checkpoint weight right after reading it: pack it and swap the
    layer for a QuantLinear. Returns nothing to assign: the weight now lives in the new module's packed parameters."""

    def __init__(self, quantizer: TrainStreamHfQuantizer) -> None:
        self.quantizer = quantizer

    def convert(self, input_dict: dict[str, Any], full_layer_name: str | None = None, model: nn.Module | None = None,
                missing_keys: set[str] | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
        (value,) = (v[0] if isinstance(v, list) else v for v in input_dict.values())
        module_name = full_layer_name.rpartition(".")[0]
        self.quantizer._swap(model, module_name, value)
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        return {}


class TrainStreamHfQuantizer(HfQuantizer):
    """Packs each target linear layer's weight into a QuantLinear as ``from_pretrained`` reads it (see the module)."""

    requires_calibration = False
    quantization_config: TrainStreamQuantizationConfig

    def __init__(self, quantization_config: TrainStreamQuantizationConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.targets: set[str] = set()

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        if self.pre_quantized:
            raise ValueError("trainstream: this checkpoint's config already has a trainstream quantization_config, "
                             "but packed checkpoints are not a format this package saves or loads; load the original "
                             "bf16 / fp16 checkpoint with quantization_config=TrainStreamQuantizationConfig(...)")

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        self._model = weakref.ref(model)  # for is_serializable: whether save_pretrained writes adapters only
        q = self.quantization_config
        fmt = get_format(q.quantize)
        skip = tuple(q.skip) + tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        tied_head = head if getattr(text_config, "tie_word_embeddings", False) else None
        bad = []
        for name, m in model.named_modules():
            if not _is_target(m) or _skipped(name, skip) or m is tied_head:
                continue
            in_features = m.weight.shape[0] if _is_conv1d(m) else m.in_features
            if in_features % fmt.in_features_multiple:
                bad.append(f"{name} (in_features={in_features})")
            self.targets.add(name)
        if bad:
            raise ValueError(f"trainstream: {fmt.name} needs in_features to be a multiple of "
                             f"{fmt.in_features_multiple}; these layers are not: {', '.join(bad)}. Add them to "
                             f"TrainStreamQuantizationConfig(skip=...), or use int8 or fp8 (any width).")

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        module_name, _, tensor_name = param_name.rpartition(".")
        return tensor_name == "weight" and module_name in self.targets

    def get_quantize_ops(self) -> ConversionOps:
        return _QuantizeOnLoad(self)

    def _swap(self, model: nn.Module, module_name: str, weight: torch.Tensor) -> None:
        old = model.get_submodule(module_name)
        if isinstance(old, QuantLinear):  # a module reachable under two names, already converted
            return
        q = self.quantization_config
        with torch.no_grad():
            packed = quantize(weight.detach().t() if _is_conv1d(old) else weight.detach(), get_format(q.quantize))
        # The bias may still be a meta skeleton (loaded next, into the QuantLinear's own bias parameter).
        new = LoadedQuantLinear(packed, old.bias, act_quant=q.act_quant, outliers=q.outliers)
        for p in new.parameters(recurse=False):
            if not p.is_meta:  # a bias still to load gets its flag when transformers assigns it
                p._is_hf_initialized = True
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        left = [n for n in sorted(self.targets) if not isinstance(model.get_submodule(n), QuantLinear)]
        if left:  # weights the checkpoint lacked: transformers initialised them (and reports them missing)
            warnings.warn(f"trainstream: {len(left)} layers had no weight in the checkpoint and were quantized as "
                          f"initialised: {', '.join(left[:4])}{' ...' if len(left) > 4 else ''}", stacklevel=2)
            for name in left:
                self._swap(model, name, model.get_submodule(name).weight)
        setattr(model, KBIT_FLAG, True)  # the module docstring: what PEFT and TRL see
        return model

    def remove_quantization_config(self, model: nn.Module) -> None:
        """transformers' clean-up once the model is no longer quantized (``dequantize``), the k-bit flag included."""
        super().remove_quantization_config(model)
        if hasattr(model, KBIT_FLAG):
            delattr(model, KBIT_FLAG)

    def is_serializable(self, **kwargs: Any) -> bool:
        """Never: the packed layout is this package's own. transformers (5.24, 5.25) asks only from ``save_pretrained``,
        which then refuses with "check out the warnings from the logger"; this raises the reason and what to do
        instead.

        A model given adapters through transformers' PEFT integration (``add_adapter``) saves only them: no error
        then. A model this quantizer no longer belongs to (a copy) gets the reason as a logged warning, before
        transformers' refusal.

        Raises:
            ValueError: :data:`NOT_SERIALIZABLE`, when ``save_pretrained`` would refuse.
        """
        ref = getattr(self, "_model", None)
        model = ref() if ref is not None else None
        message = NOT_SERIALIZABLE.format(fmt=self.quantization_config.quantize)
        if model is None or getattr(model, "hf_quantizer", None) is not self:
            logger.warning(message)
        elif not getattr(model, "_hf_peft_config_loaded", False):
            raise ValueError(message)
        return False

    @property
    def is_trainable(self) -> bool:
        return True  # through adapters (PEFT LoRA over QuantLinear); the packed base itself is frozen


def _register() -> None:
    # register_* raise on a second registration of the name (this module imported again after a reload): keep the
    # first registration then.
    for register, cls in ((register_quantization_config, TrainStreamQuantizationConfig),
                          (register_quantizer, TrainStreamHfQuantizer)):
        try:
            register(QUANT_METHOD)(cls)
        except ValueError:
            pass


_register()


def reference_logprobs(
    model: nn.Module,
    chosen: Any,
    rejected: Any,
    *,
    ref_model: nn.Module | None = None,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO reference log-probabilities from the policy's own base weights: LoRA adapters switched off.

    No second model is kept in memory: for a ``peft.PeftModel`` the adapters are disabled with
    ``model.disable_adapter()`` (PEFT's public context manager) for the duration of the call. The model is put in
    eval mode meanwhile (a reference must not see dropout) and every module's training flag is restored after.
    Runs under ``torch.no_grad()``.

    Args:
        model: the policy, a ``PeftModel`` over a transformers causal LM.
        chosen, rejected: each either an ``input_ids`` tensor [B, T] or a mapping with ``input_ids`` and optionally
            ``attention_mask`` and ``labels_mask`` (TRL's name ``completion_mask`` is accepted too).
        ref_model: an explicit reference model; required when ``model`` is not a PEFT model. Used as it is.
        **kw: passed to :func:`trainstream_hf.losses.sequence_logprobs` (``chunk_tokens``, ``average``).

    Returns:
        (ref_chosen, ref_rejected): two [B] fp32 tensors without grad.
    """
    from contextlib import nullcontext

    from trainstream_hf.losses import sequence_logprobs

    def score(m: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, torch.Tensor):
            return sequence_logprobs(m, batch, **kw)
        labels_mask = batch.get("labels_mask", batch.get("completion_mask"))
        return sequence_logprobs(m, batch["input_ids"], batch.get("attention_mask"), labels_mask, **kw)

    if ref_model is not None:
        scorer, adapters_off = ref_model, nullcontext()
    else:
        try:
            from peft import PeftModel
        except ImportError:  # pragma: no cover - peft is a dependency of this package
            PeftModel = ()
        if not isinstance(model, PeftModel):
            raise TypeError(
                f"reference_logprobs needs a peft.PeftModel (its adapters are switched off to get the reference), got "
                f"{type(model).__name__}; pass ref_model=... to score with a separate reference model."
            )
        scorer, adapters_off = model, model.disable_adapter()

    modes = [(m, m.training) for m in scorer.modules()]
    scorer.eval()
    try:
        with torch.no_grad(), adapters_off:
            return score(scorer, chosen), score(scorer, rejected)
    finally:
        for m, training in modes:
            m.training = training
