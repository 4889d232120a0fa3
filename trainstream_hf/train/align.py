"""What the dpo and grpo recipes share: the run's set-up, the policy (a base model and its LoRA config), TRL's
arguments and the engine's config from the recipe's sections, a progress bar that times every step, the trainer's
logged metrics as curves, and the summary's common part.

Both recipes train through TRL 1.16's trainers as :mod:`trainstream_hf.integrations.trl` subclasses them: the engine
(the ``trainstream`` section, when ``wrap`` is true) is installed by a ``TrainStreamCallback`` when training begins
and taken out when it ends, and the reference is the policy with its LoRA adapters switched off (one model in
memory). The Trainer places the model on the device whole before it starts, so these recipes train models that fit
there (the engine then pages what its plan says); sft's own loop builds larger ones straight into host RAM.
"""
from __future__ import annotations

import contextlib
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from trainstream_hf.train import data, model as models, processes, report
from trainstream_hf.train.config import ConfigError, parse_args, to_dict
from trainstream_hf.wrap import engine_of

__all__ = ["Run", "setup", "build_policy", "engine_config", "trl_arguments", "workdir", "Progress", "curves",
           "summary"]


@dataclass
class Run:
    """A recipe run's settings, resolved: the config, the command that started it, the start time, the autocast
    mode, the compute device and the tokenizer."""

    cfg: Any
    command: str
    started: float
    mixed: str
    device: torch.device
    tokenizer: Any


def setup(recipe: str, cls: type, argv: list[str] | None, description: str) -> Run:
    """Parses ``--config FILE`` and the overrides into ``cls`` and checks, before any work, what the run needs:
    the autocast mode and device, a writable ``output_dir`` (created only when the run ends), the tokenizer, and
    engine options TRL's Trainer can honour.

    Raises:
        ConfigError, FileNotFoundError, NotADirectoryError, PermissionError: naming the option.
    """
    import datasets

    # transformers 5.24 deprecates the gradient_checkpointing names that TRL 1.16 still uses (its config field, and
    # disable_gradient_checkpointing around every reference pass): one FutureWarning per use, nothing to act on.
    warnings.filterwarnings("ignore", message=r"`\w*gradient_checkpointing\w*` is deprecated", category=FutureWarning)
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", f"recipes/{recipe}.py", *argv])
    cfg = parse_args(cls, argv, description=description)
    processes.require_single(processes.from_environment(), f"the {recipe} recipe")
    mixed = models.resolve_mixed_precision(cfg.mixed_precision)
    device = models.resolve_device(cfg.device)
    models.cap_vram(cfg.vram_cap, device)
    if device.type == "cuda" and device.index != 0:
        # TRL's Trainer trains on the process's first visible GPU.
        raise ConfigError(f"device={cfg.device!r}: the dpo and grpo recipes train on cuda:0; pick the GPU with "
                          "CUDA_VISIBLE_DEVICES instead")
    report.check_output_dir(cfg.output_dir)
    datasets.disable_progress_bars()  # one bar: the training loop's
    tokenizer = data.load_tokenizer(cfg.data.tokenizer)
    return Run(cfg, command, started, mixed, device, tokenizer)


def trainer_of(cfg) -> str:
    """The recipe's ``trainer`` ('trainstream', or a stock TRL baseline); sft has no such option."""
    return getattr(cfg, "trainer", "trainstream")


def build_policy(run: Run):
    """The base model, built on the device (random weights, or a local checkpoint; packed as built with
    ``trainstream.quantize``), and the ``peft.LoraConfig`` of the ``lora`` section (None with ``lora.r`` null).
    The trainer adds the adapters, so that its reference is the base with them off.

    With ``trainer`` 'trl' the base stays in ``dtype`` (the trainstream section is not read); with 'trl_bnb' its
    linear layers but the LM head become bitsandbytes NF4 layers (double quantization, bf16 compute:
    ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", ...)``'s settings), one at a time.

    Raises:
        ConfigError: 'trl_bnb' without CUDA or without bitsandbytes.
    """
    cfg, ts = run.cfg, run.cfg.trainstream
    trainer = trainer_of(cfg)
    if trainer == "trl_bnb":
        import importlib.util

        if run.device.type != "cuda":
            raise ConfigError(f"trainer='trl_bnb': bitsandbytes' NF4 layers run on CUDA, but device is {run.device}; "
                              "use trainer 'trl' on the CPU")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("trainer='trl_bnb' needs bitsandbytes (pip install bitsandbytes), the baseline it runs")
    stock = trainer != "trainstream"
    model = models.build_model(cfg.model, cfg.init, cfg.dtype, vocab_size=len(run.tokenizer), seed=cfg.seed,
                               device=run.device, home=run.device, quantize=None if stock else ts.quantize,
                               outliers=0.0 if stock else ts.outliers)
    if trainer == "trl_bnb":
        from trainstream_hf.train.baseline import quantize_linears_nf4_

        quantize_linears_nf4_(model, run.device)
    if cfg.lora.r is None:
        return model, None
    lora = cfg.lora
    return model, models.lora_config(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                                     target_modules=lora.target_modules)


def engine_config(run: Run, batch_shape: tuple[int, int]):
    """The ``trainstream`` section as the trainer's ``trainstream_config`` (None with ``wrap`` false): the base was
    quantized as it was built (wrap finds it packed in that format and leaves it), and ``batch_shape`` (sequences x tokens of one forward) sizes the plan unless the
    section gives one."""
    if not run.cfg.wrap or trainer_of(run.cfg) != "trainstream":
        return None
    ts = run.cfg.trainstream
    return replace(ts, batch_shape=ts.batch_shape or tuple(batch_shape), device=ts.device or str(run.device))


def trl_arguments(run: Run, config_cls: type, output_dir: str, **recipe_args):
    """TRL's ``DPOConfig`` / ``GRPOConfig`` from the ``train`` section and the run, plus ``recipe_args``.

    Nothing is saved through the Trainer (``save_strategy="no"``, no reporting integration); ``output_dir`` is a
    scratch directory (:func:`workdir`). A log every ``train.log_every`` steps, and one after the first step.
    Gradient checkpointing: off through trainstream (the engine's plan decides what to recompute), TRL's own default
    for the stock baselines (``trainer`` 'trl' / 'trl_bnb').
    """
    cfg, tc = run.cfg, run.cfg.train
    if trainer_of(cfg) == "trainstream":
        # TRL turns gradient checkpointing on by default; what to recompute is the engine's plan's call
        # (trainstream.recompute), and the wrap=false baseline recomputes nothing either.
        recipe_args.setdefault("gradient_checkpointing", False)
    return config_cls(
        output_dir=output_dir, max_steps=tc.steps, per_device_train_batch_size=tc.batch_size,
        gradient_accumulation_steps=1, learning_rate=tc.lr, weight_decay=tc.weight_decay, adam_beta1=tc.betas[0],
        adam_beta2=tc.betas[1], warmup_steps=tc.warmup_steps, lr_scheduler_type=tc.scheduler,
        max_grad_norm=tc.max_grad_norm or 0.0, logging_steps=tc.log_every, logging_first_step=True, report_to=[],
        save_strategy="no", seed=cfg.seed, use_cpu=run.device.type == "cpu", bf16=run.mixed == "bf16",
        dataloader_num_workers=0, **recipe_args)


@contextlib.contextmanager
def workdir() -> Iterator[str]:
    """A scratch directory for the Trainer's ``output_dir``, removed afterwards: the run writes only its
    ``output_dir``, and only when it ends."""
    with tempfile.TemporaryDirectory(prefix="trainstream-recipe-") as path:
        yield path


class Progress(TrainerCallback):
    """One progress bar showing the logged figures named in ``shown`` (transformers' own bar, which also prints
    every log, is taken out), the wall time of every optimizer step (its generation included, for GRPO), and, while
    the engine is installed, its plan and what it moved in each optimizer step (the engine's step is the optimizer
    step).

    Args:
        desc: the bar's label.
        shown: logged key -> label on the bar, e.g. ``{"loss": "loss", "reward": "reward"}``.
    """

    def __init__(self, desc: str, shown: dict[str, str]):
        self.desc, self.shown = desc, shown
        self.seconds: list[float] = []
        self.generation_seconds: list[float] = []  # per optimizer step: in the policy's generate() (GRPO sampling)
        self._gen = 0.0
        self._timed_model = None
        self.moved: list[dict] = []  # per optimizer step: bytes each way and engine steps closed
        self.plan: dict | None = None
        self.bar = None
        self._engine = None
        self._t0 = 0.0
        # CUDA peaks over the training steps alone (reset at the first step's start, read at each step's end): the
        # model's loading (a bf16 load quantized on the device peaks far above training) is not the run's peak,
        # and the engine resets the counters at each of its steps, so the last reading alone would be one step's.
        self.train_peak: dict | None = None

    @classmethod
    def attach(cls, trainer, desc: str, shown: dict[str, str]) -> "Progress":
        """A ``Progress`` added to ``trainer`` (after its engine callback, so that the engine is in when this one's
        ``on_train_begin`` runs), in place of transformers' progress bar."""
        trainer.remove_callback(ProgressCallback)
        progress = cls(desc, shown)
        trainer.add_callback(progress)
        progress._time_generation(trainer.model)
        return progress

    def _time_generation(self, model) -> None:
        """Adds the wall time of every ``model.generate`` call (the object TRL samples from, synchronised on CUDA at
        both ends) to the current step's generation seconds; :meth:`on_train_end` takes the timer off."""
        inner = model.generate

        def generate(*args, **kwargs):
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                self._gen += time.perf_counter() - t0

        model.generate = generate
        self._timed_model = model

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from tqdm.auto import tqdm

        engine = engine_of(model) if model is not None else None
        if engine is not None:
            self.plan = report.plan_summary(engine.plan)
            self._engine = engine
        self.bar = tqdm(total=state.max_steps, desc=self.desc, unit="step", dynamic_ncols=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.train_peak is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            self.train_peak = {"kind": "cuda max_memory_allocated over the training steps", "bytes": 0,
                               "reserved_bytes": 0}
        self._t0 = time.perf_counter()
        self._gen = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._t0)
        if self.train_peak is not None:
            self.train_peak["bytes"] = max(self.train_peak["bytes"], torch.cuda.max_memory_allocated())
            self.train_peak["reserved_bytes"] = max(self.train_peak["reserved_bytes"],
                                                    torch.cuda.max_memory_reserved())
        self.generation_seconds.append(self._gen)
        # The engine's step is the optimizer step (reference pass, generation, forward, backward): it closed
        # when step() returned, just before this event.
        s = self._engine.stats() if self._engine is not None else None
        if s and (not self.moved or s["step"] != self.moved[-1]["last"]["step"]):
            self.moved.append({"h2d_bytes": s["h2d_bytes"], "d2h_bytes": s["d2h_bytes"], "last": s})
        self.bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        figures = {label: f"{logs[key]:.3g}" for key, label in self.shown.items() if key in (logs or {})}
        if figures and self.bar is not None:
            self.bar.set_postfix(figures)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
        if self._timed_model is not None:
            self._timed_model.__dict__.pop("generate", None)
            self._timed_model = None

    def engine(self) -> dict | None:
        """The summary's ``trainstream`` section (None when the engine was not installed): medians per optimizer
        step, every step's figures whole (the engine's step is the optimizer step)."""
        if self.plan is None:
            return None
        full = self.moved
        out: dict = {"plan": self.plan, "steps_measured": len(full)}
        if full:
            last = full[-1]["last"]
            out.update({"h2d_bytes_per_step": statistics.median(m["h2d_bytes"] for m in full),
                        "d2h_bytes_per_step": statistics.median(m["d2h_bytes"] for m in full),
                        "arena_reserved_bytes": last["arena_reserved_bytes"],
                        "arena_used_bytes": last["arena_used_bytes"], "last_engine_step": last})
            peaks = [m["last"]["peak_allocated_bytes"] for m in full if "peak_allocated_bytes" in m["last"]]
            if peaks:
                out["peak_allocated_bytes"] = max(peaks)
        return out


def curves(log_history: list[dict], keys: list[str]) -> dict[str, list[list[float]]]:
    """``{key: [[step, value], ...]}`` of each of ``keys`` over the Trainer's step logs (each value the mean over
    the steps since the previous log, as TRL logs its metrics)."""
    return {k: [[h["step"], h[k]] for h in log_history if k in h and "step" in h] for k in keys}


def train_curves(log_history: list[dict], keys: list[str]) -> dict:
    """The summary's ``train`` section: each logged metric's first and last value, and its whole curve."""
    c = curves(log_history, keys)
    return {"first": {k: v[0][1] for k, v in c.items() if v}, "last": {k: v[-1][1] for k, v in c.items() if v},
            "curves": c}


def before_after(before: dict | None, after: dict | None, drop: str) -> dict | None:
    """The summary's ``heldout`` section: the held-out figures before and after training, without the ``drop``
    list (shown separately); None when there was no evaluation."""
    if not before:
        return None
    return {"before": {k: v for k, v in before.items() if k != drop},
            "after": {k: v for k, v in after.items() if k != drop}}


def summary(run: Run, recipe: str, model, counts: dict, progress: Progress, log_history: list[dict],
            results: dict) -> dict:
    """The run summary: what ran (command, versions, config, model), ``results`` (the recipe's own figures), then
    timing, peak memory and the engine's figures."""
    cfg = run.cfg
    train_seconds = sum(progress.seconds)
    tokens = [h["num_tokens"] for h in log_history if "num_tokens" in h]
    return {
        "recipe": recipe, **report.run_info(run.device, run.command), "config": to_dict(cfg),
        "model": {"type": model.config.model_type, **counts, "dtype": cfg.dtype,
                  "quantize": {"trl": None, "trl_bnb": "bitsandbytes nf4"}.get(trainer_of(cfg),
                                                                             cfg.trainstream.quantize),
                  "lora_r": cfg.lora.r},
        "mixed_precision": run.mixed,
        "steps": len(progress.seconds),
        **results,
        "trainer": trainer_of(cfg),
        "timing": {"train_seconds": train_seconds, "median_step_seconds": statistics.median(progress.seconds),
                   # every step's, first included (a compiled decode step pays its compilation there)
                   "step_seconds": list(progress.seconds),
                   **({"generation_seconds": list(progress.generation_seconds)}
                      if any(progress.generation_seconds) else {}),
                   # GRPO: each step's sampling (generate()) and the rest (scoring, reference, forward, backward, step)
                   **({"median_generation_seconds": statistics.median(progress.generation_seconds),
                       "median_train_seconds": statistics.median(
                           s - g for s, g in zip(progress.seconds, progress.generation_seconds))}
                      if any(progress.generation_seconds) else {}),
                   # TRL counts the tokens of the sequences it trained on (num_tokens, logged cumulatively)
                   "tokens_per_second": tokens[-1] / train_seconds if tokens else None,
                   "wall_seconds": time.perf_counter() - run.started},
        # the training steps' peak on CUDA (both trainers alike); the whole process's elsewhere
        "peak_memory": progress.train_peak or report.peak_memory(run.device),
        "trainstream": progress.engine(),
    }
