"""The job's rendezvous store: `python -m sgdjob_trainer.rendezvous_store --host H --port P`.

Hosts a c10d TCPStore that torchrun's agents use for their c10d rendezvous (`--rdzv-conf is_host=0`).
It runs in its own small pod so that no worker's loss, worker 0's included, takes the rendezvous
with it. torch is imported only here, when the store actually runs: the operator image has no torch.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from datetime import timedelta
from types import FrameType

log = logging.getLogger("sgdjob_trainer.rendezvous_store")


def serve(host: str, port: int, stop: threading.Event) -> None:
    """Run the store until `stop` is set. The store lives as long as this frame holds it."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch only where the store runs

    # TCPStore alone listens on every interface; binding the socket ourselves keeps it to the pod IP,
    # so several jobs' stores can share a machine whose pods are loopback addresses (the devcluster node agent).
    sock = socket.create_server((host, port), backlog=1024, reuse_port=False)
    # wait_for_workers=False: membership is elastic and nobody knows the world size up front.
    store = TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
        timeout=timedelta(seconds=900),
    )
    sock.detach()  # the store owns the descriptor now and closes it itself
    log.info("rendezvous store listening on %s:%d", host, port)
    try:
        stop.wait()
    finally:
        log.info("rendezvous store stopping")
        del store


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sgdjob_trainer.rendezvous_store", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (the pod IP)")
    parser.add_argument("--port", type=int, default=29400)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    serve(args.host, args.port, stop)


if __name__ == "__main__":
    main()
