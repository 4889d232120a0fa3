"""The model's repeated blocks: the unit that weights are paged and activations offloaded by.

A block is one of the model's repeated layers (a decoder layer). They are found generically, with no
function per model: among the model's ``nn.ModuleList`` s, the lists whose children are all block classes
(transformers' ``GradientCheckpointingLayer`` subclasses, or classes named in a ``_no_split_modules``),
the one holding the most parameters wins. Parameters, not length, decide, so that a vision-language
model's language stack beats its (longer or shorter) vision tower. ``TABLE`` names the list directly for
the few model types where that rule is wrong. A model without such a list (a plain ``nn.Module`` stack)
falls back to the largest list of two or more same-class modules.

PEFT wrappers need no special case: ``PeftModel.named_modules()`` reaches the wrapped model, so the list
is found under its prefixed name (``base_model.model.model.layers``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from torch import nn

__all__ = ["Blocks", "find_blocks", "check_wrappable", "TABLE", "SUPPORTED"]

# model_type -> the block list's qualified name, matched as a suffix of the module name (so it also holds
# under PEFT's ``base_model.model.`` prefix). Only for models where the generic rule picks wrongly.
TABLE: dict[str, str] = {
    # Vision-language models whose vision tower outweighs the language model in their default configs
    # (surveyed over transformers 5.24's causal-LM and image-text-to-text model types); a fine-tune pages
    # the language stack.
    "blip-2": "language_model.model.decoder.layers",
    "instructblip": "language_model.model.decoder.layers",
    "instructblipvideo": "language_model.model.decoder.layers",
    "git": "git.encoder.layer",
    "glm_ocr": "language_model.layers",
    "paddleocr_vl": "language_model.layers",
}


# What the engine trains, for the errors that refuse anything else.
SUPPORTED = ("decoder-only causal LMs (transformers' *ForCausalLM, or a PEFT model around one) whose layers are an "
             "nn.ModuleList of same-class blocks")


@dataclass(frozen=True)
class Blocks:
    """The repeated layers of a model, in forward order.

    Attributes:
        model: the module they were found in (the one passed to :func:`find_blocks`).
        name: qualified name of their ``nn.ModuleList`` within ``model``.
        layers: the blocks; ``layers[i]`` runs before ``layers[i + 1]`` in the forward pass.
    """

    model: nn.Module
    name: str
    layers: tuple[nn.Module, ...]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> nn.Module:
        return self.layers[i]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.layers)

    def __repr__(self) -> str:
        kinds = sorted({type(m).__name__ for m in self.layers})
        return f"Blocks({self.name!r}, {len(self.layers)} x {'/'.join(kinds)})"


def _model_type(model: nn.Module) -> str | None:
    for m in model.modules():
        config = getattr(m, "config", None)
        model_type = getattr(config, "model_type", None)
        if isinstance(model_type, str):
            return model_type
    return None


def _block_class_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for m in model.modules():
        no_split = getattr(m, "_no_split_modules", None)
        if no_split:
            names.update(no_split)
    return names


def _is_block_class(module: nn.Module, names: set[str]) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers is optional for plain torch models
        GradientCheckpointingLayer = ()
    return isinstance(module, GradientCheckpointingLayer) or type(module).__name__ in names


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, path: str | None = None) -> Blocks:
    """Finds the model's repeated blocks.

    Args:
        model: a transformers model, a PEFT wrapper of one, or any ``nn.Module`` holding its layers in
            an ``nn.ModuleList``.
        path: qualified name of the block list, overriding the search (and ``TABLE``).

    Returns:
        The :class:`Blocks`, in forward order.

    Raises:
        ValueError: the model has no repeated blocks (or ``path`` does not name a non-empty ModuleList).
    """
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if path is None:
        suffix = TABLE.get(_model_type(model) or "")
        if suffix is not None:
            hits = [(n, m) for n, m in lists if n == suffix or n.endswith("." + suffix)]
            if len(hits) == 1:
                path = hits[0][0]
    if path is not None:
        found = dict(lists).get(path)
        if found is None:
            raise ValueError(f"find_blocks: {path!r} is not a non-empty nn.ModuleList of "
                             f"{type(model).__name__}; ModuleLists there: {[n for n, _ in lists] or 'none'}")
        return Blocks(model, path, tuple(found))

    names = _block_class_names(model)
    candidates = [(n, m) for n, m in lists if all(_is_block_class(c, names) for c in m)]
    if not candidates:
        # Not a transformers model (or one with unusual classes): any list of two or more same-class
        # modules is a repeated stack.
        candidates = [(n, m) for n, m in lists if len(m) >= 2 and len({type(c) for c in m}) == 1]
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (no nn.ModuleList of two or more same-class layers); "
            f"trainstream_hf supports {SUPPORTED}: load such a model (e.g. AutoModelForCausalLM.from_pretrained), "
            "or hold your own layers in an nn.ModuleList")
    name, found = max(candidates, key=lambda nm: (_n_params(nm[1]), len(nm[1])))
    return Blocks(model, name, tuple(found))


def _check_placed_by_itself(model: nn.Module, name: str) -> None:
    """Refuses a model whose weights something else already places or shards: Accelerate's ``device_map`` hooks
    over several devices, FSDP (1 or 2), tensor parallelism (DTensor parameters) or a DeepSpeed engine. Each moves
    or gathers weights at every forward on its own, where the engine pages them itself."""
    classes = {c.__name__ for m in model.modules() for c in type(m).__mro__}
    if "DeepSpeedEngine" in classes:
        raise ValueError(f"{name} is a DeepSpeed engine: DeepSpeed and trainstream_hf both decide where the weights "
                         "and optimizer state live; wrap the plain model (without deepspeed.initialize / "
                         "--deepspeed) and let trainstream_hf offload")
    if classes & {"FullyShardedDataParallel", "FSDPModule"}:
        raise ValueError(f"{name} is sharded by FSDP: FSDP and trainstream_hf both decide where the weights live; "
                         "wrap the unsharded model (on several GPUs trainstream_hf trains under "
                         "DistributedDataParallel: the README's 'Several GPUs')")
    dtensor = next((n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"
                    or type(getattr(p, "data", None)).__name__ == "DTensor"), None)
    if dtensor is not None:
        raise ValueError(f"{name} has sharded (DTensor) parameters, e.g. {dtensor} (tensor parallelism, tp_plan, or "
                         "FSDP2): trainstream_hf pages whole parameters; load the model without tp_plan and wrap "
                         "it unsharded")
    device_map = getattr(model, "hf_device_map", None)
    places = sorted({str(v) for v in device_map.values()}) if isinstance(device_map, dict) else []
    if len(places) > 1:
        raise ValueError(f"{name} was loaded with a device_map over {', '.join(places)}: Accelerate's hooks then move "
                         "each layer's weights and inputs to its own device at every forward, where trainstream_hf "
                         "places the weights itself; load it without device_map (into host RAM if it is larger than "
                         "the GPU) and pass device='cuda' to wrap, which places it block by block")


def _is_encoder_decoder(model: nn.Module) -> bool:
    for m in model.modules():
        if getattr(getattr(m, "config", None), "is_encoder_decoder", False) is True:
            return True
        if isinstance(getattr(m, "encoder", None), nn.Module) and isinstance(getattr(m, "decoder", None), nn.Module):
            return True
    return False


def check_wrappable(model: nn.Module) -> None:
    """Refuses, with what is supported and what to do, a model the engine cannot train.

    Args:
        model: what the user passed to ``wrap`` / ``plan``.

    Raises:
        ValueError: an encoder-decoder model (T5, BART, Whisper, ...), a model without repeated blocks, one
            with parameters or buffers on the ``meta`` device (no values to train or page), or one whose weights
            something else places: a ``device_map`` over several devices, FSDP, tensor parallelism, DeepSpeed.
    """
    name = type(model).__name__
    _check_placed_by_itself(model, name)
    if _is_encoder_decoder(model):
        raise ValueError(f"{name} is an encoder-decoder model, which trainstream_hf does not support; it trains "
                         f"{SUPPORTED}: use a decoder-only model (e.g. AutoModelForCausalLM.from_pretrained)")
    find_blocks(model)  # raises its own message when there are no repeated blocks
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"{name} has {len(meta)} parameter(s) or buffer(s) on the meta device, which hold no "
                         f"values (first: {meta[0]}); trainstream_hf trains a model whose weights are loaded: build it "
                         "outside torch.device('meta') / init_empty_weights() (e.g. "
                         "AutoModelForCausalLM.from_pretrained without a device_map that offloads to 'disk'), or call "
                         "model.to_empty(device='cpu') and load_state_dict(...) first")
