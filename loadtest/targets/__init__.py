"""Target kinds the load test speaks, one module each, behind targets.base.Target."""
