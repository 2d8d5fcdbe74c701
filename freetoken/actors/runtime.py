"""Actors: one anyio task per resource, a typed mailbox, supervision, request-reply.

Why actors: each resource (the scheduler's queues and KV pages, the GPU runner's device) has
one owner that handles one message at a time, so its state needs no locks.
Why supervision: a crashed actor must turn every request it was serving into an EngineError,
never a hang, and the rest of the process stays up to report it (`ActorSystem.health`).
Policy: a crashed actor is marked failed and stays failed (no silent restart); sends to it
raise EngineError at once.

Replies and outboxes are how requests wait on actors. Whichever actor last received one inside
a message (a top-level field of the message struct) holds it; `Actor.hold` adopts one by hand.
All of this runs on the event loop; worker threads hand results back through `run_blocking`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, ClassVar, Generic, TypeVar, TypeVarTuple

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from freetoken.errors import EngineError
from freetoken.trace import NULL_RECORDER, TraceRecorder

log = logging.getLogger(__name__)
T = TypeVar("T")
Ts = TypeVarTuple("Ts")
H = TypeVar("H", bound=Callable[[Any, Any], Coroutine[Any, Any, None]])
A = TypeVar("A", bound="Actor")


def _held_in(msg: Any) -> list[Held]:
    """The replies and outboxes a message carries in its top-level struct fields."""
    fields = getattr(type(msg), "__struct_fields__", ())
    return [v for v in (getattr(msg, f) for f in fields) if isinstance(v, Held)]


class Held:
    """Something a caller waits on while an actor holds it; failed with EngineError if it dies."""

    _holder: Actor | None = None

    @property
    def done(self) -> bool:
        raise NotImplementedError

    def fail(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _release(self) -> None:
        if self._holder is not None:
            self._holder._held.discard(self)
            self._holder = None


class Reply(Held, Generic[T]):
    """One-shot answer to a request message. The first `set` or `fail` wins (returns True)."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._exc: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def set(self, value: T) -> bool:
        return self._resolve(value, None)

    def fail(self, exc: BaseException) -> bool:
        return self._resolve(None, exc)

    def _resolve(self, value: T | None, exc: BaseException | None) -> bool:
        if self.done:
            return False
        self._value, self._exc = value, exc
        self._event.set()
        self._release()
        return True

    async def wait(self) -> T:
        await self._event.wait()
        if self._exc is not None:
            raise self._exc
        return self._value  # type: ignore[return-value]


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Outbox(Held, Generic[T]):
    """A streaming request's events. `put` never blocks: one slow client must not stall a batch.
    The consumer iterates; `fail` ends the stream with the exception, after the events already
    put. A consumer that stops early calls `aclose`; the producer then sees `put` return False."""

    def __init__(self) -> None:
        self._tx, self._rx = anyio.create_memory_object_stream[Any](math.inf)
        self._ended = False

    @property
    def done(self) -> bool:
        return self._ended

    @property
    def consumer_gone(self) -> bool:
        return self._tx.statistics().open_receive_streams == 0

    def put(self, item: T) -> bool:
        if self.done:
            return False
        try:
            self._tx.send_nowait(item)
            return True
        except anyio.BrokenResourceError:
            self.close()
            return False

    def close(self) -> bool:
        if self.done:
            return False
        self._ended = True
        self._tx.close()
        self._release()
        return True

    def fail(self, exc: BaseException) -> bool:
        if self.done:
            return False
        if not self.consumer_gone:
            self._tx.send_nowait(_Failure(exc))
        return self.close()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        try:
            item = await self._rx.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._rx.close()
            raise StopAsyncIteration from None
        if isinstance(item, _Failure):
            self._rx.close()
            raise item.exc
        return item

    async def aclose(self) -> None:
        self._rx.close()


def handles(*types: type) -> Callable[[H], H]:
    """Mark an actor method as the handler of these message types (dispatch by exact type)."""

    def mark(fn: H) -> H:
        fn._handles = types  # type: ignore[attr-defined]
        return fn

    return mark


_OVERRIDABLE = {"on_start", "on_stop", "handle"}


class Actor:
    """Base of every actor: handlers marked with `@handles(Msg)`, or override `handle`.
    One message at a time, in order; a handler that awaits another actor blocks this mailbox."""

    _handlers: ClassVar[dict[type, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A handler named like a runtime member (`status`, `send`, ...) would silently replace it.
        clash = {
            name for name in vars(cls)
            if name in vars(Actor) and name not in _OVERRIDABLE and not name.startswith("__")
        }
        if clash:
            raise TypeError(f"{cls.__name__} redefines Actor members {sorted(clash)}; rename them")
        table = dict(cls._handlers)  # inherited handlers, by method name so overrides apply
        for attr_name, attr in vars(cls).items():
            for msg_type in getattr(attr, "_handles", ()):
                table[msg_type] = attr_name
        cls._handlers = table

    def __init__(self, name: str | None = None, *, mailbox_size: int = 64) -> None:
        self.name = name or type(self).__name__
        self.trace: TraceRecorder = NULL_RECORDER  # the system's recorder once spawned
        self._mailbox_size = mailbox_size
        self._tx: MemoryObjectSendStream[Any]  # the mailbox, created by spawn
        self._rx: MemoryObjectReceiveStream[Any]
        self._held: set[Held] = set()
        self._limiter = anyio.CapacityLimiter(1)  # blocking work of one actor stays ordered
        self._scope: anyio.CancelScope | None = None
        self._state = "new"  # new -> running -> stopped | failed
        self._error: BaseException | None = None

    # -- what subclasses implement ---------------------------------------------------------
    async def on_start(self) -> None:
        """Runs before the first message (allocate resources, warm up)."""

    async def on_stop(self) -> None:
        """Runs once at the end, after a stop or a crash, shielded from cancellation."""

    async def handle(self, msg: Any) -> None:
        raise TypeError(f"{self.name} has no handler for {type(msg).__name__}")

    # -- what other code calls --------------------------------------------------------------
    @property
    def status(self) -> str:
        if self._state == "failed":
            return f"failed: {type(self._error).__name__}: {self._error}"
        return self._state

    def _check_send(self, msg: Any) -> None:
        if self._state != "running":
            if self._state == "new":
                raise RuntimeError(f"actor {self.name} is not spawned")
            raise self._dead_error()
        if type(msg) not in self._handlers and type(self).handle is Actor.handle:
            raise TypeError(f"{self.name} does not handle {type(msg).__name__}")

    async def send(self, msg: Any) -> None:
        """Enqueue, waiting while the mailbox is full (backpressure)."""
        self._check_send(msg)
        try:
            await self._tx.send(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise self._dead_error() from None

    def send_nowait(self, msg: Any) -> None:
        """Enqueue or raise anyio.WouldBlock when the mailbox is full."""
        self._check_send(msg)
        try:
            self._tx.send_nowait(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise self._dead_error() from None

    async def ask(self, build: Callable[[Reply[T]], Any]) -> T:
        """Request-reply in one call: `n = await counter.ask(lambda r: Get(reply=r))`."""
        reply: Reply[T] = Reply()
        await self.send(build(reply))
        return await reply.wait()

    def hold(self, item: Held) -> None:
        """Make this actor responsible for `item`: it fails with EngineError if this actor dies."""
        if item.done:
            return
        if self._state != "running":
            item.fail(self._dead_error())
            return
        item._release()
        item._holder = self
        self._held.add(item)

    async def run_blocking(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Run blocking work (torch, numba) in a worker thread, one at a time per actor, so the
        event loop stays responsive and this actor's device work stays in submission order."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    # -- the loop ---------------------------------------------------------------------------
    def _dead_error(self) -> EngineError:
        if self._state == "failed":
            err = EngineError(f"actor {self.name} failed: {type(self._error).__name__}: {self._error}")
            err.__cause__ = self._error
            return err
        return EngineError(f"actor {self.name} is stopped")

    async def _deliver(self, msg: Any) -> None:
        for item in _held_in(msg):
            self.hold(item)
        name = self._handlers.get(type(msg))
        if name is None:
            await self.handle(msg)
        else:
            await getattr(self, name)(msg)

    async def _main(self, system: ActorSystem) -> None:
        assert self._scope is not None
        try:
            with self._scope:
                try:
                    await self.on_start()
                    async for msg in self._rx:
                        if self.trace.enabled:
                            depth = self._rx.statistics().current_buffer_used
                            self.trace.counter(self.name, "mailbox", depth)
                            with self.trace.span(self.name, type(msg).__name__):
                                await self._deliver(msg)
                        else:
                            await self._deliver(msg)
                except Exception as exc:
                    self._error = exc
        finally:
            self._finish(system)
            with anyio.CancelScope(shield=True):
                try:
                    await self.on_stop()
                except Exception:
                    log.exception("actor %s: on_stop failed", self.name)

    def _finish(self, system: ActorSystem) -> None:
        """Mark the actor dead and fail everything it held or had queued. Synchronous, so no
        send can slip in between."""
        self._state = "failed" if self._error is not None else "stopped"
        err = self._dead_error()
        self._tx.close()  # senders blocked on a full mailbox get EngineError
        while True:
            try:
                msg = self._rx.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            for item in _held_in(msg):
                item.fail(err)
        self._rx.close()
        held, self._held = self._held, set()
        for item in held:
            item.fail(err)
        if self._error is not None:
            log.error("actor %s failed", self.name, exc_info=self._error)
            if system.on_failure is not None:
                try:
                    system.on_failure(self, self._error)
                except Exception:
                    log.exception("actor %s: failure callback failed", self.name)


class ActorSystem:
    """Runs actors in one task group: `async with ActorSystem() as system: system.spawn(a)`.

    Leaving the block stops every actor: queued and in-flight requests fail with EngineError
    (a handler may be waiting on another actor, so an orderly drain is not well defined; an
    error reaches every client instead). `on_failure(actor, exc)` runs after a crash, e.g. to
    `kill` actors that cannot work without the dead one.
    """

    def __init__(
        self,
        recorder: TraceRecorder = NULL_RECORDER,
        on_failure: Callable[[Actor, BaseException], None] | None = None,
    ) -> None:
        self.recorder = recorder
        self.on_failure = on_failure
        self.actors: dict[str, Actor] = {}
        self._tg: TaskGroup | None = None

    async def __aenter__(self) -> ActorSystem:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._tg is not None
        tg, self._tg = self._tg, None
        tg.cancel_scope.cancel()
        # Actor tasks never raise, so an error from the `async with` body propagates as itself
        # rather than wrapped in an exception group.
        await tg.__aexit__(None, None, None)

    def spawn(self, actor: A) -> A:
        if self._tg is None:
            raise RuntimeError("spawn needs a running ActorSystem (use `async with`)")
        if actor.name in self.actors or actor._state != "new":
            raise ValueError(f"actor {actor.name!r} is already spawned")
        self.actors[actor.name] = actor
        actor.trace = self.recorder
        actor._scope = anyio.CancelScope()
        actor._tx, actor._rx = anyio.create_memory_object_stream[Any](actor._mailbox_size)
        actor._state = "running"
        self._tg.start_soon(actor._main, self, name=f"actor:{actor.name}")
        return actor

    def kill(self, actor: Actor, reason: BaseException) -> None:
        """Fail an actor from outside (as if its handler raised `reason`)."""
        if actor._state == "running" and actor._scope is not None:
            actor._error = reason
            actor._scope.cancel()

    def health(self) -> dict[str, str]:
        """Actor name -> "running", "stopped" or "failed: <error>"."""
        return {name: actor.status for name, actor in self.actors.items()}

    @property
    def healthy(self) -> bool:
        return all(actor.status == "running" for actor in self.actors.values())
