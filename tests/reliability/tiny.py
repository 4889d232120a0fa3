"""The tiny Llama and token rows the Trainer tests of this folder train on (CPU, a few seconds)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(layers: int = 2) -> LlamaForCausalLM:
    """hidden 64, vocab 100, 32 positions; the same weights on every call (seed 0)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                        max_position_embeddings=32))


def token_rows(rows: int) -> list[dict]:
    """``rows`` examples of 16 random tokens, labels = inputs; the same on every call (seed 7)."""
    g = torch.Generator().manual_seed(7)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, 100, (rows, 16), generator=g)]
