"""A started server's handle: its address, and its shutdown in bounded, logged steps.

Why apart from ``app.py``: the assembler wires the stages once; this is what
the caller holds afterwards (the CLI's signal handlers, a training agent, tests).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from layertap.server.rpc.admission import PrincipalAdmission, StreamAdmission
from layertap.server.rpc.auth import Authenticator
from layertap.server.rpc.health import HealthServicer
from layertap.server.rpc.open_pool import OpenPool
from layertap.server.rpc.state import ServerState
from layertap.server.tls import TlsFiles

__all__ = ["STOP_STEP_SECONDS", "LayertapServer"]

log = logging.getLogger("layertap.server")

#: Seconds each shutdown step after the gRPC drain (metrics server, host-transfer
#: thread, expiry thread) may take before the process exits without it.
STOP_STEP_SECONDS = 3.0


@dataclass
class LayertapServer:
    """A running server; ``stop()`` shuts it down gracefully."""

    grpc_server: grpc.Server
    state: ServerState
    port: int
    health: HealthServicer
    metrics_port: int | None = None
    auth: Authenticator | None = None
    tls: TlsFiles | None = None
    #: Admission of long streams (``--max-streams``).
    streams: StreamAdmission | None = None
    #: Per-principal budgets and the open services' pool.
    principals: PrincipalAdmission | None = None
    #: The plaintext Health-only listener (``--health-address``) and its port.
    health_server: grpc.Server | None = None
    health_port: int | None = None
    listener_health: HealthServicer | None = None
    listener_pool: OpenPool | None = None
    #: Shutdown steps after the gRPC drain, run in reverse order: (what, how).
    _closers: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _finished: threading.Event = field(default_factory=threading.Event)
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)
    #: The shutdown step in progress, named in the watchdog's log line.
    _step: str = "not started"

    @property
    def address(self) -> str:
        return f"{self.state.config.host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting work, drain in-flight RPCs for ``grace`` seconds, close.

        Then stop the health listener, the metrics server and the threads,
        each bounded by ``STOP_STEP_SECONDS``, so a SIGTERM ends in bounded
        time with every step logged (or logged as abandoned).
        """
        with self._stop_lock:  # exactly one caller runs the steps
            first = not self._stopped.is_set()
            self._stopped.set()
        if not first:
            # A second stop() (SIGTERM racing a `with` exit) returns only once
            # the first has finished, so the interpreter never exits mid-step.
            self._finished.wait()
            return
        try:
            # The health listener's servicer follows this one: probes read
            # NOT_SERVING on either port for the whole drain.
            self._step = "health NOT_SERVING"
            self.health.enter_graceful_shutdown()
            # End Subscribe streams first: they never finish on their own, so the
            # grace period would otherwise always run out on them.
            self._step = "closing subscriber streams"
            self.state.broker.close()
            if self.state.generator is not None:
                # Generations would run on through the grace period: they end now, UNAVAILABLE.
                self._step = "ending generations"
                self.state.generator.close()
            self._step = "draining gRPC calls"
            self.grpc_server.stop(self.state.config.grace_seconds if grace is None else grace).wait()
            self._step = "writing unsaved baselines"
            _run_bounded("baseline writer", self._last_saves, STOP_STEP_SECONDS)
            if self.health_server is not None:
                self._step = "stopping the health listener"
                self.health_server.stop(0).wait()
                log.info("health listener stopped")
            for servicer in (self.health, self.listener_health):
                if servicer is not None:
                    servicer.close()
            for what, close in reversed(self._closers):
                self._step = f"stopping the {what}"
                _run_bounded(what, close, STOP_STEP_SECONDS)
            self._step = "done"
            log.info("shutdown complete")
        finally:
            self._finished.set()

    def _last_saves(self) -> None:
        """Frozen baselines a full disk kept unsaved get one last write; those that still fail are lost,
        which must not pass in silence (a SIGTERM used to exit 0 without a word)."""
        lost = self.state.drift.final_saves()
        if not lost:
            return
        if self.state.metrics is not None:
            self.state.metrics.baselines_lost.inc(len(lost))
        log.error("shutdown: %d frozen baseline layer(s) could not be written to --baseline-dir and are lost: %s "
                  "(%s); set them again after the restart", len(lost),
                  ", ".join(f"{e.tap}/{e.layer}" for e in lost[:8]) + (" ..." if len(lost) > 8 else ""),
                  lost[0].save_error)

    @property
    def step(self) -> str:
        """The shutdown step in progress (``not started``, ..., ``done``)."""
        return self._step

    def finished(self, timeout: float | None = None) -> bool:
        """Whether ``stop()`` has finished, waiting up to ``timeout`` seconds."""
        return self._finished.wait(timeout)

    def reload(self) -> None:
        """SIGHUP: re-read the token file and the certificates; a bad file keeps the old ones."""
        if self.auth is not None:
            self.auth.reload()
        if self.tls is not None:
            self.tls.reload()

    def wait(self) -> None:
        """Block until the server is stopped and ``stop()`` has finished.

        gRPC terminates as soon as its calls drain; the rest of ``stop()`` (the
        metrics server, the host-transfer thread) runs on the signal handler's
        thread and must finish before the caller returns and the interpreter
        kills daemon threads mid-step.
        """
        self.grpc_server.wait_for_termination()
        if self._stopped.is_set():
            self._finished.wait()

    def __enter__(self) -> LayertapServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)


def _run_bounded(what: str, step: Callable[[], None], timeout: float) -> None:
    """Run one shutdown step on its own thread, waiting ``timeout`` seconds at most.

    A stuck step (a callback that never returns) must not keep a SIGTERMed
    process alive; it is logged and abandoned instead.
    """
    ok: list[bool] = []

    def run() -> None:
        try:
            step()
            ok.append(True)
        except Exception:  # shutdown must finish
            log.exception("error stopping the %s", what)

    thread = threading.Thread(target=run, name="layertap-stop", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.warning("%s did not stop within %.1fs; exiting without it", what, timeout)
    elif ok:
        log.info("%s stopped", what)
