"""The peer side of the engine benchmark on CPU: model builders, the timing harness, the peers that run
without CUDA, the clean "not run" rows of those that need it, and the ``peers --quick`` suite."""
import json
import re
import sys

import pytest
import torch

from trainstream_hf.bench import peers
from trainstream_hf.bench.__main__ import main
from trainstream_hf.bench.harness import measure_training, not_run, vram_cap
from trainstream_hf.bench.models import SHAPES, build_model, make_batch, model_config


@pytest.mark.parametrize("shape, params", [("llama3-8b", 8_030_261_248), ("llama3.2-3b", 3_212_749_824),
                                           ("qwen2.5-32b", 32_763_876_352)])
def test_shape_table_param_counts(shape, params):
    model = build_model(shape, device="meta")
    assert sum(p.numel() for p in model.parameters()) == params
    assert model.config._attn_implementation == "sdpa" and not model.config.use_cache
    assert next(model.parameters()).dtype == torch.bfloat16


def test_tied_embeddings_follow_the_table():
    tied = build_model("llama3.2-3b", device="meta")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = build_model("llama3-8b", device="meta")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_unknown_shape_says_which_exist():
    with pytest.raises(ValueError, match="tiny"):
        model_config("llama-nope")


def test_build_tiny_is_seeded_and_trains():
    a = build_model("tiny", torch.bfloat16, "cpu", seed=1)
    b = build_model("tiny", torch.bfloat16, "cpu", seed=1)
    c = build_model("tiny", torch.bfloat16, "cpu", seed=2)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.layers.0.mlp.up_proj.weight"], pc["model.layers.0.mlp.up_proj.weight"])
    assert a.training and a.dtype == torch.bfloat16
    fp32 = build_model("tiny", torch.float32, "cpu")
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    batch = make_batch(2, 16, SHAPES["tiny"]["vocab_size"], "cpu", seed=3)
    loss = a(**batch).loss
    assert torch.isfinite(loss) and loss.item() > 0


def test_make_batch_is_seeded_random_tokens():
    x = make_batch(2, 64, 256, "cpu", seed=0)
    assert x["input_ids"].shape == (2, 64) and x["input_ids"].dtype == torch.long
    assert torch.equal(x["input_ids"], x["labels"]) and x["labels"].data_ptr() != x["input_ids"].data_ptr()
    assert 0 <= x["input_ids"].min() and x["input_ids"].max() < 256 and x["input_ids"].unique().numel() > 50
    assert torch.equal(make_batch(2, 64, 256, "cpu", seed=0)["input_ids"], x["input_ids"])
    assert not torch.equal(make_batch(2, 64, 256, "cpu", seed=1)["input_ids"], x["input_ids"])


@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_peft_lora_tiny_cpu(grad_ckpt):
    row = peers.peft_lora("tiny", grad_ckpt, batch=2, seq=32, warmup=1, repeats=2, device="cpu")
    assert row["status"] == "ok", row
    assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(64 / row["step_s"])
    assert row["peer"] == "peft_lora" and row["grad_ckpt"] is grad_ckpt and row["shape"] == "tiny"
    # r=16 on q,k,v,o,gate,up,down of 2 layers: r * (in + out) each; the LM head is excluded.
    h, i, kv = 64, 128, 32
    per_layer = 16 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    assert row["trainable_params"] == 2 * per_layer
    assert row["max_allocated"] is None  # no CUDA memory figures on CPU


def test_torch_full_tiny_cpu():
    row = peers.torch_full("tiny", batch=1, seq=32, warmup=1, repeats=2, device="cpu")
    assert row["status"] == "ok", row
    assert row["step_s"] > 0 and row["params"] == 106_816


def test_not_installed_peers_say_so(monkeypatch):
    for mod in ("bitsandbytes", "deepspeed"):
        monkeypatch.setitem(sys.modules, mod, None)  # find_spec -> None, import -> ImportError
    kw = dict(batch=1, seq=16, warmup=0, repeats=1, device="cpu")
    for row, lib in ((peers.bnb_qlora("tiny", True, **kw), "bitsandbytes"),
                     (peers.deepspeed_zero2_offload("tiny", True, None, **kw), "deepspeed")):
        assert row["status"] == f"not run: {lib} not installed"
        assert row["step_s"] is None and row["grad_ckpt"] is True and row["name"]


def test_installed_cuda_peers_need_cuda(monkeypatch):
    real = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("bitsandbytes", "deepspeed") else real(name, *a))
    kw = dict(batch=1, seq=16, warmup=0, repeats=1, device="cpu")
    assert peers.bnb_qlora("tiny", **kw)["status"] == "not run: requires CUDA"
    assert peers.deepspeed_zero2_offload("tiny", **kw)["status"] == "not run: requires CUDA"


def test_harness_reports_oom_and_releases(monkeypatch):
    calls = {"steps": 0, "closed": 0}

    def setup():
        def step():
            calls["steps"] += 1
            if calls["steps"] == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return step, lambda: calls.__setitem__("closed", calls["closed"] + 1)

    row = measure_training("x", setup, device=torch.device("cpu"), warmup=1, repeats=3, fields={"peer": "p"})
    assert row["status"] == "oom" and "Tried to allocate" in row["error"] and row["step_s"] is None
    assert row["peer"] == "p" and calls["closed"] == 1


def test_harness_propagates_other_errors():
    def setup():
        def step():
            raise ValueError("a bug, not a result")
        return step, None
    with pytest.raises(ValueError, match="a bug"):
        measure_training("x", setup, device=torch.device("cpu"), warmup=1, repeats=1)


def test_harness_times_median_and_fields():
    def setup():
        return (lambda: torch.randn(64, 64) @ torch.randn(64, 64)), None
    row = measure_training("mm", setup, device=torch.device("cpu"), warmup=1, repeats=3, tokens=10,
                           fields={"shape": "s"}, vram_budget=123)
    assert row["status"] == "ok" and row["tokens_per_s"] == pytest.approx(10 / row["step_s"])
    assert row["shape"] == "s" and row["vram_budget"] == 123 and row["setup_s"] >= 0
    assert not_run("n", "why")["status"] == "not run: why"


def test_vram_cap_is_a_no_op_off_cuda():
    with vram_cap(2**30, torch.device("cpu")):
        pass


def test_cpu_adamw_time_restores_threads():
    before = torch.get_num_threads()
    row = peers.cpu_adamw_time(300_000, threads=1, repeats=2)
    assert row["status"] == "ok" and row["step_s"] > 0
    assert row["params_per_s"] == pytest.approx(300_000 / row["step_s"])
    assert row["threads"] == 1 and torch.get_num_threads() == before


def test_offload_bounds_arithmetic():
    bw = {"status": "ok", "h2d_GBps": 50.0, "d2h_GBps": 40.0}
    b = peers.offload_bounds(10**9, bw, 0.3)
    assert b["grads_d2h_s"] == pytest.approx(0.05) and b["params_h2d_s"] == pytest.approx(0.04)
    assert b["serial_s"] == pytest.approx(0.39) and b["overlapped_s"] == pytest.approx(0.3)
    assert peers.offload_bounds(10**9, {"status": "not run: requires CUDA"}, 0.3)["status"].startswith("not run")


def test_peers_quick_writes_json(tmp_path, capsys, monkeypatch):
    for mod in ("bitsandbytes", "deepspeed"):
        monkeypatch.setitem(sys.modules, mod, None)
    # The checkpointing variants are covered by test_peft_lora_tiny_cpu; leaving them out keeps this fast.
    main(["peers", "--quick", "--seq", "16", "--repeats", "2",
          "--peers", "bandwidth,peft,bnb,full,ds,ds_ckpt,cpu_adamw", "--out", str(tmp_path), "--name", "p"])
    data = json.loads((tmp_path / "p.json").read_text())
    env = data["environment"]
    for key in ("command", "commit", "date", "torch", "cpu_count", "gpu"):
        assert key in env
    assert data["suite"] == "peers" and data["quick"] and data["shape"] == "tiny"
    assert data["seq"] == 16 and data["repeats"] == 2 and data["warmup"] == 1
    rows = {r["key"]: r for r in data["results"]}
    assert set(rows) == {"peft", "bnb", "full", "ds", "ds_ckpt", "cpu_adamw"}
    for key in ("peft", "full", "cpu_adamw"):
        assert rows[key]["status"] == "ok" and rows[key]["step_s"] > 0, rows[key]
    for key in ("bnb", "ds", "ds_ckpt"):
        assert rows[key]["status"].startswith("not run"), rows[key]
    assert rows["peft"]["x_first"] == 1.0
    if not torch.cuda.is_available():
        assert data["bandwidth"]["status"] == "not run: requires CUDA"
    out = capsys.readouterr().out
    assert "| group | name | status |" in out and "PEFT LoRA" in out


def test_unknown_peer_is_refused():
    with pytest.raises(ValueError, match="unknown peers"):
        peers.run(quick=True, peers=["nope"])


def test_extra_jobs_join_the_table_with_ratios():
    seen = {}

    def job(step_s):
        def fn(shape, full_shape, budget, kw):
            seen.update(shape=shape, full_shape=full_shape, budget=budget, **kw)
            return {"name": f"job {step_s}", "step_s": step_s, "status": "ok", "max_allocated": None,
                    "max_reserved": None}
        return fn

    payload, md = peers.run(quick=True, seq=16, repeats=2, peers=["cpu_adamw", "a", "b"],
                            extra_jobs={"a": ("lora", job(0.25)), "b": ("lora", job(0.5))}, suite="engine")
    assert payload["suite"] == "engine"
    assert seen == {"shape": "tiny", "full_shape": "tiny", "budget": 24 * 2**30, "batch": 1, "seq": 16,
                    "warmup": 1, "repeats": 2}
    assert [r["key"] for r in payload["results"]] == ["cpu_adamw", "a", "b"]  # grouped, run order
    _, a, b = payload["results"]
    assert a["x_first"] == 1.0 and b["x_first"] == pytest.approx(2.0)
    assert "x_first" not in payload["results"][0] and "| lora | job 0.5 | ok |" in md


def test_engine_quick_runs_trainstream_beside_peers(tmp_path, capsys):
    main(["engine", "--quick", "--seq", "16", "--repeats", "2",
          "--peers", "peft,ts_lora,ts_nf4,ts_nf4_fused_norms,ts_full,ts_paged", "--out", str(tmp_path),
          "--name", "e"])
    data = json.loads((tmp_path / "e.json").read_text())
    rows = {r["key"]: r for r in data["results"]}
    assert data["suite"] == "engine"
    assert set(rows) == {"peft", "ts_lora", "ts_nf4", "ts_nf4_fused_norms", "ts_full", "ts_paged"}
    assert "partial" not in data  # the final write replaces the per-row ones
    assert rows["ts_nf4_fused_norms"]["name"].endswith(", fused norms")
    for key in ("ts_lora", "ts_nf4", "ts_nf4_fused_norms", "ts_full", "ts_paged"):
        assert rows[key]["status"] == "ok" and rows[key]["step_s"] > 0, rows[key]
        assert rows[key]["predicted_peak"] > 0 and "engine_stats" in rows[key]
    assert rows["ts_full"]["offloaded_optimizer_params"] > 0
    assert rows["ts_nf4"]["peer"] == "trainstream_nf4" and "nf4" in rows["ts_nf4"]["name"]


def test_each_row_reaches_the_json_as_it_is_measured(tmp_path):
    """A run cut short (a time limit on the GPU machine) keeps the rows it measured: ``on_row`` gets the payload
    after every row, marked partial."""
    seen = []

    def job(step_s):
        def fn(shape, full_shape, budget, kw):
            return {"name": f"job {step_s}", "step_s": step_s, "status": "ok", "max_allocated": None,
                    "max_reserved": None}
        return fn

    peers.run(quick=True, peers=["a", "b"], extra_jobs={"a": ("lora", job(0.25)), "b": ("lora", job(0.5))},
              on_row=lambda p: seen.append((p["partial"], [r["key"] for r in p["results"]])))
    assert seen == [(True, ["a"]), (True, ["a", "b"])]


def test_harness_counts_python_gc_and_can_freeze(monkeypatch):
    """Every row reports the cyclic GC's collections and pause time during its timed steps; --gc-freeze moves what
    is alive after warm-up out of the collector's reach for them (and back after)."""
    import gc

    from trainstream_hf.bench import harness

    def setup():
        def step():
            gc.collect()  # one full collection per timed step
        return step, None

    row = measure_training("x", setup, device=torch.device("cpu"), warmup=1, repeats=3)
    assert row["python_gc"]["collections"][2] == 3 and row["python_gc"]["frozen"] is False
    frozen_during = []
    monkeypatch.setattr(harness, "GC_FREEZE", True)
    row = measure_training("y", lambda: ((lambda: frozen_during.append(gc.get_freeze_count())), None),
                           device=torch.device("cpu"), warmup=0, repeats=2)
    assert row["python_gc"]["frozen"] is True and min(frozen_during) > 0 and gc.get_freeze_count() == 0


def test_peers_help_names_every_row(capsys):
    """--help lists every row each suite accepts (the list is written out, so a new row must be added to it)."""
    from trainstream_hf.bench import engine, quant

    with pytest.raises(SystemExit):
        main(["engine", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse folds the long lists anywhere, even inside a word
    text = text[text.index("subsetof:"):]  # the --peers help (--shape's help says "quant:" too)
    lists = [re.search(marker + r"([a-z0-9_,]+)", text).group(1)
             for marker in ("subsetof:", "engine:thoseand", "quant:")]
    listed = {name for names in lists for name in names.split(",")}
    assert set(peers.PEERS) <= listed
    assert set(engine.JOBS) <= listed and set(quant.ROWS) <= listed


def test_pcie_figures_use_the_busier_direction():
    bw = {"status": "ok", "h2d_GBps": 50.0, "d2h_GBps": 25.0}
    row = {"step_s": 2.0, "engine_stats": {"h2d_bytes": 80e9, "d2h_bytes": 30e9}}
    f = peers.pcie_figures(row, bw)
    assert f["h2d_s"] == pytest.approx(1.6) and f["d2h_s"] == pytest.approx(1.2)
    assert f["bound_s"] == pytest.approx(1.6)
    assert f["efficiency"] == pytest.approx(0.8) and f["x_bound"] == pytest.approx(1.25)
    assert peers.pcie_figures({"step_s": 2.0, "engine_stats": {"h2d_bytes": 0, "d2h_bytes": 0}}, bw) is None
    assert peers.pcie_figures(row, {"status": "not run: not selected"}) is None
    assert peers.pcie_figures({**row, "step_s": None}, bw) is None


def test_engine_recipe_row_runs_the_recipe_as_launched(tmp_path):
    """recipe_nf4: the sft recipe launched as a user launches it (accelerate launch, single-GPU config) in a child
    process of the run; the row is its summary's median step, beside the peers of the same run."""
    main(["engine", "--quick", "--repeats", "2", "--peers", "peft,recipe_nf4", "--out", str(tmp_path), "--name", "r"])
    rows = {r["key"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    row = rows["recipe_nf4"]
    assert row["status"] == "ok" and row["step_s"] > 0 and row["recipe_steps"] == 3, row
    assert "recipes/sft.py" in row["recipe_command"] and "sft-tiny-cpu.yaml" in row["recipe_command"]
    assert "accelerate" in row["recipe_command"] and row["x_first"] == row["step_s"] / rows["peft"]["step_s"]


def test_engine_recipe_row_errors_name_the_cause():
    from trainstream_hf.bench.engine import recipe_sft

    with pytest.raises(ValueError, match="no recipe config for shape 'qwen'"):
        recipe_sft("qwen", warmup=1, repeats=1)
    with pytest.raises(RuntimeError, match="recipe exited with status"):
        recipe_sft("tiny", warmup=1, repeats=1, launcher=[sys.executable, "-c", "import sys; sys.exit(3)", "--"])


def test_rows_list_their_losses(tmp_path):
    """Each training row lists every step's loss (warm-up first), read after the timed steps: a fast row that
    trains something else shows. Same seed, weights and batch: the bf16 LoRA rows start from the same loss (B = 0 at
    init), the nf4 one from a nearby one."""
    main(["engine", "--quick", "--seq", "16", "--warmup", "1", "--repeats", "2", "--peers", "peft,ts_lora,ts_nf4",
          "--out", str(tmp_path), "--name", "l"])
    rows = {r["key"]: r for r in json.loads((tmp_path / "l.json").read_text())["results"]}
    for key in ("peft", "ts_lora", "ts_nf4"):
        losses = rows[key]["losses"]
        assert len(losses) == 3 and all(0 < v < 20 for v in losses), (key, losses)
    assert rows["ts_lora"]["losses"][0] == pytest.approx(rows["peft"]["losses"][0], rel=1e-5)
    assert rows["ts_nf4"]["losses"][0] == pytest.approx(rows["peft"]["losses"][0], rel=0.05)
    assert rows["peft"]["losses"][2] < rows["peft"]["losses"][0]  # it trains
    # and the gradient norm of each warm-up step: the same model and batch give the same scale
    norms = {key: rows[key]["warmup_grad_norms"] for key in ("peft", "ts_lora", "ts_nf4")}
    assert all(len(n) == 1 and n[0] > 0 for n in norms.values()), norms
    assert norms["ts_lora"][0] == pytest.approx(norms["peft"][0], rel=1e-3)
    assert norms["ts_nf4"][0] == pytest.approx(norms["peft"][0], rel=0.2)


def test_harness_records_the_gradient_norm_of_each_warmup_step_only():
    """warmup_grad_norms: the norm of the gradients each warm-up optimizer step applies (over every parameter group,
    CPU and device alike), none from the timed steps; no optimizer step, no field."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    seen = []

    def step():
        loss = layer(torch.randn(3, 8)).square().sum()
        loss.backward()
        seen.append(torch.cat([p.grad.flatten() for p in layer.parameters()]).norm().item())
        opt.step()
        opt.zero_grad()
        return loss.detach()

    row = measure_training("g", lambda: (step, None), device=torch.device("cpu"), warmup=2, repeats=3)
    assert len(seen) == 5 and row["warmup_grad_norms"] == pytest.approx(seen[:2], rel=1e-6)
    row = measure_training("n", lambda: ((lambda: None), None), device=torch.device("cpu"), warmup=1, repeats=2)
    assert "warmup_grad_norms" not in row


def test_the_gradient_norm_is_the_loops_optimizer_step_once_per_step():
    """An optimizer stepping others inside its own step (the engine's offloaded AdamW: its device and host shares)
    gives one norm per warm-up step, the loop's; an optimizer_in_backward row, whose gradients are consumed during
    backward, runs and records none rather than failing on reading them."""
    from tests.helpers import tiny_llama
    import trainstream_hf as ts

    def setup(**options):
        model = tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
        model, opt = ts.wrap(model, opt, device="cpu", vram_budget="8GiB", offload_optimizer=True,
                             min_offload_numel=0, **options)
        plain = []

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if not options:
                plain.append(float(torch.stack([p.grad.norm() for p in model.parameters()]).norm()))
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step, lambda: ts.unwrap(model), plain

    step, close, plain = setup()
    row = measure_training("full", lambda: (step, close), device=torch.device("cpu"), warmup=2, repeats=1)
    assert row["warmup_grad_norms"] == pytest.approx(plain[:2], rel=1e-5)
    step, close, _ = setup(optimizer_in_backward=True)
    row = measure_training("inbwd", lambda: (step, close), device=torch.device("cpu"), warmup=2, repeats=1)
    assert row["status"] == "ok" and len(row["losses"]) == 3 and "warmup_grad_norms" not in row


def test_harness_keeps_no_losses_for_steps_that_return_none():
    row = measure_training("x", lambda: ((lambda: None), None), device=torch.device("cpu"), warmup=1, repeats=2)
    assert "losses" not in row
    values = iter([3.0, 2.0, 1.0])
    row = measure_training("y", lambda: ((lambda: torch.tensor(next(values))), None), device=torch.device("cpu"),
                           warmup=1, repeats=2)
    assert row["losses"] == [3.0, 2.0, 1.0]


def test_accum_rows_count_every_micro_batch(tmp_path):
    """--accum N: the full fine-tune rows take N micro-batches per optimizer step and count N x batch x seq tokens."""
    from trainstream_hf.bench import engine

    payload, _ = peers.run(quick=True, peers=["full", "ts_full"], extra_jobs=engine.JOBS, suite="engine", accum=3,
                           repeats=2, warmup=1)
    assert payload["accum"] == 3
    for r in payload["results"]:
        assert r["status"] == "ok" and r["accum"] == 3 and "3 micro-batches" in r["name"]
        assert r["tokens_per_s"] == pytest.approx(3 * 64 / r["step_s"], rel=1e-6)
    with pytest.raises(ValueError, match="accum"):
        peers.run(quick=True, peers=["full"], accum=0)


def test_zero3_peer_offloads_parameters_and_optimizer():
    cfg = peers.zero3_offload_config(1, gradient_accumulation_steps=4)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu" == z["offload_optimizer"]["device"]
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["bf16"]["enabled"]
    with pytest.raises(ValueError, match="stage 2 or 3"):
        peers.deepspeed_zero2_offload("tiny", stage=4, device="cpu")
    row = peers.deepspeed_zero2_offload("tiny", stage=3, device="cpu")  # no CUDA (or no deepspeed) here
    assert row["status"].startswith("not run") and "ZeRO-3" in row["name"] and "offload_param cpu" in row["name"]


def test_deepspeed_full_finetune_host_estimate():
    """A DeepSpeed full fine-tune row whose states (DeepSpeed's own estimate: 16 bytes per parameter for ZeRO-2's
    offloaded optimizer, 18 for ZeRO-3's) cannot fit the host's available RAM says so before it starts: the kernel
    would kill it, and the suite's process with it."""
    from trainstream_hf.bench.peers import DEEPSPEED_HOST_BYTES, _deepspeed_host_shortfall

    numel = sum(p.numel() for p in peers.build_model("llama3-8b", torch.bfloat16, "meta").parameters())
    assert 8.0e9 < numel < 8.1e9
    host = 128 * 2**30
    why = _deepspeed_host_shortfall("llama3-8b", 3, available=host)
    assert why is not None and "18 bytes per parameter" in why and "128 GiB available" in why
    assert 18 * numel > host >= 16 * numel  # ZeRO-3 does not fit 128 GiB; ZeRO-2's estimate would
    assert _deepspeed_host_shortfall("llama3-8b", 2, available=host) is None
    assert _deepspeed_host_shortfall("tiny", 3, available=host) is None
    assert DEEPSPEED_HOST_BYTES == {2: 16, 3: 18}
