"""Builders and checks that many test files share: seeded random tensors with realistic outliers, bit-for-bit
comparison, tiny transformers models built from configs (no hub) and the token rows they train on.

Import them as ``from tests.helpers import ...`` (the suite runs as ``python -m pytest`` from the repository root).
Every builder is seeded, so a call returns the same values every time; the defaults are the values the tests
used before this module gathered them, and a test that used other values passes them as arguments.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
from torch import nn

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --- exactness -------------------------------------------------------------------------------------------------------

def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as an integer tensor of the same shape and element size.

    ``torch.equal(bits(a), bits(b))`` is bit-for-bit equality: -0.0 differs from 0.0, NaNs with equal payloads are
    equal, and float8 (which has no ``==`` on every device) compares too. Shapes must match as well.
    """
    return t.contiguous().view(_SAME_SIZE_INT[t.element_size()])


def assert_same_bits(a: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | Sequence[torch.Tensor], *,
                     devices: tuple[str, str] | None = None) -> None:
    """Asserts that ``a`` and ``b`` (two tensors, or two equally long sequences of tensors) are bit-for-bit equal,
    with the same dtypes and shapes. A failure names the output, how many elements differ and the first of them.

    Args:
        a: What was computed (a tensor, or a sequence of them, e.g. a quantizer's (data, scale) pair).
        b: What it must equal, in the same form.
        devices: When given, ``(device type of a, device type of b)``, e.g. ``("cuda", "cpu")`` for a kernel checked
            against the CPU path; each pair is compared on the CPU.
    """
    single = isinstance(a, torch.Tensor)
    pairs = [(a, b)] if single else list(zip(a, b, strict=False))
    if not single:
        assert len(a) == len(b), (len(a), len(b))
    for i, (x, y) in enumerate(pairs):
        where = "" if single else f"output {i}: "
        if devices is not None:
            assert (x.device.type, y.device.type) == devices, (where, x.device, y.device, devices)
        assert x.dtype == y.dtype and x.shape == y.shape, (where, x.dtype, y.dtype, x.shape, y.shape)
        x, y = x.cpu(), y.cpu()
        if not torch.equal(bits(x), bits(y)):
            bad = (bits(x) != bits(y)).nonzero()
            first = tuple(bad[0])
            raise AssertionError(f"{where}{bad.shape[0]} of {x.numel()} elements differ, first at "
                                 f"{bad[0].tolist()}: {x[first]} vs {y[first]}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in float64: the error of ``a`` relative to the reference ``b``'s range."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between the parameters of two models of the same architecture."""
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


# --- seeded tensors with outliers ------------------------------------------------------------------------------------

def randn_outliers(shape, seed: int, dtype: torch.dtype = torch.float32, outliers: bool = True) -> torch.Tensor:
    """N(0, 1) with 0.1% of the entries (at least one) scaled 100x, the outliers real weights and activations have.

    Args:
        shape: An int or a tuple.
        seed: Seeds a fresh CPU generator; the result is made on the CPU.
        dtype: The values are drawn in float32, then cast.
        outliers: False gives plain N(0, 1) (the same draws as the first ones with outliers).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if outliers:
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 1000),), generator=g)
        x.view(-1)[idx] *= 100.0
    return x.to(dtype)


def strided_outlier_weight(n: int, k: int, seed: int, every: int = 97, scale: float = 30.0) -> torch.Tensor:
    """An (n, k) N(0, 1) weight whose every ``every``-th element (in row-major order) is scaled ``scale`` times."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w.view(-1)[::every] *= scale
    return w


def outlier_channel_tokens(shape, seed: int, dtype: torch.dtype = torch.float32, zero_token: bool = True
                           ) -> torch.Tensor:
    """N(0, 1) activations with 1% of the channels (the last dimension; at least one) scaled 50x, the outlier
    channels LLM activations have.

    Args:
        shape: (tokens, channels), or any shape whose last dimension is the channels.
        seed: Seeds a fresh CPU generator; the result is made on the CPU.
        dtype: The values are drawn in float32, then cast.
        zero_token: Zero the second row (an all-zero token: a zero scale), where there is more than one.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., torch.randperm(shape[-1], generator=g)[: max(1, shape[-1] // 100)]] *= 50.0
    if zero_token and shape[0] > 1:
        x[1] = 0.0
    return x.to(dtype)


def column_scale(cols: int, seed: int) -> torch.Tensor:
    """A per-column activation scale (as SmoothQuant-style outlier handling makes): positive values spread over six
    decades, 1e-3 to 1e3 from the first column to the last; ``[0.37]`` for a single column."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(cols, generator=g) * torch.logspace(-3, 3, cols) if cols > 1 else torch.tensor([0.37])


def scale_input_channels(model: nn.Module, every: int, factor: float) -> nn.Module:
    """Scales every ``every``-th input channel of each ``nn.Linear`` weight of ``model`` by ``factor``, in place
    (outlier input channels, as trained checkpoints have); returns ``model``."""
    with torch.no_grad():
        for m in model.modules():
            if type(m) is nn.Linear:
                m.weight[:, ::every] *= factor
    return model


# --- tiny models and data --------------------------------------------------------------------------------------------

def tiny_llama(layers: int = 2, *, hidden: int = 64, vocab: int = 100, positions: int | None = 32,
               seed: int | None = 0, dtype: torch.dtype = torch.float32, **config):
    """A tiny ``LlamaForCausalLM`` built from a config (no hub), with the same weights on every call.

    Args:
        layers: Decoder layers.
        hidden: Hidden size; the MLP is twice as wide unless ``intermediate_size`` is given.
        vocab: Vocabulary size.
        positions: ``max_position_embeddings``; None leaves the LlamaConfig default.
        seed: ``torch.manual_seed`` before the weights are drawn; None draws from the global generator as it is.
        dtype: The model's dtype.
        **config: Other ``LlamaConfig`` fields (they override the 4 attention / 2 key-value heads too).

    Returns:
        The model in train mode (as built).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab)
    if positions is not None:
        fields["max_position_embeddings"] = positions
    fields.update(config)
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**fields)).to(dtype)


def step_batch(step: int, b: int = 2, t: int = 16, vocab: int = 128) -> torch.Tensor:
    """The token ids of training micro-batch ``step``: seeded by the step alone, so two runs see the same data."""
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(1000 + step))


def micro_batches(model: nn.Module, step: int, accumulation: int, losses: list) -> None:
    """One optimizer step's forwards and backwards on :func:`step_batch` micro-batches, each loss scaled by
    ``1 / accumulation`` and appended (detached) to ``losses``."""
    for k in range(accumulation):
        ids = step_batch(step * accumulation + k)
        loss = model(input_ids=ids, labels=ids).loss / accumulation
        loss.backward()
        losses.append(loss.detach().clone())


def token_rows(rows: int, vocab: int = 100, length: int = 16, seed: int = 7) -> list[dict]:
    """``rows`` Trainer examples of ``length`` random tokens, labels = inputs; the same on every call."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, vocab, (rows, length), generator=g)]


def randomize_lora_b(model: nn.Module, seed: int = 3, std: float = 0.05) -> None:
    """Non-zero LoRA B (N(0, std), seeded), so that "adapters on" and "adapters off" differ from the first step."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)


# --- recipe outputs --------------------------------------------------------------------------------------------------

def png_panels(run_dir, summary: dict) -> int:
    """The curves PNG that summary.json names, checked to be a drawn PNG; how many panels it has (460 px each)."""
    data = (run_dir / summary["curves"]).read_bytes()
    assert summary["curves"] == "curves.png" and data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert len(data) > 10_000  # drawn, not a blank canvas
    width = struct.unpack(">I", data[16:20])[0]
    assert width % 460 == 0, width
    return width // 460


def cuda_median_ms(fn, warmup: int = 5, repeats: int = 30) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (CUDA events), after ``warmup`` untimed calls."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# --- processes -------------------------------------------------------------------------------------------------------

# The modules a warm process starts with: importing them takes a fresh interpreter ~4-6 s on the 2-core CI machine,
# most of a short child run's time.
WARM_MODULES = ["torch", "transformers", "transformers.trainer", "peft", "trainstream_hf",
                "trainstream_hf.integrations.transformers"]
_warm_context = None


class WarmProcess:
    """``fn(*args)`` in a process forked from a server that imported :data:`WARM_MODULES` once (multiprocessing's
    forkserver: the server never ran a thread or a kernel of torch, so each child starts clean), its stdout and
    stderr in ``log``. The part of ``subprocess.Popen`` the tests use: ``pid``, ``poll()``, ``wait(timeout)``,
    ``send_signal()`` and ``returncode`` (``-signal`` when a signal ended it, 1 on an exception).

    Unlike a fresh interpreter, the child's modules were imported with the environment the server started with;
    ``drop_env_prefix`` removes variables from the child's environment for what reads it after import. ``fn`` must be
    importable by its module's name."""

    def __init__(self, fn, *args, log, drop_env_prefix: str | None = None):
        global _warm_context
        import multiprocessing

        if _warm_context is None:
            _warm_context = multiprocessing.get_context("forkserver")
            _warm_context.set_forkserver_preload(WARM_MODULES)
        self._proc = _warm_context.Process(target=_run_logged, args=(str(log), drop_env_prefix, fn, args))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"WarmProcess({self.pid})", timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        import os

        if self._proc.exitcode is None:
            os.kill(self.pid, sig)


def _run_logged(log: str, drop_env_prefix: str | None, fn, args) -> None:
    import os
    import sys

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if drop_env_prefix:
        for k in [k for k in os.environ if k.startswith(drop_env_prefix)]:
            del os.environ[k]
    torch.set_num_threads(1)  # as the tests run (tests/conftest.py)
    fn(*args)
    sys.stdout.flush()


def run_script(script: str, *args: str, cwd, logs, env: dict | None = None, module: bool = False,
               timeout: float = 300):
    """``python script args...`` (``python -m script args...`` with ``module``) as a user runs it (``__main__``,
    ``sys.argv``, the script's folder first on ``sys.path``, ``cwd``, ``env`` over the environment without the
    ``TRAINSTREAM*`` variables), forked from the warm server (:class:`WarmProcess`) instead of a fresh interpreter: a
    ``subprocess.CompletedProcess`` with its exit status, stdout and stderr (kept in files under ``logs``). Not for
    what happens before torch or transformers are imported (the server imported them)."""
    import subprocess
    from pathlib import Path

    logs = Path(logs)
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / "stdout", logs / "stderr"
    proc = WarmProcess(_run_script, str(out), str(err), str(cwd), script, list(args), dict(env or {}), module,
                       log=logs / "log", drop_env_prefix="TRAINSTREAM")
    code = proc.wait(timeout)
    return subprocess.CompletedProcess([script, *args], code, out.read_text(), err.read_text())


def _run_script(out: str, err: str, cwd: str, script: str, args: list, env: dict, module: bool) -> None:
    import os
    import runpy
    import sys

    for path, fd in ((out, 1), (err, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]  # (run_module puts the module's file first)
    try:
        if module:
            sys.path.insert(0, cwd)
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
