"""Scheduler: per-model queues, dynamic and continuous batching, worker attachment."""
