"""TRL's Online DPO (``trl.experimental.online_dpo``, TRL 1.16) with trainstream, and generation through the paged KV
cache for the online trainers.

TRL 1.16 ships ``OnlineDPOTrainer`` under ``trl.experimental`` (its API may change between TRL releases; importing it
warns so). :class:`TrainStreamOnlineDPOTrainer` differs from it as the DPO and GRPO subclasses do
(:mod:`trainstream_hf.integrations.trl`):

* The engine: ``trainstream_config=`` (or a :class:`TrainStreamOnlineDPOConfig`) installs it when the optimizer is
  created (``EngineTrainerMixin``); its figures go into every log as ``trainstream/*``.
* One model in memory. TRL keeps no reference model when it is given ``peft_config`` (the reference is the policy
  with its adapters disabled), but it deep-copies a policy that is already a ``PeftModel`` (its
  ``create_reference_model``); here a PEFT policy never gets a copy, whichever way it came. A policy without adapters
  and without an explicit ``ref_model`` is refused (TRL would copy the whole model).
* The reference log-probabilities: TRL 1.16 scores them with ``_forward`` (full ``[B, T, V]`` logits and a
  ``log_softmax`` over the vocabulary) under ``self.model.disable_adapter()`` and ``no_grad``; exactly that call
  (text only, adapters off, no grad) is answered by :func:`~trainstream_hf.losses.token_logprobs`, the LM head
  ``ref_chunk_tokens`` at a time. Every completion position is scored, padding included, as TRL's ``_forward`` does
  (its KL statistics read them); the loss masks them.
* ``generation_cache``: a fraction in [0, 1] makes TRL's ``generate`` call use a
  :class:`~trainstream_hf.cache.TrainStreamCache` with that fraction of the layers' K/V resident on the device (the
  rest streamed from pinned host pages); None (default) leaves TRL's choice. ``TrainStreamGRPOTrainer`` takes the
  same argument.

TRL 1.16 internals relied on: ``OnlineDPOTrainer._forward(model, prompt_ids, prompt_mask, completion_ids,
completion_mask, vision_inputs)`` and its left truncation to ``max_length``; ``training_step`` calling ``_generate``
then ``_forward``; ``create_reference_model`` looked up in the trainer's module at ``__init__``.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
from accelerate.utils import is_peft_model
from torch import nn

with warnings.catch_warnings():  # the import's own "experimental" warning: this module's docstring says it
    warnings.simplefilter("ignore")
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    from trl.experimental.online_dpo import online_dpo_trainer as _trl_online

from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.integrations.transformers import EngineTrainerMixin, TrainStreamTrainingArguments
from trainstream_hf.integrations.trl import (_drop_stale_input_grad_hooks, _is_prompt_learning, _log, _reference_pass,
                                             _synchronize_engines)
from trainstream_hf.losses import token_logprobs

__all__ = ["TrainStreamOnlineDPOConfig", "TrainStreamOnlineDPOTrainer", "close_kept", "generation_through_cache",
           "release_generation_pages"]


@dataclass
class TrainStreamOnlineDPOConfig(OnlineDPOConfig, TrainStreamTrainingArguments):
    """``trl.experimental.online_dpo.OnlineDPOConfig`` plus ``trainstream`` and every ``trainstream_<option>``."""


def check_generation_cache(resident: float | None) -> float | None:
    if resident is None:
        return None
    if isinstance(resident, bool) or not isinstance(resident, (int, float)) or not 0.0 <= float(resident) <= 1.0:
        raise ValueError(f"generation_cache: the fraction of layers whose K/V stays on the device, in [0, 1], or None "
                         f"(TRL's own cache), got {resident!r}")
    return float(resident)


@contextlib.contextmanager
def generation_through_cache(model: nn.Module, resident: float | None, keep: dict | None = None) -> Iterator[None]:
    """For the duration, a ``model.generate`` call given no cache gets a fresh
    :class:`~trainstream_hf.cache.TrainStreamCache` of ``model`` with ``resident`` of its layers on the device (closed
    when the call returns). Nothing changes with ``resident=None``.

    With ``keep`` (a dict the caller owns), the cache is static instead (``TrainStreamCache(static=True)``, sized for
    the prompt plus ``max_new_tokens``, rounded up to 64 tokens), so that generate() can compile its decode step over
    it; it is kept in ``keep`` and reset for the next call of the same batch that fits it, as transformers keeps its
    own static cache, so that the compiled step finds the same buffers. ``close_kept(keep)`` releases it."""
    if resident is None:
        yield
        return
    from trainstream_hf.cache import TrainStreamCache, cache_keyword

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    key = cache_keyword(base)
    had = "generate" in model.__dict__
    original = model.generate

    def generate(*args, **kwargs):
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return original(*args, **kwargs)
        # TRL turns the cache off under gradient checkpointing (use_cache=False in its generation config); generate()
        # would then feed the whole sequence at every step into the cache given here, and decode wrong tokens
        kwargs["use_cache"] = True
        if keep is None:
            cache = TrainStreamCache(base, resident=resident)
            try:
                return original(*args, **{**kwargs, key: cache})
            finally:
                cache.close()
        ids = kwargs.get("input_ids", args[0] if args else None)
        need = ids.shape[1] + _new_tokens(base, ids.shape[1], kwargs)
        cache, kept = keep.get("cache"), keep.get("size")
        if cache is not None and kept[0] == ids.shape[0] and kept[2] == ids.device and kept[1] >= need:
            cache.reset()  # (prompts of another length: the same capacity, so the same compiled step)
        else:
            close_kept(keep)
            size = (ids.shape[0], -(-need // 64) * 64, ids.device)
            cache = keep["cache"] = TrainStreamCache(base, resident=resident, static=True, max_cache_len=size[1])
            keep["size"] = size
        return original(*args, **{**kwargs, key: cache})

    model.generate = generate
    try:
        yield
    finally:
        if had:
            model.generate = original
        else:
            del model.generate


def close_kept(keep: dict) -> None:
    """Releases the static cache :func:`generation_through_cache` kept in ``keep``."""
    cache = keep.pop("cache", None)
    keep.pop("size", None)
    if cache is not None:
        cache.close()


def release_generation_pages(model: nn.Module) -> None:
    """At the end of training: the pinned host pages the caches of :func:`generation_through_cache` left with the
    model for its next cache (``trainstream_hf.cache.release_host_pages``) go back, instead of staying pinned while
    the trained model lives."""
    from trainstream_hf.cache import release_host_pages

    release_host_pages(model.get_base_model() if hasattr(model, "get_base_model") else model)


def _new_tokens(model: nn.Module, prompt: int, kwargs: dict) -> int:
    """The most tokens a generate() call adds: its ``max_new_tokens``, or ``max_length`` less the prompt."""
    config = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", config.max_new_tokens)
    if new is None:
        new = kwargs.get("max_length", config.max_length) - prompt
    if new is None or new < 1:
        raise ValueError(f"generation through a static TrainStreamCache needs max_new_tokens >= 1, got {new}")
    return int(new)


_INIT = inspect.signature(OnlineDPOTrainer.__init__)


class TrainStreamOnlineDPOTrainer(EngineTrainerMixin, OnlineDPOTrainer):
    """``trl.experimental.online_dpo.OnlineDPOTrainer`` (TRL 1.16) with the trainstream engine, one model in memory
    and chunked reference log-probabilities (module docstring).

    Args:
        *args, **kwargs: as for ``OnlineDPOTrainer``.
        trainstream_config: installs the engine when the optimizer is created (or a
            :class:`TrainStreamOnlineDPOConfig` that turns it on).
        ref_chunk_tokens: completion tokens per LM-head chunk in the reference pass.
        generation_cache: resident fraction of a :class:`~trainstream_hf.cache.TrainStreamCache` for TRL's
            ``generate`` (None: TRL's own cache).

    Raises:
        ValueError: a policy without adapters and no ``ref_model`` (TRL would copy the whole model), ``vllm``
            generation with ``generation_cache``, ``ref_chunk_tokens < 1``, a ``generation_cache`` outside [0, 1].
    """

    def __init__(self, *args, trainstream_config: TrainStreamConfig | None = None, ref_chunk_tokens: int = 1024,
                 generation_cache: float | None = None, **kwargs):
        if ref_chunk_tokens < 1:
            raise ValueError(f"ref_chunk_tokens must be >= 1, got {ref_chunk_tokens}")
        self.ref_chunk_tokens = int(ref_chunk_tokens)
        self.generation_cache = check_generation_cache(generation_cache)
        bound = _INIT.bind(self, *args, **kwargs).arguments
        model, args_ = bound["model"], bound.get("args")
        peft_policy = bound.get("peft_config") is not None or (isinstance(model, nn.Module) and is_peft_model(model))
        if bound.get("ref_model") is None and not peft_policy:
            raise ValueError(
                "TrainStreamOnlineDPOTrainer: Online DPO needs a reference policy, and for a model without adapters "
                "TRL would make it a full copy of the model; trainstream keeps one model in memory. Train LoRA "
                "adapters (pass peft_config=LoraConfig(...), or a peft.PeftModel) so that the reference is the same "
                "model with its adapters disabled, or pass ref_model= yourself.")
        if self.generation_cache is not None and args_ is not None and getattr(args_, "use_vllm", False):
            raise ValueError("TrainStreamOnlineDPOTrainer: generation_cache applies to transformers' generate; with "
                             "use_vllm=True vLLM generates. Drop one of them.")
        cfg = self._ts_setup(args_, trainstream_config)
        # TRL 1.16 deep-copies a policy that is already a PeftModel (it checks peft_config only): no copy here.
        copy = _trl_online.create_reference_model
        if bound.get("ref_model") is None and peft_policy:
            _trl_online.create_reference_model = lambda m, *a, **k: None
        try:
            super().__init__(*args, **kwargs)
        finally:
            _trl_online.create_reference_model = copy
        self._ts_attach(cfg)

    # -- the reference ------------------------------------------------------------------------------
    def _ts_is_reference_call(self, model, prompt_ids, vision_inputs) -> bool:
        if self.ref_model is not None or model is not self.model or torch.is_grad_enabled():
            return False
        if vision_inputs is not None or prompt_ids.size(1) == 0:
            return False
        scorer = self.accelerator.unwrap_model(model)
        if not is_peft_model(scorer) or _is_prompt_learning(scorer):
            return False
        # TRL's self.model.disable_adapter(): every LoRA layer's adapters off (other PEFT tuners: TRL's own path)
        lora = [m for m in scorer.modules() if hasattr(m, "lora_A") and hasattr(m, "disable_adapters")]
        return bool(lora) and all(m.disable_adapters for m in lora)

    def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        """TRL 1.16 internal; the reference call is answered here, every other one by TRL (module docstring)."""
        if not self._ts_is_reference_call(model, prompt_ids, vision_inputs):
            return super()._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs)
        over = max(prompt_ids.size(1) + completion_ids.size(1) - self.max_length, 0)  # TRL's left truncation
        prompt_ids, prompt_mask = prompt_ids[:, over:], prompt_mask[:, over:]
        ids = torch.cat((prompt_ids, completion_ids), dim=1)
        mask = torch.cat((prompt_mask, completion_mask), dim=1)
        scored = torch.zeros_like(mask)
        scored[:, prompt_ids.size(1):] = 1  # every completion position, as TRL's _forward
        scorer = self.accelerator.unwrap_model(model)
        with _reference_pass(self, scorer):
            logps = token_logprobs(scorer, ids, mask, scored, chunk_tokens=self.ref_chunk_tokens, score_masked=True)
        return logps[:, prompt_ids.size(1) - 1:]

    # -- generation and logging ---------------------------------------------------------------------
    def _generate(self, model, prompts, images=None):
        _synchronize_engines(self.accelerator.unwrap_model(model))
        with generation_through_cache(self.accelerator.unwrap_model(model), self.generation_cache):
            return super()._generate(model, prompts, images)

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:  # (the hooks TRL's checkpointing toggles leave on the embedding: see the GRPO trainer)
            _drop_stale_input_grad_hooks(self.accelerator.unwrap_model(model))

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.generation_cache is not None:
                release_generation_pages(self.accelerator.unwrap_model(self.model))

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        _log(self, logs)
        super().log(logs, *args, **kwargs)
