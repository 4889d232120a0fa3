"""TRL's DPOTrainer with trainstream: the engine callback, and reference log-probs in bounded chunks.

``TrainStreamDPOTrainer`` is TRL's ``DPOTrainer`` (targets **TRL 1.16**, ``trl/trainer/dpo_trainer.py``) with two
changes:

* ``trainstream_config=`` adds a :class:`~trainstream_hf.integrations.transformers.TrainStreamCallback`, which
  installs the engine when training begins and takes it out at the end (as ``TrainStreamTrainer`` does), and the
  engine's figures go into every log.
* The reference log-probabilities are computed with :func:`trainstream_hf.losses.sequence_logprobs` (hidden
  states of the completion tokens only, through the LM head ``ref_chunk_tokens`` at a time), with the same
  reference TRL 1.16 would use: for a PEFT policy and no ``ref_model``, the same model with its adapters switched
  off (or its ``"ref"`` adapter when one exists), so a single model is in memory; else ``ref_model``.

What TRL 1.16 does and what is overridden here:

* ``DPOTrainer.compute_ref_log_probs(model, inputs)`` scores one padded ``[chosen; rejected]`` batch; TRL calls it
  only from ``_precompute_ref_logps`` (``precompute_ref_log_probs=True``). Overridden.
* Without precompute, TRL computes the reference inline in ``DPOTrainer._compute_loss`` (no hook). But
  ``_compute_loss`` reads ``inputs["ref_chosen_logps"]`` / ``inputs["ref_rejected_logps"]`` when
  ``self.precompute_ref_logps`` is true, so ``compute_loss`` is overridden to put our reference log-probs into the
  batch and set that flag for the duration of the call: the rest of TRL's loss (policy forward with its fused LM
  head, every ``loss_type``, metrics) is TRL's own code, unchanged.

Batches this path does not cover fall back to TRL's code, unchanged: ``ld_alpha`` (needs per-token log-probs),
vision / extra model inputs (anything besides ``input_ids``, ``attention_mask``, ``completion_mask``), and
prompt-learning PEFT adapters.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from accelerate.utils import is_peft_model
from trl import DPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.integrations.transformers import TrainStreamCallback, log_figures
from trainstream_hf.losses import sequence_logprobs
from trainstream_hf.wrap import engine_of

__all__ = ["TrainStreamDPOTrainer"]

_BATCH_KEYS = {"input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps"}


class TrainStreamDPOTrainer(DPOTrainer):
    """``trl.DPOTrainer`` (TRL 1.16) with the trainstream engine and chunked reference log-probabilities.

    Args:
        *args, **kwargs: as for ``DPOTrainer``.
        trainstream_config: when given, the engine is installed at train begin (``TrainStreamCallback``) and its
            figures are logged as ``trainstream/*``.
        ref_chunk_tokens: completion tokens per LM-head chunk in the reference pass; bounds its largest
            intermediate at about ``ref_chunk_tokens * vocab * 4`` bytes.
    """

    def __init__(self, *args, trainstream_config: TrainStreamConfig | None = None, ref_chunk_tokens: int = 1024,
                 **kwargs):
        if ref_chunk_tokens < 1:
            raise ValueError(f"ref_chunk_tokens must be >= 1, got {ref_chunk_tokens}")
        # Set before DPOTrainer.__init__: with precompute_ref_log_probs it calls compute_ref_log_probs from there.
        self.ref_chunk_tokens = int(ref_chunk_tokens)
        self._ts_callback = None
        super().__init__(*args, **kwargs)
        if trainstream_config is not None:
            self._ts_callback = TrainStreamCallback(trainstream_config)
            self.add_callback(self._ts_callback)

    # -- reference log-probs ------------------------------------------------------------------------
    def _ts_covers(self, inputs: dict[str, Any]) -> bool:
        """Whether sequence_logprobs gives exactly what TRL 1.16 would compute for this batch."""
        if self.ld_alpha is not None or not set(inputs) <= _BATCH_KEYS:
            return False
        if self.ref_model is None and is_peft_model(self.model):
            cfg = getattr(self.accelerator.unwrap_model(self.model), "active_peft_config", None)
            if cfg is not None and getattr(cfg, "is_prompt_learning", False):
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
        # The engine's overlapped CPU optimizer step is awaited by the model's top-level forward hook, which
        # sequence_logprobs bypasses (it calls the decoder and the head directly): wait for the step here.
        for m in (scorer, getattr(scorer, "get_base_model", lambda: None)()):
            engine = engine_of(m) if m is not None else None
            if engine is not None and hasattr(engine.optimizer, "synchronize"):
                engine.optimizer.synchronize()
        modes = [(m, m.training) for m in scorer.modules()]
        scorer.eval()  # a reference sees no dropout
        try:
            with (torch.no_grad(),
                  disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
                  adapters, self.accelerator.autocast()):
                logps = sequence_logprobs(scorer, inputs["input_ids"], inputs["attention_mask"],
                                          inputs["completion_mask"], chunk_tokens=self.ref_chunk_tokens)
        finally:
            for m, training in modes:
                m.training = training
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

    # -- logging --------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._ts_callback is not None and self._ts_callback.last:
            logs.update(log_figures(self._ts_callback.last))
        super().log(logs, *args, **kwargs)
