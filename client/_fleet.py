"""``Fleet``: one client for many agents (the ranks of a training job) or serving replicas.

Each call fans out to every target concurrently, one :class:`Client` per
target, and merges what came back into one :class:`FleetResult`: every item
tagged with its target and, where the server is a training agent, its rank.
A target that is down, refuses or times out becomes a :class:`FleetError` in
the result instead of failing the others, so one dead rank never blinds a
dashboard to the rest. :meth:`Fleet.watch` merges the members' summary
streams into one :class:`FleetStream` the same way.

This module keeps the membership (``dns:`` targets resolved again as replicas
come and go) and the fan-out; the result types are in ``_fleet_result``, the
merged stream in ``_fleet_stream``, the fleet baseline's steps in
``_fleet_baseline``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from ._capture import CaptureOptions
from ._channel import TlsOption
from ._client import DEFAULT_TIMEOUT, Client
from ._errors import ClientClosed, InvalidArgument, LayertapError, ServerUnavailable
from ._fleet_baseline import set_fleet_baseline, spread_fleet_baseline
from ._fleet_result import FleetError, FleetItem, FleetResult
from ._fleet_stream import FleetStream
from ._resolver import DNS_SCHEME, DnsTarget, Resolver, system_resolver
from ._taps import SummaryStream, TapOptions, Unpack
from ._types import BaselineInfo, DriftThresholds, LayerDrift, LayerInfo, ModelMetadata, ServerStats, TapSpec

#: Fleet, and the types its calls return (defined beside it, re-exported for ``layertap``).
__all__ = ["Fleet", "FleetError", "FleetItem", "FleetResult", "FleetStream"]

T = TypeVar("T")

#: Seconds after which a call resolves ``dns:`` targets again.
DEFAULT_RESOLVE_EVERY = 30.0
#: Members called at once.
MAX_PARALLEL = 32


class Fleet:
    """Fans calls out to many layertap agents or serving replicas at once.

    Args:
        targets: ``"host:port"`` of each member (or bare ports for ``127.0.0.1``).
            For a ``torchrun`` job, the ranks' agents listen on a base port
            plus ``LOCAL_RANK``. A ``"dns:///name:port"`` target (alone, or
            in the list) stands for every address the name resolves to: a
            Kubernetes headless Service names every ready replica.
        timeout: Default deadline of each member's call, in seconds.
        token: Bearer token sent to every member; default ``$LAYERTAP_TOKEN``.
        tls: As for :class:`Client`, the same for every member. Members found
            through ``dns:///name:port`` are dialled by address and verified
            against ``name`` (the certificate lists the Service's names).
        resolver: ``(host, port) -> addresses`` for ``dns:`` targets; default
            the system's (``getaddrinfo``). It may raise ``OSError``.
        resolve_every: Seconds after which the next call resolves ``dns:``
            targets again. A member that is unreachable makes the next call
            resolve at once, and :meth:`set_baseline` always does, so it
            installs on every replica found.

    Example:
        >>> with layertap.Fleet(["node0:50061", "node0:50062"]) as fleet:
        ...     for item in fleet.watch("*", point="param_grad", reducers="norm"):
        ...         print(item.rank, item.value.step, item.value.results["norm"].l2)
        >>> with layertap.Fleet("dns:///layertap-headless.ml.svc.cluster.local:50051", tls="ca.pem") as fleet:
        ...     print(fleet.targets)  # one "10.1.2.3:50051" per replica

    Raises:
        InvalidArgument: No target, a target named twice, or a malformed one.
    """

    def __init__(self, targets: str | Sequence[str | int], *, timeout: float = DEFAULT_TIMEOUT,
                 token: str | None = None, tls: TlsOption = None, resolver: Resolver | None = None,
                 resolve_every: float = DEFAULT_RESOLVE_EVERY) -> None:
        if isinstance(targets, str) and targets.startswith(DNS_SCHEME):
            targets = [targets]
        if isinstance(targets, (str, int)) or not targets:
            raise InvalidArgument("targets: give a list of one or more 'host:port' targets, or 'dns:///name:port'")
        if not resolve_every > 0:
            raise InvalidArgument(f"resolve_every must be > 0 seconds, got {resolve_every}")
        self._options: dict[str, Any] = {"timeout": timeout, "token": token, "tls": tls}
        self._resolver = resolver or system_resolver
        self._resolve_every = resolve_every
        self._closed = False
        self._lock = threading.Lock()
        #: Each given target in order: its Client, or the name that stands for many.
        self._sources: list[Client | DnsTarget] = []
        #: Members found behind each dns: target (by its text), in address order.
        self._found: dict[str, list[Client]] = {}
        #: dns: targets with no member now, and why.
        self._unresolved: dict[str, LayertapError] = {}
        self._next_resolve = 0.0
        self._streams: weakref.WeakSet[FleetStream] = weakref.WeakSet()
        #: Ranks learned from the members' metadata; None for serving replicas.
        self._ranks: dict[str, int | None] = {}
        self._pool = ThreadPoolExecutor(max_workers=MAX_PARALLEL, thread_name_prefix="layertap-fleet")
        try:
            for t in targets:
                dns = DnsTarget.parse(t) if isinstance(t, str) else None
                self._sources.append(dns or Client(t, **self._options))
        except BaseException:  # a malformed target: the channels opened so far are closed, not leaked
            self.close()
            raise
        given = [s.text if isinstance(s, DnsTarget) else s.target for s in self._sources]
        if len(set(given)) != len(given):
            self.close()
            raise InvalidArgument(f"targets: each target once, got {given}")
        self._resolve(force=True)

    @property
    def targets(self) -> list[str]:
        """Every member's ``host:port`` now, in target order (``dns:`` members by address)."""
        return [c.target for c in self._members()]

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<layertap.Fleet {len(self.targets)} targets{' closed' if self._closed else ''}>"

    def close(self) -> None:
        """Closes every open :class:`FleetStream` and member channel. Idempotent."""
        self._closed = True
        for stream in list(self._streams):
            stream.close()  # first: a stream closed this way ends quietly, not with a member error each
        with self._lock:
            clients = [s for s in self._sources if not isinstance(s, DnsTarget)]
            clients += [c for found in self._found.values() for c in found]
        for c in clients:
            c.close()
        self._pool.shutdown(wait=False)

    # ------------------------------------------------------------------ members
    def _members(self) -> list[Client]:
        with self._lock:
            return [c for s in self._sources
                    for c in (self._found.get(s.text, []) if isinstance(s, DnsTarget) else [s])]

    def _unresolved_errors(self) -> list[FleetError]:
        with self._lock:
            return [FleetError(text, None, error) for text, error in self._unresolved.items()]

    def _resolve(self, *, force: bool = False) -> None:
        """Resolves the dns: targets when due (see ``resolve_every``), or now with ``force``.

        New addresses become members; members whose address is gone are
        closed. A name that does not resolve keeps the members found before
        (a DNS hiccup never empties a fleet) and, with none, is reported as a
        :class:`FleetError` of every call until it resolves.
        """
        names = [s for s in self._sources if isinstance(s, DnsTarget)]
        with self._lock:
            if not names or self._closed or not (force or time.monotonic() >= self._next_resolve):
                return
            self._next_resolve = time.monotonic() + self._resolve_every
            static = {s.target for s in self._sources if not isinstance(s, DnsTarget)}
        for dns in names:
            try:
                addresses = [a for a in dns.resolve(self._resolver) if a not in static]
            except OSError as exc:
                with self._lock:
                    if not self._found.get(dns.text):
                        self._unresolved[dns.text] = ServerUnavailable(f"{dns.text}: cannot resolve {dns.host}: {exc}")
                continue
            with self._lock:
                old = {c.target: c for c in self._found.get(dns.text, [])}
                kept = {a: old.pop(a) for a in addresses if a in old}
            server_name = dns.host if self._options["tls"] else None
            added = {a: Client(a, tls_server_name=server_name, **self._options) for a in addresses if a not in kept}
            with self._lock:
                self._found[dns.text] = [kept.get(a) or added[a] for a in addresses]
                if addresses:
                    self._unresolved.pop(dns.text, None)
                else:
                    self._unresolved[dns.text] = ServerUnavailable(f"{dns.text}: {dns.host} resolves to no address")
                for gone in old.values():
                    self._ranks.pop(gone.target, None)
            for gone in old.values():  # a replica that left: its channel (and its calls) end
                gone.close()

    def _after_failure(self, errors: Sequence[FleetError]) -> None:
        """An unreachable member: resolve again on the next call (its pod may have moved)."""
        if any(isinstance(e.error, ServerUnavailable) for e in errors):
            with self._lock:
                self._next_resolve = 0.0

    # ------------------------------------------------------------------ fan-out
    def _rank(self, client: Client, timeout: float | None) -> int | None:
        if client.target not in self._ranks:
            self._ranks[client.target] = client.metadata(timeout=timeout).rank
        return self._ranks[client.target]

    def _fan_out(self, call: Callable[[Client], list[T]], timeout: float | None,
                 clients: Sequence[Client] | None = None) -> FleetResult[T]:
        if self._closed:
            raise ClientClosed("this Fleet was closed; create a new one")
        every = clients is None
        if every:
            self._resolve()

        def one(client: Client) -> list[FleetItem[T]] | FleetError:
            try:
                rank = self._rank(client, timeout)
                return [FleetItem(client.target, rank, v) for v in call(client)]
            except LayertapError as exc:
                return FleetError(client.target, self._ranks.get(client.target), exc)

        result: FleetResult[T] = FleetResult()
        for out in self._pool.map(one, self._members() if clients is None else clients):
            if isinstance(out, FleetError):
                result.errors.append(out)
            else:
                result.items.extend(out)
        self._after_failure(result.errors)
        if every:
            result.errors.extend(self._unresolved_errors())
        return result

    def metadata(self, *, timeout: float | None = None) -> FleetResult[ModelMetadata]:
        """Each member's :meth:`Client.metadata` (its rank and world size included)."""
        return self._fan_out(lambda c: [c.metadata(timeout=timeout)], timeout)

    def layers(self, *, timeout: float | None = None) -> FleetResult[LayerInfo]:
        """Every member's layers; the ranks of one job list the same ones."""
        return self._fan_out(lambda c: c.layers(timeout=timeout), timeout)

    def stats(self, *, timeout: float | None = None) -> FleetResult[ServerStats]:
        """One :class:`ServerStats` per member (hooks, passes, subscribers...)."""
        return self._fan_out(lambda c: [c.stats(timeout=timeout)], timeout)

    def drift(self, selector: str = "", *, timeout: float | None = None) -> FleetResult[LayerDrift]:
        """Every member's drift scores, each against its baseline (one shared one after :meth:`set_baseline`)."""
        return self._fan_out(lambda c: c.drift(selector, timeout=timeout), timeout)

    def set_baseline(self, selector: str, *, passes: int = 500, window: int = 50, point: str = "output",
                     thresholds: DriftThresholds | Mapping[str, float] | None = None, name: str | None = None,
                     derive: str = "", wait: float = 600.0, timeout: float | None = None) -> FleetResult[BaselineInfo]:
        """One drift baseline for the whole fleet, installed on every member.

        Every member collects ``passes`` live passes, the members' builders are
        merged exactly (as if one member had seen every pass) and frozen once,
        and that one reference (same edges, same counts) is installed on every
        member; :meth:`drift` then scores each member against it. The steps are
        in ``layertap._fleet_baseline``. A member that fails on the way lands
        in ``errors`` and the reference is built from the others.

        Args:
            selector, passes, window, point, thresholds: As for :meth:`Client.set_baseline`.
            name: Name of the baseline tap on every member (default derived from the selector).
            derive: As for :meth:`Client.set_baseline`: ``"entropy"`` or ``"top1_prob"`` baselines that
                quantity of the tensor on every member (the frozen reference names it), ``""`` the tensor.
            wait: Seconds to wait for every member to collect its passes.
            timeout: Deadline of each call, in seconds.

        Returns:
            The baseline tap and its layers, per member that installed the reference.

        Raises:
            DeadlineExceeded: A member still collecting after ``wait`` seconds
                (the members hold their passes; call again to retry).
            InvalidArgument: A bad selector, passes, window or threshold.
        """
        return self._baseline_steps(lambda members, each, fail: set_fleet_baseline(
            members, each, fail, selector, passes=passes, window=window, point=point, thresholds=thresholds,
            name=name, derive=derive, wait=wait, timeout=timeout), timeout)

    def spread_baseline(self, selector: str, *, window: int = 50, point: str = "output",
                        thresholds: DriftThresholds | Mapping[str, float] | None = None, name: str | None = None,
                        derive: str = "", timeout: float | None = None) -> FleetResult[BaselineInfo]:
        """Copies the fleet baseline of :meth:`set_baseline` to the members that lack it (replicas added since).

        Give the arguments of that :meth:`set_baseline` call (its ``passes``
        and ``wait`` aside): they name the baseline tap (``derive`` included). A member that holds it
        frozen exports its reference, installed unchanged (same edges, same
        counts) on every member without it; the others are left as they are.

        Returns:
            The baseline tap and its layers, per member that got the copy (none: every member had it).

        Raises:
            NotFound: No member holds that baseline frozen.
            InvalidArgument: A bad selector, window or threshold.
        """
        return self._baseline_steps(lambda members, each, fail: spread_fleet_baseline(
            members, each, fail, selector, window=window, point=point, thresholds=thresholds, name=name,
            derive=derive, timeout=timeout), timeout)

    def _baseline_steps(self, steps: Callable[[list[Client], Any, Any], list[tuple[Client, BaselineInfo]]],
                        timeout: float | None) -> FleetResult[BaselineInfo]:
        """Runs a fleet baseline's ``steps`` (``layertap._fleet_baseline``) over every member found now."""
        if self._closed:
            raise ClientClosed("this Fleet was closed; create a new one")
        self._resolve(force=True)  # every replica there is now
        members = self._members()
        errors: list[FleetError] = self._unresolved_errors()

        def each(clients: Sequence[Client], fn: Callable[[Client], Any]) -> list[tuple[Client, Any]]:
            res = self._fan_out(lambda c: [(c, fn(c))], timeout, clients=clients)
            errors.extend(res.errors)
            return [item.value for item in res]

        def fail(client: Client, exc: LayertapError) -> None:
            errors.append(FleetError(client.target, self._ranks.get(client.target), exc))

        installed = steps(members, each, fail)
        self._after_failure(errors)
        order = {c.target: i for i, c in enumerate(members)}
        items = [FleetItem(c.target, self._ranks.get(c.target), info) for c, info in installed]
        return FleetResult(sorted(items, key=lambda i: order[i.target]),
                           sorted(errors, key=lambda e: order.get(e.target, len(order))))

    def capture(self, layers: str | Sequence[str], *, n: int = 1, as_torch: bool = False,
                **options: Unpack[CaptureOptions]) -> FleetResult[Any]:
        """One :meth:`Client.capture` per member, concurrently: each item's
        value is what that member's capture returned (passive on agents: the
        next step's tensors, gradient points included)."""
        names = layers if isinstance(layers, str) else list(layers)
        return self._fan_out(lambda c: [c.capture(names, n=n, as_torch=as_torch, **options)],
                             options.get("timeout"))

    def watch(self, selector: str | TapSpec, *, queue_size: int | None = None, timeout: float | None = None,
              **options: Unpack[TapOptions]) -> FleetStream:
        """One merged stream of every member's summaries (see :meth:`Client.watch`).

        A member that is down, or fails mid-stream, ends alone: it lands in
        ``stream.errors`` and the others go on.
        """
        if self._closed:
            raise ClientClosed("this Fleet was closed; create a new one")
        self._resolve()

        def opener(client: Client) -> Callable[[], SummaryStream]:
            return lambda: client.watch(selector, queue_size=queue_size, timeout=timeout, **options)

        stream = FleetStream([(c, opener(c)) for c in self._members()], self._unresolved_errors())
        self._streams.add(stream)
        return stream

