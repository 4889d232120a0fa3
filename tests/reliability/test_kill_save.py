"""A Trainer run killed (SIGKILL) at any point, saves included, resumes from its last complete checkpoint and finishes
as the uninterrupted run does; a checkpoint-* folder is never incomplete. A train() that fails leaves nothing installed.

The run the test kills (:func:`child_run`, each in a process of its own) is a TrainStreamTrainer with paged trainable
weights saving every step, resuming from the last checkpoint in its folder when there is one."""
import hashlib
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import trainstream_hf as ts
from trainstream_hf.integrations.transformers import STAGING_PREFIX, TrainStreamTrainer, TrainStreamTrainingArguments
from tiny import tiny_llama, token_rows
from tests.helpers import WarmProcess

MAX_STEPS = 24
# what a complete checkpoint of the run holds
FILES = {"config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
         "training_args.bin"}


def _model():
    return tiny_llama()


def _data():
    return token_rows(4 * MAX_STEPS)


def _args(out, **kw):
    return TrainStreamTrainingArguments(
        output_dir=str(out), trainstream="on", trainstream_page_weights="true", trainstream_offload_optimizer="true",
        trainstream_min_offload_numel=0, trainstream_vram_budget="64GiB", per_device_train_batch_size=4,
        learning_rate=1e-2, weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, **kw)


class _KillingTrainer(TrainStreamTrainer):
    """SIGKILLs its own process while writing checkpoint ``kill_at[0]``, right after part ``kill_at[1]`` of it
    (model / optimizer / rng; the trainer state is written last), or (``rotation``) once that checkpoint is in place,
    while save_total_limit's rotation deletes the oldest one."""

    kill_at: tuple[int, str] | None = None

    def _kill(self, part: str) -> None:
        if self.kill_at == (self.state.global_step, part):
            os.kill(os.getpid(), signal.SIGKILL)

    def save_model(self, *args, **kwargs):
        super().save_model(*args, **kwargs)
        self._kill("model")

    def _save_optimizer_and_scheduler(self, output_dir):
        super()._save_optimizer_and_scheduler(output_dir)
        self._kill("optimizer")

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        self._kill("rng")


def train_run(out, kill_at=None) -> dict:
    """The run: from the last checkpoint in ``out`` if any, to MAX_STEPS. Returns the losses by step and a digest of
    the final weights."""
    model = _model()
    trainer = _KillingTrainer(model=model, args=_args(out, max_steps=MAX_STEPS, save_strategy="steps", save_steps=1,
                                                      save_total_limit=3), train_dataset=_data())
    trainer.kill_at = kill_at
    if kill_at is not None and kill_at[1] == "rotation":
        rmtree = shutil.rmtree

        def rmtree_then_kill(path, *args, **kwargs):
            if f"{STAGING_PREFIX}removed-" in str(path) and os.path.isdir(path) and \
                    trainer.state.global_step == kill_at[0]:
                os.kill(os.getpid(), signal.SIGKILL)
            return rmtree(path, *args, **kwargs)
        shutil.rmtree = rmtree_then_kill
    resume = os.path.isdir(out) and get_last_checkpoint(out) is not None
    trainer.train(resume_from_checkpoint=resume or None)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "global_step": trainer.state.global_step, "weights": digest.hexdigest(), "resumed": resume}


def _child(out: Path, log: Path, kill_at=None) -> WarmProcess:
    """The run in a process of its own (forked with its modules imported: tests/helpers.py), its output in ``log``
    (a pipe nobody reads while it runs could fill)."""
    return WarmProcess(child_run, str(out), kill_at, log=log, drop_env_prefix="TRAINSTREAM")


def child_run(out: str, kill_at) -> None:
    """What a child runs: :func:`train_run`, its result printed on a ``RESULT`` line."""
    print("RESULT " + json.dumps(train_run(out, kill_at)), flush=True)


def _checkpoints(out: Path) -> dict[int, Path]:
    return {int(p.name.split("-")[1]): p for p in out.glob("checkpoint-*")}


def _check_complete(out: Path) -> int:
    """Every checkpoint-* folder is complete and readable; returns the last step saved (0: none)."""
    from safetensors.torch import load_file

    found = _checkpoints(out)
    for step, folder in found.items():
        assert FILES <= {p.name for p in folder.iterdir()}, f"{folder.name} is incomplete: {sorted(os.listdir(folder))}"
        assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == step
        assert len(load_file(str(folder / "model.safetensors"))) == 1 + 2 * 9 + 1 + 1  # embedding, blocks, norm, head
    last = get_last_checkpoint(str(out)) if out.is_dir() else None
    assert (last is None) == (not found) and (last is None or Path(last) == found[max(found)])
    return max(found, default=0)


def _staging(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob(f"{STAGING_PREFIX}*")) if out.is_dir() else []


def test_killed_anywhere_resumes_from_a_complete_checkpoint(tmp_path):
    """Six runs into one output folder: three killed from inside (while writing a checkpoint: after its model; after
    its optimizer and RNG state, the trainer state not written yet; while save_total_limit deletes the oldest one),
    two from outside (the moment a checkpoint starts being written; a random time later), each resuming where the
    last complete checkpoint left off, and a last one that finishes. Its losses and final weights are the
    uninterrupted run's, bit for bit."""
    rng = random.Random(22)
    out = tmp_path / "run"
    reference = train_run(tmp_path / "reference")
    last, kills = 0, []
    plan = [("inside", "model"), ("outside", "at-save"), ("outside", "random"), ("inside", "rotation"),
            ("inside", "rng")]
    for n, (how, what) in enumerate(plan):
        log = tmp_path / f"run-{n}.log"
        if how == "inside" and what == "rotation":
            # the run saves 4 checkpoints; the 4th one's rotation deletes the oldest of the 4 then kept (limit 3)
            step = last + 4
            oldest = sorted(set(_checkpoints(out)) | {last + 1, last + 2, last + 3})[-3]
            child = _child(out, log, (step, what))
            child.wait(timeout=300)
            assert child.returncode == -signal.SIGKILL, log.read_text()[-3000:]
            # the oldest one was renamed away whole before its deletion began; the newest is in place
            assert step in _checkpoints(out) and oldest not in _checkpoints(out)
            assert _staging(out) == [f"{STAGING_PREFIX}removed-checkpoint-{oldest}"]
        elif how == "inside":
            step = rng.randint(last + 2, last + 3)  # one more checkpoint complete, the next one cut short
            child = _child(out, log, (step, what))
            child.wait(timeout=300)
            assert child.returncode == -signal.SIGKILL, log.read_text()[-3000:]
            # killed while writing `step`: that checkpoint never appears, its staging folder is what is left
            assert step not in _checkpoints(out) and _staging(out) == [f"{STAGING_PREFIX}{step}"]
        else:
            # The staging folder the last run left goes when this one starts training (seen gone long before its
            # first save); a staging folder after that is a checkpoint being written.
            stale = set(_staging(out))
            child = _child(out, log)
            deadline = time.monotonic() + 120
            while child.poll() is None and time.monotonic() < deadline:
                staging = set(_staging(out))
                stale &= staging
                if staging - stale or max(_checkpoints(out), default=0) > last:
                    if what == "random":
                        time.sleep(rng.uniform(0.1, 0.4))  # past that save, into the next steps and saves
                    child.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.0005)
            child.wait(timeout=300)
            assert child.returncode == -signal.SIGKILL, f"the run ended before it was killed: {log.read_text()[-3000:]}"
            what += " (while saving)" if set(_staging(out)) - stale else ""
        now = _check_complete(out)
        assert now >= last  # (a kill during the first steps of a resumed run loses nothing saved)
        kills.append((how, what, now))
        last = now
    assert 0 < last < MAX_STEPS, kills

    log = tmp_path / "run-last.log"
    child = _child(out, log)
    child.wait(timeout=300)
    assert child.returncode == 0, log.read_text()[-3000:]
    result = json.loads([x for x in log.read_text().splitlines() if x.startswith("RESULT ")][-1][7:])
    assert result["resumed"] and result["global_step"] == MAX_STEPS, kills
    assert _check_complete(out) == MAX_STEPS and _staging(out) == []
    # JSON keys are text; the losses of the steps before the resume come from the checkpoint's own history
    assert {int(k): v for k, v in result["losses"].items()} == reference["losses"], kills
    assert result["weights"] == reference["weights"], kills


class _FailAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"failed at step {state.global_step}")


def test_failed_train_leaves_nothing_installed(tmp_path):
    """train() raising at step 2 (here a callback) takes out the engine it installed, whether or not the engine would
    have stayed after a successful train() (trainstream_unwrap_at_end=False), and gives the trainer its optimizer
    back: a second train() starts afresh and unwraps at its end."""
    for unwrap_at_end in (True, False):
        model = _model()
        fail = _FailAt(2)
        trainer = TrainStreamTrainer(model=model, args=_args(tmp_path / str(unwrap_at_end), max_steps=3,
                                                             save_strategy="no"),
                                     train_dataset=_data(), callbacks=[fail], trainstream_unwrap_at_end=unwrap_at_end)
        try:
            trainer.train()
        except RuntimeError as e:
            assert str(e) == "failed at step 2"
        else:
            raise AssertionError("train() did not fail")
        assert ts.engine_of(model) is None
        assert all(type(p) is torch.nn.Parameter and p.numel() > 0 for p in model.parameters())
        assert trainer.optimizer is None and trainer.lr_scheduler is None
        trainer.remove_callback(fail)
        trainer.train()
        assert trainer.state.global_step == 3 and type(trainer.optimizer.optimizer).__name__ == "OffloadedAdamW"
        assert (ts.engine_of(model) is None) == unwrap_at_end
        if not unwrap_at_end:
            ts.unwrap(model)

