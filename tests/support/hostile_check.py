"""Sends hostile cases (``support.hostile``) to a real server and judges the answers.

One :class:`Target` per server, over raw generated stubs, so the exact
request reaches the server. :meth:`Target.run` returns the problems of a case
as strings instead of raising, so the test asserts there are none and the
fuzz benchmark counts them. A case has a problem when:

* the code is not one the server documents (never INTERNAL or UNKNOWN), or a
  valid request is not answered OK;
* a unary answer, or a stream's first message, takes longer than
  :data:`PROMPT_SECONDS`;
* an error's message is over the server's cap, or an INVALID_ARGUMENT from a
  layertap service names no field;
* the server logged an ERROR or a traceback, or a thread died;
* the case left something behind: a hook, a tap, a subscriber, a capture.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2_grpc
from grpc_status import rpc_status

from layertap.server.config import ServerConfig
from layertap.server.errors import DOMAIN, MAX_MESSAGE_CHARS
from layertap.server.running import LayertapServer
from layertap.v1 import inference_pb2 as ipb
from layertap.v1 import inference_pb2_grpc, telemetry_pb2_grpc, tensor_pb2
from layertap.v1 import telemetry_pb2 as pb
from support.e2e import scrape
from support.hostile import HEALTH, INFERENCE, TELEMETRY, Case
from support.rpc_table import RPCS

Code = grpc.StatusCode
#: The codes the server documents (server/errors.py, docs/security.md); DEADLINE_EXCEEDED only
#: ever comes from the client's own deadline, which the latency check catches first.
DOCUMENTED = frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS,
                        Code.RESOURCE_EXHAUSTED, Code.FAILED_PRECONDITION, Code.PERMISSION_DENIED,
                        Code.UNAUTHENTICATED, Code.UNIMPLEMENTED, Code.DEADLINE_EXCEEDED, Code.OUT_OF_RANGE})
#: Longest wait for a unary answer or a stream's first message: half the client's deadline, so an answer
#: that waits for something (a timeout, traffic, a lock) shows as slow, and a busy machine is not.
PROMPT_SECONDS = 5.0
#: The client's deadline: long enough that a slow answer shows as slow, not as a timeout.
CALL_TIMEOUT = 10.0
#: How long cleanup that runs on gRPC's callback thread (a cancelled stream) may take.
SETTLE_SECONDS = 5.0


def server_config(**overrides: object) -> ServerConfig:
    """The fuzzed server: the defaults, with a small request cap (so RESOURCE_EXHAUSTED is cheap to
    reach) and metrics on (their sinks see every tap); pass ``baseline_dir`` so baselines are saved too."""
    cfg = ServerConfig(port=0, metrics_port=0, max_request_bytes=4 << 20, compile_reducers=False)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def demo_input(n: int = 1, nasty: bool = False) -> tensor_pb2.Tensor:
    """A valid demo-model batch; ``nasty`` sprinkles NaN, ±inf, ±max, subnormals and -0 in."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 3, 32, 32)).astype(np.float32)
    if nasty and x.size:
        special = np.array([np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, -0.0], np.float32)
        flat = x.reshape(-1)
        flat[rng.integers(0, flat.size, 64)] = rng.choice(special, 64)
    return tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=list(x.shape), raw_data=x.tobytes())


class LogWatch(logging.Handler):
    """Collects ERROR records, records with a traceback, and exceptions that end a thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._bad: list[str] = []
        self._lock2 = threading.Lock()
        self._previous_hook = threading.excepthook

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            text = f"{record.levelname} {record.name}: {record.getMessage()}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            with self._lock2:
                self._bad.append(text)

    def _thread_died(self, args: threading.ExceptHookArgs) -> None:
        with self._lock2:
            self._bad.append(f"thread {args.thread.name if args.thread else '?'} died: "
                             f"{args.exc_type.__name__}: {args.exc_value}")
        self._previous_hook(args)

    def install(self) -> LogWatch:
        logging.getLogger().addHandler(self)
        self._previous_hook = threading.excepthook
        threading.excepthook = self._thread_died
        return self

    def uninstall(self) -> None:
        logging.getLogger().removeHandler(self)
        threading.excepthook = self._previous_hook

    def take(self) -> list[str]:
        """What was recorded since the last call."""
        with self._lock2:
            bad, self._bad = self._bad, []
        return bad


@dataclass
class Outcome:
    """What one case got: the first call's code and latency, and every problem found."""

    rpc: str
    code: grpc.StatusCode
    seconds: float
    problems: list[str] = field(default_factory=list)


def _details_problems(err: grpc.RpcError, service: str) -> list[str]:
    out = []
    details = err.details() or ""
    if len(details) > MAX_MESSAGE_CHARS:
        out.append(f"{err.code().name} message is {len(details)} chars, over the {MAX_MESSAGE_CHARS} cap")
    if err.code() == Code.INVALID_ARGUMENT and service != HEALTH:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
        info = error_details_pb2.ErrorInfo()
        for d in status.details if status is not None else []:
            if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                d.Unpack(info)
        if info.domain != DOMAIN or not info.metadata.get("field"):
            out.append(f"INVALID_ARGUMENT without an ErrorInfo naming the field: {details[:200]!r}")
    return out


class Target:
    """A server under fuzzing, called through raw generated stubs."""

    def __init__(self, address: str, logs: LogWatch | None = None, server: LayertapServer | None = None) -> None:
        """``server``: the same server in process, to wait for its summaries and scrape its metrics."""
        self.server = server
        self.channel = grpc.insecure_channel(address)
        self.stubs: dict[str, Any] = {
            INFERENCE: inference_pb2_grpc.InferenceServiceStub(self.channel),
            TELEMETRY: telemetry_pb2_grpc.TelemetryServiceStub(self.channel),
            HEALTH: health_pb2_grpc.HealthStub(self.channel),
        }
        self.logs = logs
        #: Codes seen per RPC (first call of each case), and the slowest answer.
        self.codes: Counter[tuple[str, str]] = Counter()
        self.max_seconds = 0.0

    def close(self) -> None:
        self.channel.close()

    # -- calls -----------------------------------------------------------------
    def _unary(self, service: str, method: str, request: Message, problems: list[str],
               expect: frozenset[grpc.StatusCode] | None = None) -> tuple[grpc.StatusCode, Any, float]:
        """One unary call, judged: documented code (or one of ``expect``), prompt, bounded details."""
        start = time.monotonic()
        try:
            resp, code, err = getattr(self.stubs[service], method)(request, timeout=CALL_TIMEOUT), Code.OK, None
        except grpc.RpcError as exc:
            resp, code, err = None, exc.code(), exc
        seconds = time.monotonic() - start
        self._judge(f"{method}", service, code, err, seconds, problems, expect)
        return code, resp, seconds

    def _judge(self, what: str, service: str, code: grpc.StatusCode, err: grpc.RpcError | None, seconds: float,
               problems: list[str], expect: frozenset[grpc.StatusCode] | None) -> None:
        if code not in (expect or DOCUMENTED):
            detail = (err.details() or "") if err is not None else ""
            want = "/".join(sorted(c.name for c in expect)) if expect else "a documented code"
            problems.append(f"{what}: {code.name} ({detail[:300]!r}), expected {want}")
        if seconds > PROMPT_SECONDS:
            problems.append(f"{what}: answered after {seconds:.2f} s (limit {PROMPT_SECONDS} s)")
        if err is not None:
            problems.extend(f"{what}: {p}" for p in _details_problems(err, service))

    def infer(self, problems: list[str], n: int = 1, nasty: bool = False) -> None:
        """A known-good Infer (traffic for passive captures, taps and baselines)."""
        self._unary(INFERENCE, "Infer", ipb.InferRequest(inputs=[demo_input(n, nasty)]), problems,
                    frozenset({Code.OK}))

    def published(self, problems: list[str]) -> None:
        """Wait for the passes so far to reach the sinks, then check that /metrics still renders."""
        if self.server is None:
            return
        if not self.server.state.taps.flush(PROMPT_SECONDS):
            problems.append(f"summaries not published within {PROMPT_SECONDS} s")
        if self.server.metrics_port is not None:
            try:
                scrape(self.server.metrics_port)
            except Exception as exc:  # noqa: BLE001 - reported as a problem of the case
                problems.append(f"/metrics: {type(exc).__name__}: {exc}")

    def _pump(self, stop: threading.Event, problems: list[str]) -> None:
        while not stop.is_set():
            self.infer(problems)
            stop.wait(0.02)

    def _stream(self, case: Case, service: str, method: str, problems: list[str]) -> tuple[grpc.StatusCode, float]:
        """Open the stream, time its first message, look at it, cancel."""
        req = case.request
        stop = threading.Event()
        pump = None
        if method == "Capture" and not req.inputs:  # type: ignore[attr-defined]
            # A passive capture waits for live traffic: supply it until the first message.
            pump = threading.Thread(target=self._pump, args=(stop, problems), daemon=True)
        stream = getattr(self.stubs[service], method)(req, timeout=CALL_TIMEOUT)
        start = time.monotonic()
        if pump is not None:
            pump.start()
        first, err = None, None
        try:
            try:
                first, code = next(stream), Code.OK
            except StopIteration:
                code = Code.OK
            except grpc.RpcError as exc:
                code, err = exc.code(), exc
            seconds = time.monotonic() - start
            stop.set()
            self._judge(method, service, code, err, seconds, problems, frozenset({Code.OK}) if case.valid else None)
            if code == Code.OK:
                self._after_first(case, first, problems)
        finally:
            stop.set()
            stream.cancel()
            if pump is not None:
                pump.join()
        return code, seconds

    def _after_first(self, case: Case, first: Any, problems: list[str]) -> None:
        req: Any = case.request
        if first is None:
            if case.valid:
                problems.append(f"{case.rpc}: the stream ended without a message")
            return
        if case.rpc.endswith("Capture") and first.WhichOneof("payload") != "header":
            problems.append(f"Capture: the first message is not a header: {first}")
        elif case.rpc.endswith("Capture") and first.header.layer not in req.layers:
            problems.append(f"Capture: header for {first.header.layer!r}, which was not asked for")
        if case.rpc.endswith("Subscribe"):
            if len(first.stream_tap_ids) != len(req.stream_taps):
                problems.append(f"Subscribe: {len(first.stream_tap_ids)} stream tap ids for {len(req.stream_taps)} taps")
            for tap_id in first.stream_tap_ids[:1]:
                # A stream tap ends with its stream, never by DeleteTap.
                self._unary(TELEMETRY, "DeleteTap", pb.DeleteTapRequest(id=tap_id), problems,
                            frozenset({Code.INVALID_ARGUMENT}))

    # -- follow-ups of unary calls that create state --------------------------------
    def _after_create(self, req: pb.CreateTapRequest, resp: pb.CreateTapResponse, valid: bool,
                      problems: list[str]) -> None:
        tap_id = resp.tap.id
        if valid:
            self.infer(problems, 2, nasty=True)  # the tap's reducers run on real passes
            self.infer(problems, 0)
            self.published(problems)
            _, taps, _ = self._unary(TELEMETRY, "ListTaps", pb.ListTapsRequest(), problems, frozenset({Code.OK}))
            mine = [t for t in (taps.taps if taps is not None else []) if t.id == tap_id]
            if not mine:
                problems.append(f"CreateTap: tap {tap_id!r} is not listed")
            elif mine[0].disabled and "per_channel.dim" not in mine[0].last_error:
                # A per-channel dim is checked against each tensor's rank, so a tap
                # over layers of mixed rank is disabled by design; nothing else may.
                problems.append(f"CreateTap: a valid tap was disabled: {mine[0].last_error[:300]}")
            if req.spec.name:
                self._unary(TELEMETRY, "CreateTap", req, problems, frozenset({Code.ALREADY_EXISTS}))
        # A short TTL may run out before the delete; anything else must still be there.
        lasting = req.forever or not req.HasField("ttl") or req.ttl.ToNanoseconds() >= 30 * 10**9
        gone = frozenset({Code.OK} if lasting else {Code.OK, Code.NOT_FOUND})
        self._unary(TELEMETRY, "DeleteTap", pb.DeleteTapRequest(id=tap_id), problems, gone)
        self._unary(TELEMETRY, "DeleteTap", pb.DeleteTapRequest(id=tap_id), problems, frozenset({Code.NOT_FOUND}))

    def _after_baseline(self, req: pb.SetBaselineRequest, resp: pb.SetBaselineResponse, valid: bool,
                        problems: list[str]) -> None:
        if valid:
            for i in range(min(req.passes or 1, 3) + 1):  # enough passes to freeze a small baseline
                self.infer(problems, i % 3, nasty=i == 1)
            self.published(problems)
            self._unary(TELEMETRY, "GetDrift", pb.GetDriftRequest(), problems, frozenset({Code.OK}))
        self._unary(TELEMETRY, "DeleteTap", pb.DeleteTapRequest(id=resp.tap), problems, frozenset({Code.OK}))

    # -- a whole case ------------------------------------------------------------------
    def run(self, case: Case) -> Outcome:
        """Send ``case``, run its follow-ups, wait for the server to settle; never raises on a bad answer."""
        rpc = RPCS[case.rpc]
        service, method = rpc.service, rpc.method
        problems: list[str] = []
        if rpc.streaming:
            code, seconds = self._stream(case, service, method, problems)
        else:
            code, resp, seconds = self._unary(service, method, case.request, problems,
                                              frozenset({Code.OK}) if case.valid else None)
            if code == Code.OK and method == "CreateTap":
                self._after_create(case.request, resp, case.valid, problems)  # type: ignore[arg-type]
            elif code == Code.OK and method == "SetBaseline":
                self._after_baseline(case.request, resp, case.valid, problems)  # type: ignore[arg-type]
        problems += self.settle()
        if self.logs is not None:
            problems += [f"server log: {line}" for line in self.logs.take()]
        self.codes[(case.rpc, code.name)] += 1
        self.max_seconds = max(self.max_seconds, seconds)
        return Outcome(case.rpc, code, seconds, problems)

    def stats(self) -> pb.GetServerStatsResponse:
        return self.stubs[TELEMETRY].GetServerStats(pb.GetServerStatsRequest(), timeout=CALL_TIMEOUT)

    def settle(self, seconds: float = SETTLE_SECONDS) -> list[str]:
        """Wait for the server to hold nothing (hooks, taps, subscribers, captures); what is left is a problem.

        Whatever is left is then removed, so one bad case does not spoil the next.
        """
        end = time.monotonic() + seconds
        while True:
            s = self.stats()
            left = {k: getattr(s, k) for k in ("active_hooks", "taps", "subscribers", "active_captures")
                    if getattr(s, k)}
            if not left or time.monotonic() > end:
                break
            time.sleep(0.02)
        if not left:
            return []
        for tap in self.stubs[TELEMETRY].ListTaps(pb.ListTapsRequest(), timeout=CALL_TIMEOUT).taps:
            if tap.kind == pb.TAP_KIND_DURABLE:
                self.stubs[TELEMETRY].DeleteTap(pb.DeleteTapRequest(id=tap.id), timeout=CALL_TIMEOUT)
        return [f"left behind after {seconds:.0f} s: {left}"]
