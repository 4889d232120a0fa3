"""On CUDA, a plan that pages weights switches the caching allocator to expandable segments (engine/allocator.py),
and training stays bit-identical to the unwrapped model. Run in a subprocess: the setting is process-wide and would
carry over into the other GPU tests."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import copy, os, torch
    import trainstream_hf as ts
    from transformers import LlamaConfig, LlamaForCausalLM

    assert "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    ref = LlamaForCausalLM(cfg).cuda()
    model = copy.deepcopy(ref)
    model, _ = ts.wrap(model, None, vram_budget="64GiB", page_weights=True, min_offload_numel=0, batch_shape=(2, 64),
                       host_arena=None)
    assert ts.engine_of(model).expandable_segments
    ids = torch.randint(0, 512, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    # Wrapped without an optimizer, a step closes at the next forward of block 0: two steps, stats of the first.
    for _ in range(2):
        for m in (ref, model):
            m(input_ids=ids, labels=ids).loss.backward()
    assert model.trainstream_stats()["expandable_segments"] is True
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), n
    # A later allocation comes from an expandable segment.
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    segs = [s for s in torch.cuda.memory_snapshot() if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
    assert segs and segs[0].get("is_expandable", False), segs[:1]
    print("ok")
""")


def test_paged_plan_runs_on_expandable_segments():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
