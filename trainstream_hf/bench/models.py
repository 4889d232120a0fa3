"""Random-weight causal LMs of published shapes, built straight on the target device, and random batches.

The shape table is the only per-model knowledge: name -> transformers config kwargs (``model_type`` picks
the config class); any other model's config.json serves as a shape too (:func:`model_config`). Weights are random;
the benchmarks measure time and memory, not loss.
"""
from __future__ import annotations

import os
import re

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

SHAPES: dict[str, dict] = {
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-8B: Llama-3-8B's layers with a 128k context (its llama3 RoPE scaling is left out: it
    # changes no shape or cost); the shape of the longest-sequence search
    "llama3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # mistralai/Mistral-7B-v0.3 (no sliding window)
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, rope_theta=1000000.0,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
                       tie_word_embeddings=False),
    # Qwen/Qwen2.5-7B (q/k/v carry biases in Qwen2)
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # meta-llama/Llama-3.2-3B (its llama3 RoPE scaling is left out: it changes no shape or cost)
    "llama3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True),
    # Qwen/Qwen2.5-32B (q/k/v carry biases in Qwen2)
    "qwen2.5-32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, rope_theta=1000000.0,
                        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Small enough for CPU tests; GQA (4 heads, 2 kv heads) like the real ones.
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                 rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def model_config(shape: str) -> PretrainedConfig:
    """The transformers config of a shape (training settings: no KV cache).

    Args:
        shape: a key of :data:`SHAPES`, or a model of your own: a transformers config.json (a Hub checkpoint's), a
            folder holding one, or a JSON file of config kwargs with ``model_type`` (as under ``configs/models/``).
            Only the shape is read; the weights are random.

    Returns:
        A fresh config object (safe to modify).

    Raises:
        ValueError: neither a known name nor a readable config (the message lists the names).
    """
    if shape in SHAPES:
        kwargs = dict(SHAPES[shape])
        return AutoConfig.for_model(kwargs.pop("model_type"), use_cache=False, **kwargs)
    if not os.path.exists(shape):
        raise ValueError(f"unknown shape {shape!r}: name one of {', '.join(sorted(SHAPES))}, or give the path of a "
                         "model's config.json (or of a folder holding one)")
    from trainstream_hf.train.model import model_config as read_config

    try:
        config = read_config(shape)
    except Exception as e:  # a config transformers cannot read: one line, which file and why
        raise ValueError(f"shape {shape!r}: not a transformers model config ({type(e).__name__}: {e})") from None
    config.use_cache = False
    return config


def shape_label(shape: str) -> str:
    """A name for ``shape`` in result file names: the name itself, or for a config path the name of the model's folder
    (``.../Qwen3-8B/config.json`` -> ``qwen3-8b``) or file (``configs/models/llama3-8b.json`` -> ``llama3-8b``)."""
    if shape in SHAPES:
        return shape
    path = os.path.normpath(os.path.abspath(shape))
    if os.path.basename(path) == "config.json":
        path = os.path.dirname(path)
    name = os.path.splitext(os.path.basename(path))[0] if os.path.isfile(path) else os.path.basename(path)
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "model"


def build_model(shape: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                seed: int = 0) -> PreTrainedModel:
    """Builds a random-weight causal LM of ``shape`` directly on ``device``, in training mode.

    Parameters are allocated and initialised on ``device`` in ``dtype``, one block at a time, the way the recipes
    and the benchmark's trainstream rows build theirs (:func:`trainstream_hf.train.model.materialize`), so every
    row of a benchmark starts from the same weights for one seed, and an 8B model never passes through host memory
    or through fp32.

    Args:
        shape: a key of :data:`SHAPES` or a config path (:func:`model_config`).
        dtype: parameter dtype (bf16 for frozen bases, fp32 for fp32-master full fine-tuning).
        device: where to build; ``"meta"`` builds without memory (for counting parameters).
        seed: seeds torch's generators before initialisation, so two builds are equal.

    Returns:
        The model, ``attn_implementation="sdpa"``, ``use_cache=False``, in ``train()`` mode.
    """
    config = model_config(shape)
    torch.manual_seed(seed)
    if torch.device(device).type == "meta":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        return model.train()
    from trainstream_hf.train.model import materialize, skeleton

    model = materialize(skeleton(config, dtype), device=device, home=device)
    return model.train()


def make_batch(batch: int, seq: int, vocab: int, device: str | torch.device = "cuda",
               seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch of uniformly random tokens; labels equal the inputs (the model shifts them).

    Args:
        batch: sequences per batch.
        seq: tokens per sequence.
        vocab: vocabulary size (tokens are drawn from ``[0, vocab)``).
        device: where the tensors live.
        seed: seed of the (CPU) generator, so the batch does not depend on the device.

    Returns:
        ``{"input_ids": LongTensor[batch, seq], "labels": LongTensor[batch, seq]}``.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def lora_step_flops(shape: str, batch: int, seq: int, r: int = 16) -> float:
    """Model FLOPs of one training step of LoRA rank ``r`` on every linear layer of the decoder blocks over a frozen
    base of ``shape`` (the table's step), counted from the shape, not from any implementation: recomputation and
    dequantization are not model FLOPs.

    Forward: 2 FLOPs per weight per token for each linear layer (the blocks' and ``lm_head``) and causal attention's
    two products (``QK^T`` and ``PV``, half of the square each: ``2 * seq^2 * heads * head_dim`` per layer and
    sequence). Backward: the frozen linear layers need only their input gradient (1x their forward), attention its
    three operands' gradients (2x), the adapters their input and weight gradients (2x): in all 2x the linear layers'
    forward, 3x attention's, and ``6 * tokens`` per adapter parameter. The linear layers are the model's own, built
    without memory, so any family counts alike; every attention layer is counted as full causal attention.
    """
    cfg = model_config(shape)
    model = build_model(shape, device="meta")
    out = model.get_output_embeddings()
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not out]
    linear = sum(m.in_features * m.out_features for m in blocks) + (out.in_features * out.out_features
                                                                     if isinstance(out, torch.nn.Linear) else 0)
    adapters = sum(r * (m.in_features + m.out_features) for m in blocks)
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    tokens = batch * seq
    attention_fwd = layers * batch * 2 * seq * seq * heads * hd
    return float(2 * 2 * tokens * linear + 3 * attention_fwd + 6 * tokens * adapters)
