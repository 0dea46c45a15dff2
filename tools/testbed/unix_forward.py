"""python -m tools.testbed.unix_forward --listen PATH --to HOST:PORT

Accepts on a Unix socket and relays each connection to HOST:PORT. Started inside a network
namespace (ip netns exec) it lets a test in the root namespace reach a service that has no
route from there: a filesystem socket is not bound to a network namespace, so no link or
route between the namespaces and the host is ever needed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


async def _relay(host: str, port: int, client_reader, client_writer) -> None:
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(_pipe(client_reader, upstream_writer), _pipe(upstream_reader, client_writer))


async def _serve(path: str, host: str, port: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = await asyncio.start_unix_server(lambda r, w: _relay(host, port, r, w), path=path)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="Unix socket path to accept on")
    parser.add_argument("--to", required=True, help="HOST:PORT each connection is relayed to")
    args = parser.parse_args()
    host, _, port = args.to.rpartition(":")
    asyncio.run(_serve(args.listen, host, int(port)))


if __name__ == "__main__":
    main()
