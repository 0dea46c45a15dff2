"""The token fast path: scheduler and gateway CPU per token, end to end against request-level batching,
and the floors under it (a grpc.aio hop, one decode step, one lone stream)."""
