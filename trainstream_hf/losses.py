"""Sequence and per-token log-probabilities through the LM head in bounded chunks, and the DPO loss.

The log-probability of a sequence under a causal LM is

    log p(x_{t in S}) = sum_{t in S} [ z_t[x_t] - logsumexp_v z_t[v] ],   z_t = head(h_{t-1})

where ``h`` are the decoder's final hidden states and ``S`` the scored positions (the completion). Computing it as
``model(ids).logits.log_softmax(-1)`` materialises a [B, T, V] tensor (and its gradient): 2 x 4096 x 128k fp32 is
4 GiB. :func:`sequence_logprobs` instead gathers the hidden states of the scored positions only, and runs the head
over at most ``chunk_tokens`` of them at a time under ``torch.utils.checkpoint``, so that backward recomputes each
chunk's logits instead of keeping them: the largest intermediate is O(chunk_tokens x V) in forward and backward.
:func:`token_logprobs` is the same computation left per token ([B, T-1], zero where unscored), as GRPO needs it.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# Per-model knowledge: what the CausalLM's forward does to the head's output before returning ``logits``
# (transformers 5.24). Keyed by config attribute; the attribute's value parametrises the transform. A value of
# None means the transform is off (Gemma2 with ``final_logit_softcapping=None``).
_LOGIT_TRANSFORMS: dict[str, Callable[[Tensor, float], Tensor]] = {
    # gemma2 / gemma3 / ...: tanh soft-capping, modeling_gemma2.Gemma2ForCausalLM.forward
    "final_logit_softcapping": lambda z, cap: torch.tanh(z / cap) * cap,
    # recurrent_gemma: same soft-capping under another name
    "logits_soft_cap": lambda z, cap: torch.tanh(z / cap) * cap,
    # cohere / cohere2: ``logits * self.logit_scale``
    "logit_scale": lambda z, s: z * s,
    # granite / granitemoe: ``logits / config.logits_scaling``
    "logits_scaling": lambda z, s: z / s,
}

# Model types whose logits come from something other than head(last_hidden_state) followed by the transforms above;
# scoring them here would be silently wrong, so they are refused.
_UNSUPPORTED_MODEL_TYPES = {
    "falcon_h1": "multiplies the logits by model.lm_head_multiplier",
    "xlstm": "soft-caps the logits inside its backbone (output_logit_soft_cap)",
    "inkling": "scales the logits by a muP width multiplier",
    "inkling2": "scales the logits by a muP width multiplier",
}


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` under a PEFT wrapper (LoRA layers are injected in place, so they stay live)."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        raise NotImplementedError(
            "sequence_logprobs does not support prompt-learning PEFT methods (prefix/prompt tuning): they prepend "
            "virtual tokens inside PeftModel.forward. Use LoRA-style adapters."
        )
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def _logit_transforms(model: nn.Module) -> list[Callable[[Tensor], Tensor]]:
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type in _UNSUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"sequence_logprobs does not support model_type {model_type!r}: it {_UNSUPPORTED_MODEL_TYPES[model_type]}. "
            "Add its logit transform to trainstream_hf.losses._LOGIT_TRANSFORMS."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError("sequence_logprobs supports decoder-only causal LMs, not encoder-decoder models.")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = []
    for attr, fn in _LOGIT_TRANSFORMS.items():
        value = getattr(text_config, attr, None)
        if value is not None:
            out.append(lambda z, fn=fn, value=float(value): fn(z, value))
    return out


def _chunk_token_logprobs(head: nn.Module, transforms, hidden: Tensor, targets: Tensor) -> Tensor:
    """log p(target) for one chunk of hidden states [n, H] -> [n], in fp32 whatever the model dtype."""
    logits = head(hidden).float()
    for transform in transforms:
        logits = transform(logits)
    # gather - logsumexp instead of log_softmax: one [n, V] temporary fewer.
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _scored_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    labels_mask: Tensor | None,
    chunk_tokens: int,
    temperature: float = 1.0,
    score_masked: bool = False,
) -> tuple[Tensor, Tensor]:
    """(token_logps [N] fp32, scored [B, T-1] bool): log p(input_ids[:, 1:]) at the N scored positions, in order."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if labels_mask is None:
        scored = attention_mask.bool()
    else:
        scored = labels_mask.bool() if score_masked else attention_mask.bool() & labels_mask.bool()
    scored = scored[:, 1:]

    lm = _unwrap(model)
    transforms = _logit_transforms(lm)
    if temperature != 1.0:
        # Sampling temperature divides the final logits, after soft-capping / scaling (as generate and TRL do).
        transforms.append(lambda z, t=float(temperature): z / t)
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings (LM head); pass a *ForCausalLM model.")
    decoder = lm.get_decoder()
    if decoder is lm:
        raise ValueError(f"{type(lm).__name__}.get_decoder() returned the model itself; pass a *ForCausalLM model.")

    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    # Only the scored positions go through the head: prompt and padding cost nothing there.
    hidden = hidden[:, :-1][scored]  # [N, H]
    targets = input_ids[:, 1:][scored]  # [N]

    differentiable = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    pieces = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if differentiable:
            # Non-reentrant checkpoint saves only (h, y); backward recomputes this chunk's [n, V] logits,
            # differentiates them and frees them before the next chunk.
            pieces.append(checkpoint(_chunk_token_logprobs, head, transforms, h, y, use_reentrant=False))
        else:
            pieces.append(_chunk_token_logprobs(head, transforms, h, y))
    token_logps = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
    return token_logps, scored


def sequence_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    labels_mask: Tensor | None = None,
    *,
    chunk_tokens: int = 1024,
    average: bool = False,
) -> Tensor:
    """Per-sequence log-probability of the scored tokens, never materialising [B, T, V] logits.

    Equal (up to float rounding) to ``model(input_ids, attention_mask).logits.log_softmax(-1)`` gathered at
    ``input_ids[:, 1:]`` and summed over the scored positions, forward and backward.

    Args:
        model: a transformers decoder-only ``*ForCausalLM`` or a (LoRA-style) PEFT model over one. Hidden states
            come from ``get_decoder()`` of the unwrapped model, the head from ``get_output_embeddings()``; logit
            soft-capping / scaling from the config (``_LOGIT_TRANSFORMS``) is applied, unknown ones are refused.
        input_ids: [B, T] token ids.
        attention_mask: [B, T], 1 for real tokens, 0 for padding. Default: all ones.
        labels_mask: [B, T], 1 where token t is scored (predicted from the tokens before it), e.g. TRL's
            ``completion_mask``. Combined with ``attention_mask``; position 0 is never scored (nothing predicts it).
            Default: every non-padding position after the first.
        chunk_tokens: how many scored tokens go through the head at once; bounds the largest intermediate at
            about ``chunk_tokens * V * 4`` bytes in forward and in backward (each chunk is recomputed there).
        average: divide each sequence's sum by its number of scored tokens (a sequence with none gives 0).

    Returns:
        [B] fp32 tensor, differentiable with respect to the model's trainable parameters.
    """
    token_logps, scored = _scored_token_logprobs(model, input_ids, attention_mask, labels_mask, chunk_tokens)
    batch = input_ids.shape[0]
    rows = torch.arange(batch, device=input_ids.device).unsqueeze(1).expand_as(scored)[scored]  # [N]
    out = torch.zeros(batch, dtype=torch.float32, device=input_ids.device).index_add(0, rows, token_logps)
    if average:
        out = out / scored.sum(dim=1).clamp(min=1).to(out.dtype)
    return out


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    labels_mask: Tensor | None = None,
    *,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    score_masked: bool = False,
) -> Tensor:
    """Per-token log-probabilities of the scored tokens, never materialising [B, T, V] logits.

    ``out[b, t] = log softmax(z_t / temperature)[input_ids[b, t+1]]`` where token t+1 is scored, else 0: the
    per-token form of :func:`sequence_logprobs` (which is ``token_logprobs(...).sum(1)`` at ``temperature=1``), as
    GRPO-style losses need it. Same chunking, same memory bound, same logit transforms; ``temperature`` divides the
    logits after them, as ``generate`` and TRL 1.16's ``GRPOTrainer`` do.

    Args:
        model, input_ids, attention_mask, labels_mask, chunk_tokens: as for :func:`sequence_logprobs`.
        temperature: the sampling temperature the logits are divided by (> 0).
        score_masked: ``labels_mask`` alone says which tokens are scored, those whose ``attention_mask`` is 0
            included (what a full forward's logits give there; TRL's Online DPO reads them in its statistics).

    Returns:
        [B, T - 1] fp32 tensor, zero at unscored positions, differentiable with respect to the model's trainable
        parameters.
    """
    token_logps, scored = _scored_token_logprobs(model, input_ids, attention_mask, labels_mask, chunk_tokens,
                                                 temperature, score_masked)
    # masked_scatter keeps the graph (and gives a [B, T-1] of zeros when nothing is scored).
    return token_logps.new_zeros(scored.shape).masked_scatter(scored, token_logps)


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO loss from sequence log-probabilities (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290, Eq. 7).

    ``delta = (pi_c - ref_c) - (pi_r - ref_r)``. Matches TRL 1.16, ``trl/trainer/dpo_trainer.py``,
    ``DPOTrainer._compute_loss`` with ``f_divergence_type="reverse_kl"``, ``use_weighting=False``:

    * ``"sigmoid"``: ``-logsigmoid(beta * delta)``. TRL 1.16 ignores ``label_smoothing`` here (older TRL applied
      conservative-DPO smoothing, ``-(1-e) logsigmoid(b d) - e logsigmoid(-b d)``); a non-zero value is refused
      rather than silently ignored.
    * ``"robust"`` (Chowdhury et al. 2024): ``(-(1-e) logsigmoid(b d) + e logsigmoid(-b d)) / (1 - 2e)``.
    * ``"hinge"``: ``relu(1 - beta * delta)``.

    Rewards are TRL's logged ``rewards/chosen`` / ``rewards/rejected``: ``beta * (pi - ref)``, detached.

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: [B] sequence log-probabilities.
        beta: the KL temperature.
        loss_type: ``"sigmoid"``, ``"robust"`` or ``"hinge"``.
        label_smoothing: the flip probability of ``"robust"``, in [0, 0.5).

    Returns:
        (loss, chosen_rewards, rejected_rewards): the mean loss over the batch (scalar) and two [B] tensors.
    """
    if not math.isclose(label_smoothing, 0.0) and loss_type != "robust":
        raise ValueError(
            f"label_smoothing={label_smoothing} has no effect with loss_type={loss_type!r} in TRL 1.16; "
            "use loss_type='robust' for label-flip smoothing."
        )
    chosen_logratios = policy_chosen - ref_chosen
    rejected_logratios = policy_rejected - ref_rejected
    logits = beta * (chosen_logratios - rejected_logratios)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(logits)
    elif loss_type == "robust":
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"robust DPO needs label_smoothing in [0, 0.5), got {label_smoothing}")
        losses = (
            -(1 - label_smoothing) * F.logsigmoid(logits) + label_smoothing * F.logsigmoid(-logits)
        ) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - logits)
    else:
        raise ValueError(f"loss_type must be 'sigmoid', 'robust' or 'hinge', got {loss_type!r}")
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return losses.mean(), chosen_rewards, rejected_rewards
