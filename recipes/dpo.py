"""Direct preference optimisation of LoRA adapters on pairs made from local prompt-completion data, trained with TRL's
DPOTrainer through trainstream (trainstream_hf.integrations.trl.TrainStreamDPOTrainer).

    python recipes/dpo.py --config configs/dpo-tiny-cpu.yaml [--train.steps 100 --dpo.beta 0.2 ...]

Makes the pairs at load time (chosen = the completion, rejected = the completion corrupted: a swap, a substitution,
a dropped or a repeated character; ``dpo.corruptions``, seeded), builds the model as sft does and hands it with the
``lora`` section's LoraConfig to the trainer, whose reference is the same model with its adapters off. Scores held-out
pairs (made from ``data.test_file`` the same way) before and after training: the DPO loss, the implicit-reward
accuracy and margin, and how often the policy gives the chosen completion the higher log-probability, per kind of
corruption too. With ``wrap`` true the engine (the ``trainstream`` section) is installed for the training steps.
Prints a summary and writes it to ``<output_dir>/summary.json``, with its curves (training and held-out loss and
reward accuracy, the engine's GB/s per step) in ``<output_dir>/curves.png``. ``python recipes/dpo.py --help`` lists
every option; without ``--config`` it runs configs/dpo-tiny-cpu.yaml (the demo) and says so.
"""
from __future__ import annotations

from tqdm.auto import tqdm
from trl import DPOConfig as TRLDPOConfig, DPOTrainer

from trainstream_hf.integrations.trl import TrainStreamDPOTrainer
from trainstream_hf.train import align, data, evaluate, model as models, report
from trainstream_hf.train.config import run_cli, with_default_config
from trainstream_hf.train.schema import DPOConfig

DEMO = "configs/dpo-tiny-cpu.yaml"

SHOWN = {"loss": "loss", "rewards/accuracies": "acc", "rewards/margins": "margin"}
LOGGED = ["loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
          "logps/rejected"]


def main(argv: list[str] | None = None) -> dict:
    run = align.setup("dpo", DPOConfig, with_default_config(argv, DEMO, "recipes/dpo.py"), __doc__)
    cfg, tok, dc = run.cfg, run.tokenizer, run.cfg.dpo
    examples = data.load_examples(cfg.data.train_file)
    pairs = data.preference_pairs(examples, dc.corruptions, seed=cfg.seed)
    if dc.fill_context:  # every pair at ~data.max_length tokens, for both trainers alike
        pairs = data.fill_context(pairs, examples, tok, cfg.data.max_length)
    chosen, rejected = data.tokenize_pairs(pairs, tok, cfg.data.max_length)  # too long: an error now, not a cut
    if cfg.eval.enabled:
        test = data.load_examples(cfg.data.test_file, option="data.test_file", limit=cfg.eval.examples)
        test_pairs = data.preference_pairs(test, dc.corruptions, seed=cfg.seed + 1, option="data.test_file")
        test_rows = data.tokenize_pairs(test_pairs, tok, cfg.data.max_length)
    model, lora = align.build_policy(run)
    longest = max(len(r["input_ids"]) for r in chosen + rejected)

    with align.workdir() as scratch:
        args = align.trl_arguments(run, TRLDPOConfig, scratch, beta=dc.beta, loss_type=[dc.loss_type],
                                   max_length=cfg.data.max_length)
        common = dict(model=model, args=args, train_dataset=pairs.remove_columns("corruption"), processing_class=tok,
                      peft_config=lora)
        if cfg.trainer == "trainstream":
            trainer = TrainStreamDPOTrainer(
                **common, ref_chunk_tokens=dc.ref_chunk_tokens,
                # one forward scores the chosen and the rejected sequences of a batch together
                trainstream_config=align.engine_config(run, (2 * cfg.train.batch_size, longest)))
        else:  # the stock baseline: TRL's DPOTrainer, ref_model None (the adapters switched off)
            trainer = DPOTrainer(**common, ref_model=None)
        progress = align.Progress.attach(trainer, "dpo", SHOWN)
        model = trainer.model  # the PeftModel
        counts = models.count_parameters(model)

        def heldout():
            return evaluate.preferences(model, test_pairs, *test_rows, beta=dc.beta, loss_type=dc.loss_type,
                                        batch_size=cfg.eval.batch_size, pad_id=tok.pad_token_id, device=run.device,
                                        chunk_tokens=dc.ref_chunk_tokens) if cfg.eval.enabled else None

        before = heldout()
        trainer.train()  # the engine is installed at its start and taken out at its end
        after = heldout()

    history = trainer.state.log_history
    summary = align.summary(run, "dpo", model, counts, progress, history, {
        "pairs": {"train": len(pairs), "heldout": len(test_pairs) if before else 0},
        "heldout": align.before_after(before, after, "pairs"),
        "train": align.train_curves(history, LOGGED),
        "pairs_after": after["pairs"][:cfg.eval.show] if after else [],
    })
    logged, steps = summary["train"]["curves"], summary["steps"]
    losses = {"training (logged)": logged["loss"]}
    metrics = {"training reward accuracy (logged)": logged["rewards/accuracies"]}
    if after:
        losses["held-out pairs"] = report.endpoints(before["loss"], after["loss"], steps)
        metrics["held-out reward accuracy"] = report.endpoints(before["reward_accuracy"], after["reward_accuracy"],
                                                               steps)
    png = report.write_curves(cfg.output_dir, f"recipes/dpo.py: {steps} steps on {run.device}", losses, metrics,
                              [m["last"] for m in progress.moved])
    summary["curves"] = png.name
    if cfg.save_model:
        models.save_model(model, tok, f"{cfg.output_dir}/model")
    path = report.write_summary(summary, cfg.output_dir)
    for p in summary["pairs_after"]:
        tqdm.write(f"  {p['prompt']} {p['chosen']} over {p['rejected']} ({p['corruption']}): reward margin "
                   f"{p['reward_margin']:+.3f}, log-probs {p['logp_chosen']:.2f} / {p['logp_rejected']:.2f}")
    tqdm.write(report.format_dpo_summary(summary) + f"\nsummary: {path}\ncurves: {png}")
    return summary


if __name__ == "__main__":
    run_cli(main, "recipes/dpo.py")
