"""scripts/fp8_curve_diag.py on the CPU: each variant trains its own model from the same seed and batch, and the
bf16 run's adapters loaded into each gives the loss of the same weights; on the CPU every fp8 variant follows bf16
(on the GPU the table's fp8 rows do not: benchmarks/NOTES.md, 2026-12-07)."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("fp8_curve_diag",
                                              Path(__file__).resolve().parents[1] / "scripts" / "fp8_curve_diag.py")
diag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diag)


def test_every_variant_trains_from_the_same_start_and_is_evaluated_at_the_same_adapters(rowwise_scaled_mm,
                                                                                          monkeypatch):
    from trainstream_hf.quant import matmul

    # the tensor-core path (ops.fp8_linear, its CPU kernel), as sm_89+ GPUs take it by default
    monkeypatch.setitem(matmul.ACT_QUANT_FORMATS, "fp8", matmul.FP8_W8A8_SCALED_MM)
    variants = ["fp8", "fp8_emulated", "fp8_peft", "fp8_noreuse", "fp8_wrap", "fp8_compiled_aot"]
    result = diag.run(small=True, steps=3, tokens=32, device="cpu", variants=variants)
    runs = result["runs"]
    assert list(runs) == ["bf16", *variants]  # the reference first, whatever the order asked
    ref = runs["bf16"]
    assert ref["losses"][-1] < ref["losses"][0] and ref["update_norm"] > 0
    # the bf16 run evaluated at its own adapters: its last training loss's model after one more update
    assert abs(ref["loss_at_bf16_adapters"] - ref["losses"][-1]) < 0.05
    for v in variants:
        r = runs[v]
        assert len(r["losses"]) == len(r["grad_norms"]) == 3
        assert abs(r["losses"][-1] - ref["losses"][-1]) < 0.02 and abs(r["update_norm"] / ref["update_norm"] - 1) < 0.05
        assert abs(r["loss_at_bf16_adapters"] - ref["loss_at_bf16_adapters"]) < 0.02, v
    # fresh quantizations are the kept ones' bits; PEFT's forward and the emulated maths other roundings
    assert runs["fp8_noreuse"]["losses"] == runs["fp8"]["losses"] != runs["fp8_emulated"]["losses"]
