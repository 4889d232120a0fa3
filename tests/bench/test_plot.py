import json

import pytest

from trainstream_hf.bench import plot


def _payload():
    return {"environment": {"commit": "abc", "date": "2026-12-03", "gpu": {"name": "NVIDIA H200"}},
            "results": [
                {"name": "bf16 + PEFT", "status": "ok", "step_s": 0.24, "max_allocated": 36 * 2**30,
                 "max_reserved": 38 * 2**30},
                {"name": "trainstream LoRA", "status": "ok", "step_s": 0.30, "max_allocated": 20 * 2**30,
                 "max_reserved": 22 * 2**30, "vram_budget": 24 * 2**30},
                {"name": "nf4 dequant", "status": "ok", "step_ms": 1.5},
                {"name": "bnb", "status": "not run: bitsandbytes not installed"},
            ]}


def test_rows_split_ran_and_not_run():
    ran, skipped = plot.rows_to_plot(_payload())
    assert [r["label"] for r in ran] == ["bf16 + PEFT", "trainstream LoRA", "nf4 dequant"]
    assert ran[2]["step_s"] == pytest.approx(1.5e-3) and ran[2]["alloc_gib"] is None
    assert ran[1]["budget_gib"] == 24 and ran[0]["reserved_gib"] == 38
    assert skipped == [{"label": "bnb", "status": "not run: bitsandbytes not installed"}]


def test_png_written(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(_payload()))
    out = plot.plot(str(path))
    assert out == str(tmp_path / "engine.png")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no 'results' list"):
        plot.rows_to_plot({"bandwidth": {}})
    path = tmp_path / "none.json"
    path.write_text(json.dumps({"results": [{"name": "x", "status": "not run: no GPU"}]}))
    with pytest.raises(ValueError, match="no row"):
        plot.plot(str(path))
