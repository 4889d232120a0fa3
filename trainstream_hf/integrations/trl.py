"""TRL's DPOTrainer and GRPOTrainer with trainstream: the engine callback, reference log-probs in bounded chunks.

Both subclasses target **TRL 1.16** and differ from TRL's trainers in the same two ways:

* The engine: ``trainstream_config=`` (or a ``TrainStreamDPOConfig`` / ``TrainStreamGRPOConfig``, i.e. TRL's config
  plus every ``trainstream_*`` field of :class:`~trainstream_hf.integrations.transformers.TrainStreamTrainingArguments`)
  installs the engine when the optimizer is created, before Accelerate's ``prepare`` (``EngineTrainerMixin``, as in
  ``TrainStreamTrainer``); a model that does not fit the device stays in host RAM until then, and its
  :class:`~trainstream_hf.integrations.transformers.TrainStreamCallback` puts the engine's figures into every log.
* One model in memory. The reference is the same model: for a PEFT policy, the model with its adapters switched off
  (or its ``"ref"`` adapter, which TRL 1.16 copies from a policy that came with a trained adapter). The reference
  log-probabilities are computed by :mod:`trainstream_hf.losses` (hidden states of the completion tokens only, through
  the LM head ``ref_chunk_tokens`` at a time): :func:`~trainstream_hf.losses.sequence_logprobs` for DPO,
  :func:`~trainstream_hf.losses.token_logprobs` for GRPO. ``TrainStreamGRPOTrainer`` refuses ``beta > 0`` without a
  PEFT policy: TRL 1.16 would then load a second full copy of the model as ``ref_model``.

TRL 1.16 internals overridden (the only ones; everything else is TRL's code, unchanged):

* ``DPOTrainer.compute_ref_log_probs(model, inputs)`` (``trl/trainer/dpo_trainer.py``) scores one padded
  ``[chosen; rejected]`` batch; TRL calls it only from ``_precompute_ref_logps`` (``precompute_ref_log_probs=True``).
* ``DPOTrainer.compute_loss``: without precompute, TRL computes the reference inline in ``DPOTrainer._compute_loss``
  (no hook), but ``_compute_loss`` reads ``inputs["ref_chosen_logps"]`` / ``inputs["ref_rejected_logps"]`` when
  ``self.precompute_ref_logps`` is true; so ``compute_loss`` puts our reference log-probs into the batch and sets that
  flag for the duration of the call. The policy forward (TRL's fused LM head), every ``loss_type`` and the metrics
  stay TRL's.
* ``GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size, ...)``
  (``trl/trainer/grpo_trainer.py``): ``_generate_and_score_completions`` computes the reference with it, under
  ``torch.no_grad()`` and inside ``use_adapter(model, None | "ref")``, on ``self.model`` when ``ref_model`` is None.
  Exactly that call (adapters off or ``"ref"`` active, no grad, no entropy, text-only inputs) is answered with
  ``token_logprobs``; every other call (policy, old policy, entropies) is TRL's fused LM head.
* ``training_step`` (transformers' public hook, TRL's ``GRPOTrainer.training_step`` underneath) waits for the engine's
  overlapped optimizer step before TRL generates: ``generate`` does not run the model's top-level forward hooks,
  which is where that wait otherwise happens.

Batches these paths do not cover fall back to TRL's code, unchanged: DPO's ``ld_alpha`` (per-token log-probs), vision
or other extra model inputs (anything besides ids and masks), and prompt-learning PEFT adapters.

Numerics: the reference logits of a chunk are ``lm_head(h)`` in the model's dtype, then fp32 (as the model's own
forward gives them); TRL 1.16's fused head, which scores the policy, accumulates the head's matmul in fp32. In fp32 the
two agree to ~1e-6; in bf16 set ``cast_lm_head_to_fp32=True`` (GRPO) for the two to agree as closely. The reference
runs in eval mode (no dropout) whatever ``disable_dropout`` says.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from accelerate.utils import is_peft_model
from torch import nn
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.integrations.transformers import EngineTrainerMixin, TrainStreamTrainingArguments, log_figures
from trainstream_hf.losses import sequence_logprobs, token_logprobs
from trainstream_hf.wrap import engine_of

__all__ = ["TrainStreamDPOConfig", "TrainStreamDPOTrainer", "TrainStreamGRPOConfig", "TrainStreamGRPOTrainer"]

_BATCH_KEYS = {"input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps"}


# -- configs: TRL's config + TrainStreamTrainingArguments' trainstream_* fields ------------------------------------
# TRL's config comes first so that its defaults (learning_rate, logging_steps, ...) win over TrainingArguments' ones
# (dataclass fields are collected in reverse MRO order); __post_init__ runs TRL's, then ours, then TrainingArguments'.
@dataclass
class TrainStreamDPOConfig(DPOConfig, TrainStreamTrainingArguments):
    """``trl.DPOConfig`` plus ``trainstream`` ("auto" / "on" / "off") and every ``trainstream_<option>``."""


@dataclass
class TrainStreamGRPOConfig(GRPOConfig, TrainStreamTrainingArguments):
    """``trl.GRPOConfig`` plus ``trainstream`` ("auto" / "on" / "off") and every ``trainstream_<option>``."""


# -- shared machinery -------------------------------------------------------------------------------------------
def _engines(model: nn.Module) -> Iterator:
    """The engines installed on ``model`` and on its PEFT base model (wrap may have been given either)."""
    for m in (model, getattr(model, "get_base_model", lambda: None)()):
        engine = engine_of(m) if m is not None else None
        if engine is not None:
            yield engine


def _refuse_compiled_paging(trainer, policy: nn.Module) -> None:
    """compiled_generation with paged block weights: those blocks would run outside the compiled decode step's graph
    (BlockHooks.keep_out_of_enclosing_compile), breaking it at each, for no gain over eager; eager, said once."""
    for engine in _engines(policy):
        if engine.plan is not None and engine.plan.paged_blocks:
            warnings.warn(f"compiled_generation: the plan pages {len(engine.plan.paged_blocks)} blocks' weights, which "
                          "a compiled decode step would run outside its graph, breaking it at each; generating eagerly "
                          "(a larger vram_budget keeps every block on the device)", RuntimeWarning, stacklevel=3)
            trainer.generation_config.disable_compile = True
            return


def _kept_cache_oom(device_bytes: int, err: BaseException) -> str:
    """The out-of-memory message of a training step while compiled generation keeps its static cache: what is
    outside the engine's plan and what to do, then torch's own first line."""
    return (f"TrainStreamGRPOTrainer: out of device memory in a training step while compiled generation keeps its "
            f"static TrainStreamCache ({device_bytes / 2**30:.2f} GiB on the device) and its CUDA graphs' memory "
            f"between steps, outside the engine's plan: lower trainstream's vram_budget by at least that much, lower "
            f"generation_cache (fewer resident layers), or pass compiled_generation=False. "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__})")


def _drop_stale_input_grad_hooks(model: nn.Module) -> None:
    """TRL 1.16 turns gradient checkpointing off around each generation and on again, and transformers'
    ``enable_input_require_grads`` (5.17 to 5.25) registers a new ``make_inputs_require_grads`` hook on the input
    embedding each time, forgetting the handle of the one before: the hooks pile up, two a step, and a compiled decode
    step recompiles at every step (its guards count them). Removes those no model holds a handle to."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    hooks = getattr(emb, "_forward_hooks", None)
    if not hooks:
        return
    held = set()
    for m in model.modules():  # (the list of 5.17+; the single handle kept for backward compatibility)
        held.update(h.id for h in [*(getattr(m, "_require_grads_hooks", None) or []),
                                   getattr(m, "_require_grads_hook", None)] if h is not None)
    for key, fn in list(hooks.items()):
        if getattr(fn, "__name__", "") == "make_inputs_require_grads" and key not in held:
            del hooks[key]
            for extra in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                getattr(emb, extra, {}).pop(key, None)


def _synchronize_engines(model: nn.Module) -> None:
    """Waits for the engine's overlapped CPU optimizer step. The model's top-level forward hook does that wait, and
    ``losses`` (decoder and head called directly) and ``generate`` bypass it."""
    for engine in _engines(model):
        if hasattr(engine.optimizer, "synchronize"):
            engine.optimizer.synchronize()


@contextlib.contextmanager
def _reference_pass(trainer, scorer: nn.Module) -> Iterator[None]:
    """No grad, no dropout (eval, every module's flag restored after), no gradient checkpointing, the trainer's
    autocast, and the engine's pending step done."""
    _synchronize_engines(scorer)
    modes = [(m, m.training) for m in scorer.modules()]
    scorer.eval()
    try:
        with (torch.no_grad(),
              disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs),
              trainer.accelerator.autocast()):
            yield
    finally:
        for m, training in modes:
            m.training = training


def _is_prompt_learning(model: nn.Module) -> bool:
    cfg = getattr(model, "active_peft_config", None)
    return cfg is not None and bool(getattr(cfg, "is_prompt_learning", False))


def _log(trainer, logs: dict[str, float]) -> None:
    if trainer._ts_callback is not None and trainer._ts_callback.last:
        logs.update(log_figures(trainer._ts_callback.last))


# -- DPO ----------------------------------------------------------------------------------------------------------
_DPO_INIT = inspect.signature(DPOTrainer.__init__)


class TrainStreamDPOTrainer(EngineTrainerMixin, DPOTrainer):
    """``trl.DPOTrainer`` (TRL 1.16) with the trainstream engine and chunked reference log-probabilities.

    Args:
        *args, **kwargs: as for ``DPOTrainer``.
        trainstream_config: when given (or when ``args`` is a :class:`TrainStreamDPOConfig` that turns the engine on),
            the engine is installed when the optimizer is created (``EngineTrainerMixin``) and its figures are logged as
            ``trainstream/*``.
        ref_chunk_tokens: completion tokens per LM-head chunk in the reference pass; bounds its largest
            intermediate at about ``ref_chunk_tokens * vocab * 4`` bytes.
    """

    _ts_rows = 2  # the training forward carries each pair's chosen and rejected sequences

    def __init__(self, *args, trainstream_config: TrainStreamConfig | None = None, ref_chunk_tokens: int = 1024,
                 **kwargs):
        if ref_chunk_tokens < 1:
            raise ValueError(f"ref_chunk_tokens must be >= 1, got {ref_chunk_tokens}")
        # Set before DPOTrainer.__init__: with precompute_ref_log_probs it calls compute_ref_log_probs from there.
        self.ref_chunk_tokens = int(ref_chunk_tokens)
        cfg = self._ts_setup(_DPO_INIT.bind(self, *args, **kwargs).arguments.get("args"), trainstream_config)
        super().__init__(*args, **kwargs)
        self._ts_attach(cfg)

    # -- reference log-probs ------------------------------------------------------------------------
    def _ts_covers(self, inputs: dict[str, Any]) -> bool:
        """Whether sequence_logprobs gives exactly what TRL 1.16 would compute for this batch."""
        if self.ld_alpha is not None or not set(inputs) <= _BATCH_KEYS:
            return False
        if self.ref_model is None and is_peft_model(self.model):
            if _is_prompt_learning(self.accelerator.unwrap_model(self.model)):
                return False
        return True

    def _ts_reference_logps(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ref_chosen, ref_rejected) [B] for a padded [chosen; rejected] batch, without grad."""
        if self.ref_model is not None:
            scorer = self.accelerator.unwrap_model(self.ref_model)
            adapters = contextlib.nullcontext()
        else:
            # TRL 1.16 keeps no reference model when the policy is PEFT (or with precompute): adapters off, or the
            # "ref" adapter TRL created for a policy that came with a trained adapter.
            scorer = self.accelerator.unwrap_model(self.model)
            adapters = (use_adapter(scorer, adapter_name="ref" if "ref" in scorer.peft_config else None)
                        if is_peft_model(scorer) else contextlib.nullcontext())
        with _reference_pass(self, scorer), adapters:
            logps = sequence_logprobs(scorer, inputs["input_ids"], inputs["attention_mask"],
                                      inputs["completion_mask"], chunk_tokens=self.ref_chunk_tokens)
        return logps.chunk(2, dim=0)

    def compute_ref_log_probs(self, model, inputs):
        """TRL 1.16 hook used by ``precompute_ref_log_probs=True``; ``model`` is ``self.ref_model or self.model``."""
        if not self._ts_covers(inputs):
            return super().compute_ref_log_probs(model, inputs)
        return self._ts_reference_logps(inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.precompute_ref_logps or not self._ts_covers(inputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        ref_chosen, ref_rejected = self._ts_reference_logps(inputs)
        inputs = {**inputs, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
        # TRL 1.16's _compute_loss takes the reference from the batch when this flag is set.
        self.precompute_ref_logps = True
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.precompute_ref_logps = False

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        _log(self, logs)
        super().log(logs, *args, **kwargs)


# -- GRPO ---------------------------------------------------------------------------------------------------------
_GRPO_INIT = inspect.signature(GRPOTrainer.__init__)


class TrainStreamGRPOTrainer(EngineTrainerMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` (TRL 1.16) with the trainstream engine and a reference that is the same model.

    With ``beta > 0`` the KL term's reference per-token log-probabilities come from the policy with its LoRA adapters
    switched off (TRL's ``use_adapter``), scored by :func:`~trainstream_hf.losses.token_logprobs`; ``ref_model`` stays
    None. Without a PEFT policy (a ``PeftModel``, or a model and ``peft_config=``) ``beta > 0`` is refused.

    Args:
        *args, **kwargs: as for ``GRPOTrainer``.
        trainstream_config: when given (or when ``args`` is a :class:`TrainStreamGRPOConfig` that turns the engine
            on), the engine is installed when the optimizer is created (``EngineTrainerMixin``) and its figures
            are logged as ``trainstream/*``.
        ref_chunk_tokens: completion tokens per LM-head chunk in the reference pass; bounds its largest
            intermediate at about ``ref_chunk_tokens * vocab * 4`` bytes.
        generation_cache: a fraction in [0, 1]: TRL's ``generate`` decodes with a
            :class:`~trainstream_hf.cache.TrainStreamCache` holding that fraction of the layers' K/V on the device
            (the rest in pinned host pages); None (default): TRL's own cache.
        compiled_generation: sample with a static cache and the decode step compiled by transformers (torch.compile's
            "reduce-overhead" mode: CUDA graphs on a GPU), where TRL turns that compilation off: the decode step of a
            LoRA model over a packed base is a few hundred small kernels per token, bound by their launches. The
            engine's block hooks stand aside in that traced no-grad forward (nothing to page or save); with paged block
            weights it is turned off with a warning at the first step. The first steps pay the compilation. With
            ``generation_cache`` the static cache is a ``TrainStreamCache(static=True)``: the resident layers' updates
            are in the compiled graph, each offloaded layer's copies run between graphs. That cache is kept between
            steps (its device bytes beside training's, as transformers keeps its static cache) and released when
            ``train()`` returns. Those bytes and the CUDA graphs' memory are outside the engine's plan: a training
            step that then runs out of memory raises torch's ``OutOfMemoryError`` with the cache's size and what to
            lower first.

    Raises:
        ValueError: ``beta > 0`` and the policy is not a PEFT model; ``ref_chunk_tokens < 1``; a ``generation_cache``
            outside [0, 1].
    """

    def __init__(self, *args, trainstream_config: TrainStreamConfig | None = None, ref_chunk_tokens: int = 1024,
                 generation_cache: float | None = None, compiled_generation: bool = False, **kwargs):
        from trainstream_hf.integrations.trl_online import check_generation_cache

        if ref_chunk_tokens < 1:
            raise ValueError(f"ref_chunk_tokens must be >= 1, got {ref_chunk_tokens}")
        self.generation_cache = check_generation_cache(generation_cache)
        self.compiled_generation = bool(compiled_generation)
        self._ts_kept_cache: dict = {}  # compiled generation through TrainStreamCache: the static cache, reused
        bound = _GRPO_INIT.bind(self, *args, **kwargs).arguments
        grpo_args, model = bound.get("args"), bound["model"]
        beta = grpo_args.beta if grpo_args is not None else GRPOConfig.__dataclass_fields__["beta"].default
        # (a model given by path, a str, is loaded by TRL without adapters)
        if beta != 0.0 and bound.get("peft_config") is None and not (isinstance(model, nn.Module)
                                                                       and is_peft_model(model)):
            raise ValueError(
                f"TrainStreamGRPOTrainer: beta={beta} needs a reference policy, and for a model without adapters TRL "
                f"1.16 would load a second full copy of it as ref_model; trainstream keeps one model in memory. Train "
                f"LoRA adapters (pass peft_config=LoraConfig(...), or a peft.PeftModel) so that the reference is the "
                f"same model with its adapters switched off, or set beta=0.0 (no KL term, TRL's default).")
        self.ref_chunk_tokens = int(ref_chunk_tokens)
        cfg = self._ts_setup(grpo_args, trainstream_config)
        super().__init__(*args, **kwargs)
        if self.ref_model is not None:  # TRL changed how it builds the reference: never keep a second model
            raise RuntimeError("TrainStreamGRPOTrainer: TRL created a ref_model; this class targets TRL 1.16, which "
                               "keeps none for a PEFT policy")
        if self.compiled_generation:
            if getattr(self, "generation_config", None) is None:  # (vLLM generation: TRL builds no config)
                raise ValueError("compiled_generation=True compiles transformers' generate(); with use_vllm TRL does "
                                 "not call it")
            # TRL 1.16 builds its GenerationConfig with disable_compile=True; generation_kwargs overrides the model's
            self.generation_config.disable_compile = False
            if self.generation_cache is None:  # transformers' StaticCache (else a static TrainStreamCache is passed)
                self.generation_config.cache_implementation = "static"
                self.generation_kwargs["cache_implementation"] = "static"
        self._ts_attach(cfg)

    def _ts_is_reference_call(self, model, compute_entropy: bool, compute_aux_loss: bool, extra: dict) -> bool:
        """Whether TRL 1.16 is asking for the reference's log-probs (see the module docstring), text-only."""
        if self.beta == 0.0 or self.ref_model is not None or model is not self.model:
            return False
        if compute_entropy or compute_aux_loss or torch.is_grad_enabled() or any(v is not None for v in extra.values()):
            return False
        scorer = self.accelerator.unwrap_model(model)
        if not is_peft_model(scorer) or _is_prompt_learning(scorer):
            return False
        # TRL's use_adapter(model, None) disables the adapters; use_adapter(model, "ref") activates the "ref" copy.
        return not scorer.has_active_enabled_adapter or scorer.active_adapter == "ref"

    def _ts_reference_token_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                                  batch_size: int | None) -> torch.Tensor:
        """[B, logits_to_keep] reference log-probs of the last ``logits_to_keep`` tokens, 0 at padding (as TRL)."""
        scorer = self.accelerator.unwrap_model(self.model)
        batch_size = batch_size or input_ids.size(0)
        scored = torch.zeros_like(attention_mask)
        scored[:, -logits_to_keep:] = 1
        pieces = []
        with _reference_pass(self, scorer):  # TRL's use_adapter around this call already chose the adapters
            for start in range(0, input_ids.size(0), batch_size):
                rows = slice(start, start + batch_size)
                logps = token_logprobs(scorer, input_ids[rows], attention_mask[rows], scored[rows],
                                       chunk_tokens=self.ref_chunk_tokens, temperature=self.temperature)
                pieces.append(logps[:, -logits_to_keep:])
        return torch.cat(pieces, dim=0)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        """TRL 1.16 internal; the reference call is answered here, every other one by TRL (module docstring)."""
        if not self._ts_is_reference_call(model, compute_entropy, compute_aux_loss, extra):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)
        return self._ts_reference_token_logps(input_ids, attention_mask, logits_to_keep, batch_size), None, None

    def training_step(self, model, inputs, num_items_in_batch):
        from trainstream_hf.integrations.trl_online import generation_through_cache

        policy = self.accelerator.unwrap_model(model)
        _synchronize_engines(policy)  # before TRL generates (module docstring)
        if self.compiled_generation and not self.generation_config.disable_compile:
            _refuse_compiled_paging(self, policy)
        keep = self._ts_kept_cache if self.compiled_generation else None
        try:
            with generation_through_cache(policy, self.generation_cache, keep):  # TRL generates inside the step
                return super().training_step(model, inputs, num_items_in_batch)
        except torch.OutOfMemoryError as err:
            kept = keep.get("cache") if keep else None
            if kept is None:
                raise
            raise torch.OutOfMemoryError(_kept_cache_oom(kept.memory()["device"], err)) from err
        finally:
            _drop_stale_input_grad_hooks(policy)

    def train(self, *args, **kwargs):
        from trainstream_hf.integrations.trl_online import close_kept, release_generation_pages

        try:
            return super().train(*args, **kwargs)
        finally:
            close_kept(self._ts_kept_cache)
            if self.generation_cache is not None:
                release_generation_pages(self.accelerator.unwrap_model(self.model))

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        _log(self, logs)
        super().log(logs, *args, **kwargs)
