"""Gateway: the edge. Auth, tenant quotas, deadlines, retries, shedding, routing."""
