"""Ctrl-C stops a wrapped training loop, every time.

A KeyboardInterrupt raised where Python cannot propagate it (a gc callback, a weakref or finalize callback, a
``__del__``) is printed as "Exception ignored in ..." and dropped: the loop goes on as if Ctrl-C had never been
pressed. The engine runs its gc callback during every collection, so a loop that makes garbage used to lose a good
share of its SIGINTs there. The callback is native now (csrc/runtime/gc_pauses.cpp); the tests below check that a
collection, also the one that frees a dropped engine, runs no Python code of ours, and that every SIGINT sent at
a random point stops a real loop.
"""
import gc
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from trainstream_hf.engine.gcstats import GcPauses

WORKER = Path(__file__).resolve().parent / "interrupted_loop.py"
PROCESSES, ROUNDS = 2, 6  # 12 SIGINTs, each at a random point of a busy loop (steps of tens of ms)
STOPS_WITHIN_S = 5.0       # a step of the tiny model takes tens of ms; an interrupt kept waiting this long was lost
START_WITHIN_S = 120.0     # imports and wrap, on a slow shared machine


class _Run:
    """One worker process; its stdout lines arrive in a queue, its stderr is collected."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(WORKER), str(ROUNDS)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        self._err = threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True)
        self._err.start()

    @staticmethod
    def _pump(stream, put):
        for line in stream:
            put(line.rstrip("\n"))
        put(None)  # end of stream

    def wait_for(self, expected: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return False
            if line == expected:
                return True
            if line is None:
                return False
        return False


def _drive(run: _Run, rng: random.Random, lost: list, errors: list) -> None:
    """Sends one SIGINT per round at a random time inside the loop; counts those that did not stop it."""
    try:
        for k in range(ROUNDS):
            if not run.wait_for(f"loop {k}", START_WITHIN_S):
                errors.append(f"round {k} never started (exit code {run.proc.poll()})")
                return
            time.sleep(rng.uniform(0.0, 0.4))
            last = k == ROUNDS - 1
            for attempt in range(10):
                run.proc.send_signal(signal.SIGINT)
                if last:
                    try:
                        run.proc.wait(STOPS_WITHIN_S)
                        stopped = True
                    except subprocess.TimeoutExpired:
                        stopped = False
                else:
                    stopped = run.wait_for(f"stopped {k}", STOPS_WITHIN_S)
                if stopped:
                    break
                lost.append(k)  # this SIGINT was swallowed: send another one so the run can go on
            else:
                errors.append(f"round {k}: 10 SIGINTs did not stop the loop")
                return
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        run.proc.wait()


def test_every_sigint_stops_a_wrapped_training_loop():
    runs = [_Run() for _ in range(PROCESSES)]
    lost: list[int] = []
    errors: list[str] = []
    drivers = [threading.Thread(target=_drive, args=(r, random.Random(i), lost, errors)) for i, r in enumerate(runs)]
    for d in drivers:
        d.start()
    for d in drivers:
        d.join()
    for r in runs:
        r._err.join(10)  # the process has exited: its stderr ends
    stderr = "\n".join("\n".join(line for line in r.stderr if line is not None) for r in runs)
    ignored = [line for line in stderr.splitlines() if "Exception ignored in" in line]
    assert not errors, f"{errors}\n{stderr[-3000:]}"
    assert not lost and not ignored, (
        f"{len(lost)} SIGINTs were swallowed ({len(set(lost))} rounds of {PROCESSES * ROUNDS} needed more than "
        "one); stderr says:\n" + "\n".join(ignored[:5]))
    for r in runs:
        err = "\n".join(line for line in r.stderr if line is not None)
        assert r.proc.returncode != 0 and "Traceback" in err and err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]


def _python_run_by(action) -> list[str]:
    """The Python functions that run during ``action()`` although it calls none itself: gc callbacks, finalizers,
    weakref callbacks. A pending SIGINT is raised in the first of them and dropped."""
    calls: list[str] = []
    own = getattr(action, "__code__", None)  # a lambda's own frame is not one of them

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is not own:
            code = frame.f_code
            calls.append(f"{code.co_qualname} ({code.co_filename}:{code.co_firstlineno})")

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls


def _cycles(n: int) -> list:
    out = []
    for _ in range(n):
        a = []
        a.append(a)
        out.append(a)
    return out


class _Owner:
    pass


def test_the_gc_callback_runs_no_python_code():
    pauses = GcPauses().start()
    automatic = gc.isenabled()
    gc.disable()  # only the collection below is counted
    try:
        gc.collect()  # others' garbage (a generator's close runs Python code) goes first
        garbage = _cycles(50_000)
        del garbage
        pauses.take()
        assert _python_run_by(gc.collect) == []
        stats = pauses.take()
        assert stats["collections"] == [0, 0, 1] and stats["seconds"] > 0, stats
        assert pauses.take() == {"collections": [0, 0, 0], "seconds": 0.0}
        gc.collect(0)
        assert pauses.take()["collections"] == [1, 0, 0]
    finally:
        pauses.stop()
        if automatic:
            gc.enable()
    assert all(cb is not pauses._callback for cb in gc.callbacks)


def test_the_gc_callback_leaves_with_its_owner_running_no_python_code():
    before = list(gc.callbacks)
    owner = _Owner()
    owner.cycle, owner.pauses = owner, GcPauses().start(owner=owner)  # collected by gc, as an engine is
    counter = owner.pauses._callback
    assert gc.callbacks == before + [counter]
    gc.collect()  # others' garbage goes first
    del owner
    assert _python_run_by(gc.collect) == []
    assert gc.callbacks == before


def test_dropping_a_wrapped_model_runs_no_python_code_in_the_collection():
    """A model dropped without unwrap is freed by some later collection, in the middle of whatever step runs then;
    nothing of ours may run Python code there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import trainstream_hf as ts

    torch.manual_seed(0)
    before = len(gc.callbacks)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters()), vram_budget="64GiB", host_arena=None)
    ids = torch.randint(0, 100, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    held = [model, opt]
    del model, opt
    gc.collect()  # what the step left behind, before the drop
    calls = _python_run_by(lambda: (held.clear(), gc.collect()))
    # Once anything in the process has used torch.compile (compile_blocks' tests, in the same pytest run), dynamo
    # tags every new module with a weakref whose callback is Python (torch/_dynamo/mutation_guard.py): torch's, not
    # ours, and present whether or not the model is wrapped.
    calls = [c for c in calls if "/torch/_dynamo/" not in c]
    assert calls == [], calls
    assert len(gc.callbacks) == before
