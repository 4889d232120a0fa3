"""trainstream_hf: train models larger than GPU memory in the Hugging Face ecosystem.

    model, optimizer = trainstream_hf.wrap(model, optimizer, vram_budget="24GiB")
"""
__version__ = "0.1.0"

from trainstream_hf.config import TrainStreamConfig  # noqa: E402
from trainstream_hf.planner import BudgetError, Plan  # noqa: E402
from trainstream_hf.wrap import engine_of, plan, unwrap, wrap  # noqa: E402
from trainstream_hf.quant import QuantLinear, quantize_model  # noqa: E402


# The Hugging Face side, imported when first asked for (transformers, Accelerate, TRL are heavy, and TRL optional), so
# that `import trainstream_hf` stays light for plain-PyTorch users: name -> module.
_LAZY = {
    "PagedKVCache": "trainstream_hf.cache", "TrainStreamCache": "trainstream_hf.cache",
    "TrainStreamQuantizationConfig": "trainstream_hf.integrations.huggingface",
    "TrainStreamTrainer": "trainstream_hf.integrations.transformers",
    "TrainStreamTrainingArguments": "trainstream_hf.integrations.transformers",
    "TrainStreamCallback": "trainstream_hf.integrations.transformers",
    "TrainStreamAccelerator": "trainstream_hf.integrations.accelerate",
    "TrainStreamDPOTrainer": "trainstream_hf.integrations.trl",
    "TrainStreamDPOConfig": "trainstream_hf.integrations.trl",
    "TrainStreamGRPOTrainer": "trainstream_hf.integrations.trl",
    "TrainStreamGRPOConfig": "trainstream_hf.integrations.trl",
    "TrainStreamOnlineDPOTrainer": "trainstream_hf.integrations.trl_online",
    "TrainStreamOnlineDPOConfig": "trainstream_hf.integrations.trl_online",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainstream_hf' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = ["wrap", "unwrap", "plan", "engine_of", "quantize_model", "QuantLinear", "TrainStreamConfig", "Plan",
           "BudgetError", *_LAZY, "__version__"]
