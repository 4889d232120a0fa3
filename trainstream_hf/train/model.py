"""Building the model a recipe trains: random weights from a shipped config, or a local checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["DTYPES", "resolve_device", "build_model"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str) -> torch.device:
    """'auto' -> the current CUDA device when there is one, else the CPU; otherwise ``torch.device(spec)``."""
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={spec!r} but CUDA is not available; use device=cpu or auto")
    return device


def build_model(spec: str, init: str, dtype: str, *, vocab_size: int, seed: int):
    """A causal LM, nothing fetched from a hub.

    Args:
        spec: with ``init="random"``, a JSON file of config kwargs (with ``model_type``) or a directory holding
            config.json; with ``init="pretrained"``, a local model directory.
        init: "random" or "pretrained".
        dtype: a key of ``DTYPES``.
        vocab_size: the tokenizer's size; the model's embedding must cover it.
        seed: seeds the random initialisation.

    Returns:
        The model, on the CPU.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"model: no such file or directory {spec!r}")
    if init == "random":
        if path.is_dir():
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        else:
            kwargs = json.loads(path.read_text())
            if "model_type" not in kwargs:
                raise ValueError(f"model: {spec!r} needs a 'model_type' key (e.g. \"llama\")")
            config = AutoConfig.for_model(**kwargs)
        set_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    elif init == "pretrained":
        if not path.is_dir():
            raise ValueError(f"model: init=pretrained loads a local model directory; {spec!r} is a file "
                             "(use init=random to build from a config file)")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=True)
    else:
        raise ValueError(f"init: 'random' or 'pretrained', got {init!r}")
    n = model.get_input_embeddings().num_embeddings
    if n < vocab_size:
        raise ValueError(f"model: its embedding has {n} rows but the tokenizer has {vocab_size} tokens; raise "
                         "vocab_size in the model config")
    return model
