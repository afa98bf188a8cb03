"""The broker channel reuses one Redis client (conductor/tasks/transport.py) and still moves messages."""

from __future__ import annotations

import os

import pytest
from kombu import Connection, Exchange, Queue

from conductor.tasks import transport
from conductor.tasks.app import create_app


@pytest.fixture
def connection() -> Connection:
    transport.install()
    url = os.environ.get("CONDUCTOR_TEST_BROKER_URL", "redis://127.0.0.1:6379/5")
    with Connection(url) as conn:
        yield conn


def test_the_app_publishes_through_the_shared_client_transport() -> None:
    with create_app().connection_for_write() as conn:
        assert isinstance(conn.transport, transport.Transport)


def test_one_client_per_pool_and_messages_still_flow(connection: Connection) -> None:
    channel = connection.default_channel
    assert isinstance(channel, transport.Channel)
    first = channel._create_client()
    assert channel._create_client() is first  # no client per command
    assert channel._create_client(asynchronous=True) is not first  # BRPOP keeps its own connection pool

    queue = Queue("conductor-transport-test", Exchange("conductor-transport-test"), "t")
    with connection.Producer() as producer:
        for i in range(3):
            producer.publish({"n": i}, exchange=queue.exchange, routing_key="t", declare=[queue])
    got = []
    with connection.SimpleQueue(queue) as simple:
        for _ in range(3):
            message = simple.get(timeout=5)
            got.append(message.payload["n"])
            message.ack()  # the ack's unacked-index update goes through the shared client too
    assert got == [0, 1, 2]
    assert channel._create_client() is first

    channel._disconnect_pools()  # after a connection error kombu rebuilds the pool: a client of the new one
    assert channel._create_client() is not first
    assert channel._create_client().connection_pool is channel.pool
