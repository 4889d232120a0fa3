"""Every config under configs/ loads and validates; the YAML + override loader refuses what it should."""
import dataclasses
import json
import shlex
import typing
from pathlib import Path

import pytest
import yaml

from trainstream_hf.config import TrainStreamConfig
from trainstream_hf.train.config import ConfigError, build, help_text, load, parse_overrides, read_command_comment
from trainstream_hf.train.schema import RECIPES, DPOConfig, GRPOConfig, SFTConfig

ROOT = Path(__file__).resolve().parents[1]
YAMLS = sorted(p for ext in ("*.yaml", "*.yml") for p in (ROOT / "configs").rglob(ext))
MODEL_JSONS = sorted((ROOT / "configs" / "models").glob("*.json"))
# recipe -> (its config class, its tiny CPU config): every recipe has one
TINY = {"sft": (SFTConfig, "sft-tiny-cpu.yaml"), "dpo": (DPOConfig, "dpo-tiny-cpu.yaml"),
        "grpo": (GRPOConfig, "grpo-tiny-cpu.yaml")}


def test_there_are_configs():
    assert set(TINY) == set(RECIPES) and all((ROOT / "recipes" / f"{name}.py").is_file() for name in RECIPES)
    for name, (cls, yaml_name) in TINY.items():
        assert (ROOT / "configs" / yaml_name) in YAMLS and RECIPES[name] is cls
        assert read_command_comment(ROOT / "configs" / yaml_name) == \
            f"python recipes/{name}.py --config configs/{yaml_name}"
    assert (ROOT / "configs" / "accelerate" / "single_gpu.yaml") in YAMLS
    assert (ROOT / "configs" / "accelerate" / "two_gpus.yaml") in YAMLS
    assert MODEL_JSONS


# config -> (model JSON, base format, LoRA rank or None for a full fine-tune): the 24 GiB benchmark set
BENCHMARK_CONFIGS = {
    "llama3-8b-lora-bf16-24gib.yaml": ("llama3-8b", None, 16),
    "llama3-8b-lora-nf4-24gib.yaml": ("llama3-8b", "nf4", 16),
    "llama3-8b-lora-fp8-24gib.yaml": ("llama3-8b", "fp8", 16),
    "llama3-8b-lora-nvfp4-24gib.yaml": ("llama3-8b", "nvfp4", 16),
    "llama3-70b-lora-nf4-24gib.yaml": ("llama3-70b", "nf4", 16),
    "llama3.2-3b-full-24gib.yaml": ("llama3.2-3b", None, None),
    "llama3-8b-full-24gib.yaml": ("llama3-8b", None, None),
}


@pytest.mark.parametrize("name", sorted(BENCHMARK_CONFIGS))
def test_benchmark_configs(name):
    """Each runs under accelerate launch with the stock single-GPU config, random weights of its shape, batch
    1 x 2048 tokens, a 24 GiB budget, bf16 under the launcher's mixed precision."""
    path = ROOT / "configs" / name
    assert read_command_comment(path) == ("accelerate launch --config_file configs/accelerate/single_gpu.yaml "
                                          f"recipes/sft.py --config configs/{name}")
    cfg = load(SFTConfig, path)
    shape, quantize, r = BENCHMARK_CONFIGS[name]
    assert (cfg.model, cfg.init, cfg.dtype, cfg.mixed_precision) == \
        (f"configs/models/{shape}.json", "random", "bfloat16", "auto")
    assert (cfg.trainstream.quantize, cfg.lora.r, cfg.trainstream.vram_budget) == (quantize, r, "24GiB")
    assert (cfg.train.batch_size, cfg.data.max_length, cfg.data.packing) == (1, 2048, True)
    assert cfg.trainstream.batch_shape == (1, 2048) and cfg.wrap and not cfg.eval.enabled
    assert cfg.loop == ("trainer" if shape == "llama3-70b" else "plain")  # issue 5: the 70B nf4 run through Trainer
    if r is not None:
        assert cfg.lora.target_modules == "all-linear"
    if name == "llama3-8b-full-24gib.yaml":  # its state fits a 128 GiB host with bf16 moments only
        assert cfg.trainstream.optimizer_moments == "bfloat16" and cfg.trainstream.offload_optimizer is True


def test_model_jsons_agree_with_the_benchmark_shapes():
    """configs/models/ and trainstream_hf.bench.models.SHAPES describe the same architectures where both have one."""
    from trainstream_hf.bench.models import SHAPES

    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings", "rms_norm_eps")
    checked = 0
    for path in MODEL_JSONS:
        shape = SHAPES.get(path.stem)
        if shape is None:
            continue
        ours = json.loads(path.read_text())
        assert {k: ours[k] for k in keys} == {k: shape[k] for k in keys}, path.name
        assert ours["rope_parameters"]["rope_theta"] == shape["rope_theta"], path.name
        checked += 1
    assert checked >= 2


def _accelerate_config(path: Path, script: str):
    """accelerate's own loader (refuses unknown keys); one host; several processes for the sft recipe only (its plain
    loop trains data parallel, the dpo and grpo recipes in one process)."""
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.num_machines == 1, f"{path}: the recipes train on one host (num_machines: 1)"
    if cfg.num_processes != 1:
        assert script == "recipes/sft.py" and str(cfg.distributed_type).endswith("MULTI_GPU"), \
            f"{path}: only recipes/sft.py trains in several processes, on GPUs (distributed_type: MULTI_GPU)"
    return cfg


def validate_config_file(path: Path, root: Path = ROOT) -> None:
    """Raises (AssertionError, ConfigError, ...) unless ``path`` starts with a comment giving the command that
    runs it and its contents validate against what that command reads it as: a recipe config (``--config
    path``, schema from ``RECIPES``), or an Accelerate config (``--config_file path``, accelerate's own
    loader, which refuses unknown keys). Every file the command or a recipe config names must exist; an Accelerate
    config named by a recipe config's command is validated too."""
    command = read_command_comment(path)
    assert command, f"{path}: the first line must be a comment with the command that runs it"
    words = shlex.split(command)
    scripts = [i for i, w in enumerate(words) if w.startswith("recipes/") and w.endswith(".py")]
    assert scripts, f"{path}: the first-line command {command!r} runs no recipes/<name>.py"
    script = words[scripts[0]]
    assert (root / script).is_file(), f"{path}: the command runs {script}, which does not exist"
    rel = str(path.relative_to(root))
    launcher = words[:scripts[0]]
    args = words[scripts[0] + 1:]
    if "--config_file" in launcher:
        assert launcher[:2] == ["accelerate", "launch"], f"{path}: --config_file belongs to accelerate launch"
        acc = launcher[launcher.index("--config_file") + 1]
        assert (root / acc).is_file(), f"{path}: the command's accelerate config {acc} does not exist"
        _accelerate_config(root / acc, script)
        if acc == rel:  # this file is the accelerate config: the recipe config its command names must exist
            assert "--config" in args and (root / args[args.index("--config") + 1]).is_file(), \
                f"{path}: the command's recipe config does not exist: {command!r}"
            return
    assert "--config" in args and args[args.index("--config") + 1] == rel, \
        f"{path}: the command must pass --config {rel} (or --config_file {rel} to accelerate), got {command!r}"
    name = Path(script).stem
    assert name in RECIPES, f"{path}: no config schema for recipe {name!r} in trainstream_hf.train.schema.RECIPES"
    raw = yaml.safe_load(path.read_text())
    assert isinstance(raw, dict) and raw, f"{path}: empty config"
    i = args.index("--config")
    cfg = load(RECIPES[name], path, parse_overrides(args[:i] + args[i + 2:]))  # unknown keys, bad types raise
    for value in (cfg.model, cfg.data.train_file, cfg.data.test_file, cfg.data.tokenizer):
        assert (root / value).exists(), f"{path}: {value} does not exist"


@pytest.mark.parametrize("path", YAMLS, ids=[str(p.relative_to(ROOT)) for p in YAMLS])
def test_config_validates(path):
    validate_config_file(path)


@pytest.mark.parametrize("name, text, error, match", [
    ("no_comment.yaml", "train:\n  steps: 3\n", AssertionError, "first line must be a comment"),
    ("no_recipe.yaml", "# python train.py --config c/no_recipe.yaml\n", AssertionError, "runs no recipes/"),
    ("other.yaml", "# python recipes/sft.py --config c/else.yaml\ninit: random\n", AssertionError,
     "must pass --config c/other.yaml"),
    ("typo.yaml", "# python recipes/sft.py --config c/typo.yaml\ntrain:\n  stepz: 3\n", ConfigError,
     r"unknown option train\.stepz"),
    ("override.yaml", "# python recipes/sft.py --config c/override.yaml --train.steps x\ninit: random\n",
     ConfigError, r"train\.steps: expected int, got 'x'"),
    ("missing.yaml", "# python recipes/sft.py --config c/missing.yaml\ndata:\n  test_file: nope.jsonl\n",
     AssertionError, "nope.jsonl does not exist"),
    ("acc.yaml", "# accelerate launch --config_file c/acc.yaml recipes/sft.py --config c/x.yaml\n"
     "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_procs: 1\n",
     ValueError, r"unknown keys \(\['num_procs'\]\)"),
    ("multi.yaml", "# accelerate launch --config_file c/multi.yaml recipes/dpo.py --config c/x.yaml\n"
     "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n",
     AssertionError, "only recipes/sft.py trains in several processes"),
    ("multicpu.yaml", "# accelerate launch --config_file c/multicpu.yaml recipes/sft.py --config c/x.yaml\n"
     "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n",
     AssertionError, "only recipes/sft.py trains in several processes, on GPUs"),
    ("launched.yaml", "# accelerate launch --config_file c/none.yaml recipes/sft.py --config c/launched.yaml\n"
     "init: random\n", AssertionError, "accelerate config c/none.yaml does not exist"),
    ("badvalue.yaml", "# python recipes/sft.py --config c/badvalue.yaml\nmixed_precision: fp16\n", ConfigError,
     r"mixed_precision: expected 'auto' \| 'no' \| 'bf16', got 'fp16'"),
    ("badsection.yaml", "# python recipes/sft.py --config c/badsection.yaml\nlora:\n  rank: 16\n", ConfigError,
     r"unknown option lora\.rank; the options of lora are: r, alpha, dropout, target_modules"),
    ("dpo.yaml", "# python recipes/dpo.py --config c/dpo.yaml\ndpo:\n  corruptions: [swap, flip]\n", ConfigError,
     r"dpo\.corruptions\[1\]: expected 'swap' \| 'substitute' \| 'drop' \| 'repeat', got 'flip'"),
    ("dpofull.yaml", "# python recipes/dpo.py --config c/dpofull.yaml\nlora:\n  r: null\n", ConfigError,
     r"lora\.r: null would train every parameter"),
    ("dpopack.yaml", "# python recipes/dpo.py --config c/dpopack.yaml\ndata:\n  packing: true\n", ConfigError,
     r"unknown option data\.packing"),
    ("grpo.yaml", "# python recipes/grpo.py --config c/grpo.yaml --grpo.num_generations 6\ninit: random\n",
     ConfigError, r"train\.batch_size=64 must be a multiple of grpo\.num_generations=6"),
    ("sftgrpo.yaml", "# python recipes/sft.py --config c/sftgrpo.yaml\ngrpo:\n  beta: 0.1\n", ConfigError,
     r"unknown option grpo; the options are: model, init"),
])
def test_config_validation_catches(tmp_path, name, text, error, match):
    """The walk above fails for each kind of broken config (checked on copies in a scratch tree)."""
    (tmp_path / "recipes").mkdir()
    for recipe in RECIPES:
        (tmp_path / "recipes" / f"{recipe}.py").write_text("")
    for rel in ("configs/models/tiny-llama.json", "data/train.jsonl", "data/test.jsonl", "data/tokenizer"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).symlink_to(ROOT / rel)
    (tmp_path / "c").mkdir()
    path = tmp_path / "c" / name
    path.write_text(text)
    with pytest.raises(error, match=match):
        validate_config_file(path, tmp_path)
    if name == "acc.yaml":  # and a valid accelerate config passes once the recipe config it runs exists
        path.write_text(text.replace("num_procs", "num_processes"))
        with pytest.raises(AssertionError, match="recipe config does not exist"):
            validate_config_file(path, tmp_path)
        (tmp_path / "c" / "x.yaml").write_text("# python recipes/sft.py --config c/x.yaml\ninit: random\n")
        validate_config_file(path, tmp_path)


@pytest.mark.parametrize("path", MODEL_JSONS, ids=[p.name for p in MODEL_JSONS])
def test_model_config_builds(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = json.loads(path.read_text())
    config = AutoConfig.for_model(**kwargs)
    for k, v in kwargs.items():
        if k != "model_type":
            assert getattr(config, k) == v, f"{path}: {k} not taken by {type(config).__name__}"
    if getattr(config, "hidden_size", 0) <= 1024:  # small ones: build it
        AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("recipe", sorted(TINY))
def test_tiny_config_matches_the_tokenizer(recipe):
    from trainstream_hf.train.data import load_tokenizer

    cls, name = TINY[recipe]
    cfg = load(cls, ROOT / "configs" / name)
    tok = load_tokenizer(str(ROOT / cfg.data.tokenizer))
    model = json.loads((ROOT / cfg.model).read_text())
    assert len(tok) <= model["vocab_size"]
    assert (model["pad_token_id"], model["bos_token_id"], model["eos_token_id"]) == \
        (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)


# -- the loader ------------------------------------------------------------------------------------------
def _leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _get(obj, dotted):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("recipe", sorted(TINY))
def test_every_field_is_overridable_from_the_command_line(recipe):
    """Each leaf option of each recipe, given on the command line as YAML text of a valid value, lands in the
    config."""
    cls, name = TINY[recipe]
    path = ROOT / "configs" / name
    base = load(cls, path)
    changed = {"model": "elsewhere.json", "init": "pretrained", "dtype": "bfloat16", "device": "cpu", "seed": 7,
               "output_dir": "out", "save_model": True, "wrap": False, "train.betas": [0.8, 0.9],
               "train.scheduler": "cosine", "train.max_grad_norm": None, "trainstream.quantize": "nf4",
               "trainstream.vram_budget": "24GiB", "trainstream.host_arena": "1GiB", "trainstream.peer": False,
               "trainstream.device": "cpu", "trainstream.grads": "host", "trainstream.batch_shape": [2, 8],
               "trainstream.min_activation_bytes": "1MiB", "trainstream.outliers": 0.01,
               "trainstream.prefetch": 0, "trainstream.overlap_step": True, "trainstream.host_arena_slab": "128MiB",
               "trainstream.data_parallel": False, "trainstream.expandable_segments": False,
               "trainstream.elide_casts": False, "trainstream.fused_loss": False, "trainstream.tiled_mlp": True,
               "trainstream.host_embedding": False, "trainstream.optimizer_resident": False,
               "trainstream.optimizer_streamed": 0.25, "trainer": "trl",
               "trainstream.compile_blocks": "auto", "trainstream.optimizer_moments": "bfloat16",
               "vram_cap": "20GiB",
               "mixed_precision": "bf16", "lora.r": 4, "lora.dropout": 0.05,
               "lora.target_modules": ["q_proj", "v_proj"], "dpo.loss_type": "hinge", "dpo.corruptions": ["drop"],
               "grpo.rewards": ["exact_match", "char_position"], "grpo.loss_type": "grpo",
               "grpo.scale_rewards": "none", "grpo.generation_cache": 0.5,
               # grpo: completions per step stay a multiple of the group size
               "train.batch_size": 128 if recipe == "grpo" else base.train.batch_size + 1,
               "grpo.num_generations": 4, "train.weight_decay": 0.05, "loop": "trainer"}
    needs = {"trainstream.quantize": ["--lora.r", "16"]}  # a quantized base is frozen: it takes adapters
    leaves = list(_leaves(cls))
    assert len(leaves) > 30
    for key in leaves:
        old = _get(base, key)
        if key in changed:
            new = changed[key]
        elif isinstance(old, bool):
            new = not old
        elif isinstance(old, int):
            new = old + 1
        elif isinstance(old, float):
            new = old / 2
        elif isinstance(old, str) and key.startswith("data."):
            new = old + ".other"
        else:
            raise AssertionError(f"no test value for {key}={old!r}; add one to `changed`")
        text = yaml.safe_dump(new, default_flow_style=True).strip().removesuffix("...").strip()
        cfg = load(cls, path, parse_overrides([f"--{key}", text] + needs.get(key, [])))
        got = _get(cfg, key)
        assert (list(got) if isinstance(got, tuple) else got) == new, key
        assert got != old, key


def test_override_forms_and_yaml_typing():
    o = parse_overrides(["--train.steps", "5", "--train.lr=3e-4", "--wrap", "false", "--train.betas", "[0.9, 0.95]",
                         "--train.max_grad_norm", "null", "--output_dir=a b"])
    assert o == {"train.steps": 5, "train.lr": "3e-4", "wrap": False, "train.betas": [0.9, 0.95],
                 "train.max_grad_norm": None, "output_dir": "a b"}
    cfg = load(SFTConfig, None, o)
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.betas == (0.9, 0.95) and cfg.train.max_grad_norm is None and cfg.wrap is False
    assert load(SFTConfig, None, {"train.lr": 1}).train.lr == 1.0  # an int where a float is expected
    assert load(SFTConfig, None, {"output_dir": 2024}).output_dir == "2024"  # a number where text is expected
    with pytest.raises(ConfigError, match=r"output_dir: expected str, got 1\.5"):
        load(SFTConfig, None, {"output_dir": 1.5})
    assert isinstance(load(SFTConfig, None, {"trainstream.vram_budget": 0.5}).trainstream, TrainStreamConfig)


@pytest.mark.parametrize("overrides, match", [
    ({"train.stpes": 5}, r"unknown option train\.stpes \(did you mean train\.steps\?\)"),
    ({"bogus": 1}, r"unknown option bogus; the options are: model, init"),
    ({"train.steps": "many"}, r"train\.steps: expected int, got 'many'"),
    ({"train.steps": 2.5}, r"train\.steps: expected int"),
    ({"wrap": "yes please"}, r"wrap: expected bool"),
    ({"init": "zeros"}, r"init: expected 'random' \| 'pretrained', got 'zeros'"),
    ({"train.betas": [0.9]}, r"train\.betas: expected a list \[float, float\]"),
    ({"train": 5}, r"train: a section; give its options as train\.<option> \(steps, batch_size"),
    ({"train.steps.x": 5}, r"train\.steps is a value, not a section"),
    ({"train.steps": 0}, r"train: steps: at least 1"),
    ({"trainstream.grads": "sideways"}, r"trainstream: grads: 'auto', 'device' or 'host', got 'sideways'"),
    ({"loop": "bogus"}, r"loop: expected 'plain' \| 'trainer', got 'bogus'"),
    ({"trainstream.quantize": "int3"}, r"quantize: unknown format 'int3'; choose one of None, 'int8'"),
    ({"trainstream.overlap": True},
     r"unknown option trainstream\.overlap \(did you mean trainstream\.overlap_step\?\); the options of trainstream"),
])
def test_bad_options_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(SFTConfig, None, overrides)


def test_bad_command_lines():
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--train.steps"])
    with pytest.raises(ConfigError, match="expected an option like"):
        parse_overrides(["steps", "5"])
    with pytest.raises(FileNotFoundError, match="no such file"):
        load(SFTConfig, ROOT / "configs" / "missing.yaml")


def test_yaml_with_unknown_key_is_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("# python recipes/sft.py --config c.yaml\ntrain:\n  steps: 3\n  lr_schedule: cosine\n")
    assert read_command_comment(p) == "python recipes/sft.py --config c.yaml"
    with pytest.raises(ConfigError, match=r"unknown option train\.lr_schedule"):
        load(SFTConfig, p)
    p.write_text("- 1\n- 2\n")
    assert read_command_comment(p) is None
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load(SFTConfig, p)


@pytest.mark.parametrize("recipe", sorted(TINY))
def test_help_lists_every_option(recipe):
    cls = TINY[recipe][0]
    text = help_text(cls)
    for key in _leaves(cls):
        assert f"--{key}  (" in text, key
    assert "(int; default 250)" in text and "Optimizer steps." in text
    # defaults as the recipe gives them (dpo and grpo train adapters by default)
    assert f"--lora.r  (int or null; default {None if recipe == 'sft' else 8})" in text


@pytest.mark.parametrize("cls, overrides, match", [
    (DPOConfig, {"dpo.corruptions": ["swap", "flip"]},
     r"dpo\.corruptions\[1\]: expected 'swap' \| 'substitute' \| 'drop' \| 'repeat', got 'flip'"),
    (DPOConfig, {"dpo.corruptions": "swap"}, r"dpo\.corruptions: expected a list"),
    (DPOConfig, {"dpo.corruptions": []}, r"dpo: corruptions: at least one of 'swap', 'substitute', 'drop', 'repeat'"),
    (DPOConfig, {"dpo.loss_type": "ipo"}, r"dpo\.loss_type: expected 'sigmoid' \| 'hinge', got 'ipo'"),
    (DPOConfig, {"dpo.beta": -1}, r"dpo: beta: must be > 0"),
    (DPOConfig, {"lora.r": None}, r"lora\.r: null would train every parameter"),
    (DPOConfig, {"eval.max_new_tokens": 4}, r"unknown option eval\.max_new_tokens; the options of eval are: enabled"),
    (DPOConfig, {"trainstream.quantize": "nf3"}, r"quantize: unknown format 'nf3'"),
    (GRPOConfig, {"grpo.rewards": ["bleu"]},
     r"grpo\.rewards\[0\]: expected 'char_overlap' \| 'char_position' \| 'exact_match', got 'bleu'"),
    (GRPOConfig, {"grpo.rewards": ["exact_match", "exact_match"]}, r"grpo: rewards: each of .* at most once"),
    (GRPOConfig, {"grpo.num_generations": 3}, r"train\.batch_size=64 must be a multiple of grpo\.num_generations=3"),
    (GRPOConfig, {"grpo.beta": -0.1}, r"grpo: beta: must be >= 0"),
    (GRPOConfig, {"grpo.max_completion_length": 0}, r"grpo: max_completion_length and ref_chunk_tokens: at least 1"),
    (GRPOConfig, {"lora.r": None}, r"grpo\.beta=0\.04 needs a reference"),
    (GRPOConfig, {"grpo.num_gens": 4}, r"unknown option grpo\.num_gens \(did you mean grpo\.num_generations\?\)"),
    (SFTConfig, {"dpo.beta": 0.1}, r"unknown option dpo; the options are: model, init"),
])
def test_recipe_sections_are_checked(cls, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(cls, None, overrides)
    assert load(GRPOConfig, None, {"lora.r": None, "grpo.beta": 0}).lora.r is None  # no KL term: a full fine-tune


def test_build_keeps_defaults_for_missing_sections():
    cfg = build(SFTConfig, {"train": {"steps": 3}})
    assert cfg.train.steps == 3 and cfg.train.batch_size == SFTConfig().train.batch_size
    assert cfg.trainstream == TrainStreamConfig()
    assert SFTConfig().train is not SFTConfig().train  # sections are not shared between instances
