"""The tenant the token-path benchmarks' gateway admits (bench_token_path's e2e part, bench_lone_stream)."""

from __future__ import annotations

from tools.testbed.gateway_fixtures import tenant

# make up's demo traffic comes from tenant alpha (critical); quotas generous so none refuses the load.
E2E_API_KEY = "bench-token-path"
E2E_TENANT = tenant("bench", E2E_API_KEY, priority="critical")
