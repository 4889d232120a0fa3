"""PEFT: LoRA over trainstream's quantized bases (peft 0.21).

PEFT's own calls need nothing of this module: ``QuantLinear`` is an ``nn.Linear`` to PEFT, so
``get_peft_model(model, LoraConfig(target_modules="all-linear"))``, ``PeftModel.from_pretrained(quantized_base,
adapter_dir)`` and ``AutoPeftModelForCausalLM.from_pretrained(adapter_dir, quantization_config=...)`` wrap every
packed layer, and the LoRA layer over one is :class:`~trainstream_hf.quant.lora.QuantLoraLinear` (the fused native
path) without any registration (:mod:`trainstream_hf.quant.lora`)::

    model = quantize_model(base, "nf4")
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    ...                                       # train; model.disable_adapter() gives the base's outputs
    model.save_pretrained(path)               # a standard PEFT adapter (adapter_config.json + safetensors)
    model = PeftModel.from_pretrained(quantize_model(fresh_base, "nf4"), path)
    merged = model.merge_and_unload()         # plain nn.Linear layers: dequantized base + LoRA delta

:func:`quant_lora_config` and :func:`load_quant_lora` are the older spelling of the same (a ``LoraConfig`` with
PEFT's custom-module mapping registered, and a loader that registers it again); they still work and give the same
layers, and are kept for code written against them.
"""
from __future__ import annotations

import os

from peft import LoraConfig, PeftModel
from torch import nn

from trainstream_hf.quant.linear import QuantLinear, _is_conv1d
from trainstream_hf.quant.lora import QuantLoraLinear, register_quant_lora

__all__ = ["QuantLoraLinear", "register_quant_lora", "quant_lora_config", "load_quant_lora"]


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
