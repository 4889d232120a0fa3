"""trainstream_hf.train.report's curves PNG, and the engine's per-step figures that feed it and summary.json."""
import random
import struct
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf as ts
from trainstream_hf.train import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PANEL_PIXELS = 460  # write_curves: 4.6 inches a panel at 100 dpi


def png_size(path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk (which follows the signature); fails on anything but a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


def _series(seed: int, steps: int = 30):
    rng = random.Random(seed)
    losses = {"training": [[s, 4.2 - 0.1 * s + rng.gauss(0, 0.05)] for s in range(1, steps + 1)],
              "held-out": report.endpoints(4.1, 2.3, steps)}
    metrics = {"held-out accuracy": report.endpoints(0.0, 0.6, steps)}
    engine = [{"step": s, "h2d_GBps": rng.uniform(1, 20), "d2h_GBps": rng.uniform(1, 20), "h2d_bytes": 2**20}
              for s in range(steps)]
    engine[7]["h2d_GBps"] = 180.0  # an outlier step
    return losses, metrics, engine


def test_write_curves_draws_a_panel_per_kind_of_figure(tmp_path):
    losses, metrics, engine = _series(0)
    path = report.write_curves(str(tmp_path / "new" / "run"), "recipes/x.py: 30 steps on cpu", losses, metrics,
                               engine)
    assert path == tmp_path / "new" / "run" / "curves.png"  # the output directory is made
    width, height = png_size(path)
    assert width == 3 * PANEL_PIXELS and height > 200  # loss, evaluation, engine GB/s
    assert path.stat().st_size > 10_000  # drawn, not a blank canvas
    assert sorted(p.name for p in path.parent.iterdir()) == ["curves.png"]  # no temporary file left


def test_write_curves_without_the_engine_leaves_its_panel_out(tmp_path):
    losses, metrics, _ = _series(1)
    for engine in (None, []):
        path = report.write_curves(str(tmp_path), "plain model", losses, metrics, engine, name="plain.png")
        assert path.name == "plain.png" and png_size(path)[0] == 2 * PANEL_PIXELS
    # No evaluation (eval.enabled false) and no engine: the loss panel alone; empty series are not drawn.
    path = report.write_curves(str(tmp_path), "loss only", {"training": losses["training"], "held-out": []},
                               {"held-out accuracy": []}, None, name="loss.png")
    assert png_size(path)[0] == PANEL_PIXELS and path.stat().st_size > 5_000


def test_matplotlib_is_imported_only_to_draw():
    code = "import sys, trainstream_hf.train.report; print('matplotlib' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_last_step_figures_are_one_steps_worth():
    """summary.json's ``last_step`` describes one step, not the run: with every block's weights paged and its
    activations offloaded, the pager loads each of the 3 blocks once per forward at every step, and the last
    step's counters equal the first step's (cumulative counters would be 4x after 4 steps)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = ts.wrap(model, optimizer, page_weights=True, offload_activations=True, min_activation_bytes=0,
                               min_offload_numel=0, vram_budget="64GiB", host_arena=None)
    log = report.StepLog(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        log.record(0.01, loss.item())
    ts.unwrap(model)
    summary = log.engine_summary()
    assert summary["steps_measured"] == 4 and [s["step"] for s in log.engine] == [0, 1, 2, 3]
    first, last = log.engine[0], summary["last_step"]
    assert last["step"] == 3 and last["weights"]["paged_blocks"] == 3
    assert last["weights"]["loads_forward"] == 3
    for part, counters in (("weights", ("h2d_bytes", "h2d_copies", "loads_forward", "loads_backward",
                                        "reused_backward", "weight_refs")),
                           ("activations", ("offloaded", "d2h_bytes", "h2d_bytes"))):
        for key in counters:
            assert last[part][key] == first[part][key], (part, key)
    assert last["activations"]["offloaded"] > 0
    assert last["h2d_bytes"] == first["h2d_bytes"] == summary["h2d_bytes_per_step"] > 0
