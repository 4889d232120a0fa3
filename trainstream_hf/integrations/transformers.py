"""transformers' Trainer: a TrainingArguments flag, a TrainerCallback that installs the engine, a Trainer.

Four ways in, all building one :class:`TrainStreamConfig` and calling the same :func:`wrap`:

* ``TrainStreamTrainingArguments(..., trainstream="auto", trainstream_vram_budget="24GiB")`` with
  ``TrainStreamTrainer`` (or the callback by hand); every option is a ``--trainstream_*`` command-line flag
  through ``HfArgumentParser``;
* ``Trainer(..., callbacks=[TrainStreamCallback(vram_budget="24GiB")])`` with any TrainingArguments;
* ``TrainStreamTrainer``, which adds the callback when the arguments ask for it and puts the engine's
  figures (H2D / D2H GB/s, overlap, peak VRAM, arena use) into every log, so they reach TensorBoard / W&B
  like the loss does;
* nothing in the script at all: ``TRAINSTREAM=on`` (+ ``TRAINSTREAM_<OPTION>`` variables) with
  ``python -m trainstream_hf.auto train.py`` or ``accelerate launch ... -m trainstream_hf.auto train.py`` puts a
  :class:`TrainStreamEnvCallback` into every Trainer (:mod:`trainstream_hf.auto` says how).

The callback installs the engine when training begins, after the Trainer (through Accelerate) has built and
prepared its optimizer: the prepared optimizer's inner torch optimizer is replaced by the engine's
(``AcceleratedOptimizer.optimizer``), and the LR scheduler keeps working because the two share their
param-group dicts. With ``quantize`` set, the frozen linear layers of the model (a PEFT model's base) are packed in
place first (:func:`quantize_frozen_base`). Targets transformers 5.17-5.24 and accelerate 1.15-1.16.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from trainstream_hf.config import (TrainStreamConfig, config_from_text, default_batch_shape, env_config,
                                   runner_accumulation)
from trainstream_hf.integrations.accelerate import distributed_kind
from trainstream_hf.quant.linear import QuantLinear
from trainstream_hf.integrations.huggingface import TrainStreamQuantizationConfig, mark_quantized
from trainstream_hf.quant.model import quantize_frozen_base  # re-exported: its home before wrap(quantize=) used it
from trainstream_hf.quant.model import is_plain_linear
from trainstream_hf.wrap import engine_of, unwrap, wrap

__all__ = ["TrainStreamCallback", "TrainStreamEnvCallback", "TrainStreamTrainingArguments", "TrainStreamTrainer",
           "log_figures", "quantize_frozen_base"]

logger = logging.getLogger("trainstream_hf")

_PREFIX = "trainstream_"


def log_figures(stats: dict) -> dict[str, float]:
    """The engine's last-step figures as flat ``trainstream/<name>`` scalars for a Trainer log."""
    out: dict[str, float] = {}
    for key in ("h2d_GBps", "d2h_GBps", "overlap", "step_seconds", "peak_allocated_bytes",
                "peak_reserved_bytes", "arena_used_bytes", "predicted_peak_bytes"):
        v = stats.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            name = key.replace("_bytes", "_GiB")
            out[f"trainstream/{name}"] = v / 2**30 if key.endswith("_bytes") else float(v)
    opt = stats.get("optimizer") or {}
    if isinstance(opt.get("adam_seconds"), float):
        out["trainstream/cpu_adamw_seconds"] = opt["adam_seconds"]
    gc_pauses = stats.get("python_gc") or {}  # Python's cyclic GC stops the thread that launches the GPU work
    if isinstance(gc_pauses.get("seconds"), float):
        out["trainstream/python_gc_seconds"] = gc_pauses["seconds"]
        out["trainstream/python_gc_collections"] = float(sum(gc_pauses.get("collections") or ()))
    return out


def _go_first(callback: TrainerCallback) -> None:
    """Puts ``callback`` first in the Trainer's callback list, so that the reporting callbacks (TensorBoard, W&B, ...:
    the Trainer adds them before the user's) see the figures it adds to each log. TrainerCallback events carry no
    handle to the Trainer; the CallbackHandler calling this event is found on the stack. The list is replaced, not
    reordered in place, so the event under way goes on over the old one unchanged."""
    import sys

    from transformers.trainer_callback import CallbackHandler

    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler):
            if handler.callbacks and handler.callbacks[0] is not callback and callback in handler.callbacks:
                handler.callbacks = [callback] + [c for c in handler.callbacks if c is not callback]
            return


def _is_step_log(logs: dict) -> bool:
    """Whether a Trainer log is a training step's (it has the step's ``loss``), the one the engine's last-step
    figures belong to: not an evaluation's, and not the summary that ``train()`` also returns as its metrics."""
    return "loss" in logs and "train_runtime" not in logs


def refuse_quantized_without_adapters(model: nn.Module, who: str) -> None:
    """A model whose linear layers are packed (:class:`~trainstream_hf.quant.QuantLinear`: frozen, no weight
    gradient) but that carries no PEFT adapters would train only its embeddings and norms: almost certainly not what
    was meant, so the trainers refuse it with the fix.

    Raises:
        ValueError: ``model`` has QuantLinear layers and no ``peft_config`` (neither a ``PeftModel`` nor a model with
            adapters loaded through transformers' ``load_adapter``).
    """
    if getattr(model, "peft_config", None):
        return
    packed = next((n for n, m in model.named_modules() if isinstance(m, QuantLinear)), None)
    if packed is not None:
        raise ValueError(f"{who}: the model's linear layers are packed (QuantLinear, e.g. {packed}): a frozen base that "
                         "cannot train, and the model has no PEFT adapters, so only its embeddings and norms would. "
                         "Add LoRA first: peft.get_peft_model(model, peft.LoraConfig(r=16, "
                         "target_modules='all-linear'))")


def refuse_sharded_training(args, who: str) -> None:
    """A Trainer run with FSDP or DeepSpeed (``TrainingArguments`` ``fsdp`` / ``deepspeed``, or an ``accelerate
    launch`` config that sets them): each decides where the weights and optimizer state live, as the engine does.
    Raises ValueError saying to use one."""
    kind = distributed_kind(getattr(getattr(args, "distributed_state", None), "distributed_type", None))
    used = ("FSDP" if getattr(args, "fsdp", None) or kind == "FSDP" else
            "DeepSpeed" if getattr(args, "deepspeed", None) or kind == "DEEPSPEED" else
            "Megatron-LM" if kind == "MEGATRON_LM" else None)
    if used is not None:
        raise ValueError(f"{who}: the Trainer runs with {used}, which decides where the weights and optimizer state "
                         f"live, as trainstream_hf does; use one: drop {used} (several GPUs: trainstream_hf trains "
                         "under DistributedDataParallel, plain `accelerate launch --multi_gpu`), or set "
                         "trainstream='off'")


def training_autocast(args, device=None):
    """The autocast the Trainer's forward runs in for ``args`` (``bf16`` / ``fp16``; Accelerate's mixed precision),
    on ``device`` (default ``args.device``); a context that does nothing without mixed precision."""
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device if device is not None else args.device).type, dtype=dtype)


class TrainStreamCallback(TrainerCallback):
    """Installs trainstream into a Trainer's model and optimizer when training begins.

    Args:
        config: a :class:`TrainStreamConfig`; ``options`` override its fields (or build one).
        unwrap_at_end: take the engine out when training ends, every weight back on the device. False leaves it
            installed, for a model that never fits on the device whole (paged weights): the caller unwraps it
            when, and if, it needs the plain model.
        **options: :class:`TrainStreamConfig` fields, e.g. ``vram_budget="24GiB"``.

    The Trainer clips as it always does (``max_grad_norm``, through Accelerate's ``clip_grad_norm_`` over
    ``model.parameters()``) and logs the true ``grad_norm`` whatever ``grads`` says: a gradient held in host RAM
    (``grads="host"``, or a paged trainable weight, whose gradient always goes there) is what that parameter's
    ``p.grad`` shows (``engine/grads.py``). fp16 mixed precision (a GradScaler) is refused: use bf16.
    """

    def __init__(self, config: TrainStreamConfig | None = None, *, unwrap_at_end: bool = True, **options):
        base = config.to_dict() if config is not None else {}
        base.update(options)
        self.config = TrainStreamConfig(**base)
        self.unwrap_at_end = unwrap_at_end
        self.model = None
        self.last: dict = {}
        self.quantized: list[str] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        _go_first(self)
        if model is None or engine_of(model) is not None:
            if model is not None and self.model is None:
                self.model = model  # installed earlier (EngineTrainerMixin.create_optimizer): just report
            return
        inner = getattr(optimizer, "optimizer", optimizer)
        if getattr(optimizer, "scaler", None) is not None:
            raise ValueError("TrainStreamCallback: fp16 with a GradScaler is not supported; train in bf16")
        if inner is None:
            raise ValueError("TrainStreamCallback: the Trainer has no optimizer at train begin")
        new_opt = self.install(args, model, inner)
        if new_opt is not inner:
            if inner is optimizer:
                unwrap(model)
                raise ValueError("TrainStreamCallback: the Trainer's optimizer is not an Accelerate-prepared "
                                 "optimizer, so it cannot be replaced from a callback; use TrainStreamTrainer")
            optimizer.optimizer = new_opt

    def install(self, args, model: nn.Module, optimizer: torch.optim.Optimizer, rows: int = 1) -> torch.optim.Optimizer:
        """Wraps ``model`` and ``optimizer`` for the Trainer's ``args``; returns the optimizer to use. A model not on
        ``args.device`` yet (the engine trainers skip the Trainer's own move) is placed there by the engine, paged
        blocks staying in host RAM. ``rows``: sequences each example puts in the forward (2 for DPO's chosen and
        rejected), for the plan's batch when ``batch_shape`` is not set (:func:`trainer_batch_shape`).

        ``optimizer`` is a plain torch optimizer, or (a second ``train()`` after the engine was taken out at the end
        of the first) the Accelerate-prepared optimizer the last engine returned: :func:`wrap` then takes over the
        user's optimizer and that engine's state, so the moments and step counts go on as a plain optimizer's
        would."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # (Accelerate's wrapper of a second train())
        refuse_quantized_without_adapters(model, "TrainStreamCallback")
        refuse_sharded_training(args, "TrainStreamCallback")
        if self.config.optimizer_in_backward and args.max_grad_norm:
            raise ValueError(f"optimizer_in_backward=True updates each weight during backward, before the Trainer "
                             f"clips (max_grad_norm={args.max_grad_norm}): set max_grad_norm=0, or turn "
                             "optimizer_in_backward off to clip")
        shape = self.config.batch_shape or trainer_batch_shape(args, model, rows)
        accumulation = runner_accumulation(self.config.gradient_accumulation_steps,
                                     getattr(args, "gradient_accumulation_steps", 1), "the Trainer's")
        # bf16 / fp16: Accelerate's mixed precision returns the forward's float outputs in float32 (the logits' copy)
        mixed = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
        cfg = TrainStreamConfig(**{**self.config.to_dict(), "batch_shape": tuple(int(x) for x in shape),
                                   "gradient_accumulation_steps": accumulation,
                                   "fp32_outputs": self.config.fp32_outputs or mixed})
        if cfg.device is None and torch.device(args.device).type != "cpu" and any(
                p.device != torch.device(args.device) for p in model.parameters()):
            cfg = replace(cfg, device=str(args.device))
        dense = {n for n, m in model.named_modules() if is_plain_linear(m)} if cfg.quantize is not None else set()
        # with quantize set, wrap packs the frozen base (all or nothing); it measures a block under the autocast the
        # Trainer's forward runs in: the activations as trained, and compiled blocks compile once, not twice
        with training_autocast(args, cfg.device):
            _, new_opt = wrap(model, optimizer, cfg)
        if cfg.quantize is not None:
            self.quantized = [n for n, m in model.named_modules() if isinstance(m, QuantLinear) and n in dense]
            # ... and marks it as a loaded one would be, so that after train() the user's model can be dequantized,
            # merged and saved with transformers' and PEFT's own calls.
            mark_quantized(model, TrainStreamQuantizationConfig(cfg.quantize, outliers=cfg.outliers))
        self.model = model
        return new_opt

    def on_step_end(self, args, state, control, **kwargs):
        if self.model is not None and engine_of(self.model) is not None:
            self.last = self.model.trainstream_stats()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Callbacks after this one see the figures; TrainStreamTrainer.log adds them before any does. Trainer.log
        # (transformers 5.24) appends a copy of ``logs`` to state.log_history just before this event: the figures
        # go into that record too.
        if logs is not None and self.last and _is_step_log(logs):
            figures = log_figures(self.last)
            for k, v in figures.items():
                logs.setdefault(k, v)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                for k, v in figures.items():
                    state.log_history[-1].setdefault(k, v)

    def on_train_end(self, args, state, control, **kwargs):
        # The model goes back to an ordinary one holding the trained weights (for save / push / eval).
        if self.unwrap_at_end and self.model is not None and engine_of(self.model) is not None:
            unwrap(self.model)
        self.model = None


class TrainStreamEnvCallback(TrainStreamCallback):
    """The callback ``TRAINSTREAM=on|auto`` puts into every Trainer (:mod:`trainstream_hf.auto`): the engine's options
    from ``TRAINSTREAM_<OPTION>`` variables, checked when the Trainer is built.

    It installs the engine at the first step rather than at train begin, so that a ``TrainStreamCallback`` the
    script gave the Trainer itself (which comes later in the callback list and installs at train begin) wins: this
    one then finds the engine installed and stays out of the way. ``TRAINSTREAM=auto`` installs on a GPU only.

    Args:
        environ: the variables (default ``os.environ``).

    Raises:
        ValueError: a bad ``TRAINSTREAM`` / ``TRAINSTREAM_*`` variable (the message names it and the allowed values).
    """

    trainstream_env = True  # the marker trainstream_hf.auto looks for in DEFAULT_CALLBACKS

    def __init__(self, environ=None):
        self.mode, config = env_config(environ)
        super().__init__(config)
        self.quantized: list[str] = []
        self._tried = False

    def active(self) -> bool:
        return self.mode == "on" or (self.mode == "auto" and torch.cuda.is_available())

    def on_train_begin(self, args, state, control, **kwargs):
        self._tried = False  # each train() call decides again at its first step

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._tried or not self.active() or getattr(args, "trainstream", None) == "off":
            return  # (an explicit TrainStreamTrainingArguments(trainstream="off") beats the environment)
        self._tried = True
        if model is None or engine_of(model) is not None:
            return  # the script's own TrainStreamCallback / TrainStreamTrainer installed the engine
        super().on_train_begin(args, state, control, model=model, optimizer=optimizer, **kwargs)
        if self.model is not None:
            plan = self.model.trainstream_plan
            logger.warning("trainstream_hf: TRAINSTREAM=%s installed the engine in %s (%s): %s%s", self.mode,
                           type(self.model).__name__, _options_text(self.config),
                           str(plan).splitlines()[0] if str(plan) else "",
                           f"; {len(self.quantized)} frozen linear layers packed as {self.config.quantize}"
                           if self.quantized else "")


def _options_text(config: TrainStreamConfig) -> str:
    default = TrainStreamConfig().to_dict()
    changed = {k: v for k, v in config.to_dict().items() if v != default.get(k)}
    return ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "default options"


def _with_engine_options(cls):
    """Adds ``trainstream_<option>`` for every :class:`TrainStreamConfig` field (default None: the engine's
    default), then makes ``cls`` a dataclass: the Trainer arguments mirror the options by construction."""
    for f in fields(TrainStreamConfig):
        name = f"trainstream_{f.name}"
        cls.__annotations__[name] = "str | None"
        setattr(cls, name, field(default=None, metadata={
            "help": f"{f.metadata.get('help', '')} (default: the engine's, {f.default!r})"}))
    return dataclass(cls)


@_with_engine_options
class TrainStreamTrainingArguments(TrainingArguments):
    """TrainingArguments plus ``trainstream`` ("auto" / "on" / "off") and every engine option as
    ``trainstream_<option>`` (each :class:`TrainStreamConfig` field). Values may be given as text, as on the command
    line (``--trainstream_vram_budget 24GiB --trainstream_offload_optimizer true --trainstream_batch_shape 1,2048``:
    read by :func:`trainstream_hf.config.parse_value`, the parser of the environment route too) or as values; None
    keeps the engine's default."""

    trainstream: str = field(default="auto", metadata={
        "help": "Install the trainstream engine: 'on', 'off', or 'auto' (on when a GPU is present)."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.trainstream, str):  # as TRAINSTREAM=ON is read
            self.trainstream = self.trainstream.strip().lower()
        if self.trainstream not in ("auto", "on", "off"):
            raise ValueError(f"trainstream: 'auto', 'on' or 'off', got {self.trainstream!r}")
        self.trainstream_config()  # validate now, not when training starts

    def trainstream_enabled(self) -> bool:
        return self.trainstream == "on" or (self.trainstream == "auto" and torch.cuda.is_available())

    def trainstream_config(self) -> TrainStreamConfig:
        """The :class:`TrainStreamConfig` these arguments describe."""
        given = {f.name: getattr(self, f"trainstream_{f.name}") for f in fields(TrainStreamConfig)}
        given = {k: v for k, v in given.items() if v is not None}
        return config_from_text(given, {k: f"trainstream_{k}" for k in given})


def _does_not_fit(model: nn.Module, device) -> bool:
    """A model whose parameters outgrow the device's free memory (moving it whole would fail): only the engine can
    place it. Smaller models move as the Trainer always moves them (evaluation before training keeps working)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    need = sum(p.numel() * p.element_size() for p in model.parameters() if p.device != device)
    return need > 0.9 * free


def engine_config(args, trainstream_config: TrainStreamConfig | None) -> TrainStreamConfig | None:
    """The engine configuration a trainer gets: an explicit one, or what ``TrainStreamTrainingArguments`` turn on."""
    if trainstream_config is None and isinstance(args, TrainStreamTrainingArguments) and args.trainstream_enabled():
        trainstream_config = args.trainstream_config()
    return trainstream_config


STAGING_PREFIX = ".trainstream-tmp-"  # <run_dir>/.trainstream-tmp-<step>/checkpoint-<step>: a checkpoint being written


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a filesystem without fsync on directories (some network ones): the rename still orders what it can
    finally:
        os.close(fd)


def publish_checkpoint(staged: str, final: str) -> None:
    """Moves the fully written checkpoint folder ``staged`` to ``final`` (both in one run directory) by renames, once
    its files are on disk: a reader (``resume_from_checkpoint=True``) sees either no ``final`` or a complete one, also
    after a kill or a crash at any point. A folder already at ``final`` (a run resumed from an earlier step saves that
    step again) is set aside first and removed last. The staging folder around ``staged`` is removed."""
    for folder, _, files in os.walk(staged):
        for name in files:
            _fsync(os.path.join(folder, name))
        _fsync(folder)
    staging = os.path.dirname(staged)
    if os.path.lexists(final):
        os.rename(final, os.path.join(staging, "replaced"))
    os.rename(staged, final)
    _fsync(os.path.dirname(final))
    shutil.rmtree(staging, ignore_errors=True)


def rotate_checkpoints(run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """transformers' ``rotate_checkpoints`` (5.25: the oldest go until ``save_total_limit`` are left, never the newest
    nor the best), each folder first renamed into a staging folder and removed there: a kill while it is being
    deleted leaves no partial ``checkpoint-*`` behind."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    checkpoints = sort_checkpoints(run_dir, use_mtime=True)
    protected = {checkpoints[-1]} if checkpoints else set()
    if best_model_checkpoint is not None:
        protected.add(str(Path(best_model_checkpoint)))
    remaining = len(checkpoints)
    for folder in checkpoints:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if folder not in protected:
            doomed = os.path.join(run_dir, f"{STAGING_PREFIX}removed-{os.path.basename(folder)}")
            shutil.rmtree(doomed, ignore_errors=True)
            os.rename(folder, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            remaining -= 1


def remove_staging(run_dir: str) -> list[str]:
    """Removes the staging folders a killed run left in ``run_dir`` (a checkpoint it never finished writing, or one it
    was deleting). Returns those removed."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    stale = [os.path.join(run_dir, n) for n in names if n.startswith(STAGING_PREFIX)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def trainer_batch_shape(args, model: nn.Module, rows: int = 1) -> tuple[int, int]:
    """The (batch, sequence) a Trainer's plan is made for when ``batch_shape`` is not given: ``rows`` times the
    per-device batch, at the longer of 2048 tokens and TRL's ``max_length`` (:func:`default_batch_shape`)."""
    return default_batch_shape(model, rows * int(args.per_device_train_batch_size), getattr(args, "max_length", None))


class EngineTrainerMixin:
    """For Trainer subclasses with the engine: it is installed when the optimizer is created, before Accelerate's
    ``prepare`` (which moves the whole model to the device), and the Trainer's own move in ``__init__`` is skipped,
    so a model larger than the GPU can stay in host RAM until the engine places it (paged blocks stay there).
    Subclasses call :meth:`_ts_setup` before ``Trainer.__init__`` and :meth:`_ts_attach` after it.

    Checkpoints are written whole or not at all: each into ``<run_dir>/.trainstream-tmp-<step>/checkpoint-<step>``,
    then renamed to ``<run_dir>/checkpoint-<step>`` (:func:`publish_checkpoint`), and those ``save_total_limit``
    retires are renamed away before they are deleted (:func:`rotate_checkpoints`), so a run killed while saving
    resumes (``resume_from_checkpoint=True``) from the last complete one; ``train()`` removes what such a run left.
    A ``train()`` that raises takes out the engine it installed before the error propagates."""

    _ts_callback: TrainStreamCallback | None = None
    _ts_places_model: bool = False
    _ts_engine = None  # the engine create_optimizer installed
    _ts_given_optimizers: tuple = (None, None)  # the Trainer's optimizer and scheduler as given to __init__
    _ts_saving: int | None = None  # the step whose checkpoint is being written (into its staging folder)
    _ts_push: str | None = None  # a checkpoint push deferred until the checkpoint is in place
    _ts_rows: int = 1  # sequences per example in the training forward (DPO: chosen and rejected), for the plan

    def _ts_setup(self, args, trainstream_config: TrainStreamConfig | None) -> TrainStreamConfig | None:
        cfg = engine_config(args, trainstream_config)
        self._ts_places_model = cfg is not None
        return cfg

    def _ts_attach(self, cfg: TrainStreamConfig | None, unwrap_at_end: bool = True) -> None:
        refuse_quantized_without_adapters(self.model, type(self).__name__)
        self._ts_given_optimizers = (self.optimizer, self.lr_scheduler)
        self._ts_callback = TrainStreamCallback(cfg, unwrap_at_end=unwrap_at_end) if cfg is not None else None
        if self._ts_callback is not None:
            self.add_callback(self._ts_callback)

    def _move_model_to_device(self, model, device):
        if self._ts_places_model and _does_not_fit(model, device):
            return  # the engine places it when the optimizer is created (create_optimizer below)
        super()._move_model_to_device(model, device)

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        if self._ts_callback is not None and engine_of(self.model) is None:
            self.optimizer = optimizer = self._ts_callback.install(self.args, self.model, optimizer, rows=self._ts_rows)
            self._ts_engine = engine_of(self.model)
            if self._ts_engine is not None and self.args.should_log:
                plan = str(self._ts_engine.plan)
                logger.warning("trainstream_hf: %s installed the engine in %s: %s", type(self).__name__,
                               type(self.model).__name__, plan.splitlines()[0])
                logger.info("trainstream_hf: the plan in full:\n%s", plan)
        return optimizer

    # -- a failed train() ---------------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        if self.args.local_process_index == 0:  # one process per node: its disk may be its own
            run_dir = self._get_output_dir(kwargs.get("trial", args[1] if len(args) > 1 else None))
            for path in remove_staging(run_dir) + (remove_staging(self.args.output_dir)
                                                    if run_dir != self.args.output_dir else []):
                logger.warning("trainstream_hf: removed %s, left by a run stopped while it wrote or deleted a "
                               "checkpoint", path)
        before = engine_of(self.model)
        try:
            return super().train(*args, **kwargs)
        except BaseException as error:
            engine = engine_of(self.model)
            if engine is not None and (engine is not before or engine is self._ts_engine):
                self._ts_take_out(engine, error)
            raise

    def _ts_take_out(self, engine, error: BaseException) -> None:
        """Unwraps the engine this trainer installed after ``train()`` failed with ``error``, and gives the Trainer
        back the optimizer (and scheduler) it had before, so that nothing of the engine stays installed and a second
        ``train()`` starts as the first did."""
        try:
            unwrap(self.model)
        except Exception as e:  # the original error is the one to see; this one goes with it
            error.add_note(f"trainstream_hf: unwrapping the engine after this error failed too: {e!r}")
            logger.error("trainstream_hf: unwrapping the engine after a failed train() failed: %r", e)
            return
        self._ts_engine = None
        if self._ts_callback is not None:
            self._ts_callback.model, self._ts_callback.last = None, {}
        if getattr(self.optimizer, "optimizer", self.optimizer) is engine.optimizer:
            self.optimizer, self.lr_scheduler = self._ts_given_optimizers

    # -- checkpoints: written whole, then renamed into place -------------------------------------------------
    # transformers 5.25's Trainer._save_checkpoint writes everything (model, optimizer, scheduler, RNG, trainer state)
    # into os.path.join(self._get_output_dir(trial), "checkpoint-<step>"), rotates the checkpoints of that folder, and
    # pushes from it: it offers no other place to choose the folder, so _get_output_dir answers the staging folder
    # while it runs, and the checkpoint is moved into the run directory after.
    def _get_output_dir(self, trial):
        run_dir = super()._get_output_dir(trial)
        if self._ts_saving is not None:
            return os.path.join(run_dir, f"{STAGING_PREFIX}{self._ts_saving}")
        return run_dir

    def _save_checkpoint(self, model, trial) -> None:
        step = self.state.global_step
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        final = os.path.join(run_dir, name)
        staging = os.path.join(run_dir, f"{STAGING_PREFIX}{step}")
        staged = os.path.join(staging, name)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # what an earlier attempt at this step left
        self._ts_barrier()
        self._ts_saving, self._ts_push = step, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._ts_saving = None
        self._ts_fix_best_checkpoint(run_dir, step, staged)
        self._ts_barrier()  # every process has written its part (rng_state_<rank>.pth, shards)
        if self.args.should_save:
            publish_checkpoint(staged, final)
        self._ts_barrier()
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
        elif self.args.local_process_index == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a node whose disk the saving process does not see
        push, self._ts_push = self._ts_push, None
        if push is not None:
            super()._push_from_checkpoint(final)

    def _ts_fix_best_checkpoint(self, run_dir: str, step: int, staged: str) -> None:
        """The best checkpoint as the Trainer would name it in the run directory (it looked in the staging folder), in
        the state and in the staged trainer_state.json."""
        best_step = self.state.best_global_step
        if not best_step or self.args.save_strategy not in ("steps", "epoch", "best"):
            return
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
        if (best_step == step or os.path.exists(best)) and self.state.best_model_checkpoint != best:
            self.state.best_model_checkpoint = best
            if self.args.should_save and os.path.isfile(os.path.join(staged, TRAINER_STATE_NAME)):
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._ts_saving is not None:
            self._ts_push = checkpoint_folder  # pushed from its final place (uploads run in the background)
            return
        super()._push_from_checkpoint(checkpoint_folder)

    def _ts_barrier(self) -> None:
        if self.args.world_size > 1:
            self.accelerator.wait_for_everyone()


class TrainStreamTrainer(EngineTrainerMixin, Trainer):
    """A Trainer that installs the engine when its arguments ask for it (``TrainStreamTrainingArguments``)
    and adds the engine's figures to every log before the reporting callbacks see it.

    ``trainstream_unwrap_at_end=False`` leaves the engine installed after ``train()`` (see
    :class:`TrainStreamCallback`): unwrapping puts every weight on the device, which a paged model outgrows."""

    def __init__(self, *args, trainstream_config: TrainStreamConfig | None = None,
                 trainstream_unwrap_at_end: bool = True, **kwargs):
        cfg = self._ts_setup(kwargs.get("args", args[1] if len(args) > 1 else None), trainstream_config)
        super().__init__(*args, **kwargs)
        if cfg is None and isinstance(self.args, TrainStreamTrainingArguments) and self.args.trainstream_enabled():
            cfg = self.args.trainstream_config()  # args=None: the Trainer made default arguments
        self._ts_attach(cfg, trainstream_unwrap_at_end)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._ts_callback is not None and self._ts_callback.last and _is_step_log(logs):
            logs = {**logs, **log_figures(self._ts_callback.last)}  # a copy: the caller's dict stays its own
        super().log(logs, *args, **kwargs)
