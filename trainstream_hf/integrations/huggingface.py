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
``_process_model_after_weight_loading``; for checkpoints ``is_serializable``, ``get_state_dict_and_metadata`` (called by
``save_pretrained`` before it writes config.json), ``pre_quantized`` and ``_dequantize`` (behind
``PreTrainedModel.dequantize``). Only the 5.24 / 5.25 signatures were run here; 5.17 is not installed on this machine.

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
(not done at load time yet).

Quantized checkpoints (transformers' pre-quantized loading, as for fbgemm-fp8 or bitsandbytes):

* ``save_pretrained`` writes each packed layer's tensors as they are held, ``<layer>.weight_data``,
  ``<layer>.weight_scale``, ... (:class:`~trainstream_hf.quant.QuantLinear`'s parameters, the table in
  :mod:`trainstream_hf.quant.formats`), in safetensors, and ``quantization_config`` in config.json with ``modules``,
  the names of the layers that are packed at that moment (:meth:`TrainStreamHfQuantizer.get_state_dict_and_metadata`).
* ``from_pretrained(dir)`` reads that config (import this module first, or ``trainstream_hf``'s
  ``TrainStreamQuantizationConfig``, so that ``"trainstream"`` is registered): before loading, each listed layer
  becomes an empty :class:`LoadedQuantLinear` of the format's shapes and dtypes
  (:func:`~trainstream_hf.quant.formats.packed_layout`) and transformers reads the packed tensors into it as plain
  parameters. Nothing is quantized again: the model is bit for bit the one saved.
* ``model.dequantize()`` (transformers' ``HfQuantizer.dequantize`` through :meth:`TrainStreamHfQuantizer._dequantize`)
  puts a dense ``nn.Linear`` (GPT-2: ``Conv1D``) in every packed layer's place, its weight
  :meth:`~trainstream_hf.quant.QuantLinear.dequantize_weight` in the model's dtype, and drops ``quantization_config``:
  ``save_pretrained`` then writes a plain checkpoint.
* PEFT's ``merge_and_unload()`` leaves dense layers where it merged. When no packed layer is left, ``save_pretrained``
  drops ``quantization_config`` itself (the model is no longer quantized) and writes a plain checkpoint that stock
  transformers loads; when some are left, ``modules`` lists only those, and the merged ones are saved dense.
* Refused with what to do (``ValueError`` from ``save_pretrained``; config.json and the weights are not written):
  packed layers still wrapped in PEFT LoRA layers (``get_peft_model``; save the adapters, or merge first), and a
  layer packed by hand in another format than the config's. Not checked: a checkpoint that lacks some packed tensors
  (transformers reports them missing, as for any checkpoint, and leaves them uninitialised).

What PEFT and TRL see (:data:`KBIT_FLAG`): transformers sets ``is_quantized``, ``quantization_method`` ("trainstream")
and ``hf_quantizer`` on every quantized model; PEFT's ``prepare_model_for_kbit_training`` and TRL's QLoRA branches
(``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ... in TRL 1.16) test ``is_loaded_in_8bit`` / ``is_loaded_in_4bit``
instead, so the loaded model also gets ``is_loaded_in_8bit = True``, for every format: they then turn on gradient
checkpointing and input gradients, freeze the base, upcast the remaining bf16 / fp16 parameters (the packed tensors
are uint8, int8, float8 or float32, so nothing packed is cast), and TRL keeps the adapters in bf16, as for
bitsandbytes. The PEFT LoRA layer over each packed layer is
:class:`~trainstream_hf.integrations.peft.QuantLoraLinear` without any registration
(:mod:`trainstream_hf.integrations.peft`).
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.quant import outliers as _outliers
from trainstream_hf.quant.formats import FORMATS, QuantizedTensor, get_format, packed_layout, quantize
from trainstream_hf.quant.linear import QuantLinear, _is_conv1d
from trainstream_hf.quant.model import _is_target, _skipped, warn_weights_left_dense

__all__ = ["TrainStreamQuantizationConfig", "TrainStreamHfQuantizer", "LoadedQuantLinear", "QUANT_METHOD",
           "KBIT_FLAG", "mark_quantized"]

QUANT_METHOD = "trainstream"

# The model attribute PEFT (prepare_model_for_kbit_training, peft 0.21) and TRL (1.16) read as "a k-bit quantized base"
# (they test is_loaded_in_8bit or is_loaded_in_4bit and nothing else: not is_quantized). The 8-bit name for the 4-bit
# formats too: transformers 5.25's PreTrainedModel.num_parameters imports bitsandbytes whenever is_loaded_in_4bit is
# set, and Trainer calls it at every step (floating_point_ops), so without bitsandbytes installed a 4-bit flag would
# break training; the other readers do the same for either name where the layers are not bitsandbytes'.
KBIT_FLAG = "is_loaded_in_8bit"

logger = logging.getLogger("trainstream_hf")


class TrainStreamQuantizationConfig(QuantizationConfigMixin):
    """``quantization_config=`` for ``from_pretrained``: frozen linear weights packed as trainstream's QuantLinear.

    Args:
        quantize: ``"int8"``, ``"nf4"``, ``"fp8"`` or ``"nvfp4"``.
        outliers: fraction of input channels kept out of the activation quantization, in [0, 0.5] (see QuantLinear).
        act_quant: quantize activations on the fly (fp8 / nvfp4 only); default per format (see QuantLinear).
        skip: module names left unquantized; an entry matches a module whose name equals it or ends with
            ``"." + entry``. Default ``["lm_head"]``.
        modules: the full names of the packed layers, written by ``save_pretrained`` into a checkpoint's config and
            read back when that checkpoint is loaded (it then decides which layers are packed, not ``skip``). Leave
            it None when quantizing on load.
    """

    def __init__(self, quantize: str = "nf4", outliers: float = 0.0, act_quant: bool | None = None,
                 skip: list[str] | tuple[str, ...] | str | None = ("lm_head",), modules: list[str] | None = None,
                 **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD
        if quantize not in FORMATS:
            raise ValueError(f"TrainStreamQuantizationConfig: quantize={quantize!r}; choose one of "
                             f"{', '.join(FORMATS)}")
        self.quantize = quantize
        self.outliers = _outliers.check_outliers(outliers)
        self.act_quant = act_quant
        self.skip = [skip] if isinstance(skip, str) else list(skip or ())
        self.modules = None if modules is None else list(modules)
        if kwargs:
            raise ValueError(f"TrainStreamQuantizationConfig: unknown options {sorted(kwargs)}; the options are "
                             f"quantize, outliers, act_quant, skip (and modules, which save_pretrained writes)")

    @classmethod
    def from_trainstream_config(cls, config: TrainStreamConfig, **kwargs: Any) -> TrainStreamQuantizationConfig:
        """The quantization part of a :class:`TrainStreamConfig` (its ``quantize`` must be set)."""
        if config.quantize is None:
            raise ValueError("TrainStreamQuantizationConfig: the TrainStreamConfig has quantize=None; set a format")
        return cls(quantize=config.quantize, outliers=config.outliers, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = {"quant_method": self.quant_method, "quantize": self.quantize, "outliers": self.outliers,
             "act_quant": self.act_quant, "skip": list(self.skip)}
        if self.modules is not None:
            d["modules"] = list(self.modules)
        return d

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
    """Packs each target linear layer's weight into a QuantLinear as ``from_pretrained`` reads it, or reads a packed
    checkpoint as it was saved (``pre_quantized``); saves and dequantizes (see the module)."""

    requires_calibration = False
    quantization_config: TrainStreamQuantizationConfig

    def __init__(self, quantization_config: TrainStreamQuantizationConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.targets: set[str] = set()
        self.conv1d: set[str] = set()  # targets that were transformers Conv1D ((in, out) weight): dequantize rebuilds one

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        q = self.quantization_config
        fmt = get_format(q.quantize)
        if self.pre_quantized and q.modules is not None:
            self._pick_saved(model, q.modules)
        else:
            self._pick(model, fmt)
        warn_weights_left_dense(model, fmt.name)  # experts held as 3-D tensors are no linear layers
        if self.pre_quantized:
            for name in sorted(self.targets):
                self._swap_empty(model, name, fmt)

    def _pick(self, model: nn.Module, fmt) -> None:
        """The layers quantize_model would pick: nn.Linear and Conv1D, not skip-ped, not tied to the embeddings."""
        q = self.quantization_config
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
            self._target(name, m)
        if bad:
            raise ValueError(f"trainstream: {fmt.name} needs in_features to be a multiple of "
                             f"{fmt.in_features_multiple}; these layers are not: {', '.join(bad)}. Add them to "
                             f"TrainStreamQuantizationConfig(skip=...), or use int8 or fp8 (any width).")

    def _target(self, name: str, m: nn.Module) -> None:
        self.targets.add(name)
        if _is_conv1d(m):
            self.conv1d.add(name)

    def _pick_saved(self, model: nn.Module, names: list[str]) -> None:
        """The layers a checkpoint's config lists as packed; each must be a linear layer of this model."""
        wrong = []
        for name in names:
            try:
                m = model.get_submodule(name)
            except AttributeError:
                m = None
            if m is None or not _is_target(m):
                wrong.append(name)
                continue
            self._target(name, m)
        if wrong:
            raise ValueError(f"trainstream: the checkpoint's quantization_config lists packed layers that are not "
                             f"linear layers of {type(model).__name__}: {', '.join(wrong[:4])}"
                             f"{' ...' if len(wrong) > 4 else ''}; was it saved from another architecture?")

    def _swap_empty(self, model: nn.Module, module_name: str, fmt) -> None:
        """Puts an empty LoadedQuantLinear (on the skeleton's device, meta) in a target's place, for transformers to
        read the checkpoint's packed tensors into: its parameters are the checkpoint's ``<layer>.weight_<name>``."""
        old = model.get_submodule(module_name)
        if isinstance(old, QuantLinear):  # a module reachable under two names, already converted
            return
        conv = _is_conv1d(old)
        shape = (old.weight.shape[1], old.weight.shape[0]) if conv else (old.out_features, old.in_features)
        device = old.weight.device
        tensors = {n: torch.empty(s, dtype=dt, device=device) for n, (s, dt) in packed_layout(fmt, shape).items()}
        q = self.quantization_config
        packed = QuantizedTensor(fmt, shape, tensors, old.weight.dtype)
        self._replace(model, module_name,
                      LoadedQuantLinear(packed, old.bias, act_quant=q.act_quant, outliers=q.outliers))

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        if self.pre_quantized:
            return False  # read as saved
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
        self._replace(model, module_name, new)

    @staticmethod
    def _replace(model: nn.Module, module_name: str, new: nn.Module) -> None:
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        left = [n for n in sorted(self.targets) if not isinstance(model.get_submodule(n), QuantLinear)]
        if left:  # weights the checkpoint lacked: transformers initialised them (and reports them missing)
            warnings.warn(f"trainstream: {len(left)} layers had no weight in the checkpoint and were quantized as "
                          f"initialised: {', '.join(left[:4])}{' ...' if len(left) > 4 else ''}", stacklevel=2)
            for name in left:
                self._swap(model, name, model.get_submodule(name).weight)
        if self.pre_quantized:
            for name in self.targets:
                layer = model.get_submodule(name)
                want = packed_layout(layer.fmt, (layer.out_features, layer.in_features))
                got = {n: getattr(layer, "weight_" + n).dtype for n in want}
                if got != {n: dt for n, (_, dt) in want.items()}:
                    # transformers 5.25 keeps a pre-quantized tensor in the empty parameter's dtype; a loader that
                    # cast it to the model's dtype would have changed its bits
                    raise ValueError(f"trainstream: {name}'s packed tensors were loaded as {got}, not in the "
                                     f"checkpoint's dtypes; this transformers version casts pre-quantized tensors")
                for p in layer.parameters(recurse=False):  # transformers assigned them trainable: frozen, as built
                    p.requires_grad_(False)
        setattr(model, KBIT_FLAG, True)  # the module docstring: what PEFT and TRL see
        return model

    def remove_quantization_config(self, model: nn.Module) -> None:
        """transformers' clean-up once the model is no longer quantized (``dequantize``), the k-bit flag included."""
        super().remove_quantization_config(model)
        if hasattr(model, KBIT_FLAG):
            delattr(model, KBIT_FLAG)

    def is_serializable(self, **kwargs: Any) -> bool:
        """Always: the packed tensors are plain tensors, saved as they are (the module docstring)."""
        return True

    def get_state_dict_and_metadata(self, model: nn.Module) -> tuple[None, dict]:
        """What ``save_pretrained`` asks before it writes anything: the state dict is the model's own (None here), but
        the config it writes next must say which layers are packed *now*.

        ``quantization_config.modules`` becomes the names of the packed layers (PEFT's ``base_layer`` wrapping
        left out). When none is left (all merged by PEFT's ``merge_and_unload`` or replaced), the model is no longer
        quantized: its quantization config goes (as ``dequantize`` does), so the checkpoint is a plain one.

        Raises:
            ValueError: a packed layer in a format other than the config's (quantized again by hand), which the
                config could not describe; packed layers wrapped in PEFT LoRA layers (``get_peft_model``), whose keys
                no model loads: save the adapters or merge them.
        """
        q = self.quantization_config
        packed = {}
        for name, m in model.named_modules():
            if isinstance(m, QuantLinear):
                packed[name.replace(".base_layer", "")] = m
        wrapped = [n for n, m in model.named_modules() if n.endswith(".base_layer") and isinstance(m, QuantLinear)]
        if wrapped and not getattr(model, "_hf_peft_config_loaded", False):
            # transformers would write the LoRA layers' keys (base_layer, lora_A, ...), which no model loads back
            raise ValueError(f"trainstream: save_pretrained: {len(wrapped)} packed layers are wrapped in PEFT LoRA "
                             f"layers ({wrapped[0]}, ...); save the adapters with peft_model.save_pretrained(dir), or "
                             f"merge them first (peft_model.merge_and_unload().save_pretrained(dir))")
        if not packed:
            logger.info("trainstream: no packed layer left; saving a plain checkpoint without quantization_config")
            self.remove_quantization_config(model)
            return None, {}
        other = sorted(n for n, m in packed.items() if m.fmt.name != q.quantize)
        if other:
            raise ValueError(f"trainstream: save_pretrained: the quantization_config says {q.quantize} but these "
                             f"layers are packed in another format: {', '.join(other[:4])}"
                             f"{' ...' if len(other) > 4 else ''}; dequantize them (or the model) first")
        q.modules = sorted(packed)
        return None, {}

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | str | None = None) -> nn.Module:
        """Puts a dense layer in each packed layer's place: ``nn.Linear`` whose weight is ``dequantize_weight`` in
        ``dtype`` (default, from ``PreTrainedModel.dequantize``: the model's ``config.dtype``), or transformers'
        ``Conv1D`` (weight transposed) where the checkpoint had one. The bias is kept as it is. The new parameters
        are trainable, as a freshly built layer's are (bitsandbytes' ``dequantize`` does the same). transformers
        then drops the quantization config (:meth:`remove_quantization_config`)."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        for name, m in list(model.named_modules()):
            if not isinstance(m, QuantLinear):
                continue
            dt = dtype if dtype is not None else m.weight_dtype
            with torch.no_grad():
                w = m.dequantize_weight(dt if dt in (torch.float32, torch.bfloat16, torch.float16) else torch.float32)
                w = w.to(dt)
            bias = m.bias
            if name.replace(".base_layer", "") in self.conv1d:
                from transformers.pytorch_utils import Conv1D

                dense = Conv1D(m.out_features, m.in_features)
                dense.weight = nn.Parameter(w.t().contiguous())
                dense.bias = nn.Parameter(bias.detach()) if bias is not None else None
            else:
                dense = nn.Linear(m.in_features, m.out_features, bias=bias is not None, device="meta")
                dense.weight = nn.Parameter(w)
                if bias is not None:
                    dense.bias = nn.Parameter(bias.detach())
            self._replace(model, name, dense)
        return model

    @property
    def is_trainable(self) -> bool:
        return True  # through adapters (PEFT LoRA over QuantLinear); the packed base itself is frozen

    @property
    def is_compileable(self) -> bool:
        # QuantLinear's ops are registered with fake kernels and trace without a break (tests/engine/
        # test_compiled_blocks.py); transformers' default (False) would keep generate() from ever compiling its decode
        # step for a packed model, whatever cache or compile config it is given.
        return True


def mark_quantized(model: nn.Module, config: TrainStreamQuantizationConfig) -> bool:
    """Gives a model whose linear layers were packed in place (``quantize_frozen_base``: the Trainer flag, the callback
    and ``TRAINSTREAM_QUANTIZE``) what :class:`TrainStreamHfQuantizer` gives a model it loads: ``hf_quantizer``,
    ``is_quantized``, ``quantization_method``, ``config.quantization_config`` and the k-bit flag. transformers' own
    calls then work on it as on a loaded one: ``dequantize()`` (dense layers again), ``save_pretrained`` (the packed
    checkpoint; after ``merge_and_unload()``, a plain one). Returns False, changing nothing, when ``model`` (or the
    model inside a PEFT wrapper) is not a transformers ``PreTrainedModel`` or already has a quantizer."""
    from transformers import PreTrainedModel

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, PreTrainedModel) or getattr(base, "hf_quantizer", None) is not None:
        return False
    quantizer = TrainStreamHfQuantizer(config)
    for name, m in base.named_modules():  # the layers it would have packed
        if isinstance(m, QuantLinear):
            quantizer._target(name, m)
    # What from_pretrained does around loading, minus the conversion (the layers are packed already):
    # preprocess_model's two attributes, then the quantizer's own postprocess_model (config.quantization_config, the
    # configs' _is_quantized, the packed layers' checks, the k-bit flag), then the quantizer on the model.
    base.is_quantized = True
    base.quantization_method = QUANT_METHOD
    quantizer.postprocess_model(base)
    base.hf_quantizer = quantizer
    return True


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
