"""The cluster DNS feeder's pure part (devcluster/clusterdns.py): Services + Endpoints -> hosts-file records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from devcluster import clusterdns, realconf
from devcluster.realconf import Layout


def _svc(ns: str, name: str, cluster_ip: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": name}, "spec": {"clusterIP": cluster_ip, **spec}}


Addrs = list[dict[str, str]]


def _eps(ns: str, name: str, ready: Addrs, not_ready: Addrs | None = None) -> dict[str, Any]:
    subset: dict[str, Any] = {"addresses": ready, "ports": [{"port": 29400}]}
    if not_ready:
        subset["notReadyAddresses"] = not_ready
    return {"metadata": {"namespace": ns, "name": name}, "subsets": [subset]}


SERVICES = [
    _svc("default", "kubernetes", "10.96.0.1"),
    _svc("myns", "web", "10.96.4.7"),
    _svc("myns", "quick", "None", publishNotReadyAddresses=True),
    _svc("myns", "ext", "", type="ExternalName", externalName="example.com"),
]
ENDPOINTS = [
    _eps("default", "kubernetes", [{"ip": "10.250.0.1"}]),
    _eps("myns", "web", [{"ip": "10.244.1.5"}], not_ready=[{"ip": "10.244.2.9"}]),
    _eps(
        "myns",
        "quick",
        [{"ip": "10.244.0.3", "hostname": "quick-rdzv"}, {"ip": "10.244.2.4", "hostname": "quick-worker-0"}],
        not_ready=[{"ip": "10.244.1.8", "hostname": "quick-worker-1"}],
    ),
]


def _names(recs: set[tuple[str, str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, ip in recs:
        out.setdefault(name, set()).add(ip)
    return out


def test_cluster_ip_services_resolve_to_their_cluster_ip() -> None:
    names = _names(clusterdns.records(SERVICES, ENDPOINTS))
    assert names["kubernetes.default.svc.cluster.local"] == {"10.96.0.1"}
    assert names["web.myns.svc.cluster.local"] == {"10.96.4.7"}  # not the pod behind it
    assert names["10-244-1-5.web.myns.svc.cluster.local"] == {"10.244.1.5"}  # CoreDNS's endpoint name


def test_headless_services_resolve_to_ready_addresses_and_hostnames() -> None:
    names = _names(clusterdns.records(SERVICES, ENDPOINTS))
    assert names["quick.myns.svc.cluster.local"] == {"10.244.0.3", "10.244.2.4"}
    assert names["quick-rdzv.quick.myns.svc.cluster.local"] == {"10.244.0.3"}
    assert names["quick-worker-0.quick.myns.svc.cluster.local"] == {"10.244.2.4"}


def test_not_ready_addresses_and_external_names_get_no_record() -> None:
    recs = clusterdns.records(SERVICES, ENDPOINTS)
    assert not [r for r in recs if r[1] in ("10.244.2.9", "10.244.1.8")]
    assert not [r for r in recs if "worker-1" in r[0] or r[0].startswith("ext.")]
    # A Service whose Endpoints do not exist yet, and Endpoints without subsets (no ready pod).
    assert clusterdns.records([_svc("a", "b", "None")], [{"metadata": {"namespace": "a", "name": "b"}}]) == set()
    assert clusterdns.records([_svc("a", "b", "10.96.0.9")], []) == {("b.a.svc.cluster.local", "10.96.0.9")}


def test_hosts_text_is_sorted_and_deterministic() -> None:
    text = clusterdns.hosts_text(SERVICES, ENDPOINTS)
    assert text == clusterdns.hosts_text(list(reversed(SERVICES)), list(reversed(ENDPOINTS)))
    lines = text.splitlines()
    assert lines[0].startswith("#") and "10.96.0.1 kubernetes.default.svc.cluster.local" in lines
    assert [line.split()[1] for line in lines[1:]] == sorted(line.split()[1] for line in lines[1:])
    assert "svc.example.test" in clusterdns.hosts_text(SERVICES, ENDPOINTS, domain="example.test")


def test_hosts_file_is_replaced_only_when_it_changes(tmp_path: Path) -> None:
    assert clusterdns.write_if_changed(tmp_path, "a\n")
    mtime = (tmp_path / "hosts").stat().st_mtime_ns
    assert not clusterdns.write_if_changed(tmp_path, "a\n") and (tmp_path / "hosts").stat().st_mtime_ns == mtime
    assert clusterdns.write_if_changed(tmp_path, "b\n") and (tmp_path / "hosts").read_text() == "b\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts"]


def test_kubelets_point_pods_at_the_cluster_dns(tmp_path: Path) -> None:
    lay = Layout(tmp_path, nodes=2)
    kubelet = realconf.kubelet_argv(Path("/b"), lay, 1)
    assert "--cluster-dns=10.250.0.1" in kubelet and "--cluster-domain=cluster.local" in kubelet
    dnsmasq = realconf.dnsmasq_argv(lay)
    assert "--listen-address=10.250.0.1" in dnsmasq and f"--hostsdir={lay.dns_dir}" in dnsmasq
    assert "--conf-file=/dev/null" in dnsmasq and "--no-resolv" in dnsmasq
    feeder = realconf.clusterdns_argv("python3", lay)
    assert Path(feeder[1]).is_file() and f"--out={lay.dns_dir}" in feeder
