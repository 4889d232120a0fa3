"""One rank of the data-parallel tests (tests/engine/test_distributed.py, tests/integrations/test_accelerate.py).

    torchrun --standalone --nproc_per_node 2 tests/engine/ddp_worker.py OUT_DIR SCENARIO [SCENARIO ...]
    accelerate launch --config_file <2 processes> tests/engine/ddp_worker.py OUT_DIR accelerate

Each rank trains a tiny fp32 Llama (its own random init: seed = rank, so only broadcasts make the replicas agree) on
its share of a global batch and writes ``OUT_DIR/rank<r>.pt``: per scenario the rank's losses, its final parameters
(after unwrap) and what the engine chose, or the error it raised. The tests import this file for what they share: the
launch (:func:`launch`), one process trained on the whole global batch with plain torch (:func:`reference`) and the
comparison (:func:`check_matches_one_process`).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, SEQ, STEPS, LR = 4, 16, 3, 1e-3
ENGINE = dict(vram_budget="64GiB", host_arena=None)
# DDP_WORKER_DEVICE=cuda (tests/gpu/test_peer_cuda.py): both ranks train on GPU 0 (gloo moves CUDA tensors too) with a
# pinned arena, so that the shared host copy is registered with CUDA in each process; =nccl (tests/gpu/test_ddp_cuda.py):
# rank r on GPU r, NCCL
MODE = os.environ.get("DDP_WORKER_DEVICE", "cpu")
if MODE not in ("cpu", "cuda", "nccl"):
    raise SystemExit(f"DDP_WORKER_DEVICE: cpu, cuda or nccl, got {MODE!r}")
DEVICE = {"cpu": "cpu", "cuda": "cuda:0", "nccl": f"cuda:{os.environ.get('LOCAL_RANK', '0')}"}[MODE]
if MODE != "cpu":
    ENGINE = dict(ENGINE, host_arena="auto")
SCENARIOS = {
    # name: (model kind, trainstream options, DDP options, micro-batches per step, clip)
    "full_device": ("full", dict(offload_optimizer=True, min_offload_numel=0, grads="device"),
                    dict(gradient_as_bucket_view=True), 1, 1.0),
    "full_auto_accum": ("full", dict(offload_optimizer=True, min_offload_numel=0), {}, 2, None),
    "lora_paged": ("lora", dict(offload_activations=True, page_weights=True, min_activation_bytes=0), {}, 1, 1.0),
    "lora_paged_accum": ("lora", dict(offload_activations=True, page_weights=True, min_activation_bytes=0), {}, 2,
                         None),
    # peer: the frozen base's host copy shared by the two processes (the default 'auto'), or each its own; in the
    # fallback rank 1 cannot map the segment (an injected failure) and keeps a private copy
    "lora_private": ("lora", dict(offload_activations=True, page_weights=True, min_activation_bytes=0, peer=False),
                     {}, 1, 1.0),
    "lora_peer_fallback": ("lora", dict(page_weights=True), {}, 1, 1.0),
    # refused, with the error named in the test
    "full_host": ("full", dict(offload_optimizer=True, min_offload_numel=0, grads="host"), {}, 1, None),
    "full_paged": ("full", dict(offload_optimizer=True, min_offload_numel=0, page_weights=True), {}, 1, None),
    "plan_differs": ("lora", dict(page_weights="rank0"), {}, 1, None),
    "ddp_first": ("full", dict(offload_optimizer=True, min_offload_numel=0), {}, 1, None),
    "peer_required_fails": ("lora", dict(page_weights=True, peer=True), {}, 1, None),
}
# scenarios whose rank 1 cannot open the shared segment
_OPEN_FAILS = ("lora_peer_fallback", "peer_required_fails")
# TrainStreamAccelerator under accelerate launch (run_accelerate): full fine-tune, accumulation of 2, clipped
ACCELERATE = ("full", dict(offload_optimizer=True, min_offload_numel=0), {}, 2, 1.0)


def build(kind: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                         max_position_embeddings=64))
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
        for n, p in model.named_parameters():
            if "lora_B" in n:  # PEFT starts B at zero; random B makes A's gradient non-zero from step 1
                torch.nn.init.normal_(p, std=0.02)
    return model


def optimizer(model):
    # eps well above float32 noise in near-zero gradients: Adam divides by |g| + eps, so with the default 1e-8 a
    # different (equally right) summation order of a tiny gradient moves a weight by up to ~lr
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=1e-6, weight_decay=0.1)


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=g)


def shard(step: int, rank: int, world: int, micro: int, k: int) -> torch.Tensor:
    """Rank ``rank``'s micro-batch ``k`` of the global batch of ``step``."""
    per_rank = GLOBAL_BATCH // world
    rows = global_batch(step)[rank * per_rank:(rank + 1) * per_rank]
    size = per_rank // micro
    return rows[k * size:(k + 1) * size]


def reference(name: str, device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch per step, plain torch AdamW: losses and final parameters (on the CPU)."""
    kind, _, _, _, clip = ACCELERATE if name == "accelerate" else SCENARIOS[name]
    model = build(kind, 0).to(device)
    opt = optimizer(model)
    losses = []
    for s in range(STEPS):
        ids = global_batch(s).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def launch(cmd: list[str], out: Path, timeout: int = 240) -> list[dict]:
    """Runs a 2-process launch command and returns each rank's results."""
    path = os.environ.get("PYTHONPATH")  # kept after ours: carried wheels live there on the GPU machine
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    env = {k: v for k, v in env.items() if not k.startswith("TRAINSTREAM")}
    if Path("/sys/class/net/lo").exists():  # gloo on loopback: containers whose hostname does not resolve
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"launch failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return [torch.load(out / f"rank{k}.pt", weights_only=False) for k in range(2)]


def check_matches_one_process(ranks: list[dict], kind: str, reference) -> None:
    """Both ranks trained; averaged losses and final weights within 1e-5 of one process on the global batch;
    the replicas hold the same bits."""
    for k, res in enumerate(ranks):
        assert "error" not in res, f"rank {k}: {res.get('traceback', res.get('error'))}"
    ref_losses, ref_params = reference
    losses = [sum(r["losses"][s] for r in ranks) / len(ranks) for s in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    a, b = ranks[0]["params"], ranks[1]["params"]
    assert a.keys() == ref_params.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), f"replicas differ at {n}"
    diff = max((a[n] - ref_params[n]).abs().max().item() for n in a)
    assert diff < 1e-5, diff
    # a test that can fail: training moved the weights 100x further than the tolerance
    init = dict(build(kind, 0).named_parameters())
    assert max((ref_params[n] - init[n].detach()).abs().max().item() for n in a) > 1e-3


def _shared_mapping(name: str | None) -> dict:
    """This process's mapping of shared segment ``name``: its inode and the proportional set size (kB) of its
    pages (a page mapped by two processes counts half in each), from /proc/self/smaps."""
    if name is None:
        return {}
    found, inode, pss = False, None, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):  # a mapping's first line
                found = f"/dev/shm{name}" in line
                if found:
                    inode = int(head[4])
            elif found and line.startswith("Pss:"):
                pss += int(head[1])
    return {"inode": inode, "pss_kb": pss}


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def run(name: str, rank: int, world: int) -> dict:
    import trainstream_hf as ts
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainstream_hf.engine import peer

    kind, options, ddp_options, micro, clip = SCENARIOS[name]
    model = build(kind, seed=rank).to(DEVICE)
    opt = optimizer(model)
    if options.get("page_weights") == "rank0":
        options = {**options, "page_weights": rank == 0}
    if name == "ddp_first":
        model = DDP(model)
    refuse = mock.patch.object(peer._C, "shared_host_open", side_effect=RuntimeError("injected: cannot open"))
    with refuse if (name in _OPEN_FAILS and rank == 1) else contextlib.nullcontext(), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = ts.wrap(model, opt, **ENGINE, **options)
    eng = ts.engine_of(model)
    shared = eng.shared_host
    info = {"optimizer": type(opt).__name__, "grads": getattr(opt, "grads_mode", None),
            "paged_blocks": eng.plan.paged_blocks, "offloaded_activations": eng.plan.offloaded_activation_blocks,
            "paged_params": len(eng.pager.paged_parameters()) if eng.pager is not None else 0,
            "paged_bytes": eng.pager.stats()["paged_bytes"] if eng.pager is not None else 0,
            "arena_used": eng.arena.stats()["used"],
            "shared": None if shared is None else {"nbytes": shared.nbytes, "writer": shared.writer,
                                                   "processes": shared.processes, "name": shared.name,
                                                   "pinned": shared.pinned,
                                                   "pinned_bytes": peer.pinned_shared_bytes()},
            "warnings": [str(w.message) for w in caught if "peer" in str(w.message)]}
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    ignored = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    info["ddp_ignores_the_frozen"] = bool(frozen) and ignored == frozen
    ddp = DDP(model, **ddp_options)
    losses = []
    for s in range(STEPS):
        total = 0.0
        for k in range(micro):
            ids = shard(s, rank, world, micro, k).to(DEVICE)
            if k < micro - 1:
                with ddp.no_sync():  # accumulate locally; the last micro-batch's backward all-reduces the sum
                    loss = ddp(input_ids=ids, labels=ids).loss / micro
                    loss.backward()
            else:
                loss = ddp(input_ids=ids, labels=ids).loss / micro
                loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    info["stats"] = {k: v for k, v in model.trainstream_stats().items()
                     if k in ("h2d_bytes", "d2h_bytes", "host_shared_bytes")}
    info["mapping"] = _shared_mapping(shared.name if shared is not None else None)
    torch.distributed.barrier()  # both measured before either unmaps (else one sees the pages as its own alone)
    del shared
    ts.unwrap(model)
    info["ddp_ignore_after_unwrap"] = hasattr(model, "_ddp_params_and_buffers_to_ignore")
    del eng
    gc.collect()
    info["shared_after_unwrap"] = peer.shared_bytes()
    return {"losses": losses, "params": _params(model), "info": info}


def run_accelerate(rank: int, world: int) -> dict:
    """TrainStreamAccelerator as a user script under ``accelerate launch``: accumulation of 2, clipping."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainstream_hf.config import TrainStreamConfig
    from trainstream_hf.integrations.accelerate import TrainStreamAccelerator, TrainStreamPlugin

    kind, options, _, micro, clip = ACCELERATE
    plugin = TrainStreamPlugin("on", TrainStreamConfig(**options, **ENGINE))
    acc = TrainStreamAccelerator(cpu=True, gradient_accumulation_steps=micro, trainstream_plugin=plugin)
    assert (acc.num_processes, acc.process_index) == (world, rank), (acc.num_processes, acc.process_index)
    model = build(kind, seed=rank)
    p_model, p_opt = acc.prepare(model, optimizer(model))
    info = {"ddp": isinstance(p_model, DDP), "optimizer": type(p_opt.optimizer).__name__,
            "grads": p_opt.optimizer.grads_mode, "backend": str(torch.distributed.get_backend())}
    losses = []
    for s in range(STEPS):
        total = 0.0
        for k in range(micro):
            with acc.accumulate(p_model):  # no_sync until the last micro-batch
                ids = shard(s, rank, world, micro, k)
                loss = p_model(input_ids=ids, labels=ids).loss
                acc.backward(loss)  # divides by the accumulation steps
                if acc.sync_gradients:
                    acc.clip_grad_norm_(p_model.parameters(), clip)
                p_opt.step()  # Accelerate skips it (and zero_grad) until the gradients are synchronised
                p_opt.zero_grad()
                total += loss.item() / micro
        losses.append(total)
    acc.end_training()
    return {"losses": losses, "params": _params(model), "info": info}


def main(out_dir: str, names: list[str]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if MODE != "cpu":  # the GPU tests compare runs bit for bit (the embedding's backward uses atomics)
        torch.cuda.set_device(torch.device(DEVICE))
        torch.use_deterministic_algorithms(True, warn_only=True)
    if names != ["accelerate"]:  # the Accelerator initialises the group itself
        dist.init_process_group("nccl" if MODE == "nccl" else "gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    for name in names:
        try:
            results[name] = run_accelerate(rank, world) if name == "accelerate" else run(name, rank, world)
        except Exception as e:  # the tests say which errors are expected
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if dist.is_initialized():
            dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
