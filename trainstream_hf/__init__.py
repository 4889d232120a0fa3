"""trainstream_hf: train models larger than GPU memory in the Hugging Face ecosystem.

    model, optimizer = trainstream_hf.wrap(model, optimizer, vram_budget="24GiB")
"""
__version__ = "0.1.0"

from trainstream_hf.config import TrainStreamConfig  # noqa: E402
from trainstream_hf.planner import BudgetError, Plan  # noqa: E402
from trainstream_hf.wrap import engine_of, unwrap, wrap  # noqa: E402
from trainstream_hf.quant import QuantLinear, quantize_model  # noqa: E402


def plan(model, batch_shape, **options) -> Plan:
    """The plan ``wrap`` would install for ``model`` (nothing is installed). See :func:`wrap` for options."""
    from trainstream_hf import planner
    from trainstream_hf.engine.blocks import find_blocks
    from trainstream_hf.wrap import _compute_device

    cfg = TrainStreamConfig(**options)
    return planner.plan(model, list(find_blocks(model)), batch_shape=batch_shape, vram_budget=cfg.vram_budget,
                        device=_compute_device(model), offload_optimizer=cfg.offload_optimizer, grads=cfg.grads,
                        offload_activations=cfg.offload_activations, page_weights=cfg.page_weights,
                        slots=cfg.slots, prefetch=cfg.prefetch, min_offload_numel=cfg.min_offload_numel)


def __getattr__(name: str):
    # The KV cache subclasses transformers' Cache: import transformers only when it is asked for, so that
    # `import trainstream_hf` stays light for plain-PyTorch users.
    if name in ("PagedKVCache", "TrainStreamCache"):
        from trainstream_hf import cache
        return getattr(cache, name)
    raise AttributeError(f"module 'trainstream_hf' has no attribute {name!r}")


__all__ = ["wrap", "unwrap", "plan", "engine_of", "quantize_model", "QuantLinear", "TrainStreamConfig", "Plan",
           "BudgetError", "PagedKVCache", "TrainStreamCache", "__version__"]
