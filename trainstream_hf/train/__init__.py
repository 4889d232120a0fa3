"""What the recipes under ``recipes/`` share: typed configs from YAML + command-line overrides (``config``),
each recipe's options (``schema``), local data and tokenizer (``data``), model building (``model``),
held-out evaluation (``evaluate``) and the run summary (``report``)."""
from trainstream_hf.train.config import ConfigError, load, parse_args
from trainstream_hf.train.schema import RECIPES, SFTConfig

__all__ = ["ConfigError", "load", "parse_args", "RECIPES", "SFTConfig"]
