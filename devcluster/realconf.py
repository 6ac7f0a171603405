"""Pure configuration of the real-node cluster (devcluster/realnodes.py): addresses, names, files, argv.

Nothing here touches the machine, so the rules can be read (and unit-tested) in one place.

Network layout, all of it inside network namespaces this tool creates (the host gets nothing):

    netns <p>-fabric   bridge fab0 10.250.0.1/24: etcd, the API server, controller-manager, scheduler,
                       cluster DNS (dnsmasq on 10.250.0.1:53, fed by devcluster/clusterdns.py)
       |  veth vn<i> (fabric side, on fab0) <-> eth0 (node side)
    netns <p>-node-<i> eth0 10.250.0.<10+i>/24, bridge cni0 10.244.<i>.1/24 (pods, CNI bridge plugin),
                       containerd, kubelet, kube-proxy; routes: 10.244.<j>.0/24 via node j, default via
                       the fabric (which has no uplink: anything else is unreachable at once)

Services are 10.96.0.0/16 (kube-proxy iptables rules in each node namespace). The fabric routes the
pod CIDRs to their nodes, so the API server reaches pods (webhooks) and kubelets (logs, exec), and
pods reach the cluster DNS on 10.250.0.1 (their default route leads to the fabric through their node).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

FABRIC_IP = "10.250.0.1"
FABRIC_BRIDGE = "fab0"
CLUSTER_CIDR = "10.244.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
API_PORT = 6443
DNS_IP = FABRIC_IP  # the kubelets' --cluster-dns: every pod's nameserver
CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "k8s.gcr.io/pause:3.2"
CNI_BIN = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
MAX_NODES = 200  # node i is 10.250.0.<10+i> and 10.244.<i>.0/24


@dataclass(frozen=True)
class Layout:
    """Names, addresses and paths of one real-node cluster rooted at `workdir`."""

    workdir: Path
    nodes: int = 3
    prefix: str = "sgdjob"

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be 1..{MAX_NODES}, not {self.nodes}")

    # --- names and addresses ---
    @property
    def fabric_ns(self) -> str:
        return f"{self.prefix}-fabric"

    def node_ns(self, i: int) -> str:
        return f"{self.prefix}-node-{i}"

    @staticmethod
    def node_name(i: int) -> str:
        return f"node-{i}"

    @staticmethod
    def node_ip(i: int) -> str:
        return f"10.250.0.{10 + i}"

    @staticmethod
    def pod_cidr(i: int) -> str:
        return f"10.244.{i}.0/24"

    @staticmethod
    def pod_gateway(i: int) -> str:
        return f"10.244.{i}.1"

    @staticmethod
    def veth(i: int) -> str:
        return f"vn{i}"

    @property
    def cgroup_root(self) -> str:
        """Parent of every node's cgroup root (`<this>/node-<i>/kubepods/...`), in each v1 hierarchy."""
        return f"/{self.prefix}-devcluster"

    def node_cgroup(self, i: int) -> str:
        return f"{self.cgroup_root}/{self.node_name(i)}"

    @property
    def api_server(self) -> str:
        """The API server as kubelets, kube-proxies and pods reach it (inside the namespaces)."""
        return f"https://{FABRIC_IP}:{API_PORT}"

    # --- files ---
    @property
    def etc(self) -> Path:
        return self.workdir / "etc"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (AUDIT_POLICY): one JSON event per line."""
        return self.logs / "audit.log"

    @property
    def plane_dir(self) -> Path:
        return self.workdir / "plane"

    @property
    def incluster_kubeconfig(self) -> Path:
        """The admin kubeconfig for use inside the cluster's namespaces (https://10.250.0.1:6443)."""
        return self.etc / "admin-fabric.kubeconfig"

    @property
    def dns_dir(self) -> Path:
        """The hosts file(s) dnsmasq serves (--hostsdir), written by the clusterdns feeder."""
        return self.workdir / "dns"

    def node_dir(self, i: int) -> Path:
        return self.workdir / "nodes" / self.node_name(i)

    def containerd_socket(self, i: int) -> Path:
        # On disk, not under /run: /run is private to each node's mount namespace, and `ctr` on the
        # host imports images through this socket. (Unix socket paths are limited to 107 bytes.)
        return self.node_dir(i) / "containerd.sock"

    def identities(self) -> list[tuple[str, str, str]]:
        """(kubeconfig name, user, groups) of every client of the API server."""
        out = [
            ("admin", "admin", "system:masters"),
            ("kcm", "system:kube-controller-manager", ""),
            ("scheduler", "system:kube-scheduler", ""),
            ("kube-proxy", "system:kube-proxy", ""),
        ]
        # The Node authorizer and NodeRestriction admit a kubelet by this exact name and group.
        out += [(self.node_name(i), f"system:node:{self.node_name(i)}", "system:nodes") for i in range(self.nodes)]
        return out


def tokens_csv(tokens: dict[str, str], layout: Layout) -> str:
    """kube-apiserver's --token-auth-file: token,user,uid[,"groups"]."""
    lines = []
    for name, user, groups in layout.identities():
        lines.append(f"{tokens[name]},{user},{name}" + (f',"{groups}"' if groups else ""))
    return "\n".join(lines) + "\n"


def cni_conflist(layout: Layout, i: int) -> str:
    """The bridge network of node i. No masquerade: pod IPs are routed between nodes as they are."""
    return json.dumps(
        {
            "cniVersion": "0.4.0",
            "name": f"{layout.prefix}-{layout.node_name(i)}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,  # a pod reaching itself through its own Service
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(layout.node_dir(i) / "cni-ipam"),
                        "ranges": [[{"subnet": layout.pod_cidr(i), "gateway": layout.pod_gateway(i)}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        },
        indent=1,
    )


def containerd_toml(layout: Layout, i: int) -> str:
    d = layout.node_dir(i)
    sock = layout.containerd_socket(i)
    return f"""version = 2
root = "{d / "containerd"}"
state = "{d / "containerd-state"}"
# Snapshotters this machine cannot use only log errors at every start.
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / "containerd-opt"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_selinux = false
  # This VM lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj, and the sandbox's -998 fails
  # every pod ("can't get final child's PID from pipe: EOF"). Clamp scores to containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false  # cgroupfs, as the kubelet: there is no systemd
        Root = "{d / "runc"}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{d / "cni"}"
    max_conf_num = 1
"""


def etcd_argv(bin_dir: Path, layout: Layout) -> list[str]:
    # Loopback of the fabric namespace: only the API server, beside it, talks to etcd.
    return [
        str(bin_dir / "etcd"),
        "--name", "devcluster",
        "--data-dir", str(layout.plane_dir / "etcd"),
        "--listen-client-urls", "http://127.0.0.1:2379",
        "--advertise-client-urls", "http://127.0.0.1:2379",
        "--listen-peer-urls", "http://127.0.0.1:2380",
        "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
        "--initial-cluster", "devcluster=http://127.0.0.1:2380",
        "--listen-metrics-urls", "http://127.0.0.1:2381",
        "--unsafe-no-fsync",  # a throwaway cluster: disk syncs only cost time on a shared machine
        "--log-level", "warn",
    ]  # fmt: skip


# What the API server writes to its audit log: every request a service account outside kube-system
# makes (the operator's, a workload's), once, when it is answered (verb, object, user, status code).
# The controllers' own accounts (kube-system) and the kubelets, scheduler and admin are left out. The
# real-node Helm tier derives the operator's permissions from it and holds them against the chart's
# RBAC (e2e/test_helm_operator.py); a `devcluster up` user reads it the same way.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    userGroups: ["system:serviceaccounts:kube-system"]
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""


def apiserver_argv(bin_dir: Path, layout: Layout) -> list[str]:
    etc, plane = layout.etc, layout.plane_dir
    return [
        str(bin_dir / "kube-apiserver"),
        "--etcd-servers=http://127.0.0.1:2379",
        "--bind-address=0.0.0.0",  # 0.0.0.0 of the fabric namespace: its loopback and fab0
        f"--secure-port={API_PORT}",
        f"--advertise-address={FABRIC_IP}",  # the `kubernetes` Service's endpoint, reached from pods
        f"--cert-dir={plane / 'certs'}",
        f"--token-auth-file={etc / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged",
        "--service-account-issuer=https://kubernetes.default.svc",
        f"--service-account-key-file={etc / 'sa.pub'}",
        f"--service-account-signing-key-file={etc / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--insecure-port=0",
        "--kubelet-preferred-address-types=InternalIP",
        "--endpoint-reconciler-type=lease",
        f"--audit-policy-file={etc / 'audit-policy.yaml'}",
        f"--audit-log-path={layout.audit_log}",
        "--audit-log-maxsize=2048",  # MB before a rotation: a whole CI session stays in one file
        "--v=1",
    ]


def controller_manager_argv(bin_dir: Path, layout: Layout) -> list[str]:
    return [
        str(bin_dir / "kube-controller-manager"),
        f"--kubeconfig={layout.etc / 'kcm.kubeconfig'}",
        f"--service-account-private-key-file={layout.etc / 'sa.key'}",
        f"--root-ca-file={layout.plane_dir / 'certs' / 'apiserver.crt'}",
        "--use-service-account-credentials",
        # Each kubelet gets its pod CIDR by flag (and the CNI config): no node IPAM controller.
        "--controllers=*,-nodeipam",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--secure-port=0",
        "--port=0",
        "--v=1",
    ]


def scheduler_argv(bin_dir: Path, layout: Layout) -> list[str]:
    return [
        str(bin_dir / "kube-scheduler"),
        f"--kubeconfig={layout.etc / 'scheduler.kubeconfig'}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--secure-port=0",
        "--port=0",
        "--v=1",
    ]


def kubelet_argv(bin_dir: Path, layout: Layout, i: int, extra: Sequence[str] = ()) -> list[str]:
    """`extra`: flags of this node only (its CPU limit as allocatable: devcluster/realcpus.py)."""
    d, sock = layout.node_dir(i), layout.containerd_socket(i)
    return [
        str(bin_dir / "kubelet"),
        f"--kubeconfig={layout.etc / (layout.node_name(i) + '.kubeconfig')}",
        f"--root-dir={d / 'kubelet'}",
        f"--cert-dir={d / 'kubelet' / 'pki'}",
        f"--volume-plugin-dir={d / 'volume-plugins'}",  # the default is a host path under /usr/libexec
        "--container-runtime=remote",
        f"--container-runtime-endpoint=unix://{sock}",
        f"--image-service-endpoint=unix://{sock}",
        "--runtime-request-timeout=5m",
        "--cgroup-driver=cgroupfs",  # no systemd on this machine
        f"--cgroup-root={layout.node_cgroup(i)}",  # each node's pods in a tree of their own
        "--fail-swap-on=false",
        f"--hostname-override={layout.node_name(i)}",
        f"--node-ip={layout.node_ip(i)}",
        f"--pod-cidr={layout.pod_cidr(i)}",
        f"--cluster-dns={DNS_IP}",
        f"--cluster-domain={CLUSTER_DOMAIN}",
        # Only for dnsPolicy Default (and hostNetwork) pods, which get the node's resolver: as on most
        # clusters it knows no cluster names, and (no uplink) it fails every lookup at once.
        f"--resolv-conf={layout.etc / 'resolv.conf'}",
        f"--pod-infra-container-image={PAUSE_IMAGE}",
        "--read-only-port=0",
        # The API server calls kubelets without a client certificate (logs, exec); the kubelet port
        # is reachable only inside the cluster's namespaces.
        "--anonymous-auth=true",
        "--authorization-mode=AlwaysAllow",
        f"--address={layout.node_ip(i)}",
        "--healthz-bind-address=127.0.0.1",
        # Images are imported, never pulled: they must never be collected. The eviction flag
        # replaces the disk-based defaults, so a full host disk does not evict pods.
        "--image-gc-high-threshold=100",
        "--eviction-hard=memory.available<100Mi",
        "--max-pods=50",
        *extra,
        "--v=1",
    ]


def dnsmasq_argv(layout: Layout) -> list[str]:
    """The cluster DNS: names under cluster.local from the feeder's hosts files, nothing else."""
    return [
        "dnsmasq",
        "--keep-in-foreground",
        "--conf-file=/dev/null",  # never the host's /etc/dnsmasq.conf
        "--no-resolv",  # no upstream (there is no uplink): other names are REFUSED at once
        "--no-hosts",
        "--bind-interfaces",
        f"--listen-address={DNS_IP}",
        f"--local=/{CLUSTER_DOMAIN}/",  # unknown cluster names are NXDOMAIN, never forwarded
        # Re-read through inotify when the feeder renames a new file in; removed records go too.
        f"--hostsdir={layout.dns_dir}",
        "--user=root",  # the workdir may be private to root (pytest's tmp folders are 0700)
        "--pid-file=",  # none: RealCluster keeps the pid
        "--log-facility=-",  # stderr, i.e. the cluster's logs/dnsmasq.log
    ]


def clusterdns_argv(python: str, layout: Layout) -> list[str]:
    """The feeder, as a script (standard library only): the daemons' cwd is not the checkout."""
    return [
        python,
        str(Path(__file__).with_name("clusterdns.py")),
        f"--kubeconfig={layout.incluster_kubeconfig}",
        f"--out={layout.dns_dir}",
        f"--domain={CLUSTER_DOMAIN}",
    ]


def kube_proxy_argv(bin_dir: Path, layout: Layout, i: int) -> list[str]:
    return [
        str(bin_dir / "kube-proxy"),
        f"--kubeconfig={layout.etc / 'kube-proxy.kubeconfig'}",
        f"--hostname-override={layout.node_name(i)}",
        "--proxy-mode=iptables",
        f"--cluster-cidr={CLUSTER_CIDR}",
        f"--bind-address={layout.node_ip(i)}",
        # Zeros: leave the conntrack sysctls alone (some are machine-wide, not per namespace).
        "--conntrack-max-per-core=0",
        "--conntrack-min=0",
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0",
        "--metrics-bind-address=127.0.0.1:10249",
        "--healthz-bind-address=127.0.0.1:10256",
        "--v=1",
    ]
