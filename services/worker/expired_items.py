"""Classify items whose deadline passed before their batch started: answered, never computed.

A batch can wait on the worker (behind the running one) long enough for some of its
items to expire; computing them would spend the time the next batch needs on answers
nobody reads. Checked right before compute, on the worker's clock (unix time: the
scheduler sent absolute deadlines).
"""

from __future__ import annotations

from infermesh.v1 import scheduler_pb2

DEADLINE_EXCEEDED = 4  # google.rpc.Code


def split_expired(command: scheduler_pb2.ExecuteBatch, now_unix_us: int
                  ) -> tuple[scheduler_pb2.ExecuteBatch, list[scheduler_pb2.ItemResult]]:
    """(the batch without its expired items, their DEADLINE_EXCEEDED results); the command itself
    when nothing expired (the common case costs one pass and no copy)."""
    expired = [item for item in command.items if 0 < item.deadline_unix_us <= now_unix_us]
    if not expired:
        return command, []
    live = scheduler_pb2.ExecuteBatch(batch_id=command.batch_id, deadline_unix_us=command.deadline_unix_us)
    expired_ids = {item.item_id for item in expired}
    live.items.extend(item for item in command.items if item.item_id not in expired_ids)
    results = [
        scheduler_pb2.ItemResult(item_id=item.item_id, error=scheduler_pb2.ItemError(
            code=DEADLINE_EXCEEDED,
            message=f"deadline passed {(now_unix_us - item.deadline_unix_us) / 1000:.1f} ms before the worker "
                    "could start it; not computed"))
        for item in expired
    ]
    return live, results
