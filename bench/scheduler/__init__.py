"""The scheduler on its own gRPC API: batching, continuous against static batching, chunked prefill,
fairness, prefix caching, scale on mock workers, the step path's CPU, and tokenizing (in-process)."""
