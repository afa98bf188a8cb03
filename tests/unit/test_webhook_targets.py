"""Which webhook targets the service will call (SSRF): public unicast addresses only."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from conductor.settings import Settings
from conductor.webhooks.targets import (
    Denied,
    Unresolvable,
    UnsafeTarget,
    address_problem,
    check_url,
    denied_of,
    literal_address,
    normalize_url,
    resolve,
)

REFUSED = [
    "http://169.254.169.254/latest/meta-data/",  # the cloud metadata service
    "http://10.0.0.1/hook",
    "http://172.16.5.4/hook",
    "http://192.168.1.1/hook",
    "http://127.0.0.1:8080/hook",
    "http://[::1]/hook",
    "http://0.0.0.0/hook",
    "http://[::]/hook",
    "http://224.0.0.1/hook",  # multicast
    "http://100.64.0.1/hook",  # shared address space (carrier-grade NAT)
    "http://[fe80::1]/hook",  # link-local
    "http://[fd00::1]/hook",  # unique local
    "http://[::ffff:10.0.0.1]/hook",  # IPv4-mapped private
    "http://[::ffff:169.254.169.254]/hook",
    "http://[64:ff9b::a00:1]/hook",  # 10.0.0.1 through the well-known NAT64 prefix
    "http://[64:ff9b::a9fe:a9fe]/hook",  # ... the metadata service
    "http://[2002:a00:1::]/hook",  # 10.0.0.1 inside a 6to4 address
    "http://[64:ff9b:1::5]/hook",  # local-use NAT64
    "http://[::ffff:0:a9fe:a9fe]/hook",  # 169.254.169.254, IPv4-translated (SIIT)
    "http://[::ffff:0:a00:1]/hook",  # 10.0.0.1, IPv4-translated
    "http://[fec0::1]/hook",  # site-local (deprecated; the standard library calls it global)
    "http://[3fff::1]/hook",  # documentation (RFC 9637)
    "http://[5f00::1]/hook",  # SRv6 SIDs (RFC 9602)
    "http://[::7f00:1]/hook",  # 127.0.0.1, IPv4-compatible (deprecated)
    "http://2130706433/hook",  # 127.0.0.1 as one decimal number
    "http://0xa9.0xfe.0xa9.0xfe/hook",  # 169.254.169.254 in hex
    "http://0251.0376.0251.0376/hook",  # ... and in octal
    "http://10.1/hook",  # 10.0.0.1, short form
    "http://localhost/hook",
    "http://api.localhost/hook",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://printer.local/hook",
]


@pytest.mark.parametrize("url", REFUSED)
def test_private_loopback_link_local_and_reserved_targets_are_refused(url: str) -> None:
    with pytest.raises(UnsafeTarget, match="refused"):
        check_url(url, allow_loopback=False)


@pytest.mark.parametrize("url", ["https://hooks.example.com/conductor", "http://93.184.215.14/x",
                                 "https://[2606:4700::1111]/x", "http://[64:ff9b::5db8:d70e]/x",
                                 "http://[::ffff:0:5db8:d70e]/x"])  # NAT64 and SIIT to a public address
def test_public_targets_pass_the_submit_check(url: str) -> None:
    check_url(url, allow_loopback=False)


def test_allowing_loopback_admits_loopback_only() -> None:
    for url in ("http://127.0.0.1:9/x", "http://[::1]/x", "http://localhost:8080/x", "http://127.1/x"):
        check_url(url, allow_loopback=True)
    for url in ("http://10.0.0.1/x", "http://169.254.169.254/x", "http://0.0.0.0/x", "http://192.168.0.1/x"):
        with pytest.raises(UnsafeTarget):
            check_url(url, allow_loopback=True)


def test_legacy_ipv4_forms_are_read_as_the_address_a_resolver_would_use() -> None:
    assert str(literal_address("2130706433")) == "127.0.0.1"
    assert str(literal_address("0x7f.1")) == "127.0.0.1"
    assert str(literal_address("[::1]")) == "::1"
    assert literal_address("hooks.example.com") is None


def test_a_name_resolving_to_any_unsafe_address_is_refused_at_send_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS can point a public-looking name at the metadata service; the send-time check sees through it.
    The tenant reads the error: it is the same as for a name that does not resolve, so webhook URLs cannot
    probe which internal names exist (before: "… resolves to a private address" vs "cannot resolve …")."""
    def fake_getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        if host == "nowhere.example.com":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        assert host == "rebind.example.com"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    errors = []
    for host in ("rebind.example.com", "nowhere.example.com"):
        with pytest.raises(Unresolvable, match="does not resolve to a public address") as refused:
            resolve(f"https://{host}/hook", allow_loopback=False)
        errors.append(str(refused.value).replace(host, "HOST"))
    assert errors[0] == errors[1] and "169.254" not in errors[0]


def test_a_url_with_credentials_is_refused() -> None:
    # they would not be sent (no Basic auth from a URL): every attempt would fail 401 until the schedule ended
    for url in ("https://user:pw@hooks.example.com/x", "https://token@hooks.example.com/x"):
        with pytest.raises(UnsafeTarget, match="user name or password"):
            check_url(url, allow_loopback=False)


def test_send_time_target_pins_the_checked_address(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    target = resolve("https://hooks.example.com:8443/x", allow_loopback=False)
    assert (target.scheme, target.host, target.port, str(target.address)) == (
        "https", "hooks.example.com", 8443, "93.184.215.14")


def test_problem_names_the_kind_of_address() -> None:
    assert "link-local" in (address_problem(literal_address("169.254.169.254"), allow_loopback=False) or "")  # type: ignore[arg-type]
    assert "private" in (address_problem(literal_address("10.0.0.1"), allow_loopback=False) or "")  # type: ignore[arg-type]


def test_an_ipv6_address_carrying_an_ipv4_one_names_both() -> None:
    problem = address_problem(literal_address("[64:ff9b::a00:1]"), allow_loopback=False)  # type: ignore[arg-type]
    assert problem == "64:ff9b::a00:1 is a private address (10.0.0.1) inside an IPv6 one"


def _denied(**env: str) -> Denied:
    return denied_of(Settings(**env))  # type: ignore[arg-type]


def test_the_deployments_own_targets_are_refused_at_submit() -> None:
    """``CONDUCTOR_WEBHOOK_DENIED_TARGETS`` (addresses, networks, names) and the API's own names
    (``CONDUCTOR_ALLOWED_HOSTS``): public, yet this deployment's, so a webhook from inside must not reach them."""
    denied = _denied(webhook_denied_targets="93.184.215.14, 151.101.64.0/24, 2606:4700:7::/48, flower.example.com, "
                                            "*.ops.example.com",
                     allowed_hosts="api.example.com:443,*.tenants.example.com,localhost,127.0.0.1,104.16.0.9")
    assert denied.names == ("flower.example.com", "*.ops.example.com", "api.example.com")
    for url in ("http://93.184.215.14:5555/api/worker/shutdown/w1", "https://151.101.64.200/hook",
                "http://[::ffff:93.184.215.14]:5555/x", "http://[64:ff9b::5db8:d70e]/x", "https://[2606:4700:7::1]/x",
                "https://FLOWER.example.com./api", "https://grafana.ops.example.com/x", "https://api.example.com/v1/jobs",
                "http://104.16.0.9/x"):
        with pytest.raises(UnsafeTarget, match="this deployment's own") as refused:
            check_url(url, allow_loopback=False, denied=denied)
        assert "CONDUCTOR_WEBHOOK_DENIED_TARGETS" in str(refused.value)
    # Near misses pass: the API's wildcard is not a name of its own (a tenant's receiver may live below it),
    # a name next to a denied one, the network's neighbour, and loopback where the operator allows it.
    for url in ("https://hooks.tenants.example.com/x", "https://ops.example.com/x", "https://example.com/x",
                "https://151.101.65.1/x", "https://93.184.215.15/x", "https://flower.example.com.evil.test/x"):
        check_url(url, allow_loopback=False, denied=denied)
    check_url("http://localhost:9000/x", allow_loopback=True, denied=denied)
    check_url("http://127.0.0.1:9000/x", allow_loopback=True, denied=denied)


def test_a_name_resolving_into_a_denied_network_is_refused_at_send_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's own name pointed at the deployment's public address (a hairpin past its firewall) reads as
    any unsafe target: not sent, the same error as a name that does not resolve."""
    def fake_getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::ffff:93.184.215.14", port, 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    with pytest.raises(Unresolvable, match="does not resolve to a public address"):
        resolve("https://innocent.example.net/hook", allow_loopback=False,
                denied=_denied(webhook_denied_targets="93.184.215.0/28"))
    assert resolve("https://innocent.example.net/hook", allow_loopback=False).address == ipaddress.ip_address(
        "::ffff:93.184.215.14")  # (public, and sent, where nothing is denied)


@pytest.mark.parametrize("entry", ["*", "93.184.215.14/33", "a*b.example.com", "*.", "[]", "http://x.example.com",
                                   "flower.example.com:5555:1", "a b", "10", "1.2.3", "0x08080404", "-x.example.com"])
def test_a_malformed_denied_target_stops_the_process_at_start(entry: str) -> None:
    """Including what a resolver would read as an address (``10`` is 0.0.0.10): written so, it protected
    nothing (kept as a name no URL's host has)."""
    with pytest.raises(ValueError, match="CONDUCTOR_WEBHOOK_DENIED_TARGETS entry"):
        Settings(webhook_denied_targets=entry)  # type: ignore[call-arg]


def test_denied_entries_are_read_as_the_urls_they_must_match() -> None:
    """An address with a port (as CONDUCTOR_ALLOWED_HOSTS may write it), an IPv4-mapped one, an
    internationalised or upper-case name: each refuses the URL a tenant would write for that target (stored
    URLs hold punycode names and plain addresses), not only the spelling listed."""
    denied = _denied(webhook_denied_targets="8.8.8.8:443, [2606:4700::1]:443, ::ffff:1.1.1.1, Flöwer.Example.COM., "
                                            "*.Bücher.example")
    for url in ("http://8.8.8.8/x", "https://[2606:4700::1]/x", "https://1.1.1.1/x", "http://[::ffff:1.1.1.1]/x",
                normalize_url("https://flöwer.example.com/x"), normalize_url("https://shop.bücher.example/x")):
        with pytest.raises(UnsafeTarget, match="this deployment's own"):
            check_url(url, allow_loopback=False, denied=denied)
    check_url("https://8.8.4.4/x", allow_loopback=False, denied=denied)
    assert denied_of(Settings(webhook_denied_targets="8.8.8.8")) is denied_of(  # type: ignore[call-arg]
        Settings(webhook_denied_targets="8.8.8.8"))  # type: ignore[call-arg]  # built once per value
