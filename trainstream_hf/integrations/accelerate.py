"""Accelerate: a plugin dataclass and an Accelerator that installs the engine in ``prepare()``.

Accelerate has no registry for third-party plugins, so ``TrainStreamAccelerator`` subclasses
``Accelerator``: ``prepare(model, optimizer, ...)`` does what Accelerate does, then wraps the prepared
model and swaps the prepared optimizer's inner torch optimizer for the engine's (the LR scheduler keeps
working: both share their param-group dicts). ``TrainStreamPlugin.from_env()`` reads ``TRAINSTREAM``
("auto" / "on" / "off") and ``TRAINSTREAM_<OPTION>`` variables (parsed and checked by
:func:`trainstream_hf.auto.env_config`, the same rules as the Trainer route), so a launch can configure the engine
without code changes in the script beyond using this Accelerator. Targets accelerate 1.15-1.16.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from torch import nn

from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.wrap import engine_of, unwrap, wrap

__all__ = ["TrainStreamPlugin", "TrainStreamAccelerator"]


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
        from trainstream_hf.auto import env_config

        mode, config = env_config(environ, default="auto")
        return cls(enabled=mode, config=config if config is not None else TrainStreamConfig())

    def active(self) -> bool:
        return self.enabled == "on" or (self.enabled == "auto" and torch.cuda.is_available())


class TrainStreamAccelerator(Accelerator):
    """An Accelerator whose ``prepare`` also installs trainstream on the (first) model and optimizer.

    Args:
        trainstream_plugin: the plugin; default :meth:`TrainStreamPlugin.from_env`.
        *args, **kwargs: ``Accelerator``'s.
    """

    def __init__(self, *args, trainstream_plugin: TrainStreamPlugin | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.trainstream_plugin = trainstream_plugin or TrainStreamPlugin.from_env()
        self.trainstream_model: nn.Module | None = None

    def prepare(self, *args, device_placement=None):
        out = super().prepare(*args, device_placement=device_placement)
        plugin = self.trainstream_plugin
        if not plugin.active():
            return out
        result = list(out) if isinstance(out, tuple) else [out]
        models = [o for o in result if isinstance(o, nn.Module)]
        opts = [o for o in result if isinstance(o, torch.optim.Optimizer)]
        if models and engine_of(models[0]) is None:
            model = self.unwrap_model(models[0])
            inner = getattr(opts[0], "optimizer", opts[0]) if opts else None
            if opts and getattr(opts[0], "scaler", None) is not None:
                raise ValueError("TrainStreamAccelerator: fp16 with a GradScaler is not supported; use bf16")
            _, new_opt = wrap(model, inner, plugin.config)
            if opts and new_opt is not inner:
                opts[0].optimizer = new_opt
            self.trainstream_model = model
        return out

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Accelerate's clip, or the engine optimizer's when gradients live in host RAM."""
        opt = next((o.optimizer for o in self._optimizers if hasattr(o, "optimizer")), None)
        if opt is not None and getattr(opt, "grads_mode", None) == "host":
            return opt.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def end_training(self):
        if self.trainstream_model is not None and engine_of(self.trainstream_model) is not None:
            unwrap(self.trainstream_model)
        super().end_training()
