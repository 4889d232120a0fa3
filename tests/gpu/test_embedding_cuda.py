"""host_embedding on the GPU: a CUDA tensor over pinned host memory (_C.mapped_device_view) reads and writes that
memory, nn.Embedding over it gives the device table's rows bit for bit with no host sync, and a wrapped model whose
plan is short of memory keeps its frozen input embedding there, training as the same model with the table on the
device, in less device memory (printed, with the gather's time at the Llama-3-8B shape)."""
import pytest
import torch
from peft import LoraConfig, get_peft_model

import trainstream_hf as ts
from trainstream_hf import _C
from tests.helpers import cuda_median_ms, tiny_llama


def test_the_view_is_the_pinned_memory():
    host = torch.randn(300, 24).pin_memory()
    view = _C.mapped_device_view(host, torch.cuda.current_device())
    assert view.is_cuda and view.shape == host.shape and torch.equal(view.cpu(), host)
    view[7].fill_(3.0)  # a device write lands in host memory
    torch.cuda.synchronize()
    assert torch.equal(host[7], torch.full((24,), 3.0))
    with pytest.raises(ValueError, match="pinned CPU tensor"):
        _C.mapped_device_view(torch.randn(4), 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [4096, 7])
def test_nn_embedding_over_the_view_gives_the_device_tables_rows(dtype, dim):
    host = torch.randn(1000, dim).to(dtype).pin_memory()
    view = _C.mapped_device_view(host, torch.cuda.current_device())
    ids = torch.randint(0, 1000, (3, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = torch.nn.functional.embedding(ids, view)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, torch.nn.functional.embedding(ids, host.cuda()))


def test_the_gather_time_at_the_llama3_8b_shape():
    host = torch.randn(128256, 4096, dtype=torch.bfloat16).pin_memory()
    view = _C.mapped_device_view(host, torch.cuda.current_device())
    device = host.cuda()
    ids = torch.randint(0, 128256, (1, 2048), device="cuda")
    ms = cuda_median_ms(lambda: torch.nn.functional.embedding(ids, view))
    ms_device = cuda_median_ms(lambda: torch.nn.functional.embedding(ids, device))
    print(f"\nnn.Embedding of 2048 of 128256 x 4096 bf16 rows: host-mapped {ms:.3f} ms, device {ms_device:.3f} ms")
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
    peaks, losses, saved = {}, {}, {}
    for setting in (False, "auto"):
        model = _lora()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model, opt = ts.wrap(model, opt, vram_budget="8GiB", offload_activations=True, min_activation_bytes=0,
                             host_embedding=setting)
        assert (ts.engine_of(model).host_embedding is not None) == (setting == "auto")
        losses[setting] = []
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[setting].append(loss.detach())
        torch.cuda.synchronize()
        peaks[setting] = torch.cuda.max_memory_allocated()
        saved[setting] = {k: v.cpu() for k, v in model.state_dict().items() if "embed_tokens" in k}
        ts.unwrap(model)
        assert model.get_input_embeddings().weight.is_cuda
        del model, opt
    assert all(torch.equal(a, b) for a, b in zip(losses[False], losses["auto"]))
    assert saved[False].keys() == saved["auto"].keys() and all(torch.equal(saved[False][k], saved["auto"][k])
                                                               for k in saved[False])
    table = 32000 * 256 * 4
    print(f"\npeak allocated: table on the device {peaks[False] / 2**20:.1f} MiB, in host RAM "
          f"{peaks['auto'] / 2**20:.1f} MiB (table {table / 2**20:.1f} MiB)")
    assert peaks[False] - peaks["auto"] >= 0.9 * table
