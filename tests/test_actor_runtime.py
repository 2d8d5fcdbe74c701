"""The actor runtime: delivery, request-reply, supervision (nothing hangs), shutdown, tracing.

Every wait that would hang without supervision sits under `anyio.fail_after`, so a broken
supervisor fails the test instead of stalling the suite.
"""

from __future__ import annotations

import threading

import anyio
import msgspec
import pytest

from freetoken.actors.runtime import Actor, ActorSystem, Outbox, Reply, handles
from freetoken.errors import EngineError, RequestError
from freetoken.trace import TraceRecorder

pytestmark = pytest.mark.anyio
LIMIT = 5  # seconds; only reached when something hangs


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # what uvicorn runs on


class Add(msgspec.Struct):
    n: int


class Get(msgspec.Struct):
    reply: Reply[int]


class Park(msgspec.Struct):
    """The actor keeps the reply to answer later (like a request waiting for its batch)."""

    reply: Reply[int]


class Gate(msgspec.Struct):
    """The handler signals `entered`, waits for `release`, then raises if `crash`."""

    entered: Reply[None]
    release: anyio.Event
    crash: bool = False


class Stream(msgspec.Struct):
    n: int
    out: Outbox[int]
    crash: bool = False


class Invalid(msgspec.Struct):
    reply: Reply[int]


class Unhandled(msgspec.Struct):
    pass


class Counter(Actor):
    def __init__(self, name: str = "counter", mailbox_size: int = 64) -> None:
        super().__init__(name, mailbox_size=mailbox_size)
        self.total = 0
        self.parked: list[Reply[int]] = []
        self.stopped = False

    @handles(Add)
    async def on_add(self, msg: Add) -> None:
        self.total += msg.n

    @handles(Get)
    async def on_get(self, msg: Get) -> None:
        msg.reply.set(self.total)

    @handles(Park)
    async def on_park(self, msg: Park) -> None:
        self.parked.append(msg.reply)

    @handles(Invalid)
    async def on_invalid(self, msg: Invalid) -> None:
        msg.reply.fail(RequestError("n: must be positive", param="n"))

    @handles(Gate)
    async def on_gate(self, msg: Gate) -> None:
        msg.entered.set(None)
        await msg.release.wait()
        if msg.crash:
            raise RuntimeError("boom")

    @handles(Stream)
    async def on_stream(self, msg: Stream) -> None:
        for i in range(msg.n):
            msg.out.put(i)
        if msg.crash:
            raise RuntimeError("boom mid-stream")
        msg.out.close()

    async def on_stop(self) -> None:
        self.stopped = True


async def test_round_trip_and_request_reply() -> None:
    async with ActorSystem() as system:
        counter = system.spawn(Counter())
        await counter.send(Add(2))
        counter.send_nowait(Add(3))
        reply: Reply[int] = Reply()
        await counter.send(Get(reply))
        with anyio.fail_after(LIMIT):
            assert await reply.wait() == 5
            assert await counter.ask(lambda r: Get(r)) == 5
            # A handler's deliberate failure reaches the caller as is; the actor lives on.
            with pytest.raises(RequestError, match="must be positive"):
                await counter.ask(lambda r: Invalid(r))
        assert system.health() == {"counter": "running"}
        with pytest.raises(TypeError, match="Unhandled"):
            await counter.send(Unhandled())
    assert counter.stopped and system.health() == {"counter": "stopped"}


async def test_crash_fails_held_and_queued_replies() -> None:
    failures: list[tuple[str, BaseException]] = []
    async with ActorSystem(on_failure=lambda a, e: failures.append((a.name, e))) as system:
        counter = system.spawn(Counter())
        other = system.spawn(Counter("other"))
        parked: Reply[int] = Reply()
        await counter.send(Park(parked))
        entered: Reply[None] = Reply()
        release = anyio.Event()
        await counter.send(Gate(entered, release, crash=True))
        queued: Reply[int] = Reply()
        with anyio.fail_after(LIMIT):
            await entered.wait()
            await counter.send(Get(queued))  # waits in the mailbox behind the crashing handler
            release.set()
            for reply in (parked, queued):
                with pytest.raises(EngineError, match="counter failed: RuntimeError: boom") as info:
                    await reply.wait()
                assert isinstance(info.value.__cause__, RuntimeError)
        assert [name for name, _ in failures] == ["counter"]
        assert system.health() == {"counter": "failed: RuntimeError: boom", "other": "running"}
        assert not system.healthy
        # No silent restart: later sends fail at once; the rest of the system keeps serving.
        with pytest.raises(EngineError, match="counter failed"):
            await counter.send(Add(1))
        with pytest.raises(EngineError, match="counter failed"):
            counter.send_nowait(Add(1))
        with anyio.fail_after(LIMIT):
            assert await other.ask(lambda r: Get(r)) == 0
    assert counter.stopped


async def test_kill_from_failure_callback_cascades() -> None:
    async with ActorSystem() as system:
        scheduler = system.spawn(Counter("scheduler"))
        runner = system.spawn(Counter("runner"))
        system.on_failure = lambda actor, exc: system.kill(scheduler, EngineError(f"{actor.name} died"))
        waiting: Reply[int] = Reply()
        await scheduler.send(Park(waiting))
        entered: Reply[None] = Reply()
        release = anyio.Event()
        await runner.send(Gate(entered, release, crash=True))
        with anyio.fail_after(LIMIT):
            await entered.wait()
            release.set()
            with pytest.raises(EngineError, match="runner died"):
                await waiting.wait()
        assert system.health()["scheduler"].startswith("failed: EngineError")


async def test_shutdown_fails_pending_messages_and_blocked_senders() -> None:
    blocked_result: list[BaseException] = []

    async def blocked_sender(actor: Actor) -> None:
        try:
            await actor.send(Add(1))
        except EngineError as exc:
            blocked_result.append(exc)

    async with anyio.create_task_group() as outside:
        async with ActorSystem() as system:
            counter = system.spawn(Counter(mailbox_size=1))
            entered: Reply[None] = Reply()
            await counter.send(Gate(entered, anyio.Event()))  # never released
            queued: Reply[int] = Reply()
            with anyio.fail_after(LIMIT):
                await entered.wait()
                await counter.send(Get(queued))  # fills the mailbox
                outside.start_soon(blocked_sender, counter)
                await anyio.wait_all_tasks_blocked()
            assert counter._tx.statistics().tasks_waiting_send == 1
    with anyio.fail_after(LIMIT):
        with pytest.raises(EngineError, match="counter is stopped"):
            await queued.wait()
    assert len(blocked_result) == 1
    assert counter.stopped and system.health() == {"counter": "stopped"}
    with pytest.raises(EngineError, match="stopped"):
        await counter.send(Add(1))


async def test_error_in_body_propagates_unwrapped_and_stops_actors() -> None:
    with pytest.raises(KeyError, match="body"):
        async with ActorSystem() as system:
            counter = system.spawn(Counter())
            raise KeyError("body")
    assert counter.stopped and system.health() == {"counter": "stopped"}
    with pytest.raises(RuntimeError, match="running ActorSystem"):
        system.spawn(Counter("late"))


async def test_outbox_streams_then_fails_on_crash() -> None:
    async with ActorSystem() as system:
        counter = system.spawn(Counter())
        with anyio.fail_after(LIMIT):
            out: Outbox[int] = Outbox()
            await counter.send(Stream(3, out))
            assert [i async for i in out] == [0, 1, 2]

            out = Outbox()
            await counter.send(Stream(2, out, crash=True))
            got = []
            with pytest.raises(EngineError, match="boom mid-stream"):
                async for i in out:
                    got.append(i)
            assert got == [0, 1]  # events put before the crash still arrive, in order


async def test_outbox_consumer_leaving_is_seen_by_producer() -> None:
    out: Outbox[int] = Outbox()
    assert out.put(1)
    await out.aclose()
    assert out.consumer_gone
    assert not out.put(2)
    assert out.done


async def test_tracing_records_one_span_per_message() -> None:
    recorder = TraceRecorder()
    async with ActorSystem(recorder=recorder) as system:
        counter = system.spawn(Counter())
        await counter.send(Add(1))
        with anyio.fail_after(LIMIT):
            await counter.ask(lambda r: Get(r))
    events = recorder.to_chrome()["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [(tracks[e["tid"]], e["name"]) for e in events if e["ph"] == "X"]
    assert spans == [("counter", "Add"), ("counter", "Get")]
    assert any(e["ph"] == "C" and e["name"] == "counter/mailbox" for e in events)


async def test_tracing_off_records_nothing() -> None:
    recorder = TraceRecorder(enabled=False)
    async with ActorSystem(recorder=recorder) as system:
        counter = system.spawn(Counter())
        with anyio.fail_after(LIMIT):
            await counter.ask(lambda r: Get(r))
    assert [e for e in recorder.to_chrome()["traceEvents"] if e["ph"] != "M"] == []


class Ping(msgspec.Struct):
    n: int


class Player(Actor):
    def __init__(self, name: str, rounds: int, done: Reply[int]) -> None:
        super().__init__(name)
        self.peer: Actor | None = None
        self.rounds = rounds
        self.done = done
        self.seen: list[int] = []

    @handles(Ping)
    async def on_ping(self, msg: Ping) -> None:
        self.seen.append(msg.n)
        if msg.n == self.rounds:
            self.done.set(msg.n)
        else:
            assert self.peer is not None
            await self.peer.send(Ping(msg.n + 1))


async def test_ping_pong_1000() -> None:
    done: Reply[int] = Reply()
    async with ActorSystem() as system:
        a = system.spawn(Player("a", 1000, done))
        b = system.spawn(Player("b", 1000, done))
        a.peer, b.peer = b, a
        await a.send(Ping(0))
        with anyio.fail_after(LIMIT):
            assert await done.wait() == 1000
    assert a.seen == list(range(0, 1001, 2)) and b.seen == list(range(1, 1000, 2))


async def test_run_blocking_is_one_at_a_time_in_order() -> None:
    first_may_finish = threading.Event()
    order: list[str] = []
    loop_thread = threading.get_ident()

    def job(tag: str, wait: threading.Event | None) -> int:
        if wait is not None:
            wait.wait(LIMIT)
        order.append(tag)
        return threading.get_ident()

    async with ActorSystem() as system:
        actor = system.spawn(Counter())
        results: dict[str, int] = {}

        async def run(tag: str, wait: threading.Event | None) -> None:
            results[tag] = await actor.run_blocking(job, tag, wait)

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "first", first_may_finish)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(run, "second", None)
                await anyio.wait_all_tasks_blocked()
                # The second job queues for the actor's thread while the first holds it.
                stats = actor._limiter.statistics()
                assert (stats.borrowed_tokens, stats.tasks_waiting) == (1, 1)
                first_may_finish.set()
    assert order == ["first", "second"]
    assert loop_thread not in results.values()


def test_a_handler_cannot_shadow_a_runtime_member():
    from freetoken.actors.runtime import Actor

    with pytest.raises(TypeError, match="status"):
        class Shadowing(Actor):  # noqa: F841
            async def status(self, msg) -> None: ...
