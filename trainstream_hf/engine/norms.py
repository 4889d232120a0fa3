"""Fused RMSNorm for the Llama family's norm modules (``TrainStreamConfig.fused_norms``).

transformers' ``LlamaRMSNorm`` (and the modules copied from it: Mistral, Mixtral, Qwen2, Qwen3, Phi-3, ...) runs eight
ops forward -- an fp32 copy of the input, pow, mean, add, rsqrt, multiply, a copy back, the weight's multiply -- and
about as many backward, each a pass over a (tokens, hidden) activation; a Llama-3-8B step runs 65 of them each way.
:func:`trainstream_hf.ops.rms_norm` does the same maths in one kernel each way (csrc/autograd/rms_norm.cpp), and
saves the input and one float per row instead of an fp32 copy of the input.

Same maths, not the same bits: the row's sum of squares is reduced in another order than torch's ``mean``, so an
output may differ from the module's in the last bit. Hence opt-in. A module is taken only if its class is one of
:data:`CLASSES` and its own forward agrees with the fused op on a probe input (within rounding), so a look-alike
with other maths (Gemma's ``1 + weight``) is left alone; a call whose input dtype differs from the weight's (the
module would promote) runs the module's own forward.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch
from torch import nn

from trainstream_hf import ops

__all__ = ["CLASSES", "FusedNorms"]

# transformers classes with LlamaRMSNorm's forward: weight * to_dtype(x * rsqrt(mean(x^2) + eps)).
CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                     "Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "Phi3RMSNorm", "GraniteRMSNorm", "OlmoeRMSNorm"})


def _agrees(module: nn.Module) -> bool:
    """Whether the module's own forward and the fused op agree on a probe input (within the dtype's rounding)."""
    w = module.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(3, w.shape[0], generator=g) * 3.0).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        want = type(module).forward(module, x)
        got = ops.rms_norm(x, w, float(module.variance_epsilon))
    if want.dtype != got.dtype or want.shape != got.shape:
        return False
    tol = 1e-5 if w.dtype == torch.float32 else 2 ** -6
    scale = want.float().abs().max().clamp_min(1e-6)
    return bool(((got.float() - want.float()).abs().max() / scale) <= tol)


class FusedNorms:
    """Installs the fused forward on the eligible norm modules of some modules; :meth:`uninstall` puts the modules'
    own forwards back."""

    def __init__(self):
        self.modules: list[nn.Module] = []

    def install(self, modules: Iterable[nn.Module]) -> int:
        """Patches every eligible module among ``modules``; returns how many."""
        verdict: dict[type, bool] = {}
        for m in modules:
            cls = type(m)
            w = getattr(m, "weight", None)
            if cls.__name__ not in CLASSES or "forward" in m.__dict__ or not isinstance(w, torch.Tensor) \
                    or w.dim() != 1 or w.is_meta or not hasattr(m, "variance_epsilon") \
                    or not ops.has_kernel("rms_norm_fwd", w.device):
                continue
            if cls not in verdict:
                verdict[cls] = _agrees(m)
                if not verdict[cls]:
                    warnings.warn(f"trainstream_hf: fused_norms: {cls.__name__}'s forward does not match the fused "
                                  "RMSNorm on a probe input; it keeps its own forward", RuntimeWarning, stacklevel=3)
            if verdict[cls]:
                m.forward = _fused_forward(m)
                self.modules.append(m)
        return len(self.modules)

    def uninstall(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)
        self.modules = []


def _fused_forward(module: nn.Module):
    own = type(module).forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if hidden_states.dtype != w.dtype or hidden_states.device != w.device:
            return own(module, hidden_states)  # the module promotes (or raises): its own forward decides
        return ops.rms_norm(hidden_states, w, float(module.variance_epsilon))
    return forward
