"""host_embedding on the GPU: the kernel reading the pinned table (csrc/cuda/embedding.cu) gives nn.Embedding's rows bit
for bit with no host sync, and a wrapped model whose plan is short of memory keeps its frozen input embedding in host
RAM, training as the same model with the table on the device, in less device memory (printed)."""
import pytest
import torch
from peft import LoraConfig, get_peft_model

import trainstream_hf as ts
from trainstream_hf import ops
from tests.helpers import cuda_median_ms, tiny_llama


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [4096, 7, 24])  # 16-byte rows, rows of 14 / 28 bytes (the narrower copies)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_the_kernel_reads_the_pinned_tables_rows(dtype, dim, id_dtype):
    table = torch.randn(1000, dim).to(dtype).pin_memory()
    ids = torch.randint(0, 1000, (3, 257), generator=torch.Generator().manual_seed(0)).to(id_dtype).cuda()
    want = torch.nn.functional.embedding(ids.long().cpu(), table)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ops.embedding_from_host(ids, table)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.device == ids.device and out.dtype == dtype and torch.equal(out.cpu(), want)


def test_a_table_that_is_not_pinned_is_refused():
    with pytest.raises(ValueError, match="pinned host memory"):
        ops.embedding_from_host(torch.tensor([1], device="cuda"), torch.randn(4, 8))


def test_the_gather_time_at_the_llama3_8b_shape():
    table = torch.randn(128256, 4096, dtype=torch.bfloat16).pin_memory()
    ids = torch.randint(0, 128256, (1, 2048), device="cuda")
    device = table.cuda()
    ms = cuda_median_ms(lambda: ops.embedding_from_host(ids, table))
    ms_device = cuda_median_ms(lambda: torch.nn.functional.embedding(ids, device))
    print(f"\nembedding_from_host, 2048 of 128256 x 4096 bf16 rows: {ms:.3f} ms (device table: {ms_device:.3f} ms)")
    assert ms < 5.0


def _lora(seed=0):
    model = get_peft_model(tiny_llama(4, hidden=256, vocab=32000, positions=512, seed=seed),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(3)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.cuda()


def test_a_plan_short_of_memory_keeps_the_table_in_host_ram_and_trains_the_same():
    ids = torch.randint(0, 32000, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    peaks, losses = {}, {}
    for setting in (False, "auto"):
        model = _lora()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model, opt = ts.wrap(model, opt, vram_budget="8GiB", offload_activations=True, min_activation_bytes=0,
                             host_embedding=setting)
        assert (ts.engine_of(model).host_embedding is not None) == (setting == "auto")
        losses[setting] = []
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[setting].append(loss.detach())
        torch.cuda.synchronize()
        peaks[setting] = torch.cuda.max_memory_allocated()
        ts.unwrap(model)
        del model, opt
    assert all(torch.equal(a, b) for a, b in zip(losses[False], losses["auto"]))
    table = 32000 * 256 * 4
    print(f"\npeak allocated: table on the device {peaks[False] / 2**20:.1f} MiB, in host RAM "
          f"{peaks['auto'] / 2**20:.1f} MiB (table {table / 2**20:.1f} MiB)")
    assert peaks[False] - peaks["auto"] >= 0.9 * table
