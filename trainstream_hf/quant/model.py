"""``quantize_model``: swap a model's linear layers for :class:`~trainstream_hf.quant.linear.QuantLinear`, in place."""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from trainstream_hf.quant import outliers as _outliers
from trainstream_hf.quant.formats import QuantFormat, get_format
from trainstream_hf.quant.linear import QuantLinear, _is_conv1d, linear_weight

__all__ = ["quantize_model", "quantize_frozen_base", "is_plain_linear", "warn_weights_left_dense"]

# Subclasses of nn.Linear in transformers whose forward is the plain linear map (FalconLinear: x @ W.T + b, written
# out): packed as nn.Linear is. Every other subclass keeps its own semantics (a router, a head with an fp32 output,
# MultiheadAttention's out_proj, whose weight the attention reads directly) and is left alone.
_PLAIN_LINEAR = {("transformers.models.falcon.modeling_falcon", "FalconLinear")}


def is_plain_linear(module: nn.Module) -> bool:
    """``module`` is an ``nn.Linear`` or a subclass that computes the same map (``FalconLinear``)."""
    cls = type(module)
    return cls is nn.Linear or (cls.__module__, cls.__qualname__) in _PLAIN_LINEAR


def _is_target(module: nn.Module) -> bool:
    # nn.Linear (or a plain subclass) or Conv1D: other subclasses (MultiheadAttention's out_proj, other libraries'
    # quantized or adapter layers) have their own semantics and are left alone.
    return is_plain_linear(module) or (_is_conv1d(module) and not isinstance(module, nn.Linear))


def warn_weights_left_dense(model: nn.Module, quantize: str, stacklevel: int = 2) -> None:
    """One warning when ``model`` holds weights the packers never take: parameters of three or more dimensions
    (mixture-of-experts weights held as (experts, out, in) tensors, as transformers 5 stores Mixtral's, Qwen3-MoE's or
    GPT-OSS's; convolutions). They stay in their dtype, however large a share of the model they are, and the plan
    holds or pages them as they are: the warning says how large, so a model that stays mostly 16-bit is not taken
    for a 4-bit one."""
    dense, total = [], 0
    for name, p in model.named_parameters():  # (each shared parameter once)
        total += p.numel()
        if p.dim() >= 3:
            dense.append((name, p))
    if not dense:
        return
    count = sum(p.numel() for _, p in dense)
    name, p = dense[0]
    size = f"{count / 1e9:.1f} B" if count >= 1e9 else f"{count / 1e6:.1f} M"
    share, dtype = 100 * count / max(total, 1), str(p.dtype).replace("torch.", "")
    warnings.warn(f"quantize={quantize!r} packs nn.Linear layers only: {len(dense)} weight tensors of three or more "
                  f"dimensions ({size} parameters, {share:.0f}% of the model) stay in their dtype at full size, e.g. "
                  f"{name} {tuple(p.shape)} {dtype} (mixture-of-experts weights held as one tensor, or convolutions)",
                  RuntimeWarning, stacklevel=stacklevel + 1)


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def quantize_model(model: nn.Module, quantize: str | QuantFormat = "nf4", outliers: float = 0.0,
                   skip: str | tuple[str, ...] | list[str] = ("lm_head",), *, act_quant: bool | None = None,
                   device: torch.device | str | None = None,
                   replaced: Callable[[nn.Module, str, nn.Module], None] | None = None,
                   warn_dense: bool = True) -> nn.Module:
    """Replaces every ``nn.Linear`` and transformers ``Conv1D`` of ``model`` by a frozen :class:`QuantLinear`.

    Layers are converted one at a time and each original is released as soon as its replacement is in place, so
    the conversion never holds a second copy of the model (peak: the model plus one layer's temporaries). The
    packed weight stays on the device the layer's weight was on; ``device="cuda"`` quantizes a CPU-resident model
    on the GPU one layer at a time (the whole bf16 model is never on the GPU).

    Not converted: modules named in ``skip``, subclasses of ``nn.Linear`` (e.g. ``MultiheadAttention.out_proj``;
    :func:`is_plain_linear` names the ones that are, such as Falcon's),
    layers that are already :class:`QuantLinear`, and layers whose weight is shared with another module (tied
    ``lm_head``/embeddings: quantizing would untie it and save nothing), which get a warning.

    A layer whose in_features is not a multiple of the format's block (64 for nf4, 16 for nvfp4) is an error, not a
    silent skip, so the model never ends up partly in bf16 unasked: every such layer is named in one ValueError
    raised before anything is converted (add them to ``skip``, or choose int8 / fp8, which take any width).

    Args:
        model: the model, converted in place.
        quantize: ``"int8"``, ``"nf4"``, ``"fp8"``, ``"nvfp4"`` or a :class:`QuantFormat`.
        outliers: fraction of input channels kept out of the activation quantization, in [0, 0.5]
            (see :class:`QuantLinear`).
        skip: module names to leave alone; an entry matches a module whose qualified name equals it or ends with
            ``"." + entry`` (``"lm_head"``, ``"down_proj"``, ``"model.layers.0.mlp.up_proj"``).
        act_quant: see :class:`QuantLinear` (default None: per device, see
            :func:`~trainstream_hf.quant.matmul.default_act_quant`).
        device: where to run the quantization (default: where each weight is).
        replaced: called as ``replaced(parent, child_name, original)`` once each layer is swapped, before the
            original is released (``wrap`` keeps them, in host RAM, to put them back if it fails).
        warn_dense: warn when weights that are not linear layers' stay in their dtype
            (:func:`warn_weights_left_dense`; False where the caller warns once for the whole model).

    Returns:
        ``model`` (or the :class:`QuantLinear` when ``model`` itself is an ``nn.Linear``).

    Raises:
        ValueError: unknown format, outliers outside [0, 0.5], in_features not a multiple of the block.
    """
    fmt = get_format(quantize)
    _outliers.check_outliers(outliers)
    skip = (skip,) if isinstance(skip, str) else tuple(skip)

    owners: dict[int, set[int]] = {}  # parameter -> modules holding it
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(m))

    names, tied, bad = [], [], []
    for name, m in model.named_modules(remove_duplicate=False):
        if not _is_target(m) or _skipped(name, skip):
            continue
        if len(owners[id(m.weight)]) > 1:
            tied.append(name)
            continue
        w, _ = linear_weight(m)
        if w.shape[1] % fmt.in_features_multiple:
            bad.append(f"{name or '<model>'} (in_features={w.shape[1]})")
        names.append(name)
    del m
    if bad:
        raise ValueError(f"quantize_model: {fmt.name} needs in_features to be a multiple of "
                         f"{fmt.in_features_multiple}; these layers are not: {', '.join(bad)}. Add them to skip=, or "
                         f"use int8 or fp8 (any width). Nothing was converted.")
    if warn_dense:
        warn_weights_left_dense(model, fmt.name)
    if tied:
        warnings.warn(f"quantize_model: {len(tied)} layers share their weight with another module and stay "
                      f"unquantized: {', '.join(tied[:4])}{' ...' if len(tied) > 4 else ''}", stacklevel=2)

    done: dict[int, QuantLinear] = {}  # a module reachable under several names is converted once
    for name in names:
        if not name:  # the model is itself a linear layer
            return QuantLinear.from_linear(model, fmt, outliers, act_quant=act_quant, device=device)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        new = done.get(id(old))
        if new is None:
            new = done[id(old)] = QuantLinear.from_linear(old, fmt, outliers, act_quant=act_quant, device=device)
        setattr(parent, child, new)
        if replaced is not None:
            replaced(parent, child, old)
        del old, new
    return model


def quantize_frozen_base(model: nn.Module, quantize: str, outliers: float = 0.0, *,
                         replaced: Callable[[nn.Module, str, nn.Module], None] | None = None) -> list[str]:
    """Packs the frozen ``nn.Linear`` layers of ``model`` in place (a PEFT model's base layers; never a trainable one,
    never the output head), one layer at a time on the device each weight is on.

    Args:
        model: the model about to train (e.g. a ``PeftModel``); changed in place, parameter objects of the trainable
            layers untouched (an optimizer built over them stays valid).
        quantize: a format of ``trainstream_hf.quant.FORMATS``.
        outliers: see :class:`~trainstream_hf.QuantLinear`.
        replaced: see :func:`quantize_model`.

    A base already packed in this format (by ``from_pretrained(quantization_config=...)``, a recipe that builds it
    packed, or an earlier call) is accepted as it is: its dense frozen layers, if any, are packed, the packed ones
    left alone, so the same option can be passed on to every step that takes it.

    Returns:
        The qualified names of the layers packed by this call.

    Raises:
        ValueError: no frozen linear layer, packed or not (a full fine-tune has nothing to pack), or none whose width
            the format takes; layers already packed in another format or with other outliers.

    A frozen layer whose ``in_features`` the format cannot take (nf4 and nvfp4 pack blocks of 64 / 16 along it)
    stays in its dtype, named in a warning (``quantize_model`` refuses the whole model instead).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    frozen, keep = [], []
    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    other = [(n, m) for n, m in packed if m.fmt.name != quantize or float(m.outliers) != float(outliers)]
    if other:
        n, m = other[0]
        raise ValueError(f"quantize={quantize!r}, outliers={outliers}: layer {n} is already packed as "
                         f"{m.fmt.name!r} with outliers={m.outliers}; pass the format the base was packed in")
    # the head and whatever it wraps (PEFT's modules_to_save keeps the original head inside a wrapper)
    in_head = set() if head is None else {id(m) for m in head.modules()}
    for name, m in model.named_modules():
        if not is_plain_linear(m):
            continue
        (frozen if not m.weight.requires_grad and id(m) not in in_head else keep).append(name)
    if not frozen:
        if packed:
            return []
        conv = [n for n, m in model.named_modules()
                if _is_conv1d(m) and not any(p.requires_grad for p in m.parameters(recurse=False))]
        if conv:
            raise ValueError(f"quantize={quantize!r} packs frozen nn.Linear layers; this model's frozen projections "
                             f"are transformers' Conv1D (GPT-2 style, e.g. {conv[0]}), which it does not pack: leave "
                             "quantize unset")
        raise ValueError(f"quantize={quantize!r} packs frozen linear layers, and this model has none (every linear "
                         "layer trains): add PEFT LoRA adapters, or leave quantize unset")
    dora = [n for n, m in model.named_modules() if getattr(m, "lora_magnitude_vector", None)
            and isinstance(getattr(m, "base_layer", None), nn.Linear) and not isinstance(m.base_layer, QuantLinear)]
    if dora:
        raise ValueError(f"quantize={quantize!r}: DoRA adapters (use_dora=True, e.g. {dora[0]}) need their dense base "
                         "weight; use plain LoRA (use_dora=False), or leave quantize unset")
    fmt = get_format(quantize)
    narrow = [n for n in frozen if model.get_submodule(n).in_features % fmt.in_features_multiple]
    if narrow and len(narrow) == len(frozen):
        raise ValueError(f"quantize={quantize!r}: {fmt.name} needs in_features to be a multiple of "
                         f"{fmt.in_features_multiple}, and no frozen linear layer of this model has one (e.g. "
                         f"{narrow[0]}, in_features={model.get_submodule(narrow[0]).in_features}): use int8 or fp8 "
                         "(any width), or leave quantize unset")
    if narrow:
        warnings.warn(f"quantize={quantize!r}: {len(narrow)} of {len(frozen)} frozen linear layers stay in their "
                      f"dtype: {fmt.name} needs in_features to be a multiple of {fmt.in_features_multiple}, and "
                      f"theirs are not ({', '.join(f'{n} ({model.get_submodule(n).in_features})' for n in narrow[:3])}"
                      f"{' ...' if len(narrow) > 3 else ''}); int8 and fp8 take any width", RuntimeWarning,
                      stacklevel=3)
    # a bias that trains (PEFT's bias="all" / "lora_only") stays the Parameter it was, trainable, held by the optimizer
    trained_bias = {n: b for n in frozen if isinstance(b := model.get_submodule(n).bias, nn.Parameter)
                    and b.requires_grad}
    warn_weights_left_dense(model, fmt.name, stacklevel=3)
    quantize_model(model, quantize, outliers, skip=tuple(keep) + tuple(narrow) + ("lm_head",), replaced=replaced,
                   warn_dense=False)
    for n, bias in trained_bias.items():
        layer = model.get_submodule(n)
        if isinstance(layer, QuantLinear):
            layer.bias = bias
    return [n for n in frozen if isinstance(model.get_submodule(n), QuantLinear)]
