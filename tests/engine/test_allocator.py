"""engine/allocator: when wrap() switches the CUDA allocator to expandable segments, and how."""
import pytest
import torch

from trainstream_hf.engine.allocator import enable_expandable_segments, wants_expandable_segments

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("option, device, paged, env, want", [
    ("auto", CUDA, True, {}, True),                                                 # paged plan: on
    ("auto", CUDA, False, {}, False),                                               # nothing paged: untouched
    ("auto", CUDA, True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),  # the user chose
    ("auto", CUDA, True, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}, False),
    ("auto", CUDA, True, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, True),  # another setting only
    (True, CUDA, False, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, True),  # forced
    (False, CUDA, True, {}, False),
    (True, torch.device("cpu"), True, {}, False),                                    # no CUDA allocator
])
def test_wants_expandable_segments(option, device, paged, env, want):
    assert wants_expandable_segments(option, device, paged, env=env) is want


def test_bad_option_is_refused():
    with pytest.raises(ValueError, match="expandable_segments: 'auto', True or False"):
        wants_expandable_segments("yes", CUDA, True, env={})
    from trainstream_hf.config import TrainStreamConfig
    with pytest.raises(ValueError, match="expandable_segments"):
        TrainStreamConfig(expandable_segments="sometimes")


def test_enable_sets_the_allocator_and_releases_the_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda conf: calls.append(conf), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    assert enable_expandable_segments() is True
    assert calls == ["expandable_segments:True", "empty_cache"]


def test_enable_without_a_setter_warns(monkeypatch):
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings", raising=False)
    with pytest.warns(RuntimeWarning, match="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        assert enable_expandable_segments() is False


def test_wrap_on_the_cpu_leaves_the_allocator_alone(monkeypatch):
    import sys

    import trainstream_hf as ts
    from tests.test_wrap import _llama

    monkeypatch.setattr(sys.modules["trainstream_hf.wrap"], "enable_expandable_segments",
                        lambda: pytest.fail("touched the allocator"))
    model, _ = ts.wrap(_llama(), None, vram_budget="64GiB", page_weights=True, batch_shape=(1, 16),
                       expandable_segments=True, device="cpu")
    assert ts.engine_of(model).expandable_segments is False
    ts.unwrap(model)
