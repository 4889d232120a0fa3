"""losses.sequence_logprobs / dpo_loss and integrations.huggingface.reference_logprobs on tiny models built here."""
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from trainstream_hf.integrations.huggingface import reference_logprobs
from trainstream_hf import losses
from trainstream_hf.losses import dpo_loss, sequence_logprobs

B, T = 3, 17


def _llama(vocab=131, **kw):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, **kw)
    return LlamaForCausalLM(cfg).float()


def _gpt2():
    cfg = GPT2Config(vocab_size=131, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
                     bos_token_id=0, eos_token_id=0,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return GPT2LMHeadModel(cfg).float()


def _gemma2():
    cfg = Gemma2Config(vocab_size=131, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
                       final_logit_softcapping=3.0, attn_logit_softcapping=None)
    return Gemma2ForCausalLM(cfg).float()


MODELS = {"llama": _llama, "gpt2": _gpt2, "gemma2_softcap": _gemma2}


def _batch(vocab=131, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -5:] = 0  # right padding
    attn[2, :3] = 0  # left padding
    labels = torch.ones(B, T, dtype=torch.long)
    labels[0, :6] = 0  # prompts of different lengths
    labels[1, :4] = 0
    labels[2, :9] = 0
    return ids, attn, labels


def _naive(model, ids, attn, labels, average=False):
    logits = model(input_ids=ids, attention_mask=attn).logits
    logp = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = (attn.bool() & labels.bool())[:, 1:].float()
    out = (logp * mask).sum(1)
    return out / mask.sum(1).clamp(min=1) if average else out


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("chunk_tokens,average", [(7, False), (1024, True)])
def test_sequence_logprobs_exact_forward_and_backward(name, chunk_tokens, average):
    torch.manual_seed(1)
    model = MODELS[name]().eval()
    ids, attn, labels = _batch()
    weights = torch.randn(B)  # an arbitrary upstream gradient

    ref = _naive(model, ids, attn, labels, average)
    (ref * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    got = sequence_logprobs(model, ids, attn, labels, chunk_tokens=chunk_tokens, average=average)
    (got * weights).sum().backward()

    assert got.shape == (B,) and got.dtype == torch.float32
    assert (got < 0).all() and got.abs().min() > 1  # non-trivial values, so the comparison means something
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-5, msg=n)
        assert ref_grads[n].abs().max() > 0 or "wpe" in n or "embed" in n, n


def test_default_mask_is_all_non_padding_after_first():
    torch.manual_seed(2)
    model = _llama().eval()
    ids, attn, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(model, ids, attn, chunk_tokens=5),
                                   _naive(model, ids, attn, torch.ones_like(ids)), atol=1e-5, rtol=1e-6)
        no_mask = sequence_logprobs(model, ids)
        full = _naive(model, ids, torch.ones_like(ids), torch.ones_like(ids))
    torch.testing.assert_close(no_mask, full, atol=1e-5, rtol=1e-6)


def test_lora_gradients_flow_and_match_naive():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.eval()
    ids, attn, labels = _batch()
    ref = _naive(model, ids, attn, labels).sum()
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    sequence_logprobs(model, ids, attn, labels, chunk_tokens=8).sum().backward()
    assert ref_grads and all("lora_" in n for n in ref_grads)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().max() > 0, n
            torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-5, msg=n)


def test_unsupported_models_are_refused():
    from peft import PrefixTuningConfig, get_peft_model

    model = _llama()
    model.config.model_type = "falcon_h1"
    with pytest.raises(NotImplementedError, match="lm_head_multiplier"):
        sequence_logprobs(model, torch.randint(0, 131, (1, 4)))
    prefix = get_peft_model(_llama(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(NotImplementedError, match="prompt-learning"):
        sequence_logprobs(prefix, torch.randint(0, 131, (1, 4)))


class _AllocationTracker(TorchDispatchMode):
    """Every aten op (forward and backward run through the mode) reports its outputs: ``largest`` is the biggest
    storage any op creates, ``peak`` the most bytes of op-created storages alive at once (each storage counted from
    the op that made it until its tensor dies; parameters made before the mode are not counted). Kernel-internal
    scratch buffers are not seen."""

    def __init__(self):
        super().__init__()
        self.largest = self.live = self.peak = 0
        self._alive = set()

    def _free(self, key, nbytes):
        self._alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t._base is None:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                self.largest = max(self.largest, nbytes)
                if nbytes and key not in self._alive:
                    self._alive.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key, nbytes)
        return out


@pytest.mark.parametrize("checkpointed", [True, False])
def test_memory_bounded_forward_and_backward(checkpointed, monkeypatch):
    V, TT, BB, chunk = 32000, 256, 2, 64
    torch.manual_seed(4)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=TT, initializer_range=0.2)
    model = LlamaForCausalLM(cfg).float()
    ids = torch.randint(0, V, (BB, TT))
    full_logits = BB * TT * V * 4
    chunk_logits = chunk * V * 4
    if not checkpointed:  # the same code saving each chunk's logits for backward: the peak check must catch it
        monkeypatch.setattr(losses, "checkpoint", lambda fn, *args, use_reentrant: fn(*args))

    mode = _AllocationTracker()
    with mode:
        lp = sequence_logprobs(model, ids, chunk_tokens=chunk)
        lp.sum().backward()
    chunked = (mode.largest, mode.peak)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    mode = _AllocationTracker()
    with mode:  # the tracker must see the naive path's full logits, else the bounds below prove nothing
        naive = _naive(model, ids, torch.ones_like(ids), torch.ones_like(ids))
        naive.sum().backward()
    print(f"\ncheckpointed={checkpointed}: largest {chunked[0] / 2**20:.2f} MiB, peak live {chunked[1] / 2**20:.2f} MiB "
          f"(chunk logits {chunk_logits / 2**20:.2f} MiB); naive: largest {mode.largest / 2**20:.2f} MiB, "
          f"peak live {mode.peak / 2**20:.2f} MiB (full logits {full_logits / 2**20:.2f} MiB)")
    assert mode.largest >= full_logits and mode.peak >= 2 * full_logits
    assert chunked[0] <= chunk_logits  # no single intermediate above one chunk's fp32 logits
    torch.testing.assert_close(lp, naive, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(model.lm_head.weight.grad, grads["lm_head.weight"], atol=1e-5, rtol=1e-5)
    if checkpointed:
        # peak independent of T: a few chunk-sized buffers (logits, exp, grad) plus parameter grads
        assert chunked[1] <= 5 * chunk_logits, chunked
    else:
        assert chunked[1] > 5 * chunk_logits, chunked


def _trl_sigmoid_loss(pc, pr, rc, rr, beta):
    # Written out from trl 1.16 trl/trainer/dpo_trainer.py DPOTrainer._compute_loss (reverse_kl, loss_type "sigmoid"):
    # delta_score = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    # per_sequence_loss = -F.logsigmoid(self.beta * delta_score); loss += per_sequence_loss.mean()
    delta = (pc - rc) - (pr - rr)
    return -F.logsigmoid(beta * delta).mean()


def test_dpo_loss_matches_trl_formula():
    g = torch.Generator().manual_seed(5)
    pc, pr, rc, rr = (torch.randn(8, generator=g, dtype=torch.float64) * 40 - 120 for _ in range(4))
    pc.requires_grad_(True)
    for beta in (0.1, 0.5):
        loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=beta)
        torch.testing.assert_close(loss, _trl_sigmoid_loss(pc, pr, rc, rr, beta), atol=0, rtol=1e-12)
        torch.testing.assert_close(cr, beta * (pc - rc).detach())
        torch.testing.assert_close(rj, beta * (pr - rr).detach())
        assert not cr.requires_grad
    # the loss at equal log-ratios is log 2, and it falls as the chosen log-ratio grows
    same, _, _ = dpo_loss(pc, pr, pc.detach(), pr.detach())
    assert math.isclose(same.item(), math.log(2), rel_tol=1e-12)
    grad, = torch.autograd.grad(dpo_loss(pc, pr, rc, rr)[0], pc)
    assert (grad < 0).all()
    # robust, from the same TRL function: (clean - flipped) / (1 - 2 eps)
    eps, beta = 0.1, 0.1
    d = beta * ((pc - rc) - (pr - rr))
    want = ((-(1 - eps) * F.logsigmoid(d) - (-eps * F.logsigmoid(-d))) / (1 - 2 * eps)).mean()
    torch.testing.assert_close(dpo_loss(pc, pr, rc, rr, beta, "robust", eps)[0], want)
    with pytest.raises(ValueError, match="no effect"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.1)


def test_reference_logprobs_is_base_model_without_adapters():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(6)
    base = _llama()
    base_copy = _llama()
    base_copy.load_state_dict(base.state_dict())
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                            lora_dropout=0.5, init_lora_weights=False))
    model.train()
    ids, attn, labels = _batch(seed=7)
    ids_r, attn_r, labels_r = _batch(seed=8)
    chosen = {"input_ids": ids, "attention_mask": attn, "completion_mask": labels}
    rejected = {"input_ids": ids_r, "attention_mask": attn_r, "labels_mask": labels_r}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    training_before = [m.training for m in model.modules()]

    rc, rr = reference_logprobs(model, chosen, rejected, chunk_tokens=5)

    with torch.no_grad():
        want_c = sequence_logprobs(base_copy.eval(), ids, attn, labels)
        want_r = sequence_logprobs(base_copy, ids_r, attn_r, labels_r)
        with_adapters = sequence_logprobs(model.eval(), ids, attn, labels)
    torch.testing.assert_close(rc, want_c, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(rr, want_r, atol=1e-5, rtol=1e-6)
    assert not rc.requires_grad and not rr.requires_grad
    assert (with_adapters - rc).abs().max() > 1e-2  # the adapters do matter, so the switch-off was real
    model.train()
    assert [m.training for m in model.modules()] == training_before
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    # adapters are back on after the call
    torch.testing.assert_close(sequence_logprobs(model.eval(), ids, attn, labels), with_adapters)


def test_reference_logprobs_needs_peft_or_ref_model():
    torch.manual_seed(9)
    model, ref = _llama(), _llama()
    ids = torch.randint(0, 131, (2, 9))
    with pytest.raises(TypeError, match="ref_model"):
        reference_logprobs(model, ids, ids)
    rc, rr = reference_logprobs(model, ids, ids.flip(1), ref_model=ref)
    with torch.no_grad():
        torch.testing.assert_close(rc, sequence_logprobs(ref.eval(), ids))
        torch.testing.assert_close(rr, sequence_logprobs(ref, ids.flip(1)))
