"""A TCP forwarder from the host's loopback into a network namespace: the real-node cluster's API server
(which lives in the fabric namespace) as https://127.0.0.1:<port> for kubectl, tests and people.

    python -m devcluster.nsproxy --netns /run/netns/sgdjob-fabric --listen 127.0.0.1:PORT --connect 10.250.0.1:6443

The listening socket is made in the host's namespace first; then the (single-threaded) process
switches itself into the target namespace, so every connection it opens from then on starts there.
A socket keeps the namespace it was created in, which is what makes one process serve both sides.
Python 3.11 has no os.setns, hence libc through ctypes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import socket
from collections.abc import Sequence

CLONE_NEWNET = 0x40000000


def setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(listener: socket.socket, host: str, port: int) -> None:
    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=10)
        except (OSError, TimeoutError):
            c_writer.close()
            return
        await asyncio.gather(_pipe(c_reader, s_writer), _pipe(s_reader, c_writer))

    server = await asyncio.start_server(handle, sock=listener)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devcluster.nsproxy", description=__doc__)
    parser.add_argument("--netns", required=True, help="namespace file, e.g. /run/netns/sgdjob-fabric")
    parser.add_argument("--listen", required=True, help="host:port on this machine's loopback")
    parser.add_argument("--connect", required=True, help="host:port inside the namespace")
    args = parser.parse_args(argv)
    lhost, lport = args.listen.rsplit(":", 1)
    chost, cport = args.connect.rsplit(":", 1)
    listener = socket.create_server((lhost, int(lport)), reuse_port=False)
    setns(args.netns)
    asyncio.run(_serve(listener, chost, int(cport)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
