"""What the recipes under ``recipes/`` share: typed configs from YAML + command-line overrides (``config``),
each recipe's options (``schema``), local data and tokenizer, and the preference pairs and prompts derived from it
(``data``), model building (``model``), held-out evaluation (``evaluate``), the run summary (``report``), the grpo
rewards (``rewards``) and what the dpo and grpo recipes share around TRL's trainers (``align``)."""
from trainstream_hf.train.config import ConfigError, load, parse_args
from trainstream_hf.train.schema import RECIPES, DPOConfig, GRPOConfig, SFTConfig

__all__ = ["ConfigError", "load", "parse_args", "RECIPES", "DPOConfig", "GRPOConfig", "SFTConfig"]
