"""Tiny transformers models built from configs (no hub), for the quantize_model and PEFT tests."""
import pytest
import torch

def _tiny_llama(hidden=128, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def _tiny_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory: ``tiny_llama(hidden=128, seed=0)``, a 2-layer Llama in eval mode (7 linears per layer)."""
    pytest.importorskip("transformers")
    return _tiny_llama


@pytest.fixture(scope="session")
def tiny_gpt2():
    """Factory: ``tiny_gpt2(seed=0)``, a 2-layer GPT-2 (Conv1D layers, lm_head tied to wte) in eval mode."""
    pytest.importorskip("transformers")
    return _tiny_gpt2


@pytest.fixture(scope="session")
def token_ids():
    """Factory: ``token_ids(seed=1, batch=4)``, (batch, 32) token ids."""
    return lambda seed=1, batch=4: torch.randint(0, 256, (batch, 32), generator=torch.Generator().manual_seed(seed))
