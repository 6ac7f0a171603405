"""A real Kubernetes control plane on loopback, from the binaries in KUBEBUILDER_ASSETS.

etcd and kube-apiserver always; kube-controller-manager (garbage collection, ReplicaSets) and
kube-scheduler on request. Every process runs in its own session so `stop()` can kill the whole
tree, and ports are picked free so several planes (parallel test runs) can coexist.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from devcluster.proctree import TAG_KEY

REQUIRED = ("etcd", "kube-apiserver", "kubectl")


class AssetsMissing(RuntimeError):
    """The control-plane binaries are not where KUBEBUILDER_ASSETS says."""


def assets_dir() -> Path:
    """The folder of control-plane binaries, or AssetsMissing with how to get them."""
    value = os.environ.get("KUBEBUILDER_ASSETS", "") or _shared_assets()
    if not value:
        raise AssetsMissing(
            'KUBEBUILDER_ASSETS is not set: run `export KUBEBUILDER_ASSETS="$(../shared/k8s/install.sh)"`'
        )
    path = Path(value)
    missing = [name for name in REQUIRED if not (path / name).is_file()]
    if missing:
        raise AssetsMissing(f"KUBEBUILDER_ASSETS={path} lacks {', '.join(missing)}")
    return path


def _shared_assets() -> str:
    """What ../shared/k8s/install.sh (beside the checkout) prints, so a person's `python -m devcluster`
    works without exporting KUBEBUILDER_ASSETS first; empty when there is no such script."""
    script = Path(__file__).resolve().parents[2] / "shared" / "k8s" / "install.sh"
    if not script.is_file():
        return ""
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600, check=False)
    return result.stdout.strip().splitlines()[-1] if result.returncode == 0 and result.stdout.strip() else ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kubeconfig_text(server: str, user: str, token: str) -> str:
    """A kubeconfig (JSON, which is YAML) for a bearer token. insecure-skip-tls-verify: the API
    server's certificate is self-signed and everything here is local to this machine."""
    cluster = {"server": server, "insecure-skip-tls-verify": True}
    context = {"cluster": "devcluster", "user": user, "namespace": "default"}
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "devcluster", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "devcluster", "context": context}],
            "current-context": "devcluster",
        },
        indent=1,
    )


def run_kubectl(
    kubeconfig: Path, *args: str, check: bool = True, input_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The real kubectl from the assets folder; raises with its stderr when `check` and it fails."""
    result = subprocess.run(
        [str(assets_dir() / "kubectl"), "--kubeconfig", str(kubeconfig), *args],
        input=input_text,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


# Starts of a restarted kube-apiserver that exits at once before a restart gives up.
RESTART_TRIES = 5


@dataclass
class ControlPlane:
    """etcd + kube-apiserver (+ optional controller-manager and scheduler) under one temp dir."""

    with_controllers: bool = False
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sgdjob-k8s-")))
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    api_port: int = 0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argvs: dict[str, list[str]] = field(default_factory=dict)  # how each process was started: restart()
    # A test harness's owner tag (proctree.new_agent_tag): its processes carry it in their environment,
    # so a later run reaps them (proctree.reap_orphans) if this harness is SIGKILLed before its stop.
    # None for a plane meant to outlive its starter (`devcluster up`).
    owner_tag: str | None = None

    @property
    def bin(self) -> Path:
        return assets_dir()

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    def kubectl(
        self, *args: str, check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this plane."""
        return run_kubectl(self.kubeconfig, *args, check=check, input_text=input_text)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        self.argvs[name] = argv
        env = None if self.owner_tag is None else {**os.environ, TAG_KEY: f"{self.owner_tag}{name}/"}
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def restart_apiserver(self, down_s: float = 0.0, timeout: float = 60.0) -> None:
        """Stop kube-apiserver (SIGTERM, as a rolling control-plane upgrade does), keep it down for
        `down_s`, start it again on the same port, certificates and etcd, and wait until it serves.
        Clients see refused connections and broken watches meanwhile; nothing is lost (etcd stays)."""
        _terminate(self.procs["kube-apiserver"], 20)
        time.sleep(down_s)
        deadline = time.monotonic() + timeout
        for attempt in range(RESTART_TRIES):
            self._spawn("kube-apiserver", self.argvs["kube-apiserver"])
            try:
                self._wait_ready(max(1.0, deadline - time.monotonic()))
                return
            except RuntimeError:
                # It exited at once: its port can be held for a moment by another process on this
                # machine that picked it as a free ephemeral port while the server was down (a clean
                # CI's other half starts clusters meanwhile); the port is ours again once that goes.
                if self.procs["kube-apiserver"].poll() is None or attempt == RESTART_TRIES - 1:
                    raise
                time.sleep(1.0)

    def start(self, timeout: float = 60.0) -> ControlPlane:
        b = self.bin
        wd = self.workdir
        (wd / "certs").mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "genrsa", "-out", str(wd / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(wd / "sa.key"), "-pubout", "-out", str(wd / "sa.pub")],
            check=True,
            capture_output=True,
        )
        (wd / "tokens.csv").write_text(f"{self.token},admin,admin,system:masters\n")
        etcd_client, etcd_peer = free_port(), free_port()
        self.api_port = free_port()
        self._spawn(
            "etcd",
            [
                str(b / "etcd"),
                "--data-dir", str(wd / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
                "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
                "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",
            ],
        )  # fmt: skip
        self._spawn(
            "kube-apiserver",
            [
                str(b / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--cert-dir={wd / 'certs'}",
                f"--token-auth-file={wd / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--allow-privileged",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={wd / 'sa.pub'}",
                f"--service-account-signing-key-file={wd / 'sa.key'}",
                "--service-cluster-ip-range=127.96.0.0/16",
                "--insecure-port=0",
                "--advertise-address=127.0.0.1",
            ],
        )
        self._write_kubeconfig()
        try:
            self._wait_ready(timeout)
            if self.with_controllers:
                self._start_controllers()
        except BaseException:
            self.stop()
            raise
        return self

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(kubeconfig_text(self.server, "admin", self.token))

    def _wait_ready(self, timeout: float) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.workdir / (name + '.log')}")
            req = urllib.request.Request(f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.token}"})
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
                    # The default namespace and RBAC bootstrap can lag readyz by a moment.
                    if resp.status == 200 and self.kubectl("get", "namespace", "default", check=False).returncode == 0:
                        return
            except OSError as err:
                last = str(err)
            time.sleep(0.3)
        raise TimeoutError(f"kube-apiserver not ready after {timeout}s ({last}); logs in {self.workdir}")

    def _start_controllers(self) -> None:
        b, wd = self.bin, self.workdir
        self._spawn(
            "kube-controller-manager",
            [
                str(b / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                f"--service-account-private-key-file={wd / 'sa.key'}",
                f"--root-ca-file={wd / 'certs' / 'apiserver.crt'}",
                "--controllers=*,-nodeipam",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                "--port=0",
                "--use-service-account-credentials=false",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(b / "kube-scheduler"),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                "--port=0",
            ],
        )

    def stop(self) -> None:
        """Kill every process this plane started (whole sessions) and remove its files."""
        # One at a time, in reverse start order: an API server whose etcd is already gone hangs in
        # shutdown until the 10 s SIGKILL; with etcd still up it exits in a few seconds.
        for proc in reversed(list(self.procs.values())):
            _terminate(proc, 10)
        self.procs.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the process's session, SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
