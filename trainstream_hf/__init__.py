"""trainstream_hf: train models larger than GPU memory in the Hugging Face ecosystem.

    model, optimizer = trainstream_hf.wrap(model, optimizer, vram_budget="24GiB")
"""
__version__ = "0.1.0"

from trainstream_hf.config import TrainStreamConfig  # noqa: E402
from trainstream_hf.planner import BudgetError, Plan  # noqa: E402
from trainstream_hf.wrap import engine_of, plan, unwrap, wrap  # noqa: E402
from trainstream_hf.quant import QuantLinear, quantize_model  # noqa: E402


def __getattr__(name: str):
    # The KV cache subclasses transformers' Cache: import transformers only when it is asked for, so that
    # `import trainstream_hf` stays light for plain-PyTorch users.
    if name in ("PagedKVCache", "TrainStreamCache"):
        from trainstream_hf import cache
        return getattr(cache, name)
    raise AttributeError(f"module 'trainstream_hf' has no attribute {name!r}")


__all__ = ["wrap", "unwrap", "plan", "engine_of", "quantize_model", "QuantLinear", "TrainStreamConfig", "Plan",
           "BudgetError", "PagedKVCache", "TrainStreamCache", "__version__"]
