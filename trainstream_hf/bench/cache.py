"""bench cache: greedy decoding through ``generate()`` with each KV cache, and the floor each paged row is held to.

Rows, on one model with random weights and one batch of random prompts, each setting ``batch x prompt`` tokens with
``new`` tokens generated (``min_new_tokens = max_new_tokens``, so every row decodes as many steps):

* ``dynamic``: transformers' ``DynamicCache`` (every layer's K/V on the device);
* ``ts_1.0``, ``ts_0.5``, ``ts_0.0``: :class:`~trainstream_hf.cache.TrainStreamCache` with that fraction of the
  layers resident, the rest streamed from pinned host pages while earlier layers compute;
* ``dynamic_offloaded``: ``DynamicCache(offloading=True)``, transformers' own offloaded cache;
* by name only (``--peers``): ``ts_0.5_p2``, ``ts_0.5_p3``, resident 0.5 with 2 or 3 offloaded layers copied ahead.

Each row reports the whole ``generate`` call's tokens per second, the prefill (the call's start to the first new
token) and the mean decode step (the first new token to the last, over ``new - 1`` steps), both timed in the same
runs by a streamer that notes each token's arrival on the host. A paged row's **floor** is the slowest of what it
cannot avoid: the compute of a decode step (the ``dynamic`` row's step, every K/V on the device) and its offloaded
layers' K/V bytes at the mean context length over the pinned host-to-device bandwidth measured in the same run;
``vs_floor`` is its step over that floor. ``same_tokens`` is the fraction of generated tokens equal to the
``dynamic`` row's, and ``first_difference`` per sequence the index of the first one that differs
(``_first_difference`` says why greedy decoding of random bf16 weights parts anyway).

Every row (one cache at one setting) runs in a child process of its own (``python -m trainstream_hf.bench.cache
--child ROW ...``), which builds the model (the same seeded weights in each) and the prompts (the same seed) itself,
so an out-of-memory, a crash, a leak or a hang of one row cannot touch the next: a child that dies is a row with
status ``crashed (exit N): ...``, one that outlives ``row_timeout`` a row with status ``timeout after N s``. The
pinned bandwidth is measured in a child too. The parent gets each row's tokens back (a list) for ``same_tokens``,
and hands the payload so far to ``on_row`` after every row (a run stopped part way keeps what it measured). A quick
run on the CPU (the tests') runs its rows one after another in its own process instead, each building its own model
all the same.

Each row records where memory stood, in bytes (None where there is no such figure, the device's on the CPU):
``device_free_at_start``, ``device_total`` (``torch.cuda.mem_get_info()``) and ``host_available_at_start`` (host
``MemAvailable``, /proc/meminfo) before the model is built; ``device_free_after_model``,
``host_available_after_model`` and ``device_allocated_after_model`` (``torch.cuda.memory_allocated()``) once it is;
``max_allocated`` and ``max_reserved``, the allocator's peaks over the row. A failed row keeps the figures it reached
(a child writes them as it goes, so a crashed or stopped one keeps them too), its status holds the error's first line
(up to 400 characters), ``error`` the error's text (up to 2000) and a child's failure ``log_tail``, the last lines
it printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

import torch

from trainstream_hf.bench.common import markdown_table
from trainstream_hf.bench.harness import free_memory, is_oom, run_child
from trainstream_hf.bench.models import build_model, model_config
from trainstream_hf.engine.arena import host_memory_available

ROWS = ("dynamic", "ts_1.0", "ts_0.5", "ts_0.0", "dynamic_offloaded")
# Asked for by name (--peers): TrainStreamCache at resident=0.5 copying k offloaded layers ahead (slots k + 1) instead
# of the default one; each slot is one more layer's K/V on the device.
OPTIONAL_ROWS = ("ts_0.5_p2", "ts_0.5_p3")
ALL_ROWS = ROWS + OPTIONAL_ROWS
SETTINGS = ((8, 2048, 128), (32, 1024, 64))  # (batch, prompt tokens, new tokens): the table of issue 27
COLUMNS = ("setting", "row", "status", "tokens_per_s", "prefill_s", "step_ms", "floor_ms", "vs_floor",
           "offloaded_layers", "same_tokens")
ROW_TIMEOUT = 240.0  # seconds a row's child process may run, building its model included
STATUS_CHARS, ERROR_CHARS = 400, 2000  # a failed row's error in its status and in full
GiB = 2**30


def _cache(row: str, model, max_cache_len: int):
    from transformers import DynamicCache

    from trainstream_hf.cache import TrainStreamCache

    if row == "dynamic":
        return DynamicCache(config=model.config)
    if row == "dynamic_offloaded":
        return DynamicCache(config=model.config, offloading=True)
    resident, _, ahead = row[3:].partition("_p")
    prefetch = int(ahead) if ahead else 1
    return TrainStreamCache(model, resident=float(resident), max_cache_len=max_cache_len, prefetch=prefetch,
                            slots=max(2, prefetch + 1))


def _close(cache, failed: bool) -> None:
    """Closes a cache that has ``close`` (its device slots, pinned pages and arena go back); after a failed
    ``generate`` an error of the close itself is dropped, so the row reports the first one."""
    if not hasattr(cache, "close"):
        return
    try:
        cache.close()
    except Exception:  # noqa: BLE001 - the generate's error is the one to report
        if not failed:
            raise


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TokenClock:
    """A ``generate`` streamer that notes when each new token reached the host (after the device's queue drained):
    the prefill and the decode steps then come from one run, and no figure is a difference of two runs' timings."""

    def __init__(self, device: torch.device):
        self.device, self.times, self._prompt = device, [], True

    def put(self, value) -> None:
        if self._prompt:  # generate's first put is the prompt itself
            self._prompt = False
            return
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(model, ids: torch.Tensor, new: int, cache) -> tuple[torch.Tensor, float, list]:
    """``generate`` of ``new`` tokens: the tokens, the whole call's seconds and, per new token, the seconds from the
    call's start to the token's arrival."""
    from trainstream_hf.cache import cache_keyword

    clock = _TokenClock(ids.device)
    _sync(ids.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0, streamer=clock,
                             **{cache_keyword(model): cache})
    _sync(ids.device)
    return out[:, ids.shape[1]:], time.perf_counter() - t0, [t - t0 for t in clock.times]


def kv_bytes_per_layer(shape: str, batch: int, tokens: int, element_size: int = 2) -> int:
    """K and V of one attention layer for ``batch`` sequences of ``tokens`` tokens."""
    cfg = model_config(shape)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * batch * cfg.num_key_value_heads * head_dim * tokens * element_size


def _once(row: str, model, ids: torch.Tensor, want: int, max_len: int) -> tuple[torch.Tensor, float, dict]:
    """One ``generate`` of ``want`` tokens with a fresh cache of ``row``'s kind, closed afterwards (a failed one
    too): its tokens, its seconds and the cache's figures (``offloaded_layers``, and ``cache_stats`` where it keeps
    them)."""
    cache = _cache(row, model, max_len)
    try:
        tokens, seconds, arrivals = _generate(model, ids, want, cache)
    except BaseException:
        _close(cache, failed=True)
        raise
    figures = {"offloaded_layers": len(getattr(cache, "offloaded_layers", []) or []), "arrivals": arrivals}
    if hasattr(cache, "stats"):
        figures["cache_stats"] = cache.stats()
    _close(cache, failed=False)
    return tokens, seconds, figures


def measure_row(row: str, model, ids: torch.Tensor, new: int, repeats: int) -> dict:
    """One row: the medians over ``repeats`` whole ``new``-token ``generate`` runs, each with a fresh cache, of the
    whole call, of the prefill (the call's start to the first new token) and of the mean decode step (the first new
    token to the last, over ``new - 1`` steps); the tokens and cache figures of the last run."""
    prefill, total, steps, out = [], [], [], {"row": row}
    for _ in range(repeats):
        tokens, seconds, figures = _once(row, model, ids, new, ids.shape[1] + new)
        arrivals = figures.pop("arrivals")
        total.append(seconds)
        prefill.append(arrivals[0])
        steps.append((arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1))
        out.update(tokens=tokens.cpu(), **figures)
    out["prefill_s"], out["total_s"] = statistics.median(prefill), statistics.median(total)
    out["step_ms"] = statistics.median(steps) * 1e3
    out["tokens_per_s"] = ids.shape[0] * new / out["total_s"]
    return out


def for_generation(model):
    """``model`` (a bench model: built for training, ``use_cache=False``) set up to decode as the suite measures it:
    eval mode, the cache on (with ``use_cache=False`` ``generate`` feeds the whole sequence at every step and the
    given cache takes it all again: each step a full forward over attention to duplicated keys), and no end-of-text
    token (random weights: every row decodes every step)."""
    model.eval()
    model.config.use_cache = True
    model.generation_config.use_cache = True
    model.generation_config.eos_token_id = None
    return model


def memory_now(when: str, device: torch.device) -> dict:
    """``device_free_<when>`` and ``device_total`` (``torch.cuda.mem_get_info``, None off CUDA) and
    ``host_available_<when>`` (:func:`~trainstream_hf.engine.arena.host_memory_available`), in bytes."""
    free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (None, None)
    return {f"device_free_{when}": free, "device_total": total, f"host_available_{when}": host_memory_available()}


def _prompts(model, batch: int, prompt: int, device: torch.device) -> torch.Tensor:
    """The random prompts of a setting, the same in every row's process (one seed)."""
    return torch.randint(0, model.config.vocab_size, (batch, prompt),
                         generator=torch.Generator().manual_seed(1)).to(device)


def run_row(row: str, *, shape: str, batch: int, prompt: int, new: int, repeats: int, device: str = "cpu",
            report: Optional[Callable[[dict], None]] = None) -> dict:
    """One row from nothing in this process (what a row's child process runs): the model (seeded random weights)
    and the prompts built here, the row measured by :func:`measure_row`, and the memory figures of the module
    docstring. The row's own failure is its status (out of memory, or the error's first line), not raised.
    Before the timed runs, one untimed two-token ``generate`` with a cache of the row's kind (a fresh process
    loads its kernels on its first calls). ``report`` gets the row so far after each stage (``stage``: building
    the model, warm-up, generate, done)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    report = report or (lambda _row: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    out = {"row": row, "status": "running", "stage": "building the model", **memory_now("at_start", dev)}
    report(out)
    model = None
    try:
        model = for_generation(build_model(shape, torch.bfloat16, dev, seed=0))
        out.update(memory_now("after_model", dev), stage="warm-up",
                   device_allocated_after_model=torch.cuda.memory_allocated(dev) if cuda else None)
        report(out)
        ids = _prompts(model, batch, prompt, dev)
        _once(row, model, ids, 2, prompt + new)  # untimed: this process's first kernels load here
        out["stage"] = "generate"
        report(out)
        measured = measure_row(row, model, ids, new, repeats)
        out.update(measured, status="ok", tokens=measured["tokens"].tolist())
    except Exception as err:  # noqa: BLE001 - reported in the table, not raised
        traceback.print_exc()
        text = str(err)
        first = (text.splitlines() or [""])[0][:STATUS_CHARS]
        out["status"] = f"out of memory: {first}" if is_oom(err) else f"error: {type(err).__name__}: {first}"
        out["error"] = text[:ERROR_CHARS]
    finally:
        out["max_allocated"] = torch.cuda.max_memory_allocated(dev) if cuda else None
        out["max_reserved"] = torch.cuda.max_memory_reserved(dev) if cuda else None
        del model
        try:
            free_memory()
        except Exception:  # noqa: BLE001 - an error that sticks to the CUDA context: the row is written all the same
            traceback.print_exc()
    out["stage"] = "done"
    report(out)
    return out


def _write(path: str, result: dict) -> None:
    """``result`` as JSON at ``path``, whole or not at all (written aside, then renamed)."""
    with open(f"{path}.partial", "w") as f:
        json.dump(result, f)
    os.replace(f"{path}.partial", path)


def _child_command(what: str, args: dict, out: str) -> list[str]:
    """The command of the child process that measures ``what`` (a row of :data:`ROWS`, or ``bandwidth``) and writes
    it to ``out``."""
    return [sys.executable, "-m", "trainstream_hf.bench.cache", "--child", what, "--json", out,
            "--child-args", json.dumps(args)]


def _child(what: str, args: dict, timeout: Optional[float]) -> dict:
    """``what`` in a child process (:func:`~trainstream_hf.bench.harness.run_child`: what it wrote last, with its
    status where it died or outlived ``timeout`` seconds, and its last lines of output)."""
    return run_child(lambda out: _child_command(what, args, out), timeout)


def _same_tokens(tokens: list, ref: list) -> Optional[float]:
    """The fraction of ``tokens`` equal to ``ref``'s (None where their shapes differ)."""
    a, b = torch.tensor(tokens), torch.tensor(ref)
    return float((a == b).float().mean()) if a.shape == b.shape else None


def _first_difference(tokens: list, ref: list) -> Optional[list[int]]:
    """Per sequence, the index of the first generated token that differs from ``ref``'s (its length where none does;
    None where the shapes differ). Greedy decoding of random bf16 weights meets near-ties in the logits, where any
    other summation order (another attention kernel, another K/V layout) picks another token and the rest of the
    sequence follows it: a divergence late in a sequence says that, one at token 0 a wrong prefill."""
    a, b = torch.tensor(tokens), torch.tensor(ref)
    if a.shape != b.shape:
        return None
    differs = a != b
    return [int(d.nonzero()[0, 0]) if d.any() else int(d.numel()) for d in differs]


def _setting_rows(measured: list[dict], shape: str, batch: int, prompt: int, new: int, bandwidth: dict,
                  quick: bool) -> list[dict]:
    """A setting's rows so far as the payload holds them: each with its ``setting``, and each ``ok`` one with
    ``same_tokens`` against the ``dynamic`` row's and, for a paged row, its floor (module docstring); the tokens
    themselves only in a quick run."""
    ref = next((m for m in measured if m["row"] == "dynamic" and m["status"] == "ok"), None)
    mean_ctx = prompt + new // 2
    rows = []
    for m in measured:
        m = {**m, "setting": f"{batch} x {prompt}, {new} new"}
        if m["status"] == "ok":
            if ref is not None:
                m["same_tokens"] = _same_tokens(m["tokens"], ref["tokens"])
                m["first_difference"] = _first_difference(m["tokens"], ref["tokens"])
            if m["row"].startswith("ts_") and ref is not None:
                kv = m["offloaded_layers"] * kv_bytes_per_layer(shape, batch, mean_ctx)
                copy_ms = kv / (bandwidth["h2d_GBps"] * 1e9) * 1e3 if bandwidth.get("h2d_GBps") else 0.0
                m["floor_ms"] = max(ref["step_ms"], copy_ms)
                m["offloaded_kv_bytes_per_step"] = kv
                m["vs_floor"] = m["step_ms"] / m["floor_ms"]
            m["tokens"] = m["tokens"] if quick else None
        rows.append(m)
    return rows


def _line(setting: str, m: dict, seconds: float) -> str:
    """A row's line on stderr: its status, tokens/s, and the device memory it found and reached."""
    text = f"[cache] {setting}: {m['row']} {m['status']}"
    if m["status"] == "ok":
        text += f", {m['tokens_per_s']:.0f} tokens/s"
    figures = [f"{label} {m[key] / GiB:.1f} GiB" for label, key in (
        ("device free at start", "device_free_at_start"), ("after the model", "device_free_after_model"),
        ("peak reserved", "max_reserved")) if m.get(key) is not None]
    return text + (f" [{', '.join(figures)}]" if figures else "") + f" ({seconds:.0f} s)"


def run(*, shape: Optional[str] = None, settings=None, rows: Optional[list[str]] = None, repeats: int = 3,
        quick: bool = False, device: Optional[torch.device] = None,
        on_row: Optional[Callable[[dict], None]] = None, row_timeout: Optional[float] = ROW_TIMEOUT,
        isolate: Optional[bool] = None) -> tuple[dict, str]:
    """Every row of :data:`ROWS` (or ``rows``) for each ``(batch, prompt, new)`` of ``settings``, each in a child
    process of its own that may run ``row_timeout`` seconds (None: no limit); returns (payload, markdown). Each
    row's line goes to stderr as it ends, and ``on_row`` gets the payload so far after each row (a run stopped part
    way keeps what it measured). ``isolate=False`` runs the rows in this process (the default for a quick run on
    the CPU).

    Raises:
        ValueError: an unknown row name, or a ``row_timeout`` that is not a positive number of seconds.
    """
    from trainstream_hf.bench.peers import measure_pinned_bandwidth

    rows = list(ROWS) if rows is None else rows
    unknown = [r for r in rows if r not in ALL_ROWS]
    if unknown:
        raise ValueError(f"bench cache: unknown row(s) {unknown}; choose from {', '.join(ALL_ROWS)}")
    if row_timeout is not None and not row_timeout > 0:
        raise ValueError(f"bench cache: row_timeout {row_timeout}: give the seconds a row may run (> 0), or None "
                         "for no limit")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    isolate = not (quick and device.type == "cpu") if isolate is None else isolate
    shape = shape or ("tiny" if quick else "llama3-8b")
    settings = settings or (((2, 32, 8),) if quick else SETTINGS)
    if device.type != "cuda":
        bandwidth = {"h2d_GBps": None, "status": "not run: CPU"}
    else:
        bandwidth = _child("bandwidth", {}, row_timeout) if isolate else measure_pinned_bandwidth()
    results: list[dict] = []
    for batch, prompt, new in settings:
        setting = f"{batch} x {prompt}, {new} new"
        args = dict(shape=shape, batch=batch, prompt=prompt, new=new, repeats=repeats, device=str(device))
        measured: list[dict] = []
        shown: list[dict] = []
        for r in rows:
            t0 = time.perf_counter()
            if r == "dynamic_offloaded" and device.type != "cuda":
                m = {"row": r, "status": "not run: transformers' offloading copies on CUDA streams"}
            elif isolate:
                m = {"row": r, **_child(r, args, row_timeout)}
            else:
                m = run_row(r, **args)
            measured.append(m)
            print(_line(setting, m, time.perf_counter() - t0), file=sys.stderr, flush=True)
            shown = _setting_rows(measured, shape, batch, prompt, new, bandwidth, quick)
            if on_row is not None:
                on_row(_payload(shape, settings, repeats, bandwidth, results + shown))
        results += shown
    payload = _payload(shape, settings, repeats, bandwidth, results)
    title = f"generate() with each KV cache, {shape}, greedy, random weights ({device.type})"
    return payload, f"{title}\n\n{markdown_table(results, COLUMNS)}"


def _payload(shape, settings, repeats: int, bandwidth: dict, results: list) -> dict:
    return {"suite": "cache", "shape": shape, "settings": [list(x) for x in settings], "repeats": repeats,
            "pinned_bandwidth": bandwidth, "results": list(results)}


def _end_with_parent() -> None:
    """Asks Linux to kill this process when its parent dies (``PR_SET_PDEATHSIG``): a row's child whose suite was
    killed does not go on holding the device into whatever runs next. Nothing where there is no such call."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv=None) -> None:
    """``--child ROW --json OUT --child-args ARGS``: one row (:func:`run_row`), written to OUT as it goes;
    ``--child bandwidth --json OUT``: the pinned host-device bandwidth (the suite's child processes; see the module
    docstring)."""
    parser = argparse.ArgumentParser(prog="python -m trainstream_hf.bench.cache",
                                     description="one child process of python -m trainstream_hf.bench cache")
    parser.add_argument("--child", choices=ALL_ROWS + ("bandwidth",))
    parser.add_argument("--json")
    parser.add_argument("--child-args", default="{}")
    a = parser.parse_args(argv)
    if not (a.child and a.json):
        parser.error("give --child ROW --json OUT --child-args ARGS (one row; python -m trainstream_hf.bench cache "
                     "runs the whole suite)")
    _end_with_parent()
    try:
        args = json.loads(a.child_args)
    except json.JSONDecodeError as err:
        parser.error(f"--child-args: not JSON ({err}); give the row's arguments as a JSON object")
    if a.child == "bandwidth":
        from trainstream_hf.bench.peers import measure_pinned_bandwidth
        _write(a.json, measure_pinned_bandwidth())
        return
    run_row(a.child, report=lambda row: _write(a.json, row), **args)


if __name__ == "__main__":
    main()
