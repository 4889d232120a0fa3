"""peer='auto' leaves nothing in /dev/shm: the segment of a frozen base (as large as the base) is removed on every
error of the setup, and one left by a leader killed in the middle of it is removed by the next leader of the host.

The leader's side of :meth:`Peers.allocate` runs here without torch.distributed: ``_Leader`` makes up the other
process's part of each collective, and a hook before each collective fails or stalls the setup there, after the
segment was made. One test runs two real processes (gloo) where the second dies as it maps the segment; two
processes sharing a base are tested in tests/engine/test_distributed.py.
"""
import datetime
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from trainstream_hf import _C
from trainstream_hf.engine import peer

SIZES = {0: 3 * 4096, 1: 100}  # two frozen paged blocks: a segment of 4 pages
KILL_WITHIN_S = 120.0  # the stalled subprocess imports torch first, on a slow shared machine


class _Leader(peer.Peers):
    """Rank 0 of two processes of one host. The collectives are, in order: 0 the layouts, 1 the leader's segment
    name, 2 the other processes' mapping errors; the other process agrees on the layout and maps the segment.

    Args:
        hook: ``hook(collective, this process's part)``, run before each collective.
    """

    def __init__(self, hook=None):  # no group: the fields Peers.__init__ would gather
        self.group, self.rank, self.world, self.required = None, 0, 2, False
        self.local, self.leader, self.is_leader, self.hosts = [0, 1], 0, True, 1
        self._hook, self._collectives = hook, 0

    def _gather(self, obj) -> list:
        k = self._collectives
        self._collectives += 1
        if self._hook is not None:
            self._hook(k, obj)
        return [obj, [obj, (None, None), None][k]]


def _exists(name: str) -> bool:
    return os.path.exists("/dev/shm" + name)


def _ours() -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"trainstream-{os.getpid()}-"))


def test_the_segment_is_shared_and_its_name_gone_once_mapped():
    made = []
    shared = _Leader(lambda k, mine: made.append(mine[0]) if k == 1 else None).allocate(SIZES, pin=False)
    assert shared is not None and shared.writer and shared.processes == 2 and shared.nbytes == 4 * 4096
    assert made[0] == shared.name and not _exists(shared.name) and _ours() == []
    shared.views[1][:] = 7  # the mapping outlives the name
    assert int(shared.views[1].sum()) == 700


def test_a_dead_leaders_segment_is_removed_by_the_next_allocation():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid runs no process any more
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ns = peer._pid_namespace()
    stale = [peer._segment_name(dead.pid),
             f"/trainstream-{dead.pid}-{secrets.token_hex(6)}"]  # named as before the pid namespace was in it
    kept = {
        "a live leader's, in its setup": peer._segment_name(live.pid),
        "this process's": peer._segment_name(os.getpid()),
        "another pid namespace's, where that pid is another process": f"/trainstream-{dead.pid}-{ns + 1}-{'a' * 12}",
        "not a name allocate makes": f"/trainstream-test-{dead.pid}-{secrets.token_hex(4)}",
    }
    names = [*stale, *kept.values()]
    try:
        for name in names:
            _C.shared_host_create(name, 4096, False)
        if os.getuid() == 0:  # another user's segment, with a pid that does not run here either
            foreign = peer._segment_name(dead.pid)
            _C.shared_host_create(foreign, 4096, False)
            os.chown("/dev/shm" + foreign, 65534, 65534)
            kept["another user's"] = foreign
            names.append(foreign)
        assert all(_exists(name) for name in stale)
        assert _Leader().allocate(SIZES, pin=False) is not None
        assert not any(_exists(name) for name in stale)
        for what, name in kept.items():
            assert _exists(name), f"{what} segment was removed"
    finally:
        live.kill()
        live.wait()
        for name in names:
            _C.shared_host_unlink(name)


@pytest.mark.parametrize("collective", [1, 2])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_during_setup_leaves_no_segment(collective, error):
    """The other process dies (the collective raises) or Ctrl-C, after the segment was made."""
    made = []

    def fail(k, mine):
        if k == 1:
            made.append(mine[0])
        if k == collective:
            assert _exists(made[0])
            raise error("injected")

    with pytest.raises(error, match="injected"):
        _Leader(fail).allocate(SIZES, pin=False)
    assert made[0] is not None and not _exists(made[0]) and _ours() == []


def test_a_ctrl_c_as_the_segment_is_made_leaves_none(monkeypatch):
    """KeyboardInterrupt raised the moment the create call returns, before its result is stored."""
    made = []
    create = _C.shared_host_create

    def create_then_interrupt(name, nbytes, pin):
        create(name, nbytes, pin)
        made.append(name)
        raise KeyboardInterrupt

    monkeypatch.setattr(_C, "shared_host_create", create_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        _Leader().allocate(SIZES, pin=False)
    assert made and not _exists(made[0]) and _ours() == []


def test_a_leader_killed_during_setup_leaves_a_segment_the_next_run_removes():
    proc = subprocess.Popen([sys.executable, __file__, "stall"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the subprocess prints its segment's name, then waits to be killed
        assert line.startswith("/trainstream-"), f"no segment made (exit code {proc.poll()})"
        name = line.strip()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(KILL_WITHIN_S) == -signal.SIGKILL
        assert _exists(name)  # what the kill leaves: no process of the host removes it any more
        assert _Leader().allocate(SIZES, pin=False) is not None
        assert not _exists(name) and _ours() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if "name" in locals():
            _C.shared_host_unlink(name)


def test_a_process_that_dies_while_mapping_leaves_no_segment(tmp_path):
    """Two real processes of one group: rank 1 dies as it maps the leader's segment; the leader's collective
    fails and the segment goes with it."""
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out = [p.communicate(timeout=KILL_WITHIN_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == 3, out[1][1][-2000:]
    leader = out[0][0].split()
    assert procs[0].returncode == 0 and leader[:1] == ["made"] and leader[2:3] == ["RuntimeError"], out[0]
    assert not _exists(leader[1])


def _rank(rank: int, store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    peers = peer.Peers(dist.group.WORLD)
    if rank == 0:
        create = _C.shared_host_create

        def create_and_tell(name, nbytes, pin):
            print("made", name, flush=True)
            return create(name, nbytes, pin)

        _C.shared_host_create = create_and_tell
    else:
        _C.shared_host_open = lambda *args: os._exit(3)
    try:
        peers.allocate(SIZES, pin=False)
    except RuntimeError as e:  # the collective after the dead process's part
        print(type(e).__name__, flush=True)
    finally:
        # Gloo's worker threads left to interpreter finalization can abort the process (SIGABRT, "terminate called
        # without an active exception"): leave the group while the interpreter is whole.
        dist.destroy_process_group()


def _stall(k, mine):
    if k == 1:
        print(mine[0], flush=True)
        time.sleep(KILL_WITHIN_S)


if __name__ == "__main__":
    if sys.argv[1:] == ["stall"]:
        _Leader(_stall).allocate(SIZES, pin=False)
        sys.exit("not killed")
    _rank(int(sys.argv[2]), sys.argv[3])
