"""bench cache on the CPU (tiny model): every row decodes the same tokens through generate(), and each paged row
is set against its floor."""
import json

import pytest

from trainstream_hf.bench import cache
from trainstream_hf.bench.__main__ import main
from trainstream_hf.bench.models import model_config


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
    assert [rows[n]["offloaded_layers"] for n in ("ts_1.0", "ts_0.5", "ts_0.0")] == [0, layers // 2, layers]
    for name in ("ts_1.0", "ts_0.5", "ts_0.0"):  # no bandwidth on the CPU: the floor is the compute step
        assert rows[name]["floor_ms"] == rows["dynamic"]["step_ms"]
        assert rows[name]["vs_floor"] == pytest.approx(rows[name]["step_ms"] / rows["dynamic"]["step_ms"])
    assert rows["ts_0.0"]["cache_stats"]["h2d_bytes"] > 0 and rows["ts_1.0"]["cache_stats"]["h2d_bytes"] == 0
    assert "| 2 x 32, 8 new | ts_0.5 | ok |" in capsys.readouterr().out


def test_kv_bytes_count_k_and_v_of_every_kv_head():
    cfg = model_config("llama3-8b")  # 8 key-value heads of 128
    assert cfg.num_key_value_heads == 8
    assert cache.kv_bytes_per_layer("llama3-8b", 32, 1024) == 2 * 32 * 8 * 128 * 1024 * 2


def test_unknown_rows_are_named():
    with pytest.raises(ValueError, match=r"unknown row\(s\) \['nope'\]; choose from dynamic"):
        cache.run(rows=["nope"], quick=True)


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
    # the payload so far after each setting (one in a quick run), for a JSON that a cut run still leaves behind
    assert len(partial) == 1 and [r["row"] for r in partial[0]["results"]] == ["dynamic", "ts_0.5", "ts_0.0"]
