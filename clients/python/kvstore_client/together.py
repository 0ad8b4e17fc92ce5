"""One read call asked of several nodes at once from the calling thread: a cluster's residency.

The cluster's other fan-outs hand each node's call to a thread of its pool. A residency query asks every
member about the whole chain (8192 keys for a 128k-token prompt, in 4 Lookups each), and on a host with
few cores the hand-offs, and the threads contending for the interpreter, cost more than the Lookups: with
three nodes on two cores, a third of the client's CPU time. Here each member's attempt is driven from
this thread instead, one step of each in turn (node_steps.drive_together): every member has its first
part before any has its second, a token chain's next part is hashed while the nodes look up the one
before (lookup.SharedTokenChain), and an answer is awaited only once every message is on its way.

For calls of one attempt that only exchange messages (no pages move, so nothing is written into a
caller's buffer). A member lost before or under its attempt is asked once more on its own, through its
client, which reconnects as for any call; one still lost answers None. Any other error is raised once
every attempt ended.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, TypeVar

from kvstore_client import errors
from kvstore_client.channel import call_deadline
from kvstore_client.client import KVStoreClient
from kvstore_client.node_steps import OnNode, Steps, drive_together, lost_under, take_on

log = logging.getLogger(__name__)

T = TypeVar("T")


def ask_together(clients: Mapping[str, KVStoreClient], make_call: Callable[[], Steps[T]],
                 node_lost: tuple[type[BaseException], ...], timeout_s: float | None) -> dict[str, T | None]:
    """make_call() (a node call of one attempt, node_calls.py) on each client, by node id, driven together;
    an error in `node_lost` makes that node's answer None."""
    answers: dict[str, T | None] = {}
    asked = []   # (node id, client, its call, why its connection could not be entered, or None)
    runs, conns = [], []
    with call_deadline(timeout_s):
        try:
            for node_id, client in clients.items():
                call = make_call()
                try:
                    step = call.send(None)
                except StopIteration as done:   # answered without the node (an empty chain)
                    answers[node_id] = done.value
                    continue
                if not isinstance(step, OnNode) or step.needs_data:
                    raise TypeError(f"ask_together takes calls of one attempt that move no pages, not {step!r}")
                try:
                    conn = client._enter_connection()
                except node_lost as exc:
                    asked.append((node_id, client, call, exc))
                    continue
                asked.append((node_id, client, call, None))
                conns.append(conn)
                runs.append((step.attempt(conn), take_on(conn)))
            # an error is read against its connection (lost under the attempt?) before the connection is left
            outcomes = iter([(result, lost_under(error, conn) if isinstance(error, errors.KVStoreError) else error)
                             for (result, error), conn in zip(drive_together(runs), conns)])
        finally:   # no attempt runs on now
            for conn in conns:
                conn.leave()
        failure: BaseException | None = None
        for node_id, client, call, unreached in asked:
            result, error = (None, unreached) if unreached is not None else next(outcomes)
            if error is None:
                answers[node_id] = _finish(call, result)
            elif isinstance(error, node_lost):
                log.info("node %s was lost (%s: %s): asked again on its own", node_id, type(error).__name__, error)
                answers[node_id] = _alone(client, make_call, node_lost)
            else:
                failure = failure or error
    if failure is not None:
        raise failure
    return answers


def _finish(call: Steps[T], result: object) -> T:
    """The call's answer from its one attempt's result."""
    try:
        step = call.send(result)
    except StopIteration as done:
        return done.value
    raise TypeError(f"ask_together takes calls of one attempt; this one went on with {step!r}")


def _alone(client: KVStoreClient, make_call: Callable[[], Steps[T]],
           node_lost: tuple[type[BaseException], ...]) -> T | None:
    """The call on one node the ordinary way (its client reconnects once); None while it is still lost."""
    try:
        return client._run(make_call(), None)   # within the deadline of the call_deadline block around it
    except node_lost as exc:
        log.info("a node did not answer (%s: %s): counted as a miss", type(exc).__name__, exc)
        return None
