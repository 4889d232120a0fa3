"""A transformers ``Cache`` whose K/V lives partly in host pages, streamed back while earlier layers compute.

Decoding with a long context is bound by the KV cache, not the weights: ``2 * layers * tokens * kv_heads *
head_dim`` elements per sequence. :class:`PagedKVCache` (alias :class:`TrainStreamCache`) keeps a chosen
share of the attention layers *resident* on the compute device and the rest *offloaded*: their K/V live
on the host (pinned, from :class:`~trainstream_hf.engine.arena.HostArena`, on CUDA) and visit the device
in a ring of ``slots`` preallocated buffers, exactly like the weight pager's blocks.

Schedule, for each ``update(key_states, value_states, layer_idx)`` (``P`` = ``prefetch``):

* layer ``i`` offloaded: the compute stream waits (event, no host sync) for the copy of ``i``'s K/V into
  its slot, issued ``P`` offloaded layers ago (or now, on a miss); the new tokens are written into the slot
  and sent to the host copy on the D2H stream;
* then, for any layer, the next ``P`` offloaded layers in cyclic order are copied into free slots on the
  H2D stream. Cyclic: the last layers of step ``t`` prefetch the first ones of step ``t + 1``, behind the
  LM head and sampling.

Guards: a copy into a slot waits for all work queued on the compute stream (every attention kernel that
read the slot's previous occupant has been enqueued: layers run in order) and for the last D2H copy (which
may still read the slot, or still be writing the host pages the copy reads). A slot given to a layer with
nothing to copy in (its prefill) is written by the compute stream only after the D2H copy that last read it. Host pages are released only
after a host synchronisation, which happens on growth, ``reorder_cache`` and ``close`` only.

Layout: every buffer is token-major, ``[capacity, batch, heads, head_dim]``, so the first ``L`` tokens of
a layer are one contiguous block (one ``cudaMemcpyAsync``, no staging) and appending is a plain slice
write. ``update`` returns a ``[batch, heads, L, head_dim]`` permuted view of it (no copy). Capacity is
preallocated (``max_cache_len``) and grows in chunks of ``chunk`` tokens, so decoding allocates nothing
per token. Sliding-window layers keep their whole history but return (and copy) only the window, exactly
as ``DynamicSlidingWindowLayer`` does, so outputs match ``DynamicCache`` bit for bit.

On a CPU compute device the same code runs with plain CPU tensors and synchronous copies (CI).

Runs on transformers 5.17 and 5.24 alike (see the version shims below). Hand it to the model or ``generate()``
as ``cache=`` on 5.24, as ``past_key_values=`` on 5.17 (where ``cache=`` is not the cache argument).
"""
from __future__ import annotations

import bisect
import functools
import inspect
import math
import weakref

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from trainstream_hf.engine.arena import HostArena
from trainstream_hf.engine.streams import Transfer, TransferStreams

__all__ = ["PagedKVCache", "TrainStreamCache", "cache_keyword", "release_host_pages"]

_SLIDING = ("sliding_attention", "chunked_attention")  # same cache behaviour; only the mask differs

# Pinned host pages kept with each model (its config object) for the model's next cache: pinning costs ~0.4 s per
# GiB (benchmarks/NOTES.md, 2026-12-03), and a cache made for each generate() call pinned its pages anew every
# time (+0.5-0.7 s of an 8B model's prefill on an H100 at ecec175, where torch's pinned memory, which
# DynamicCache(offloading=True) uses, is cached). A cache's pages go back to the pool when it is closed or collected;
# a page handed out again may still be the target of the old cache's last device-to-host copy (a cache dropped right
# after generate() returns, without close), so each release records an event on the old cache's copy stream and the
# next cache over the pool waits for those events before its first page is written.
class _PagePool:
    def __init__(self, owner, pools: dict):
        # (slabs are reserved as each cache needs them, one per cache shape; a block that finds no room takes a slab
        # of its own, at least this size)
        self.arena = HostArena("auto", slab_bytes="64MiB")
        self.released: list = []  # CUDA events: copies into pages given back, to finish before they are reused
        key = id(owner)  # (configs define __eq__, so they cannot be dictionary keys themselves)
        # (the dictionary bound now: at interpreter exit the module's globals may be gone when the config goes)
        self.owner = weakref.ref(owner, lambda _ref: pools.pop(key, None))

    def take(self) -> HostArena:
        """The arena, once every copy into pages given back has finished (a host wait; usually long done)."""
        for event in self.released:
            event.synchronize()
        self.released.clear()
        return self.arena


_PAGE_POOLS: dict[int, _PagePool] = {}  # id(config) -> its pool; the entry goes when the config does


def _pins_pages(device: torch.device) -> bool:
    """Offloaded layers' pages are pinned (an arena) on CUDA; on the CPU they are plain tensors."""
    return device.type == "cuda"


def _page_pool(owner) -> _PagePool | None:
    """The pool the caches over ``owner`` (a model's config) take their host pages from, made at first use; None
    where ``owner`` takes no weak reference (the cache then pins an arena of its own)."""
    pool = _PAGE_POOLS.get(id(owner))
    if pool is not None and pool.owner() is owner and not pool.arena.closed:
        return pool
    try:
        pool = _PagePool(owner, _PAGE_POOLS)
    except TypeError:
        return None
    _PAGE_POOLS[id(owner)] = pool
    return pool


def _give_back(pool: _PagePool, streams) -> None:
    """A cache's pages are going back to ``pool`` (closed, or collected): its last copies into them are noted."""
    if streams is not None and streams.is_cuda:
        event = torch.cuda.Event()
        event.record(streams.d2h)
        pool.released.append(event)


def release_host_pages(model) -> int:
    """Gives back the pinned host pages kept for ``model``'s caches (a model or its config): they go once no cache
    over it still holds them (they go with the model anyway). Returns the bytes that pool had reserved."""
    config = model if isinstance(model, PreTrainedConfig) else getattr(model, "config", None)
    pool = _PAGE_POOLS.pop(id(config), None)
    if pool is None or pool.owner() is not config:
        return 0
    reserved = pool.arena.stats()["reserved"]
    pool.arena.close()
    return reserved


# -- transformers version shims (5.17.0 and 5.24.0; pyproject: transformers>=5.17) ----------------------------
# Written against 5.24.0. What 5.17.0 does differently, and how it is bridged (everything else in this module is
# version-free):
#
# * ``cache_utils.DummyLayer`` (the no-cache layer of KV-sharing consumers, Gemma 3n / 4, and of MLP-only layers)
#   does not exist in 5.17: there a KV-sharing cache simply has fewer layers, and "moe" / "mlp" layers get a
#   LinearAttentionLayer. 5.17's ``Cache`` handles a layer that is not a ``CacheLayerMixin`` as 5.24's handles a
#   DummyLayer (``get_seq_length()`` / ``get_mask_sizes`` look past it to the first attention layer; the batch,
#   early-init and compile checks skip it), so ``_NoCacheLayer`` stands in for it there and both versions build
#   the same layers.
# * ``Cache.is_dummy`` (5.24) is missing in 5.17: ``PagedKVCache.is_dummy`` defines it for both.
# * ``get_layer_types_and_kwargs``: 5.24 returns the types of all ``num_hidden_layers`` ("dummy" for consumers and
#   MLP-only layers) and one kwargs dict per layer; 5.17 returns one kwargs dict for all layers and drops the last
#   ``num_kv_shared_layers`` types (the consumers). ``_layer_types`` returns the 5.24 form on both.
# * ``config.kv_sharing_modes`` (5.24: None / "store" / "reuse" per layer) is missing in 5.17, whose Gemma 3n / 4
#   attention modules compute the same thing inline from ``num_kv_shared_layers`` (``store_full_length_kv``):
#   ``_layer_types`` does that computation on 5.17, so the producers stay resident there too.
# * ``Cache.max_cache_len`` is a deprecated read-only property in 5.17 (an AttributeError on assignment), gone in
#   5.24: ``PagedKVCache`` shadows it with a plain attribute.
# * Callers (not this module): 5.24 models and ``generate()`` take ``cache=`` (``past_key_values=`` deprecated);
#   5.17 ones take ``past_key_values=`` only (a ``cache=`` there is not the cache). The layers' ``update`` /
#   ``get_mask_sizes`` / ``lazy_initialization`` signatures and ``Cache.update(k, v, layer_idx, ...)`` are the same
#   in both (5.24 passes an extra ``kwargs=`` to ``update``, which ``PagedKVCache.update`` accepts and ignores).
try:
    from transformers.cache_utils import DummyLayer as _NoCacheLayer  # in 5.24.0, not in 5.17.0
except ImportError:  # transformers 5.17.0
    class _NoCacheLayer:
        """Stand-in for 5.24's ``cache_utils.DummyLayer``: a layer that stores no K/V."""

        supports_early_init = False
        is_compileable = True
        is_croppable = True

        def __init__(self, **kwargs):
            self.is_initialized = True
            self.keys = self.values = None

        def update(self, key_states, value_states, *args, **kwargs):
            if key_states is None and value_states is None:
                return None, None
            raise NotImplementedError("PagedKVCache: this layer stores no K/V (KV-sharing consumer or MLP-only layer)")

        def offload(self): ...
        def prefetch(self): ...
        def reset(self): ...
        def crop(self, tokens_to_remove: int): ...
        def reorder_cache(self, beam_idx): ...
        def batch_repeat_interleave(self, repeats: int): ...
        def batch_select_indices(self, indices): ...

        def get_max_length(self) -> int:
            return -1


def _layer_types(text) -> tuple[list[str], list[dict], list[str | None]]:
    """``(types, per-layer kwargs, kv_sharing_modes)`` of the decoder layers, in 5.24's form on both versions.

    ``kv_sharing_modes``, per layer: "store" (a KV-sharing producer: later layers of the same forward reuse the
    K/V it returns), "reuse" (a consumer, no cache of its own, typed "dummy") or None.
    """
    types, kwargs = get_layer_types_and_kwargs(text)
    if not isinstance(kwargs, dict):  # transformers 5.24
        return list(types), list(kwargs), list(getattr(text, "kv_sharing_modes", None) or [None] * len(types))
    # transformers 5.17: one kwargs dict for all layers; the last ``num_kv_shared_layers`` types cut off
    types, n, shared = list(types), len(types), getattr(text, "num_kv_shared_layers", None)
    modes = [None] * n
    if shared is not None:  # Gemma 3n / 4: what their 5.17 attention computes inline (``is_kv_shared_layer``,
        # ``store_full_length_kv``), the rule of 5.24's ``kv_sharing_modes``: the consumers reuse the K/V returned
        # by the last non-consumer layer of their type, which stores it even when no layer reuses it.
        n = text.num_hidden_layers
        first = n - shared  # == len(types) after 5.17's cut
        # (no layer_types: 5.17 inferred one type for all layers, so the cut-off ones are of that type too)
        all_types = list(getattr(text, "layer_types", None) or types + types[-1:] * (n - len(types)))
        if first <= 0:
            types, modes = ["dummy"] * n, ["reuse"] * n
        else:
            if set(all_types[:first]) != set(all_types):
                raise ValueError("the set of layer types producing a cache is different than the set of layer types "
                                 "using them")
            modes = [None if i < first else "reuse" for i in range(n)]
            for t in set(all_types):
                modes[first - 1 - all_types[:first][::-1].index(t)] = "store"
            types = types[:first] + ["dummy"] * (n - first)
    types = ["dummy" if t in ("moe", "mlp") else t for t in types]  # 5.24 maps these to "dummy" itself
    kwargs = [{"sliding_window": text.sliding_window} if t == "sliding_attention" else
              {"sliding_window": text.attention_chunk_size} if t == "chunked_attention" else {} for t in types]
    return types, kwargs, modes


# -- end of the version shims ------------------------------------------------------------------------------------


class _PagedLayer(CacheLayerMixin):
    """One attention layer's K/V: token-major buffers on the device (resident) or the host (offloaded)."""

    is_compileable = False  # generate() must not compile or build static 4D masks for us
    is_croppable = True
    supports_early_init = False

    def __init__(self, resident: bool, sliding_window: int | None = None, static_len: int | None = None):
        super().__init__()
        self.resident = resident
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.length = 0  # tokens held (static resident layers: cumulative_length; this counts eager updates)
        self.k: torch.Tensor | None = None  # [capacity, batch, kv_heads, head_dim]
        self.v: torch.Tensor | None = None
        # static (PagedKVCache(static=True)): the whole capacity is returned and masked, as StaticLayer does; the
        # token count is a device tensor so that a compiled decode step reads it without a guard or a host sync
        self.static_len = static_len
        self.is_compileable = static_len is not None
        self.cumulative_length: torch.Tensor | None = None
        self.k_hm: torch.Tensor | None = None  # static resident layers: the [batch, kv_heads, capacity, head_dim]
        self.v_hm: torch.Tensor | None = None  # buffers behind k / v

    def start(self) -> int:
        """First cached token the next query sees (the window start for sliding layers)."""
        return max(0, self.length - self.sliding_window + 1) if self.is_sliding else 0

    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("PagedKVCache layers are initialised by the cache's update()")

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("PagedKVCache layers are updated through PagedKVCache.update(..., layer_idx)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.static_len is not None:
            return self.static_len, 0
        start = self.start()
        return self.length - start + query_length, start

    def get_seq_length(self) -> int | torch.Tensor:
        if self.static_len is not None:
            return self.cumulative_length if self.is_initialized else 0
        return self.length

    def get_max_length(self) -> int:
        return -1 if self.static_len is None else self.static_len  # dynamic: grows in chunks

    def tokens(self) -> int:
        """Tokens held, as a Python int (a host sync for a static resident layer)."""
        if self.static_len is not None and self.resident:
            return int(self.cumulative_length) if self.is_initialized else 0
        return self.length


class PagedKVCache(Cache):
    """KV cache with resident layers on the compute device and offloaded ones in host pages.

    One generation at a time, as transformers' caches: :meth:`reset` empties it for the next (keeping its buffers),
    :meth:`close` gives its memory back. ``generate()`` must run with ``use_cache`` on: a cache given the whole
    sequence again (what ``use_cache=False`` feeds it) is refused.

    Args:
        model: a transformers causal LM (or its config). Its decoder layer types decide each cache layer:
            full attention, sliding / chunked attention, or none (KV-sharing and MLP-only layers).
        resident: fraction in [0, 1] of the attention layers whose K/V stays on the device (rounded down;
            for layers of one shape, the fraction of the KV bytes held on the device besides the slots).
            The offloaded layers are spread evenly over the depth so that each copy overlaps several
            layers of compute. Layers whose K/V other layers reuse (KV sharing) are always resident.
        resident_layers: the number of resident layers instead of a fraction.
        max_cache_len: tokens preallocated per sequence (prompt + new tokens); more grow in ``chunk`` s,
            each growth a host synchronisation and a copy. Default: the first prompt, rounded up.
        chunk: growth granularity in tokens.
        slots: device buffers for offloaded layers (``>= prefetch + 1``), each sized for one layer.
        prefetch: offloaded layers copied ahead of their use.
        arena: host arena for the pages (default: a pinned arena of the cache's own on CUDA, plain CPU
            tensors on the CPU).
        streams: transfer streams of the compute device (default: the cache's own).
        static: a fixed capacity of ``max_cache_len`` tokens (required), every layer returning all of it with
            the unused positions masked, as transformers' StaticCache does, so that ``generate()`` can compile
            the decode step (``disable_compile=False``; CUDA graphs on a GPU). Resident layers are updated
            inside the compiled graph; each offloaded layer's update runs between graphs (a graph break: its
            copies are issued from Python; ``torch._dynamo.config.recompile_limit`` is raised to twice the layers
            plus 8, as the frames around each break compile once per layer). The tokens are StaticCache's. Full
            attention layers only.

    Raises:
        ValueError: no decoder layers, an unsupported layer type (linear attention, encoder-decoder), or
            a bad ``resident`` / ``slots`` / ``prefetch`` / ``chunk``; ``static`` without ``max_cache_len``
            or with sliding / chunked attention layers.
    """

    max_cache_len: int | None = None  # shadows 5.17's read-only Cache.max_cache_len property (see the shims)

    def __init__(self, model, *, resident: float = 0.0, resident_layers: int | None = None,
                 max_cache_len: int | None = None, chunk: int = 256, slots: int = 2, prefetch: int = 1,
                 arena: HostArena | None = None, streams: TransferStreams | None = None, static: bool = False):
        config = model if isinstance(model, PreTrainedConfig) else getattr(model, "config", None)
        if not isinstance(config, PreTrainedConfig):
            raise ValueError(f"PagedKVCache: {type(model).__name__} is not a transformers model or config")
        if config.is_encoder_decoder:
            raise ValueError("PagedKVCache: encoder-decoder models are not supported (decoder-only LMs only)")
        text = config.get_text_config(decoder=True)
        try:
            types, kwargs, modes = _layer_types(text)
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"PagedKVCache: cannot read the decoder layers of {type(config).__name__}: {e}") from e
        bad = sorted({t for t in types if t not in ("full_attention", "dummy", *_SLIDING)})
        if bad:
            raise ValueError(f"PagedKVCache: layer types {bad} are not supported (full, sliding and chunked "
                             "attention are); use DynamicCache for this model")
        attn = [i for i, t in enumerate(types) if t != "dummy"]
        if not attn:
            raise ValueError(f"PagedKVCache: {type(config).__name__} has no attention layers to cache")
        n_res = _resident_count(resident, resident_layers, len(attn))
        # KV-sharing producers (Gemma 4) hand their returned K/V to later layers of the same forward: a
        # slot could be overwritten before those read it, so they stay resident.
        movable = [i for i in attn if modes[i] != "store"]
        m = min(len(attn) - n_res, len(movable))
        offloaded = [movable[(k + 1) * len(movable) // m - 1] for k in range(m)]  # evenly spread
        if slots < 1 or not 0 <= prefetch <= slots - 1:
            raise ValueError(f"PagedKVCache: need slots >= 1 and 0 <= prefetch <= slots - 1 (a prefetched layer "
                             f"needs a slot besides the running one), got slots={slots}, prefetch={prefetch}")
        if chunk < 1 or (max_cache_len is not None and max_cache_len < 1):
            raise ValueError(f"PagedKVCache: chunk and max_cache_len must be >= 1, got {chunk}, {max_cache_len}")
        if static and max_cache_len is None:
            raise ValueError("PagedKVCache(static=True) needs max_cache_len: the prompt's tokens plus the most new "
                             "tokens generated (its buffers are allocated once, at that size)")
        if static and any(t in _SLIDING for t in types):
            raise ValueError("PagedKVCache(static=True) supports full attention layers only; this model has sliding "
                             "or chunked attention layers: use static=False (the default)")
        layers = [_NoCacheLayer() if t == "dummy" else
                  _PagedLayer(i not in offloaded, kw.get("sliding_window") if t in _SLIDING else None,
                              max_cache_len if static else None)
                  for i, (t, kw) in enumerate(zip(types, kwargs))]
        super().__init__(layers=layers)
        self.offloaded_layers = offloaded
        self.static = bool(static)
        if self.static and offloaded:
            # Each offloaded layer's update breaks a compiled decode step's graph, and the frames around the break
            # (the attention and decoder layer forwards) are then compiled once per layer: let dynamo keep them all.
            import torch._dynamo

            need, cfg = 2 * len(layers) + 8, torch._dynamo.config
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # (older torch)
            if getattr(cfg, name) < need:
                setattr(cfg, name, need)
        self.num_slots, self.num_prefetch, self.chunk, self.max_cache_len = slots, prefetch, chunk, max_cache_len
        self._arena, self._own_arena = arena, arena is None
        self._pages_owner = config  # whose page pool an own arena is drawn from (_page_pool)
        self._pool: _PagePool | None = None  # the model's pool, where this cache's pages come from (_page_pool)
        self._streams, self._own_streams = streams, streams is None
        self._device: torch.device | None = None
        self._dtype: torch.dtype | None = None
        self._batch = 0
        self.capacity = 0
        self._slot_k: list[torch.Tensor] = []  # flat device buffers, typed views per occupant
        self._slot_v: list[torch.Tensor] = []
        self._occupant: list[int | None] = []
        self._slot_of: dict[int, int] = {}
        self._pending: dict[int, Transfer] = {}  # copies issued, not yet waited on by the compute stream
        self._d2h_event = None  # last D2H copy; FIFO stream, so it covers all earlier ones
        self._slot_read: list = []  # per slot: the last D2H copy that reads it (None: none, or done)
        self._stats = dict(h2d_bytes=0, d2h_bytes=0, loads_ahead=0, loads_on_demand=0, growths=0)

    # -- transformers Cache API -------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Appends the new tokens' K/V of ``layer_idx`` and returns the K/V its attention sees.

        Returns:
            ``(keys, values)`` as ``[batch, kv_heads, visible, head_dim]`` views of device buffers, valid
            until the next ``update`` of the same layer.
        """
        layer = self.layers[layer_idx]
        if not isinstance(layer, _PagedLayer):
            return layer.update(key_states, value_states, *args, **kwargs)
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            raise ValueError("PagedKVCache stores K/V without autograd history; run generation under "
                             "torch.no_grad() (generate() does), or use DynamicCache to backpropagate")
        self._check_input(key_states, value_states)
        if not layer.is_initialized:
            self._init_layer(layer, key_states, value_states)
        if self.static:
            if layer.resident:  # traced into a compiled decode step: tensor ops on fixed buffers only
                if not torch.compiler.is_compiling():  # eager: the host count says what fits (a traced step cannot)
                    self._check_fits(layer.length, key_states.shape[-2])
                    layer.length += key_states.shape[-2]
                with torch.no_grad():
                    pos = torch.arange(key_states.shape[-2], device=self._device) + layer.cumulative_length
                    layer.k_hm.index_copy_(2, pos, key_states)
                    layer.v_hm.index_copy_(2, pos, value_states)
                    layer.cumulative_length.add_(key_states.shape[-2])
                return layer.k_hm, layer.v_hm
            return self._update_offloaded_static(layer_idx, key_states, value_states)
        q, n = key_states.shape[-2], layer.length
        if n and q == n + 1 and self._refed(layer, key_states):
            # generate() with use_cache off (model.config.use_cache=False, as many training scripts leave it) feeds
            # the whole sequence at every step, and a cache it was given would take all of it again: every later
            # token would attend to each earlier one twice, at shifted positions
            raise ValueError(f"PagedKVCache: layer {layer_idx} holds {n} tokens and is given them again with one more: "
                             "generate() does this when use_cache is off (model.config.use_cache=False); set "
                             "model.generation_config.use_cache = True or pass use_cache=True to generate() (new "
                             "tokens that repeat the held ones, in a model without positions in its keys: feed "
                             "them in two calls)")
        if n + q > self.capacity:
            self._grow(n + q)
        with torch.no_grad():
            k, v = (layer.k, layer.v) if layer.resident else self._acquire(layer_idx)
            k[n:n + q].copy_(key_states.permute(2, 0, 1, 3))
            v[n:n + q].copy_(value_states.permute(2, 0, 1, 3))
            if not layer.resident:  # the host pages stay the truth: slots are only borrowed
                self._streams.to_host(k[n:n + q], layer.k[n:n + q])
                self._d2h_event = self._streams.to_host(v[n:n + q], layer.v[n:n + q]).event
                self._slot_read[self._slot_of[layer_idx]] = self._d2h_event  # the slot's reader until then
                self._stats["d2h_bytes"] += _nbytes(k[n:n + q]) + _nbytes(v[n:n + q])
            s = layer.start()  # from the past length, as get_mask_sizes saw it
            layer.length = n + q
            self._prefetch_after(layer_idx)
        return k[s:n + q].permute(1, 2, 0, 3), v[s:n + q].permute(1, 2, 0, 3)

    def _refed(self, layer: _PagedLayer, key_states: torch.Tensor) -> bool:
        """The first ``layer.length`` of ``key_states`` are the keys held (within rounding): the sequence given
        again, not new tokens (those sit at other positions, so their keys differ)."""
        n = layer.length
        if not layer.resident and self._d2h_event is not None:
            self._d2h_event.synchronize()  # the host pages are written
        held = layer.k[:n].to(device=key_states.device, dtype=torch.float32)
        given = key_states[:, :, :n].permute(2, 0, 1, 3).float()
        return bool((given - held).abs().amax() <= 0.02 * held.abs().amax() + 1e-6)

    @torch.compiler.disable
    def _update_offloaded_static(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """``update`` of an offloaded layer with a static capacity: as the dynamic one, but returning the whole slot
        (masked past the tokens held). Never traced: a compiled decode step breaks its graph here and runs the
        copies from Python."""
        layer = self.layers[layer_idx]
        q, n = key_states.shape[-2], layer.length
        self._check_fits(n, q)
        with torch.no_grad():
            k, v = self._acquire(layer_idx)
            k[n:n + q].copy_(key_states.permute(2, 0, 1, 3))
            v[n:n + q].copy_(value_states.permute(2, 0, 1, 3))
            self._streams.to_host(k[n:n + q], layer.k[n:n + q])
            self._d2h_event = self._streams.to_host(v[n:n + q], layer.v[n:n + q]).event
            self._slot_read[self._slot_of[layer_idx]] = self._d2h_event
            self._stats["d2h_bytes"] += _nbytes(k[n:n + q]) + _nbytes(v[n:n + q])
            layer.length = n + q
            layer.cumulative_length.add_(q)
            self._prefetch_after(layer_idx)
        return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def _check_fits(self, held: int, new: int) -> None:
        if held + new > self.capacity:
            raise ValueError(f"PagedKVCache(static=True): {held + new} tokens do not fit max_cache_len="
                             f"{self.capacity}; make it the prompt's length plus the most new tokens, and call "
                             "cache.reset() before a new generation")

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last ``-tokens_to_remove`` tokens (a negative int, as ``DynamicCache.crop`` wants)."""
        if tokens_to_remove > 0:
            raise ValueError(f"PagedKVCache.crop: pass a negative number of tokens to remove, got {tokens_to_remove}")
        for layer in self._paged():
            layer.length = max(0, layer.length + tokens_to_remove)
            if layer.cumulative_length is not None:
                layer.cumulative_length.clamp_(min=-tokens_to_remove).add_(tokens_to_remove)
        self._invalidate()  # a sliding window may now start before what a slot holds

    def reset(self) -> None:
        """Empties the cache, keeping its buffers for the next generation."""
        for layer in self._paged():
            layer.length = 0
            if layer.cumulative_length is not None:
                layer.cumulative_length.zero_()
        self._invalidate()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorders the batch for beam search. Synchronises the host once (the host pages are reordered)."""
        self._sync()
        with torch.no_grad():
            for layer in self._paged():
                n = layer.tokens()
                if layer.is_initialized and n:
                    idx = beam_idx.to(layer.k.device)
                    for buf in (layer.k, layer.v):
                        buf[:n].copy_(buf[:n].index_select(1, idx))
        self._invalidate()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PagedKVCache: the batch size is fixed for a generation; expand the inputs "
                                  "before the first forward instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("PagedKVCache: the batch size is fixed for a generation (no batch_select_indices)")

    @property
    def is_dummy(self) -> list[bool]:
        """Whether each layer stores no K/V (``Cache.is_dummy`` of transformers 5.24, defined for 5.17 too)."""
        return [isinstance(layer, _NoCacheLayer) for layer in self.layers]

    # -- public extras ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Cumulative H2D / D2H bytes, offloaded-layer copies issued ahead of use and on demand (stalls),
        and capacity growths."""
        return dict(self._stats)

    def memory(self) -> dict:
        """Bytes held now: ``device`` (resident layers + slots) and ``host`` (offloaded pages)."""
        dev = sum(_nbytes(t) for t in self._slot_k + self._slot_v)
        host = 0
        for layer in self._paged():
            if layer.is_initialized:
                b = _nbytes(layer.k) + _nbytes(layer.v)
                dev, host = (dev + b, host) if layer.resident else (dev, host + b)
        return {"device": dev, "host": host, "capacity": self.capacity}

    def close(self) -> None:
        """Releases every buffer (after the copies in flight) and the cache's own arena. The cache can be
        used again afterwards, as a new one."""
        self._sync()
        for layer in self._paged():
            layer.k = layer.v = layer.k_hm = layer.v_hm = layer.cumulative_length = None
            layer.length, layer.is_initialized = 0, False
        self._slot_k, self._slot_v, self._occupant, self._slot_read = [], [], [], []
        self._slot_of.clear()
        self._pending.clear()
        self._d2h_event = None
        if self._own_arena and self._arena is not None:
            if self._pool is not None:
                self._give_back()  # (the pages, dropped above, are back in the model's pool for its next cache)
            else:
                self._arena.close()
            self._arena, self._pool = None, None
        if self._own_streams:
            self._streams = None
        self._device, self._dtype, self._batch, self.capacity = None, None, 0, 0

    # -- set-up and growth ------------------------------------------------------------------------
    def _paged(self) -> list[_PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, _PagedLayer)]

    def _check_input(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or k.dtype != v.dtype:
            raise ValueError(f"PagedKVCache.update: expected key/value [batch, heads, tokens, head_dim] of one "
                             f"dtype, got {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
        if self._device is not None and k.shape[0] != self._batch:
            if any(layer.tokens() for layer in self._paged()):
                raise ValueError(f"PagedKVCache: batch size changed mid-generation ({self._batch} -> {k.shape[0]}); "
                                 "call cache.reset() (or use a new cache) for a new batch")
            self.close()  # empty: start over with the new batch size
        if self._device is not None and (k.device != self._device or k.dtype != self._dtype):
            raise ValueError(f"PagedKVCache: K/V moved from {self._device} {self._dtype} to {k.device} {k.dtype} "
                             "mid-generation; call cache.close() first")
        if self._device is None:
            self._device, self._dtype, self._batch = k.device, k.dtype, k.shape[0]
            if self._streams is None:
                self._streams = TransferStreams(k.device)
            if self._streams.device != k.device:
                raise ValueError(f"PagedKVCache: streams are for {self._streams.device}, K/V are on {k.device}")
            q, want = k.shape[-2], self.max_cache_len or 0
            if self.static and q > want:
                raise ValueError(f"PagedKVCache(static=True): a prompt of {q} tokens does not fit max_cache_len="
                                 f"{want}; make it the prompt's length plus the most new tokens")
            self.capacity = want if want >= q else _round_up(q, self.chunk)

    def _init_layer(self, layer: _PagedLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        if not layer.resident and self._arena is None and _pins_pages(self._device):
            # One slab sized for every offloaded layer like this one: pinning is slow, pin once, and keep it with
            # the model for its next cache (_page_pool), which finds it free again when this one is gone
            per_layer = self.capacity * (k[:, :, 0].numel() + v[:, :, 0].numel()) * k.element_size()
            need = _round_up(per_layer * len(self.offloaded_layers), 1 << 20)
            pool = _page_pool(self._pages_owner)
            if pool is None:
                self._arena = HostArena("auto", slab_bytes=need)
            else:
                self._arena, self._pool = pool.take(), pool
                if self._arena.stats()["largest_free"] < need:
                    self._arena.reserve(need, contiguous=True)
                # closed or collected, the pages go back with their last copy noted (no reference to self)
                self._give_back = weakref.finalize(self, _give_back, pool, self._streams)
                self._give_back.atexit = False  # (at exit the pool goes too: nothing to note)
        layer.k = self._alloc(layer.resident, self.capacity, k)
        layer.v = self._alloc(layer.resident, self.capacity, v)
        layer.batch_size, layer.length, layer.is_initialized = k.shape[0], 0, True
        if self.static:
            with torch.inference_mode(False):
                layer.cumulative_length = torch.zeros((), dtype=torch.long, device=self._device)
            static = [layer.cumulative_length]
            if layer.resident:  # the head-major buffers themselves: what attention reads and the graph updates
                layer.k_hm, layer.v_hm = layer.k.permute(1, 2, 0, 3), layer.v.permute(1, 2, 0, 3)
                static += [layer.k_hm, layer.v_hm]
            for t in static:  # fixed addresses: a CUDA graph replays over them instead of copying them in
                torch._dynamo.mark_static_address(t)
        if not layer.resident and (not self._slot_k or self._slot_k[0].numel() < layer.k.numel()
                                   or self._slot_v[0].numel() < layer.v.numel()):
            self._alloc_slots()  # first offloaded layer, or a wider one (prefill only)

    @torch.inference_mode(False)  # buffers outlive a generate() under inference_mode: keep them normal
    def _alloc(self, resident: bool, capacity: int, like: torch.Tensor) -> torch.Tensor:
        """A ``[capacity, batch, kv_heads, head_dim]`` buffer. Offloaded pages are stored token-major (a step's new
        tokens are one contiguous block to copy to the host); a resident layer is stored head-major, ``[batch,
        kv_heads, capacity, head_dim]`` seen through a permuted view, so that attention reads each head's keys and
        values as contiguous rows, as from StaticCache's buffers."""
        shape = (capacity, like.shape[0], like.shape[1], like.shape[3])
        if resident:  # (static: zeros, as StaticCache's: masked positions must not hold NaN bit patterns)
            return (torch.zeros if self.static else torch.empty)(
                (shape[1], shape[2], shape[0], shape[3]), dtype=like.dtype, device=self._device).permute(2, 0, 1, 3)
        if self._pool is not None:  # (what another cache over the model gave back since is reused after its copies)
            return self._pool.take().empty(shape, like.dtype)
        if self._arena is not None:
            return self._arena.empty(shape, like.dtype)
        return torch.empty(shape, dtype=like.dtype)

    @torch.inference_mode(False)
    def _alloc_slots(self) -> None:
        if self._slot_k:
            self._sync()  # in-flight copies use the slots being replaced
        off = [self.layers[j] for j in self.offloaded_layers if self.layers[j].is_initialized]
        nk = max(layer.k.numel() for layer in off)
        nv = max(layer.v.numel() for layer in off)
        new = torch.zeros if self.static else torch.empty  # static: a slot's unused positions are read (masked)
        self._slot_k = [new(nk, dtype=self._dtype, device=self._device) for _ in range(self.num_slots)]
        self._slot_v = [new(nv, dtype=self._dtype, device=self._device) for _ in range(self.num_slots)]
        self._occupant = [None] * self.num_slots
        self._slot_read = [None] * self.num_slots
        self._slot_of.clear()
        self._pending.clear()

    def _grow(self, need: int) -> None:
        """Reallocates every buffer at the next multiple of ``chunk`` holding ``need`` tokens."""
        self._sync()  # copies in flight read or write the pages being replaced
        self.capacity = _round_up(need, self.chunk)
        with torch.no_grad():
            for layer in self._paged():
                if layer.is_initialized:
                    # One buffer at a time, so the arena can reuse each freed block for the next.
                    for name in ("k", "v"):
                        old = getattr(layer, name)
                        new = self._alloc(layer.resident, self.capacity, old.permute(1, 2, 0, 3))
                        new[:layer.length].copy_(old[:layer.length])
                        setattr(layer, name, new)
                        del old
        if self._slot_k:
            self._alloc_slots()
        self._stats["growths"] += 1

    def _sync(self) -> None:
        """Host sync: every copy issued on the H2D / D2H streams is done (so pages may be touched or freed)."""
        if self._streams is not None:
            self._streams.synchronize()

    # -- slots ------------------------------------------------------------------------------------
    def _views(self, slot: int, layer: _PagedLayer) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._slot_k[slot][:layer.k.numel()].view(layer.k.shape)
        v = self._slot_v[slot][:layer.v.numel()].view(layer.v.shape)
        return k, v

    def _acquire(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s slot views, its copy waited for on the compute stream (no host sync)."""
        if i not in self._slot_of:
            if self._load(i, current=i, protect={i}):
                self._stats["loads_on_demand"] += 1
        slot = self._slot_of[i]
        transfer = self._pending.pop(i, None)
        if transfer is not None:
            transfer.wait()  # the copy itself waited for every D2H copy issued before it
        elif self._streams.is_cuda and self._slot_read[slot] is not None:
            # Nothing copied in (a new layer's prefill, an empty window): the compute stream writes the slot next,
            # while the D2H copy of its previous occupant's new tokens may still be reading it.
            torch.cuda.current_stream(self._device).wait_event(self._slot_read[slot])
        return self._views(slot, self.layers[i])

    def _prefetch_after(self, i: int) -> None:
        off = self.offloaded_layers
        if not off or not self.num_prefetch:
            return
        pos = bisect.bisect_right(off, i)
        targets = [j for j in off[pos:] + off[:pos] if j != i and self.layers[j].is_initialized][:self.num_prefetch]
        protect = {i, *targets}
        for j in targets:
            if j not in self._slot_of and self._load(j, current=i, protect=protect):
                self._stats["loads_ahead"] += 1

    def _load(self, j: int, *, current: int, protect: set) -> bool:
        """Gives layer ``j`` a slot and issues the copy of its visible tokens; True if bytes moved."""
        free = [s for s, o in enumerate(self._occupant) if o is None]
        if free:
            slot = free[0]
        else:
            victims = [s for s, o in enumerate(self._occupant) if o not in protect]
            if not victims:
                raise RuntimeError(f"PagedKVCache: all {self.num_slots} slots hold layers in use; raise slots")
            # Evict the occupant needed last: the one furthest ahead in cyclic layer order.
            slot = max(victims, key=lambda s: (self._occupant[s] - current) % len(self.layers))
            victim = self._occupant[slot]
            del self._slot_of[victim]
            self._pending.pop(victim, None)  # a later copy into the slot queues behind it on the H2D stream
        self._occupant[slot], self._slot_of[j] = j, slot
        layer = self.layers[j]
        s, n = layer.start(), layer.length
        if n <= s:
            return False
        if self._streams.is_cuda and self._d2h_event is not None:
            # The slot's previous occupant may still be read by its D2H copy, and j's pages still written.
            self._streams.h2d.wait_event(self._d2h_event)
        k, v = self._views(slot, layer)
        # after=None: the copy also waits for all work queued on the compute stream (the slot's last readers).
        self._streams.to_device(layer.k[s:n], out=k[s:n])
        self._pending[j] = self._streams.to_device(layer.v[s:n], out=v[s:n])  # FIFO: covers the K copy
        self._stats["h2d_bytes"] += _nbytes(k[s:n]) + _nbytes(v[s:n])
        return True

    def _invalidate(self) -> None:
        """Forgets what the slots hold (their contents are re-copied on next use)."""
        self._occupant = [None] * len(self._slot_k)
        self._slot_of.clear()
        self._pending.clear()

    def __repr__(self) -> str:
        n = len(self._paged())
        return (f"{type(self).__name__}(layers={n}, offloaded={len(self.offloaded_layers)}, slots={self.num_slots}, "
                f"prefetch={self.num_prefetch}, capacity={self.capacity})")


TrainStreamCache = PagedKVCache


def _resident_count(resident: float, resident_layers: int | None, n: int) -> int:
    if resident_layers is not None:
        if resident != 0.0:
            raise ValueError("PagedKVCache: pass resident (a fraction) or resident_layers (a count), not both")
        if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or not 0 <= resident_layers <= n:
            raise ValueError(f"PagedKVCache: resident_layers must be an int in [0, {n}], got {resident_layers!r}")
        return resident_layers
    if isinstance(resident, bool) or not isinstance(resident, (int, float)) or not 0.0 <= resident <= 1.0:
        raise ValueError(f"PagedKVCache: resident must be a fraction in [0, 1] of the {n} attention layers, "
                         f"got {resident!r} (use resident_layers=k for a count)")
    return math.floor(resident * n + 1e-9)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_keyword(model) -> str:
    """The keyword ``model.generate`` / ``model(...)`` takes a cache by: ``cache`` from transformers 5.24
    (``past_key_values`` deprecated there), ``past_key_values`` before (5.17 reads no ``cache=``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_keyword(type(base))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
