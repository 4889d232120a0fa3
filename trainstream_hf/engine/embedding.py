"""A frozen input embedding whose table lives in pinned host RAM (``wrap(host_embedding=...)``).

Llama-3's input embedding is a 128k x 4096 bf16 table: 1 GiB of device memory that a LoRA run only ever reads a few
thousand rows of per step. :class:`HostEmbedding` keeps the table in pinned host memory and replaces the module's
forward by :func:`trainstream_hf.ops.embedding_from_host`, whose CUDA kernel reads each token's row straight from
that memory (mapped into the device's address space): no copy of the table on the device, no host synchronisation,
~16 MiB of PCIe reads for 2048 tokens of a 4096-wide bf16 table. The values are the device table's.

The parameter stays a parameter of the model, on the compute device, with an empty placeholder as its data (as a
paged block's weights: ``model.device``, dtypes and hooks see what they saw). ``state_dict()`` gives the table (the
host tensor itself: no copy) and ``load_state_dict()`` writes into it. :meth:`HostEmbedding.close` (``unwrap``) puts
the table back on the compute device.

Which embeddings qualify (:func:`hostable`): exactly ``nn.Embedding`` (a subclass's forward may scale or mix, e.g.
Gemma's), frozen, without ``max_norm`` (its forward renormalises rows in place) or a sparse gradient, and not shared
with another module (a tied output head reads the whole table every step).
"""
from __future__ import annotations

import torch
from torch import nn

from trainstream_hf import ops

HOSTED_ATTR = "_trainstream_host_embedding"


def hostable(model: nn.Module) -> nn.Embedding | None:
    """The model's input embedding when :class:`HostEmbedding` can hold it, else None."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if type(emb) is not nn.Embedding or emb.weight.requires_grad or emb.max_norm is not None or emb.sparse:
        return None
    uses = sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is emb.weight)
    return emb if uses == 1 else None


class HostEmbedding:
    """Keeps ``module``'s table in host memory (pinned when ``device`` is CUDA) and gathers the rows of each call's ids
    on ``device``. See the module docstring."""

    def __init__(self, module: nn.Embedding, device: torch.device):
        weight = module.weight
        self.module, self.weight, self.device = module, weight, torch.device(device)
        host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(weight.detach())
        self.host = host
        weight.data = torch.empty(0, dtype=weight.dtype, device=self.device)
        setattr(weight, HOSTED_ATTR, True)
        self._had_forward = "forward" in module.__dict__
        self._forward = module.__dict__.get("forward")
        module.forward = self._gather
        # (functions, not bound methods: torch marks a state-dict post-hook with an attribute)
        self._hooks = [module.register_state_dict_pre_hook(lambda *a: self._state_dict_pre(*a)),
                       module.register_state_dict_post_hook(lambda *a: self._state_dict_post(*a)),
                       module.register_load_state_dict_pre_hook(lambda *a: self._load_pre(*a)),
                       module.register_load_state_dict_post_hook(lambda *a: self._load_post(*a))]
        self._loaded: str | None = None
        self._keep_vars: list[bool] = []
        self.closed = False

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def _gather(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Embedding.forward's own name
        return ops.embedding_from_host(input, self.host)

    # -- state dicts: the table itself, not the placeholder ------------------------------------------------------
    def _state_dict_pre(self, module, prefix, keep_vars) -> None:
        self._keep_vars.append(keep_vars)

    def _state_dict_post(self, module, state_dict, prefix, local_metadata) -> None:
        if not self._keep_vars.pop() and prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = self.host

    def _load_pre(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                  error_msgs) -> None:
        key = prefix + "weight"
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            return  # absent (torch reports it missing) or not a tensor (torch reports that)
        del state_dict[key]  # not compared with the placeholder; the post-hook takes it off the missing keys
        self._loaded = key
        if value.shape != self.host.shape:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                              f"the shape in current model is {self.host.shape}.")
            return
        with torch.no_grad():
            self.host.copy_(value)

    def _load_post(self, module, incompatible_keys) -> None:
        key = self._loaded
        if key is not None:
            incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k != key]
            self._loaded = None

    def close(self) -> None:
        """Puts the table back on the compute device as the parameter's data (where wrap placed every other non-block
        parameter) and the module's own forward back. Idempotent."""
        if self.closed:
            return
        for h in self._hooks:
            h.remove()
        if self._had_forward:
            self.module.forward = self._forward
        else:
            del self.module.forward
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # no gather still reads the pinned table
        self.weight.data = self.host.to(self.device, copy=True) if self.device.type != "cpu" else self.host
        delattr(self.weight, HOSTED_ATTR)
        self.host = None
        self.closed = True
