"""TLS for gRPC and /metrics from ``--tls-cert/--tls-key`` (and ``--tls-client-ca``), reloadable.

gRPC uses ``grpc.dynamic_ssl_server_credentials``: its fetcher hands a new
certificate configuration to the next handshake after :meth:`TlsFiles.reload`.
``/metrics`` shares one ``ssl.SSLContext`` whose chain is reloaded in place,
so new connections get the new certificate and open ones keep theirs.
"""

from __future__ import annotations

import logging
import ssl
import threading
from pathlib import Path

import grpc

log = logging.getLogger("layertap.server")


class TlsFiles:
    """The certificate, key and optional client CA; ``reload()`` re-reads them."""

    def __init__(self, cert: str, key: str, client_ca: str | None = None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._contexts: list[ssl.SSLContext] = []
        self._config = self._read()

    def _read(self) -> grpc.ServerCertificateConfiguration:
        try:
            cert, key = Path(self.cert).read_bytes(), Path(self.key).read_bytes()
            ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        except OSError as exc:
            raise ValueError(f"TLS: {exc.filename}: {exc.strerror or exc}") from None
        # Validate the pair now (grpc would only fail at the first handshake).
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            probe.load_cert_chain(self.cert, self.key)
            if self.client_ca:
                probe.load_verify_locations(self.client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"TLS: --tls-cert {self.cert} / --tls-key {self.key}: {exc}") from None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._config, self._fetch,  # type: ignore[arg-type]  # grpc accepts None: "no change"
            require_client_authentication=self.client_ca is not None)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def ssl_context(self) -> ssl.SSLContext:
        """A server context for /metrics, kept current by :meth:`reload`."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load(ctx)
        self._contexts.append(ctx)
        return ctx

    def _load(self, ctx: ssl.SSLContext) -> None:
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED

    def reload(self) -> bool:
        """Re-read the files; a bad pair keeps the old certificates and logs an error."""
        try:
            config = self._read()
            for ctx in self._contexts:
                self._load(ctx)
        except (ValueError, ssl.SSLError, OSError) as exc:
            log.error("TLS reload failed, keeping the old certificates: %s", exc)
            return False
        with self._lock:
            self._config = self._pending = config
        log.info("TLS certificates reloaded from %s", self.cert)
        return True
