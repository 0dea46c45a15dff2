"""The scheduling class a tenant's requests carry, shared by the gateway (tenant file, shedding,
admission) and the scheduler (queues)."""

from __future__ import annotations

import enum


class Priority(enum.IntEnum):
    """Values equal infermesh.v1.Priority numbers; lower is served first."""

    CRITICAL = 1
    STANDARD = 2
    SHEDDABLE = 3

    @classmethod
    def from_wire(cls, value: int) -> Priority:
        """PRIORITY_UNSPECIFIED (0) means STANDARD."""
        return cls.STANDARD if value == 0 else cls(value)
