"""The options of each recipe, as dataclasses (one section per concern); YAML files under ``configs/`` fill them.

``RECIPES`` maps a recipe's name (``recipes/<name>.py``) to its config class, so that the configs test can
validate every YAML against the recipe its first-line command runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainstream_hf.config import TrainStreamConfig

__all__ = ["DataArgs", "TrainArgs", "EvalArgs", "LoraArgs", "SFTConfig", "RECIPES"]


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


def _section(cls: type, help: str):
    return field(default_factory=cls, metadata={"help": help})


@dataclass
class DataArgs:
    """Prompt-completion JSONL files and the tokenizer, all local."""

    train_file: str = _opt("data/train.jsonl", "Training examples: JSON lines with 'prompt' and 'completion'.")
    test_file: str = _opt("data/test.jsonl", "Held-out examples, same format; evaluated before and after.")
    tokenizer: str = _opt("data/tokenizer", "Local tokenizer directory (tokenizer.json + tokenizer_config.json).")
    max_length: int = _opt(64, "Longest tokenized example (prompt + completion + specials); longer is an error. "
                                "With packing: the length of every training sequence.")
    packing: bool = _opt(False, "Concatenate the tokenized training examples into sequences of exactly max_length "
                                "tokens (prompt positions still masked out of the loss; attention spans example "
                                "boundaries), so that a step sees batch_size x max_length tokens.")

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"max_length: at least 2 tokens, got {self.max_length}")


@dataclass
class TrainArgs:
    """The optimisation: AdamW, a warm-up schedule, gradient clipping."""

    steps: int = _opt(250, "Optimizer steps.")
    batch_size: int = _opt(64, "Examples per step.")
    lr: float = _opt(3e-3, "Peak learning rate.")
    weight_decay: float = _opt(0.01, "AdamW weight decay.")
    betas: tuple[float, float] = _opt((0.9, 0.98), "AdamW betas.")
    warmup_steps: int = _opt(30, "Linear warm-up steps.")
    scheduler: Literal["linear", "cosine", "constant_with_warmup"] = _opt(
        "linear", "Learning-rate schedule after warm-up (transformers.get_scheduler names).")
    max_grad_norm: float | None = _opt(1.0, "Clip the total gradient norm to this; null: no clipping.")
    log_every: int = _opt(10, "Steps between progress-bar loss updates (also the loss curve's resolution).")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")


@dataclass
class EvalArgs:
    """Held-out evaluation: teacher-forced loss and greedy exact match, before and after training."""

    enabled: bool = _opt(True, "Evaluate before and after training. false: no evaluation (benchmark configs: random "
                               "weights have nothing to show, and a model larger than the GPU is never whole on it).")
    examples: int = _opt(300, "Held-out examples to evaluate (the first N of data.test_file); 0: all.")
    batch_size: int = _opt(100, "Examples per evaluation batch.")
    max_new_tokens: int = _opt(12, "Greedy decoding stops at <eos> or after this many tokens.")
    show: int = _opt(4, "Held-out predictions printed after training.")

    def __post_init__(self) -> None:
        if self.examples < 0 or self.batch_size < 1 or self.max_new_tokens < 1 or self.show < 0:
            raise ValueError("examples >= 0, batch_size >= 1, max_new_tokens >= 1 and show >= 0 expected, got "
                             f"{self.examples}, {self.batch_size}, {self.max_new_tokens}, {self.show}")


@dataclass
class LoraArgs:
    """PEFT LoRA adapters; with ``r: null`` every parameter trains (a full fine-tune)."""

    r: int | None = _opt(None, "LoRA rank; null: no adapters, full fine-tune.")
    alpha: int = _opt(16, "lora_alpha (the update is scaled by alpha / r).")
    dropout: float = _opt(0.0, "Dropout on the adapters' input.")
    target_modules: str | list[str] = _opt("all-linear", "Module names to adapt, or 'all-linear' (every linear layer "
                                                         "but the output head, quantized ones included).")

    def __post_init__(self) -> None:
        if self.r is not None and self.r < 1:
            raise ValueError(f"r: at least 1 (or null for a full fine-tune), got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: in [0, 1), got {self.dropout}")


@dataclass
class SFTConfig:
    """Supervised fine-tuning of a causal LM on prompt-completion data (recipes/sft.py)."""

    model: str = _opt("configs/models/tiny-llama.json",
                      "With init=random: a model config JSON (transformers config kwargs with model_type) or a "
                      "directory holding config.json. With init=pretrained: a local model directory.")
    init: Literal["random", "pretrained"] = _opt(
        "random", "'random': build from the config with random weights; 'pretrained': load local weights.")
    dtype: Literal["float32", "bfloat16", "float16"] = _opt("float32", "Parameter dtype.")
    mixed_precision: Literal["auto", "no", "bf16"] = _opt(
        "auto", "Autocast of the forward pass: 'bf16', 'no', or 'auto': what accelerate launch's config file says "
                "(its mixed_precision), 'no' without accelerate launch.")
    device: str = _opt("auto", "Compute device: 'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1'.")
    seed: int = _opt(0, "Seeds the weights' initialisation and the order of the batches.")
    output_dir: str = _opt("build/sft", "Where summary.json (and the model, with save_model) are written.")
    save_model: bool = _opt(False, "Also save the trained model and tokenizer to output_dir/model.")
    wrap: bool = _opt(True, "Train through trainstream_hf.wrap with the trainstream section's options; false "
                            "trains the plain model (the baseline).")
    data: DataArgs = _section(DataArgs, "Data files and tokenizer.")
    train: TrainArgs = _section(TrainArgs, "Optimisation.")
    eval: EvalArgs = _section(EvalArgs, "Held-out evaluation.")
    lora: LoraArgs = _section(LoraArgs, "LoRA adapters (r: null trains every parameter).")
    trainstream: TrainStreamConfig = _section(TrainStreamConfig, "Options of trainstream_hf.wrap "
                                                                   "(TrainStreamConfig fields); quantize and outliers "
                                                                   "are applied by the recipe as it builds the base.")

    def __post_init__(self) -> None:
        if self.trainstream.quantize is not None and self.lora.r is None:
            raise ValueError(f"trainstream.quantize={self.trainstream.quantize!r} packs the base weights, which then "
                             "stay frozen: set lora.r (e.g. 16) to train adapters over them, or trainstream.quantize "
                             "null for a full fine-tune")


RECIPES: dict[str, type] = {"sft": SFTConfig}
