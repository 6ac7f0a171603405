"""A rendezvous store that stops answering while the job stalls is re-homed after
runPolicy.storeLostGraceSeconds, long before its node would be declared lost: force-deleted, recreated
off its node with a StoreLost Event, and the worker failures it causes spend no backoffLimit. The
store here is a real HTTP server at the store pod's address and health port, answering GET /healthz
200 as a serving store does, closed to play the power cut (its Node still reads Ready, as it does for
the node controller's first 40 s)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sgdjob_operator.k8s.builders import RDZV_HEALTH_PORT
from sgdjob_trainer.wire.launch_contract import STORE_HEALTH_PATH
from tests.operator.conftest import Cluster, Operator, wait_for
from tests.operator.test_node_loss import _excluded, _node

pytestmark = pytest.mark.k8s


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == STORE_HEALTH_PATH else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


class StoreHealth:
    """What the operator asks of the store: its health endpoint, serving until `close`."""

    def __init__(self, ip: str) -> None:
        self.server = ThreadingHTTPServer((ip, RDZV_HEALTH_PORT), _Healthy)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.server.shutdown()
            self.server.server_close()


def test_a_silent_store_is_re_homed_off_its_node_and_its_failures_are_free(
    cluster: Cluster, operator: Operator
) -> None:
    home, other = f"{cluster.ns}-s", f"{cluster.ns}-t"
    for name in (home, other):
        _node(cluster, name)
    ip = "127.0.13.4"
    listener = StoreHealth(ip)
    try:
        cluster.apply(
            "sl",
            {"replicas": 2, "runPolicy": {"backoffLimit": 0, "storeLostGraceSeconds": 5, "nodeLostGraceSeconds": 600}},
        )
        wait_for("2 worker pods", lambda: len(cluster.pods("sl")) == 2)
        cluster.run_pod("sl-worker-0", "127.0.13.2", node=home)
        cluster.run_pod("sl-worker-1", "127.0.13.3", node=other)
        store = wait_for("rendezvous pod", lambda: cluster.pods("sl", role="rendezvous").get("sl-rdzv"))
        cluster.run_pod("sl-rdzv", ip, node=home)
        wait_for(
            "the store answering the operator",
            lambda: (cluster.status("sl").get("controller") or {}).get("storeAnswered") == store.metadata.uid,
            timeout=30,
        )

        listener.close()  # the power cut: nothing answers at the store's address any more
        cut = time.monotonic()
        # The worker on the dead node fails as its kubelet never would report; the survivor's agent loses
        # the store and exits: neither may spend backoffLimit 0.
        wait_for("the silence noticed", lambda: (cluster.status("sl").get("controller") or {}).get("storeSilence"))
        cluster.end_pod("sl-worker-1", 1)
        new = wait_for(
            "the store recreated",
            lambda: (
                (p := cluster.pods("sl", role="rendezvous").get("sl-rdzv")) is not None
                and p.metadata.uid != store.metadata.uid
                and p
            ),
            timeout=40,
        )
        took = time.monotonic() - cut
        assert 5 <= took <= 5 + 10, took  # the grace, then the next pass (whole-second times, 2 s probes)
        assert home in _excluded(new), "kept off the node that still reads Ready"
        lost = [e.message for e in cluster.events("sl") if e.reason == "StoreLost"]
        assert len(lost) == 1 and f"sl-rdzv on node {home}" in lost[0], lost
        failed = [e.message for e in cluster.events("sl") if e.reason == "WorkerFailed"]
        assert failed and all("not counted: infrastructure" in m for m in failed), failed
        status = cluster.status("sl")
        assert status.get("restarts", 0) == 0 and status["phase"] != "Failed", status
        assert status["controller"]["storeMove"]["node"] == home
        print(f"silent store re-homed {took:.1f}s after its health endpoint closed (grace 5 s)")
    finally:
        listener.close()
        for name in (home, other):
            cluster.core.delete_node(name)
