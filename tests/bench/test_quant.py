"""The quant benchmark suite on the CPU: one tiny block's linear layers through every row, end to end."""
import json
import sys

import pytest
import torch

from trainstream_hf.bench import quant
from trainstream_hf.bench.__main__ import main
from trainstream_hf.quant import QuantLinear, packed_nbytes, quantize

CPU = torch.device("cpu")


def test_llama3_8b_block_is_the_issue_shapes():
    assert quant.block_linears("llama3-8b") == [
        ("q_proj", 4096, 4096), ("k_proj", 4096, 1024), ("v_proj", 4096, 1024), ("o_proj", 4096, 4096),
        ("gate_proj", 4096, 14336), ("up_proj", 4096, 14336), ("down_proj", 14336, 4096)]


@pytest.mark.parametrize("fmt", ["bf16", "nf4"])
def test_block_step_returns_the_input_gradients(fmt):
    linears = quant.block_linears("tiny")
    ws = quant.block_weights(linears, CPU, seed=3)
    assert torch.equal(ws[0], quant.block_weights(linears, CPU, seed=3)[0])
    xs, leaves, grads = quant.block_inputs(linears, 8, CPU, seed=4)
    assert [x.shape[1] for x in xs] == [k for _, k, _ in linears] and len(leaves) == 4
    # As in the model: q / k / v read one tensor, o_proj its own, gate / up one, down_proj its own.
    q, k, v, o, gate, up, down = xs
    assert q is k is v and gate is up
    assert [id(t) for t in leaves] == [id(q), id(o), id(gate), id(down)]
    assert o is not q and gate is not q and gate is not o and all(t.requires_grad for t in leaves)
    if fmt == "bf16":
        layers, dense = [quant._dense(w) for w in ws], ws
    else:
        layers = [QuantLinear(quantize(w, fmt)) for w in ws]
        dense = [layer.dequantize_weight(torch.bfloat16) for layer in layers]
    dx = quant.block_step(layers, xs, leaves, grads)()
    assert all(x.grad is None for x in leaves)  # returned, not accumulated
    for leaf, got in zip(leaves, dx):
        want = sum(g.float() @ w.float() for x, g, w in zip(xs, grads, dense) if x is leaf)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_tiny_suite_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # the same rows whether or not it is installed here
    main(["quant", "--shape", "tiny", "--seq", "16", "--warmup", "1", "--repeats", "2",
          "--out", str(tmp_path), "--name", "q"])
    data = json.loads((tmp_path / "q.json").read_text())
    env = data["environment"]
    for key in ("command", "commit", "date", "torch", "cuda", "cpu_count", "gpu"):
        assert key in env
    assert "quant" in env["command"]
    assert data["suite"] == "quant" and data["shape"] == "tiny" and data["tokens"] == 16
    assert data["warmup"] == 1 and data["repeats"] == 2 and len(data["linears"]) == 7
    assert data["flops_per_step"] == 4 * 16 * sum(r["in_features"] * r["out_features"] for r in data["linears"])
    rows = {r["key"]: r for r in data["results"]}
    assert list(rows) == [k for k in quant.ROWS if k != "dequant"]
    cuda = torch.cuda.is_available()
    ran = ["bf16", "int8", "nf4", "fp8", "fp8_outliers", "fp8_wo", "nvfp4"]
    for key in ran:
        r = rows[key]
        assert r["status"] == "ok", r
        assert r["step_s"] > 0 and r["tflops"] > 0
        assert r["x_bf16"] == pytest.approx(r["step_s"] / rows["bf16"]["step_s"])
        assert r["path"] and r["weight_bytes"] > 0 and r["x_bnb"] is None
        assert (r["max_allocated"] is None) is (not cuda)
    assert rows["bf16"]["x_bf16"] == 1.0
    assert rows["bnb_nf4"]["status"] == "not run: bitsandbytes not installed"
    if not quant.fp4_tensor_cores(quant.default_device()):
        assert rows["nvfp4_w4a4"]["status"] == "not run: no such GPU (FP4 tensor cores need sm_100+)"
    for r in rows.values():
        if r["status"].startswith("not run"):
            assert len(r["status"]) > len("not run: ") and r["step_s"] is None and r["name"]
    # the selected paths and packed sizes are the library's own
    for key in ran[1:]:
        fmt, act_quant, _, _ = quant.QUANT_ROWS[key]
        layer = QuantLinear(quantize(torch.randn(64, 64), fmt), act_quant=act_quant)
        assert rows[key]["path"] == layer.matmul_path(quant.default_device()).name
        assert rows[key]["weight_bytes"] == sum(packed_nbytes(fmt, (r["out_features"], r["in_features"]))
                                                for r in data["linears"])
    assert rows["fp8"]["path"] != "dequant" and rows["fp8_wo"]["path"] == "dequant"
    assert rows["bf16"]["weight_bytes"] == 2 * sum(r["in_features"] * r["out_features"] for r in data["linears"])
    # issue 4's targets sit on their rows; meets is only judged on a GPU
    assert rows["nf4"]["target"] == "<= 0.8x bnb nf4" and rows["fp8"]["target"] == "<= 0.75x bf16"
    assert rows["nvfp4"]["target"] == "<= 1.0x bnb nf4"
    assert rows["nf4"]["meets"] is None  # no bnb row to compare with
    assert "target" not in rows["int8"]
    # dequantize section against the copy bandwidth of the same run
    bw = data["copy_bandwidth"]
    assert bw["status"] == "ok" and bw["GBps"] > 0
    deq = {r["fmt"]: r for r in data["dequant"]}
    assert set(deq) == {"int8", "nf4", "fp8", "nvfp4"}
    for fmt, r in deq.items():
        assert r["shape"] == [64, 128] and r["packed_bytes"] == packed_nbytes(fmt, (64, 128))
        assert r["bytes_moved"] == r["packed_bytes"] + 2 * 64 * 128
        assert r["GBps"] == pytest.approx(r["bytes_moved"] / r["time_s"] / 1e9)
        assert r["of_copy"] == pytest.approx(r["GBps"] / bw["GBps"]) and (r["meets"] is None) is (not cuda)
    out = capsys.readouterr().out
    assert "| name | path | status | step_ms |" in out and "trainstream nf4" in out and "dequantize -> bf16" in out


def test_rows_subset_and_unknown_rows():
    payload, md = quant.run(shape="tiny", seq=8, warmup=0, repeats=1, rows=["bf16", "fp8"], device="cpu")
    assert [r["key"] for r in payload["results"]] == ["bf16", "fp8"]
    assert payload["dequant"] == [] and payload["copy_bandwidth"]["status"].startswith("not run")
    assert payload["results"][1]["x_bf16"] > 0 and "dequantize" not in md
    with pytest.raises(ValueError, match="unknown rows"):
        quant.run(shape="tiny", rows=["nope"], device="cpu")


def test_bnb_row_needs_cuda(monkeypatch):
    real = quant.importlib.util.find_spec
    monkeypatch.setattr(quant.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "bitsandbytes" else real(name, *a))
    row = quant.bnb_nf4_row(quant.block_linears("tiny"), 8, CPU, 0, 1)
    assert row["status"] == "not run: requires CUDA" and row["key"] == "bnb_nf4"
