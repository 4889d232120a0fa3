"""Several processes for the sft recipe (either loop): ``accelerate launch --num_processes N`` or ``torchrun``.

The launcher sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; each process trains a replica on GPU ``LOCAL_RANK``
(the CPU with gloo where there is none) on its own share of every global step's batches, with the engine installed
first and torch's DistributedDataParallel around it (``engine/distributed.py``: wrap, then DDP). Rank 0 evaluates,
prints and writes the summary; every process reports its step times and host memory to it, so that a run on N GPUs
says how host RAM grew with N (``peer``: one host copy of a frozen base per host).
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from trainstream_hf.train.config import ConfigError

__all__ = ["Processes", "from_environment", "start", "finish", "device_for", "rank_batches", "mean", "total",
           "gather", "host_memory", "trainable_checksum", "cpu_launch_config", "free_port"]


@dataclass(frozen=True)
class Processes:
    """This process's place in the launch: ``rank`` of ``world``, ``local_rank`` on its host."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def several(self) -> bool:
        return self.world > 1


def _int(env, name: str, default: int) -> int:
    value = env.get(name, "")
    if value == "":
        return default
    if not value.isdigit():
        raise ConfigError(f"{name}={value!r}: the launcher's environment must hold a non-negative integer")
    return int(value)


def from_environment(environ=None) -> Processes:
    """The launch as ``torchrun`` / ``accelerate launch`` describe it in the environment (one process without)."""
    env = os.environ if environ is None else environ
    p = Processes(rank=_int(env, "RANK", 0), world=max(1, _int(env, "WORLD_SIZE", 1)),
                  local_rank=_int(env, "LOCAL_RANK", 0))
    if p.rank >= p.world:
        raise ConfigError(f"RANK={p.rank} but WORLD_SIZE={p.world}")
    return p


def require_single(procs: Processes, what: str) -> None:
    """Refuses a launch of several processes where ``what`` trains in one."""
    if procs.several:
        raise ConfigError(f"WORLD_SIZE={procs.world}: {what} trains in one process on one device; launch it with "
                          "configs/accelerate/single_gpu.yaml (num_processes: 1), or use the sft recipe for several")


def device_for(spec: str, procs: Processes) -> torch.device | None:
    """The device of this process under several processes: ``cuda:LOCAL_RANK`` ('auto' with CUDA), the CPU ('auto'
    without, or 'cpu'). None with one process (the recipe resolves ``spec`` itself).

    Raises:
        ConfigError: a device pinned to one GPU (each process takes its own), or more processes on this host than
            GPUs.
    """
    if not procs.several:
        return None
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if spec not in ("auto", "cuda"):
        raise ConfigError(f"device={spec!r}: under several processes each one takes GPU LOCAL_RANK; set device auto "
                          "(or cpu)")
    count = torch.cuda.device_count()
    if procs.local_rank >= count:
        raise ConfigError(f"LOCAL_RANK={procs.local_rank} but this host has {count} GPU(s): launch at most {count} "
                          "processes per host")
    torch.cuda.set_device(procs.local_rank)
    return torch.device("cuda", procs.local_rank)


def start(procs: Processes, device: torch.device) -> None:
    """Joins the process group (NCCL on GPUs, gloo on the CPU) when there are several processes."""
    if procs.several and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=30))


def finish(procs: Processes) -> None:
    """Leaves the process group while the interpreter is whole. A collection first: a DDP wrapper held in reference
    cycles (the Trainer's) holds the group too, and freed only at interpreter finalization it takes gloo's worker
    threads down there, which can abort the process (SIGABRT, "terminate called without an active exception")."""
    if procs.several and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def rank_batches(batches: Iterator, procs: Processes) -> Iterator:
    """This process's share of each global step: of every ``world`` consecutive batches, the ``rank``-th (every
    process draws the same seeded sequence, so the shares are disjoint and together make the global batch)."""
    while True:
        step = [next(batches) for _ in range(procs.world)]
        yield step[procs.rank]


def _reduce(value, procs: Processes, device: torch.device, dtype) -> torch.Tensor:
    t = torch.tensor([value], dtype=dtype, device=device)
    if procs.several:
        dist.all_reduce(t)
    return t


def mean(value: float, procs: Processes, device: torch.device) -> float:
    """``value`` averaged over the processes (a collective: every process calls it)."""
    return _reduce(float(value), procs, device, torch.float64).item() / procs.world


def total(value: int, procs: Processes, device: torch.device) -> int:
    """``value`` summed over the processes (a collective)."""
    return int(_reduce(int(value), procs, device, torch.int64).item())


def gather(obj, procs: Processes) -> list:
    """Every process's ``obj``, in rank order (a collective; ``[obj]`` with one process)."""
    if not procs.several:
        return [obj]
    out = [None] * procs.world
    dist.all_gather_object(out, obj)
    return out


def trainable_checksum(model: torch.nn.Module) -> float:
    """The float64 sum of every trainable parameter: equal on every process when the replicas are (DDP keeps them
    so), which the summary shows per process."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in model.parameters() if p.requires_grad))


def host_memory() -> dict:
    """This process's host memory now: resident set (``rss_bytes``) and proportional set (``pss_bytes``: pages
    shared with other processes, such as a ``peer`` segment, count their share only, so the processes' PSS add up to
    the host RAM they use), from /proc/self/smaps_rollup; empty where that file does not exist."""
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    out[f"{key.lower()}_bytes"] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a launch's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_launch_config(path, processes: int) -> tuple[str, dict]:
    """An accelerate config for ``processes`` gloo processes on the CPU of this host, written to ``path``, and the
    environment variables such a launch wants.

    ``accelerate launch --cpu`` cannot start several processes without MPI (its simple launcher starts one), so the
    config asks for the multi-GPU launcher (torchrun) and the script itself asks for the CPU (the recipes'
    ``--device cpu``, Trainer's ``use_cpu=True``); with 1 process it is a plain launch. The port is a free one, so
    that concurrent launches do not meet.

    Returns:
        (the config's path, {"OMP_NUM_THREADS": "1", and GLOO_SOCKET_IFNAME=lo where the host has a loopback
        interface: gloo otherwise picks the host name's address, which some sandboxes cannot reach}).
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    kind = "MULTI_GPU" if processes > 1 else "'NO'"  # quoted: YAML reads a bare NO as false
    text = ("compute_environment: LOCAL_MACHINE\n"
            f"distributed_type: {kind}\nmixed_precision: 'no'\n"
            f"num_machines: 1\nnum_processes: {processes}\nmachine_rank: 0\nmain_process_port: {free_port()}\n"
            "use_cpu: false\ndynamo_config: {}\n")
    with open(path, "w") as f:
        f.write(text)
    env = {"OMP_NUM_THREADS": "1"}
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return str(path), env
