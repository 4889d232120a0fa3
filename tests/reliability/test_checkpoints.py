"""Checkpoints of a model whose trainable block weights are paged hold the weights in use at their step, whether the
blocks all fit the device slots or not, and resuming from one reproduces the uninterrupted run bit for bit."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

import trainstream_hf as ts
from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.integrations.transformers import TrainStreamTrainer, TrainStreamTrainingArguments
from tiny import tiny_llama, token_rows

SAVE_STEPS, MAX_STEPS = 5, 10


def _model(layers):
    return tiny_llama(layers)


def _data():
    return token_rows(40)


def _args(out, **kw):
    return TrainStreamTrainingArguments(
        output_dir=str(out), trainstream="on", trainstream_page_weights="true", trainstream_offload_optimizer="true",
        trainstream_min_offload_numel=0, trainstream_vram_budget="64GiB", max_steps=MAX_STEPS,
        save_strategy="steps", save_steps=SAVE_STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
        weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=1.0, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, **kw)


def _config(slots):
    # the TrainingArguments flags have no slots: the engine's config is given whole
    return TrainStreamConfig(page_weights=True, offload_optimizer=True, min_offload_numel=0, vram_budget="64GiB",
                             slots=slots, prefetch=1)


class _InUse(TrainerCallback):
    """The weights in use after each step that saves (the engine's own values: a paged parameter's host copy, which
    the next forward copies to the device; any other parameter's data), and the pager's layout."""

    def __init__(self):
        self.weights, self.layout = {}, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        pager = ts.engine_of(model).pager
        self.layout = (pager.paged_blocks, pager.num_slots)
        if state.global_step % SAVE_STEPS == 0:
            paged = {id(p) for p in pager.paged_parameters()}
            self.weights[state.global_step] = {
                n: (pager.host_tensor(p) if id(p) in paged else p.detach()).clone()
                for n, p in model.named_parameters()}


def _losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.mark.parametrize("layers, slots", [(2, 2), (4, 2)], ids=["blocks-fit-the-slots", "more-blocks-than-slots"])
def test_checkpoints_hold_the_weights_in_use_and_resume_bit_exact(tmp_path, layers, slots):
    in_use = _InUse()
    model = _model(layers)
    full = TrainStreamTrainer(model=model, args=_args(tmp_path / "full"), train_dataset=_data(), callbacks=[in_use],
                              trainstream_config=_config(slots))
    full.train()
    assert in_use.layout == (list(range(layers)), slots)
    for step in (SAVE_STEPS, MAX_STEPS):
        folder = tmp_path / "full" / f"checkpoint-{step}"
        saved = load_file(str(folder / "model.safetensors"))
        assert sorted(saved) == sorted(in_use.weights[step])
        for name, want in in_use.weights[step].items():
            assert saved[name].shape == want.shape and torch.equal(saved[name], want), (step, name)
        assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == step

    resumed_model = _model(layers)
    resumed = TrainStreamTrainer(model=resumed_model, args=_args(tmp_path / "resumed"), train_dataset=_data(),
                                 trainstream_config=_config(slots))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{SAVE_STEPS}"))
    # (the resumed history starts with the checkpoint's own: steps 1 to 5)
    want, got = _losses(full), _losses(resumed)
    assert sorted(got) == sorted(want) == list(range(1, MAX_STEPS + 1))
    assert [got[s] for s in range(SAVE_STEPS + 1, MAX_STEPS + 1)] == \
        [want[s] for s in range(SAVE_STEPS + 1, MAX_STEPS + 1)]  # bit for bit
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name


def test_state_dict_and_load_state_dict_of_a_paged_model(tmp_path):
    """Outside the Trainer: state_dict() gives every paged parameter's current value with a storage of its own (so
    save_pretrained writes them all, none taken for a tied weight); load_state_dict() writes host copies and the
    optimizer's masters, so the next step starts from the loaded weights; a shape that does not fit names the
    parameter and both shapes."""
    model = _model(4)
    reference = _model(4)

    def hooks():
        return [len(d) for m in (model, *model.model.layers) for d in (
            m._state_dict_pre_hooks, m._state_dict_hooks, m._load_state_dict_pre_hooks, m._load_state_dict_post_hooks)]
    before = hooks()
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _config(2))
    pager = ts.engine_of(model).pager
    assert pager.paged_blocks == [0, 1, 2, 3] and pager.num_slots == 2
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    paged = {id(p) for p in pager.paged_parameters()}
    names = {n for n, p in model.named_parameters() if id(p) in paged}
    sd = model.state_dict()
    for n, p in model.named_parameters():
        want = pager.host_tensor(p) if id(p) in paged else p
        assert torch.equal(sd[n], want), n
    starts = [sd[n].untyped_storage().data_ptr() for n in names]
    assert len(set(starts)) == len(starts) and all(sd[n].untyped_storage().nbytes() == sd[n].nbytes for n in names)
    up = model.model.layers[3].mlp.up_proj.weight
    assert model.state_dict(keep_vars=True)["model.layers.3.mlp.up_proj.weight"] is up  # the parameters, as asked

    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(sd) and all(torch.equal(saved[n], sd[n]) for n in sd)

    # load the untrained weights back: the host copies, the forward and the next step all start from them
    start = reference.state_dict()
    result = model.load_state_dict(start)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for n, p in model.named_parameters():
        got = pager.host_tensor(p) if id(p) in paged else p
        assert torch.equal(got, start[n]), n
    assert all(torch.equal(m, start[n]) for n, m in
               ((n, opt.master_params()[p]) for n, p in model.named_parameters() if p in opt.master_params()))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_opt.load_state_dict(opt.state_dict())  # the same moments and step counts
    for m, o in ((model, opt), (reference, ref_opt)):
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        got = pager.host_tensor(p) if id(p) in paged else p
        assert torch.allclose(got, q, rtol=0, atol=1e-6), n

    bad = dict(start)
    bad["model.layers.2.self_attn.q_proj.weight"] = torch.randn(64, 32)
    with pytest.raises(RuntimeError, match=r"size mismatch for model\.layers\.2\.self_attn\.q_proj\.weight: copying a "
                                           r"param with shape torch\.Size\(\[64, 32\]\) from checkpoint, the shape in "
                                           r"current model is torch\.Size\(\[64, 64\]\)"):
        model.load_state_dict(bad)
    partial = {k: v for k, v in start.items() if k != "model.layers.1.mlp.down_proj.weight"}
    assert model.load_state_dict(partial, strict=False).missing_keys == ["model.layers.1.mlp.down_proj.weight"]
    assert hooks() != before
    ts.unwrap(model)
    assert hooks() == before


def test_load_best_model_at_end_with_paged_weights(tmp_path):
    """load_best_model_at_end loads a checkpoint into the wrapped model before the engine comes out: the model ends with
    that checkpoint's weights (not the placeholders' shapes, not the optimizer's last masters written back over them),
    and every trainer_state.json names the best checkpoint in the run directory."""
    model = _model(4)
    # the highest eval loss is "best": the checkpoint of step 5, not the last one
    args = _args(tmp_path, eval_strategy="steps", eval_steps=SAVE_STEPS, load_best_model_at_end=True,
                 metric_for_best_model="eval_loss", greater_is_better=True, per_device_eval_batch_size=4)
    trainer = TrainStreamTrainer(model=model, args=args, train_dataset=_data(), eval_dataset=_data()[:8],
                                 trainstream_config=_config(2))
    trainer.train()
    best = tmp_path / f"checkpoint-{SAVE_STEPS}"
    assert trainer.state.best_model_checkpoint == str(best)
    assert ts.engine_of(model) is None
    saved = load_file(str(best / "model.safetensors"))
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name
    for step in (SAVE_STEPS, MAX_STEPS):
        state = json.loads((tmp_path / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert state["best_model_checkpoint"] == str(best)


@pytest.mark.parametrize("page_weights", [False, True])
def test_load_state_dict_into_a_wrapped_model_is_what_the_next_step_starts_from(page_weights):
    """The optimizer keeps fp32 masters of offloaded parameters: a load_state_dict into the wrapped model (the
    Trainer's load_best_model_at_end) must reach them, or the next step puts the old weights back."""
    model = _model(2)
    model, opt = ts.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), vram_budget="64GiB",
                         offload_optimizer=True, min_offload_numel=0, page_weights=page_weights, host_arena=None)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    step()
    step()
    model.load_state_dict(saved)
    for g in opt.param_groups:
        g["lr"] = 0.0  # the next step changes nothing: it must leave exactly the loaded weights
    step()
    ts.unwrap(model)
    now = model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in saved.items())
