"""bench cache on the CPU (tiny model): every row decodes the same tokens through generate(), each paged row is set
against its floor, and each row runs in a process of its own whose crash or hang is that row's status."""
import json
import sys
import time

import pytest

from trainstream_hf.bench import cache
from trainstream_hf.bench.__main__ import main
from trainstream_hf.bench.models import model_config

DEVICE_FIGURES = ("device_free_at_start", "device_total", "device_free_after_model", "device_allocated_after_model",
                  "max_allocated", "max_reserved")


def test_every_row_decodes_the_dynamic_caches_tokens_and_paged_rows_get_a_floor(tmp_path, capsys):
    main(["cache", "--quick", "--repeats", "1", "--out", str(tmp_path), "--name", "c"])
    payload = json.loads((tmp_path / "c.json").read_text())
    rows = {r["row"]: r for r in payload["results"]}
    assert list(rows) == list(cache.ROWS) and payload["shape"] == "tiny"
    assert rows["dynamic_offloaded"]["status"].startswith("not run")  # transformers' offloading is CUDA-only
    layers = model_config("tiny").num_hidden_layers
    for name in ("dynamic", "ts_1.0", "ts_0.5", "ts_0.0"):
        r = rows[name]
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["step_ms"] > 0
        assert r["same_tokens"] == 1.0 and len(r["tokens"]) == 2 and len(r["tokens"][0]) == 8  # greedy, exact
        assert r["first_difference"] == [8, 8]  # (no token differs: each sequence's length)
    assert [rows[n]["offloaded_layers"] for n in ("ts_1.0", "ts_0.5", "ts_0.0")] == [0, layers // 2, layers]
    for name in ("ts_1.0", "ts_0.5", "ts_0.0"):  # no bandwidth on the CPU: the floor is the compute step
        assert rows[name]["floor_ms"] == rows["dynamic"]["step_ms"]
        assert rows[name]["vs_floor"] == pytest.approx(rows[name]["step_ms"] / rows["dynamic"]["step_ms"])
    # the offloaded layers' K/V went to host pages (their device slots hold both of tiny's layers: nothing comes back)
    assert rows["ts_0.0"]["cache_stats"]["d2h_bytes"] > 0
    assert rows["ts_1.0"]["cache_stats"]["h2d_bytes"] == rows["ts_1.0"]["cache_stats"]["d2h_bytes"] == 0
    assert "| 2 x 32, 8 new | ts_0.5 | ok |" in capsys.readouterr().out
    for name in ("dynamic", "ts_1.0", "ts_0.5", "ts_0.0"):  # where memory stood (no device figures on the CPU)
        r = rows[name]
        assert {k: r[k] for k in DEVICE_FIGURES} == dict.fromkeys(DEVICE_FIGURES) and r["stage"] == "done"
        assert r["host_available_at_start"] > 0 and r["host_available_after_model"] > 0


def test_kv_bytes_count_k_and_v_of_every_kv_head():
    cfg = model_config("llama3-8b")  # 8 key-value heads of 128
    assert cfg.num_key_value_heads == 8
    assert cache.kv_bytes_per_layer("llama3-8b", 32, 1024) == 2 * 32 * 8 * 128 * 1024 * 2


def test_unknown_rows_and_bad_timeouts_are_named():
    with pytest.raises(ValueError, match=r"unknown row\(s\) \['nope'\]; choose from dynamic"):
        cache.run(rows=["nope"], quick=True)
    with pytest.raises(ValueError, match=r"row_timeout 0: give the seconds a row may run \(> 0\), or None"):
        cache.run(quick=True, row_timeout=0)


def test_a_failing_row_is_a_result_and_the_others_run(monkeypatch):
    real = cache.measure_row

    def flaky(row, *a, **kw):
        if row == "ts_0.5":
            raise RuntimeError("copy engine on fire\nsecond line")
        return real(row, *a, **kw)

    monkeypatch.setattr(cache, "measure_row", flaky)
    partial = []
    payload, md = cache.run(quick=True, repeats=1, rows=["dynamic", "ts_0.5", "ts_0.0"], on_row=partial.append)
    rows = {r["row"]: r for r in payload["results"]}
    assert rows["ts_0.5"]["status"] == "error: RuntimeError: copy engine on fire"
    assert rows["dynamic"]["status"] == "ok" and rows["ts_0.0"]["status"] == "ok"
    # the payload so far after each row, for a JSON that a cut run still leaves behind
    assert [[r["row"] for r in p["results"]] for p in partial] == [["dynamic"], ["dynamic", "ts_0.5"],
                                                                    ["dynamic", "ts_0.5", "ts_0.0"]]
    assert rows["ts_0.5"]["error"] == "copy engine on fire\nsecond line" and rows["ts_0.5"]["max_allocated"] is None


def test_a_row_in_a_child_process_returns_its_tokens_and_memory_figures():
    partial = []
    payload, _ = cache.run(quick=True, repeats=1, rows=["ts_0.0"], isolate=True, on_row=partial.append)
    (r,) = payload["results"]
    here = cache.run_row("dynamic", shape="tiny", batch=2, prompt=32, new=8, repeats=1)
    assert r["status"] == "ok" and r["tokens"] == here["tokens"]  # the child built the same weights and prompts
    assert r["offloaded_layers"] == model_config("tiny").num_hidden_layers and r["cache_stats"]["d2h_bytes"] > 0
    assert {k: r[k] for k in DEVICE_FIGURES} == dict.fromkeys(DEVICE_FIGURES) and r["stage"] == "done"
    assert r["host_available_at_start"] > 0 and r["host_available_after_model"] > 0 and r["wall_s"] > 0
    assert "log_tail" not in r and partial == [payload] and json.loads(json.dumps(payload)) == payload


def _fake_children(monkeypatch, before: dict) -> None:
    """Each row's child process replaced by a small Python program that runs ``before[row](out)`` (code) and then
    writes an ``ok`` row: a step of 2 ms, the same tokens in every row."""
    def command(what, args, out):
        row = {"row": what, "status": "ok", "tokens": [[1, 2], [3, 4]], "step_ms": 2.0, "prefill_s": 0.1,
               "tokens_per_s": 10.0, "offloaded_layers": 1, "max_reserved": None}
        code = before.get(what, lambda _out: "")(out) + f"\nimport json; json.dump({row!r}, open({out!r}, 'w'))"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(cache, "_child_command", command)


def test_a_row_whose_process_dies_is_a_result_and_the_next_rows_run(monkeypatch):
    _fake_children(monkeypatch, {"ts_0.5": lambda out: "raise RuntimeError('copy engine on fire')"})
    partial = []
    payload, md = cache.run(quick=True, rows=["dynamic", "ts_0.5", "ts_0.0"], isolate=True, on_row=partial.append)
    rows = {r["row"]: r for r in payload["results"]}
    assert rows["ts_0.5"]["status"] == "crashed (exit 1): RuntimeError: copy engine on fire"
    assert rows["ts_0.5"]["log_tail"][0] == "Traceback (most recent call last):"
    assert rows["dynamic"]["status"] == "ok" and rows["ts_0.0"]["status"] == "ok"
    assert rows["ts_0.0"]["same_tokens"] == 1.0 and rows["ts_0.0"]["vs_floor"] == 1.0  # the parent's sums
    assert [len(p["results"]) for p in partial] == [1, 2, 3]
    assert "| 2 x 32, 8 new | ts_0.5 | crashed (exit 1): RuntimeError: copy engine on fire |" in md


def test_a_row_that_outlives_its_timeout_is_stopped_and_keeps_what_it_wrote(monkeypatch):
    started = {"row": "ts_0.5", "status": "running", "stage": "generate", "host_available_at_start": 123}
    _fake_children(monkeypatch, {"ts_0.5": lambda out: (
        f"import json, time; json.dump({started!r}, open({out!r}, 'w')); print('decoding', flush=True); "
        "time.sleep(60)")})
    t0 = time.perf_counter()
    payload, _ = cache.run(quick=True, rows=["dynamic", "ts_0.5", "ts_0.0"], isolate=True, row_timeout=1)
    assert time.perf_counter() - t0 < 30
    rows = {r["row"]: r for r in payload["results"]}
    assert rows["ts_0.5"]["status"] == "timeout after 1 s" and rows["ts_0.5"]["log_tail"] == ["decoding"]
    assert rows["ts_0.5"]["stage"] == "generate" and rows["ts_0.5"]["host_available_at_start"] == 123
    assert rows["dynamic"]["status"] == "ok" and rows["ts_0.0"]["status"] == "ok"


@pytest.mark.parametrize("suite", ["cache", "table"])
def test_a_row_timeout_that_is_no_time_is_refused_in_one_line(suite, capsys):
    with pytest.raises(SystemExit):
        main([suite, "--quick", "--row-timeout", "0"])
    assert "--row-timeout 0: give the seconds a row's process may run (> 0)" in capsys.readouterr().err


def test_rows_decode_one_token_a_step_through_their_cache():
    """The bench models are built for training (use_cache=False), where generate() feeds the whole sequence at every
    step and a given cache takes it all again (attention over duplicated keys). A row's model decodes one token a
    step: the cache ends holding the prompt and the new tokens but the last, once each."""
    import torch
    from transformers import DynamicCache

    from trainstream_hf.bench.models import build_model

    model = cache.for_generation(build_model("tiny", torch.float32, "cpu", seed=0))
    seen, forward = [], model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    model.forward = spy
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    kv = DynamicCache(config=model.config)
    tokens, seconds, arrivals = cache._generate(model, ids, 4, kv)
    assert seen == [16, 1, 1, 1] and kv.get_seq_length() == 16 + 3 and tokens.shape == (2, 4)
    # one arrival a new token, in order, within the call: the prefill and the steps come from this one run
    assert len(arrivals) == 4 and arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] <= seconds


def test_first_difference_is_per_sequence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert cache._first_difference([[1, 2, 9, 4], [0, 6, 7, 8]], ref) == [2, 0]
    assert cache._first_difference(ref, ref) == [4, 4] and cache._first_difference([[1, 2]], ref) is None


def test_a_deeper_prefetch_row_decodes_the_same_tokens(tmp_path):
    """``ts_0.5_p2`` (asked for by name): resident=0.5 with two offloaded layers copied ahead, three slots."""
    made = []
    real = cache._cache

    def spy(row, model, max_cache_len):
        kv = real(row, model, max_cache_len)
        made.append((row, getattr(kv, "num_slots", None), getattr(kv, "num_prefetch", None)))
        return kv

    cache._cache = spy
    try:
        payload, _ = cache.run(quick=True, rows=["dynamic", "ts_0.5_p2"], repeats=1)
    finally:
        cache._cache = real
    rows = {r["row"]: r for r in payload["results"]}
    assert rows["ts_0.5_p2"]["status"] == "ok" and rows["ts_0.5_p2"]["same_tokens"] == 1.0
    assert ("ts_0.5_p2", 3, 2) in made
    with pytest.raises(ValueError, match="unknown row"):
        cache.run(quick=True, rows=["ts_0.5_p9"])


@pytest.mark.parametrize("row", cache.ALL_ROWS + ("bandwidth",))
def test_the_child_process_takes_every_row_the_suite_runs(row, capsys):
    """The suite runs each row as ``--child ROW`` (isolate=True, the default on the GPU); the rows named by --peers
    only (ts_0.5_p2, ts_0.5_p3) were refused there as an invalid choice at 2026-12-07's H100 run."""
    with pytest.raises(SystemExit):
        cache.main(["--child", row])  # no --json: the parser accepted the row, then asks for the rest
    assert "give --child ROW --json OUT" in capsys.readouterr().err
