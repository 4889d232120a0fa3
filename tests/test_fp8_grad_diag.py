"""scripts/fp8_grad_diag.py on the CPU: its variants run, and the FP8 tensor-core path's maths (ops.fp8_linear's CPU
kernel: activations and the output gradient rounded to E4M3 per token) gives gradients that point where the exact
W8A8 reference's do, at every block. On the GPU the script compares the same with cuBLASLt, torch._scaled_mm and
compiled blocks (benchmarks/NOTES.md, 2026-12-07)."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("fp8_grad_diag",
                                              Path(__file__).resolve().parents[1] / "scripts" / "fp8_grad_diag.py")
diag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diag)


def test_fp8_tensor_core_gradients_follow_the_exact_reference_on_the_cpu():
    result = diag.run(blocks=2, tokens=48, device="cpu", small=True)
    rows = result["rows"]
    assert set(rows) == {"emulated", "dequant", "tc"} and result["reference"] == "emulated"
    assert all(x == pytest.approx({"cosine": 1.0, "norm_ratio": 1.0}, abs=1e-9) for x in rows["emulated"].values())
    for variant in ("dequant", "tc"):
        for part, x in rows[variant].items():
            assert x["cosine"] > 0.995 and abs(x["norm_ratio"] - 1) < 0.02, (variant, part, x)
    assert rows["tc"]["input"]["cosine"] < 1.0  # it did round the output gradient to E4M3
