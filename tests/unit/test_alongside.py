"""A worker process's local slots (conductor/tasks/alongside.py): never more steps at once than slots,
a full set says so instead of queueing, and a slot comes back when its run ends, raised or not."""

from __future__ import annotations

import threading

import pytest

from conductor.tasks.alongside import THREAD_PREFIX, LocalSlots, local_slots


def test_a_full_set_refuses_and_a_finished_run_gives_its_slot_back() -> None:
    slots = LocalSlots(2)
    gate = threading.Event()
    names: list[str] = []

    def hold() -> str:
        names.append(threading.current_thread().name)
        gate.wait(10)
        return "done"

    first, second = slots.start(hold), slots.start(hold)
    assert first is not None and second is not None and slots.spare() == 0
    assert slots.start(hold) is None  # nothing queues behind a busy slot: the caller runs it itself
    gate.set()
    assert (first.result(10), second.result(10)) == ("done", "done")
    assert all(name.startswith(THREAD_PREFIX) for name in names)
    assert slots.spare() == 2

    def boom() -> None:
        raise ValueError("a step's run raised")

    failed = slots.start(boom)
    assert failed is not None
    with pytest.raises(ValueError):
        failed.result(10)
    assert slots.spare() == 2


def test_no_slots_run_nothing_and_a_process_has_one_set_per_size() -> None:
    assert LocalSlots(0).start(lambda: None) is None
    assert local_slots(3) is local_slots(3) and local_slots(3) is not local_slots(4)
