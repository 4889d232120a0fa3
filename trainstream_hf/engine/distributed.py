"""Data parallel: each process wraps its own replica, then torch's DistributedDataParallel reduces gradients.

The order is ``model, opt = wrap(model, opt, ...)`` first, then ``DistributedDataParallel(model, ...)``: DDP
broadcasts, buckets and hooks the parameters as they are when it is built, so it comes after the engine has placed
them (a model loaded in host RAM is placed on the GPU by ``wrap(device=...)``, block by block), and it calls the
wrapped model's forward, where the engine's hooks sit. ``wrap`` refuses a model already inside DDP. When it finds
a default process group of more than one process (``data_parallel="auto"``) it also, through this module:

* refuses ``grads="host"`` and turns ``"auto"`` into ``"device"``. Host mode copies each gradient to the host
  and sets ``p.grad = None`` in a post-accumulate-grad hook, which autograd runs *before* DDP's reducer hook
  on the same accumulator: the reducer then finds no gradient, all-reduces zeros (written back into ``p.grad``
  at the end of backward), and every process steps on its own local gradient while the replicas drift apart
  silently (measured: 6e-3 between two ranks after 3 steps of a tiny Llama). Under DDP host mode would save
  nothing anyway: DDP's buckets hold every trainable gradient on the device for the whole run, and with
  ``gradient_as_bucket_view=True`` ``p.grad`` *is* that bucket. So gradients stay on the device, DDP reduces
  them there (NCCL on GPUs), and ``optimizer.step()`` copies the averaged ones to the host;
* refuses trainable paged parameters (``page_weights`` over blocks that train, e.g. a full fine-tune). DDP
  keeps each trainable parameter's gradient accumulator and bucket from its construction, when a paged
  parameter is an empty placeholder: backward fails (``got [64, 128] but expected shape compatible with
  [0]``), and the buckets would hold the whole gradient on the device, which paging exists to avoid. A frozen
  paged base under trainable adapters (LoRA) is fine: DDP reduces only what trains;
* checks that every process made the same plan for what changes the maths or DDP's view of the model (which
  parameters are paged, which are stepped on the CPU, the gradient mode), since ``vram_budget="auto"`` and
  measured timings may differ between GPUs. A difference is an error, not a hang or a slow drift;
* broadcasts rank 0's values into what DDP's own initial broadcast cannot reach: the host copies of paged
  weights (DDP sees their empty placeholders), and the parameters whose optimizer state is offloaded (their fp32
  masters are read right after, so they must already hold the values DDP would broadcast);
* sends rank 0's frozen parameters itself, as bytes, and has DDP leave every frozen parameter alone
  (:func:`hide_frozen_from_ddp`). DDP's initial broadcast groups the module's tensors by dtype and sends them as
  they are: gloo has no float8, so the codes of a packed base (nf4's absmax, fp8's weights) fail it ("Invalid scalar
  type"), and it would send paged placeholders, which are empty. DDP reduces only what trains, so frozen
  parameters are nothing to it after that first broadcast.
"""
from __future__ import annotations

import atexit
import hashlib
import time
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["process_group", "settle_collectives_at_exit", "check_not_ddp", "check_no_trainable_paged", "check_same_plan", "broadcast_from_rank0",
           "hide_frozen_from_ddp", "restore_ddp_ignore", "DDP_IGNORE"]

# The module attribute DistributedDataParallel reads the names of the parameters and buffers it leaves alone from
# (what its static _set_params_and_buffers_to_ignore_for_model sets; torch 2.x).
DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"


def process_group(data_parallel: str | bool, grads: str):
    """The process group the replicas train in, or None when wrap runs alone.

    Args:
        data_parallel: the config option: ``"auto"`` (an initialized default group of more than one process),
            True (the same, but an uninitialized ``torch.distributed`` is an error) or False (never).
        grads: the config's gradient mode; ``"host"`` is refused under data parallel (module docstring).

    Raises:
        ValueError: ``data_parallel=True`` without an initialized process group, or ``grads="host"``.
    """
    if data_parallel is False:
        return None
    ready = dist.is_available() and dist.is_initialized()
    if not ready:
        if data_parallel is True:
            raise ValueError("data_parallel=True: torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group() before wrap (torchrun and accelerate launch "
                             "set the environment it reads)")
        return None
    if dist.get_world_size() < 2:
        return None
    if grads == "host":
        raise ValueError("grads='host' cannot be used with several processes (DistributedDataParallel): its hook "
                         "moves each local gradient to the host before DDP's reducer sees it, so DDP would average "
                         "zeros and the replicas would drift apart; DDP's buckets keep the gradients on the device "
                         "anyway. Use grads='device' or 'auto' (or data_parallel=False if the processes train "
                         "independent models)")
    settle_collectives_at_exit()
    return dist.group.WORLD


_SETTLE_REGISTERED = False
SETTLE_SECONDS = 0.1


def settle_collectives_at_exit() -> None:
    """Registers, once per process, an exit handler that releases the GIL for :data:`SETTLE_SECONDS` while the
    interpreter is still whole.

    Why: a collective's work object may be freed by the backend's worker thread after the Python side let go of its
    tensors; freeing a tensor whose Python object the C++ side then owns takes the GIL. If the interpreter is already
    finalizing, Python ends that thread inside a C++ destructor and the process aborts with "terminate called without
    an active exception". Seen in 2 of ~76 zero-code runs of two gloo processes (tests/integrations/test_auto.py):
    gdb on the core showed gloo's ``runLoop`` -> ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
    ``pthread_exit`` while the main thread was in ``Py_FinalizeEx``'s garbage collection; pytorch/pytorch PR 179291
    describes the same race, and the same script without trainstream aborts the same way (2 of 6 runs under pytest). A thread waiting for the GIL at exit gets it during this sleep and finishes first. It
    narrows the window rather than closing it (a worker descheduled for longer still races, as in any torch
    program): torch owns the fix.
    """
    global _SETTLE_REGISTERED
    if not _SETTLE_REGISTERED:
        _SETTLE_REGISTERED = True
        atexit.register(_settle)


def _settle() -> None:
    if dist.is_available() and dist.is_initialized():
        time.sleep(SETTLE_SECONDS)


def check_not_ddp(model: nn.Module) -> None:
    """wrap goes inside DDP, not around it."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("wrap: this model is already inside DistributedDataParallel; wrap the model first, then "
                         "build DDP around it: model, opt = trainstream_hf.wrap(model, opt, ...); "
                         "ddp = DistributedDataParallel(model, ...)")


def check_no_trainable_paged(model: nn.Module, paged: Sequence[nn.Parameter]) -> None:
    """Raises ValueError naming ``page_weights`` when a paged parameter trains (module docstring: why)."""
    training = {id(p) for p in paged if p.requires_grad}
    if not training:
        return
    names = [n for n, p in model.named_parameters() if id(p) in training]
    raise ValueError(
        f"page_weights: {len(names)} trainable parameters would be paged ({', '.join(names[:3])}"
        f"{' ...' if len(names) > 3 else ''}), which cannot work under DistributedDataParallel: DDP keeps each "
        "trainable parameter's gradient accumulator and bucket from its construction, when a paged parameter is "
        "an empty placeholder, and its buckets would hold the whole gradient on the device. Page a frozen base "
        "under LoRA adapters, set page_weights=False, or raise min_offload_numel above the trainable tensors' "
        "size so that they stay on the device")


def check_same_plan(summary: dict, device: torch.device, group) -> None:
    """Every process must have planned ``summary`` identically; all ranks raise together when one differs.

    Each field travels as a 64-bit digest in a tensor on the compute device (NCCL moves device memory only), not
    as a pickled object.

    Args:
        summary: field -> value (its ``repr`` is digested): what changes the maths or DDP's view of the model.
        device: the compute device.
        group: the process group.

    Raises:
        ValueError: some process planned differently; names the first differing field and the ranks.
    """
    keys = list(summary)
    mine = torch.tensor([_digest(summary[k]) for k in keys], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    every = [t.tolist() for t in every]
    for rank, digests in enumerate(every):
        for i, key in enumerate(keys):
            if digests[i] != every[0][i]:
                raise ValueError(
                    f"wrap: the plan differs between processes: {key} differs between rank 0 and rank {rank} (here, "
                    f"on rank {dist.get_rank(group)}: {_short(summary[key])}). Every replica must place the same "
                    "parameters the same way; give every process the same options and pin the choices "
                    "(page_weights, offload_optimizer, a fixed vram_budget) rather than 'auto' when the GPUs' free "
                    "memory differs")


def _digest(value) -> int:
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little", signed=True)


def _short(value) -> str:
    if isinstance(value, (list, tuple)) and len(value) > 4:
        return f"[{', '.join(map(repr, value[:4]))}, ... ({len(value)} in all)]"
    return repr(value)


@torch.no_grad()
def broadcast_from_rank0(tensors: Sequence[torch.Tensor], device: torch.device, group,
                         write: Sequence[bool] | None = None) -> None:
    """Overwrites ``tensors`` with rank 0's values, in place.

    Tensors on the compute device go as they are; host tensors (paged weights) are staged through the device
    when it is a GPU (NCCL moves device memory only), one tensor at a time, and sent directly when the compute
    device is the CPU (gloo).

    Args:
        write: per tensor, whether this process writes what it receives (default: all). False for host memory this
            process shares with another that writes it (``peer``, engine/peer.py): it still takes part in the
            collective, into a scratch copy.
    """
    for k, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        keep = write is None or write[k] or dist.get_rank(group) == 0
        direct = t.device.type == device.type and t.is_contiguous() and keep
        buf = t if direct else t.to(device, copy=True, memory_format=torch.contiguous_format)
        # As bytes: the packed formats hold dtypes the backends may not reduce (gloo has no float8), and a
        # broadcast only copies.
        dist.broadcast(buf.reshape(-1).view(torch.uint8), src=0, group=group)
        if buf is not t and keep:
            t.copy_(buf)


def hide_frozen_from_ddp(model: nn.Module, paged: Sequence[nn.Parameter], device: torch.device, group) -> object:
    """Sends rank 0's frozen parameters that are on the device (paged ones went with :func:`broadcast_from_rank0`)
    and adds every frozen parameter's name to the list of what DistributedDataParallel leaves alone (module
    docstring: why).

    Returns:
        The model's previous list (None when it had none), for :func:`restore_ddp_ignore`.
    """
    paged_ids = set(map(id, paged))
    names, resident = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        names.append(name)
        if id(p) not in paged_ids:
            resident.append(p.data)
    broadcast_from_rank0(resident, device, group)
    previous = model.__dict__.get(DDP_IGNORE)
    model.__dict__[DDP_IGNORE] = sorted(set(previous or ()) | set(names))
    return previous


def restore_ddp_ignore(model: nn.Module, previous) -> None:
    """Puts back the list :func:`hide_frozen_from_ddp` replaced."""
    if previous is None:
        model.__dict__.pop(DDP_IGNORE, None)
    else:
        model.__dict__[DDP_IGNORE] = previous
