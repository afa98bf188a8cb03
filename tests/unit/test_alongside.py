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


def test_only_steps_of_remote_models_are_claimed_to_run_beside() -> None:
    from conductor import engine
    from conductor.pool.config import PoolConfig
    from conductor.settings import get_settings

    pool = PoolConfig.model_validate({"planner": "template:single", "agents": {
        "remote": {"provider": "sim"}, "llama": {"provider": "local", "model": "qwen2.5-coder-1.5b-instruct-q4_k_m"}}})

    def take(spare: int) -> engine.Taker:
        return engine.Taker(worker="w", task_id=None, settings=get_settings(), runs=lambda *_: True,
                            spare=lambda: spare)

    mixed = {0: "llama", 1: "remote", 2: "llama", 3: "remote"}
    # The first runs in the task's own slot whatever its provider; a local model's steps are never put on a
    # slot beside it (they would wait for the model's lock there): they are sent.
    assert engine._to_take(take(8), "j", [0, 1, 2, 3], mixed, pool) == [0, 1, 3]
    assert engine._to_take(take(1), "j", [0, 1, 2, 3], mixed, pool) == [0, 1]
    assert engine._to_take(take(8), "j", [2, 0], mixed, pool) == [2]
    remote = dict.fromkeys(range(4), "remote")
    assert engine._to_take(take(0), "j", [0, 1, 2, 3], remote, pool) == [0]
    assert engine._to_take(take(8), "j", [0, 1, 2, 3], remote, None) == [0]  # the job's pool unknown here
