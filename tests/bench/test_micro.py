import json

import torch

from trainstream_hf.bench.__main__ import main


def test_micro_quick_writes_json(tmp_path, capsys):
    main(["micro", "--quick", "--out", str(tmp_path), "--name", "m"])
    data = json.loads((tmp_path / "m.json").read_text())
    env = data["environment"]
    for key in ("command", "commit", "date", "torch", "cpu_count"):
        assert key in env
    assert data["adamw"] and all(r["ours+bf16"] > 0 and r["torch_fused"] > 0 for r in data["adamw"])
    assert data["staging"] and all(r["GB/s"] > 0 for r in data["staging"])
    if not torch.cuda.is_available():
        assert data["copy_bandwidth_GBps"].startswith("not run") and data["contention"].startswith("not run")
    assert "AdamW" in capsys.readouterr().out
