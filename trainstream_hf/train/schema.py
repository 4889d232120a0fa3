"""The options of each recipe, as dataclasses (one section per concern); YAML files under ``configs/`` fill them.

``RECIPES`` maps a recipe's name (``recipes/<name>.py``) to its config class, so that the configs test can
validate every YAML against the recipe its first-line command runs. The three recipes share the top-level options
(:class:`RecipeConfig`) and the ``train``, ``lora`` and ``trainstream`` sections; each adds or narrows what is its own
(``data.packing`` for sft, the ``dpo`` and ``grpo`` sections).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainstream_hf.config import TrainStreamConfig

__all__ = ["DataArgs", "SFTDataArgs", "TrainArgs", "EvalArgs", "PairEvalArgs", "LoraArgs", "DPOArgs", "GRPOArgs",
           "RecipeConfig", "SFTConfig", "DPOConfig", "GRPOConfig", "RECIPES", "CORRUPTIONS", "REWARDS"]

# Names the dpo / grpo sections accept; what they do is in train/data.py (CORRUPT) and train/rewards.py (REWARDS).
CORRUPTIONS = ("swap", "substitute", "drop", "repeat")
REWARDS = ("char_overlap", "char_position", "exact_match")


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


def _section(cls, help: str):
    return field(default_factory=cls, metadata={"help": help})


def _list(default: list, help: str):
    return field(default_factory=lambda: list(default), metadata={"help": help})


@dataclass
class DataArgs:
    """Prompt-completion JSONL files and the tokenizer, all local."""

    train_file: str = _opt("data/train.jsonl", "Training examples: JSON lines with 'prompt' and 'completion'.")
    test_file: str = _opt("data/test.jsonl", "Held-out examples, same format; evaluated before and after.")
    tokenizer: str = _opt("data/tokenizer", "Local tokenizer directory (tokenizer.json + tokenizer_config.json).")
    max_length: int = _opt(64, "Longest tokenized example (prompt + completion + specials); longer is an error.")

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"max_length: at least 2 tokens, got {self.max_length}")


@dataclass
class SFTDataArgs(DataArgs):
    """Prompt-completion JSONL files and the tokenizer, all local; optionally packed."""

    max_length: int = _opt(64, "Longest tokenized example (prompt + completion + specials); longer is an error. "
                                "With packing: the length of every training sequence.")
    packing: bool = _opt(False, "Concatenate the tokenized training examples into sequences of exactly max_length "
                                "tokens (prompt positions still masked out of the loss; attention spans example "
                                "boundaries), so that a step sees batch_size x max_length tokens.")


@dataclass
class TrainArgs:
    """The optimisation: AdamW, a warm-up schedule, gradient clipping."""

    steps: int = _opt(250, "Optimizer steps.")
    batch_size: int = _opt(64, "Examples per step (grpo: completions per step, grpo.num_generations per prompt).")
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
    """Held-out evaluation before and after training: greedy completions scored by exact match (sft: and the
    teacher-forced loss; grpo: and the rewards)."""

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
class PairEvalArgs:
    """Held-out preference pairs (made from data.test_file as the training pairs are), scored before and after
    training: the DPO loss against the reference, the implicit-reward accuracy and margin, and how often the policy
    itself gives the chosen completion the higher log-probability."""

    enabled: bool = _opt(True, "Evaluate before and after training.")
    examples: int = _opt(300, "Held-out pairs to evaluate (from the first N examples of data.test_file); 0: all.")
    batch_size: int = _opt(100, "Pairs per evaluation batch.")
    show: int = _opt(4, "Held-out pairs printed after training, with their log-probabilities.")

    def __post_init__(self) -> None:
        if self.examples < 0 or self.batch_size < 1 or self.show < 0:
            raise ValueError("examples >= 0, batch_size >= 1 and show >= 0 expected, got "
                             f"{self.examples}, {self.batch_size}, {self.show}")


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


def _lora8() -> LoraArgs:
    return LoraArgs(r=8)


def _check_unique(name: str, values: list[str], allowed: tuple[str, ...]) -> None:
    if not values:
        raise ValueError(f"{name}: at least one of {', '.join(map(repr, allowed))}, got []")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}: each of {', '.join(map(repr, allowed))} at most once, got {values}")


@dataclass
class DPOArgs:
    """Direct preference optimisation (TRL's DPOTrainer through trainstream_hf.integrations.trl) on pairs made from
    the prompt-completion data: chosen = the completion, rejected = the completion corrupted."""

    beta: float = _opt(0.1, "KL temperature: the implicit reward is beta x (policy - reference) log-probability.")
    loss_type: Literal["sigmoid", "hinge"] = _opt(
        "sigmoid", "'sigmoid': -log sigmoid(beta x margin) (the DPO paper); 'hinge': relu(1 - beta x margin).")
    corruptions: list[Literal["swap", "substitute", "drop", "repeat"]] = _list(
        CORRUPTIONS, "How a rejected completion is made from the correct one, one kind per pair drawn from this "
                           "list (seeded): 'swap' two different adjacent characters, 'substitute' one character by "
                           "another of the same kind (lowercase, uppercase, digit), 'drop' one character, 'repeat' "
                           "one character.")
    ref_chunk_tokens: int = _opt(1024, "Completion tokens per LM-head chunk when the reference (the model with its "
                                       "adapters off) is scored; bounds that pass's largest tensor.")
    fill_context: bool = _opt(False, "Put solved training examples (prompt and completion, one per line) ahead of "
                                     "each pair's prompt until its longer sequence is as close to data.max_length "
                                     "as they allow: every pair then runs at that length (time and memory per "
                                     "step at a given sequence length); false: each pair alone.")

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"beta: must be > 0, got {self.beta}")
        _check_unique("corruptions", list(self.corruptions), CORRUPTIONS)
        self.corruptions = list(self.corruptions)
        if self.ref_chunk_tokens < 1:
            raise ValueError(f"ref_chunk_tokens: at least 1, got {self.ref_chunk_tokens}")


@dataclass
class GRPOArgs:
    """Group relative policy optimisation (TRL's GRPOTrainer through trainstream_hf.integrations.trl): completions
    sampled for each training prompt, scored against the prompt's reference completion."""

    num_generations: int = _opt(8, "Completions sampled per prompt (a group); train.batch_size must be a multiple.")
    max_completion_length: int = _opt(8, "Sampling stops at <eos> or after this many tokens.")
    temperature: float = _opt(1.0, "Sampling temperature.")
    beta: float = _opt(0.04, "KL coefficient against the reference (the model with its LoRA adapters off); 0: no KL "
                             "term and no reference pass.")
    rewards: list[Literal["char_overlap", "char_position", "exact_match"]] = _list(
        ["char_overlap"], "Reward functions of a completion and the prompt's answer, summed (trainstream_hf/train/"
                          "rewards.py): 'char_overlap' (F1 of the characters they share, with multiplicity, in any "
                          "order), 'char_position' (positions where they agree / the longer length), 'exact_match' "
                          "(1 if equal, else 0).")
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = _opt(
        "dapo", "How token losses are averaged (TRL's GRPOConfig.loss_type).")
    scale_rewards: Literal["group", "batch", "none"] = _opt(
        "group", "Advantages divided by the rewards' standard deviation in each group, over the batch, or not at all.")
    ref_chunk_tokens: int = _opt(1024, "Completion tokens per LM-head chunk when the reference is scored.")
    generation_cache: float | None = _opt(
        None, "Sampling decodes through a TrainStreamCache with this fraction of the layers' K/V on the device (the "
              "rest in pinned host pages, streamed as the layers run); null: TRL's own cache.")
    compiled_generation: bool = _opt(
        False, "Sample with a static cache and transformers' compiled decode step (CUDA graphs on a GPU), which TRL "
               "turns off (TrainStreamGRPOTrainer(compiled_generation=...)); with generation_cache the static cache is "
               "a TrainStreamCache(static=True), kept between steps.")

    def __post_init__(self) -> None:
        if self.generation_cache is not None and not 0.0 <= self.generation_cache <= 1.0:
            raise ValueError(f"generation_cache: a fraction in [0, 1] or null, got {self.generation_cache!r}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations: at least 2 (advantages compare completions of one prompt), got "
                             f"{self.num_generations}")
        if self.max_completion_length < 1 or self.ref_chunk_tokens < 1:
            raise ValueError("max_completion_length and ref_chunk_tokens: at least 1, got "
                             f"{self.max_completion_length}, {self.ref_chunk_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if self.beta < 0:
            raise ValueError(f"beta: must be >= 0, got {self.beta}")
        _check_unique("rewards", list(self.rewards), REWARDS)
        self.rewards = list(self.rewards)


@dataclass
class RecipeConfig:
    """What every recipe reads: the model, where it runs, the data, the optimisation, adapters and the engine."""

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
    vram_cap: str | None = _opt(None, "Cap the CUDA allocator at this size (e.g. '24GiB'): a larger GPU then behaves "
                                      "like one of that size (torch.cuda.set_per_process_memory_fraction); null: no "
                                      "cap. trainstream.vram_budget is what the plan aims for; this is the wall.")
    seed: int = _opt(0, "Seeds the weights' initialisation and the order of the batches.")
    output_dir: str = _opt("build/run", "Where summary.json (and the model, with save_model) are written.")
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


@dataclass
class SFTConfig(RecipeConfig):
    """Supervised fine-tuning of a causal LM on prompt-completion data (recipes/sft.py)."""

    output_dir: str = _opt("build/sft", "Where summary.json (and the model, with save_model) are written.")
    data: SFTDataArgs = _section(SFTDataArgs, "Data files and tokenizer.")
    loop: Literal["plain", "trainer"] = _opt(
        "plain", "How the steps run: 'plain': the recipe's own PyTorch loop over trainstream_hf.wrap; 'trainer': "
                 "transformers' Trainer (trainstream_hf.integrations.transformers.TrainStreamTrainer, which installs "
                 "the engine when it creates its optimizer; its AdamW leaves biases and norms out of weight "
                 "decay). Both write the same summary.")



@dataclass
class DPOConfig(RecipeConfig):
    """Direct preference optimisation of LoRA adapters on pairs made from prompt-completion data (recipes/dpo.py)."""

    output_dir: str = _opt("build/dpo", "Where summary.json (and the adapters, with save_model) are written.")
    eval: PairEvalArgs = _section(PairEvalArgs, "Held-out preference pairs.")
    lora: LoraArgs = _section(_lora8, "LoRA adapters; required (the reference is the model with them off).")
    dpo: DPOArgs = _section(DPOArgs, "The DPO objective and how the pairs are made.")
    trainer: Literal["trainstream", "trl", "trl_bnb"] = _opt(
        "trainstream", "'trainstream': TRL's trainer through trainstream_hf.integrations.trl (the engine, one model for "
                       "policy and reference); 'trl': stock TRL with PEFT over the bf16 base (ref_model None, "
                       "TRL's defaults, gradient checkpointing included), the baseline; 'trl_bnb': the same over a "
                       "bitsandbytes NF4 base (QLoRA; CUDA and bitsandbytes needed). The baselines ignore wrap and "
                       "the trainstream section.")

    def __post_init__(self) -> None:
        if self.lora.r is None:
            raise ValueError("lora.r: null would train every parameter, but the DPO reference is the same model with "
                             "its LoRA adapters switched off (one model in memory): set lora.r (e.g. 8)")
        super().__post_init__()


@dataclass
class GRPOConfig(RecipeConfig):
    """Group relative policy optimisation on prompts of prompt-completion data, rewarded against the completion
    (recipes/grpo.py)."""

    output_dir: str = _opt("build/grpo", "Where summary.json (and the adapters, with save_model) are written.")
    lora: LoraArgs = _section(_lora8, "LoRA adapters (r: null trains every parameter; needs grpo.beta 0).")
    grpo: GRPOArgs = _section(GRPOArgs, "Sampling, rewards and the GRPO objective.")
    trainer: Literal["trainstream", "trl", "trl_bnb"] = _opt(
        "trainstream", "'trainstream': TRL's trainer through trainstream_hf.integrations.trl (the engine, one model for "
                       "policy and reference, grpo.generation_cache); 'trl': stock TRL with PEFT over the bf16 base (ref_model None, "
                       "TRL's defaults, gradient checkpointing included), the baseline; 'trl_bnb': the same over a "
                       "bitsandbytes NF4 base (QLoRA; CUDA and bitsandbytes needed). The baselines ignore wrap and "
                       "the trainstream section.")

    def __post_init__(self) -> None:
        if self.trainer != "trainstream" and self.grpo.compiled_generation:
            raise ValueError(f"grpo.compiled_generation is trainstream's trainer's (stock TRL turns generate()'s "
                             f"compilation off); trainer={self.trainer!r}: set it false, or trainer 'trainstream'")
        if self.trainer != "trainstream" and self.grpo.generation_cache is not None:
            raise ValueError(f"grpo.generation_cache={self.grpo.generation_cache} samples through trainstream's "
                             f"TrainStreamCache, which trainer={self.trainer!r} (stock TRL, its own cache) does not "
                             "use: set grpo.generation_cache null, or trainer 'trainstream'")
        if self.lora.r is None and self.grpo.beta > 0:
            raise ValueError(f"grpo.beta={self.grpo.beta} needs a reference, which is the model with its LoRA adapters "
                             "switched off: set lora.r (e.g. 8), or grpo.beta 0 for a full fine-tune without a KL term")
        if self.train.batch_size % self.grpo.num_generations:
            raise ValueError(f"train.batch_size={self.train.batch_size} must be a multiple of grpo.num_generations="
                             f"{self.grpo.num_generations} (completions per step = prompts x completions per prompt)")
        super().__post_init__()


RECIPES: dict[str, type] = {"sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig}
