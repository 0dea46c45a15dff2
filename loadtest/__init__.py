"""Open-loop load generator and tail-latency report writer for inference servers.

Drives only public APIs: infermesh's gRPC, OpenAI HTTP and KServe v2 (loadtest/targets/);
see docs/loadtest.md.
"""

REPORT_SCHEMA = "infermesh.loadtest/v1"
SWEEP_SCHEMA = "infermesh.loadtest.sweep/v1"
