"""Container health check: exit 0 when the service's grpc.health.v1 reports SERVING.

    python /app/healthcheck.py gateway          # dials 127.0.0.1:$INFERMESH_GATEWAY_PORT
    python /app/healthcheck.py 127.0.0.1:50051  # or an explicit host:port (plaintext)

Used by the images' HEALTHCHECK (and so by compose's depends_on). The check itself is
services.common.health_probe, which Kubernetes runs as its exec probe: with the service's
INFERMESH_<SERVICE>_TLS_* files set it dials with the service's own certificate (the
scheduler and workers require one), else plaintext.
"""

from __future__ import annotations

import os
import sys

from services.common.health_probe import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], dict(os.environ)))
