"""The steps a node client's call is made of, and the two shells that take them: blocking and asyncio.

Every call of a node client (node_calls.py) is written once, as a generator that does no I/O. It
yields steps (send a message, read its answer, post one without waiting, move pages into or out of
leased slots, run an attempt on the node) and is sent each step's result, or has the step's error
thrown into it, so which messages go in which order, what each answer means and which leases a
failure gives back is decided in one place. `drive` takes the steps with blocking I/O (KVStoreClient,
and the cluster's node clients), `drive_async` awaits them (AsyncKVStoreClient); neither decides
anything. The shape is that of h11 and httpcore: protocol logic with no I/O, under thin shells.

Two levels:
- a call (node_calls.put, ...) yields OnNode steps: run this attempt on a standing connection, and
  once more on a new one if the node was lost under it and `retry()` says the attempt may be repeated
  (the shell owns connections, deadlines and reconnects);
- an attempt (pipeline.PutBatch.steps, lookup.leading_hits, ...) is given the connection to read what
  Hello set up (`conn.hello.limits`, `conn.namespace_ids`, `conn.data.shape` and `.rdma_qp_num`,
  `conn.control.answers_in_order`) and yields the message and page steps below.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Generator, TypeVar

from kvstore_client import errors

T = TypeVar("T")
Steps = Generator[Any, Any, T]   # a call or an attempt: yields steps, is sent their results, returns T

CONTROL, GRPC = "control", "grpc"


@dataclasses.dataclass(frozen=True)
class Send:
    """Send a message; the result is its pending answer, for Answer. `over`: the connection's control channel
    (the local socket, answered in order, or gRPC), or its gRPC channel whatever the control channel is."""

    method: str
    request: Any
    over: str = CONTROL


@dataclasses.dataclass(frozen=True)
class Answer:
    """Wait for a sent message's answer: the result is the response; a refusal is raised into the call."""

    pending: Any


@dataclasses.dataclass(frozen=True)
class Post:
    """Send a message on the control channel without waiting for its answer (a refusal is logged)."""

    method: str
    request: Any


@dataclasses.dataclass(frozen=True)
class PutPages:
    """Copy pages into a write lease's slots; the result is the checksums taken while copying, or None. `ahead`:
    where the data path can, a move copied with the node comes back as an assisted_copy.MoveInFlight, for a
    Commit sent before its answer is read (then Settle it)."""

    lease_id: int
    token: bytes
    pages: Any
    page_bytes: int
    ahead: bool = False


@dataclasses.dataclass(frozen=True)
class Settle:
    """Read the node's answer to a MoveInFlight (MoveInFlight.settle: at most once); the result is None."""

    move: Any


@dataclasses.dataclass(frozen=True)
class GetPages:
    """Copy a read lease's pages out; the result is the checksums of what landed, or None."""

    lease_id: int
    token: bytes
    pages: Any
    page_bytes: int


@dataclasses.dataclass(frozen=True)
class OnNode:
    """Run attempt(conn) on a standing connection; the result is what the attempt returns. If the node was lost
    under it and retry() (or retry, a bool), it runs once more on a new connection. `needs_data`: the attempt
    moves pages, so a connection with no data plane refuses it (TransportUnavailable)."""

    attempt: Callable[[Any], Steps]
    retry: bool | Callable[[], bool] = True
    needs_data: bool = False

    def may_retry(self) -> bool:
        return self.retry() if callable(self.retry) else self.retry


def call(method: str, request: Any, over: str = CONTROL) -> Steps:
    """Send a message and wait for its answer: `answer = yield from call(...)`."""
    return (yield Answer((yield Send(method, request, over))))


def drive(steps: Steps, take: Callable[[Any], Any]) -> Any:
    """Run a call or an attempt to its end, each step taken by take(step) (blocking)."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value
        error = None
        try:
            result = take(step)
        except BaseException as exc:   # into the call, which gives back what it holds and raises it (or not)
            result, error = None, exc


def drive_together(runs: list[tuple[Steps, Callable[[Any], Any]]]) -> list[tuple[Any, BaseException | None]]:
    """Drive several attempts from one thread, one step of each in turn, each step taken by its own take
    (attempts on different connections): every message of every attempt goes out before any is awaited, with
    no thread handed the work. Each attempt ends as (result, None) or, where it raised, (None, error)."""
    outcomes: list[tuple[Any, BaseException | None]] = [(None, None)] * len(runs)
    sent: list[tuple[Any, BaseException | None]] = [(None, None)] * len(runs)   # each one's last step's result
    live = list(range(len(runs)))
    while live:
        for i in list(live):
            steps, take = runs[i]
            result, error = sent[i]
            try:
                step = steps.send(result) if error is None else steps.throw(error)
            except StopIteration as done:
                outcomes[i] = (done.value, None)
                live.remove(i)
                continue
            except Exception as exc:
                outcomes[i] = (None, exc)
                live.remove(i)
                continue
            try:
                sent[i] = (take(step), None)
            except BaseException as exc:   # into the attempt, as drive() does
                sent[i] = (None, exc)
    return outcomes


async def drive_async(steps: Steps, take: Callable[[Any], Any]) -> Any:
    """drive(), each step awaited: await take(step)."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value
        error = None
        try:
            result = await take(step)
        except BaseException as exc:
            result, error = None, exc


def take_on(conn: Any) -> Callable[[Any], Any]:
    """The blocking shell of an attempt's steps on a connection (connection.NodeConnection, or any object with
    its control, grpc and data)."""
    def take(step: Any) -> Any:
        if isinstance(step, Send):
            return (conn.grpc if step.over == GRPC else conn.control).submit(step.method, step.request)
        if isinstance(step, Answer):
            return step.pending.result()
        if isinstance(step, Post):
            return conn.control.post(step.method, step.request)
        if isinstance(step, PutPages):
            put = getattr(conn.data, "put_ahead", conn.data.put) if step.ahead else conn.data.put
            return put(step.lease_id, step.token, step.pages, step.page_bytes)
        if isinstance(step, GetPages):
            return conn.data.get(step.lease_id, step.token, step.pages, step.page_bytes)
        if isinstance(step, Settle):
            return step.move.settle()
        raise TypeError(f"an attempt yielded {step!r}, which is no step of one")
    return take


def take_async_on(conn: Any) -> Callable[[Any], Any]:
    """The asyncio shell of an attempt's steps on a connection (async_client's): a Send's pending answer is a
    future settled in the background, so every message an attempt sends ahead is on its way at once."""
    async def take(step: Any) -> Any:
        if isinstance(step, Send):
            pending = (conn.grpc if step.over == GRPC else conn.control).submit(step.method, step.request,
                                                                                 conn.timeout_s)
            pending.add_done_callback(_seen)
            return pending
        if isinstance(step, Answer):
            return await step.pending
        if isinstance(step, Post):
            return conn.control.post(step.method, step.request)
        if isinstance(step, PutPages):
            return await conn.data.put(step.lease_id, step.token, step.pages, step.page_bytes)
        if isinstance(step, GetPages):
            return await conn.data.get(step.lease_id, step.token, step.pages, step.page_bytes)
        raise TypeError(f"an attempt yielded {step!r}, which is no step of one")
    return take


def lost_under(exc: errors.KVStoreError, conn: Any) -> errors.KVStoreError:
    """What an attempt's error is reported as: Unavailable when the connection was lost under it, else itself.

    A restarted node may answer a call with what only makes sense there (a lease it never gave:
    LeaseNotFound); the connection then reads as lost, and the call as Unavailable (which a shell may
    retry). A deadline is not a lost node: DeadlineExceeded stays as it is.
    """
    if isinstance(exc, (errors.Unavailable, errors.DeadlineExceeded)) or conn.alive():
        return exc
    return errors.Unavailable(f"the connection to the node was lost during the call ({type(exc).__name__}: {exc})")


def _seen(answer: asyncio.Future) -> None:
    """An answer an attempt never read (it failed first, or stopped at a short part) is not reported as lost."""
    if not answer.cancelled():
        answer.exception()
