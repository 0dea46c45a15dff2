"""python -m services.gateway.tenants hash-key: the digest of an API key read from stdin (directory.main);
python -m services.gateway.tenants fetch-jwks: an OIDC issuer's JWKS into a file (oidc_fetch.main)."""

import sys

from services.gateway.tenants import oidc_fetch
from services.gateway.tenants.directory import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(oidc_fetch.main(argv[1:]) if argv[:1] == ["fetch-jwks"] else main(argv))
