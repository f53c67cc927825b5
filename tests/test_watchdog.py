"""infra/watchdog.py: one rank's failure stops every rank (DESIGN.md section 10).

The watchdogs of "ranks" in one process share an in-memory store (torch.distributed.HashStore, the
TCPStore's API) and report their exit instead of taking it; tests/test_rank_failure.py stops real
ranks under accelerate launch."""
import threading
import time

import pytest
import torch.distributed as dist

from infra import watchdog

BEAT, TIMEOUT = 0.02, 0.4


class Exits:
    """What a watchdog's exit(1) would have done: which rank, when."""

    def __init__(self):
        self.seen, self.event = [], threading.Event()

    def of(self, rank):
        def exit(code):
            self.seen.append((rank, code, time.monotonic()))
            self.event.set()
        return exit


def ranks(store, exits, world=2, timeout_s=TIMEOUT):
    return [watchdog.Watchdog(store, r, world, timeout_s, beat=BEAT, exit=exits.of(r)) for r in range(world)]


def test_a_rank_that_fails_stops_the_others_naming_its_error(capfd):
    exits = Exits()
    dogs = ranks(dist.HashStore(), exits, world=3, timeout_s=5.0)
    t = time.monotonic()
    dogs[1].fail(MemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    dogs[1].stop()
    deadline = time.monotonic() + 5
    while len(exits.seen) < 2 and time.monotonic() < deadline:
        time.sleep(BEAT)
    assert sorted((r, c) for r, c, _ in exits.seen) == [(0, 1), (2, 1)]
    assert all(when - t < 2.5 for _, _, when in exits.seen)  # on the report, not on a silence (5 s)
    err = capfd.readouterr().err
    for r in (0, 2):
        assert f"rank {r}: stopping: rank 1 failed: MemoryError: CUDA out of memory. Tried to allocate" in err
    for d in dogs:
        d.stop()


@pytest.mark.parametrize("how", ["killed", "store gone"])
def test_silence_past_the_timeout_stops_a_rank(capfd, how):
    """A killed or frozen rank writes nothing: its heartbeat stops. A store that no longer answers (the node that
    hosted it is gone) is the same news."""
    class Gone:
        def __getattr__(self, name):
            def call(*args):
                raise RuntimeError("Connection reset by peer")
            return call
    exits, t = Exits(), time.monotonic()
    dogs = ranks(dist.HashStore() if how == "killed" else Gone(), exits)
    if how == "killed":
        dogs[1].halt.set()  # its thread ends without a word, as in a SIGKILL
    deadline = time.monotonic() + TIMEOUT + 5
    while not any(r == 0 for r, _, _ in exits.seen) and time.monotonic() < deadline:
        time.sleep(BEAT)
    # rank 0's exit (with the store gone, rank 1 stops too, in either order)
    rank, code, when = next((x for x in exits.seen if x[0] == 0), (None, None, None))
    assert (rank, code) == (0, 1) and TIMEOUT <= when - t < TIMEOUT + 3  # (+ 3: a loaded machine's thread wake-ups)
    assert how == "store gone" or [r for r, _, _ in exits.seen] == [0]  # a killed rank stops no one else
    err = capfd.readouterr().err
    want = "rank 1 has not been heard from for" if how == "killed" else "the launch's store has not answered for"
    assert f"rank 0: stopping: {want}" in err
    for d in dogs:
        d.stop()


def test_a_rank_that_ends_its_run_is_not_waited_for_and_stopped_watchdogs_stay_quiet():
    exits = Exits()
    dogs = ranks(dist.HashStore(), exits)
    time.sleep(5 * BEAT)
    dogs[1].stop()  # rank 1 is done: rank 0 may outlive it by far more than the timeout
    assert not exits.event.wait(3 * TIMEOUT)
    dogs[0].stop()
    assert not dogs[0].thread.is_alive() and not dogs[1].thread.is_alive() and exits.seen == []


def test_slow_ranks_are_not_stopped():
    """A heartbeat that moves, however slowly the rank's main work goes, keeps it in."""
    exits = Exits()
    dogs = ranks(dist.HashStore(), exits, world=4)
    assert not exits.event.wait(4 * TIMEOUT)
    for d in dogs:
        d.stop()
    assert exits.seen == []


def test_one_process_or_off_costs_nothing():
    assert watchdog.start(0).thread is None and watchdog.start(45).thread is None  # no process group here
    with pytest.raises(ValueError):
        with watchdog.reporting():
            watchdog.start(45)
            raise ValueError("x")
    assert watchdog.CURRENT.thread is None


def test_reporting_tells_the_others_and_ends_the_watch(monkeypatch):
    """train_twice.main's block: the watchdog that setup starts inside it reports the run's exception and ends
    with it; a run that ends well ends it too."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store, exits = dist.HashStore(), Exits()
    other = watchdog.Watchdog(store, 0, 2, TIMEOUT, beat=BEAT, exit=exits.of(0))
    monkeypatch.setattr(watchdog, "_make", lambda timeout_s: watchdog.Watchdog(store, 1, 2, timeout_s, beat=BEAT,
                                                                                 exit=exits.of(1)))
    with pytest.raises(RuntimeError):
        with watchdog.reporting():
            mine = watchdog.start(TIMEOUT)
            raise RuntimeError("in the update")
    assert exits.event.wait(3) and exits.seen[0][:2] == (0, 1) and not mine.thread.is_alive()
    assert store.get("twice/watchdog/0/failed") == b"1\tRuntimeError: in the update"  # the reporter, its error
    other.stop()
    ended = store.add("twice/watchdog/0/done/1", 0)  # rank 1's end marks so far (the failed run's)
    with watchdog.reporting():
        mine = watchdog.start(TIMEOUT)
    assert not mine.thread.is_alive() and store.add("twice/watchdog/0/done/1", 0) == ended + 1


def test_each_launch_attempt_has_its_own_keys(monkeypatch):
    """torchrun --max_restarts keeps its store across attempts: a failure reported in attempt 0 does not stop
    attempt 1."""
    store, exits = dist.HashStore(), Exits()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    old = ranks(store, exits)
    old[1].fail(RuntimeError("first attempt"))
    assert exits.event.wait(3)
    for d in old:
        d.stop()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = Exits()
    new = ranks(store, again)
    assert not again.event.wait(3 * TIMEOUT)
    for d in new:
        d.stop()
