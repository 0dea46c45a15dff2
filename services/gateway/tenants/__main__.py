"""python -m services.gateway.tenants hash-key: the digest of an API key read from stdin (directory.main)."""

import sys

from services.gateway.tenants.directory import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
