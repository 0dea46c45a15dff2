from __future__ import annotations

from infermesh.v1 import scheduler_pb2
from services.worker.attach_client import _guarded_batch
from services.worker.expired_items import DEADLINE_EXCEEDED, split_expired


def batch(*deadlines_us: int) -> scheduler_pb2.ExecuteBatch:
    command = scheduler_pb2.ExecuteBatch(batch_id=7, deadline_unix_us=max(deadlines_us))
    for item_id, deadline_us in enumerate(deadlines_us, start=1):
        command.items.add(item_id=item_id, top_k=1, deadline_unix_us=deadline_us)
    return command


def test_items_past_their_deadline_are_answered_not_computed():
    live, expired = split_expired(batch(1_000, 5_000, 0, 2_000), now_unix_us=2_500)
    assert [item.item_id for item in live.items] == [2, 3]  # 0 means no deadline
    assert live.batch_id == 7
    assert [(r.item_id, r.error.code) for r in expired] == [(1, DEADLINE_EXCEEDED), (4, DEADLINE_EXCEEDED)]
    assert expired[0].error.message == "deadline passed 1.5 ms before the worker could start it; not computed"


def test_a_batch_with_nothing_expired_is_passed_on_as_it_is():
    command = batch(5_000, 0)
    live, expired = split_expired(command, now_unix_us=2_500)
    assert live is command and expired == []


def test_the_runtime_sees_only_live_items_and_the_reply_answers_every_item():
    seen = []

    class Runtime:
        def execute_batch(self, command):
            seen.extend(item.item_id for item in command.items)
            return scheduler_pb2.BatchResult(batch_id=command.batch_id,
                                             items=[scheduler_pb2.ItemResult(item_id=i.item_id) for i in command.items])

    far_future_us = 2**62
    result = _guarded_batch(Runtime(), batch(1, far_future_us, 2))
    assert seen == [2]
    assert sorted(r.item_id for r in result.items) == [1, 2, 3]
    assert {r.item_id for r in result.items if r.error.code == DEADLINE_EXCEEDED} == {1, 3}
