"""Unit tests of the swappable backend behind `Server.update()` (nbserve/serving/backend_ref.py)
with fake backends whose streams the test holds open: new requests go to the new backend at
once, running ones finish on the old one, which is closed (off the loop) when its last request
ends; StoppedBackend refuses. No engine, no server."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from nbserve.serving.backend_ref import StoppedBackend, SwappableBackend, is_backend
from nbserve.types import (
    BackendDefaults,
    BusyError,
    EngineStoppedError,
    Finished,
    Request,
    Started,
    Usage,
)


class FakeBackend(BackendDefaults):
    """A Backend whose requests stay open until the test calls `finish(request_id)`."""

    def __init__(self, name: str, max_context: int = 100):
        self.model_name = name
        self.max_context = max_context  # an engine-only attribute, read through the reference
        self.served: list[str] = []
        self.ended: list[str] = []  # requests whose stream was closed or ran out
        self.close_calls = 0
        self.close_threads: list[threading.Thread] = []
        self.closed = threading.Event()
        self.cancelled = 0
        self._gates: dict[str, asyncio.Event] = {}

    def _gate(self, request_id: str) -> asyncio.Event:
        return self._gates.setdefault(request_id, asyncio.Event())

    def finish(self, request_id: str) -> None:
        self._gate(request_id).set()

    async def generate(self, request: Request) -> AsyncIterator[Any]:
        if request.metadata.get("refuse"):
            raise BusyError("full")
        rid = request.request_id
        self.served.append(rid)
        try:
            yield Started(rid, 1, 0)
            await self._gate(rid).wait()
            yield Finished(0, "stop", Usage(1, 1, 0))
        finally:
            self.ended.append(rid)

    def stats(self) -> dict[str, Any]:
        return {"model": self.model_name, "running": len(self.served) - len(self.ended)}

    def health(self) -> dict[str, Any]:
        return {"ready": True, "model": self.model_name}

    def cancel_all(self) -> int:
        self.cancelled += 1
        return len(self.served) - len(self.ended)

    def close(self) -> None:
        self.close_calls += 1
        self.close_threads.append(threading.current_thread())
        self.closed.set()


def req(rid: str, **metadata: Any) -> Request:
    return Request(prompt="hi", request_id=rid, metadata=metadata)


async def drain(stream: AsyncIterator[Any]) -> list[Any]:
    return [ev async for ev in stream]


async def drain_after_finish(ref: SwappableBackend, backend: FakeBackend, rid: str) -> None:
    backend.finish(rid)
    await drain(ref.generate(req(rid)))


NOT_CLOSED_WAIT = 0.05  # how long to watch for a close that must not come


# ----------------------------------------------------------------------------- swapping


async def test_new_requests_go_to_the_new_backend_running_ones_finish_on_the_old() -> None:
    old, new = FakeBackend("old"), FakeBackend("new")
    ref = SwappableBackend(old)
    s1 = ref.generate(req("r1"))
    assert isinstance(await anext(s1), Started)

    assert ref.swap(new) is old
    assert ref.current is new and ref.model_name == "new"
    assert old.close_calls == 0  # r1 still runs there
    s2 = ref.generate(req("r2"))
    assert isinstance(await anext(s2), Started)
    assert (old.served, new.served) == (["r1"], ["r2"])
    assert ref.in_flight(old) == 1 and ref.in_flight(new) == 1 and ref.in_flight() == 2
    assert ref.stats()["retiring_backends"] == 1

    old.finish("r1")
    assert [type(ev) for ev in await drain(s1)] == [Finished]
    assert old.closed.wait(2), "the old backend was not closed after its last request"
    assert old.close_calls == 1
    assert old.close_threads[0] is not threading.current_thread()  # closed off the loop
    assert ref.in_flight(old) == 0 and "retiring_backends" not in ref.stats()
    assert new.close_calls == 0

    new.finish("r2")
    await drain(s2)
    assert new.close_calls == 0  # the current backend stays open when idle


async def test_the_old_backend_closes_only_after_its_last_request() -> None:
    old, new = FakeBackend("old"), FakeBackend("new")
    ref = SwappableBackend(old)
    s1, s2 = ref.generate(req("r1")), ref.generate(req("r2"))
    await anext(s1)
    await anext(s2)
    ref.swap(new)
    old.finish("r1")
    await drain(s1)
    assert not old.closed.wait(NOT_CLOSED_WAIT)
    assert ref.in_flight(old) == 1
    old.finish("r2")
    await drain(s2)
    assert old.closed.wait(2) and old.close_calls == 1


async def test_a_cancelled_request_on_the_old_backend_also_lets_it_close() -> None:
    old, new = FakeBackend("old"), FakeBackend("new")
    ref = SwappableBackend(old)
    s1 = ref.generate(req("r1"))
    await anext(s1)
    ref.swap(new)
    await s1.aclose()  # the client went away mid-stream
    assert old.ended == ["r1"]  # the old backend's stream was closed (its request aborted)
    assert old.closed.wait(2) and old.close_calls == 1


async def test_an_idle_old_backend_is_closed_at_the_swap() -> None:
    old, new = FakeBackend("old"), FakeBackend("new")
    ref = SwappableBackend(old)
    await drain_after_finish(ref, old, "r0")
    ref.swap(new)
    assert old.close_calls == 1  # at once, in the caller's thread: nothing to wait for
    assert old.close_threads == [threading.current_thread()]


async def test_swap_with_close_old_false_never_closes_the_old_backend() -> None:
    old, new = FakeBackend("old"), FakeBackend("new")
    ref = SwappableBackend(old)
    s1 = ref.generate(req("r1"))
    await anext(s1)
    assert ref.swap(new, close_old=False) is old
    old.finish("r1")
    await drain(s1)
    ref.close()  # closes the current one and any retiring one: old is neither
    assert old.close_calls == 0 and new.close_calls == 1


async def test_swapping_in_the_current_backend_changes_nothing() -> None:
    b = FakeBackend("b")
    ref = SwappableBackend(b)
    assert ref.swap(b) is b
    assert ref.current is b and b.close_calls == 0


async def test_a_request_refused_before_its_first_event_is_not_left_in_flight() -> None:
    old, new = FakeBackend("old"), FakeBackend("new")
    ref = SwappableBackend(old)
    with pytest.raises(BusyError):
        await anext(ref.generate(req("r1", refuse=True)))
    assert ref.in_flight() == 0
    ref.swap(new)
    assert old.close_calls == 1  # nothing held it open


async def test_swapping_back_to_a_draining_backend_keeps_it_open() -> None:
    a, b = FakeBackend("a"), FakeBackend("b")
    ref = SwappableBackend(a)
    s1 = ref.generate(req("r1"))
    await anext(s1)
    ref.swap(b)  # a drains r1
    ref.swap(a)  # and serves again: b is idle and closed
    assert ref.current is a and b.close_calls == 1
    a.finish("r1")
    await drain(s1)
    assert not a.closed.wait(NOT_CLOSED_WAIT), "the current backend was closed"


# ----------------------------------------------------------------------------- the rest of it


async def test_engine_attributes_come_from_the_current_backend() -> None:
    old, new = FakeBackend("old", max_context=100), FakeBackend("new", max_context=200)
    ref = SwappableBackend(old)
    assert ref.max_context == 100 and ref.health()["model"] == "old"
    assert ref.stats()["model"] == "old"
    ref.swap(new)
    assert ref.max_context == 200 and ref.health()["model"] == "new"
    with pytest.raises(AttributeError):
        getattr(ref, "_gates")  # noqa: B009 - private names are not forwarded
    with pytest.raises(AttributeError):
        getattr(ref, "no_such_attribute")  # noqa: B009
    assert is_backend(ref)


async def test_cancel_all_reaches_the_current_and_the_retiring_backends() -> None:
    old, new = FakeBackend("old"), FakeBackend("new")
    ref = SwappableBackend(old)
    s1 = ref.generate(req("r1"))
    await anext(s1)
    ref.swap(new)
    s2 = ref.generate(req("r2"))
    await anext(s2)
    assert ref.cancel_all() == 2
    assert old.cancelled == 1 and new.cancelled == 1
    for b, s, rid in ((old, s1, "r1"), (new, s2, "r2")):
        b.finish(rid)
        await drain(s)


async def test_close_closes_every_backend_and_then_refuses() -> None:
    old, new = FakeBackend("old"), FakeBackend("new")
    ref = SwappableBackend(old)
    s1 = ref.generate(req("r1"))
    await anext(s1)
    ref.swap(new)
    ref.close()
    assert old.close_calls == 1 and new.close_calls == 1
    assert ref.model_name == "new"  # still named, for messages and /v1/models
    assert ref.health()["ready"] is False and ref.stats()["stopped"] is True
    with pytest.raises(EngineStoppedError):
        await anext(ref.generate(req("r3")))
    with pytest.raises(RuntimeError, match="stopped"):
        ref.swap(FakeBackend("newer"))
    old.finish("r1")
    await drain(s1)  # a request that outlived the close ends without closing old again
    assert old.close_calls == 1


async def test_close_can_leave_the_current_backend_open() -> None:
    b = FakeBackend("b")
    ref = SwappableBackend(b)
    ref.close(close_current=False)
    assert b.close_calls == 0
    with pytest.raises(EngineStoppedError):
        await anext(ref.generate(req("r1")))
    ref.close()  # idempotent
    assert b.close_calls == 0


async def test_stopped_backend_refuses_every_request() -> None:
    stopped = StoppedBackend("m")
    assert is_backend(stopped) and stopped.model_name == "m"
    with pytest.raises(EngineStoppedError, match="stopped"):
        await anext(stopped.generate(req("r1")))
    assert stopped.health() == {"ready": False, "status": "stopped", "model": "m"}
    assert stopped.stats()["stopped"] is True
    stopped.close()
    with pytest.raises(EngineStoppedError):
        await anext(stopped.generate(req("r2")))


def test_create_app_takes_an_object_with_every_backend_member() -> None:
    from nbserve.serving.app import create_app

    create_app(FakeBackend("m"), ui=False)  # BackendDefaults gives the optional members
    with pytest.raises(TypeError, match="nbserve.types.Backend"):
        create_app(object(), ui=False)  # type: ignore[arg-type]
