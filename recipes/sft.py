"""Supervised fine-tuning of a causal LM on local prompt-completion data, trained through trainstream.

    python recipes/sft.py --config configs/sft-tiny-cpu.yaml [--train.steps 100 --trainstream.page_weights false ...]
    python recipes/sft.py --config configs/sft-tiny-cpu.yaml --loop trainer
    accelerate launch --config_file configs/accelerate/single_gpu.yaml recipes/sft.py --config configs/<one>.yaml
    accelerate launch --config_file configs/accelerate/two_gpus.yaml recipes/sft.py --config configs/<one>.yaml

Builds the model (random weights piece by piece straight where they will live, quantized as built with
``trainstream.quantize``; or a local checkpoint), adds LoRA adapters (``lora.r``), evaluates held-out loss and greedy
exact match, then trains with the engine (the ``trainstream`` section's options) in one of two loops (``loop``):
``plain`` wraps the model and optimizer with trainstream_hf.wrap and runs a plain PyTorch loop (forward under autocast
when mixed precision is on, backward, clip, step, schedule); ``trainer`` hands the model to transformers' Trainer as
trainstream_hf.integrations.transformers.TrainStreamTrainer, which installs the engine when it creates its optimizer.
Either loop leaves the engine installed: the model is unwrapped only to be evaluated again or saved (both evaluations
see the plain model), since unwrapping puts every weight on the device. Prints a summary (the same fields for both
loops: per-step losses and wall times, the engine's figures) and writes it to ``<output_dir>/summary.json``, with
its curves (training and held-out loss, exact match, the engine's GB/s per step) in ``<output_dir>/curves.png``.
Under ``accelerate launch`` it takes the launch config's mixed precision (``mixed_precision: auto``). Launched as
several processes (``accelerate launch --num_processes N``, torchrun), either loop trains data parallel
(trainstream_hf/train/processes.py): a replica per GPU, each on its share of the global batch (``train.batch_size``
per process), wrapped by the engine with DistributedDataParallel around it (the plain loop builds it; the Trainer's
Accelerate does, after the engine went in); rank 0 evaluates and writes the summary, which gathers every process's
step times and host memory.
``python recipes/sft.py --help`` lists every option; without ``--config`` it runs configs/sft-tiny-cpu.yaml (the demo)
and says so.
"""
from __future__ import annotations

import shlex
import statistics
import time
from dataclasses import replace
from functools import partial

import datasets
import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback, get_scheduler
from transformers.trainer_callback import ProgressCallback

import trainstream_hf
from trainstream_hf.integrations.transformers import TrainStreamTrainer, TrainStreamTrainingArguments
from trainstream_hf.train import align, data, evaluate, model as models, processes, report
from trainstream_hf.train.config import ConfigError, parse_args, run_cli, to_dict, with_default_config
from trainstream_hf.train.schema import SFTConfig

DEMO = "configs/sft-tiny-cpu.yaml"


def main(argv: list[str] | None = None) -> dict:
    t_start = time.perf_counter()
    argv = with_default_config(argv, DEMO, "recipes/sft.py")
    command = shlex.join(["python", "recipes/sft.py", *argv])
    cfg = parse_args(SFTConfig, argv, description=__doc__)
    # Everything the run reads or writes is checked before the model is built; nothing is written before training
    # ends (then the summary, and the model with save_model, each complete or absent).
    procs = processes.from_environment()
    mixed = models.resolve_mixed_precision(cfg.mixed_precision)
    device = processes.device_for(cfg.device, procs) or models.resolve_device(cfg.device)
    models.cap_vram(cfg.vram_cap, device)
    processes.start(procs, device)
    if cfg.loop == "trainer" and device.type == "cuda" and device.index != 0 and not procs.several:
        # The Trainer trains on the process's first visible GPU (under several processes: on GPU LOCAL_RANK).
        raise ConfigError(f"device={cfg.device!r}: loop 'trainer' trains on cuda:0; pick the GPU with "
                          "CUDA_VISIBLE_DEVICES instead")
    if procs.main:  # the one that writes; a check on every rank would race over the probe's directory
        report.check_output_dir(cfg.output_dir)
    datasets.disable_progress_bars()  # one bar: the training loop's
    tokenizer = data.load_tokenizer(cfg.data.tokenizer)
    train_rows = data.tokenize(data.load_examples(cfg.data.train_file), tokenizer, cfg.data.max_length)
    if cfg.data.packing:
        train_rows = data.pack(train_rows, cfg.data.max_length)
    # Made now so that a batch_size larger than the rows fails here; the trainer loop batches the same rows itself.
    batches = processes.rank_batches(data.batches(train_rows, cfg.train.batch_size, tokenizer.pad_token_id,
                                                  seed=cfg.seed), procs)
    if cfg.eval.enabled:
        test = data.load_examples(cfg.data.test_file, option="data.test_file", limit=cfg.eval.examples)
        test_rows = data.tokenize(test, tokenizer, cfg.data.max_length)
    ts = cfg.trainstream
    home = models.home_device(device, wrap=cfg.wrap, page_weights=ts.page_weights, evaluate=cfg.eval.enabled)
    model = models.build_model(cfg.model, cfg.init, cfg.dtype, vocab_size=len(tokenizer), seed=cfg.seed,
                               device=device, home=home, quantize=ts.quantize, outliers=ts.outliers)
    if cfg.lora.r is not None:
        model = models.add_lora(model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                                target_modules=cfg.lora.target_modules)
    counts = models.count_parameters(model)
    ev = dict(batch_size=cfg.eval.batch_size, max_new_tokens=cfg.eval.max_new_tokens, device=device)
    evaluating = cfg.eval.enabled and procs.main  # the replicas are equal: rank 0 evaluates for all
    before = evaluate.evaluate(model, tokenizer, test, test_rows, **ev) if evaluating else None

    tc = cfg.train
    ts_cfg = None
    if cfg.wrap:
        longest = max(len(r["input_ids"]) for r in train_rows)
        # The base was quantized as it was built (above; wrap finds it packed in that format and leaves it); wrap
        # places it (device: a model built in host RAM).
        ts_cfg = replace(ts, batch_shape=ts.batch_shape or (tc.batch_size, longest), device=ts.device or str(device))
    if cfg.loop == "plain":
        model, log, tokens = train_plain(model, batches, tc, ts_cfg, device, mixed, procs)
    else:
        model, log, tokens = train_with_trainer(model, train_rows, tokenizer.pad_token_id, tc, ts_cfg, device,
                                                mixed, seed=cfg.seed, show=procs.main)
    engine = None
    # Every process's figures, taken while the engine still holds its host memory (rank 0 reports them all).
    mine = {"rank": procs.rank, "device": str(device), "median_step_seconds": statistics.median(log.seconds),
            "trainable_checksum": processes.trainable_checksum(model), **processes.host_memory()}
    if cfg.wrap:
        engine = {"plan": report.plan_summary(model.trainstream_plan), **log.engine_summary()}
        mine["host_shared_bytes"] = log.engine[-1].get("host_shared_bytes", 0) if log.engine else 0
    per_process = processes.gather(mine, procs)
    if cfg.loop == "plain":  # the Trainer counts every process's tokens already (num_input_tokens_seen)
        tokens = processes.total(tokens, procs, device)
    if cfg.wrap and (cfg.eval.enabled or cfg.save_model) and procs.main:
        # An ordinary model again, every weight on the device (so it must fit there whole).
        model = trainstream_hf.unwrap(model)
    if not procs.main:
        model = None  # this replica (and what holds the process group through it) goes before the group does
    processes.finish(procs)
    if not procs.main:
        return {"rank": procs.rank, "losses": log.losses, **mine}

    after = evaluate.evaluate(model, tokenizer, test, test_rows, **ev) if evaluating else None
    train_seconds = sum(log.seconds)
    summary = {
        "recipe": "sft", **report.run_info(device, command), "config": to_dict(cfg),
        "model": {"type": model.config.model_type, **counts, "dtype": cfg.dtype, "quantize": ts.quantize,
                  "lora_r": cfg.lora.r},
        "mixed_precision": mixed,
        "steps": tc.steps,
        "loss": {"before": before["loss"], "after": after["loss"]} if after else None,
        "exact_match": {"before": before["exact_match"], "after": after["exact_match"], "total": after["total"],
                        "correct_before": before["correct"], "correct_after": after["correct"]} if after else None,
        "train_loss": {"first": log.losses[0], "last": log.losses[-1], "curve": log.loss_curve(tc.log_every)},
        "timing": {"train_seconds": train_seconds, "median_step_seconds": statistics.median(log.seconds),
                   "tokens_per_second": tokens / train_seconds, "wall_seconds": time.perf_counter() - t_start},
        "peak_memory": report.peak_memory(device),
        "processes": {"world": procs.world, "per_process": per_process,
                      "host_pss_bytes": sum(p.get("pss_bytes", 0) for p in per_process)},
        "trainstream": engine,
        "predictions_after": after["predictions"][:cfg.eval.show] if after else [],
    }
    losses, metrics = {"training": list(enumerate(log.losses, 1))}, {}
    if after:
        losses["held-out, per completion token"] = report.endpoints(before["loss"], after["loss"], tc.steps)
        metrics["held-out exact match"] = report.endpoints(before["exact_match"], after["exact_match"], tc.steps)
    png = report.write_curves(cfg.output_dir, f"recipes/sft.py: {tc.steps} steps on {device}", losses, metrics,
                              log.engine)
    summary["curves"] = png.name
    if cfg.save_model:
        models.save_model(model, tokenizer, f"{cfg.output_dir}/model")
    path = report.write_summary(summary, cfg.output_dir)
    for p in summary["predictions_after"]:
        mark = "ok" if p["prediction"] == p["answer"] else f"expected {p['answer']}"
        tqdm.write(f"  {p['prompt']} {p['prediction']}   ({mark})")
    tqdm.write(report.format_summary(summary) + f"\nsummary: {path}\ncurves: {png}")
    return summary


def train_plain(model, batches, tc, ts_cfg, device: torch.device, mixed: str,
                procs: processes.Processes = processes.Processes()):
    """``tc.steps`` steps of a plain PyTorch loop with a torch AdamW, both wrapped by trainstream_hf.wrap with
    ``ts_cfg`` (None: not wrapped, the baseline). Under several processes (``procs``) DistributedDataParallel goes
    around the wrapped model and the logged loss is the processes' mean.

    Returns:
        The model (still wrapped; never the DDP wrapper), its :class:`report.StepLog` and the number of tokens this
        process trained on.
    """
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tc.lr, betas=tc.betas,
                                  weight_decay=tc.weight_decay)
    def autocast():  # the loop's forward precision
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed == "bf16")

    if ts_cfg is not None:
        # under the loop's autocast: the plan measures a block as the loop runs it (docs/architecture.md)
        with autocast():
            model, optimizer = trainstream_hf.wrap(model, optimizer, config=ts_cfg)
        if procs.main:
            tqdm.write(str(model.trainstream_plan))
    forward = model
    if procs.several:  # wrap first, then DDP (engine/distributed.py)
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    scheduler = get_scheduler(tc.scheduler, optimizer, num_warmup_steps=tc.warmup_steps, num_training_steps=tc.steps)
    # The engine's optimizer clips host-resident gradients too; torch's clip_grad_norm_ sees device ones only.
    clip = getattr(optimizer, "clip_grad_norm_", None) or (
        lambda n: torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], n))

    log = report.StepLog(model)
    tokens = 0
    model.train()
    bar = tqdm(range(tc.steps), desc="sft", unit="step", dynamic_ncols=True, disable=not procs.main)
    for step in bar:
        batch = {k: v.to(device) for k, v in next(batches).items()}
        tokens += int(batch["attention_mask"].sum())
        t0 = time.perf_counter()
        with autocast():
            loss = forward(**batch).loss
        loss.backward()
        if tc.max_grad_norm is not None:
            clip(tc.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        value = loss.item()  # waits for the step: honest step times
        seconds = time.perf_counter() - t0
        log.record(seconds, processes.mean(value, procs, device) if procs.several else value)
        if (step + 1) % tc.log_every == 0 or step + 1 == tc.steps:
            bar.set_postfix(loss=f"{sum(log.losses[-tc.log_every:]) / len(log.losses[-tc.log_every:]):.3f}",
                            lr=f"{scheduler.get_last_lr()[0]:.1e}")
    bar.close()
    return model, log, tokens


class _RecipePlacedArguments(TrainStreamTrainingArguments):
    """The model is already where the recipe built it (``models.home_device``): on the device, or in host RAM for
    the engine to place block by block, as wrap does in the plain loop. The Trainer's own move of the whole model
    (which TrainStreamTrainer skips only when the model outgrows the device's free memory, not the engine's budget)
    would put a paged model on the GPU whole first."""

    @property
    def place_model_on_device(self) -> bool:
        return False


class _StepLogCallback(TrainerCallback):
    """Fills the plain loop's :class:`report.StepLog` from the Trainer: each optimizer step's wall time
    (``on_step_begin`` to ``on_step_end``, the device synchronised at both ends so that the time is the step's own)
    and its loss from the log the Trainer writes right after the step (``logging_steps=1``). Shows the engine's plan
    and a progress bar as the plain loop does."""

    def __init__(self, log: report.StepLog, device: torch.device, log_every: int, show: bool = True):
        self.log, self.device, self.log_every, self.show = log, device, log_every, show
        self.bar = None
        self._t0 = self._seconds = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        engine = trainstream_hf.engine_of(model) if model is not None else None
        if engine is not None and self.show:
            tqdm.write(str(engine.plan))
        self.bar = tqdm(total=state.max_steps, desc="sft", unit="step", dynamic_ncols=True, disable=not self.show)

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self._seconds = time.perf_counter() - self._t0
        self.bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in (logs or {}):
            return  # the end-of-training log (train_loss, runtime)
        self.log.record(self._seconds, logs["loss"])
        if state.global_step % self.log_every == 0 or state.global_step == state.max_steps:
            recent = self.log.losses[-self.log_every:]
            self.bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", lr=f"{logs['learning_rate']:.1e}")

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def train_with_trainer(model, rows, pad_id: int, tc, ts_cfg, device: torch.device, mixed: str, *, seed: int,
                       show: bool = True):
    """``tc.steps`` steps of transformers' Trainer as TrainStreamTrainer, with the engine's ``ts_cfg`` (None: no
    engine, the baseline) installed when the Trainer creates its optimizer and left installed after training. Under
    several processes the Trainer (Accelerate) builds DDP around the model after the engine went in (the optimizer,
    hence the engine, comes before ``accelerator.prepare``) and gives each process its share of the data; ``show``:
    this process prints the plan and the bar.

    Args:
        rows: the tokenized training sequences, batched as :func:`data.batches` batches them (right-padded, every
            step ``tc.batch_size`` of them: the last partial batch of an epoch is dropped), in the Trainer's own
            seeded order.

    Returns:
        The model (still wrapped), its :class:`report.StepLog` and the number of tokens trained on (by every
        process: the Trainer sums them).
    """
    log = report.StepLog(model)
    # The Trainer's output_dir is a scratch directory, removed afterwards: the run writes only its own output_dir,
    # and only when it ends.
    with align.workdir() as scratch:
        args = _RecipePlacedArguments(
            output_dir=scratch, trainstream="on" if ts_cfg is not None else "off", max_steps=tc.steps,
            per_device_train_batch_size=tc.batch_size, gradient_accumulation_steps=1, learning_rate=tc.lr,
            adam_beta1=tc.betas[0], adam_beta2=tc.betas[1], weight_decay=tc.weight_decay,
            warmup_steps=tc.warmup_steps, lr_scheduler_type=tc.scheduler, max_grad_norm=tc.max_grad_norm or 0.0,
            # Every step's loss, as the plain loop records it; the bar still shows one every log_every steps.
            logging_steps=1, report_to="none", save_strategy="no", seed=seed, use_cpu=device.type == "cpu",
            bf16=mixed == "bf16", dataloader_drop_last=True, dataloader_num_workers=0, remove_unused_columns=False,
            include_num_input_tokens_seen="non_padding")
        trainer = TrainStreamTrainer(model=model, args=args, train_dataset=rows,
                                     data_collator=partial(data.collate, pad_id=pad_id), trainstream_config=ts_cfg,
                                     trainstream_unwrap_at_end=False)
        trainer.remove_callback(ProgressCallback)  # it prints every log; the bar below shows one every log_every
        trainer.add_callback(_StepLogCallback(log, device, tc.log_every, show))
        trainer.train()
    return model, log, trainer.state.num_input_tokens_seen


if __name__ == "__main__":
    run_cli(main, "recipes/sft.py")
