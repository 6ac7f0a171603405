"""The files a real-node cluster (devcluster/realnodes.py) runs on, written before its first daemon
starts: the service-account key pair, the API server's token file and a kubeconfig per identity, the
admin's two kubeconfigs (host loopback and in-cluster), the nodes' resolver, and each node's folder
with its CNI and containerd configuration; and the host folders the nodes mount over. What the files
say is realconf.py's (pure); this module only writes them.
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

from devcluster import realconf, realhost
from devcluster.controlplane import free_port, kubeconfig_text
from devcluster.realconf import Layout


def write_files(lay: Layout, kubeconfig: Path) -> tuple[int, list[str]]:
    """Every file under the cluster's workdir, `kubeconfig` the admin's on the host's loopback (at a
    free port, for the forwarder into the fabric). Returns that port and the host folders made as mount
    points, a child before its parent (removed with rmdir at stop)."""
    for d in (lay.etc, lay.logs, lay.plane_dir / "certs", lay.dns_dir):
        d.mkdir(parents=True, exist_ok=True)
    etc = lay.etc
    subprocess.run(["openssl", "genrsa", "-out", str(etc / "sa.key"), "2048"], check=True, capture_output=True)
    subprocess.run(
        ["openssl", "rsa", "-in", str(etc / "sa.key"), "-pubout", "-out", str(etc / "sa.pub")],
        check=True,
        capture_output=True,
    )
    tokens = {name: secrets.token_hex(24) for name, _, _ in lay.identities()}
    _private(etc / "tokens.csv", realconf.tokens_csv(tokens, lay))
    api_port = free_port()
    for name, user, _ in lay.identities():
        _private(etc / f"{name}.kubeconfig", kubeconfig_text(lay.api_server, user, tokens[name]))
    _private(kubeconfig, kubeconfig_text(f"https://127.0.0.1:{api_port}", "admin", tokens["admin"]))
    _private(lay.incluster_kubeconfig, kubeconfig_text(lay.api_server, "admin", tokens["admin"]))
    # The node's resolver, for dnsPolicy Default pods: a query to their own loopback fails at
    # once instead of waiting for a server that is not there.
    (etc / "audit-policy.yaml").write_text(realconf.AUDIT_POLICY)
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    made = [p for p in (Path("/var/lib/cni"), *realhost.DEVICE_PLUGINS_PATHS) if realhost.ensure_mountpoint(p)]
    created = [str(p) for p in reversed(made)]  # a child before its parent: removed with rmdir
    for i in range(lay.nodes):
        d = lay.node_dir(i)
        realhost.prepare_node_dir(d)
        (d / "cni" / "10-devcluster.conflist").write_text(realconf.cni_conflist(lay, i))
        (d / "containerd.toml").write_text(realconf.containerd_toml(lay, i))
    return api_port, created


def _private(path: Path, text: str) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.write_text(text)
