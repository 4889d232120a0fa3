"""Supervised fine-tuning of a causal LM on local prompt-completion data, trained through trainstream_hf.wrap.

    python recipes/sft.py --config configs/sft-tiny-cpu.yaml [--train.steps 100 --trainstream.page_weights false ...]
    accelerate launch --config_file configs/accelerate/single_gpu.yaml recipes/sft.py --config configs/<one>.yaml

Builds the model (random weights piece by piece straight where they will live, quantized as built with
``trainstream.quantize``; or a local checkpoint), adds LoRA adapters (``lora.r``), evaluates held-out loss and greedy
exact match, wraps the model and optimizer with trainstream_hf.wrap (the ``trainstream`` section's options), trains
with a plain PyTorch loop (forward under autocast when mixed precision is on, backward, clip, step, schedule),
unwraps, evaluates again (both evaluations see the plain model), prints a summary and writes it to
``<output_dir>/summary.json``. Under ``accelerate launch`` it runs as one process and takes the launch config's
mixed precision (``mixed_precision: auto``). ``python recipes/sft.py --help`` lists every option.
"""
from __future__ import annotations

import shlex
import statistics
import sys
import time
from dataclasses import replace

import datasets
import torch
from tqdm.auto import tqdm
from transformers import get_scheduler

import trainstream_hf
from trainstream_hf.train import data, evaluate, model as models, report
from trainstream_hf.train.config import parse_args, run_cli, to_dict
from trainstream_hf.train.schema import SFTConfig


def main(argv: list[str] | None = None) -> dict:
    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "recipes/sft.py", *argv])
    cfg = parse_args(SFTConfig, argv, description=__doc__)
    # Everything the run reads or writes is checked before the model is built; nothing is written before training
    # ends (then the summary, and the model with save_model, each complete or absent).
    mixed = models.resolve_mixed_precision(cfg.mixed_precision)
    device = models.resolve_device(cfg.device)
    report.check_output_dir(cfg.output_dir)
    datasets.disable_progress_bars()  # one bar: the training loop's
    tokenizer = data.load_tokenizer(cfg.data.tokenizer)
    train_rows = data.tokenize(data.load_examples(cfg.data.train_file), tokenizer, cfg.data.max_length)
    if cfg.data.packing:
        train_rows = data.pack(train_rows, cfg.data.max_length)
    batches = data.batches(train_rows, cfg.train.batch_size, tokenizer.pad_token_id, seed=cfg.seed)
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
    before = evaluate.evaluate(model, tokenizer, test, test_rows, **ev) if cfg.eval.enabled else None

    tc = cfg.train
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tc.lr, betas=tc.betas,
                                  weight_decay=tc.weight_decay)
    if cfg.wrap:
        longest = max(len(r["input_ids"]) for r in train_rows)
        # The base was quantized as it was built (above); wrap places it (device: a model built in host RAM).
        ts_cfg = replace(ts, batch_shape=ts.batch_shape or (tc.batch_size, longest), quantize=None, outliers=0.0,
                         device=ts.device or str(device))
        model, optimizer = trainstream_hf.wrap(model, optimizer, config=ts_cfg)
        tqdm.write(str(model.trainstream_plan))
    scheduler = get_scheduler(tc.scheduler, optimizer, num_warmup_steps=tc.warmup_steps, num_training_steps=tc.steps)
    # The engine's optimizer clips host-resident gradients too; torch's clip_grad_norm_ sees device ones only.
    clip = getattr(optimizer, "clip_grad_norm_", None) or (
        lambda n: torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], n))

    log = report.StepLog(model)
    tokens = 0
    model.train()
    bar = tqdm(range(tc.steps), desc="sft", unit="step", dynamic_ncols=True)
    for step in bar:
        batch = {k: v.to(device) for k, v in next(batches).items()}
        tokens += int(batch["attention_mask"].sum())
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed == "bf16"):
            loss = model(**batch).loss
        loss.backward()
        if tc.max_grad_norm is not None:
            clip(tc.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        log.record(time.perf_counter() - t0, loss.item())  # .item() waits for the step: honest step times
        if (step + 1) % tc.log_every == 0 or step + 1 == tc.steps:
            bar.set_postfix(loss=f"{sum(log.losses[-tc.log_every:]) / len(log.losses[-tc.log_every:]):.3f}",
                            lr=f"{scheduler.get_last_lr()[0]:.1e}")
    bar.close()
    engine = None
    if cfg.wrap:
        engine = {"plan": report.plan_summary(model.trainstream_plan), **log.engine_summary()}
        if cfg.eval.enabled or cfg.save_model:
            # An ordinary model again, every weight on the device (so it must fit there whole).
            model = trainstream_hf.unwrap(model)

    after = evaluate.evaluate(model, tokenizer, test, test_rows, **ev) if cfg.eval.enabled else None
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
        "trainstream": engine,
        "predictions_after": after["predictions"][:cfg.eval.show] if after else [],
    }
    if cfg.save_model:
        models.save_model(model, tokenizer, f"{cfg.output_dir}/model")
    path = report.write_summary(summary, cfg.output_dir)
    for p in summary["predictions_after"]:
        mark = "ok" if p["prediction"] == p["answer"] else f"expected {p['answer']}"
        tqdm.write(f"  {p['prompt']} {p['prediction']}   ({mark})")
    tqdm.write(report.format_summary(summary) + f"\nsummary: {path}")
    return summary


if __name__ == "__main__":
    run_cli(main, "recipes/sft.py")
