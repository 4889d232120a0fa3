"""Weight pager: block parameters live in the host arena and visit the device in a ring of slots.

Each paged block's parameters are laid out in one flat host buffer (the arena, or for a frozen block under
``peer`` a view of host memory shared with the other processes of the host, engine/peer.py), so a block travels
as one H2D copy. The device holds ``slots`` flat buffers, each sized for the largest paged block; a resident
block's parameters are views into its slot. A block that is not resident has empty placeholders as
parameter data (``torch.empty(0)``, the ZeRO-3 trick), so it holds no device memory and any use of it
fails loudly instead of reading another block's weights.

Schedule (``P`` = ``prefetch``, at most ``slots - 1``):

* forward, block ``i`` starts: wait (event) for block ``i``, then issue the copies of the next ``P``
  paged blocks into free slots or over the block furthest behind;
* backward, block ``i``'s backward is next: the same in reverse order. Blocks still resident at the end
  of the forward pass are reused, not copied again.

Saved views of paged weights (``F.linear`` saves ``weight.t()``) alias a slot that a later block will
overwrite. :meth:`WeightPager.pack` (first in line in the shared pack hook) turns any saved tensor that
aliases a resident slot into a reference ``(param, size, stride, offset)``; unpack makes the block
resident again and returns ``param.data.as_strided(...)``: never a copy, never stale.

When is a slot's occupant done? In forward, every kernel of block ``j < i`` was enqueued before block
``i`` starts. In backward, autograd runs the ready node with the highest sequence number first, and every
node of block ``j > i`` (AccumulateGrad included) was created after every node of block ``i``, so block
``j``'s backward (which may need the real parameter shape) has run on the host before block ``i``'s begins.
On the device, the copy into a slot waits for all work queued so far on the compute stream
(``TransferStreams.to_device(out=..., after=None)``), which includes every kernel reading the old occupant.

Every paged parameter carries the attribute :data:`PAGED_ATTR` (True) while the pager holds it: its storage is a
transient slot, so code that would keep something derived from a weight on the device (QuantLinear's transposed FP8
codes, trainstream_hf/quant/linear.py) keeps nothing for it.

Trainable paged parameters get their ``.grad`` on the device as usual (AccumulateGrad runs while the
block is resident). Their values live on the host: an optimizer writes updated weights into
:meth:`WeightPager.host_tensor`, and blocks with trainable parameters are copied again at the next step
(their device copy is dropped at every ``step_start``, or on :meth:`WeightPager.invalidate`).

So a paged parameter's ``data`` is never its value to read (a placeholder, or a slot holding the weights of before
the last optimizer step): :meth:`WeightPager.track_state_dict` makes ``state_dict()`` give the host copies and
``load_state_dict()`` write them, which is what checkpoints (the Trainer's, ``save_pretrained``) go through.
"""
from __future__ import annotations

import bisect
import warnings
import weakref
from typing import Callable, Iterable

import torch
from torch import nn

from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.hooks import BlockHooks, BlockListener, is_dense
from trainstream_hf.engine.streams import Transfer, TransferStreams
from trainstream_hf.quant.linear import PAGED_ATTR  # the attribute set True on each paged parameter (unwrap removes it)

__all__ = ["WeightPager", "PAGED_ATTR"]

# Offset alignment of each parameter in a slot: keeps every parameter at least as aligned as a fresh
# device allocation would be (kernels may pick paths by alignment, and bit-exactness must not depend on it).
_ALIGN = 256


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Block:
    """Layout of one paged block: its parameters, their byte offsets, and the flat host buffer."""

    __slots__ = ("index", "params", "offsets", "nbytes", "host_flat", "host", "trainable", "views")

    def __init__(self, index: int, params: list[nn.Parameter], arena: HostArena,
                 buffer: torch.Tensor | None = None, fill: bool = True):
        self.index = index
        self.params = params
        self.offsets, self.nbytes = _layout(params)
        if buffer is not None and buffer.numel() < self.nbytes:
            raise ValueError(f"WeightPager: the host buffer given for block {index} holds {buffer.numel()} bytes, "
                             f"its parameters need {self.nbytes}")
        self.host_flat = buffer if buffer is not None else arena.empty((max(self.nbytes, 1),), torch.uint8)
        self.host = [_typed_view(self.host_flat, o, p) for o, p in zip(self.offsets, params)]
        if fill:
            for h, p in zip(self.host, params):
                h.copy_(p.data)
        self.trainable = any(p.requires_grad for p in params)
        self.views: dict[int, list[torch.Tensor]] = {}  # slot -> views of the parameters in that slot


def _layout(params: list[nn.Parameter]) -> tuple[list[int], int]:
    """Byte offsets of ``params`` in a block's flat buffer, and its size."""
    offsets, off = [], 0
    for p in params:
        off = _align(off)
        offsets.append(off)
        off += p.numel() * p.element_size()
    return offsets, off


def block_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of the flat host buffer of a block paging ``params`` (the pager's layout)."""
    return _layout(params)[1]


def select_params(hooks: BlockHooks, blocks: Iterable[int], device: torch.device,
                  param_filter: Callable[[str, nn.Parameter], bool] | None = None
                  ) -> tuple[dict[int, list[nn.Parameter]], list[str]]:
    """The parameters :class:`WeightPager` pages in each of ``blocks`` (those it keeps), and the names of those
    it leaves on the device because they are shared beyond their block (tied weights).

    Raises:
        ValueError: a block index out of range, or a parameter neither on the host nor on ``device``.
    """
    chosen = sorted(set(blocks))
    if any(not 0 <= i < len(hooks) for i in chosen):
        raise ValueError(f"WeightPager: block indices must be in [0, {len(hooks)}), got {chosen}")
    uses: dict[int, int] = {}
    root = hooks.blocks.model if hooks.blocks is not None else None
    for m in ([root] if root is not None else hooks.layers):
        for _, p in m.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    selected, skipped = {}, []
    for i in chosen:
        params = []
        for name, p in hooks.layers[i].named_parameters():
            if param_filter is not None and not param_filter(name, p):
                continue
            if uses.get(id(p), 0) > 1:
                skipped.append(f"block {i}: {name}")
                continue
            if p.device not in (device, torch.device("cpu")):
                raise ValueError(f"WeightPager: block {i} parameter {name} is on {p.device}; paged "
                                 f"parameters must be on the host or on the compute device {device}")
            params.append(p)
        if params:
            selected[i] = params
    return selected, skipped


def _typed_view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of ``flat`` (uint8) at byte ``offset`` with ``like``'s dtype, shape and (dense) strides."""
    nbytes = like.numel() * like.element_size()
    typed = flat[offset:offset + nbytes].view(like.dtype)
    if is_dense(like):
        return typed.as_strided(like.shape, like.stride(), typed.storage_offset())
    return typed.view(like.shape)  # overlapping or gapped parameters are stored contiguously


class _WeightRef:
    """A saved tensor that aliases a paged parameter: where it sits relative to ``param.data``."""

    __slots__ = ("block", "param", "size", "stride", "offset")

    def __init__(self, block: int, param: nn.Parameter, size, stride, offset: int):
        self.block = block
        self.param = param
        self.size = size
        self.stride = stride
        self.offset = offset


class WeightPager(BlockListener):
    """Keeps the parameters of the chosen blocks on the host and streams them to the device.

    Args:
        hooks: the model's :class:`BlockHooks` (shared with the activation offloader).
        streams: transfer streams of the compute device (``cpu`` copies synchronously).
        arena: host arena holding the parameters.
        blocks: indices of the blocks to page (default: all).
        slots: device slots ``S`` (>= 1), each sized for the largest paged block.
        prefetch: blocks copied ahead ``P``, ``0 <= P <= S - 1``.
        param_filter: ``(qualified name within the block, parameter) -> bool``; parameters it rejects
            (e.g. small trainable LoRA weights) stay on the device. Default: all parameters.
        refresh_trainable: drop the device copies of blocks with trainable parameters at every step start
            (an optimizer has written their host copies). False when the caller calls :meth:`invalidate`
            after each optimizer step instead (gradient accumulation then reuses resident blocks).
        host_buffers: block -> uint8 host buffer (at least :func:`block_bytes` long) to hold that block instead
            of the arena: the shared host memory of ``peer`` (``engine/peer.py``).
        fill_host_buffers: copy the parameters into ``host_buffers``; False in the processes that map a buffer
            another process fills (their own copies are freed unread).

    Parameters shared with anything outside their block (tied weights) are not paged.
    """

    needed_when_compiled = True  # a paged block's weights must be fetched before it runs

    pack_priority = 0

    def __init__(self, hooks: BlockHooks, streams: TransferStreams, arena: HostArena, *,
                 blocks: Iterable[int] | None = None, slots: int = 2, prefetch: int = 1,
                 param_filter: Callable[[str, nn.Parameter], bool] | None = None,
                 refresh_trainable: bool = True, host_buffers: dict[int, torch.Tensor] | None = None,
                 fill_host_buffers: bool = True):
        if slots < 1:
            raise ValueError(f"WeightPager: slots must be >= 1, got {slots}")
        if not 0 <= prefetch <= slots - 1:
            raise ValueError(f"WeightPager: prefetch must be in [0, slots - 1] = [0, {slots - 1}] (a prefetched "
                             f"block needs a slot of its own besides the running one), got {prefetch}")
        self.hooks = hooks
        self.streams = streams
        self.device = streams.device
        self.num_slots = slots
        self.prefetch = prefetch
        self.refresh_trainable = refresh_trainable
        selected, skipped = select_params(hooks, range(len(hooks)) if blocks is None else blocks, self.device,
                                          param_filter)
        host_buffers = host_buffers or {}
        self._blocks: dict[int, _Block] = {}
        self._origin: dict[int, list[torch.device]] = {}
        unfilled = []  # blocks whose buffer another process fills: their originals go once every block is laid out
        for i, params in selected.items():
            fill = fill_host_buffers or i not in host_buffers
            try:
                self._blocks[i] = blk = _Block(i, params, arena, host_buffers.get(i), fill=fill)
            except BaseException:
                self._restore_partial()
                raise
            self._origin[i] = [p.device for p in blk.params]
            if not fill:
                unfilled.append(blk)
                continue
            # Free each block's original as soon as it has a host copy, so that paging a model that
            # sits in (pageable) host RAM needs one block of headroom, not a second copy of the model.
            for p in blk.params:
                _mark(p)
                p.data = self._placeholder(p)
        for blk in unfilled:
            for p in blk.params:
                _mark(p)
                p.data = self._placeholder(p)
        if skipped:
            warnings.warn(f"WeightPager: {len(skipped)} parameters are shared beyond their block and stay on "
                          f"the device: {', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''}",
                          RuntimeWarning, stacklevel=2)
        self._host_of = {id(p): h for b in self._blocks.values() for p, h in zip(b.params, b.host)}
        self._order = sorted(self._blocks)
        self._pos = {j: k for k, j in enumerate(self._order)}
        self.slot_bytes = max((b.nbytes for b in self._blocks.values()), default=0)
        self._slots = [torch.empty(max(self.slot_bytes, 1), dtype=torch.uint8, device=self.device)
                       for _ in range(slots if self._blocks else 0)]
        self._slot_ptr = {s.untyped_storage().data_ptr(): k for k, s in enumerate(self._slots)}
        self._occupant: list[int | None] = [None] * len(self._slots)
        self._slot_of: dict[int, int] = {}
        self._pending: dict[int, Transfer] = {}   # issued copies not yet waited on by the compute stream
        self._loaded_in: dict[int, str] = {}      # block -> phase that loaded it ("forward"/"backward")
        self._phase = "forward"
        self._current: int | None = None
        self._stats = {"h2d_bytes": 0, "h2d_copies": 0, "loads_forward": 0, "loads_backward": 0,
                       "reused_backward": 0, "weight_refs": 0}
        self._module_hooks: list = []  # handles of the state-dict hooks (track_state_dict)
        self._optimizer = None  # weakref to the optimizer whose masters track the host copies (track_state_dict)
        self._state_dict_calls: dict[int, bool] = {}  # id(block module) -> keep_vars of the state_dict() under way
        self._loading: dict[int, tuple[list[str], list[nn.Parameter]]] = {}  # id(block module) -> keys taken, loaded
        self.closed = False
        hooks.add(self)

    # -- public ---------------------------------------------------------------------------------
    @property
    def paged_blocks(self) -> list[int]:
        return list(self._order)

    def paged_parameters(self) -> list[nn.Parameter]:
        return [p for j in self._order for p in self._blocks[j].params]

    def host_tensor(self, param: nn.Parameter) -> torch.Tensor:
        """The host (arena) copy of a paged parameter, with its true shape and strides.

        It is the parameter's value: an optimizer writes updated weights here, after :meth:`wait_copies`
        (or an event ordered after the block's last copy). Blocks with trainable parameters are copied to
        the device afresh at every step (``refresh_trainable``); call :meth:`invalidate` after writing
        other ones.
        """
        host = self._host_of.get(id(param))
        if host is None:
            raise KeyError("WeightPager.host_tensor: this parameter is not paged")
        return host

    def wait_copies(self) -> None:
        """Blocks the host until every issued H2D copy has read its host buffer (before host writes)."""
        if self.streams.is_cuda:
            self.streams.h2d.synchronize()

    def is_resident(self, block: int) -> bool:
        return block in self._slot_of

    def invalidate(self, blocks: Iterable[int] | None = None) -> None:
        """Drops the device copies of ``blocks`` (default: all) so the next use copies the host values."""
        for j in list(self._slot_of if blocks is None else blocks):
            if j in self._slot_of:
                self._evict(j)

    def counters(self) -> dict:
        """The cumulative counters of :meth:`stats` alone (the engine reports their growth per step)."""
        return dict(self._stats)

    def stats(self) -> dict:
        """Cumulative counters: H2D bytes and copies, block loads in forward / backward, blocks found
        resident from the forward pass when their backward began (not copied again), saved tensors packed
        as weight references, plus the layout."""
        return dict(self._stats, slots=len(self._slots), slot_bytes=self.slot_bytes, prefetch=self.prefetch,
                    paged_blocks=len(self._order),
                    paged_bytes=sum(b.nbytes for b in self._blocks.values()))

    def unwrap(self) -> None:
        """Gives every paged parameter back as an ordinary device tensor holding its host value, and
        detaches from the hooks. Idempotent."""
        if self.closed:
            return
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        self.hooks.discard(self)
        if self.streams.is_cuda:
            # Copies still in flight write into slots that are about to be freed on the compute stream.
            torch.cuda.current_stream(self.device).wait_stream(self.streams.h2d)
        for b in self._blocks.values():
            for p, h in zip(b.params, b.host):
                out = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=self.device)
                out.copy_(h)
                p.data = out
                _unmark(p)
            # Release the host copy and the cached slot views (they would keep the slots alive).
            b.host, b.host_flat, b.views = [], None, {}
        self._host_of = {}
        self._slots, self._slot_ptr, self._occupant = [], {}, []
        self._slot_of.clear()
        self._pending.clear()
        self.closed = True

    close = unwrap

    # -- state dicts ----------------------------------------------------------------------------
    def track_state_dict(self, root: nn.Module, optimizer=None) -> None:
        """Makes ``state_dict()`` and ``load_state_dict()`` deal in the paged parameters' values, their host copies.

        * ``state_dict()`` of ``root`` (or of any module holding a paged block) first waits for ``optimizer``'s step
          (``synchronize()``: an overlapped step's updates are all in), then gives each paged parameter as a view of
          its host copy: no copy, live as torch's detached parameters are, and with a storage of its own, so that
          safetensors and ``save_pretrained`` do not take the parameters of one flat buffer for tied weights.
          ``keep_vars=True`` keeps the parameters themselves.
        * ``load_state_dict()`` writes the values given for paged parameters into their host copies (a shape that
          does not fit is reported as torch reports any size mismatch: the parameter's name and both shapes), drops
          the device copies of their blocks, and has ``optimizer`` read their fp32 masters again. (The root's own
          hooks, which do the same for every offloaded parameter a load into the model reaches, are ``wrap``'s.)

        Args:
            root: the wrapped model, whose blocks hold the paged parameters.
            optimizer: the engine's :class:`~trainstream_hf.engine.optimizer.OffloadedAdamW` holding masters of
                paged parameters, or None.

        :meth:`unwrap` removes the hooks; a second call replaces them.
        """
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        for j in self._order:
            module = self.hooks.layers[j]
            names = {id(p): n for n, p in module.named_parameters()}
            entries = [(names[id(p)], k) for k, p in enumerate(self._blocks[j].params)]
            self._module_hooks += [
                module.register_state_dict_pre_hook(_weakly(self._state_dict_pre)),
                module.register_state_dict_post_hook(_weakly(self._state_dict_post, j, entries)),
                module.register_load_state_dict_pre_hook(_weakly(self._load_pre, j, entries)),
                module.register_load_state_dict_post_hook(_weakly(self._load_post, j))]

    def _sync_optimizer(self) -> None:
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is not None:
            opt.synchronize()

    def _state_dict_pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._sync_optimizer()
        self._state_dict_calls[id(module)] = keep_vars

    def _state_dict_post(self, j: int, entries, module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
        if self._state_dict_calls.pop(id(module), False) or self.closed:
            return  # keep_vars=True: the caller asked for the parameters themselves
        b = self._blocks[j]
        for name, k in entries:
            key = prefix + name
            if key in state_dict:
                state_dict[key] = _own_storage_view(b.host_flat, b.offsets[k], b.host[k])

    def _load_pre(self, j: int, entries, module: nn.Module, state_dict, prefix, local_metadata, strict,
                  missing_keys, unexpected_keys, error_msgs) -> None:
        # Taken out of the dict, so torch's own loading neither compares them with the placeholders nor copies into a
        # slot; the post-hook takes them off the missing keys again.
        self._sync_optimizer()
        self.wait_copies()  # no copy in flight still reads a host buffer written below
        b = self._blocks[j]
        taken, loaded = [], []
        for name, k in entries:
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor):
                continue  # absent (torch reports it missing) or not a tensor (torch reports that)
            del state_dict[key]
            taken.append(key)
            host = b.host[k]
            if value.shape != host.shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                                  f"the shape in current model is {host.shape}.")
                continue
            with torch.no_grad():
                host.copy_(value)
            loaded.append(b.params[k])
        self._loading[id(module)] = (taken, loaded)

    def _load_post(self, j: int, module: nn.Module, incompatible_keys) -> None:
        taken, loaded = self._loading.pop(id(module), ((), ()))
        if taken:
            gone = set(taken)
            incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in gone]
        if loaded:
            self.invalidate([j])
            opt = self._optimizer() if self._optimizer is not None else None
            if opt is not None:
                opt.reload_masters(loaded)

    # -- listener -------------------------------------------------------------------------------
    def step_start(self) -> None:
        self._phase, self._current = "forward", None
        if self.refresh_trainable:  # the optimizer may have written new values into their host copies
            self.invalidate([j for j in self._slot_of if self._blocks[j].trainable])

    def forward_start(self, i: int) -> None:
        self._phase = "forward"
        self._visit(i, ahead=self._order[self._pos[i] + 1:] if i in self._blocks else [])

    def backward_start(self, i: int) -> None:
        self._phase = "backward"
        self._visit(i, ahead=self._order[:self._pos[i]][::-1] if i in self._blocks else [])

    def recompute_start(self, i: int) -> None:
        if i in self._blocks:
            self._make_ready(i, protect={i, self._current})

    def pack(self, i: int, tensor: torch.Tensor):
        if not self._slot_ptr or tensor.device != self.device or tensor.layout != torch.strided:
            return None
        slot = self._slot_ptr.get(tensor.untyped_storage().data_ptr())
        if slot is None:
            return None
        j = self._occupant[slot]
        if j is None:
            raise RuntimeError("WeightPager: a saved tensor aliases an empty slot (a paged weight used after "
                               "its block left the device)")
        b = self._blocks[j]
        byte = tensor.storage_offset() * tensor.element_size()
        k = bisect.bisect_right(b.offsets, byte) - 1
        p = b.params[k] if k >= 0 else None
        if p is None or tensor.dtype != p.dtype or byte >= b.offsets[k] + b.host[k].numel() * b.host[k].element_size():
            # Aliases the slot under another dtype: rare; a device copy is correct, if not free.
            return _Kept(tensor.detach().clone(memory_format=torch.preserve_format))
        self._stats["weight_refs"] += 1
        return _WeightRef(j, p, tensor.size(), tensor.stride(), tensor.storage_offset() - p.storage_offset())

    def unpack(self, ref) -> torch.Tensor:
        if isinstance(ref, _Kept):
            return ref.tensor
        if not self.closed:
            self._make_ready(ref.block, protect={ref.block, self._current})
        data = ref.param.data
        return data.as_strided(ref.size, ref.stride, data.storage_offset() + ref.offset)

    # -- residency ------------------------------------------------------------------------------
    def _visit(self, i: int, ahead: list[int]) -> None:
        if i not in self._blocks:
            return
        self._current = i
        self._make_ready(i, protect={i})
        protect = {i}
        for j in ahead[:self.prefetch]:
            protect.add(j)
            self._load(j, protect)

    def _make_ready(self, j: int, protect: set) -> None:
        self._load(j, protect)
        transfer = self._pending.pop(j, None)
        if transfer is not None:
            transfer.wait()  # the compute stream waits for the copy's event; no host sync

    def _load(self, j: int, protect: set) -> None:
        if j in self._slot_of:
            if self._phase == "backward" and self._loaded_in.get(j) == "forward":
                self._stats["reused_backward"] += 1
                self._loaded_in[j] = "backward"
            return
        b = self._blocks[j]
        slot = self._pick_slot(protect)
        victim = self._occupant[slot]
        if victim is not None:
            self._evict(victim)
        views = b.views.get(slot)
        if views is None:
            views = b.views[slot] = [_typed_view(self._slots[slot], o, h) for o, h in zip(b.offsets, b.host)]
        for p, v in zip(b.params, views):
            p.data = v
        # after=None: the H2D stream first waits for everything queued on the compute stream so far,
        # which includes every kernel that reads the slot's previous occupant.
        self._pending[j] = self.streams.to_device(b.host_flat[:b.nbytes], out=self._slots[slot][:b.nbytes])
        self._occupant[slot] = j
        self._slot_of[j] = slot
        self._loaded_in[j] = self._phase
        self._stats["h2d_bytes"] += b.nbytes
        self._stats["h2d_copies"] += 1
        self._stats["loads_" + self._phase] += 1

    def _pick_slot(self, protect: set) -> int:
        free = [s for s, j in enumerate(self._occupant) if j is None]
        if free:
            return free[0]
        victims = [s for s, j in enumerate(self._occupant) if j not in protect]
        if not victims:
            raise RuntimeError(f"WeightPager: all {len(self._slots)} slots hold blocks in use {sorted(protect)}; "
                               "raise slots")
        # Evict the block furthest behind in the current direction: it is needed last.
        if self._phase == "forward":
            return min(victims, key=lambda s: self._occupant[s])
        return max(victims, key=lambda s: self._occupant[s])

    def _evict(self, j: int) -> None:
        slot = self._slot_of.pop(j)
        self._occupant[slot] = None
        self._pending.pop(j, None)  # a later copy into this slot is queued behind it on the H2D stream
        self._loaded_in.pop(j, None)
        for p in self._blocks[j].params:
            p.data = self._placeholder(p)

    def _restore_partial(self) -> None:
        """Construction failed: the blocks already paged get their values back where they came from."""
        for i, blk in self._blocks.items():
            for p, h, dev in zip(blk.params, blk.host, self._origin.get(i, [])):
                if p.data.shape != h.shape:  # a placeholder (not one still holding its original: kept)
                    p.data = h.to(dev, copy=True)
                _unmark(p)
        self._blocks.clear()

    def _placeholder(self, p: nn.Parameter) -> torch.Tensor:
        return torch.empty(0, dtype=p.dtype, device=self.device)


def _weakly(method, *bound):
    """A module hook calling the bound ``method`` (with ``bound`` first) through a weak reference to its object: the
    model's hook dicts must not keep the pager alive."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        m = ref()
        if m is not None:
            m(*bound, *args)
    return hook


def _own_storage_view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``flat`` (uint8, host) at ``offset`` that hold ``like``, as a tensor with ``like``'s dtype, shape
    and strides, no copy, over a storage of its own that starts there (a view of ``flat`` would share ``flat``'s
    storage, which ``save_pretrained`` and safetensors read as tied weights)."""
    nbytes = like.numel() * like.element_size()
    if nbytes == 0:
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype)
    # numpy's slice keeps ``flat`` alive; from_numpy wraps exactly those bytes in a new storage
    raw = torch.from_numpy(flat.numpy()[offset:offset + nbytes])
    return _typed_view(raw, 0, like)


def _mark(p: nn.Parameter) -> None:
    """Marks ``p`` paged before its data becomes a placeholder. ``ds_numel`` (ZeRO-3's attribute for the same trick)
    keeps its true size where counts of a model's parameters look for it: PEFT's ``print_trainable_parameters``, and
    transformers' ``num_parameters()`` as the engine wraps it (wrap.py)."""
    setattr(p, PAGED_ATTR, True)
    p.ds_numel = p.numel()


def _unmark(p: nn.Parameter) -> None:
    if getattr(p, PAGED_ATTR, False):
        delattr(p, PAGED_ATTR)
        p.__dict__.pop("ds_numel", None)


class _Kept:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
