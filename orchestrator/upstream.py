"""Connections to the model services: replica pools, one link (a stream carrying every session's
steps) per replica, and sessions that reopen themselves.

A session is pinned to one replica, because its cache lives there. When the replica answers
CACHE_MISS, or the session or its link is lost (restart, eviction, drain), the session is reopened (on
another replica when one is up) and the step is resent with keep = 0 and the full sequence: the
client notices nothing but the cost of one prefill.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import grpc
import structlog

from orchestrator.context import Context
from orchestrator.link import Link, LinkLost, LinkMessages, result_failure
from orchestrator.routing import PrefixIndex, Route, preferred
from orchestrator.step_timing import StepClock
from serving.errors import HANDLER_INTERNAL_PREFIX, ServiceError, unavailable
from serving.server import CHANNEL_OPTIONS
from serving.tensors import WireFormatError
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)

# A replica that failed is avoided for this long when another one is up.
_FAILURE_COOLDOWN_S = 5.0
# Statuses that mean "this replica, this session" rather than "this request": reopen and resend.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


class DraftAvailability:
    """Shared by all requests: after a fault of the draft service itself (unreachable, too slow, a lost
    stream, rows that are not distributions), nobody drafts until `retry_after_s` has passed. A
    request's own errors never get here (the isolation rule: see `is_draft_fault`)."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        self._down_until = 0.0

    @property
    def usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self) -> None:
        self._down_until = time.monotonic() + self.retry_after_s


# Statuses from the draft that say the draft service itself is at fault. Everything else
# (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, ...) concerns this request or this moment.
_DRAFT_FAULTS = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
}


def is_draft_fault(exc: BaseException) -> bool:
    """Whether a failed draft step marks the draft unavailable for every request."""
    if isinstance(exc, ServiceError):
        return exc.code in _DRAFT_FAULTS
    return isinstance(exc, TimeoutError | WireFormatError)


@dataclass
class Replica:
    """One replica of a model service."""

    address: str
    channel: grpc.aio.Channel
    stub: Any
    active: int = 0  # sessions pinned here now
    failed_at: float = -1e9
    link: Link | None = None  # the stream its sessions share, opened on first use

    def live_link(self, messages: LinkMessages, timeout_s: float) -> Link:
        if self.link is None or self.link.lost is not None:
            self.link = Link(messages.open(self.stub), messages, timeout_s)
        return self.link


def parse_replicas(spec: str) -> tuple[list[str], str | None]:
    """`a:1,b:2` gives a static list; `dns:///name:port` gives a name to resolve (re-resolved)."""
    spec = spec.strip()
    if spec.startswith("dns:///"):
        return [], spec.removeprefix("dns:///")
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"replica address {address!r} must be HOST:PORT")
    return addresses, None


async def resolve(name: str) -> list[str]:
    """All addresses of a DNS name (a headless Service resolves to every ready pod)."""
    host, _, port = name.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    hosts = sorted({str(info[4][0]) for info in infos})
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


@dataclass(frozen=True)
class Dial:
    """How to open a channel to a replica: plaintext, or TLS with these credentials."""

    credentials: grpc.ChannelCredentials | None = None
    server_name: str = ""  # the name to verify in the replica's certificate (replicas are dialled by address)

    def channel(self, address: str) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.aio.secure_channel(address, self.credentials, options=options)


class ReplicaPool:
    """The replicas of one service. A session with a route goes where its prefix is likely cached
    (orchestrator/routing.py) unless that replica is `route_load_slack` sessions busier than the least
    loaded; other sessions, and all of them when `route_load_slack` is None, go to the least pinned."""

    def __init__(
        self,
        name: str,
        spec: str,
        make_stub: Callable[[grpc.aio.Channel], Any],
        messages: LinkMessages,
        resolve_interval_s: float,
        dial: Dial | None = None,
        step_timeout_s: float = 60.0,
        route_load_slack: int | None = None,
    ):
        self.name = name
        self.route_load_slack = route_load_slack
        self.index = PrefixIndex()
        self.messages = messages
        self.step_timeout_s = step_timeout_s  # a step unanswered this long fails with TimeoutError
        self._dial = dial or Dial()
        self._static, self._dns_name = parse_replicas(spec)
        self._make_stub = make_stub
        self._resolve_interval_s = resolve_interval_s
        self._replicas: dict[str, Replica] = {}
        self._retired: list[Replica] = []  # gone from DNS but still serving pinned sessions
        self._resolver: asyncio.Task[None] | None = None
        self.clock = StepClock(name)

    async def start(self) -> None:
        await self.refresh()
        if self._dns_name:
            self._resolver = asyncio.create_task(self._resolve_forever())

    async def refresh(self) -> None:
        addresses = self._static or await resolve(self._dns_name or "")
        for address in addresses:
            if address not in self._replicas:
                channel = self._dial.channel(address)
                self._replicas[address] = Replica(address, channel, self._make_stub(channel))
        gone = [self._replicas.pop(a) for a in list(self._replicas) if a not in addresses]
        for replica in gone:
            self.index.forget(replica.address)
        self._retired += gone
        # A retired replica's channel closes once its last pinned session has ended.
        for replica in [r for r in self._retired if r.active == 0]:
            self._retired.remove(replica)
            await _close(replica)

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self._resolve_interval_s)
            try:
                await self.refresh()
            except OSError as exc:
                log.warning("resolve_failed", service=self.name, error=str(exc))

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def pick(self, avoid: Replica | None = None, route: Route | None = None) -> Replica:
        """A healthy replica, other than `avoid` when there is a choice: the one `route` prefers unless
        it is too busy, else the least pinned."""
        if not self._replicas:
            raise unavailable(f"no {self.name} replicas are known; check --{self.name}")
        now = time.monotonic()
        candidates = [r for r in self._replicas.values() if r is not avoid] or list(self._replicas.values())
        healthy = [r for r in candidates if now - r.failed_at > _FAILURE_COOLDOWN_S] or candidates
        least = min(r.active for r in healthy)
        chosen = random.choice([r for r in healthy if r.active == least])
        if route is not None and self.route_load_slack is not None:
            by_address = {r.address: r for r in healthy}
            best = by_address[preferred(route, self.index, list(by_address))]
            if best.active <= least + self.route_load_slack:
                chosen = best
            self.index.record(route, chosen.address)
        return chosen

    async def close(self) -> None:
        if self._resolver:
            self._resolver.cancel()
        for replica in [*self._replicas.values(), *self._retired]:
            await _close(replica)


async def _close(replica: Replica) -> None:
    if replica.link is not None:
        await replica.link.close()
    await replica.channel.close()


class SessionMessage(Protocol):
    def ByteSize(self) -> int: ...


RequestT = TypeVar("RequestT", bound=SessionMessage)
ResponseT = TypeVar("ResponseT", bound=SessionMessage)


@dataclass
class SessionStream(Generic[RequestT, ResponseT]):
    """One session on one replica of a model service, carried by that replica's link, and reopened
    (on another replica when one is up) when lost.

    The stream alone knows what the replica's cache holds: the first `_matched` tokens of the
    generation's sequence, then `_tail` (a block's tokens, a draft's own). Each step keeps the longest
    prefix of that the new context shares and feeds the rest, so rollback after a rejection, the draft's
    never-fed last token and blocks drafted ahead need no bookkeeping of their own. The sequence only
    grows, so a step compares the tail alone: its cost does not grow with the context."""

    pool: ReplicaPool
    request_id: str
    attempts: int = 4
    backoff_s: float = 0.25
    route: Route | None = None  # where the prompt's prefix is likely cached (None: least pinned)
    reused_tokens: int = 0  # tokens the replicas' prefix caches saved this session
    _matched: int = 0  # the replica's cache holds the sequence's first _matched tokens, then _tail
    _tail: list[int] = field(default_factory=list)
    reopens: int = 0  # times the session was reopened with the full sequence
    wire_bytes: int = 0  # this session's entries and results, on every link it used
    replica: Replica | None = None
    _link: Link | None = field(default=None, repr=False)
    _session: int = 0
    _closed: bool = False
    _answered: float = 0.0  # when the session's last step was answered (0: none since it was opened)

    async def step(
        self,
        context: Context,
        build: Callable[[int], RequestT],
        min_append: int = 1,
        fed_beyond: Callable[[ResponseT], Sequence[int]] | None = None,
    ) -> Stepped[ResponseT]:
        """Send build(keep) for a step that needs `context` fed (keep: what the replica holds of it; at
        least `min_append` tokens are fed anyway) and return the response; on a lost session, reopen and
        resend with keep 0. `fed_beyond(response)` names tokens the step fed after `context` (a draft's
        own tokens); the response's `cached_tokens` says how many of all those the replica now holds."""
        if self._closed:
            raise unavailable(f"the {self.pool.name} session of request {self.request_id} is closed")
        backoff = self.backoff_s
        last_error = ""
        for attempt in range(self.attempts + 1):  # one more for a cache miss on a healthy replica
            if self._link is None:
                self._open()
            assert self._link is not None
            keep = self._keep(context, min_append)
            request = build(keep)
            sent = time.perf_counter()
            try:
                result = await self._link.step(self._session, request)
                failure = result_failure(result)
            except LinkLost as exc:
                failure = exc
            if failure is not None:
                if not _retryable(failure):
                    raise ServiceError(failure.code, f"{self.pool.name} service: {failure.details}")
                last_error = f"{failure.code.name}: {failure.details}"
                log.warning("session_lost", service=self.pool.name, replica=self._address, error=last_error)
                # A cancelled stream (the service closed it for idleness, or drained) is not a sick replica.
                self._drop(failed=failure.code != grpc.StatusCode.CANCELLED)
                if attempt < self.attempts:
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff *= 2
                continue
            response = result.response
            self.wire_bytes += request.ByteSize() + response.ByteSize()
            if response.result == common_pb2.SESSION_RESULT_CACHE_MISS:
                log.info("cache_miss", service=self.pool.name, replica=self._address)
                self._forget()
                self.reopens += 1
                continue
            self.pool.clock.check(response, self._address)
            self.reused_tokens += response.timing.reused_tokens
            answered = time.perf_counter()
            self.pool.clock.account(response.timing, answered - sent, sent - self._answered if self._answered else 0.0)
            self._answered = answered
            cached, base = response.cached_tokens, context.base_len
            self._matched = min(cached, base)
            self._tail = [*context.extra, *(fed_beyond(response) if fed_beyond else ())][: max(cached - base, 0)]
            return Stepped(response, len(context) - keep)
        raise unavailable(
            f"{self.pool.name} service unavailable after {self.attempts} tries ({last_error}); "
            f"check that the {self.pool.name} replicas are running"
        )

    def _keep(self, context: Context, min_append: int) -> int:
        """How much of what the replica holds the step keeps: its common prefix with `context`, leaving
        at least `min_append` tokens to feed."""
        most = len(context) - min_append
        keep, tail = min(self._matched, context.base_len, most), self._tail
        if keep < self._matched:
            return max(keep, 0)
        for token in tail:
            if keep >= most or token != context[keep]:
                break
            keep += 1
        return max(keep, 0)

    def _forget(self) -> None:
        """The replica holds nothing of the session (a new or reopened one): no last answer either."""
        self._matched, self._tail, self._answered = 0, [], 0.0

    @property
    def where(self) -> Place:
        """The session's place now: a row fetch asks there, and only there."""
        return Place(self._link, self._session)

    def reachable(self, place: Place) -> bool:
        """Whether the link a session was at still stands, wherever the session is now."""
        return place.link is not None and place.link.lost is None

    async def fetch(self, place: Place, fetch: Any) -> Any | None:
        """The FetchedRow answering `fetch` from the session at `place`, or None when it is not that
        session any more (reopened since) or its replica does not answer it (lost, timed out, an error)."""
        if place != self.where or self._link is None:
            return None
        try:
            result = await self._link.fetch(self._session, fetch)
        except (LinkLost, TimeoutError) as exc:
            log.warning("row_fetch_failed", service=self.pool.name, replica=self._address, error=str(exc))
            return None
        self.wire_bytes += fetch.ByteSize() + result.ByteSize()
        return result.fetched if result.HasField("fetched") else None

    @property
    def _address(self) -> str:
        return self.replica.address if self.replica else ""

    def _open(self) -> None:
        previous = self.replica
        self.replica = self.pool.pick(avoid=previous, route=self.route)
        self.replica.active += 1
        self._link = self.replica.live_link(self.pool.messages, self.pool.step_timeout_s)
        self._session = self._link.new_session()
        if self._matched or self._tail or previous is not None:
            self.reopens += 1
        self._forget()

    def _drop(self, failed: bool) -> None:
        """Unpin from the replica (kept in self.replica so a reopen can avoid it)."""
        if self._link is None or self.replica is None:
            return
        self._link.close_session(self._session)
        self._link = None
        self.replica.active -= 1
        if failed:
            self.replica.failed_at = time.monotonic()

    def reset(self) -> None:
        """Drop the session after a failure; the next step opens a new one with the full sequence."""
        self._drop(failed=True)
        self._forget()

    def close(self) -> None:
        """End the session (safe inside a cancelled task); the service frees its cache at once."""
        self._closed = True
        self._drop(failed=False)
        self.replica = None


@dataclass(frozen=True)
class Place:
    """Where a session is: its link (one replica's stream) and its id there."""

    link: Link | None
    session: int


@dataclass(frozen=True)
class Stepped(Generic[ResponseT]):
    """A step's answer, and the tokens it fed."""

    response: ResponseT
    fed: int


def _retryable(failure: LinkLost) -> bool:
    """Whether a failed step lost its session or replica (reopen and resend) rather than failed the request.

    A replica that shuts down can reset its streams with an HTTP/2 error, and gRPC reports that as
    INTERNAL ("Internal error from Core"). A handler's own INTERNAL, a server bug, carries the
    handler prefix and is not retried."""
    if failure.code in _RETRYABLE:
        return True
    return failure.code == grpc.StatusCode.INTERNAL and not failure.details.startswith(HANDLER_INTERNAL_PREFIX)
