"""Open-loop load generator and tail-latency report writer for the infermesh gateway.

Drives only the public API (`infermesh.v1.Inference`); see docs/loadtest.md.
"""

REPORT_SCHEMA = "infermesh.loadtest/v1"
SWEEP_SCHEMA = "infermesh.loadtest.sweep/v1"
