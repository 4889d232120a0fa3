"""bench host (the host side of a step, on the CPU) and --profile (each row's steps under torch.profiler)."""
import gzip
import json
from types import SimpleNamespace

import pytest
import torch

from trainstream_hf.bench import harness, host
from trainstream_hf.bench.__main__ import main


def test_host_rows_measure_the_cpu_time_of_steps_and_layer_calls(tmp_path, capsys):
    main(["host", "--quick", "--peers", "step_wrap,layer_bf16,layer_lora_native", "--out", str(tmp_path),
          "--name", "h"])
    payload = json.loads((tmp_path / "h.json").read_text())
    rows = {r["row"]: r for r in payload["results"]}
    assert list(rows) == ["step_wrap", "layer_bf16", "layer_lora_native"]
    assert rows["step_wrap"]["unit"] == "ms per step" and rows["layer_bf16"]["unit"] == "us per layer call"
    assert all(0 < r["min"] <= r["median"] for r in rows.values())
    assert payload["torch_threads"] == 1 and torch.get_num_threads() >= 1  # restored after
    assert "| fp8 weight-only + LoRA r8, native (one node) | us per layer call |" in capsys.readouterr().out


def test_host_leaves_torch_scaled_mm_as_it_was():
    before = torch._scaled_mm
    host.layer_row("layer_fp8", calls=2, repeats=1)
    assert torch._scaled_mm is before


def test_host_names_unknown_rows():
    with pytest.raises(ValueError, match=r"unknown row\(s\) \['nope'\]; choose from step_plain"):
        host.run(rows=["nope"])


def test_profile_adds_each_rows_top_operators_and_a_trace_without_touching_its_figures(tmp_path, capsys):
    main(["table", "--quick", "--peers", "ts_nf4", "--vram-budget-gib", "0", "--profile", "2", "--trace",
          "--out", str(tmp_path), "--name", "p"])
    try:
        r = json.loads((tmp_path / "p.json").read_text())["results"][0]
        p = r["profile"]
        assert p["steps"] == 2 and p["wall_ms"] > 0 and p["kernel_busy_ms"] is None  # CPU: no kernels
        assert p["cpu_ops"] and all(o["self_cpu_ms"] >= 0 and o["calls"] > 0 for o in p["cpu_ops"])
        assert any(o["name"].startswith("trainstream::") for o in p["cpu_ops"])  # the engine's native ops show
        assert len(r["losses"]) == 1 + 3  # warm-up + timed steps: the profiled steps are not the row's
        with gzip.open(p["trace"]) as f:
            assert "traceEvents" in json.load(f)
        assert "| self CPU | calls | operator |" in capsys.readouterr().out
    finally:
        harness.PROFILE_STEPS, harness.PROFILE_TRACES = 0, None


def test_trace_needs_profile(capsys):
    with pytest.raises(SystemExit):
        main(["table", "--quick", "--trace"])
    assert "give --profile N too" in capsys.readouterr().err


def test_busy_time_is_the_union_of_the_kernels_intervals():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(start, end, name="k", device=cuda):
        return SimpleNamespace(device_type=device, name=name, time_range=SimpleNamespace(start=start, end=end))

    events = [ev(0, 10), ev(5, 12), ev(20, 25), ev(21, 22), ev(30, 90, "Memcpy HtoD"), ev(40, 80, device=cpu)]
    assert harness.busy_us(events) == 12 + 5
    assert harness.busy_us([]) == 0


@pytest.mark.parametrize("suite, first", [("table", "ts_nvfp4_outliers"), ("host", "step_plain"), ("cache", "dynamic")])
def test_unknown_rows_are_one_line_errors(capsys, suite, first):
    with pytest.raises(SystemExit):
        main([suite, "--quick", "--peers", f"{first},nope"])
    err = capsys.readouterr().err
    assert f"error: --peers: unknown {suite} row(s) nope; choose from {first}, " in err and "Traceback" not in err
