"""TrainStreamConfig: the one dataclass for every option of the engine (validated, documented)."""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["TrainStreamConfig", "parse_bytes", "runner_accumulation"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

QUANT_FORMATS = (None, "int8", "nf4", "fp8", "nvfp4")


def parse_bytes(value: int | float | str, *, name: str = "size") -> int:
    """Parses a byte count: an int, or a string such as ``"48GiB"``, ``"512 MiB"``, ``"1.5GB"``.

    Args:
        value: the size. Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB,
            GB, TB) powers of 1000.
        name: the option's name, used in error messages.

    Returns:
        The size in bytes (>= 0).
    """
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a byte count such as 2**30 or '1GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{name}: a float byte count must be whole, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{name}: cannot parse {value!r}; use e.g. '48GiB', '512MiB', '2GB' or a "
                             "number of bytes")
        if not unit and not float(m.group(1)).is_integer():  # "0.5": no unit to scale it by, not a byte count
            raise ValueError(f"{name}: a byte count must be whole, got {value!r}; give a unit ('1.5GiB')")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"{name}: expected int or str such as '48GiB', got {type(value).__name__}")
    if n < 0:
        raise ValueError(f"{name}: must be >= 0, got {value!r}")
    return n


@dataclass
class TrainStreamConfig:
    """Every option of trainstream_hf, in one place. Fields are validated on construction."""

    quantize: str | None = field(default=None, metadata={
        "help": "Storage format of frozen base weights: None (keep dtype), 'int8', 'nf4', 'fp8' or 'nvfp4'."})
    outliers: float = field(default=0.0, metadata={
        "help": "Fraction of input channels (0 to 0.5) kept in bf16 in quantized matmuls, chosen per call on "
                "the device."})
    vram_budget: int | float | str = field(default="auto", metadata={
        "help": "Device memory the plan may use: bytes, a string like '24GiB', a fraction of the device's "
                "memory in (0, 1], or 'auto' (free memory minus a margin)."})
    host_arena: int | str | None = field(default="auto", metadata={
        "help": "Pinned host memory reserved at wrap time: 'auto' (sized from what the plan needs), a size "
                "such as '48GiB' or a byte count, or None/0 for no pinned arena (pageable copies)."})
    host_arena_slab: int | str = field(default="1GiB", metadata={
        "help": "Size of each pinned slab of the host arena."})
    pageable_fallback: bool = field(default=False, metadata={
        "help": "When the host arena is exhausted, hand out ordinary pageable tensors (one warning) instead "
                "of raising ArenaExhaustedError."})
    peer: str | bool = field(default="auto", metadata={
        "help": "Data parallel: the processes of one host keep one shared, pinned host copy of a paged frozen "
                "base instead of one each (engine/peer.py): 'auto' (when a host runs several processes; private "
                "copies with a warning if sharing fails), True (an error when it cannot share) or False."})
    device: str | None = field(default=None, metadata={
        "help": "Compute device, e.g. 'cuda:0'. Default: where the model's parameters are. A model loaded in "
                "host RAM (larger than the GPU) is placed by the plan: paged block weights go to the arena, "
                "the rest to this device."})
    offload_optimizer: str | bool = field(default="auto", metadata={
        "help": "fp32 master weights and AdamW moments of large trainable parameters in host RAM, stepped on "
                "the CPU: 'auto' (when the plan needs the room), True or False."})
    grads: str = field(default="auto", metadata={
        "help": "Gradients of offloaded parameters: 'device' (kept until step), 'host' (moved to host RAM during "
                "backward) or 'auto'. Either way p.grad shows them, so torch's clip_grad_norm_ clips them all."})
    offload_activations: str | bool = field(default="auto", metadata={
        "help": "Saved activations of blocks in host RAM between forward and backward: 'auto', True or False."})
    recompute: str | bool = field(default="auto", metadata={
        "help": "Checkpoint (recompute in backward) the blocks whose activations cannot move to host RAM "
                "while the GPU computes: 'auto', True (every block) or False."})
    page_weights: str | bool = field(default="auto", metadata={
        "help": "Block weights in host RAM, streamed into device slots ahead of use: 'auto', True or False."})
    expandable_segments: str | bool = field(default="auto", metadata={
        "help": "Switch the CUDA caching allocator to expandable segments (process-wide, for segments allocated "
                "after wrap) so fragmentation cannot eat the plan's margin: 'auto' (when the plan pages weights, "
                "offloads or recomputes activations, steps optimizer state on the device or is predicted within "
                "10% of the budget, and "
                "PYTORCH_CUDA_ALLOC_CONF does not set it), True or False (never touch the allocator)."})
    slots: int = field(default=2, metadata={"help": "Device slots of the weight ring (>= 1)."})
    prefetch: int = field(default=1, metadata={"help": "Blocks copied ahead into the ring (< slots)."})
    batch_shape: tuple | None = field(default=None, metadata={
        "help": "(batch, sequence length) of the longest micro-batch, for the plan's activation estimate; default "
                "(1, min(2048, max_position_embeddings)), under a Trainer (its per-device batch, the longer of 2048 "
                "and TRL's max_length). A training forward with more tokens warns when the plan would not fit them."})
    fp32_outputs: bool = field(default=False, metadata={
        "help": "The forward's floating-point outputs are copied to float32 after it returns (Accelerate's mixed "
                "precision does this): the plan counts the logits' float32 copy at the end of the forward (1 GiB for "
                "a 128k vocabulary at 2048 tokens). The Trainer integrations and TrainStreamAccelerator set it "
                "under bf16 / fp16."})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "help": "Micro-batches per optimizer step, for the plan: from the second on, each forward runs beside the "
                "gradients the earlier ones left on the device until step(). The Trainer integration takes the "
                "Trainer's own; with plain wrap() pass it (a step with more micro-batches than planned warns when "
                "the plan would not fit them)."})
    min_offload_numel: int = field(default=1 << 20, metadata={
        "help": "Trainable parameters smaller than this (LoRA adapters, norms) keep their optimizer and "
                "their weights on the device."})
    overlap_step: str | bool = field(default="auto", metadata={
        "help": "optimizer.step() returns at once and the CPU AdamW runs while the next forward starts, each "
                "block waiting for its own new weights: 'auto' (on CUDA, unless weights are paged and "
                "trainable), True or False."})
    optimizer_in_backward: bool = field(default=False, metadata={
        "help": "Start each offloaded parameter's CPU AdamW update in backward, as soon as its gradient has left for "
                "the host, instead of at optimizer.step() (torchtune's optimizer_in_bwd): the same numbers, the CPU "
                "step overlapping backward. Needs host gradients ('auto' becomes 'host') and the worker thread "
                "(overlap_step 'auto' becomes True, on the CPU too); not with offload_optimizer=False, paged "
                "trainable weights or several processes (DDP). The gradients are consumed in backward, so no "
                "gradient clipping (set the Trainer's max_grad_norm=0), no gradient accumulation and no skipped "
                "steps (GradScaler): each raises. Without offloaded optimizer state it does nothing."})
    optimizer_resident: str | bool = field(default="auto", metadata={
        "help": "Of the offloaded parameters (not paged ones), keep the fp32 master and moments of as many as the plan's "
                "spare device memory holds on the device, in forward order, and step them there (12 bytes each; no CPU "
                "time, no PCIe traffic; the same bits as the CPU kernel): 'auto' (on CUDA), True or False."})
    optimizer_streamed: str | bool | float = field(default="auto", metadata={
        "help": "Of the offloaded parameters left, step a share on the device: their fp32 state stays in host RAM and "
                "passes through a ring of device buffers at optimizer.step() (12 bytes each way per element, no CPU "
                "time, the same bits), beside the CPU AdamW on the rest. 'auto' (on CUDA: split so the PCIe link and "
                "the CPU, measured at wrap time, finish together), True (that split on any device), a fraction of the "
                "elements in [0, 1], or False. Streamed parameters keep their gradients on the device until the step, "
                "so only as many as fit."})
    optimizer_moments: str = field(default="float32", metadata={
        "help": "The offloaded AdamW's moments on the host: 'float32' (exact) or 'bfloat16' (opt-in approximation: "
                "stored by stochastic rounding, 4 bytes per parameter instead of 8, e.g. an 8B full fine-tune's state "
                "in a 128 GiB host; the optimizer's device share is then off)."})
    optimizer_staleness: int = field(default=0, metadata={
        "help": "0: exact AdamW. 1 (opt-in approximation, ZeRO-Offload's delayed parameter update): the CPU share's "
                "update from step N's gradients runs during step N+1's forwards and backwards and reaches the device "
                "weights at step N+1's optimizer.step(), so those parameters train one update behind; the CPU AdamW "
                "then costs no step time when a step's micro-batches take longer than it (gradient accumulation). "
                "Masters and moments are exact AdamW over the gradients delivered; the optimizer's device share is not "
                "delayed; saving the model writes the pending update first. Keeps gradients on the device ('auto' "
                "becomes 'device') and streams no optimizer state; not with optimizer_in_backward or paged trainable "
                "weights. It pays at 4 or more micro-batches per step; it can cost learning: on the demo task the "
                "delayed run learned far more slowly than exact AdamW at every learning rate tried "
                "(benchmarks/NOTES.md, 2026-12-06 night). Compare loss curves before relying on it."})
    data_parallel: str | bool = field(default="auto", metadata={
        "help": "Replicas trained with DistributedDataParallel, one per process (wrap first, then DDP): 'auto' (when "
                "torch.distributed is initialized with more than one process), True or False. Then gradients stay on "
                "the device for DDP to average, trainable weights are not paged, every process must plan the same, "
                "and rank 0's values are broadcast into host-held weights and optimizer masters."})
    timeline: bool = field(default=False, metadata={
        "help": "Time every copy and block per step (overlap % in the stats; one host sync per step). "
                "TRAINSTREAM_TRACE=file.json turns it on and writes a Chrome trace."})
    min_activation_bytes: int | str = field(default="1MiB", metadata={
        "help": "Saved tensors smaller than this stay on the device."})
    chunked_loss: bool = field(default=True, metadata={
        "help": "Compute a causal LM's loss (transformers' ForCausalLMLoss) in row chunks: the same bits, without "
                "the fp32 log-probabilities of every token over the vocabulary (3 GiB for an 8B Llama at 2048 "
                "tokens). Models with another loss function are left alone."})
    fused_loss: bool | str = field(default="auto", metadata={
        "help": "Compute a causal LM's LM head and loss together in row chunks during training forwards with labels, "
                "never holding every token's logits (38 GiB of bf16 for Llama-3 at 160k tokens); the output's "
                "logits are then None. 'auto': when the logits would take at least 1 GiB; True: always; False: "
                "never. The same maths, not the same bits as the whole-matrix loss (trainstream_hf/engine/head.py)."})
    tiled_mlp: bool | str = field(default="auto", metadata={
        "help": "Run a decoder block's MLP over tiles of tokens in training, recomputing one tile at a time in "
                "backward, so its intermediate activations never exist for the whole sequence (18 GiB of bf16 for "
                "Llama-3-8B at 160k tokens). 'auto': when one call's intermediate would take at least 1 GiB; True: "
                "always; False: never. The same maths, not the same bits (trainstream_hf/engine/tiled.py)."})
    host_embedding: bool | str = field(default="auto", metadata={
        "help": "Keep a frozen input embedding's table (an nn.Embedding not tied to the output head) in pinned host "
                "RAM, the parameter a CUDA tensor over that memory: the embedding's kernel reads each batch's rows "
                "over PCIe (no device copy of the table: 1 GiB for Llama-3's 128k x 4096 bf16 table; ~16 MiB read "
                "per 2048 tokens; the device table's values). 'auto': on CUDA in one process, when the plan would "
                "otherwise move anything off the device or not fit (memory is short); True: on CUDA always; False: "
                "never (trainstream_hf/engine/embedding.py)."})
    fused_norms: bool = field(default=False, metadata={
        "help": "Run the Llama family's RMSNorm modules (LlamaRMSNorm and its copies) through one fused kernel each "
                "way instead of eight ops: the same maths, not the same bits (the row sum is reduced in another "
                "order), so off by default (trainstream_hf/engine/norms.py)."})
    compile_blocks: bool | str = field(default=False, metadata={
        "help": "Compile each decoder block's forward as one region with torch.compile (norms, RoPE, SwiGLU, casts "
                "and adapter glue fused; one compiled graph shared by the blocks of one structure); the engine's "
                "hooks, paging and offload stay outside it; generation and evaluation calls run eager. 'auto': on "
                "CUDA with Triton, eager with one warning if compilation fails or the blocks hold FP8 tensor-core "
                "layers (compiled, those do not yet train as eager on the GPU); True: torch.compile's default backend "
                "(inductor); a string: that backend ('aot_eager' traces without generating kernels); False: eager. "
                "wrap pays the compilation (on the CPU, the backward's is left to the first step): the plan measures "
                "the compiled block, which saves less than the eager one. The same maths, not the same bits, and "
                "dropout draws other masks (inductor's own random numbers; trainstream_hf/engine/compiled.py)."})
    elide_casts: str | bool = field(default="auto", metadata={
        "help": "Save an exact widening copy (PEFT's fp32 copy of a bf16 LoRA input) as its narrow source and "
                "convert it again in backward: the same values, about a third less activation memory in a "
                "LoRA block. 'auto': only when the plan needs the memory (if every block keeps its weights and "
                "activations on the device without it, or if the measured block saves no widened copy -- LoRA over "
                "QuantLinear saves its narrow input itself -- it is left out: it costs a cast per copy in backward "
                "and a Python hook per saved tensor; compiled blocks decide what they save themselves); True: always; "
                "False: never."})

    def __post_init__(self) -> None:
        if self.quantize not in QUANT_FORMATS:
            raise ValueError(f"quantize: unknown format {self.quantize!r}; choose one of "
                             f"{', '.join(repr(f) for f in QUANT_FORMATS)}")
        if not isinstance(self.outliers, (int, float)) or not 0.0 <= float(self.outliers) <= 0.5:
            raise ValueError(f"outliers: a fraction of input channels in [0, 0.5], got {self.outliers!r}")
        if isinstance(self.vram_budget, float) and not isinstance(self.vram_budget, bool):
            if not 0.0 < self.vram_budget <= 1.0:
                raise ValueError(f"vram_budget: a float is a fraction of device memory in (0, 1], got "
                                 f"{self.vram_budget!r}; pass bytes as an int or a string like '24GiB'")
        elif self.vram_budget != "auto":
            n = parse_bytes(self.vram_budget, name="vram_budget")
            bare = isinstance(self.vram_budget, int) or not _SIZE_RE.match(self.vram_budget).group(2)
            if bare and n < 2**20:  # a bare number that small is a unit left out (24 for 24 GiB), not a budget
                raise ValueError(f"vram_budget: {self.vram_budget!r} is {n} bytes, less than any model needs: give "
                                 "the unit ('24GiB'), or a float fraction of device memory (0.9)")
        if self.host_arena not in ("auto", None):
            parse_bytes(self.host_arena, name="host_arena")
        if parse_bytes(self.host_arena_slab, name="host_arena_slab") < 2**21:
            raise ValueError("host_arena_slab: slabs smaller than 2 MiB defeat the point of slabs")
        if self.peer not in ("auto", True, False):
            raise ValueError(f"peer: 'auto', True or False, got {self.peer!r}")
        if isinstance(self.gradient_accumulation_steps, bool) or not isinstance(self.gradient_accumulation_steps, int) \
                or self.gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps: an int >= 1 (micro-batches per optimizer step), got "
                             f"{self.gradient_accumulation_steps!r}")
        if self.optimizer_in_backward and self.gradient_accumulation_steps > 1:
            raise ValueError(f"optimizer_in_backward=True applies each update from its gradient in backward, so a step "
                             f"cannot accumulate {self.gradient_accumulation_steps} micro-batches: set "
                             "gradient_accumulation_steps=1 or turn optimizer_in_backward off")
        for name in ("offload_optimizer", "offload_activations", "page_weights", "overlap_step", "recompute",
                     "data_parallel", "expandable_segments", "elide_casts", "fused_loss", "tiled_mlp",
                     "host_embedding"):
            if getattr(self, name) not in ("auto", True, False):
                raise ValueError(f"{name}: 'auto', True or False, got {getattr(self, name)!r}")
        if not isinstance(self.fused_norms, bool):
            raise ValueError(f"fused_norms: True or False, got {self.fused_norms!r}")
        if not isinstance(self.compile_blocks, (bool, str)) or self.compile_blocks == "":
            raise ValueError(f"compile_blocks: True, False or a torch.compile backend name, got "
                             f"{self.compile_blocks!r}")
        if isinstance(self.compile_blocks, str) and self.compile_blocks != "auto":
            import torch._dynamo

            if self.compile_blocks not in torch._dynamo.list_backends(exclude_tags=()):
                raise ValueError(f"compile_blocks: unknown torch.compile backend {self.compile_blocks!r}; choose one "
                                 f"of {', '.join(sorted(torch._dynamo.list_backends(exclude_tags=())))} (or True)")
        if self.grads not in ("auto", "device", "host"):
            raise ValueError(f"grads: 'auto', 'device' or 'host', got {self.grads!r}")
        if not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots: an int >= 1, got {self.slots!r}")
        if not isinstance(self.prefetch, int) or not 0 <= self.prefetch < self.slots:
            raise ValueError(f"prefetch: an int in [0, slots - 1] = [0, {self.slots - 1}], got {self.prefetch!r}")
        if self.batch_shape is not None:
            if len(self.batch_shape) != 2 or any(not isinstance(x, int) or x < 1 for x in self.batch_shape):
                raise ValueError(f"batch_shape: (batch, sequence length) of positive ints, got {self.batch_shape!r}")
            self.batch_shape = tuple(self.batch_shape)
        parse_bytes(self.min_activation_bytes, name="min_activation_bytes")
        if not isinstance(self.min_offload_numel, int) or self.min_offload_numel < 0:
            raise ValueError(f"min_offload_numel: an int >= 0, got {self.min_offload_numel!r}")
        if self.optimizer_moments not in ("float32", "bfloat16"):
            raise ValueError(f"optimizer_moments: 'float32' or 'bfloat16', got {self.optimizer_moments!r}")
        if self.optimizer_resident not in ("auto", True, False):
            raise ValueError(f"optimizer_resident: 'auto', True or False, got {self.optimizer_resident!r}")
        streamed = self.optimizer_streamed
        if not (streamed in ("auto", True, False) or (isinstance(streamed, (int, float)) and
                                                      not isinstance(streamed, bool) and 0 <= streamed <= 1)):
            raise ValueError(f"optimizer_streamed: 'auto', True, False or a fraction in [0, 1], got {streamed!r}")
        if isinstance(self.optimizer_staleness, bool) or self.optimizer_staleness not in (0, 1):
            raise ValueError(f"optimizer_staleness: 0 (exact AdamW) or 1 (the CPU share's update applied one step "
                             f"late), got {self.optimizer_staleness!r}")
        if self.optimizer_staleness and (self.optimizer_in_backward or self.grads == "host"):
            what = "optimizer_in_backward=True" if self.optimizer_in_backward else "grads='host'"
            raise ValueError(f"optimizer_staleness=1 keeps each step's gradients on the device until step() and "
                             f"updates during the next step, but {what} consumes them in backward: use one or the "
                             "other")
        if not isinstance(self.optimizer_in_backward, bool):
            raise ValueError(f"optimizer_in_backward: True or False, got {self.optimizer_in_backward!r}")
        if self.optimizer_in_backward:
            clash = [f"{name}={getattr(self, name)!r}" for name, bad in (
                ("grads", self.grads == "device"), ("overlap_step", self.overlap_step is False),
                ("offload_optimizer", self.offload_optimizer is False)) if bad]
            if clash:
                raise ValueError(f"optimizer_in_backward=True updates offloaded parameters from backward's gradient "
                                 f"hooks on the step's worker thread: it needs host gradients, the overlapped step "
                                 f"and offloaded optimizer state, but {', '.join(clash)}; leave them 'auto' (or "
                                 "grads='host', overlap_step=True, offload_optimizer=True) or turn it off")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# -- options as text: environment variables and command-line arguments -------------------------------------------
ENV_MODES = ("off", "on", "auto")
# TRAINSTREAM_* variables that are not TrainStreamConfig options, and who reads them.
ENV_NOT_OPTIONS = {
    "TRAINSTREAM_TRACE": "the engine (Chrome trace file)", "TRAINSTREAM_CUDA": "setup.py (build switch)",
    "TRAINSTREAM_CPU_ISA": "the native CPU kernels", "TRAINSTREAM_COMMIT": "the benchmarks",
    "TRAINSTREAM_FP8_GEMM": "the native FP8 layer's GEMM, read once (auto, cublaslt or torch; ops.set_fp8_gemm changes "
                            "it at run time)",
    "TRAINSTREAM_FP8_GEMM_TUNE": "the cuBLASLt FP8 GEMM (0: the heuristic's first algorithm, untimed)",
    "TRAINSTREAM_UNSLOTH_SITE": "the benchmark table's Unsloth rows (their own package folder)",
    "TRAINSTREAM_BENCH_MODELS": "the benchmark table (where checkpoints for Unsloth's loader are saved)"}


# Options whose type admits a bool (annotations are strings here: ``from __future__ import annotations``).
_BOOL_OPTIONS = frozenset(f.name for f in fields(TrainStreamConfig) if "bool" in str(f.type))


def parse_value(text: str):
    """An option's text (an environment variable, a command-line argument) as its value: ``true``/``false`` ->
    bool, ``none``/``null``/empty -> None, ``1,2048`` -> a tuple, integers and floats -> numbers, anything else ->
    the text. The one parser of every text route into :class:`TrainStreamConfig`."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null", ""):
        return None
    if "," in text:
        return tuple(parse_value(t) for t in text.split(","))
    for cast in (int, float):
        try:
            return cast(text.strip())
        except ValueError:
            pass
    return text.strip()


def _switch(name: str, value):
    """``1`` / ``0`` as True / False for an option that takes a bool (``TRAINSTREAM_FUSED_NORMS=1``)."""
    if type(value) is int and value in (0, 1) and name in _BOOL_OPTIONS:
        return bool(value)
    return value


def config_from_text(options: dict[str, Any], sources: dict[str, str] | None = None) -> TrainStreamConfig:
    """A :class:`TrainStreamConfig` from option values given as text (parsed by :func:`parse_value`) or as values;
    a bad value is a ValueError whose message starts with where it came from (``sources[name]``, e.g. the variable
    ``TRAINSTREAM_VRAM_BUDGET='x'``, default the option's name)."""
    sources = sources or {}
    values = {k: _switch(k, parse_value(v)) if isinstance(v, str) else v for k, v in options.items()}
    try:
        return TrainStreamConfig(**values)
    except (TypeError, ValueError) as e:
        # TrainStreamConfig's messages start with the field's name: put where the value came from in front.
        name = next((n for n in values if str(e).startswith(f"{n}:")), None)
        where = f"{sources.get(name, name)}={options[name]!r}: " if name else ""
        raise ValueError(f"{where}{e}") from None


def option_names() -> list[str]:
    """The option names: :class:`TrainStreamConfig`'s fields, in order."""
    return [f.name for f in fields(TrainStreamConfig)]


def nearest_option(name: str) -> str | None:
    """The option a misspelt ``name`` most likely meant (one it begins, else the closest), or None."""
    names = option_names()
    near = [n for n in names if n.startswith(name)][:1] or difflib.get_close_matches(name, names, n=1)
    return near[0] if near else None


def env_config(environ=None, *, default: str = "off") -> tuple[str, TrainStreamConfig | None]:
    """``(mode, config)`` from ``TRAINSTREAM`` and ``TRAINSTREAM_<OPTION>`` variables.

    Args:
        environ: the variables (default ``os.environ``).
        default: the mode when ``TRAINSTREAM`` is unset.

    Returns:
        ``mode`` in :data:`ENV_MODES` and a :class:`TrainStreamConfig` (None when the mode is ``off``: the options
        are then not read at all).

    Raises:
        ValueError: ``TRAINSTREAM`` is not one of :data:`ENV_MODES`, a ``TRAINSTREAM_*`` variable names no option,
            or a value is not one the option takes; the message names the variable and the allowed values.
    """
    env = os.environ if environ is None else environ
    raw = env.get("TRAINSTREAM")
    mode = default if raw is None or not raw.strip() else raw.strip().lower()
    if mode not in ENV_MODES:
        raise ValueError(f"TRAINSTREAM={raw!r}: 'auto', 'on' or 'off' ('auto': on when a GPU is present)")
    if mode == "off":
        return mode, None
    names = option_names()
    opts, source = {}, {}
    for key in sorted(env):
        if not key.startswith("TRAINSTREAM_") or key in ENV_NOT_OPTIONS:
            continue
        name = key[len("TRAINSTREAM_"):].lower()
        if name not in names:
            near = nearest_option(name)
            hint = f" (did you mean TRAINSTREAM_{near.upper()}?)" if near else ""
            raise ValueError(f"{key}: unknown trainstream option {name!r}{hint}; the options are "
                             f"{', '.join('TRAINSTREAM_' + n.upper() for n in names)} (and TRAINSTREAM=auto|on|off)")
        opts[name], source[name] = env[key], key
    return mode, config_from_text(opts, source)


def runner_accumulation(own: int, runner, whose: str) -> int:
    """The plan's micro-batches per optimizer step under a runner that decides them (the Trainer, Accelerate): the
    runner's ``gradient_accumulation_steps``; the config's own may only agree with it.

    Raises:
        ValueError: the config sets another count than the runner's.
    """
    runner = max(1, int(runner or 1))
    if own != 1 and own != runner:
        raise ValueError(f"trainstream gradient_accumulation_steps={own} differs from {whose} "
                         f"gradient_accumulation_steps={runner}, which decides the micro-batches per step: leave "
                         "trainstream's unset")
    return runner


DEFAULT_PLANNED_LENGTH = 2048  # tokens per sequence a plan is made for when nothing names the length


def default_batch_shape(model, batch: int = 1, length: int | None = None) -> tuple[int, int]:
    """The (batch, sequence) a plan is made for when ``batch_shape`` is not given: ``batch`` sequences (a runner's
    per-device batch, the DataLoader's), each of the longer of 2048 tokens and ``length`` (a length the runner names:
    TRL's ``max_length``), never past the model's context (``max_position_embeddings`` or ``n_positions``). Not the
    context itself: Llama 3.1's is 131072 tokens, and a plan (and the block measured for it) at that length would
    offload everything, or fail, for batches of a few thousand tokens. A training forward with more tokens than the
    plan's warns when the plan would not hold them (wrap.py, ``Engine._check_tokens``)."""
    cfg = getattr(model, "config", None)
    context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or \
        DEFAULT_PLANNED_LENGTH
    named = length if isinstance(length, int) and length > 0 else 0
    return int(batch), min(int(context), max(DEFAULT_PLANNED_LENGTH, named))
