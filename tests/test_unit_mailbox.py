"""Unit tests of the Mailbox (nbserve/engine/requests.py), which carries events from the engine
thread to an async caller, and of `count_down`. No engine: the abort callable is a recorder."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nbserve.engine.requests import Mailbox, SyncMailbox, count_down
from nbserve.types import Delta, ErrorEvent, Finished, Started, Usage


class AbortRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request_id: str, why: str) -> None:
        self.calls.append((request_id, why))


class Clock:
    """A monotonic clock the test moves by hand: a mailbox's grace time without sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def delta(i: int) -> Delta:
    return Delta(0, str(i), [i])


async def until_waiting(box: Mailbox) -> None:
    """Yield to the loop until `get` has published its waiter (it is parked, not re-checking)."""
    for _ in range(100):
        if box.waiter is not None:
            return
        await asyncio.sleep(0)
    raise AssertionError("get() never started waiting")


async def test_an_event_posted_from_another_thread_wakes_a_waiting_get() -> None:
    abort = AbortRecorder()
    box = Mailbox(abort, "r1", asyncio.get_running_loop(), limit=None)
    task = asyncio.ensure_future(box.get())
    await until_waiting(box)
    poster = threading.Thread(target=box.post, args=(delta(7),))
    poster.start()
    ev = await asyncio.wait_for(task, timeout=2)
    poster.join()
    assert ev == delta(7)
    assert box.waiter is None and abort.calls == []


async def test_get_returns_an_event_posted_before_it_without_waiting() -> None:
    box = Mailbox(AbortRecorder(), "r1", asyncio.get_running_loop(), limit=None)
    box.post(delta(1))
    assert await asyncio.wait_for(box.get(), timeout=2) == delta(1)


async def test_events_from_another_thread_arrive_in_order() -> None:
    box = Mailbox(AbortRecorder(), "r1", asyncio.get_running_loop(), limit=None)
    go = threading.Event()

    def engine_thread() -> None:
        go.wait(2)
        for i in range(300):
            box.post(delta(i))

    t = threading.Thread(target=engine_thread)
    t.start()
    go.set()
    got = [await asyncio.wait_for(box.get(), timeout=2) for _ in range(300)]
    t.join()
    assert [ev.token_ids[0] for ev in got] == list(range(300))


async def test_past_the_backlog_limit_abort_is_called_exactly_once() -> None:
    abort = AbortRecorder()
    box = Mailbox(abort, "slow", asyncio.get_running_loop(), limit=3)
    for i in range(3):
        box.post(delta(i))
    assert abort.calls == []  # exactly at the limit is still fine
    box.post(delta(3))
    assert abort.calls == [("slow", "backlog")]
    for i in range(4, 20):
        box.post(delta(i))
    assert abort.calls == [("slow", "backlog")]
    # Nothing is dropped: the caller still reads every event, in order.
    got = [await box.get() for _ in range(20)]
    assert [ev.token_ids[0] for ev in got] == list(range(20))


async def test_events_read_in_time_never_trip_the_backlog() -> None:
    abort = AbortRecorder()
    box = Mailbox(abort, "r", asyncio.get_running_loop(), limit=2)
    for i in range(50):
        box.post(delta(i))
        box.post(delta(i))
        await box.get()
        await box.get()
    assert abort.calls == []


async def test_a_backlog_over_the_limit_is_not_too_slow_within_the_grace_time() -> None:
    """A caller's loop late for a moment (events piled far past the limit, the oldest 0.9 s
    old with a grace of 1 s) catches up: no abort, then or later."""
    abort, clock = AbortRecorder(), Clock()
    box = Mailbox(abort, "late", asyncio.get_running_loop(), limit=4, grace=1.0, clock=clock)
    for i in range(100):
        box.post(delta(i))
        clock.now += 0.009
    assert abort.calls == []
    got = [await box.get() for _ in range(100)]
    assert [ev.token_ids[0] for ev in got] == list(range(100))
    clock.now += 60  # long after: what it read no longer counts
    for i in range(4):
        box.post(delta(i))
    assert abort.calls == []


async def test_a_reader_late_by_a_steady_lag_over_the_limit_is_not_too_slow() -> None:
    """Always 20 events behind (limit 4) but taking each within 0.2 s of its post (grace 1 s):
    what it fails to read over time is nothing, so it is never cancelled."""
    abort, clock = AbortRecorder(), Clock()
    box = Mailbox(abort, "lag", asyncio.get_running_loop(), limit=4, grace=1.0, clock=clock)
    for i in range(20):
        box.post(delta(i))
    for i in range(20, 1000):
        clock.now += 0.01
        box.post(delta(i))
        assert (await box.get()).token_ids[0] == i - 20
    assert abort.calls == []


async def test_a_reader_that_stops_is_too_slow_once_its_oldest_event_passes_the_grace() -> None:
    abort, clock = AbortRecorder(), Clock()
    box = Mailbox(abort, "stopped", asyncio.get_running_loop(), limit=4, grace=0.5, clock=clock)
    for i in range(9):
        box.post(delta(i))
        clock.now += 0.0625  # the oldest is 0.5 s old at the ninth post: not more
    assert abort.calls == []
    box.post(delta(9))
    assert abort.calls == [("stopped", "backlog")]
    for i in range(10, 40):
        clock.now += 1
        box.post(delta(i))
    assert abort.calls == [("stopped", "backlog")]  # once
    got = [await box.get() for _ in range(40)]  # nothing is dropped
    assert [ev.token_ids[0] for ev in got] == list(range(40))


async def test_a_few_old_unread_events_under_the_limit_are_not_too_slow() -> None:
    abort, clock = AbortRecorder(), Clock()
    box = Mailbox(abort, "idle", asyncio.get_running_loop(), limit=4, grace=0.5, clock=clock)
    for i in range(4):
        box.post(delta(i))
        clock.now += 10
    assert abort.calls == []


def test_the_sync_mailbox_judges_a_reader_the_same_way() -> None:
    abort, clock = AbortRecorder(), Clock()
    box: SyncMailbox[Delta] = SyncMailbox(abort, "s", limit=2, grace=1.0, clock=clock)
    for i in range(10):  # late for a moment, far past the limit
        box.post(delta(i))
    assert [box.get().token_ids[0] for _ in range(10)] == list(range(10))
    for i in range(10, 20):  # then it stops reading
        clock.now += 0.4
        box.post(delta(i))
    assert abort.calls == [("s", "backlog")]
    assert [box.get().token_ids[0] for _ in range(10)] == list(range(10, 20))


async def test_no_limit_never_aborts() -> None:
    abort = AbortRecorder()
    box = Mailbox(abort, "r", asyncio.get_running_loop(), limit=None)
    for i in range(2000):
        box.post(delta(i))
    assert abort.calls == []


def test_a_closed_caller_loop_makes_post_abort_with_cancel() -> None:
    abort = AbortRecorder()
    loop = asyncio.new_event_loop()
    box = Mailbox(abort, "gone", loop, limit=None)
    task = loop.create_task(box.get())
    loop.run_until_complete(until_waiting(box))  # get() is parked on its waiter
    loop.close()  # the caller's loop goes away with get() still waiting
    box.post(delta(1))
    assert abort.calls == [("gone", "cancel")]
    task._log_destroy_pending = False  # a task of a closed loop: expected, not worth a log


# ----------------------------------------------------------------------------- count_down


USAGE = Usage(3, 2, 0)


@pytest.mark.parametrize(("remaining", "event", "expected"), [
    (2, Started("r", 3, 0), (2, False)),
    (2, Delta(0, "x", [1]), (2, False)),
    (2, Finished(0, "stop", USAGE), (1, False)),
    (1, Finished(1, "length", USAGE), (0, True)),
    (3, ErrorEvent("boom"), (3, True)),  # an error ends the request whatever is left
])
def test_count_down(remaining: int, event: object, expected: tuple[int, bool]) -> None:
    assert count_down(remaining, event) == expected


def test_count_down_ends_after_every_choice_finished() -> None:
    remaining, finished, seen = 3, False, 0
    events = [Started("r", 1, 0), Delta(0, "a", [1]), Finished(0, "stop", USAGE),
              Delta(1, "b", [2]), Finished(2, "stop", USAGE), Finished(1, "length", USAGE),
              Delta(0, "late", [3])]
    for ev in events:
        remaining, finished = count_down(remaining, ev)
        seen += 1
        if finished:
            break
    assert (remaining, finished, seen) == (0, True, 6)


async def test_a_steps_wakeups_go_out_as_one_call_per_loop() -> None:
    """gathered_wakeups: sixteen waiting callers on one loop, one call_soon_threadsafe (each
    call writes to the loop's wake-up pipe); every caller still gets its event."""
    from nbserve.engine.requests import gathered_wakeups

    loop = asyncio.get_running_loop()
    boxes = [Mailbox(AbortRecorder(), f"r{i}", loop, limit=None) for i in range(16)]
    tasks = [asyncio.ensure_future(b.get()) for b in boxes]
    for b in boxes:
        await until_waiting(b)
    calls = []
    real = loop.call_soon_threadsafe

    def counting(*args):
        calls.append(args[0].__name__)
        return real(*args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        def engine_step() -> None:
            with gathered_wakeups():
                for i, b in enumerate(boxes):
                    b.post(delta(i))
                    b.post(delta(100 + i))  # a second event of one caller: one wake-up
                with gathered_wakeups():  # nested: the outer one sends
                    pass
                assert calls == []  # nothing sent before the end

        t = threading.Thread(target=engine_step)
        t.start()
        got = await asyncio.wait_for(asyncio.gather(*tasks), timeout=2)
        t.join()
    finally:
        del loop.call_soon_threadsafe
    assert calls == ["wake_waiters"]
    assert [ev.token_ids[0] for ev in got] == list(range(16))
    assert [(await b.get()).token_ids[0] for b in boxes] == [100 + i for i in range(16)]


def test_gathered_wakeups_to_a_closed_loop_abort_its_requests() -> None:
    from nbserve.engine.requests import gathered_wakeups

    loop = asyncio.new_event_loop()
    abort = AbortRecorder()
    box = Mailbox(abort, "gone", loop, limit=None)
    box.waiter = loop.create_future()  # a caller that was waiting when its loop closed
    loop.close()
    with gathered_wakeups():
        box.post(delta(1))
        assert abort.calls == []
    assert abort.calls == [("gone", "cancel")]
