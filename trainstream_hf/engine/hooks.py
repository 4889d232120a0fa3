"""Block hooks: the one place that watches blocks run and owns the saved-tensor hooks.

Weight paging and activation offload both need (a) to know when block ``i`` starts and ends its forward
and when its backward is about to need it, and (b) to see every tensor autograd saves inside block ``i``.
(b) goes through ``torch.autograd.graph.saved_tensors_hooks``, of which only the innermost context acts,
so the two cannot each push their own: :class:`BlockHooks` pushes ONE context per block call and its pack
asks the listeners in ``pack_priority`` order (the weight pager first: a saved view of a paged weight must
become a reference, never a copy; then the activation offloader). A tensor nobody claims goes to the
context that was innermost before ours (if any), else is kept as is.

Signals (methods of :class:`BlockListener`):

* ``step_start()`` - block 0's forward begins outside backward: a new step. Listeners reset per-step
  state here, which is also how an exception in the previous forward/backward is recovered from.
* ``forward_start(i)`` / ``forward_end(i)`` - around block ``i``'s forward (module pre-/post-hooks).
* ``backward_start(i)`` - the gradient of block ``i``'s output is ready, so block ``i``'s backward nodes
  (and its recomputation, under checkpointing) run next. A tensor hook on the block's outputs, fired
  once per backward pass (graph task).
* ``recompute_start(i)`` - block ``i``'s forward runs again inside backward (checkpoint recomputation)
  with the module hooks inside the checkpoint.

Gradient checkpointing (non-reentrant ``torch.utils.checkpoint``, what transformers uses):

* transformers 5.24 (the dev environment) checkpoints ``forward`` inside ``GradientCheckpointingLayer``
  (module hooks stay outside). Forward: our context is pushed first, so the checkpoint's saved inputs
  (the block's input hidden states) are packed by us (offloadable); the checkpoint's own context is
  innermost inside and keeps only placeholders. Backward: ``backward_start(i)`` fires, then the first
  unpack recomputes the block under the checkpoint's recomputation context (innermost, our hooks not
  involved). Its saved tensors, views of the paged weights included, are held by the checkpoint until
  block ``i``'s backward has used them; the pager keeps block ``i`` resident at least that long.
* Older transformers (4.x checkpoints ``__call__``) and ``checkpoint(block, ...)`` run the module hooks
  inside the checkpoint. Forward: the checkpoint's context is already innermost when our pre-hook runs,
  so we do NOT push ours (that would steal the tensors the checkpoint discards). Recompute (detected by
  running inside a graph task): we push nothing and send ``recompute_start(i)`` so weights are resident;
  the checkpoint gets the tensors. Its saved inputs were packed outside the block, so they are not
  offloaded.
* Reentrant checkpointing runs the forward without grad (nothing saved, no output hook), so the
  recompute's pre-hook also sends ``backward_start(i)`` (once per graph task, like the output hook).

Either way the values autograd uses are those of the original forward, so results are bit-exact.

Two private torch functions are read (nothing is patched): ``torch._C._current_graph_task_id`` (also
used by torch.utils.checkpoint) and ``torch._C._autograd._top_saved_tensors_default_hooks``; both exist
from torch 2.2 through 2.13.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from trainstream_hf.engine.blocks import Blocks

__all__ = ["BlockHooks", "BlockListener", "in_backward", "is_dense"]


def in_backward() -> bool:
    """True while the current thread runs an autograd graph task (a backward pass, or a recomputation
    triggered from one)."""
    return torch._C._current_graph_task_id() != -1


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill a contiguous memory range exactly once, in any dimension order
    (what ``torch.empty_strided`` can reproduce and one flat copy can move)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda ss: ss[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _top_hooks() -> tuple[Callable, Callable] | None:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _checkpoint_on_top() -> bool:
    top = _top_hooks()
    return top is not None and getattr(top[0], "__module__", None) == "torch.utils.checkpoint"


class BlockListener:
    """Base class of what :class:`BlockHooks` notifies; every method is optional (no-op here).

    ``pack`` returns a payload to claim a saved tensor (``unpack`` gets it back in backward) or None to
    leave it to the next listener.
    """

    #: lower packs first
    pack_priority: int = 100
    #: a no-grad forward traced by torch.compile (a compiled generation step) skips the block hooks, unless a listener
    #: must act there (weight paging) and sets this
    needed_when_compiled: bool = False

    def step_start(self) -> None:
        pass

    def forward_start(self, i: int) -> None:
        pass

    def forward_end(self, i: int) -> None:
        pass

    def backward_start(self, i: int) -> None:
        pass

    def recompute_start(self, i: int) -> None:
        pass

    def pack(self, i: int, tensor: torch.Tensor) -> Any | None:
        return None

    def unpack(self, payload: Any) -> torch.Tensor:
        raise NotImplementedError


class _Packed:
    """A saved tensor claimed by ``owner`` (a listener, or None for the outer context's hooks)."""

    __slots__ = ("owner", "payload")

    def __init__(self, owner, payload):
        self.owner = owner
        self.payload = payload


class _Frame:
    __slots__ = ("block", "ctx", "pack", "recompute")

    def __init__(self, block: int, ctx=None, pack=None, recompute: bool = False):
        self.block = block
        self.ctx = ctx
        self.pack = pack
        self.recompute = recompute


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, dict):  # transformers ModelOutput is a dict
        for o in output.values():
            yield from _tensors(o)


# torch._dynamo.disable of a call-through (made by BlockHooks.keep_out_of_enclosing_compile, not at import: dynamo is
# heavy to import): a call to it from code dynamo traces breaks the graph there and runs the call eagerly, nested
# torch.compile regions included.
_EAGERLY: Callable | None = None


def forward_outside_compile(inner: Callable, *args, **kwargs):
    """A block's ``forward`` (``inner``) kept out of an enclosing torch.compile (wrap installs it beside
    :meth:`BlockHooks.keep_out_of_enclosing_compile`)."""
    if torch.compiler.is_compiling():
        return _EAGERLY(inner, *args, **kwargs)
    return inner(*args, **kwargs)


class BlockHooks:
    """One forward pre-hook / forward hook pair per block, shared by every engine component.

    Args:
        blocks: the blocks in forward order (:class:`Blocks` or a sequence of modules); block ``i`` is the
            ``i``-th.
    """

    def __init__(self, blocks: Blocks | Sequence[nn.Module]):
        self.blocks = blocks if isinstance(blocks, Blocks) else None
        self.layers: tuple[nn.Module, ...] = tuple(blocks)
        if not self.layers:
            raise ValueError("BlockHooks: no blocks given")
        self.steps = 0
        self._listeners: list[BlockListener] = []
        self._packs = False  # whether a listener takes saved tensors (else no saved-tensor hooks are pushed)
        self._frames: list[_Frame] = []
        self._backward_seen: dict[int, int] = {}
        self._outside_compile = False  # keep_out_of_enclosing_compile
        self._handles = []
        for i, m in enumerate(self.layers):
            self._handles.append(m.register_forward_pre_hook(functools.partial(self._pre, i)))
            # always_call: the context pushed by the pre-hook is popped even when the block raises.
            self._handles.append(m.register_forward_hook(functools.partial(self._post, i), always_call=True))

    def __len__(self) -> int:
        return len(self.layers)

    # -- listeners ------------------------------------------------------------------------------
    def add(self, listener: BlockListener) -> None:
        """Registers ``listener``; packs are offered in ascending ``pack_priority``."""
        if self._handles == []:
            raise RuntimeError("BlockHooks.add: the hooks were removed")
        if listener not in self._listeners:
            self._listeners.append(listener)
            self._listeners.sort(key=lambda l: l.pack_priority)
        self._packs = self._any_packs()

    def discard(self, listener: BlockListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)
        self._packs = self._any_packs()

    def _any_packs(self) -> bool:
        return any(type(l).pack is not BlockListener.pack for l in self._listeners)

    @property
    def listeners(self) -> tuple[BlockListener, ...]:
        return tuple(self._listeners)

    def remove(self) -> None:
        """Uninstalls the module hooks and forgets the listeners (close those first)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._listeners = []
        self._packs = False
        self._recover()

    def keep_out_of_enclosing_compile(self, on: bool = True) -> None:
        """Makes the hooks run as without torch.compile when a torch.compile of the whole model (``torch.compile(
        model)``, the Trainer's ``torch_compile=True``, a compiled ``generate``) traces them: dynamo breaks the graph
        there. With each block's ``forward`` wrapped in :func:`forward_outside_compile` (the caller installs it, last
        of the forwards' wrappers), the whole block call stays out of the enclosing graph, which compiles what lies
        between (embedding, head, loss), while the block runs eagerly, or as its own compiled region with
        ``compile_blocks``. For paged weights: the pager swaps a parameter's ``data`` between an empty placeholder and
        a device slot, which a traced graph (its fake tensors, its saved weights) cannot follow."""
        global _EAGERLY
        if on and _EAGERLY is None:
            import torch._dynamo

            _EAGERLY = torch._dynamo.disable(lambda fn, *args, **kwargs: fn(*args, **kwargs), recursive=True)
        self._outside_compile = on

    # -- module hooks ---------------------------------------------------------------------------
    def _pre(self, i: int, module: nn.Module, args) -> None:
        if self._outside_compile and torch.compiler.is_compiling():
            return _EAGERLY(self._pre, i, module, args)
        if self._stand_aside():
            return
        if in_backward():
            # Checkpoint recomputation with the module hooks inside the checkpoint: its context must stay
            # innermost, so we only make sure the weights are there. Reentrant checkpointing ran the forward
            # without grad, so no output hook announced this block's backward: announce it here.
            self._on_grad(i, None)
            for listener in self._listeners:
                listener.recompute_start(i)
            self._frames.append(_Frame(i, recompute=True))
            return
        if i == 0:
            self._recover()
            self.steps += 1
            self._backward_seen.clear()
            for listener in self._listeners:
                listener.step_start()
        ctx = pack = None
        # Saved-tensor hooks only where a listener takes saved tensors (weight paging, activation offload): a Python
        # call per saved tensor otherwise buys nothing (~2500 per step of a 32-layer LoRA model).
        if self._packs and torch.is_grad_enabled() and not _checkpoint_on_top():
            outer = _top_hooks()
            pack = functools.partial(self._pack, i, outer)
            ctx = torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)
        # Listeners run before the context is pushed, so one raising leaves nothing pushed behind.
        for listener in self._listeners:
            listener.forward_start(i)
        if ctx is not None:
            ctx.__enter__()
        self._frames.append(_Frame(i, ctx, pack))

    def _stand_aside(self) -> bool:
        """A no-grad forward traced by torch.compile (generation with a static cache, replayed as CUDA graphs): the
        hooks would run once, at tracing, not at each replay, and with nothing saved and every weight on the device
        they have nothing to do, so they stay out of the graph. With a pager they are traced as before (dynamo breaks
        the graph around what it cannot trace, and that part runs eagerly at every call)."""
        return torch.compiler.is_compiling() and not torch.is_grad_enabled() and \
            not any(listener.needed_when_compiled for listener in self._listeners)

    def _post(self, i: int, module: nn.Module, args, output) -> None:
        if self._outside_compile and torch.compiler.is_compiling():
            return _EAGERLY(self._post, i, module, args, output)
        if self._stand_aside():
            return  # (see _pre)
        if not self._frames or self._frames[-1].block != i:
            return  # our pre-hook did not finish (something before it raised): nothing to undo
        frame = self._frames.pop()
        if frame.ctx is not None:
            frame.ctx.__exit__(None, None, None)
        if frame.recompute or output is None:  # output None: the block raised
            return
        if torch.is_grad_enabled():
            hook = functools.partial(self._on_grad, i)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(hook)
        for listener in self._listeners:
            listener.forward_end(i)

    def _on_grad(self, i: int, grad: torch.Tensor) -> None:
        # Several outputs (or several uses of one) can fire; the listeners hear once per backward pass.
        task = torch._C._current_graph_task_id()
        if self._backward_seen.get(i) == task:
            return
        self._backward_seen[i] = task
        for listener in self._listeners:
            listener.backward_start(i)

    def _recover(self) -> None:
        """Pops contexts left pushed by a block whose post-hook never ran (a BaseException such as
        KeyboardInterrupt bypasses ``always_call``), innermost first, only while ours is on top."""
        while self._frames:
            frame = self._frames.pop()
            top = _top_hooks()
            if frame.ctx is not None and top is not None and top[0] is frame.pack:
                frame.ctx.__exit__(None, None, None)

    # -- the one pack / unpack ------------------------------------------------------------------
    def _pack(self, i: int, outer, tensor: torch.Tensor):
        for listener in self._listeners:
            payload = listener.pack(i, tensor)
            if payload is not None:
                return _Packed(listener, payload)
        if outer is not None:  # the context we shadow still gets what we do not take
            return _Packed(None, (outer[1], outer[0](tensor)))
        # An alias without the graph: a node that saves its own output would otherwise hold that output (and
        # through its grad_fn, itself) from C++, a cycle Python's gc cannot see, leaked whenever no backward runs.
        return tensor.detach()

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        if packed.owner is None:
            unpack, payload = packed.payload
            return unpack(payload)
        return packed.owner.unpack(packed.payload)
