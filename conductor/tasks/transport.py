"""kombu's Redis transport, with one Redis client per channel instead of one per command.

kombu's Redis channel builds a new ``redis.Redis`` client for every publish, acknowledgement and
unacked-index update (``Channel.conn_or_acquire`` calls ``_create_client``). With redis-py 8 building one
costs about 0.1 ms of CPU (it fills a case-insensitive table of some 200 response callbacks), more than
the ``LPUSH`` it is built for, and a step takes three of them: 5.7 % of a worker's CPU at full load
(docs/benchmarks.md, throughput profile). A client holds no connection of its own (each command checks
one out of the channel's pool and returns it), and redis-py documents clients as safe to share between
threads, so the channel keeps one per pool. Pub/sub and the consumer's BRPOP keep kombu's own clients.
"""

from __future__ import annotations

from typing import Any

import kombu.transport
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _shared_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the consumer's BRPOP connection and pub/sub: kombu's own, one each
            return super()._create_client(asynchronous=True)
        client = self._shared_client
        if client is None or client.connection_pool is not self.pool:  # the pool is rebuilt after an error
            client = self._shared_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    """Makes ``redis://`` and ``rediss://`` broker URLs use this transport (kombu picks the transport by
    the URL's scheme from its alias table, before any connection is made)."""
    for scheme in ("redis", "rediss"):
        kombu.transport.TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
