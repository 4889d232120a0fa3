"""Baselines the recipes and the benchmarks set beside trainstream: a bitsandbytes NF4 base (QLoRA), built by
replacing a model's linear layers in place. bitsandbytes is not a dependency of the package: it is imported here
only when a baseline asks for it (CUDA only).
"""
from __future__ import annotations

import torch

__all__ = ["quantize_linears_nf4_", "nf4_linear"]


def quantize_linears_nf4_(model, device: torch.device, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replaces every ``nn.Linear`` but the LM head by a bitsandbytes NF4 ``Linear4bit``, one at a time.

    Each bf16 weight is quantized (blocksize 64, double quantization of the absmax statistics, as
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)``
    does) and its module dropped before the next, so the allocator reuses the freed bf16 blocks.
    The model is marked ``is_loaded_in_4bit`` so PEFT dispatches its bnb LoRA layer, as it would for a
    ``from_pretrained(quantization_config=...)`` model.

    Args:
        model: a transformers causal LM on ``device``.
        device: a CUDA device (quantization happens on moving a ``Params4bit`` there).
        compute_dtype: dtype the 4-bit matmuls dequantize to.

    Returns:
        The number of layers replaced.
    """
    head = model.get_output_embeddings()
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    for qualname in targets:
        old = model.get_submodule(qualname)
        new = nf4_linear(old, device, compute_dtype)
        parent, _, child = qualname.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        del old
    model.is_loaded_in_4bit = True
    return len(targets)


def nf4_linear(linear: torch.nn.Linear, device: torch.device,
               compute_dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A frozen bitsandbytes NF4 ``Linear4bit`` of ``linear`` (blocksize 64, double quant), on ``device``.

    The settings of ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype)``; quantization happens when the
    ``Params4bit`` moves to ``device`` (CUDA). ``linear``'s bias tensor is shared, frozen.
    """
    import bitsandbytes as bnb

    new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                            quant_storage=torch.uint8, device="meta")
    new.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=True,
                                   quant_type="nf4", quant_storage=torch.uint8, module=new).to(device)
    if linear.bias is not None:
        new.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
    return new
