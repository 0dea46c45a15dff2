"""Label values for metrics that carry what a caller asked for: bounded, whatever callers send.

A label value made from request input (a model name, a tenant id) creates a new time series per
distinct value, so anyone who can send requests could grow the metric store without bound. Values
come only from what the service knows; anything else is counted under `OTHER`.
"""

from __future__ import annotations

from collections.abc import Callable

# One fixed value for everything the service does not know (a leading "_" cannot be a model name
# the model repository accepts, so it never collides with a real one).
OTHER = "_other"


class KnownValues:
    """`value` itself when `is_known(value)`, else OTHER (e.g. models a scheduler serves)."""

    __slots__ = ("_is_known",)

    def __init__(self, is_known: Callable[[str], bool]) -> None:
        self._is_known = is_known

    def __call__(self, value: str) -> str:
        return value if value and self._is_known(value) else OTHER


class FirstSeen:
    """The first `limit` distinct values keep their own label; later ones share OTHER.

    For values the service cannot check itself (a scheduler's tenant ids come from its gateways):
    the series count stays bounded even if a caller floods made-up values.
    """

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self._limit and value:
            self._seen.add(value)
            return value
        return OTHER


class KnownVersions:
    """A model version's label: itself when `is_known(model, version)`, else OTHER; `none` when empty.

    A version once known keeps its label (remembered, so the hot path is one set lookup): the
    versions a service ever knew are few, and a series must not flip to OTHER when a version
    leaves the routing file while its last requests finish.
    """

    __slots__ = ("_is_known", "_known", "_none")

    def __init__(self, is_known: Callable[[str, str], bool], none: str) -> None:
        self._is_known = is_known
        self._known: set[tuple[str, str]] = set()
        self._none = none

    def __call__(self, model: str, version: str) -> str:
        if not version:
            return self._none
        if (model, version) in self._known:
            return version
        if model != OTHER and self._is_known(model, version):
            self._known.add((model, version))
            return version
        return OTHER
