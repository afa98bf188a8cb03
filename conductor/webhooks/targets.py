"""Which webhook targets may be called (SSRF): only public (globally routable) unicast addresses.

Private, loopback, link-local (with the 169.254.169.254 metadata service), unspecified, multicast,
shared (CGNAT), documentation and other reserved ranges are refused — at submit for a literal address
or a reserved name, and again at send time for every address the host name resolves to. The sender
then connects to the address it checked (see ``resolve``), so a name that resolves differently a moment
later (DNS rebinding) cannot redirect the request. ``allow_loopback`` admits 127.0.0.0/8 and ::1 only.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import HttpUrl, TypeAdapter

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
RESERVED_NAMES = ("localhost", "localhost.localdomain", "metadata.google.internal", "metadata")
RESERVED_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain")
SCHEMES = ("http", "https")


class UnsafeTarget(ValueError):
    """A webhook URL the service refuses to call; the message says why."""


class Unresolvable(ValueError):
    """The host name did not resolve (perhaps for now): a retryable failure, not a refusal."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    """As written in the URL (the Host header and the TLS server name)."""
    port: int
    address: IPAddress
    """The checked address the request must connect to."""


def literal_address(host: str) -> IPAddress | None:
    """The address a host written as an IP literal means — including the legacy forms resolvers accept
    (``2130706433``, ``0x7f.1``, ``127.1``) — or None for a name."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if ":" in host:
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def address_problem(address: IPAddress, *, allow_loopback: bool) -> str | None:
    """Why ``address`` may not be called, or None."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address_problem(address.ipv4_mapped, allow_loopback=allow_loopback)
    if address.is_loopback:
        return None if allow_loopback else f"{address} is a loopback address"
    if address.is_multicast:
        return f"{address} is a multicast address"
    if address.is_unspecified:
        return f"{address} is the unspecified address"
    if address.is_link_local:
        return f"{address} is a link-local address (cloud metadata services live there)"
    if address.is_private:
        return f"{address} is a private address"
    if not address.is_global:
        return f"{address} is a reserved address, not publicly routable"
    return None


def _split(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise UnsafeTarget("must be an http or https URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UnsafeTarget("has an invalid port") from exc
    return parts.scheme, parts.hostname, port


def normalize_url(url: str) -> str:
    """The URL as jobs store it (pydantic's ``HttpUrl`` form), so the same endpoint always compares equal."""
    return str(TypeAdapter(HttpUrl).validate_python(url))


def check_url(url: str, *, allow_loopback: bool) -> None:
    """The submit-time check (no DNS lookup): a literal address must be public, a reserved name is
    refused. Names are resolved and checked again at every send."""
    _, host, _ = _split(url)
    address = literal_address(host)
    if address is not None:
        problem = address_problem(address, allow_loopback=allow_loopback)
        if problem:
            raise UnsafeTarget(f"webhook target refused: {problem}")
        return
    name = host.rstrip(".").lower()
    if name in RESERVED_NAMES or name.endswith(RESERVED_SUFFIXES):
        if allow_loopback and (name == "localhost" or name.endswith(".localhost")):
            return
        raise UnsafeTarget(f"webhook target refused: '{host}' is a local or internal host name")


def resolve(url: str, *, allow_loopback: bool) -> Target:
    """The send-time check: resolves the host and refuses the target if *any* address it resolves to is
    unsafe; returns the first address, which the request must connect to."""
    check_url(url, allow_loopback=allow_loopback)
    scheme, host, port = _split(url)
    address = literal_address(host)
    if address is not None:
        return Target(scheme, host, port, address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise Unresolvable(f"cannot resolve {host}: {exc}") from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise Unresolvable(f"{host} resolved to no address")
    for candidate in addresses:
        problem = address_problem(candidate, allow_loopback=allow_loopback)
        if problem:
            raise UnsafeTarget(f"webhook target refused: {host} resolves to {problem}")
    return Target(scheme, host, port, addresses[0])
