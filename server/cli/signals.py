"""Signals of a served process: SIGTERM/SIGINT stop it, SIGHUP reloads, and a watchdog makes sure it ends."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layertap.server.running import LayertapServer

__all__ = ["SHUTDOWN_MARGIN", "install_signal_handlers"]

log = logging.getLogger("layertap.server")

#: Seconds past ``--grace`` after which a signalled server exits whatever is
#: stuck: room for the steps after the drain, each bounded by
#: running.STOP_STEP_SECONDS (3 s; six of them today) and a little more.
SHUTDOWN_MARGIN = 20.0


def _watchdog(server: LayertapServer, deadline: float) -> None:
    """End the process if ``stop()`` has not finished ``deadline`` seconds after the signal.

    Whatever is stuck (a deadlocked gRPC thread, a callback that never
    returns), a SIGTERMed server must exit: orchestrators escalate to SIGKILL
    only after their own grace, and a wedged process holds its port until then.
    Exits 1, after a logged reason that names the step in progress.
    """
    if server.finished(deadline):
        return
    log.error("shutdown did not finish within %.1fs (--grace %.1fs + %.1fs): stuck %s; exiting with code 1",
              deadline, server.state.config.grace_seconds, SHUTDOWN_MARGIN, server.step)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def install_signal_handlers(server: LayertapServer) -> None:
    """SIGTERM/SIGINT: graceful shutdown (health goes NOT_SERVING first); SIGHUP: reload tokens and certificates.

    A watchdog ends the process with code 1 if shutdown has not finished
    ``--grace`` + :data:`SHUTDOWN_MARGIN` seconds after the first signal.
    """
    started = threading.Event()

    def handle(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down (grace %.1fs)", signum, server.state.config.grace_seconds)
        if started.is_set():
            return
        started.set()
        threading.Thread(target=server.stop, name="layertap-stop", daemon=True).start()
        threading.Thread(target=_watchdog, args=(server, server.state.config.grace_seconds + SHUTDOWN_MARGIN),
                         name="layertap-watchdog", daemon=True).start()

    def hangup(_signum: int, _frame: object) -> None:
        log.info("SIGHUP: reloading tokens and certificates")
        threading.Thread(target=server.reload, name="layertap-reload", daemon=True).start()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    if hasattr(signal, "SIGHUP"):  # not on Windows
        signal.signal(signal.SIGHUP, hangup)
