"""Group relative policy optimisation of LoRA adapters on the prompts of local prompt-completion data, each
completion rewarded against the prompt's reference completion; trained with TRL's GRPOTrainer through trainstream
(trainstream_hf.integrations.trl.TrainStreamGRPOTrainer).

    python recipes/grpo.py --config configs/grpo-tiny-cpu.yaml [--train.steps 100 --grpo.rewards [exact_match] ...]

Each step samples ``grpo.num_generations`` completions of ``train.batch_size / grpo.num_generations`` prompts, scores
them with the ``grpo.rewards`` functions (character overlap, positional agreement, exact match with the answer;
trainstream_hf/train/rewards.py), and pushes the policy towards the completions that beat their group's mean; with
``grpo.beta`` > 0 a KL term holds it near the reference, the same model with its adapters off. Held-out prompts
(``data.test_file``) are completed greedily before and after training and scored by the same rewards and exact
match. With ``wrap`` true the engine (the ``trainstream`` section) is installed for the training steps. Prints a
summary, the mean sampled reward over the steps included, and writes it to ``<output_dir>/summary.json``, with its
curves (training loss, sampled and held-out rewards, the engine's GB/s per step) in ``<output_dir>/curves.png``.
``python recipes/grpo.py --help`` lists every option; without ``--config`` it runs configs/grpo-tiny-cpu.yaml (the
demo) and says so.
"""
from __future__ import annotations

from tqdm.auto import tqdm
from trl import GRPOConfig as TRLGRPOConfig, GRPOTrainer

from trainstream_hf.integrations.trl import TrainStreamGRPOTrainer
from trainstream_hf.train import align, data, evaluate, model as models, report, rewards
from trainstream_hf.train.config import run_cli, with_default_config
from trainstream_hf.train.schema import GRPOConfig

DEMO = "configs/grpo-tiny-cpu.yaml"

SHOWN = {"reward": "reward", "completions/mean_length": "length", "kl": "kl"}


def main(argv: list[str] | None = None) -> dict:
    run = align.setup("grpo", GRPOConfig, with_default_config(argv, DEMO, "recipes/grpo.py"), __doc__)
    cfg, tok, gc = run.cfg, run.tokenizer, run.cfg.grpo
    prompts = data.prompts_with_answers(data.load_examples(cfg.data.train_file))
    longest = data.check_prompt_lengths(prompts["prompt"], tok, gc.max_completion_length, cfg.data.max_length)
    if cfg.eval.enabled:
        test = data.load_examples(cfg.data.test_file, option="data.test_file", limit=cfg.eval.examples)
        data.check_prompt_lengths(test["prompt"], tok, cfg.eval.max_new_tokens, cfg.data.max_length,
                                  option="eval.max_new_tokens")
    model, lora = align.build_policy(run)
    logged = ["reward", *[f"rewards/{name}/mean" for name in gc.rewards], "kl", "completions/mean_length", "loss",
              "entropy"]

    with align.workdir() as scratch:
        args = align.trl_arguments(run, TRLGRPOConfig, scratch, num_generations=gc.num_generations,
                                   max_completion_length=gc.max_completion_length, temperature=gc.temperature,
                                   beta=gc.beta, loss_type=gc.loss_type, scale_rewards=gc.scale_rewards)
        common = dict(model=model, reward_funcs=rewards.reward_functions(gc.rewards), args=args,
                      train_dataset=prompts, processing_class=tok, peft_config=lora)
        if cfg.trainer == "trainstream":
            trainer = TrainStreamGRPOTrainer(
                **common, ref_chunk_tokens=gc.ref_chunk_tokens, generation_cache=gc.generation_cache,
                compiled_generation=gc.compiled_generation,
                trainstream_config=align.engine_config(run, (cfg.train.batch_size,
                                                             longest + gc.max_completion_length)))
        else:  # the stock baseline: TRL's own trainer, reference and generation path
            trainer = GRPOTrainer(**common)
        progress = align.Progress.attach(trainer, "grpo", SHOWN)
        model = trainer.model
        counts = models.count_parameters(model)

        def heldout():
            return evaluate.evaluate_rewards(model, tok, test, gc.rewards, batch_size=cfg.eval.batch_size,
                                             max_new_tokens=cfg.eval.max_new_tokens,
                                             device=run.device) if cfg.eval.enabled else None

        before = heldout()
        trainer.train()  # the engine is installed at its start and taken out at its end
        after = heldout()

    history = trainer.state.log_history
    summary = align.summary(run, "grpo", model, counts, progress, history, {
        "heldout": align.before_after(before, after, "predictions"),
        "train": align.train_curves(history, logged),
        "predictions_after": after["predictions"][:cfg.eval.show] if after else [],
    })
    curves, steps = summary["train"]["curves"], summary["steps"]
    metrics = {"sampled reward (logged)": curves["reward"]}
    if after:
        for name in gc.rewards:
            metrics[f"held-out {name} (greedy)"] = report.endpoints(before["rewards"][name], after["rewards"][name],
                                                                    steps)
        if "exact_match" not in gc.rewards:
            metrics["held-out exact match (greedy)"] = report.endpoints(before["exact_match"], after["exact_match"],
                                                                        steps)
    png = report.write_curves(cfg.output_dir, f"recipes/grpo.py: {steps} steps on {run.device}",
                              {"training (logged)": curves["loss"]}, metrics, [m["last"] for m in progress.moved])
    summary["curves"] = png.name
    if cfg.save_model:
        models.save_model(model, tok, f"{cfg.output_dir}/model")
    path = report.write_summary(summary, cfg.output_dir)
    for p in summary["predictions_after"]:
        tqdm.write(f"  {p['prompt']} {p['prediction']}   (answer {p['answer']})")
    tqdm.write(report.format_grpo_summary(summary) + f"\nsummary: {path}\ncurves: {png}")
    return summary


if __name__ == "__main__":
    run_cli(main, "recipes/grpo.py")
