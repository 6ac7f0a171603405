"""The validating admission webhook: the rules alone, the CLI's flags, and the real API server calling
`sgdjob operator --webhook-port` over TLS with a certificate made here by openssl."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from click.testing import CliRunner

from devcluster.controlplane import ControlPlane, free_port
from sgdjob_operator.cli import main
from sgdjob_operator.k8s.settings import OperatorSettings
from sgdjob_operator.k8s.webhook import PATH, check, review


def _job(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "sgdjob.dev/v1alpha1",
        "kind": "SGDJob",
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "minReplicas": 1,
            "maxReplicas": 3,
            "training": {"steps": 10},
            "runPolicy": {"suspend": True},
            **spec,
        },
    }


def test_review_names_the_field_and_lets_unchanged_specs_pass() -> None:
    bad = _job("x", minReplicas=3)["spec"]
    with pytest.raises(kopf.AdmissionError, match=r"spec\.minReplicas") as err:
        review(bad, None)
    assert err.value.code == 422
    review(_job("x")["spec"], None)
    review(bad, dict(bad))  # metadata-only update of a job stored before the webhook existed
    with pytest.raises(kopf.AdmissionError):
        review(bad, _job("x")["spec"])


def test_review_refuses_a_new_job_whose_name_cannot_name_its_service_but_not_an_update() -> None:
    spec = _job("x")["spec"]
    with pytest.raises(kopf.AdmissionError, match=r"metadata\.name: 'team\.a' cannot name the job's Service"):
        review(spec, None, name="team.a")
    review(spec, None, name="team-a")
    review({**spec, "replicas": 3}, spec, name="team.a")  # a job stored before the rule can still be changed


def test_review_warns_that_auto_cannot_adapt_a_command_but_stores_it() -> None:
    spec = _job("x", mode="auto", training={"command": ["python", "train.py"]})["spec"]
    (warning,) = review(spec, None, name="x")
    assert warning.startswith("spec.mode: auto cannot adapt spec.training.command"), warning
    assert review({**spec, "mode": "sync"}, None, name="x") == []


def test_webhook_flags_are_checked() -> None:
    assert check(OperatorSettings()) is None
    assert "needs --webhook-cert" in str(check(OperatorSettings(webhook_port=9443)))
    assert "need --webhook-port" in str(check(OperatorSettings(webhook_cert="c")))
    assert check(OperatorSettings(webhook_port=9443, webhook_cert="c", webhook_key="k")) is None
    result = CliRunner().invoke(main, ["operator", "--webhook-port", "9443"])
    assert result.exit_code != 0 and "--webhook-cert" in result.output
    assert "--webhook-port" in CliRunner().invoke(main, ["operator", "--help"]).output


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(folder: Path, ip: str = "127.0.0.1", dns: str = "") -> tuple[Path, Path, Path]:
    """A CA and a serving certificate for `ip` (or the DNS name `dns`) signed by it: (ca.crt, tls.crt, tls.key)."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=sgdjob-test-ca",
        cwd=folder,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "tls.key",
        "-out",
        "tls.csr",
        "-subj",
        f"/CN={dns or ip}",
        cwd=folder,
    )
    san = f"DNS:{dns}" if dns else f"IP:{ip}"
    (folder / "san.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "tls.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "tls.crt",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        cwd=folder,
    )
    return folder / "ca.crt", folder / "tls.crt", folder / "tls.key"


@dataclass(frozen=True)
class WebhookRun:
    port: int
    ca: Path
    log: Callable[[], str]

    def admits(self, spec: dict[str, Any]) -> bool | None:
        """The webhook's answer to a CREATE of `spec` (allowed?), or None when it did not answer."""
        review_ = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {"uid": "u", "name": "x", "object": {"metadata": {"name": "x"}, "spec": spec}},
        }
        request = urllib.request.Request(
            f"https://127.0.0.1:{self.port}{PATH}",
            data=json.dumps(review_).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            ctx = ssl.create_default_context(cafile=str(self.ca))
            with urllib.request.urlopen(request, timeout=2, context=ctx) as answer:
                return bool(json.load(answer)["response"]["allowed"])
        except OSError:
            return None


def _serving(port: int, ca: Path) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=1) as sock,
            ctx.wrap_socket(sock, server_hostname="127.0.0.1"),
        ):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def operator_with_webhook(k8s_crd: ControlPlane, tmp_path: Path, ns: str, *flags: str) -> Iterator[WebhookRun]:
    """`sgdjob operator` (with `flags`) watching `ns` and serving its webhook on a free port over TLS;
    yields once the port completes a TLS handshake."""
    ca, cert, key = make_certs(tmp_path)
    port = free_port()
    argv = [str(Path(sys.executable).parent / "sgdjob"), "operator", "--kubeconfig", str(k8s_crd.kubeconfig), "-n", ns]
    argv += ["--webhook-port", str(port), "--webhook-addr", "127.0.0.1", "--webhook-cert", str(cert)]
    argv += ["--webhook-key", str(key), *flags]
    log = tmp_path / "operator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while not _serving(port, ca):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "webhook not serving after 90 s:\n" + log.read_text()[-3000:]
            time.sleep(0.3)
        yield WebhookRun(port, ca, log.read_text)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def webhook_operator(k8s_crd: ControlPlane, tmp_path: Path) -> Iterator[tuple[str, Callable[[], str]]]:
    """The operator with its webhook on a free port, watching one fresh namespace, and a
    ValidatingWebhookConfiguration (limited to that namespace) pointing at it by URL."""
    ns, name = f"wh-{uuid.uuid4().hex[:6]}", f"sgdjob-test-{uuid.uuid4().hex[:6]}"
    k8s_crd.kubectl("create", "namespace", ns)
    k8s_crd.kubectl("label", "namespace", ns, f"sgdjob-webhook-test={name}")
    try:
        with operator_with_webhook(k8s_crd, tmp_path, ns) as run:
            config = {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": name},
                "webhooks": [
                    {
                        "name": "validate.sgdjob.dev",
                        "admissionReviewVersions": ["v1"],
                        "sideEffects": "None",
                        "failurePolicy": "Fail",
                        "timeoutSeconds": 10,
                        "namespaceSelector": {"matchLabels": {"sgdjob-webhook-test": name}},
                        "clientConfig": {
                            "url": f"https://127.0.0.1:{run.port}{PATH}",
                            "caBundle": base64.b64encode(run.ca.read_bytes()).decode(),
                        },
                        "rules": [
                            {
                                "apiGroups": ["sgdjob.dev"],
                                "apiVersions": ["v1alpha1"],
                                "operations": ["CREATE", "UPDATE"],
                                "resources": ["sgdjobs"],
                            }
                        ],
                    }
                ],
            }
            k8s_crd.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(config))
            yield ns, run.log
    finally:
        k8s_crd.kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found", check=False)
        k8s_crd.kubectl("-n", ns, "delete", "sgdjobs", "--all", "--wait=false", check=False)


def test_api_server_rejects_a_cross_field_invalid_job_through_the_webhook(
    k8s_crd: ControlPlane, webhook_operator: tuple[str, Any]
) -> None:
    ns, _ = webhook_operator

    def apply(doc: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return k8s_crd.kubectl("-n", ns, "apply", "-f", "-", check=False, input_text=yaml.safe_dump(doc))

    # The CRD's schema accepts it (each field alone is fine); only the cross-field rule refuses it.
    bad = apply(_job("too-few", replicas=2, minReplicas=3))
    assert bad.returncode != 0, bad.stdout
    assert "validate.sgdjob.dev" in bad.stderr and "spec.minReplicas" in bad.stderr, bad.stderr
    assert k8s_crd.kubectl("-n", ns, "get", "sgdjob", "too-few", check=False).returncode != 0

    good = apply(_job("fine"))
    assert good.returncode == 0, good.stderr
    # A valid job the policy cannot adapt is stored, with the webhook's warning printed by kubectl.
    warned = apply(_job("script", mode="auto", training={"command": ["python", "train.py"]}))
    assert warned.returncode == 0 and "Warning: spec.mode: auto cannot adapt" in warned.stderr, warned.stderr
    assert k8s_crd.kubectl("-n", ns, "get", "sgdjob", "fine", "-o", "name").stdout.strip() == "sgdjob.sgdjob.dev/fine"

    # An update that breaks the rule is refused as well; the stored spec stays.
    worse = k8s_crd.kubectl(
        "-n", ns, "patch", "sgdjob", "fine", "--type=merge", "-p", '{"spec":{"maxReplicas":1}}', check=False
    )
    assert worse.returncode != 0 and ("spec.maxReplicas" in worse.stderr or "spec.replicas" in worse.stderr), (
        worse.stderr
    )
    assert k8s_crd.kubectl("-n", ns, "get", "sgdjob", "fine", "-o", "jsonpath={.spec.maxReplicas}").stdout == "3"


def test_the_webhook_answers_without_a_gap_while_a_standby_takes_the_lease_and_starts_kopf(
    k8s_crd: ControlPlane, tmp_path: Path
) -> None:
    """Every replica's webhook is behind one Service, so a replica that is taking over must not refuse
    connections: the port opens at the process' start and stays open through taking the Lease and
    kopf's start. Here a Lease held by a leader that stopped renewing keeps the operator a standby for
    a few seconds; the webhook is called every 50 ms from then until kopf has run a while."""
    ns = f"whl-{uuid.uuid4().hex[:6]}"
    k8s_crd.kubectl("create", "namespace", ns)
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "sgdjob-operator", "namespace": ns},
        "spec": {"holderIdentity": "gone-leader", "leaseDurationSeconds": 4, "acquireTime": now, "renewTime": now},
    }
    k8s_crd.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(lease))
    flags = ["--leader-elect", "--lease-namespace", ns, "--lease-duration", "4", "--renew-deadline", "3"]
    bad = _job("x", minReplicas=3)["spec"]
    try:
        with operator_with_webhook(k8s_crd, tmp_path, ns, *flags, "--retry-period", "0.5") as run:
            answers: list[tuple[str, bool | None]] = []  # (role when asked, the answer)
            led_at: float | None = None
            deadline = time.monotonic() + 90
            while led_at is None or time.monotonic() < led_at + 6:
                assert time.monotonic() < deadline, "never took the lease:\n" + run.log()[-3000:]
                role = "leader" if "holds lease" in run.log() else "standby"
                if role == "leader" and led_at is None:
                    led_at = time.monotonic()
                answers.append((role, run.admits(bad)))
                time.sleep(0.05)
            assert "Activity" in run.log() or "kopf" in run.log(), run.log()[-3000:]  # kopf ran meanwhile
    finally:
        k8s_crd.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    roles = {role for role, _ in answers}
    unanswered = [n for n, (_, allowed) in enumerate(answers) if allowed is not False]
    assert roles == {"standby", "leader"}, answers
    assert not unanswered, f"{len(unanswered)} of {len(answers)} calls not refused as they should be: {unanswered[:10]}"
