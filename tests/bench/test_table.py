"""bench table: every row in a process of its own, the same weights and batch, one table and JSON (CPU, tiny)."""
import json
import os
import re
from pathlib import Path

import pytest
import torch

from trainstream_hf.bench import table
from trainstream_hf.bench.__main__ import main


def test_rows_run_apart_on_the_same_model_and_make_one_table(tmp_path, capsys):
    main(["table", "--quick", "--peers", "ts_auto,peft,ts_nf4,bnb", "--vram-budget-gib", "0",
          "--out", str(tmp_path), "--name", "t"])
    payload = json.loads((tmp_path / "t.json").read_text())
    rows = {r["row"]: r for r in payload["results"]}
    assert list(rows) == ["ts_auto", "peft", "ts_nf4", "bnb"]
    for name in ("ts_auto", "peft", "ts_nf4"):
        assert rows[name]["status"] == "ok" and rows[name]["step_s"] > 0 and len(rows[name]["losses"]) == 4
    # not installed here: a row that says so, without a process started for it
    assert rows["bnb"]["status"] == "not run: bitsandbytes not installed" and "wall_s" not in rows["bnb"]
    assert set(table.NEEDS) <= {fn for _, _, fn, _ in table.ROWS.values()}
    # one seeded base for every row: the unquantized rows start from the same loss, bit for bit
    assert rows["ts_auto"]["losses"][0] == rows["peft"]["losses"][0]
    assert "plan" in rows["ts_auto"] and "engine_stats" in rows["ts_auto"]
    shown = {r["row"]: r for r in payload["table"]}
    assert min(r["vs_fastest"] for r in shown.values() if r["vs_fastest"] is not None) == 1.0
    assert shown["trainstream nf4"]["last_loss"] == rows["ts_nf4"]["losses"][-1]
    assert shown["trainstream nf4"]["grad_norm"] == rows["ts_nf4"]["warmup_grad_norms"][0] > 0
    assert payload["environment"]["commit"] and payload["environment"]["command"].endswith("--name t")
    out = capsys.readouterr().out
    assert "| row | status | step_s |" in out and "bitsandbytes QLoRA nf4 + PEFT | not run" in out
    readme = table.readme_table(str(tmp_path / "t.json"))
    assert readme.count("\n|") >= 5 and "CPU, commit" in readme


def test_a_row_that_hangs_is_a_row_with_that_status():
    payload, md = table.run(shape="tiny", rows=["peft"], seq=16, warmup=1, repeats=1, vram_budget_gib=0,
                            row_timeout=0.5)
    assert payload["results"][0]["status"].startswith("timeout after")
    assert "timeout" in md


def test_unknown_rows_are_named():
    with pytest.raises(ValueError, match=r"unknown row\(s\) \['nope'\]; choose from ts_nvfp4_outliers"):
        table.run(rows=["nope"])


def test_the_readme_table_is_the_committed_json_rendered():
    """The README's results table is generated from a committed JSON, never typed: re-rendering it changes nothing."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text()
    section = text.split(table.BEGIN)[1].split(table.END)[0].strip()
    path = re.search(r"`(benchmarks/results/table-[^`]+\.json)`", section).group(1)
    assert (root / path).is_file()
    cwd = os.getcwd()
    os.chdir(root)  # the source line names the JSON relative to the repository
    try:
        assert section == table.readme_table(path)
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("fit_up_to", [5000, 8192, 70000, 300000, 100])
def test_longest_fitting_doubles_then_bisects(fit_up_to):
    best, probes = table.longest_fitting(lambda n: n <= fit_up_to, 1024, 262144, granularity=1024)
    if fit_up_to < 1024:
        assert best is None and probes == [(1024, False)]  # nothing below the granularity is tried
        return
    want = min(fit_up_to, 262144) // 1024 * 1024
    assert best == want and all(ok == (n <= fit_up_to) for n, ok in probes)
    assert len(probes) <= 2 * 10  # doublings plus bisection steps, not a scan


@pytest.mark.parametrize("fit_up_to", [40000, 32768, 3000, 1024, 500])
def test_longest_fitting_halves_when_the_start_does_not_fit(fit_up_to):
    best, probes = table.longest_fitting(lambda n: n <= fit_up_to, 65536, 262144, granularity=1024)
    assert probes[0] == (65536, False) and all(ok == (n <= fit_up_to) for n, ok in probes)
    assert best == (None if fit_up_to < 1024 else fit_up_to // 1024 * 1024)
    assert len(probes) <= 2 * 10


def test_longest_runs_each_probe_in_a_child():
    payload, md = table.run_longest(shape="tiny", rows=["peft"], start=32, limit=64, granularity=16,
                                    vram_budget_gib=0)
    r = payload["results"][0]
    assert r["status"] == "ok" and r["longest_seq"] == 64 and [n for n, _ in r["probes"]] == [32, 64]
    assert set(r["statuses"].values()) == {"ok"}
    assert r["tokens_per_s"] > 0 and "| PyTorch + PEFT, bf16 | ok | 64 |" in md and "first_step_tokens_per_s" in md


def test_an_uncapped_reference_row_is_never_the_fastest():
    rows = [{"row": "peft_uncapped", "label": "ref", "status": "ok", "step_s": 0.1},
            {"row": "ts_nf4", "label": "nf4", "status": "ok", "step_s": 0.2},
            {"row": "peft", "label": "capped", "status": "oom", "step_s": None, "max_allocated": 3 * table.GiB}]
    shown = {r["row"]: r for r in table.summarize(rows)}
    assert shown["nf4"]["vs_fastest"] == 1.0 and shown["ref"]["vs_fastest"] == 0.5
    assert shown["capped"]["status"] == "oom" and shown["capped"]["alloc_GiB"] == 3.0  # an OOM keeps its peak
    assert "peft_uncapped" in table.UNCAPPED and table.ROWS["peft_uncapped"][2] == "peft_lora"


def test_unsloth_rows_say_why_they_did_not_run_on_a_cpu():
    payload, _ = table.run(shape="tiny", rows=["unsloth_ckpt"], seq=16, warmup=1, repeats=1, vram_budget_gib=0)
    assert [r["status"] for r in payload["results"]] == ["not run: Unsloth needs a CUDA GPU"]
    assert table.run_row("unsloth", shape="tiny", batch=1, seq=16, warmup=1, repeats=1, vram_budget=None)["status"] \
        == "not run: Unsloth needs a CUDA GPU"


def test_unsloth_rows_see_their_own_folder_first(tmp_path):
    """Unsloth's pins (trl <= 1.15, datasets < 5) live in a folder only its rows' processes put first on the path."""
    import subprocess
    import sys

    from trainstream_hf.bench import unsloth

    site = tmp_path / "site"
    (site / "trl").mkdir(parents=True)
    (site / "trl" / "__init__.py").write_text("__version__ = 'pinned-for-unsloth'\n")
    env = unsloth.child_env({"PATH": os.environ["PATH"], unsloth.SITE_ENV: str(site)})
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    code = "import trl, trainstream_hf; print(trl.__version__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.strip() == "pinned-for-unsloth", out.stderr


def test_the_unsloth_checkpoint_holds_the_tables_weights(tmp_path, monkeypatch):
    """Unsloth loads from disk: the saved folder holds the same seeded weights as every other row's model."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainstream_hf.bench import unsloth
    from trainstream_hf.bench.models import build_model

    monkeypatch.setenv(unsloth.MODELS_ENV, str(tmp_path))
    path = unsloth.model_dir("tiny", 3)
    assert path == str(tmp_path / "tiny-seed3")
    unsloth.save_model("tiny", 3, path)  # what saved_model runs in a process of its own
    assert unsloth.saved_model("tiny", 3) == path and not list(tmp_path.glob("*.tmp-*"))  # there: not saved again
    assert (tmp_path / "tiny-seed3" / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    built = build_model("tiny", torch.bfloat16, "cpu", 3).state_dict()
    assert loaded.keys() == built.keys() and all(torch.equal(loaded[k], built[k]) for k in built)


def test_model_flops_count_every_linear_weight_and_causal_attention():
    """lora_step_flops against the model's own parameter counts: 2 x 2 FLOPs per frozen linear weight per token (the
    forward and the input gradient), 6 per adapter weight, 3 x causal attention's two products."""
    from peft import LoraConfig, get_peft_model

    from trainstream_hf.bench.models import build_model, lora_step_flops, model_config

    cfg = model_config("llama3.1-8b")
    model = build_model("llama3.1-8b", device="meta")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    adapters = sum(p.numel() for n, p in get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
                   .named_parameters() if "lora_" in n)
    batch, seq = 2, 1024
    attention = cfg.num_hidden_layers * batch * 2 * seq * seq * cfg.hidden_size  # causal: half of 2 products
    want = 4 * batch * seq * linear + 6 * batch * seq * adapters + 3 * attention
    assert lora_step_flops("llama3.1-8b", batch, seq) == want


def test_a_models_own_config_is_a_shape(tmp_path, capsys):
    """--shape takes a config.json (or its folder) of any family: the rows build that shape with random weights, the
    result file is named after the model's folder, and the model FLOPs count that model's own linear layers."""
    from transformers import Phi3Config

    from trainstream_hf.bench.models import build_model, lora_step_flops, model_config, shape_label

    folder = tmp_path / "Phi-3-Tiny"
    Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=256, pad_token_id=0).save_pretrained(folder)
    for spec in (str(folder), str(folder / "config.json")):
        cfg = model_config(spec)
        assert cfg.model_type == "phi3" and cfg.use_cache is False and shape_label(spec) == "phi-3-tiny"
    # Phi-3 fuses q/k/v and gate/up: the count is the model's own layers, not a Llama formula
    model = build_model(str(folder), device="meta")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    adapters = sum(16 * (m.in_features + m.out_features) for m in blocks)
    assert lora_step_flops(str(folder), 1, 32) == 4 * 32 * linear + 6 * 32 * adapters + 3 * 2 * 2 * 32 * 32 * 64
    main(["table", "--quick", "--shape", str(folder / "config.json"), "--peers", "ts_nf4",
          "--vram-budget-gib", "0", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "table-phi-3-tiny-cpu-quick.json").read_text())
    row = payload["results"][0]
    assert row["status"] == "ok" and len(row["losses"]) == 4 and all(0 < x < 10 for x in row["losses"])


@pytest.mark.parametrize("shape", ["llama-9000", "/no/such/config.json"])
def test_an_unknown_shape_is_one_line_naming_the_choices(shape, capsys):
    with pytest.raises(SystemExit):
        main(["table", "--quick", "--shape", shape])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m trainstream_hf.bench: error: --shape: unknown shape") and "llama3.1-8b" in err


def test_a_file_that_is_not_a_config_is_refused_in_one_line(tmp_path, capsys):
    bad = tmp_path / "notes.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        main(["engine", "--quick", "--full-shape", str(bad)])
    err = capsys.readouterr().err
    assert "error: --full-shape: shape " in err and "not a transformers model config" in err


def test_mfu_is_reported_only_where_the_peak_is_known():
    from trainstream_hf.bench.common import peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == peak_bf16_flops("NVIDIA H200") == 989.5e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756.5e12 and peak_bf16_flops("cpu") is None
    rows = [{"row": "a", "label": "a", "status": "ok", "step_s": 0.5}, {"row": "b", "label": "b", "status": "oom"}]
    got = table.summarize(rows, {"model_flops_per_step": 1e14, "peak_bf16_flops": 1e15})
    assert got[0]["mfu"] == pytest.approx(0.2) and got[1]["mfu"] is None
    assert table.summarize(rows, {"model_flops_per_step": 1e14, "peak_bf16_flops": None})[0]["mfu"] is None


def test_a_row_planned_at_a_peers_peak_runs_after_it_and_takes_its_peak(monkeypatch):
    calls = []

    def child(row, args, timeout):
        calls.append((row, args.get("plan_budget")))
        return {"row": row, "label": row, "status": "ok", "step_s": 0.1, "max_allocated": 5 * table.GiB}

    monkeypatch.setattr(table, "_child", child)
    payload, _ = table.run(shape="tiny", rows=["ts_nf4_at_ckpt_peak", "unsloth_ckpt"], seq=16, vram_budget_gib=24)
    assert calls == [("unsloth_ckpt", None), ("ts_nf4_at_ckpt_peak", 5 * table.GiB)]
    assert [r["row"] for r in payload["results"]] == ["unsloth_ckpt", "ts_nf4_at_ckpt_peak"]
    # without the peer in the run, or when it did not run: said, and nothing started
    calls.clear()
    payload, _ = table.run(shape="tiny", rows=["ts_nf4_at_ckpt_peak"], seq=16, vram_budget_gib=24)
    assert calls == [] and payload["results"][0]["status"] == (
        "not run: its plan budget is unsloth_ckpt's peak in the same run; add unsloth_ckpt")
    monkeypatch.setattr(table, "_child", lambda row, args, timeout: {"row": row, "status": "oom"})
    payload, _ = table.run(shape="tiny", rows=["unsloth_ckpt", "ts_nf4_at_ckpt_peak"], seq=16, vram_budget_gib=24)
    assert payload["results"][1]["status"] == "not run: unsloth_ckpt did not run (oom)"


def test_a_plan_budget_under_the_cap_is_the_plans():
    result = table.run_row("ts_nf4", shape="tiny", batch=1, seq=16, warmup=1, repeats=1, vram_budget=None,
                           plan_budget=3 * table.GiB)
    assert result["status"] == "ok" and result["plan_budget"] == 3 * table.GiB
    assert "budget 3.00 GiB" in result["plan"]
