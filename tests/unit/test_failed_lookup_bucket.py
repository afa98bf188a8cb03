"""Failed key lookups count per client address (``quotas.failed_lookup_bucket``): an IPv6 address by its /64,
which one subscriber usually holds whole (a bucket per address gave it 2^64 of them), and an IPv4-mapped
IPv6 address as its IPv4 address (a dual-stack socket reports IPv4 clients so: one client, one bucket)."""

from __future__ import annotations

import pytest

from conductor.quotas import failed_lookup_bucket


@pytest.mark.parametrize(("client", "bucket"), [
    ("203.0.113.7", "203.0.113.7"),
    ("::ffff:203.0.113.7", "203.0.113.7"),
    ("::FFFF:cb00:7107", "203.0.113.7"),
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
    ("2001:DB8:1:2::1", "2001:db8:1:2::/64"),
    ("[2001:db8:1:2::1]", "2001:db8:1:2::/64"),
    ("::1", "::/64"),
    ("unknown", "unknown"),
    ("testclient", "testclient"),
])
def test_bucket(client: str, bucket: str) -> None:
    assert failed_lookup_bucket(client) == bucket


def test_another_64_is_another_bucket() -> None:
    assert failed_lookup_bucket("2001:db8:1:2::1") != failed_lookup_bucket("2001:db8:1:3::1")
