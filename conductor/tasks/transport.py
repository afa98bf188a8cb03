"""kombu's Redis transport, with one Redis client per channel instead of one per command.

kombu's Redis channel builds a new ``redis.Redis`` client for every publish, acknowledgement and
unacked-index update (``Channel.conn_or_acquire`` calls ``_create_client``). With redis-py 8 building one
costs about 0.1 ms of CPU (it fills a case-insensitive table of some 200 response callbacks), more than
the ``LPUSH`` it is built for, and a step takes three of them: 5.7 % of a worker's CPU at full load
(docs/benchmarks.md, throughput profile). A client holds no connection of its own (each command checks
one out of the channel's pool and returns it), and redis-py documents clients as safe to share between
threads, so the channel keeps one per pool. Pub/sub and the consumer's BRPOP keep kombu's own clients.

The channel also keeps the parameters of its Redis connection pool, so that it can still acknowledge and
restore its messages after its kombu connection was collected (``Channel._connparams``): without them a
Celery worker exited on losing Redis with a message unacknowledged (docs/architecture.md, Worker
supervision).
"""

from __future__ import annotations

import logging
from typing import Any

import kombu.transport
import redis
from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)


class Channel(kombu_redis.Channel):
    _shared_client: Any = None
    _pool_params: dict[str, Any] | None = None
    """What the channel's (synchronous) pool was built from, while its kombu connection was attached."""

    def _connparams(self, asynchronous: bool = False) -> Any:
        """kombu's parameters for a pool of this channel, or, once its kombu connection is detached, the ones
        it had: a pool for the acknowledgements and restores of the messages it delivered.

        When a Celery worker loses Redis, its consumer first collects the broken connection (``collect``:
        the default channel's close fails on the dead socket and is left half done, then the transport's
        ``client`` is set to None) and then closes it (``close``), which closes that channel again: its
        pools were dropped, and restoring the unacknowledged messages of the task in flight builds a new
        pool from ``transport.client.hostname``. That raised ``AttributeError: 'NoneType' object has no
        attribute 'hostname'``, not a connection error, so it escaped Celery's reconnection as
        "Unrecoverable error" and the worker process exited (the supervisor restarted it; kombu #582 is the
        same failure by another path). With the saved parameters the restore meets Redis as it is: away, a
        redis ``ConnectionError``, which kombu's close ignores (the message stays in the unacked hash); back,
        the message is restored to its queue (a copy of a running step's message, refused by its claim).
        The task's late acknowledgement, made on this channel, reaches Redis the same way: on the threads
        pool Celery runs it from its event loop, which resumes once the consumer has reconnected, and it
        removes the message from the unacked hash. One made while Redis is still away (a gevent worker
        acknowledges at once) fails as kombu's "Couldn't ack", and the message is delivered again after the
        visibility timeout, to be refused by its claim. The consumer's own BRPOP and pub/sub pools are never
        rebuilt for a detached (or closed) channel: asking for one raises a connection error."""
        transport = self.connection  # None once the channel is closed
        if transport is None or transport.client is None:
            if asynchronous or self._pool_params is None:
                raise redis.exceptions.ConnectionError("the broker connection of this channel was closed")
            return dict(self._pool_params)
        params = super()._connparams(asynchronous=asynchronous)
        if not asynchronous:
            self._pool_params = dict(params)
        return params

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> Any:
        """kombu's, except that an acknowledgement on a detached channel (its connection lost, ``_connparams``)
        that finds Redis still away is logged in one line instead of raising. A gevent worker acknowledges a
        task the moment it ends (Celery's ``call_soon_ack`` without an event loop), so every step that ended
        during an outage raised here, and kombu logged each as "Couldn't ack" with a traceback: up to a
        thousand of them for a ``--concurrency 1000`` worker. Nothing more could be done with it: a Redis that
        kept the message delivers it again after the visibility timeout, and its claim refuses the copy; one
        that lost its data lost the message too. On an attached channel the error is kombu's and Celery's,
        as before."""
        try:
            return super().basic_ack(delivery_tag, multiple=multiple)
        except self.connection_errors as exc:
            transport = self.connection
            if transport is not None and transport.client is not None:
                raise
            log.warning("message %s: its acknowledgement is lost with the broker connection (%r); a Redis that "
                        "kept the message delivers it again after the visibility timeout, and its claim refuses it",
                        delivery_tag, exc)
            return None

    def queue_delete(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        """kombu's, except that a channel closing with Redis away leaves the binding of its auto-delete queue
        behind instead of raising. Celery's gossip and remote-control consumers each close such a channel
        when the worker reconnects after losing Redis, through ``ignore_errors(c.connection, ...)`` while
        ``c.connection`` is already None: the refused connection then became an AttributeError logged with
        its traceback ("Error on restarting Gossip"), once per outage. The close goes on without it. What
        is left behind is a binding to a queue no one consumes, as a worker that dies leaves; a Redis that
        lost its data has none."""
        try:
            return super().queue_delete(queue, *args, **kwargs)
        except self.connection_errors as exc:
            if not self._closing:
                raise
            log.info("closing a broker channel with Redis away: the binding of %s is left behind (%r)", queue, exc)
            return None

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
