"""Cluster DNS records for the real-node cluster: Services and Endpoints -> a hosts file for dnsmasq.

    python devcluster/clusterdns.py --kubeconfig KC --out DIR [--domain cluster.local] [--interval 0.5]

RealCluster runs dnsmasq on 10.250.0.1:53 (the kubelets' --cluster-dns) with `--hostsdir=DIR`, and this
feeder beside it in the fabric namespace. Every `interval` seconds the feeder lists Services and
Endpoints (resourceVersion=0: from the API server's cache) and, when the records changed, renames a new
`DIR/hosts` into place; dnsmasq notices through inotify and drops the records that went away.

The records follow CoreDNS's kubernetes plugin, so pods resolve names as on any cluster:
  * `<svc>.<ns>.svc.<domain>` -> the ClusterIP, or for a headless Service its ready endpoint addresses;
  * `<host>.<svc>.<ns>.svc.<domain>` -> an endpoint address, where <host> is the address's hostname
    (a pod with spec.hostname and spec.subdomain = the Service) or else its IP with dashes.
Only `subsets[].addresses` count: the endpoints controller already moves not-ready addresses in when
a Service has publishNotReadyAddresses. ExternalName Services get no record (a hosts file holds no
CNAME). Shorter names (`<svc>`, `<svc>.<ns>`, `<svc>.<ns>.svc`) come from the pods' search path.

Run as a script, it imports only the standard library: the daemons' cwd is not the checkout.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

Obj = dict[str, Any]
HOSTS_FILE = "hosts"


def records(services: Iterable[Obj], endpoints: Iterable[Obj], domain: str = "cluster.local") -> set[tuple[str, str]]:
    """(name, ip) pairs for every Service and its ready endpoint addresses."""
    by_service = {(e["metadata"]["namespace"], e["metadata"]["name"]): e for e in endpoints}
    out: set[tuple[str, str]] = set()
    for svc in services:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        spec = svc.get("spec") or {}
        if spec.get("type") == "ExternalName":
            continue
        fqdn = f"{name}.{ns}.svc.{domain}"
        cluster_ip = spec.get("clusterIP") or ""
        headless = cluster_ip == "None"
        if cluster_ip and not headless:
            out.add((fqdn, cluster_ip))
        for addr in _ready_addresses(by_service.get((ns, name))):
            ip = addr["ip"]
            if headless:
                out.add((fqdn, ip))
            # CoreDNS answers endpoint names for any Service, not only headless ones.
            host = addr.get("hostname") or ip.replace(".", "-").replace(":", "-")
            out.add((f"{host}.{fqdn}", ip))
    return out


def _ready_addresses(endpoints: Obj | None) -> list[Obj]:
    subsets = (endpoints or {}).get("subsets") or []
    return [a for s in subsets for a in s.get("addresses") or [] if a.get("ip")]


def hosts_text(services: Iterable[Obj], endpoints: Iterable[Obj], domain: str = "cluster.local") -> str:
    """The hosts file for dnsmasq: one `ip name` line per record, sorted, so equal input gives equal text."""
    lines = [f"{ip} {name}" for name, ip in sorted(records(services, endpoints, domain))]
    return "".join(line + "\n" for line in ["# cluster DNS records (devcluster/clusterdns.py)", *lines])


def write_if_changed(directory: Path, text: str) -> bool:
    """Replace DIR/hosts atomically when its text differs; True when written."""
    path = directory / HOSTS_FILE
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    # A dotfile: dnsmasq skips those in its hostsdir, so it never reads the half-written file.
    tmp = directory / f".{HOSTS_FILE}.tmp"
    tmp.write_text(text)
    tmp.replace(path)
    return True


class Lister:
    """GETs over one kept-alive HTTPS connection with the kubeconfig's bearer token (JSON kubeconfig,
    as devcluster.controlplane.kubeconfig_text writes it; the server's certificate is not checked)."""

    def __init__(self, kubeconfig: Path, timeout: float = 5.0) -> None:
        config = json.loads(kubeconfig.read_text())
        url = urlparse(config["clusters"][0]["cluster"]["server"])
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.headers = {"Authorization": f"Bearer {config['users'][0]['user']['token']}", "Accept": "application/json"}
        self.timeout = timeout
        self.context = ssl.create_default_context()
        self.context.check_hostname = False
        self.context.verify_mode = ssl.CERT_NONE
        self.conn: http.client.HTTPSConnection | None = None

    def items(self, path: str) -> list[Obj]:
        if self.conn is None:
            self.conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.context)
        try:
            self.conn.request("GET", f"{path}?resourceVersion=0", headers=self.headers)
            resp = self.conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = None
            raise
        if resp.status != 200:
            raise OSError(f"GET {path}: HTTP {resp.status}: {body[:200]!r}")
        items: list[Obj] = json.loads(body)["items"]
        return items


def run(lister: Lister, out: Path, domain: str, interval: float) -> None:
    last_error = ""
    while True:
        try:
            text = hosts_text(lister.items("/api/v1/services"), lister.items("/api/v1/endpoints"), domain)
            if write_if_changed(out, text):
                print(f"{time.strftime('%H:%M:%S')} wrote {text.count(chr(10)) - 1} records", flush=True)
            last_error = ""
        except (OSError, ValueError, KeyError, http.client.HTTPException) as err:
            if repr(err) != last_error:  # once per kind of failure: the API server may be restarting
                last_error = repr(err)
                print(f"{time.strftime('%H:%M:%S')} listing failed: {last_error}", file=sys.stderr, flush=True)
        time.sleep(interval)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python devcluster/clusterdns.py", description=__doc__)
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path, help="dnsmasq's --hostsdir")
    parser.add_argument("--domain", default="cluster.local")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between two listings")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run(Lister(args.kubeconfig), args.out, args.domain, args.interval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
