"""Which webhook targets may be called (SSRF): only public (globally routable) unicast addresses.

Private, loopback, link-local (with the 169.254.169.254 metadata service), unspecified, multicast,
shared (CGNAT), documentation and other reserved ranges are refused — also inside an IPv6 address
(IPv4-mapped, 6to4, NAT64) — at submit for a literal address
or a reserved name, and again at send time for every address the host name resolves to. The sender
then connects to the address it checked (see ``resolve``), so a name that resolves differently a moment
later (DNS rebinding) cannot redirect the request. ``allow_loopback`` admits 127.0.0.0/8 and ::1 only.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import HttpUrl, TypeAdapter

if TYPE_CHECKING:
    from conductor.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
log = logging.getLogger(__name__)
RESERVED_NAMES = ("localhost", "localhost.localdomain", "metadata.google.internal", "metadata")
RESERVED_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain")
SCHEMES = ("http", "https")


class UnsafeTarget(ValueError):
    """A webhook URL the service refuses to call; the message says why."""


class Unresolvable(ValueError):
    """The host name did not resolve (perhaps for now): a retryable failure, not a refusal."""


@dataclass(frozen=True)
class Denied:
    """Public targets refused besides the non-public ranges: this deployment's own
    (``settings.webhook_denied``: ``CONDUCTOR_WEBHOOK_DENIED_TARGETS`` and the API's own host names)."""

    networks: tuple[IPNetwork, ...] = ()
    names: tuple[str, ...] = ()
    """Lowercased, without a trailing dot; ``*.example.com`` for every name below ``example.com``."""

    def network_of(self, address: IPAddress) -> IPNetwork | None:
        """The denied network holding ``address`` (or the IPv4 address an IPv6 one carries), or None."""
        embedded = embedded_ipv4(address)
        reached = [address] if embedded is None else [address, embedded]
        return next((net for net in self.networks for a in reached if a.version == net.version and a in net), None)

    def has_name(self, name: str) -> bool:
        from conductor.settings import host_allowed  # (names match as the Host allowlist's do; never "*")

        return host_allowed(name, self.names)


NOTHING_DENIED = Denied()
OWN = "one of this deployment's own (CONDUCTOR_WEBHOOK_DENIED_TARGETS, CONDUCTOR_ALLOWED_HOSTS)"


def denied_of(settings: Settings) -> Denied:
    """The ``Denied`` targets of ``settings`` (built once per value of the two settings)."""
    return _denied(settings.webhook_denied_targets, settings.allowed_hosts)


@lru_cache(maxsize=16)
def _denied(denied_targets: str, allowed_hosts: str) -> Denied:
    from conductor.settings import webhook_denied

    networks, names = webhook_denied(denied_targets, allowed_hosts)
    return Denied(networks, names)


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


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
"""The well-known NAT64 prefix (RFC 6052): its last 32 bits are the IPv4 address a NAT64 gateway reaches."""
NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
"""Local-use NAT64 (RFC 8215): a network's own translation, which may reach its private IPv4 ranges."""
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
"""Deprecated IPv4-compatible addresses (RFC 4291), ``::`` and ``::1`` aside."""
IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")
"""IPv4-translated addresses (SIIT, RFC 2765): the last 32 bits are the IPv4 address a translator reaches."""
GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
"""The only IPv6 space allocated for public unicast (RFC 4291): anything outside it (site-local
``fec0::/10`` among them, which the standard library calls global) is refused."""
NOT_ROUTED_V6 = (ipaddress.IPv6Network("3fff::/20"), ipaddress.IPv6Network("5f00::/16"))
"""Inside 2000::/3 but never routed publicly: documentation (RFC 9637) and SRv6 SIDs (RFC 9602)."""


def address_problem(address: IPAddress, *, allow_loopback: bool) -> str | None:
    """Why ``address`` may not be called, or None."""
    kind = address_kind(address, allow_loopback=allow_loopback)
    return None if kind is None else f"{address} is {kind}"


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries and reaches (IPv4-mapped or -translated, 6to4, well-known
    NAT64), or None."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    embedded = address.ipv4_mapped or address.sixtofour
    if embedded is None and (address in NAT64 or address in IPV4_TRANSLATED):
        embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return embedded


def address_kind(address: IPAddress, *, allow_loopback: bool) -> str | None:
    """What makes ``address`` unsafe to call ("a private address", …), or None. An IPv6 address that
    carries an IPv4 one (IPv4-mapped or -translated, 6to4, well-known NAT64) is judged by the IPv4 address
    it reaches."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = embedded_ipv4(address)
        if embedded is not None:
            kind = address_kind(embedded, allow_loopback=allow_loopback)
            return None if kind is None else f"{kind} ({embedded}) inside an IPv6 one"
        if address in NAT64_LOCAL:
            return "a local-use NAT64 address (it may reach private IPv4 networks)"
        if address in IPV4_COMPATIBLE and not (address.is_loopback or address.is_unspecified):
            return "a deprecated IPv4-compatible address"
    if address.is_loopback:
        return None if allow_loopback else "a loopback address"
    if address.is_multicast:
        return "a multicast address"
    if address.is_unspecified:
        return "the unspecified address"
    if address.is_link_local:
        return "a link-local address (cloud metadata services live there)"
    if address.is_private:
        return "a private address"
    if not address.is_global:
        return "a reserved address, not publicly routable"
    if isinstance(address, ipaddress.IPv6Address) and (
        address not in GLOBAL_UNICAST or any(address in net for net in NOT_ROUTED_V6)
    ):
        return "a reserved address, not publicly routable"
    return None


def _split(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise UnsafeTarget("must be an http or https URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UnsafeTarget("has an invalid port") from exc
    if parts.username is not None or parts.password is not None:
        # the request would go without them (they are not sent as Basic auth), each attempt failing 401
        raise UnsafeTarget("must not carry a user name or password (put a token in the path or query)")
    return parts.scheme, parts.hostname, port


def normalize_url(url: str) -> str:
    """The URL as jobs store it (pydantic's ``HttpUrl`` form), so the same endpoint always compares equal."""
    return str(TypeAdapter(HttpUrl).validate_python(url))


def check_url(url: str, *, allow_loopback: bool, denied: Denied = NOTHING_DENIED) -> None:
    """The submit-time check (no DNS lookup): a literal address must be public and not ``denied``, a
    reserved or denied name is refused. Names are resolved and checked again at every send."""
    _, host, _ = _split(url)
    address = literal_address(host)
    if address is not None:
        problem = address_problem(address, allow_loopback=allow_loopback)
        if problem:
            raise UnsafeTarget(f"webhook target refused: {problem}")
        if denied.network_of(address) is not None:
            raise UnsafeTarget(f"webhook target refused: {address} is {OWN}")
        return
    name = host.rstrip(".").lower()
    if denied.has_name(name):
        raise UnsafeTarget(f"webhook target refused: '{host}' is {OWN}")
    if name in RESERVED_NAMES or name.endswith(RESERVED_SUFFIXES):
        if allow_loopback and (name == "localhost" or name.endswith(".localhost")):
            return
        raise UnsafeTarget(f"webhook target refused: '{host}' is a local or internal host name")


def resolve(url: str, *, allow_loopback: bool, denied: Denied = NOTHING_DENIED,
            within_s: float | None = None) -> Target:
    """The send-time check: resolves the host and raises :class:`Unresolvable` if it does not resolve (within
    ``within_s`` seconds, when given) or *any* address it resolves to is unsafe or ``denied``; returns the first
    address, which the request must connect to."""
    check_url(url, allow_loopback=allow_loopback, denied=denied)
    scheme, host, port = _split(url)
    address = literal_address(host)
    if address is not None:
        return Target(scheme, host, port, address)
    # The tenant reads what this raises (the delivery's attempts): a name that does not resolve and one that
    # resolves to a private address read the same and are both retried, so webhook URLs cannot probe which
    # internal names (``postgres``, a cluster's services) exist. The log has the detail, with the host only:
    # hook URLs often carry their own tokens in the path or query.
    unreachable = Unresolvable(f"webhook target {host} does not resolve to a public address (not sent)")
    try:
        infos = _getaddrinfo(host, port, within_s)
    except (socket.gaierror, UnicodeError, TimeoutError) as exc:
        log.warning("webhook target %s (port %s) does not resolve: %s", host, port, exc)
        raise unreachable from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        log.warning("webhook target %s (port %s) resolved to no address", host, port)
        raise unreachable
    for candidate in addresses:
        kind = address_kind(candidate, allow_loopback=allow_loopback)
        if kind is None and (network := denied.network_of(candidate)) is not None:
            kind = f"in {network}, {OWN}"
        if kind:
            log.warning("webhook target refused: %s (port %s) resolves to %s, %s", host, port, candidate, kind)
            raise unreachable
    return Target(scheme, host, port, addresses[0])


def _getaddrinfo(host: str, port: int, within_s: float | None) -> list[tuple[Any, ...]]:
    """``socket.getaddrinfo``, given up after ``within_s`` seconds (``TimeoutError``). The system resolver
    cannot be interrupted and may take its own timeouts over every name server (tens of seconds): the
    lookup runs on a daemon thread (a greenlet under gevent), left to end on its own."""
    if within_s is None:
        return list(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
    done = threading.Event()
    found: list[Any] = []

    def look_up() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except BaseException as exc:  # handed to the caller, which raises it
            found.append(exc)
        finally:
            done.set()

    threading.Thread(target=look_up, name=f"webhook-dns-{host}", daemon=True).start()
    if not done.wait(within_s):
        raise TimeoutError(f"no answer from the resolver within {within_s:g} s")
    if isinstance(found[0], BaseException):
        raise found[0]
    return list(found[0])
