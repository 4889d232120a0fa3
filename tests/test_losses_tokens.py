"""losses.token_logprobs (per-token, chunked through the LM head) against naive full logits, on tiny models."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from trainstream_hf.losses import sequence_logprobs, token_logprobs

B, T, V = 3, 17, 131


def _llama():
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
    return LlamaForCausalLM(cfg).float()


def _gemma2():
    cfg = Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, initializer_range=0.2, final_logit_softcapping=3.0,
                       attn_logit_softcapping=None)
    return Gemma2ForCausalLM(cfg).float()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -5:] = 0  # right padding inside the completion
    attn[2, :3] = 0  # left padding
    labels = torch.zeros(B, T, dtype=torch.long)
    labels[:, -8:] = 1  # the last 8 tokens are the completion, as in GRPO's logits_to_keep
    return ids, attn, labels


def _naive(model, ids, attn, labels, temperature):
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    logp = logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp * (attn.bool() & labels.bool())[:, 1:]


@pytest.mark.parametrize("make", [_llama, _gemma2], ids=["llama", "gemma2_softcap"])
@pytest.mark.parametrize("chunk_tokens,temperature", [(5, 1.0), (1024, 0.7)])
def test_token_logprobs_exact_forward_and_backward(make, chunk_tokens, temperature):
    torch.manual_seed(1)
    model = make().eval()
    ids, attn, labels = _batch()
    weights = torch.randn(B, T - 1)  # an arbitrary upstream gradient

    want = _naive(model, ids, attn, labels, temperature)
    (want * weights).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    got = token_logprobs(model, ids, attn, labels, chunk_tokens=chunk_tokens, temperature=temperature)
    (got * weights).sum().backward()

    scored = (attn.bool() & labels.bool())[:, 1:]
    assert got.shape == (B, T - 1) and got.dtype == torch.float32
    assert (got[~scored] == 0).all() and (got[scored] < -0.5).all()  # non-trivial values where scored
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], atol=1e-5, rtol=1e-5, msg=n)
    if temperature == 1.0:
        with torch.no_grad():
            torch.testing.assert_close(got.detach().sum(1), sequence_logprobs(model, ids, attn, labels), atol=1e-5,
                                       rtol=1e-6)


def test_token_logprobs_nothing_scored_and_bad_arguments():
    model = _llama().eval()
    ids, attn, _ = _batch()
    out = token_logprobs(model, ids, attn, torch.zeros_like(ids))
    assert out.shape == (B, T - 1) and not out.any()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(model, ids, chunk_tokens=0)


class _Largest(TorchDispatchMode):
    """The largest storage any aten op creates (forward and backward)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t._base is None:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_token_logprobs_never_holds_full_logits():
    vocab, tt, bb, chunk = 8000, 128, 2, 32
    torch.manual_seed(4)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=tt, initializer_range=0.2)
    model = LlamaForCausalLM(cfg).float()
    ids = torch.randint(0, vocab, (bb, tt))
    with _Largest() as chunked:
        got = token_logprobs(model, ids, chunk_tokens=chunk, temperature=0.9)
        got.sum().backward()
    with _Largest() as naive, torch.no_grad():  # the tracker must see the naive path's full logits
        want = _naive(model, ids, torch.ones_like(ids), torch.ones_like(ids), 0.9)
    assert naive.largest >= bb * tt * vocab * 4
    assert chunked.largest <= chunk * vocab * 4
    torch.testing.assert_close(got.detach(), want, atol=1e-4, rtol=1e-6)
