"""``QuantLinear``: a frozen linear layer whose weight is held packed in int8, NF4, FP8 or NVFP4."""
from __future__ import annotations

import weakref

import torch
from torch import nn

from trainstream_hf import ops
from trainstream_hf.quant import matmul, outliers as _outliers
from trainstream_hf.quant.formats import QuantFormat, QuantizedTensor, dequantize, get_format, quantize

__all__ = ["QuantLinear", "linear_weight", "PAGED_ATTR"]

# Set (True) on a parameter while the engine's weight pager holds it (engine/weights.py): its storage is then a
# transient device slot. Defined here, below the engine, so that QuantLinear can read it without importing the engine.
PAGED_ATTR = "_trainstream_paged"

_PREFIX = "weight_"  # packed tensors are registered as weight_data, weight_scale, ...


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` of an ``nn.Linear`` or a transformers ``Conv1D`` (GPT-2), weight in (out, in) layout.

    Conv1D stores its weight transposed, (in, out); the returned weight is a transposed view (no copy).

    Raises:
        TypeError: any other module, and a :class:`QuantLinear` (an ``nn.Linear`` without a dense weight).
    """
    if isinstance(module, QuantLinear):  # an nn.Linear whose weight is packed: nothing dense to return
        raise TypeError("expected a dense nn.Linear or transformers' Conv1D, got a QuantLinear (already quantized)")
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if _is_conv1d(module):
        return module.weight.t(), module.bias
    raise TypeError(f"expected nn.Linear or transformers' Conv1D, got {type(module).__name__}")


def _is_conv1d(module: nn.Module) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is a dependency, but a bare-torch model needs none of it
        return False
    return isinstance(module, Conv1D)


class _QuantLinearFunction(torch.autograd.Function):
    """``y = x W_hat^T`` through a :class:`~trainstream_hf.quant.matmul.MatmulPath`; ``dx = path.backward(dy)``.

    The packed tensors are inputs and are saved with ``save_for_backward`` (not on ``ctx``), so saved-tensor hooks
    see them: the engine's pager turns saved views of a paged block's weights into references.
    """

    @staticmethod
    def forward(ctx, x, path, fmt, shape, dtype, k, w_t, *packed):
        q = QuantizedTensor(fmt, shape, dict(zip(fmt.tensor_names, packed)), dtype)
        x2d = x.reshape(-1, shape[1])
        if x2d.shape[0] == 0:
            y = x2d.new_zeros((0, shape[0]))
        elif k and path.quantizes_activations:
            y = _outliers.outlier_matmul(x2d, q, k, path.forward).to(x.dtype)
        else:
            # x itself as the source: the layers that read the same x share its quantization
            # (matmul.quantize_activation); the outlier path above quantizes a modified copy, never shared.
            y = path.forward(x2d, q, x).to(x.dtype)
        ctx.save_for_backward(*packed)
        ctx.meta = (path, fmt, shape, dtype)
        ctx.w_t = w_t  # the layer's kept transposed FP8 codes (not an activation: no saved-tensor hooks), or None
        return y.view(*x.shape[:-1], shape[0])

    @staticmethod
    def backward(ctx, dy):
        matmul.forget_activation()  # the forward is over: no activation quantization is reused into the next step
        path, fmt, shape, dtype = ctx.meta
        dx = None
        if ctx.needs_input_grad[0]:
            # ctx.saved_tensors is read once: under torch.utils.checkpoint (use_reentrant=False) a second read raises.
            q = QuantizedTensor(fmt, shape, dict(zip(fmt.tensor_names, ctx.saved_tensors)), dtype)
            dy2d = dy.reshape(-1, shape[0])
            dx = (path.backward(dy2d, q) if ctx.w_t is None else path.backward(dy2d, q, ctx.w_t))
            dx = dx.view(*dy.shape[:-1], shape[1])
        return (dx, None, None, None, None, None, None) + (None,) * len(fmt.tensor_names)


class QuantLinear(nn.Linear):
    """A frozen linear layer, ``y = x W^T + b``, whose weight is held packed in a :class:`QuantFormat`.

    Storage: the packed tensors of the :class:`QuantizedTensor` are frozen ``nn.Parameter`` s named ``weight_<name>``
    (``weight_data``, ``weight_scale``, ...), so that ``state_dict``, ``.to(device)`` and the engine's weight pager
    handle them as any frozen parameter, as packed bytes. ``weight`` is a property that rebuilds the
    :class:`QuantizedTensor` around them (cheap, no copy); nothing is ever kept dequantized. Casting the module
    (``.to(torch.bfloat16)``, ``.half()``, ``.float()``) casts the bias and changes ``weight.dtype`` but leaves the
    packed tensors' bits alone (float8 codes and float32 scales are floating point, and a cast would destroy them).

    Forward, for activations ``x`` (..., in_features) in float32, bfloat16 or float16: ``y`` has ``x``'s dtype and
    is computed by the matmul path :func:`~trainstream_hf.quant.matmul.select_path` picks for (format, device,
    ``act_quant``); its numerics are documented in :mod:`trainstream_hf.quant.matmul`:

    * weight-only (int8, nf4; fp8 / nvfp4 with ``act_quant=False``): exactly ``F.linear(x, dequantize(W, x.dtype))``;
    * fp8 with ``act_quant=True`` (default on the CPU and on sm_89+ GPUs): W8A8, activations quantized per token to
      E4M3, float32 accumulation; on sm_89+ through ``torch._scaled_mm`` (FP8 tensor cores), whose backward is FP8 too.
      Layers called one after another on the same input tensor (q / k / v, gate / up) quantize it once
      (:func:`~trainstream_hf.quant.matmul.quantize_activation`: same bits, checked against in-place writes);
    * nvfp4 with ``act_quant=True`` (default on the CPU): W4A4, activations quantized to NVFP4, float32 accumulation.

    With ``outliers=p > 0`` and an activation-quantized path, the ``ceil(p * in_features)`` input channels of largest
    ``max |x|`` bypass the activation quantization (:mod:`trainstream_hf.quant.outliers`); weight-only paths compute
    ``x W_hat^T`` at the activation's precision already, and ignore it. The bias is added in ``y``'s dtype.

    Backward: ``dx = dy @ dequantize(W, dy.dtype)`` (straight-through for the activation quantization; the weight is
    decoded again, not saved in 16 bits), except on the FP8 tensor-core path, which quantizes ``dy * s_w`` per token
    to E4M3 and multiplies it with the FP8 codes (:mod:`trainstream_hf.quant.matmul`); no gradient for the weight;
    the bias is frozen unless its ``requires_grad`` is set, then it gets the usual ``sum(dy)``.

    FP8 transpose cache (``fp8_transpose_cache``, on by default): the FP8 tensor-core backward needs the codes
    transposed, (K, N) (Hopper's FP8 GEMMs take both operands K-major), and would otherwise transpose them on every
    backward call. The layer keeps that copy instead, as TransformerEngine does on Hopper: made at the first call
    that needs a backward (grad enabled, ``x.requires_grad``, a call the tensor-core path runs; not while a CUDA
    graph is being captured or under ``torch.compile``), and made again when ``weight_data`` is not the tensor it was
    made from: another storage (a weak reference to it, so a freed storage never matches), data pointer, shape,
    strides, or ``_version`` (every in-place write through the parameter, e.g. ``load_state_dict``, bumps it). Writes
    that bypass the version counter are not seen, as autograd does not see them (through ``weight_data.data``, from
    outside torch): call :meth:`clear_fp8_transpose_cache` after them. Same bytes as the per-call transpose, so the
    same bits. Memory: +1 byte per weight element on the weight's device (the packed FP8 weight's size again) for as
    long as the layer lives; ``fp8_transpose_cache=False`` (or setting the attribute) trades it back for one
    transpose per backward call. Paged weights (the engine's weight pager marks them) get no copy: their storage is a
    device slot that other blocks reuse, so a copy would have to be rebuilt at every visit and would hold device
    memory outside the pager's budget. The outlier route (``outliers > 0``) takes the same kept copy.

    Under ``torch.autocast`` (CPU or CUDA) ``x`` is cast to the autocast dtype first and the layer runs with autocast
    off inside, as ``torch.amp.custom_fwd(cast_inputs=...)`` does (which cannot be used here: it fixes one device
    type at decoration time); ``y`` is in the autocast dtype, as ``nn.Linear``'s would be.

    An ``nn.Linear`` to the libraries that look for one, as bitsandbytes' ``Linear4bit`` is: ``isinstance(layer,
    nn.Linear)`` holds, so PEFT's ``target_modules="all-linear"`` selects it and PEFT's default LoRA dispatch wraps
    it; it runs ``nn.Module.__init__``, not ``nn.Linear``'s, so it never holds a dense weight. What they read:
    ``in_features``, ``out_features``, ``weight`` (``.shape`` (out, in), ``.device``, ``.dtype`` the logical dtype),
    ``bias``. A PEFT LoRA layer that takes one as its base becomes a
    :class:`~trainstream_hf.integrations.peft.QuantLoraLinear` (:func:`_lora_follows_its_base`). Code that would
    rewrite a dense ``nn.Linear`` weight (``reset_parameters``, transformers' ``_init_weights``) is refused or skipped:
    the packed weight is frozen.

    Args:
        weight: the quantized (out_features, in_features) weight.
        bias: optional (out_features,) bias, kept in its dtype (the tensor is shared, not copied).
        act_quant: quantize activations on the fly (fp8, nvfp4 only). Default (None): decided per device each time
            the layer runs (:func:`~trainstream_hf.quant.matmul.default_act_quant`): False for int8 and nf4
            (weight-only); True for fp8 and nvfp4 on the CPU; on a GPU, True where the format's tensor-core path
            runs (fp8 on sm_89+) and False elsewhere (nvfp4 today: its emulation is float32 matmuls). ``act_quant``
            reads back the value for the weight's current device.
        outliers: fraction of input channels kept out of the activation quantization, in [0, 0.5].
        fp8_transpose_cache: keep the FP8 codes transposed for the tensor-core backward (see above); the attribute of
            that name switches it later (False also frees the copy at the next call).
    """

    # transformers (5.24, 5.25) runs _init_weights over every module of a model whose _is_hf_initialized flag is unset
    # (initialize_weights); as an nn.Linear this layer would get init.normal_(weight), which a packed weight cannot
    # take. It holds its weights by construction.
    _is_hf_initialized = True

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None = None, *, act_quant: bool | None = None,
                 outliers: float = 0.0, fp8_transpose_cache: bool = True) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate and initialise a dense weight
        if not isinstance(weight, QuantizedTensor):
            raise TypeError(f"QuantLinear: weight must be a QuantizedTensor (trainstream_hf.quant.quantize), got "
                            f"{type(weight).__name__}; use QuantLinear.from_linear for an nn.Linear")
        self.fmt: QuantFormat = weight.fmt
        self.out_features, self.in_features = weight.shape
        self.weight_dtype: torch.dtype = weight.dtype
        self.outliers = _outliers.check_outliers(outliers)
        self._act_quant: bool | None = None if act_quant is None else bool(act_quant)
        matmul.select_path(self.fmt, weight.device, self._act_quant)  # raises now for act_quant on int8 / nf4
        self._packed_names = tuple(_PREFIX + n for n in self.fmt.tensor_names)
        # (device, act_quant) -> the path select_path picks: it depends on nothing else, and forward runs per call.
        self._paths: dict[tuple[torch.device, bool | None], matmul.MatmulPath] = {}
        self.fp8_transpose_cache = bool(fp8_transpose_cache)
        # (weak reference to weight_data's storage, (data_ptr, shape, stride, _version), the (K, N) codes) or None
        self._fp8_wt: tuple[weakref.ref, tuple, torch.Tensor] | None = None
        for name in self.fmt.tensor_names:
            self.register_parameter(_PREFIX + name, nn.Parameter(weight.tensors[name], requires_grad=False))
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"QuantLinear: bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
            bias = nn.Parameter(bias.detach(), requires_grad=False)
        self.register_parameter("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Module, fmt: str | QuantFormat, outliers: float = 0.0, *,
                    act_quant: bool | None = None, device: torch.device | str | None = None) -> QuantLinear:
        """Quantizes an ``nn.Linear`` (or a transformers ``Conv1D``, whose (in, out) weight is transposed).

        Args:
            linear: the layer; it is not modified, and its bias tensor is shared.
            fmt: ``"int8"``, ``"nf4"``, ``"fp8"``, ``"nvfp4"`` or a :class:`QuantFormat`.
            outliers: see the class.
            act_quant: see the class.
            device: quantize there (e.g. ``"cuda"`` for a CPU-resident layer), then put the packed weight back
                on the layer's device. Default: where the weight is.

        Returns:
            The :class:`QuantLinear`, on the layer's device, ``weight.dtype`` the layer's weight dtype.

        Raises:
            ValueError: unknown format, in_features not a multiple of the format's block, outliers out of range.
        """
        w, b = linear_weight(linear)
        f = get_format(fmt)
        _outliers.check_outliers(outliers)
        with torch.no_grad():
            src = w.detach() if device is None else w.detach().to(device)
            q = quantize(src, f)
            if q.device != w.device:
                q = q.to(w.device)
        return cls(q, b, act_quant=act_quant, outliers=outliers)

    @property
    def act_quant(self) -> bool:
        """Whether the forward quantizes activations on the weight's current device (the explicit setting, or the
        device's default when it was left None)."""
        if self._act_quant is not None:
            return self._act_quant
        return matmul.default_act_quant(self.fmt, self.weight_data.device)

    @act_quant.setter
    def act_quant(self, value: bool | None) -> None:
        value = None if value is None else bool(value)
        matmul.select_path(self.fmt, self.weight_data.device, value)  # the same check as the constructor
        self._act_quant = value

    @property
    def weight(self) -> QuantizedTensor:
        """The packed weight (a view of this module's ``weight_*`` parameters; nothing is copied or decoded)."""
        return QuantizedTensor(self.fmt, (self.out_features, self.in_features),
                               {n: getattr(self, _PREFIX + n) for n in self.fmt.tensor_names}, self.weight_dtype)

    @weight.setter
    def weight(self, value) -> None:
        raise AttributeError("QuantLinear.weight is a frozen quantized weight and cannot be assigned; build a new "
                             "layer with QuantLinear(quantize(w, fmt), bias) or QuantLinear.from_linear")

    def reset_parameters(self) -> None:
        raise NotImplementedError("QuantLinear: the packed weight is frozen and cannot be re-initialised; build a new "
                                  "layer with QuantLinear.from_linear from an initialised nn.Linear")

    def dequantize_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new (out_features, in_features) tensor of the decoded weight in ``dtype`` (default ``weight.dtype``)."""
        return dequantize(self.weight, self.weight_dtype if dtype is None else dtype)

    def matmul_path(self, device: torch.device | str | None = None) -> matmul.MatmulPath:
        """The path the forward takes on ``device`` (default: where the weight is)."""
        return matmul.select_path(self.fmt, torch.device(device) if device is not None else self.weight_data.device,
                                  self._act_quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in ops.WEIGHT_DTYPES:
            raise TypeError(f"QuantLinear: input must be float32, bfloat16 or float16, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear: input's last dimension must be in_features={self.in_features}, got "
                             f"shape {tuple(x.shape)}")
        device = x.device
        if torch.is_autocast_enabled(device.type):
            x = x.to(torch.get_autocast_dtype(device.type))
            with torch.autocast(device.type, enabled=False):
                return self._forward(x, device)
        return self._forward(x, device)

    def _forward(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        # Runs once per layer call, and on the GPU the host side of a call is about as long as its kernels
        # (benchmarks/NOTES.md, 2026-12-03 H200 quant profile): parameters are read from _parameters
        # (nn.Module.__getattr__ is a slow fallback) and the path is looked up, not selected, after the first call
        # on a device.
        params = self._parameters
        packed = [params[n] for n in self._packed_names]
        if packed[0].device != device:
            raise ValueError(f"QuantLinear: input is on {device} but the weight is on {packed[0].device}")
        path = self._path_on(device)
        k = _outliers.num_outliers(self.outliers, self.in_features) if self.outliers else 0
        y = None
        shape = (self.out_features, self.in_features)
        q = QuantizedTensor(self.fmt, shape, dict(zip(self.fmt.tensor_names, packed)), self.weight_dtype)
        # the kept transposed FP8 codes for this call's backward (None: the backward transposes, or none needed)
        w_t = self._fp8_transposed(packed[0], x, path, q) if path is matmul.FP8_W8A8_SCALED_MM and x.numel() else None
        split = k and path.quantizes_activations
        if path.layer is not None and x.numel() and (not split or path.layer_outliers):
            # A path with its own autograd node in C++ (weight-only and FP8 tensor-core layers, csrc/autograd/): no
            # Python in the backward; the FP8 one takes the kept transposed codes and splits the outlier channels off
            # itself. Other outlier splits and empty inputs take the Python Function below.
            y = path.layer(x, q, w_t, k) if path.layer_outliers else path.layer(x, q)
        if y is None:
            y = _QuantLinearFunction.apply(x, path, self.fmt, shape, self.weight_dtype, k, w_t, *packed)
        bias = params["bias"]
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y

    def _fp8_transposed(self, w: torch.Tensor, x: torch.Tensor, path: matmul.MatmulPath,
                        q: QuantizedTensor) -> torch.Tensor | None:
        """The kept (K, N) copy of the FP8 codes ``w`` for this call's backward (made or made again here), or None
        where the backward should transpose per call (the class docstring's FP8 transpose cache)."""
        if not self.fp8_transpose_cache or getattr(w, PAGED_ATTR, False):
            self._fp8_wt = None  # switched off, or paged since the copy was made: it goes
            return None
        if not (x.requires_grad and torch.is_grad_enabled()):
            return None  # no backward from this call (the copy stays for the next that has one)
        if torch.compiler.is_compiling() or w.is_inference():
            return None
        if not matmul.takes_transposed_weight(path, x.dtype, q):
            return None
        storage = w.untyped_storage()  # the same Python object while the storage lives (torch keeps it)
        key = (w.data_ptr(), w.shape, w.stride(), w._version)
        kept = self._fp8_wt
        if kept is not None and kept[0]() is storage and kept[1] == key:
            return kept[2]
        if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # a copy made now would live in the graph's pool and be written only by its replays
        self._fp8_wt = None  # the stale copy goes before the new one is made
        w_t = ops.transpose_bytes(w)
        self._fp8_wt = (weakref.ref(storage), key, w_t)
        return w_t

    def fp8_transpose_cache_bytes(self, device: torch.device | str | None = None) -> int:
        """Device bytes the FP8 transpose cache holds on ``device`` (default: the weight's) once the layer has run a
        backward there: ``out_features * in_features`` where the cache is on and the layer takes the FP8 tensor-core
        path there (fp8 with ``act_quant`` on sm_89+, both dimensions multiples of 16), else 0. Paged weights hold
        none; the planner counts it for resident blocks."""
        if self.fmt.name != "fp8" or not self.fp8_transpose_cache:
            return 0
        device = torch.device(device) if device is not None else self.weight_data.device
        if self._path_on(device) is not matmul.FP8_W8A8_SCALED_MM:
            return 0
        if self.out_features % 16 or self.in_features % 16:
            return 0
        return self.out_features * self.in_features

    def clear_fp8_transpose_cache(self) -> None:
        """Drops the kept transposed FP8 codes (made again at the next call that needs them). Needed only after a
        write to the weight that its version counter does not see (through ``weight_data.data``, from outside
        torch)."""
        self._fp8_wt = None

    def __getstate__(self):
        # Derived state that copies and pickles of the layer make again: the kept copy (it holds a weak reference,
        # which pickle refuses), and the selected paths (module constants compared by identity, which a deep copy
        # would duplicate).
        state = super().__getstate__()
        state["_fp8_wt"] = None
        state["_paths"] = {}
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("fp8_transpose_cache", True)  # a layer pickled before the cache existed
        self.__dict__.setdefault("_fp8_wt", None)

    def _path_on(self, device: torch.device) -> matmul.MatmulPath:
        """The path for ``device`` and the current ``act_quant``, selected once and then looked up (under torch.compile,
        selected each time: a guard on this layer's own cache would compile every block of a model on its own)."""
        if torch.compiler.is_compiling():
            return matmul.select_path(self.fmt, device, self._act_quant)
        path = self._paths.get((device, self._act_quant))
        if path is None:
            path = self._paths[(device, self._act_quant)] = matmul.select_path(self.fmt, device, self._act_quant)
        return path

    def fused_lora_operands(self, x: torch.Tensor, lora_a: torch.Tensor) -> tuple[list[torch.Tensor], str] | None:
        """``(packed, fmt)`` for :func:`trainstream_hf.ops.lora_dequant_linear` when this layer would run ``x``
        through its native weight-only node (no bias, no activation quantization, a native decoder for the device)
        and the adapter computes in the same dtype as the base (autocast on, or ``x`` in ``lora_a``'s dtype) or the
        node splits float32 adapters over bf16 ``x`` (ops.lora_dequant_linear); else None (the base and the adapter
        then run separately, with PEFT's numbers)."""
        if self.bias is not None or not x.numel() or x.dtype not in ops.WEIGHT_DTYPES:
            return None
        device = x.device
        if not torch.is_autocast_enabled(device.type) and x.dtype != lora_a.dtype and not (
                x.dtype == torch.bfloat16 and lora_a.dtype == torch.float32):
            return None
        path = self._path_on(device)
        decoder = self.fmt.native[1]
        if path is not matmul.DEQUANT or decoder is None or not ops.has_kernel(decoder, device):
            return None
        params = self._parameters
        packed = [params[n] for n in self._packed_names]
        if packed[0].device != device or x.shape[-1] != self.in_features:
            return None  # the plain forward raises the clear error
        return packed, self.fmt.name

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) / .half() / .float() reach every floating tensor through _apply (torch 2.13); the packed
        # float8 codes and float32 scales must keep their dtype and bits. Probe what fn does to a float tensor
        # without copying anything; if it casts, move the packed tensors only, and take the new dtype as the
        # weight's logical dtype. The kept transposed FP8 codes go: they would keep the old device's memory alive until
        # the next call (a move changes the storage, so they would not be used again).
        self._fp8_wt = None
        ref = self.weight_data
        probes = [fn(torch.empty(0, dtype=dt, device=ref.device)) for dt in (torch.float32, torch.float16)]
        cast = next((p.dtype for p, dt in zip(probes, (torch.float32, torch.float16)) if p.dtype != dt), None)
        if cast is None:
            return super()._apply(fn, recurse)
        packed = {id(getattr(self, _PREFIX + n)) for n in self.fmt.tensor_names}
        target = probes[0].device

        def keep_dtype(t):
            return t.to(target) if id(t) in packed else fn(t)

        out = super()._apply(keep_dtype, recurse)
        if cast in ops.WEIGHT_DTYPES:  # .double() casts the bias only: float64 is no dtype to decode the weight to
            self.weight_dtype = cast
        return out

    def extra_repr(self) -> str:
        default = " (device default)" if self._act_quant is None else ""
        cache = f", fp8_transpose_cache={self.fp8_transpose_cache}" if self.fmt.name == "fp8" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt.name}, act_quant={self.act_quant}{default}, outliers={self.outliers}{cache}")


def _lora_follows_its_base(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """Keeps PEFT's LoRA ``Linear`` a :class:`~trainstream_hf.integrations.peft.QuantLoraLinear` exactly while its
    ``base_layer`` is a :class:`QuantLinear` (:func:`~trainstream_hf.integrations.peft.follow_base`).

    A global module-registration hook (torch's public
    ``torch.nn.modules.module.register_module_module_registration_hook``): ``nn.Module.__setattr__`` and
    ``add_module`` call it before storing any child module, so it costs one string comparison per registration.
    Installed here, with the class, so that it is in place wherever a QuantLinear exists however it was imported,
    without importing peft (seconds) at ``import trainstream_hf``: the PEFT integration (a layer above this one) is
    imported here, inside the function, only when a PEFT layer (peft already imported) takes a QuantLinear.
    """
    if name == "base_layer" and (
            isinstance(child, QuantLinear) and type(parent).__module__ == "peft.tuners.lora.layer"
            or type(parent).__module__ == "trainstream_hf.integrations.peft"):
        from trainstream_hf.integrations.peft import follow_base

        follow_base(parent, child)


torch.nn.modules.module.register_module_module_registration_hook(_lora_follows_its_base)
