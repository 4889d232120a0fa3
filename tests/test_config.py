import pytest

from trainstream_hf.config import TrainStreamConfig, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("48GiB", 48 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096),
    (123, 123), ("2kib", 2048), (8.0, 8),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["48 parsecs", "GiB", "-1", -5, 1.5, True, [1], "0.5", "1.5 "])
def test_parse_bytes_rejects(bad):
    with pytest.raises((ValueError, TypeError), match="size"):
        parse_bytes(bad)


@pytest.mark.parametrize("negative", ["-1", "-1GiB", " -0.5 MiB", -5])
def test_a_negative_size_is_called_negative(negative):
    with pytest.raises(ValueError, match="must be >= 0"):
        parse_bytes(negative)


def test_config_defaults_and_dict():
    cfg = TrainStreamConfig()
    assert cfg.host_arena == "auto" and cfg.quantize is None
    assert (cfg.optimizer_resident, cfg.optimizer_streamed) == ("auto", "auto")
    assert TrainStreamConfig(optimizer_streamed=0.25).optimizer_streamed == 0.25
    assert cfg.to_dict()["outliers"] == 0.0


@pytest.mark.parametrize("kwargs,msg", [
    ({"quantize": "int3"}, "unknown format"),
    ({"outliers": 0.7}, r"\[0, 0.5\]"),
    ({"vram_budget": 1.5}, "fraction"),
    ({"vram_budget": "lots"}, "cannot parse"),
    ({"vram_budget": 24}, r"vram_budget: 24 is 24 bytes, less than any model needs: give the unit \('24GiB'\)"),
    ({"vram_budget": "0.5"}, "a byte count must be whole"),
    ({"vram_budget": "24"}, "'24' is 24 bytes"),
    ({"host_arena": "48 GiBs"}, "cannot parse"),
    ({"host_arena_slab": "1MiB"}, "2 MiB"),
    ({"fused_loss": "sometimes"}, "fused_loss"),
    ({"tiled_mlp": 2}, "tiled_mlp"),
    ({"optimizer_resident": "yes"}, "optimizer_resident: 'auto', True or False"),
    ({"optimizer_streamed": 1.5}, r"optimizer_streamed: 'auto', True, False or a fraction in \[0, 1\]"),
    ({"optimizer_streamed": "half"}, "optimizer_streamed"),
    ({"optimizer_moments": "fp8"}, "optimizer_moments: 'float32' or 'bfloat16'"),
])
def test_config_rejects(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        TrainStreamConfig(**kwargs)


def test_every_field_documented():
    from dataclasses import fields
    assert all(f.metadata.get("help") for f in fields(TrainStreamConfig))
