"""A frozen input embedding whose table lives in pinned host RAM (``wrap(host_embedding=...)``).

Llama-3's input embedding is a 128k x 4096 bf16 table: 1 GiB of device memory of which a LoRA step reads a few
thousand rows. :class:`HostEmbedding` copies the table into pinned host memory and gives the parameter, as its data,
a CUDA tensor over that memory (its device mapping: ``_C.mapped_device_view``). The parameter is then an ordinary
CUDA parameter of the full shape to everything that looks (``model.device``, the embedding's forward, torch.compile
and CUDA graphs, ``state_dict()``), but its bytes are in host RAM: ``nn.Embedding``'s kernel reads the batch's rows
over PCIe (16 MiB for 2048 tokens of a 4096-wide bf16 table), with no copy of the table on the device and no host
synchronisation, and the values are the device table's. Anything that reads the whole table (saving it) reads it
over PCIe too. :meth:`HostEmbedding.close` (``unwrap``) gives the parameter a device copy again.

Which embeddings qualify (:func:`hostable`): exactly ``nn.Embedding`` (a subclass's forward may scale or mix, e.g.
Gemma's), frozen, without ``max_norm`` (its forward renormalises rows in place) or a sparse gradient, and not shared
with another module (a tied output head reads the whole table every step).
"""
from __future__ import annotations

import torch
from torch import nn

HOSTED_ATTR = "_trainstream_host_embedding"


def hostable(model: nn.Module) -> nn.Embedding | None:
    """The model's input embedding when :class:`HostEmbedding` can hold it, else None."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if type(emb) is not nn.Embedding or emb.weight.requires_grad or emb.max_norm is not None or emb.sparse:
        return None
    uses = sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is emb.weight)
    return emb if uses == 1 else None


def map_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the pinned ``host`` tensor's memory (CUDA: its device mapping)."""
    from trainstream_hf import _C

    return _C.mapped_device_view(host, device.index if device.index is not None else torch.cuda.current_device())


class HostEmbedding:
    """Keeps ``module``'s table in pinned host memory, the parameter's data a ``device`` tensor over it. See the
    module docstring."""

    def __init__(self, module: nn.Embedding, device: torch.device, arena=None):
        weight = module.weight
        self.weight, self.device = weight, torch.device(device)
        cuda = self.device.type == "cuda"
        # In the engine's pinned arena, which the plan's host bytes reserved for it (exactly; torch's pinned
        # allocator rounds up to a power of two: 2 GiB for Llama-3's 1 GiB table); else a pinned tensor of its own.
        host = arena.copy_of(weight.detach()) if arena is not None and arena.pinned else None
        if host is None or (cuda and not host.is_pinned()):  # (an exhausted arena's pageable fallback)
            host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=cuda)
            host.copy_(weight.detach())
        self.host = host
        weight.data = map_to_device(host, self.device)  # the device table is freed here
        setattr(weight, HOSTED_ATTR, True)
        self.closed = False

    def close(self) -> None:
        """Gives the parameter a copy of the table on the compute device (where wrap placed every other non-block
        parameter). Idempotent."""
        if self.closed:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # no kernel still reads the pinned table
        self.weight.data = torch.empty_like(self.host, device=self.device).copy_(self.host)
        delattr(self.weight, HOSTED_ATTR)
        self.host = None
        self.closed = True
