"""optimizer_in_backward on CUDA: real streams and events; the same bits as the ordinary overlapped step."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

import trainstream_hf as ts


@pytest.fixture(autouse=True)
def _deterministic():
    # two runs of the same step must agree to the bit (see test_wrap_cuda.py: the embedding's backward uses atomics)
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def _llama(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).to(dtype).cuda()


def _ids(step):
    return torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(100 + step)).cuda()


def _run(dtype, lagging_backward, **options):
    model = _llama(dtype)
    if lagging_backward:
        # Each block's backward starts with a ~1 ms spin on the compute stream, so its kernels run long after the host
        # queued them: a weight's H2D copy not ordered after the kernels that read it would overwrite it early.
        def lag(module, args, out):
            (out if isinstance(out, torch.Tensor) else out[0]).register_hook(lambda g: torch.cuda._sleep(2_000_000))
        for layer in list(model.model.layers) + [model.lm_head]:
            layer.register_forward_hook(lag)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt = ts.wrap(model, opt, offload_optimizer=True, min_offload_numel=0, vram_budget="64GiB",
                         page_weights=False, offload_activations=False, **options)
    sched = get_linear_schedule_with_warmup(opt, 3, 10)
    losses = []
    for s in range(10):
        loss = model(input_ids=_ids(s), labels=_ids(s)).loss
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        sched.step()
        opt.zero_grad()
    ts.unwrap(model)
    return model, losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lagging_backward", [False, True])
def test_in_backward_equals_overlapped_step_cuda(dtype, lagging_backward):
    a, la = _run(dtype, lagging_backward, optimizer_in_backward=True)
    b, lb = _run(dtype, lagging_backward, grads="host", overlap_step=True)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
