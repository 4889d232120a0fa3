"""Accelerate: a plugin dataclass and an Accelerator that installs the engine in ``prepare()``.

Accelerate has no registry for third-party plugins, so ``TrainStreamAccelerator`` subclasses
``Accelerator``: ``prepare(model, optimizer, ...)`` first wraps the model and optimizer on the Accelerator's
device, then does what Accelerate does with the wrapped ones: under ``accelerate launch --num_processes N``
its DistributedDataParallel goes around the wrapped model, the order ``trainstream_hf.engine.distributed``
requires, and the LR scheduler keeps working (the engine's optimizer shares the user's param-group dicts).
``TrainStreamPlugin.from_env()`` reads ``TRAINSTREAM``
("auto" / "on" / "off") and ``TRAINSTREAM_<OPTION>`` variables (parsed and checked by
:func:`trainstream_hf.config.env_config`, the same rules as the Trainer route), so a launch can configure the engine
without code changes in the script beyond using this Accelerator. Targets accelerate 1.15-1.16.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from accelerate import Accelerator
from torch import nn

from trainstream_hf.config import (TrainStreamConfig, default_batch_shape, nearest_option, option_names,
                                   runner_accumulation)
from trainstream_hf.wrap import engine_of, unwrap, wrap

__all__ = ["TrainStreamPlugin", "TrainStreamAccelerator"]


def distributed_kind(distributed_type) -> str:
    """Accelerate's ``DistributedType`` (or None) as its bare name: "FSDP", "DEEPSPEED", "MULTI_GPU", ... ("" for
    None)."""
    return str(getattr(distributed_type, "value", distributed_type) or "").rsplit(".", 1)[-1]


@dataclass
class TrainStreamPlugin:
    """Whether and how :class:`TrainStreamAccelerator` installs the engine.

    Attributes:
        enabled: "auto" (when a GPU is present), "on" or "off".
        config: the engine's options.
    """

    enabled: str = "auto"
    config: TrainStreamConfig = field(default_factory=TrainStreamConfig)

    def __post_init__(self):
        if self.enabled not in ("auto", "on", "off"):
            raise ValueError(f"TrainStreamPlugin.enabled: 'auto', 'on' or 'off', got {self.enabled!r}")

    @classmethod
    def from_env(cls, environ=None) -> "TrainStreamPlugin":
        """``TRAINSTREAM=on`` and ``TRAINSTREAM_VRAM_BUDGET=24GiB`` style variables (any config field); an unset
        ``TRAINSTREAM`` means "auto" here (this Accelerator is already an explicit choice)."""
        from trainstream_hf.config import env_config

        mode, config = env_config(environ, default="auto")
        return cls(enabled=mode, config=config if config is not None else TrainStreamConfig())

    def active(self) -> bool:
        return self.enabled == "on" or (self.enabled == "auto" and torch.cuda.is_available())


class TrainStreamAccelerator(Accelerator):
    """An Accelerator whose ``prepare`` also installs trainstream on the (first) model and optimizer.

    Args:
        trainstream_plugin: the plugin; default :meth:`TrainStreamPlugin.from_env`.
        trainstream: "auto", "on" or "off", as :class:`TrainStreamTrainingArguments`' flag (default: the plugin's).
        **trainstream_<option>: any :class:`TrainStreamConfig` field, e.g. ``trainstream_vram_budget="24GiB"``; over
            what the environment says.
        *args, **kwargs: ``Accelerator``'s.

    Raises:
        ValueError: ``trainstream_plugin`` together with ``trainstream`` / ``trainstream_<option>`` arguments, or an
            argument that names no option.
    """

    def __init__(self, *args, trainstream_plugin: TrainStreamPlugin | None = None, trainstream: str | None = None,
                 **kwargs):
        options = {k[len("trainstream_"):]: kwargs.pop(k) for k in list(kwargs) if k.startswith("trainstream_")}
        if trainstream_plugin is not None and (options or trainstream is not None):
            raise ValueError("TrainStreamAccelerator: pass trainstream_plugin= or trainstream= / trainstream_<option>= "
                             "arguments, not both")
        if trainstream_plugin is None and (options or trainstream is not None):
            trainstream_plugin = _plugin_from_arguments(trainstream, options)
        super().__init__(*args, **kwargs)
        self.trainstream_plugin = trainstream_plugin or TrainStreamPlugin.from_env()
        self.trainstream_model: nn.Module | None = None

    def prepare(self, *args, device_placement=None):
        """Installs the engine on the first model (with the first optimizer, if any) of ``args``, then lets
        Accelerate prepare what ``wrap`` returned. Without ``batch_shape`` in the config, the plan takes the batch
        size of a ``DataLoader`` prepared in the same call (sequences of up to 2048 tokens, or the model's context).

        The engine goes in first, on ``self.device``: under several processes Accelerate's DDP must be built
        around the wrapped model (``trainstream_hf.engine.distributed`` says why), and a model larger than the
        GPU is placed block by block by ``wrap`` instead of moved whole by Accelerate.
        """
        plugin = self.trainstream_plugin
        if not plugin.active():
            return super().prepare(*args, device_placement=device_placement)
        args = list(args)
        mi = next((i for i, o in enumerate(args) if isinstance(o, nn.Module)), None)
        oi = next((i for i, o in enumerate(args) if isinstance(o, torch.optim.Optimizer)), None)
        if mi is not None and engine_of(self.unwrap_model(args[mi])) is None:
            kind = distributed_kind(self.distributed_type)
            if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
                raise ValueError(f"TrainStreamAccelerator: Accelerate runs with {kind}, which decides where the "
                                 "weights and optimizer state live, as trainstream_hf does; use one: a launch config "
                                 "without it (several GPUs: trainstream_hf trains under DistributedDataParallel, "
                                 "--multi_gpu), or TRAINSTREAM=off")
            model = self.unwrap_model(args[mi])
            inner = getattr(args[oi], "optimizer", args[oi]) if oi is not None else None
            if inner is not None and (self.scaler is not None or getattr(args[oi], "scaler", None) is not None):
                raise ValueError("TrainStreamAccelerator: fp16 with a GradScaler is not supported; use bf16")
            config = plugin.config
            placement = self.device_placement if device_placement is None else device_placement
            if config.device is None and placement:
                # Accelerate's cpu device is "cpu:0", which parameters never report; the engine compares devices.
                config = replace(config, device="cpu" if self.device.type == "cpu" else str(self.device))
            loader = next((o for o in args if isinstance(o, torch.utils.data.DataLoader)), None)
            if config.batch_shape is None and isinstance(getattr(loader, "batch_size", None), int):
                # a DataLoader prepared in the same call names the batch (not the length: 2048, or the context)
                config = replace(config, batch_shape=default_batch_shape(model, loader.batch_size))
            config = replace(config, gradient_accumulation_steps=runner_accumulation(  # Accelerate's micro-batches
                config.gradient_accumulation_steps, self.gradient_accumulation_steps, "Accelerate's"),
                # mixed precision: prepare() makes the forward return its float outputs in float32 (the logits' copy)
                fp32_outputs=config.fp32_outputs or bool(getattr(self, "native_amp", False)))
            with self.autocast():  # the block measured as the prepared forward runs it (mixed precision)
                _, new_opt = wrap(model, inner, config)
            if oi is not None and new_opt is not inner:
                if inner is args[oi]:
                    args[oi] = new_opt
                else:  # prepared by an earlier call: swap the torch optimizer inside Accelerate's wrapper
                    args[oi].optimizer = new_opt
            self.trainstream_model = model
        return super().prepare(*args, device_placement=device_placement)

    def end_training(self):
        if self.trainstream_model is not None and engine_of(self.trainstream_model) is not None:
            unwrap(self.trainstream_model)
        super().end_training()


def _plugin_from_arguments(mode: str | None, options: dict) -> TrainStreamPlugin:
    """The environment's plugin with ``mode`` and ``options`` (TrainStreamConfig fields) over it."""
    names = option_names()
    for name in options:
        if name not in names:
            near = nearest_option(name)
            hint = f" (did you mean trainstream_{near}?)" if near else ""
            raise ValueError(f"TrainStreamAccelerator: trainstream_{name} names no option{hint}; the options are "
                             f"TrainStreamConfig's fields: {', '.join(names)}")
    env = TrainStreamPlugin.from_env()
    return TrainStreamPlugin(enabled=env.enabled if mode is None else mode, config=replace(env.config, **options))
