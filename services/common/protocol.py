"""Numbers two services must agree on, each kept once here."""

from __future__ import annotations

# The Attach protocol (protos/infermesh/v1/scheduler.proto) a worker speaks in its hello and the
# newest one a scheduler serves.
ATTACH_PROTOCOL_VERSION = 1

# Generated tokens a request gets when it names no max_tokens: the scheduler generates up to this
# (capped by the model's max sequence length), and the gateway charges the tenant's token quota for
# it up front (refunding what was not generated).
DEFAULT_MAX_TOKENS = 128
