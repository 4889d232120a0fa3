"""Building the model a recipe trains: random weights from a shipped config, or a local checkpoint.

Random weights are built the way a model larger than the GPU must be. The skeleton is made with its parameters on
the meta device (no memory; buffers such as the rotary tables are real and small), then materialised one piece at a
time, in forward order: a decoder block, or a module outside the blocks (embeddings, final norm, head). Each piece is
allocated on the compute device in the model's dtype, initialised there by transformers' own ``_init_weights`` (the
initialisation ``from_config`` would give), its linear layers packed by :func:`trainstream_hf.quantize_model` when
``quantize`` is set, and only then moved to where it will live (``home``): the compute device, or host RAM when the
engine's plan may page the weights (``wrap(device=...)`` places a host-resident model block by block). So neither the
whole model in its dtype on the GPU nor an fp32 copy of it ever exists: building a 70B nf4 base holds one bf16
decoder layer on the GPU at a time, and the packed layers in host RAM.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from trainstream_hf.train.config import ConfigError

__all__ = ["DTYPES", "resolve_device", "cap_vram", "resolve_mixed_precision", "model_config", "skeleton", "materialize",
           "build_model", "home_device", "lora_config", "add_lora", "count_parameters", "save_model"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str) -> torch.device:
    """'auto' -> the current CUDA device when there is one, else the CPU; otherwise ``torch.device(spec)``."""
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={spec!r} but CUDA is not available; use device=cpu or auto")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def cap_vram(spec: str | None, device: torch.device) -> int | None:
    """Caps the CUDA caching allocator of ``device`` at ``spec`` bytes (``"24GiB"``, or None: no cap) with
    ``torch.cuda.set_per_process_memory_fraction``, so that a larger GPU behaves like one of that size: what the
    allocator reserves, fragmentation included, may not pass it (the CUDA context and cuBLAS workspaces outside
    the allocator are not counted). Returns the cap in bytes.

    Raises:
        ConfigError: a cap on a device that is not CUDA, or a size that does not parse.
    """
    if spec is None:
        return None
    from trainstream_hf.config import parse_bytes

    try:
        cap = parse_bytes(spec, name="vram_cap")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if device.type != "cuda":
        raise ConfigError(f"vram_cap={spec!r} caps the CUDA allocator, but the device is {device}; set vram_cap null")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    return cap


def resolve_mixed_precision(spec: str, environ=None) -> str:
    """The autocast mode of the forward: ``"no"`` or ``"bf16"``.

    ``"auto"`` takes what ``accelerate launch`` was told (its config file's ``mixed_precision``, which it passes to
    the script as ``ACCELERATE_MIXED_PRECISION``; accelerate 1.15-1.16), and ``"no"`` outside ``accelerate launch``.
    Raises:
        ConfigError: fp16 / fp8 asked by the launcher (fp16 needs a GradScaler, which the engine refuses).
    """
    env = os.environ if environ is None else environ
    if spec != "auto":
        return spec
    launched = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower() or "no"
    if launched not in ("no", "bf16"):
        raise ConfigError(f"mixed_precision: accelerate launch asks for {launched!r} (ACCELERATE_MIXED_PRECISION); "
                         "the recipes support 'no' and 'bf16' (fp16 needs a GradScaler, which the engine refuses): set "
                         "mixed_precision: bf16 in the accelerate config, or --mixed_precision no|bf16")
    return launched


def _read_config(spec: str):
    from transformers import AutoConfig

    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"model: no such file or directory {spec!r}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model: {spec!r} holds no config.json (not a transformers model directory)")
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    try:
        kwargs = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model: {spec!r} is not a JSON model config ({e})") from None
    if not isinstance(kwargs, dict) or "model_type" not in kwargs:
        raise ConfigError(f"model: {spec!r} needs a 'model_type' key (e.g. \"llama\")")
    kwargs = dict(kwargs)
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def model_config(spec: str):
    """The transformers config a model spec describes: a JSON file of config kwargs with ``model_type`` (as the ones
    under ``configs/models/``) or a directory holding config.json."""
    return _read_config(spec)


def skeleton(config, dtype: torch.dtype) -> nn.Module:
    """A causal LM of ``config`` whose parameters are on the meta device (no memory) in ``dtype``; its buffers are
    real (CPU) and tied weights are tied (the same parameter object)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    # include_buffers=False: buffers computed at construction (rotary inv_freq) stay real, so nothing has to
    # recompute them; parameters go to meta. Ties made in post_init are lost under the patch: tie again.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    # quantize_model's rule for skip entries (exact qualified name, or a ".entry" suffix of it)
    return any(name == s or name.endswith("." + s) for s in skip)


def _owners(model: nn.Module) -> dict[int, nn.Module]:
    """Module -> the nearest PreTrainedModel at or above it (whose ``_init_weights`` initialises it), as
    transformers' ``initialize_weights`` dispatches for composite models."""
    from transformers import PreTrainedModel

    out: dict[int, nn.Module] = {}

    def walk(m: nn.Module, owner: nn.Module) -> None:
        if isinstance(m, PreTrainedModel):
            owner = m
        out[id(m)] = owner
        for c in m.children():
            walk(c, owner)

    walk(model, model)
    return out


@torch.no_grad()
def materialize(model: nn.Module, *, device: torch.device | str, home: torch.device | str,
                quantize: str | None = None, outliers: float = 0.0, skip: tuple[str, ...] = ("lm_head",),
                act_quant: bool | None = None) -> nn.Module:
    """Gives the meta parameters of ``model`` real, initialised values, one block (or outside module) at a time.

    Each piece is allocated on ``device`` in its parameter dtype, initialised there by the owning model's
    ``_init_weights`` (transformers' per-module initialisation), its ``nn.Linear`` layers packed with
    :func:`~trainstream_hf.quantize_model` when ``quantize`` is set (``skip``: as there; tied layers stay as they are),
    then moved to ``home``. Parameters shared by several modules (tied embeddings) are materialised once.

    Args:
        model: a :func:`skeleton` (meta parameters, real buffers), changed in place.
        device: where each piece is initialised and quantized (the compute device: fast, and the bf16 piece is
            the only dense one there).
        home: where each finished piece goes: ``device``, or ``"cpu"`` for a model the engine will page.
        quantize: ``None`` or a format of :data:`trainstream_hf.quant.FORMATS`.
        outliers, act_quant: see :class:`~trainstream_hf.QuantLinear`.
        skip: module names left unquantized (``quantize_model``'s rule).

    Returns:
        ``model``.
    """
    from trainstream_hf.engine.blocks import find_blocks
    from trainstream_hf.quant import quantize_model
    from trainstream_hf.quant.model import is_plain_linear, warn_weights_left_dense

    device, home = torch.device(device), torch.device(home)
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    owners = _owners(model)
    blocks = find_blocks(model)
    block_names = {id(b): f"{blocks.name}.{i}" for i, b in enumerate(blocks)}
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    # modules holding a parameter shared with another module (a tied head): left unquantized, as quantize_model does
    tied = {id(m) for m in model.modules() for p in m._parameters.values() if p is not None and holders[id(p)] > 1}
    # id(shared meta parameter) -> its real replacement, so ties stay ties. Only shared ones: a reference kept here to
    # any other parameter would keep a packed layer's dense weight alive, i.e. the whole dense model.
    done: dict[int, nn.Parameter] = {}
    to_build = {id(p): n for n, p in model.named_parameters() if p.is_meta}
    built: set[int] = set()

    def allocate(m: nn.Module) -> bool:
        """Real tensors on ``device`` for ``m``'s own meta parameters; True when any is new (to initialise)."""
        fresh = False
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = done.get(id(p))
            if new is None:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                if holders[id(p)] > 1:
                    done[id(p)] = new
                built.add(id(p))
                fresh = True
            m._parameters[name] = new
        for name, b in list(m._buffers.items()):
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)
        return fresh

    def build_block(block: nn.Module, name: str) -> None:
        for m in [m for m in block.modules() if allocate(m)]:
            owners[id(m)]._init_weights(m)
        if quantize is not None:
            local_skip = tuple(rel for rel, sub in block.named_modules()
                               if rel and is_plain_linear(sub) and _skipped(f"{name}.{rel}", skip))
            quantize_model(block, quantize, outliers, skip=local_skip, act_quant=act_quant, warn_dense=False)
        block.to(home)

    def build_own(m: nn.Module, name: str) -> None:
        """``m``'s own parameters and buffers (not its children's)."""
        if allocate(m):
            owners[id(m)]._init_weights(m)
        if quantize is not None and is_plain_linear(m) and name and not _skipped(name, skip) and id(m) not in tied:
            parent, _, child = name.rpartition(".")
            # a Linear gives back its QuantLinear
            q = quantize_model(m, quantize, outliers, act_quant=act_quant, warn_dense=False)
            setattr(model.get_submodule(parent), child, q)
            m = q
        before = dict(m._parameters)
        m._apply(lambda t: t.to(home), recurse=False)
        for pname, p in before.items():  # a parameter replaced rather than moved in place: keep ties pointing at it
            if p is not None and m._parameters[pname] is not p:
                done.update({k: m._parameters[pname] for k, v in done.items() if v is p})

    def visit(m: nn.Module, name: str) -> None:
        if id(m) in block_names:
            build_block(m, block_names[id(m)])
            return
        build_own(m, name)
        for cname, child in list(m.named_children()):
            visit(child, f"{name}.{cname}" if name else cname)

    if quantize is not None:
        warn_weights_left_dense(model, quantize, stacklevel=2)  # once for the model, not per block
    visit(model, "")
    left = [n for k, n in to_build.items() if k not in built]
    if left:  # a parameter reachable from no module visited above: a bug here, not the user's
        raise RuntimeError(f"materialize: parameters left on the meta device: {left[:4]}")
    return model


def build_model(spec: str, init: str, dtype: str, *, vocab_size: int, seed: int,
                device: torch.device | str = "cpu", home: torch.device | str | None = None,
                quantize: str | None = None, outliers: float = 0.0):
    """A causal LM, nothing fetched from a hub, placed where it will train.

    Args:
        spec: with ``init="random"``, a JSON file of config kwargs (with ``model_type``) or a directory holding
            config.json; with ``init="pretrained"``, a local model directory.
        init: "random" (built piece by piece, see :func:`materialize`) or "pretrained".
        dtype: a key of ``DTYPES``.
        vocab_size: the tokenizer's size; the model's embedding must cover it.
        seed: seeds the random initialisation.
        device: the compute device (random weights are initialised there).
        home: where the model is left: ``device`` (default) or ``"cpu"`` (host RAM, for the engine to page).
        quantize: pack the linear layers (not ``lm_head``) in this format as they are built (``pretrained``: as
            they are loaded, through :class:`~trainstream_hf.integrations.huggingface.TrainStreamQuantizationConfig`).
        outliers: see :class:`~trainstream_hf.QuantLinear`.

    Returns:
        The model, on ``home``.
    """
    from transformers import AutoModelForCausalLM, set_seed

    device = torch.device(device)
    home = device if home is None else torch.device(home)
    if init == "random":
        config = _read_config(spec)
        n = getattr(config.get_text_config(), "vocab_size", None) if hasattr(config, "get_text_config") else None
        if n is not None and n < vocab_size:
            raise ConfigError(f"model: {spec!r} has vocab_size {n} but the tokenizer has {vocab_size} tokens; raise "
                             "vocab_size in the model config")
        set_seed(seed)
        model = materialize(skeleton(config, DTYPES[dtype]), device=device, home=home, quantize=quantize,
                            outliers=outliers)
    elif init == "pretrained":
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"model: no such file or directory {spec!r}")
        if not path.is_dir():
            raise ConfigError(f"model: init=pretrained loads a local model directory; {spec!r} is a file "
                             "(use init=random to build from a config file)")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model: {spec!r} holds no config.json (not a transformers model directory)")
        kwargs = {}
        if quantize is not None:
            from trainstream_hf.integrations.huggingface import TrainStreamQuantizationConfig

            kwargs["quantization_config"] = TrainStreamQuantizationConfig(quantize=quantize, outliers=outliers)
        # Loaded straight to home (device_map), quantized tensor by tensor as read when asked.
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=True,
                                                     device_map={"": str(home)}, **kwargs)
    else:
        raise ConfigError(f"init: 'random' or 'pretrained', got {init!r}")
    n = model.get_input_embeddings().num_embeddings
    if n < vocab_size:
        raise ConfigError(f"model: its embedding has {n} rows but the tokenizer has {vocab_size} tokens; raise "
                         "vocab_size in the model config")
    return model


def home_device(device: torch.device, *, wrap: bool, page_weights, evaluate: bool) -> torch.device:
    """Where a recipe builds its model: host RAM when the engine trains it on a GPU, may page its weights
    (``page_weights`` not False) and nothing needs it whole on the GPU before wrapping (no evaluation before
    training); ``wrap(device=...)`` then places each block where the plan says. Otherwise the device."""
    if wrap and device.type == "cuda" and page_weights is not False and not evaluate:
        return torch.device("cpu")
    return device


def lora_config(model: nn.Module, *, r: int, alpha: int, dropout: float, target_modules):
    """The PEFT ``LoraConfig`` of the ``lora`` section for ``model`` (``QuantLinear`` targets dispatched to
    trainstream's LoRA layer), for ``get_peft_model`` or a TRL trainer's ``peft_config``.

    Args:
        model: the causal LM (possibly quantized).
        r, alpha, dropout: ``LoraConfig``'s ``r``, ``lora_alpha``, ``lora_dropout``.
        target_modules: module names, or ``"all-linear"`` (every linear layer but the output head).
    """
    from trainstream_hf.integrations.peft import quant_lora_config

    return quant_lora_config(model, r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                             task_type="CAUSAL_LM")


def add_lora(model: nn.Module, *, r: int, alpha: int, dropout: float, target_modules):
    """PEFT LoRA adapters on ``model`` (over ``QuantLinear`` bases too); the base is frozen.

    Args:
        model: the causal LM.
        r, alpha, dropout, target_modules: as :func:`lora_config`.

    Returns:
        The ``peft.PeftModel``.
    """
    from peft import get_peft_model

    return get_peft_model(model, lora_config(model, r=r, alpha=alpha, dropout=dropout, target_modules=target_modules))


def count_parameters(model: nn.Module) -> dict[str, int]:
    """``{"parameters": ..., "trainable": ...}``; a quantized layer counts its logical in x out weights, not
    its packed bytes."""
    from trainstream_hf.quant import QuantLinear

    total = trainable = 0
    seen: set[int] = set()  # tied parameters count once
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.in_features * m.out_features + (m.bias.numel() if m.bias is not None else 0)
            continue
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
                trainable += p.numel() if p.requires_grad else 0
    return {"parameters": total, "trainable": trainable}


def save_model(model: nn.Module, tokenizer, path: str | Path) -> Path:
    """Saves the model (a PEFT model: its adapter) and the tokenizer to ``path``, written under a temporary
    name first and renamed when complete, so a failure never leaves a half-written model directory."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path
