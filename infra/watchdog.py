"""When one rank of a run fails, every rank stops within a minute (DESIGN.md section 10).

Without it a rank that raises (an OOM in the rollout, an error in the update), is killed, or hangs
leaves the others waiting in their next collective for `collective_timeout_h` (6 h). On one node
torchrun's agent ends the other workers when one exits, and gloo's collectives fail as soon as a
peer's socket closes; but across nodes each node's agent sees only its own workers, NCCL waits for a
dead peer until the collective times out, and no launcher notices a rank that is alive but stuck.

Each rank runs one daemon thread over its own connection to the launch's key-value store (the
TCPStore at MASTER_ADDR:MASTER_PORT that torch.distributed met at): every `beat` seconds it counts
up its own heartbeat and reads the others'. It stops its process (one line on stderr, exit status 1,
the pid's other threads with it) when
- another rank reported a failure: the failing rank writes its exception to the store before its
  own exit (`Watchdog.fail`; the run's first report stays), so the others name it;
- another rank's heartbeat has not moved for `timeout_s` seconds (killed, frozen, or its node gone),
  or the store itself has not answered for that long (the node that hosted it is gone).
A rank that ends its run says so (`Watchdog.stop`), and is not waited for. The heartbeats are read
with the reader's clock only, so the nodes' clocks need not agree. One process: no thread.

    with watchdog.reporting():       # train_twice.main: an error inside reaches the other ranks
        ...watchdog.start(timeout_s) # train_twice.setup, once the ranks have met
        ...                          # the run; the watch ends with the block

Costs: three store round trips a second per rank, whatever the world size; nothing in the training
loop. The limit: a rank
whose Python holds the GIL for `timeout_s` without a pause would look stuck (torch.save and load
of 2 GiB, safetensors, matmuls and sorts of seconds leave the beat on time: RESULTS.md
"Reliability"); `rank_timeout_s = 0` turns the watchdog off.
"""
import contextlib
import datetime
import os
import sys
import threading
import time


class Watchdog:
    """The rank's thread; Watchdog(None) (one process, or off) does nothing."""

    def __init__(self, store, rank: int = 0, world: int = 1, timeout_s: float = 45.0,
                 beat: float = 1.0, prefix: str = "twice/watchdog", exit=os._exit):
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s, self.beat, self.exit = timeout_s, beat, exit
        # a launcher that restarts workers keeps its store: each attempt has its own keys
        self.prefix = f"{prefix}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.lock, self.halt, self.failing = threading.Lock(), threading.Event(), threading.Event()
        self.thread = None
        if store is not None:
            self.thread = threading.Thread(target=self._watch, name="twice-watchdog", daemon=True)
            self.thread.start()

    def _key(self, what: str, rank=None) -> str:
        return f"{self.prefix}/{what}" + ("" if rank is None else f"/{rank}")

    def _call(self, fn, *args):
        with self.lock:  # one connection, shared with fail() and stop() on the main thread
            return fn(*args)

    def _watch(self):
        """Each beat three round trips whatever the world size: this rank's count up, the run's
        failure report, every other rank's count and end mark at once."""
        others = [r for r in range(self.world) if r != self.rank]
        keys = [self._key(what, r) for what in ("beat", "done") for r in others]
        seen = {r: (-1, time.monotonic()) for r in others}  # last count, when it last moved
        answered, ready = time.monotonic(), False
        while not self.halt.wait(self.beat):
            now = time.monotonic()
            try:
                if not ready:  # counters exist before any rank reads them (add 0 makes a key)
                    for key in keys + [self._key("done", self.rank)]:
                        self._call(self.store.add, key, 0)
                    ready = True
                self._call(self.store.add, self._key("beat", self.rank), 1)
                if self._call(self.store.check, [self._key("failed")]):
                    rank, why = self._call(self.store.get, self._key("failed")).decode().split("\t", 1)
                    if int(rank) != self.rank:
                        return self._stop(f"rank {rank} failed: {why}")
                values = [int(v) for v in self._call(self.store.multi_get, keys)]
                for r, count, done in zip(others, values, values[len(others):]):
                    if done:
                        continue
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > self.timeout_s:
                        return self._stop(f"rank {r} has not been heard from for "
                                          f"{now - seen[r][1]:.0f} s (killed, stuck, or its "
                                          "node gone)")
                answered = now
            except Exception as e:  # the store is unreachable: its host may be gone
                if now - answered > self.timeout_s:
                    return self._stop(f"the launch's store has not answered for "
                                      f"{now - answered:.0f} s ({type(e).__name__}: {e})")

    def _stop(self, why: str):
        if self.halt.is_set() or self.failing.is_set():  # the run ended meanwhile, or fails with its own error
            return
        print(f"rank {self.rank}: stopping: {why}", file=sys.stderr, flush=True)
        self.exit(1)

    def fail(self, error: BaseException):
        """This rank is failing: tell the others before it exits. The run's first report stays
        (a later one is usually a consequence of it); a report that cannot be written leaves the
        others the heartbeat's silence."""
        if self.thread is None:
            return
        self.failing.set()  # its own error propagates: the thread no longer stops the process for another's
        text = f"{type(error).__name__}: {error}".splitlines()[0][:500] if str(error) \
            else type(error).__name__
        with contextlib.suppress(Exception):
            self._call(self.store.compare_set, self._key("failed"), "", f"{self.rank}\t{text}")

    def stop(self):
        """This rank's run has ended (or failed, after fail()): the thread ends, the others stop
        waiting for this rank's heartbeat (best effort: a store already gone has no one to tell)."""
        if self.thread is None or self.halt.is_set():
            return
        self.halt.set()
        with contextlib.suppress(Exception):
            self._call(self.store.add, self._key("done", self.rank), 1)
        self.thread.join(timeout=5 * self.beat)


CURRENT = Watchdog(None)  # this process's (one per process, as torch.distributed's group)


def start(timeout_s: float) -> Watchdog:
    """Start this process's watchdog (CURRENT): a thread when torch.distributed runs over several
    processes and timeout_s > 0, else one that does nothing. Called once the ranks have met."""
    global CURRENT
    CURRENT.stop()
    CURRENT = _make(timeout_s)
    return CURRENT


@contextlib.contextmanager
def reporting():
    """Around a rank's run: an exception inside reaches the other ranks before it propagates, and
    the watchdog started inside (start) ends with the run, error or not."""
    try:
        yield
    except BaseException as e:
        CURRENT.fail(e)
        raise
    finally:
        CURRENT.stop()


def _make(timeout_s: float) -> Watchdog:
    import torch.distributed as dist
    if timeout_s <= 0 or not dist.is_available() or not dist.is_initialized() \
            or dist.get_world_size() < 2 or "MASTER_ADDR" not in os.environ:
        return Watchdog(None)
    # its own connection: the process group's store is busy on the main thread's collectives
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(5.0, timeout_s / 3)))
    return Watchdog(store, dist.get_rank(), dist.get_world_size(), timeout_s)
