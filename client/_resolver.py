"""``dns:///name:port`` fleet targets: every address a name resolves to is one member.

A Kubernetes headless Service resolves to the address of each ready pod, so
one such target stands for every replica behind it. gRPC's own ``dns:``
resolver would pick among the addresses and balance calls over them; a
fleet needs each of them as a member of its own. The resolver is
injectable: tests put replicas on 127.0.0.1 and 127.0.0.2 behind one name.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._errors import InvalidArgument

#: ``(host, port)`` -> the addresses behind that name (IPv4 or IPv6 literals).
#: Raising ``OSError`` (``socket.gaierror``) means the name does not resolve now.
Resolver = Callable[[str, int], Sequence[str]]

#: The scheme prefix of a target that names a whole fleet (gRPC's naming syntax).
DNS_SCHEME = "dns:"


def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``getaddrinfo`` gives for ``host`` (A and AAAA records), deduplicated, sorted."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True)
class DnsTarget:
    """A parsed ``dns:///name:port`` target.

    Attributes:
        text: The target as given.
        host: The name to resolve, and the name a TLS certificate must carry.
        port: The port every replica listens on.
    """

    text: str
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> DnsTarget | None:
        """The target, or None when ``text`` is a plain ``host:port``.

        Raises:
            InvalidArgument: A ``dns:`` target with a DNS authority, no host or no port.
        """
        if not text.startswith(DNS_SCHEME):
            return None
        rest = text[len(DNS_SCHEME):]
        if rest.startswith("//"):
            authority, slash, rest = rest[2:].partition("/")
            if authority or not slash:
                raise InvalidArgument(f"target {text!r}: a DNS server (dns://SERVER/...) is not supported; "
                                      "write dns:///name:port, which asks the system's resolver")
        host, sep, port = rest.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"target {text!r}: expected dns:///name:port (the port is required)")
        return cls(text, host, int(port))

    def address(self, ip: str) -> str:
        """The gRPC target of one resolved address (IPv6 in brackets)."""
        try:
            v6 = ipaddress.ip_address(ip).version == 6
        except ValueError:
            raise InvalidArgument(f"{self.text}: the resolver returned {ip!r}, not an IP address") from None
        return f"[{ip}]:{self.port}" if v6 else f"{ip}:{self.port}"

    def resolve(self, resolver: Resolver) -> list[str]:
        """The gRPC targets of every address behind the name, sorted (empty when it resolves to none).

        Raises:
            OSError: The name does not resolve now.
        """
        return sorted({self.address(ip) for ip in resolver(self.host, self.port)})
