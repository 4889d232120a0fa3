"""bench cache: greedy decoding through ``generate()`` with each KV cache, and the floor each paged row is held to.

Rows, on one model with random weights and one batch of random prompts, each setting ``batch x prompt`` tokens with
``new`` tokens generated (``min_new_tokens = max_new_tokens``, so every row decodes as many steps):

* ``dynamic``: transformers' ``DynamicCache`` (every layer's K/V on the device);
* ``ts_1.0``, ``ts_0.5``, ``ts_0.0``: :class:`~trainstream_hf.cache.TrainStreamCache` with that fraction of the
  layers resident, the rest streamed from pinned host pages while earlier layers compute;
* ``dynamic_offloaded``: ``DynamicCache(offloading=True)``, transformers' own offloaded cache.

Each row reports the whole ``generate`` call's tokens per second, the prefill (a one-token ``generate``) and the mean
decode step: ``(total - prefill) / (new - 1)``. A paged row's **floor** is the slowest of what it cannot avoid: the
compute of a decode step (the ``dynamic`` row's step, every K/V on the device) and its offloaded layers' K/V bytes
at the mean context length over the pinned host-to-device bandwidth measured in the same run; ``vs_floor`` is its
step over that floor. ``same_tokens`` is the fraction of generated tokens equal to the ``dynamic`` row's.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Optional

import torch

from trainstream_hf.bench.common import markdown_table
from trainstream_hf.bench.harness import free_memory
from trainstream_hf.bench.models import build_model, model_config

ROWS = ("dynamic", "ts_1.0", "ts_0.5", "ts_0.0", "dynamic_offloaded")
SETTINGS = ((8, 2048, 128), (32, 1024, 64))  # (batch, prompt tokens, new tokens): the table of issue 27
COLUMNS = ("setting", "row", "status", "tokens_per_s", "prefill_s", "step_ms", "floor_ms", "vs_floor",
           "offloaded_layers", "same_tokens")


def _cache(row: str, model, max_cache_len: int):
    from transformers import DynamicCache

    from trainstream_hf.cache import TrainStreamCache

    if row == "dynamic":
        return DynamicCache(config=model.config)
    if row == "dynamic_offloaded":
        return DynamicCache(config=model.config, offloading=True)
    return TrainStreamCache(model, resident=float(row[3:]), max_cache_len=max_cache_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, ids: torch.Tensor, new: int, cache) -> tuple[torch.Tensor, float]:
    from trainstream_hf.cache import cache_keyword

    _sync(ids.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0, **{cache_keyword(model): cache})
    _sync(ids.device)
    return out[:, ids.shape[1]:], time.perf_counter() - t0


def kv_bytes_per_layer(shape: str, batch: int, tokens: int, element_size: int = 2) -> int:
    """K and V of one attention layer for ``batch`` sequences of ``tokens`` tokens."""
    cfg = model_config(shape)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * batch * cfg.num_key_value_heads * head_dim * tokens * element_size


def measure_row(row: str, model, ids: torch.Tensor, new: int, repeats: int) -> dict:
    """One row: the median over ``repeats`` of a one-token ``generate`` (prefill) and of the whole ``new``-token one,
    each with a fresh cache; the tokens of the last whole run."""
    max_len = ids.shape[1] + new
    prefill, total, out = [], [], {"row": row}
    for _ in range(repeats):
        for want, into in ((1, prefill), (new, total)):
            cache = _cache(row, model, max_len)
            tokens, seconds = _generate(model, ids, want, cache)
            into.append(seconds)
            if want == new:  # the last whole run's tokens and cache figures
                out["tokens"] = tokens.cpu()
                out["offloaded_layers"] = len(getattr(cache, "offloaded_layers", []) or [])
                if hasattr(cache, "stats"):
                    out["cache_stats"] = cache.stats()
            if hasattr(cache, "close"):
                cache.close()
    out["prefill_s"], out["total_s"] = statistics.median(prefill), statistics.median(total)
    out["step_ms"] = (out["total_s"] - out["prefill_s"]) / max(1, new - 1) * 1e3
    out["tokens_per_s"] = ids.shape[0] * new / out["total_s"]
    return out


def _guarded_row(row: str, model, ids, new: int, repeats: int) -> dict:
    """:func:`measure_row`, or the row's failure as its status (out of memory, or the error's first line): one row's
    failure is a result, and the others still run."""
    try:
        return {"status": "ok", **measure_row(row, model, ids, new, repeats)}
    except torch.OutOfMemoryError as err:
        status = f"out of memory: {str(err).splitlines()[0][:160]}"
    except Exception as err:  # noqa: BLE001 - reported in the table, not raised
        status = f"error: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
    free_memory()
    return {"row": row, "status": status}


def run(*, shape: Optional[str] = None, settings=None, rows: Optional[list[str]] = None, repeats: int = 3,
        quick: bool = False, device: Optional[torch.device] = None,
        on_row: Optional[Callable[[dict], None]] = None) -> tuple[dict, str]:
    """Every row of :data:`ROWS` (or ``rows``) for each ``(batch, prompt, new)`` of ``settings``; returns (payload,
    markdown). Each row's line goes to stderr as it ends, and ``on_row`` gets the payload so far after each setting
    (a run stopped part way keeps what it measured).

    Raises:
        ValueError: an unknown row name.
    """
    from trainstream_hf.bench.peers import measure_pinned_bandwidth

    rows = list(ROWS) if rows is None else rows
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"bench cache: unknown row(s) {unknown}; choose from {', '.join(ROWS)}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = shape or ("tiny" if quick else "llama3-8b")
    settings = settings or (((2, 32, 8),) if quick else SETTINGS)
    bandwidth = measure_pinned_bandwidth() if device.type == "cuda" else {"h2d_GBps": None, "status": "not run: CPU"}
    model = build_model(shape, torch.bfloat16, device, seed=0).eval()
    model.generation_config.eos_token_id = None  # random weights: every row decodes every step
    results = []
    try:
        for batch, prompt, new in settings:
            ids = torch.randint(0, model.config.vocab_size, (batch, prompt),
                                generator=torch.Generator().manual_seed(1)).to(device)
            measured = []
            for r in rows:
                t0 = time.perf_counter()
                measured.append({"row": r, "status": "not run: transformers' offloading copies on CUDA streams"}
                                if r == "dynamic_offloaded" and device.type != "cuda" else
                                _guarded_row(r, model, ids, new, repeats))
                m = measured[-1]
                print(f"[cache] {batch} x {prompt}, {new} new: {r} {m['status']}"
                      + (f", {m['tokens_per_s']:.0f} tokens/s" if m["status"] == "ok" else "")
                      + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            ref = next((m for m in measured if m["row"] == "dynamic"), None)
            ref_tokens = None if ref is None else ref["tokens"]
            mean_ctx = prompt + new // 2
            for m in measured:
                m["setting"] = f"{batch} x {prompt}, {new} new"
                if m["status"] != "ok":
                    results.append(m)
                    continue
                if ref is not None:
                    m["same_tokens"] = float((m["tokens"] == ref_tokens).float().mean())
                if m["row"].startswith("ts_") and ref is not None:
                    kv = m["offloaded_layers"] * kv_bytes_per_layer(shape, batch, mean_ctx)
                    copy_ms = kv / (bandwidth["h2d_GBps"] * 1e9) * 1e3 if bandwidth.get("h2d_GBps") else 0.0
                    m["floor_ms"] = max(ref["step_ms"], copy_ms)
                    m["offloaded_kv_bytes_per_step"] = kv
                    m["vs_floor"] = m["step_ms"] / m["floor_ms"]
                m["tokens"] = m["tokens"].tolist() if quick else None  # the tokens themselves only in a quick run
                results.append(m)
            free_memory()
            if on_row is not None:
                on_row(_payload(shape, settings, repeats, bandwidth, results))
    finally:
        del model
        free_memory()
    payload = _payload(shape, settings, repeats, bandwidth, results)
    title = f"generate() with each KV cache, {shape}, greedy, random weights ({device.type})"
    return payload, f"{title}\n\n{markdown_table(results, COLUMNS)}"


def _payload(shape, settings, repeats: int, bandwidth: dict, results: list) -> dict:
    return {"suite": "cache", "shape": shape, "settings": [list(x) for x in settings], "repeats": repeats,
            "pinned_bandwidth": bandwidth, "results": list(results)}
