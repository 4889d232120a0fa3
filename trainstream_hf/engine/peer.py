"""peer="auto": the processes of one host keep one host copy of a frozen paged base, not one each.

Under data parallel every process wraps a replica of the same model, so the packed weights a frozen base pages
from host RAM are the same bytes in every process. Instead of each process pinning its own copy (host RAM growing
with the number of GPUs), the first process of each host (its *leader*: the lowest rank there) creates a POSIX
shared-memory segment (``csrc/runtime/shared_host.cpp``), every other process of the host maps it, and each
registers it with CUDA (``cudaHostRegister``) when the arena is pinned: one physical, page-locked copy that every
GPU of the host reads by DMA. Only the leader writes the weights; the others free their own copies unread. (CUDA
IPC handles cover device memory only; shared host pages registered in each process are CUDA's way to share host
memory.)

What is shared: the flat host buffers of paged blocks whose paged parameters are all frozen (a LoRA base; under
data parallel trainable parameters are never paged, ``engine/distributed.py``). Everything else (optimizer state,
offloaded activations, trainable weights) differs between processes and stays in each process's own arena.

Collectives: :meth:`Peers.find` and :meth:`Peers.allocate` run on every process of the group in the same order
(``wrap`` calls them whether or not the process pages anything), so a process that plans differently cannot make
the others hang here; it gets no sharing, and ``check_same_plan`` raises on every rank right after. A host whose
processes cannot share (``/dev/shm`` too small, separate mount namespaces) falls back to private copies with one
warning under ``peer="auto"``, and raises on every rank under ``peer=True``. The segment's name is unlinked as
soon as every process of the host has mapped it (or failed to), or when anything before that raises, so nothing is
left in ``/dev/shm`` whatever happens next; its pages go when the last process unmaps them (the last view of the
weights dies). A leader killed between creating and unlinking (SIGKILL, OOM killer) cannot clean up: its segment
(``trainstream-<pid>-<pid namespace>-<random>``, as large as the frozen base) is removed by the next leader of the
host once that pid no longer runs.
"""
from __future__ import annotations

import os
import re
import secrets
import socket
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainstream_hf import _C

__all__ = ["Peers", "SharedHost", "host_key", "shared_bytes", "pinned_shared_bytes", "remove_stale_segments"]

# Byte alignment of each block's buffer in the segment (a page: DMA and the CPU both like it).
_ALIGN = 4096
# Where glibc's shm_open keeps the segments, and the names made here: trainstream-<pid>-<pid namespace>-<random>
# (trainstream-<pid>-<random> before the namespace was part of it).
_SHM_DIR = "/dev/shm"
_SEGMENT = re.compile(r"trainstream-([1-9][0-9]*)(?:-([0-9]+))?-[0-9a-f]{12}")


def _pid_namespace() -> int:
    """This process's pid namespace (its inode; 0 when unknown): a pid names a process only inside it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _segment_name(pid: int) -> str:
    """A fresh segment name owned by ``pid`` of this pid namespace."""
    return f"/trainstream-{pid}-{_pid_namespace()}-{secrets.token_hex(6)}"


def _runs(pid: int) -> bool:
    """``pid`` is a live process (or one of another user's, which we may not signal: taken as live)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_segments() -> list[str]:
    """Removes the segments that leaders killed during setup left in ``/dev/shm``; returns their names.

    Only names made by :meth:`Peers.allocate` in this pid namespace (another namespace's pids mean other
    processes), owned by this user, whose pid no longer runs: a live leader's segment is never touched.
    """
    ns = _pid_namespace()
    try:
        entries = os.listdir(_SHM_DIR)
    except OSError:
        return []
    removed = []
    for entry in entries:
        m = _SEGMENT.fullmatch(entry)
        if m is None or (m[2] is not None and int(m[2]) != ns) or _runs(int(m[1])):
            continue
        try:
            if os.stat(os.path.join(_SHM_DIR, entry)).st_uid != os.getuid():
                continue
        except OSError:
            continue  # gone meanwhile
        if _C.shared_host_unlink("/" + entry):
            removed.append(entry)
    return removed


def host_key() -> str:
    """Identifies this host (and boot): processes with equal keys can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shared_bytes() -> int:
    """Bytes of shared host memory mapped in this process (all segments)."""
    return int(_C.shared_host_bytes())


def pinned_shared_bytes() -> int:
    """Bytes of shared host memory registered with CUDA (page-locked) in this process."""
    return int(_C.shared_host_pinned_bytes())


@dataclass
class SharedHost:
    """One segment mapped in this process: a uint8 view per shared block; ``writer``: this process fills them."""

    name: str
    nbytes: int
    writer: bool
    pinned: bool
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    processes: int = 1  # processes of this host that map it

    def holds(self, t: torch.Tensor) -> bool:
        """``t`` lives in this segment."""
        views = iter(self.views.values())
        first = next(views, None)
        return first is not None and t.device.type == "cpu" and \
            t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


class Peers:
    """The processes of this host within a data-parallel group.

    Args:
        group: the data-parallel process group.
        required: ``peer=True``: a host with a single process of the group is an error (on every rank).
    """

    def __init__(self, group, *, required: bool = False):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.required = required
        keys = self._gather(host_key())
        self.local = [r for r, k in enumerate(keys) if k == keys[self.rank]]
        self.leader = self.local[0]
        self.is_leader = self.rank == self.leader
        self.hosts = len(set(keys))
        alone = sorted({k for k in keys if keys.count(k) == 1})
        if required and alone:
            raise ValueError(f"peer=True: {len(alone)} host(s) run a single process of the group ({alone[0]}, ...), "
                             "so there is nobody to share host memory with; use peer='auto' or False")

    @classmethod
    def find(cls, group, peer: str | bool) -> "Peers | None":
        """The peers of this process for ``peer`` (the config option), or None without a group (or peer=False).

        Raises:
            ValueError: ``peer=True`` without a data-parallel group of several processes, or a host alone.
        """
        if peer is False:
            return None
        if group is None:
            if peer is True:
                raise ValueError("peer=True shares host memory between the processes of a data-parallel group, but "
                                 "this process trains alone (no torch.distributed group of several processes); "
                                 "use peer='auto' or False")
            return None
        # every process of the group gets one, sharing or not: allocate() is a collective
        return cls(group, required=peer is True)

    @property
    def active(self) -> bool:
        """Another process of the group runs on this host."""
        return len(self.local) > 1

    def _gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def allocate(self, sizes: dict[int, int], *, pin: bool) -> SharedHost | None:
        """One segment per host holding a buffer of ``sizes[block]`` bytes for each block. Collective.

        Args:
            sizes: block index -> bytes of its flat host buffer (the frozen paged blocks; may be empty).
            pin: register the mapping with CUDA (the arena is pinned).

        Returns:
            The mapping, or None when this process keeps private copies: nothing to share, a single process on
            this host, the processes of this host asked for different layouts, or the segment could not be made
            or mapped here (one warning).

        Raises:
            RuntimeError: ``peer=True`` and some process could not share (on every rank).
        """
        offsets, off = {}, 0
        for i in sorted(sizes):
            offsets[i] = off
            off += -(-int(sizes[i]) // _ALIGN) * _ALIGN
        total = off
        layouts = self._gather(sorted(sizes.items()))
        same = all(layouts[r] == layouts[self.rank] for r in self.local)
        share = self.active and total > 0 and same
        name, error = None, None
        created = None  # the name this process made and has not removed yet
        try:
            # 1. the leader creates the segment
            if share and self.is_leader:
                remove_stale_segments()
                name = created = _segment_name(os.getpid())  # set first: an interrupt may follow the call at once
                try:
                    flat = _C.shared_host_create(name, total, pin)
                except RuntimeError as e:  # nothing was left (shared_host.cpp removes the name on its errors)
                    name = created = None
                    error = str(e)
            made = self._gather((name, error))
            name = made[self.leader][0] if share else None
            if share and name is None and not self.is_leader:
                error = f"the leader (rank {self.leader}) could not create the segment: {made[self.leader][1]}"
            # 2. the others map it; 3. the leader removes the name once every process of its host has tried, or
            # as soon as anything raises (a peer that died makes the collective fail)
            if name is not None and not self.is_leader:
                try:
                    flat = _C.shared_host_open(name, total, pin)
                except RuntimeError as e:
                    name, error = None, str(e)
            opened = self._gather(error)
        finally:
            if created is not None:
                _C.shared_host_unlink(created)
        failed = [(r, e) for r, e in enumerate(opened) if e is not None]
        if failed and self.required:
            r, e = failed[0]
            raise RuntimeError(f"peer=True: rank {r} could not share host memory with its host's other processes: {e}")
        if error is not None:
            warnings.warn(f"peer='auto': this process keeps its own host copy of the frozen paged weights ({error})",
                          RuntimeWarning, stacklevel=2)
        if name is None:
            return None
        mapped = sum(1 for r in self.local if opened[r] is None)
        return SharedHost(name=name, nbytes=total, writer=self.is_leader, pinned=pin, processes=mapped,
                          views={i: flat[offsets[i]:offsets[i] + int(sizes[i])] for i in sorted(sizes)})

    def agree(self, error: BaseException | None) -> None:
        """Collective: raises on every rank when ``error`` is set on any (so none waits for the others forever)."""
        errors = self._gather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            raise RuntimeError(f"wrap failed on rank {failed[0][0]}: {failed[0][1]}")

    def barrier(self) -> None:
        """Every process waits until the others got here (the leaders' writes are then visible)."""
        self._gather(None)
