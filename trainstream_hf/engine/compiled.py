"""Each decoder block's forward compiled as one region with torch.compile (``compile_blocks``).

A LoRA step of an 8B model on a GPU spends much of its time outside the weight GEMMs: norms, RoPE, SwiGLU, dtype
casts and adapter glue run as one unfused kernel each (the profile in benchmarks/NOTES.md). torch.compile fuses them
per block; Unsloth compiles its decoder layer the same way. This is PyTorch's "regional compilation": the blocks
share one class and their parameters reach the graph as inputs (dynamo's ``inline_inbuilt_nn_modules``), so the
first block compiles and every other block of the same structure reuses its code (two graphs in a LoRA model: block
0's input needs no gradient under a frozen embedding, the others' do). Nothing per layer may reach a guard: a block's
training call writes no cache (:func:`drop_cache`) and ``QuantLinear`` selects its matmul path without its per-layer
cache under compile. A sequence length seen for the second time makes dynamo mark it dynamic (its default), so a run
of varying lengths compiles a few times, not once per length. wrap installs it before the plan measures a block, so
the plan counts what the compiled region saves (30-40% less than the eager block on the CPU's tiny Llamas): the
measurement compiles for the plan's batch shape in training mode, and the first training step reuses that code when
it runs the same shape without autocast (with autocast it compiles again, under the loop's own mode). The region runs
without common-subexpression elimination across the joint graph (:func:`_compiled_forward` says why), and with the
native extension's build in torch.compile's cache keys (:func:`_build_pass`): a rebuilt extension is never served the
graphs traced through the C++ nodes of the build before.

Only training calls (``training`` and grad mode on) run compiled; generation and evaluation run the eager forward.
With ``compile_blocks='auto'`` (on CUDA with Triton) a first compilation that fails warns once and leaves the blocks
eager. What is compiled is the block's own ``forward``, set on the instance; ``Module.__call__`` and its hooks stay
outside the region. The engine's block hooks (weight paging, the saved-tensor context of activation offload, the
overlapped optimizer step) therefore run eagerly around it, and the checkpoint of a recomputed block wraps the compiled
forward (recomputation runs the same compiled code). The compiled autograd function saves its tensors through
``save_for_backward``, so an active saved-tensor hook (the activation offloader) sees them: fewer, since fused
kernels keep fewer intermediates than the eager graph.

Not the same bits as eager: inductor fuses elementwise chains and may reorder reductions (bounded in
tests/engine/test_compiled_blocks.py). Around the compiled blocks, offloaded activations and recomputation stay exact:
a wrapped model with compiled blocks equals, bit for bit, the same model with the same blocks compiled and nothing
moved. With gradients in host RAM (paged trainable weights, the offloaded optimizer's host mode) the parameters take
another class after the first step, the blocks are compiled again for it, and the gradients agree within float32
rounding only (measured on the CPU).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import Sequence

import torch
from torch import nn

_MISSING = object()
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")


_CACHE_POSITIONS: dict[type, tuple[int, ...]] = {}


def _cache_positions(cls: type) -> tuple[int, ...]:
    """Indices in a call's positional arguments (``self`` not counted) of ``cls.forward``'s cache parameters (GPT-2's
    model passes its cache positionally)."""
    if cls not in _CACHE_POSITIONS:
        try:
            names = list(inspect.signature(cls.forward).parameters)[1:]
        except (TypeError, ValueError):
            names = []
        _CACHE_POSITIONS[cls] = tuple(i for i, n in enumerate(names) if n in CACHE_ARGUMENTS)
    return _CACHE_POSITIONS[cls]


def drop_cache(layer: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What transformers does to a checkpointed layer's call in training: no cache written (``use_cache`` off, the
    cache argument None, by keyword or by position, unless the layer says it checkpoints with one). A training
    forward's cache is never read; writing it would make each block's call differ (its own cache layer) and, under a
    checkpoint, write it twice. Changes ``kwargs`` in place; returns the positional arguments."""
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if getattr(layer, "_can_checkpoint_with_cache", False):
        return args
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    positions = [i for i in _cache_positions(type(layer)) if i < len(args) and args[i] is not None]
    if positions:
        args = tuple(None if i in positions else a for i, a in enumerate(args))
    return args


@functools.lru_cache(maxsize=None)
def build_identity() -> str:
    """The native extension's build, as torch.compile's caches should see it: the package version and the loaded
    library's size and modification time."""
    import os

    import trainstream_hf
    from trainstream_hf import _C

    st = os.stat(_C.__file__)
    return f"trainstream_hf {trainstream_hf.__version__} {st.st_size} {st.st_mtime_ns}"


@functools.lru_cache(maxsize=None)
def _build_pass():
    """A post-grad pass that does nothing and whose ``uuid`` is :func:`build_identity`, or None where this torch has no
    custom-pass API. torch.compile's caches (FX graph, AOTAutograd: /tmp/torchinductor_<user>) treat every op as
    cache-safe, and a compiled block's graph holds this package's ops whole at dynamo's level, so a process with a
    rebuilt extension whose C++ nodes trace to other ATen ops would get the graph compiled before (same key: seen on
    the CPU, benchmarks/NOTES.md, 2026-12-07). Inductor hashes a custom pass's uuid into those keys."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # pragma: no cover - a torch without it
        return None

    class BuildKey(CustomGraphPass):
        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return build_identity()

    return BuildKey()


def _compile_settings():
    """The settings every compiled call runs under: no common-subexpression elimination (:func:`_compiled_forward`
    says why) and, where the user set no post-grad pre-pass of their own, :func:`_build_pass` in inductor's cache
    keys."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._functorch.config.patch(cse=False))
    import torch._inductor.config as inductor_config

    if getattr(inductor_config, "post_grad_custom_pre_pass", False) is None:
        build = _build_pass()
        if build is not None:
            stack.enter_context(inductor_config.patch(post_grad_custom_pre_pass=build))
    return stack


def _compiled_forward(owner: "CompiledBlocks", layer: nn.Module, eager, compiled, *args, **kwargs):
    # Training calls only: one compiled graph serves every block because a training call carries no per-layer state
    # (no cache). A call that writes a cache (generate(), evaluation) would reach a guard per layer and recompile
    # for each: it runs eager, as does every call once compilation has failed with fallback on.
    if not (layer.training and torch.is_grad_enabled()) or owner.failed is not None:
        return eager(*args, **kwargs)
    args = drop_cache(layer, args, kwargs)
    # No common-subexpression elimination across the joint graph: a quantized layer decodes its weight in the
    # forward and again in the backward (from the packed tensors it saves), and merging the two decodes would save
    # every dense weight for the backward: the whole bf16 model (out of memory at 24 GiB on the 8B table row at
    # 66d2b61, benchmarks/NOTES.md); without it the region saves less than eager does.
    if owner.fallback and not owner.compiled_once:
        try:
            out = compiled(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - any failure to compile: eager from now on, said once
            owner.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            warnings.warn(f"compile_blocks='auto': torch.compile of the decoder blocks failed ({owner.failed}); they "
                          "run eager from now on (set compile_blocks=False to skip the attempt, or True to see the "
                          "error)", RuntimeWarning, stacklevel=2)
            return eager(*args, **kwargs)
        owner.compiled_once = True
        return out
    return compiled(*args, **kwargs)


class _UnderSettings:
    """torch.compile's backend ``inner``, run under :func:`_compile_settings`: they apply where dynamo compiles a
    region (the joint graph is partitioned and the AOTAutograd cache key taken there), and cost nothing on the calls
    that reuse it (entering them around every block call cost ~0.2 ms on the host, 2026-12-07). One object per
    backend (:func:`_backend`): dynamo recompiles a region for a backend that is not the one it compiled it with."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, gm, example_inputs, **kwargs):
        with _compile_settings():
            return self.inner(gm, example_inputs, **kwargs)


@functools.lru_cache(maxsize=None)
def _backend(backend) -> _UnderSettings:
    """The one :class:`_UnderSettings` of ``backend`` (a torch.compile backend name or callable)."""
    import torch._dynamo

    return _UnderSettings(torch._dynamo.lookup_backend(backend))


def inductor_usable(device: torch.device) -> bool:
    """Whether torch.compile's default backend can generate kernels for ``device``'s training step here: CUDA with
    Triton installed (``compile_blocks='auto'`` compiles only then)."""
    if device.type != "cuda":
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - torch without the helper
        return False
    return bool(has_triton())


class CompiledBlocks:
    """Compiles the blocks' forwards on :meth:`install`; :meth:`uninstall` gives each its previous forward back.

    Args:
        backend: torch.compile's backend.
        fallback: a failure of the first compiled call warns once and leaves every block eager (``compile_blocks=
            'auto'``); without it the error is raised (an explicit request).
    """

    def __init__(self, backend: str = "inductor", *, fallback: bool = False):
        self.backend = backend
        self.fallback = bool(fallback)
        self.failed: str | None = None  # why compilation failed, once it has (fallback)
        self.compiled_once = False
        self._saved: list[tuple[nn.Module, object]] = []

    def install(self, blocks: Sequence[nn.Module]) -> int:
        """Sets a compiled ``forward`` on every block (its instance forward if it has one, else its class's);
        returns how many. Compilation itself happens at each structure's first call."""
        for block in blocks:
            inner = block.__dict__.get("forward", _MISSING)
            self._saved.append((block, inner))
            fn = inner if inner is not _MISSING else type(block).forward.__get__(block)
            block.__dict__["forward"] = functools.partial(_compiled_forward, self, block, fn,
                                                          torch.compile(fn, backend=_backend(self.backend)))
        return len(self._saved)

    def uninstall(self) -> None:
        for block, inner in reversed(self._saved):
            if inner is _MISSING:
                block.__dict__.pop("forward", None)
            else:
                block.__dict__["forward"] = inner
        self._saved = []
