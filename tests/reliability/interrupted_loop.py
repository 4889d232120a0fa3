"""A wrapped tiny Llama training loop under gc pressure, for tests/reliability/test_interrupts.py.

``python interrupted_loop.py ROUNDS``: each round builds and wraps a fresh model, prints ``loop <k>`` once inside
the loop and trains until a KeyboardInterrupt (the test sends SIGINT), then prints ``stopped <k>``. Every round but
the last catches the interrupt and starts the next one; the last lets it end the process, as a user's loop would.
"""
import collections
import gc
import signal
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainstream_hf as ts


def train_until_interrupted(k: int) -> None:
    torch.manual_seed(k)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters()), vram_budget="64GiB", host_arena=None)
    ids = torch.randint(0, 100, (2, 16))
    # Objects in reference cycles that live a few steps (a data pipeline's or a logger's): they reach the older
    # generations, so full collections over the whole heap run every few steps and take about half the loop's time;
    # many SIGINTs arrive during a collection, and are raised in the first Python code that runs after it.
    recent = collections.deque(maxlen=20000)
    # Garbage made before the loop is collected here, not at a random point of it: the previous round's engine
    # (its drop is tested on its own in test_interrupts.py) and the import-time cycles of third-party parsers
    # whose __del__ would drop a SIGINT (regex's Group.__del__, not ours). Every SIGINT then falls into the loop.
    gc.collect()
    print(f"loop {k}", flush=True)
    while True:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        for _ in range(5000):
            a = []
            a.append(a)
            recent.append(a)


def main() -> None:
    # A user's Ctrl-C arrives with Python's default handler, unblocked. A child inherits an ignored SIGINT (then
    # Python installs no handler) and the blocked-signal mask of the thread that started it: say what came in, then
    # start as a shell's child would.
    inherited = (signal.getsignal(signal.SIGINT), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    if inherited != (signal.default_int_handler, False):
        print(f"inherited SIGINT handler {inherited[0]!r}, blocked {inherited[1]}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    torch.set_num_threads(1)
    rounds = int(sys.argv[1])
    for k in range(rounds - 1):
        try:
            train_until_interrupted(k)
        except KeyboardInterrupt:
            print(f"stopped {k}", flush=True)
            # An interrupt raised inside torch.no_grad()'s __enter__ / __exit__ (Python code: set_grad_enabled's
            # __init__ can be interrupted before it sets the mode) leaves grad mode off for the thread; a loop that
            # goes on after Ctrl-C must turn it back on, as a notebook user would (torch's race, not the engine's:
            # 27% of interrupts landing in a bare `with torch.no_grad(): pass` loop leave it off with torch 2.13).
            if not torch.is_grad_enabled():
                print(f"round {k}: the interrupt left grad mode off; turned back on", file=sys.stderr, flush=True)
                torch.set_grad_enabled(True)
    train_until_interrupted(rounds - 1)


if __name__ == "__main__":
    main()
