"""Unsloth's rows of the benchmark table: its own 4-bit loader and LoRA, on the table's seeded weights and batch.

Unsloth (2026.10.9) pins trl <= 1.15, datasets < 5 and transformers <= 5.17, which the test suite's trl and datasets
do not meet, so it lives in a folder of its own (``scripts/unsloth-wheels.sh`` downloads it; ``scripts/gpu_table.sh``
installs it and exports ``TRAINSTREAM_UNSLOTH_SITE``). Only the processes of these rows see it: the table puts the
folder first on their ``PYTHONPATH`` with ``HF_HUB_OFFLINE=1`` (:func:`child_env`).

Unsloth loads from a checkpoint, and must be imported before transformers in its process. So the table's weights
(:func:`trainstream_hf.bench.models.build_model`, the same seeded bf16 model as every other row) are saved once per
shape and seed by a process of their own (:func:`saved_model`; the shipped tokenizer goes with them, for Unsloth's
loader), then loaded with ``FastLanguageModel.from_pretrained(path, load_in_4bit=True, local_files_only=True)``
(bitsandbytes NF4, as the bitsandbytes row quantizes) under the row's VRAM cap. The adapters match the other rows:
r16, alpha 32, no dropout, on every linear layer of the decoder; AdamW (fused, lr 1e-4) on them; the loss is what
Unsloth's model returns for ``labels`` (its fused cross-entropy). ``grad_ckpt=True`` is Unsloth's own checkpointing
(``use_gradient_checkpointing="unsloth"``, activations offloaded to host memory); ``False`` turns it off.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

import torch

from trainstream_hf.bench.harness import default_device, measure_training, not_run

SITE_ENV = "TRAINSTREAM_UNSLOTH_SITE"
MODELS_ENV = "TRAINSTREAM_BENCH_MODELS"
NEEDS_CUDA = "Unsloth needs a CUDA GPU"  # why its rows do not run without one
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(base: Optional[dict] = None) -> dict:
    """The environment of an Unsloth row's process: ``$TRAINSTREAM_UNSLOTH_SITE`` then this package's folder first on
    ``PYTHONPATH``, the Hub offline, Unsloth's compile cache in a temporary folder (not the working directory)."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in (env.get(SITE_ENV), _REPO, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(tempfile.gettempdir(), "trainstream-unsloth-compiled"))
    return env


def model_dir(shape: str, seed: int) -> str:
    """Where the table's weights of ``shape`` and ``seed`` are saved for Unsloth (``$TRAINSTREAM_BENCH_MODELS``,
    default a folder in the temporary directory)."""
    root = os.environ.get(MODELS_ENV) or os.path.join(tempfile.gettempdir(), "trainstream-bench-models")
    return os.path.join(root, f"{shape}-seed{seed}")


def save_model(shape: str, seed: int, path: str) -> None:
    """Builds the table's model (:func:`~trainstream_hf.bench.models.build_model`, bf16, on the GPU when there is one)
    and saves it with the shipped tokenizer to ``path``, through a staging folder renamed at the end (a killed save
    leaves no folder that looks complete)."""
    from transformers import AutoTokenizer

    from trainstream_hf.bench.models import build_model

    model = build_model(shape, torch.bfloat16, default_device(), seed)
    staging = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, max_shard_size="4GB")
    AutoTokenizer.from_pretrained(os.path.join(_REPO, "data", "tokenizer")).save_pretrained(staging)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)


def saved_model(shape: str, seed: int) -> str:
    """The folder of :func:`model_dir`, saved first by a process of its own if it is not there (transformers must not
    be imported before Unsloth in the calling process)."""
    path = model_dir(shape, seed)
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        subprocess.run([sys.executable, "-m", "trainstream_hf.bench.unsloth", "--save", shape, "--seed", str(seed),
                        path], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                            p for p in (_REPO, os.environ.get("PYTHONPATH")) if p)})
    return path


def unsloth_lora(shape: str = "llama3-8b", grad_ckpt: bool = False, *, batch: int = 1, seq: int = 2048,
                 warmup: int = 3, repeats: int = 10, device=None, vram_budget: Optional[int] = None,
                 seed: int = 0) -> dict:
    """Unsloth 4-bit (bitsandbytes NF4 through its loader) + its LoRA r16 on every decoder linear layer.

    Args:
        shape, batch, seq, warmup, repeats, vram_budget, seed: as :func:`trainstream_hf.bench.peers.peft_lora`.
        grad_ckpt: Unsloth's gradient checkpointing (``"unsloth"``: offloaded to host memory); False: none.
        device: must be CUDA (Unsloth's kernels are Triton); default the current GPU.

    Returns:
        The result row (``not run`` when Unsloth is not importable or there is no GPU).
    """
    device = torch.device(device) if device is not None else default_device()
    fields = dict(peer="unsloth", shape=shape, grad_ckpt=grad_ckpt, batch=batch, seq=seq)
    name = f"Unsloth 4-bit + LoRA r16{', its checkpointing' if grad_ckpt else ''}"
    if device.type != "cuda":
        return not_run(name, NEEDS_CUDA, **fields)
    if importlib.util.find_spec("unsloth") is None:
        return not_run(name, f"unsloth is not importable: run scripts/unsloth-wheels.sh, install the folder with "
                             f"pip --target DIR and set {SITE_ENV}=DIR (scripts/gpu_table.sh does both)", **fields)
    path = saved_model(shape, seed)
    import unsloth  # noqa: F401  - before transformers, as Unsloth asks
    from unsloth import FastLanguageModel

    from trainstream_hf.bench.models import make_batch, model_config
    from trainstream_hf.bench.peers import _lora_optimizer, _plain_step

    fields["unsloth"] = unsloth.__version__
    checkpointing = "unsloth" if grad_ckpt else False

    def setup():
        model, _ = FastLanguageModel.from_pretrained(
            path, max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=True, local_files_only=True,
            use_exact_model_name=True, fix_tokenizer=False, use_gradient_checkpointing=checkpointing)
        model = FastLanguageModel.get_peft_model(
            model, r=16, lora_alpha=32, lora_dropout=0.0, bias="none", target_modules=TARGETS,
            use_gradient_checkpointing=checkpointing, random_state=seed)
        FastLanguageModel.for_training(model, use_gradient_checkpointing=checkpointing)
        fields["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        inputs = make_batch(batch, seq, model_config(shape).vocab_size, device, seed)
        return _plain_step(model, _lora_optimizer(model, device), inputs), None

    return measure_training(name, setup, device=device, warmup=warmup, repeats=repeats, vram_budget=vram_budget,
                            tokens=batch * seq, fields=fields)


def main(argv=None) -> None:
    """``--save SHAPE --seed N DIR``: :func:`save_model` (what :func:`saved_model` runs in a process of its own)."""
    parser = argparse.ArgumentParser(prog="python -m trainstream_hf.bench.unsloth")
    parser.add_argument("--save", required=True, metavar="SHAPE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("dir")
    a = parser.parse_args(argv)
    save_model(a.save, a.seed, a.dir)


if __name__ == "__main__":
    main()
