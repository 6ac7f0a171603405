"""Pure builders for every object an SGDJob owns: headless Service, rendezvous pod, worker pods,
control-token Secret and run-config ConfigMap. No I/O; the kopf shell creates what these return.

Rendezvous: a small dedicated pod (`<job>-rdzv`) hosts the c10d TCPStore that torchrun's agents
rendezvous through (`python -m sgdjob_trainer.rendezvous_store`, with `is_host=0` on every worker). With the
store on worker 0, as plain torchrun does, losing worker 0 would take the rendezvous with it; on its own
pod, any single worker may go and the others re-rendezvous. The pod is recreated if it is lost.

Names are deterministic (`<job>-worker-<i>`), so a create that races an earlier one is a 409, never
a duplicate pod, whichever operator process or restart issued it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sgdjob_operator.api.models import API_VERSION, KIND, SGDJobSpec
from sgdjob_operator.k8s import gang
from sgdjob_trainer.config import SyncMode
from sgdjob_trainer.wire.launch_contract import (
    AGENT_MODULE,
    ENV_AGENT_ID,
    ENV_CONTROL_TOKEN_FILE,
    ENV_METRICS_HOST,
    ENV_NODE_NAME,
    ENV_RUN_CONFIG,
    ENV_TERMINATION_LOG,
    ENV_UNSHARED_RDZV_STORE,
    STORE_HEALTH_PATH,
    STORE_MODULE,
    TorchrunOptions,
    restart_budget,
    run_config,
    trainer_args,
)

LABEL_JOB = "sgdjob.dev/job-name"
LABEL_ROLE = "sgdjob.dev/role"
LABEL_INDEX = "sgdjob.dev/replica-index"
# The nodes a worker pod was created to stay off: once one of those exclusions expires, a pod that
# could not be scheduled is recreated without it.
ANNOTATION_EXCLUDED = "sgdjob.dev/excluded-nodes"
ROLE_WORKER = "worker"
ROLE_RDZV = "rendezvous"
CONTAINER = "trainer"
RDZV_PORT = 29400
RDZV_HEALTH_PORT = RDZV_PORT + 1  # the store's GET /healthz (rendezvous_store.py --health-port)
STORE_HEALTH_PORT_NAME = "store-health"
TOKEN_GROUP = 10001  # the trainer image's group (Dockerfile: useradd --uid 10001)
CONFIG_DIR = "/etc/sgdjob/config"
CONFIG_FILE = "run-config.json"
TOKEN_DIR = "/etc/sgdjob/control"
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
TOKEN_KEY = "token"
POLICY_STATE_KEY = "policy-state.json"
DEFAULT_IMAGE = "ghcr.io/sgdjob/trainer:0.1.0"


@dataclass(frozen=True, slots=True)
class JobRef:
    """The identity of one SGDJob: enough to name, label and own its objects."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> JobRef:
        meta = body["metadata"]
        return cls(
            name=str(meta["name"]), namespace=str(meta.get("namespace") or "default"), uid=str(meta.get("uid", ""))
        )

    @property
    def service(self) -> str:
        return self.name

    @property
    def secret(self) -> str:
        return f"{self.name}-control"

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"

    @property
    def policy_state(self) -> str:
        return f"{self.name}-policy-state"

    @property
    def rdzv_pod(self) -> str:
        return f"{self.name}-rdzv"

    @property
    def pod_group(self) -> str:
        return self.name

    @property
    def workload(self) -> str:
        return f"sgdjob-{self.name}"[:253]

    def worker(self, index: int) -> str:
        return f"{self.name}-worker-{index}"

    @property
    def rdzv_endpoint(self) -> str:
        # hostname.subdomain.namespace.svc resolves through the headless Service, whatever the cluster domain.
        return f"{self.rdzv_pod}.{self.service}.{self.namespace}.svc:{RDZV_PORT}"

    @property
    def selector(self) -> str:
        return f"{LABEL_JOB}={self.name}"


def owner_reference(job: JobRef) -> dict[str, Any]:
    # controller=True lets `kubectl describe` and the garbage collector treat the SGDJob as the owner.
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(
    job: JobRef, name: str, role: str | None = None, extra_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    labels = {LABEL_JOB: job.name, "app.kubernetes.io/managed-by": "sgdjob-operator"}
    if role is not None:
        labels[LABEL_ROLE] = role
    labels.update(extra_labels or {})
    return {"name": name, "namespace": job.namespace, "labels": labels, "ownerReferences": [owner_reference(job)]}


def build_service(job: JobRef) -> dict[str, Any]:
    """Headless Service over all the job's pods, so `<pod>.<job>` resolves before pods are ready
    (torchrun needs the names during rendezvous, long before a readiness probe could pass)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, job.service),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job.name},
            "ports": [{"name": "rendezvous", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}],
        },
    }


def build_secret(job: JobRef, token: str) -> dict[str, Any]:
    """The job's /control bearer token; workers read it from a file, the operator from the Secret."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, job.secret),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def build_config_map(job: JobRef, spec: SGDJobSpec, mode: SyncMode) -> dict[str, Any]:
    """The RunConfig every trainer reads. `mode` is the mode a (re)started worker should begin in: the
    operator keeps it at the target mode so a restarted world does not fall back to the initial one."""
    config = run_config(job.name, mode, spec.training, min_nodes=spec.min_workers, nproc_per_node=spec.nproc_per_node)
    text = config.model_dump_json(by_alias=True, indent=2) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, job.config_map),
        "data": {CONFIG_FILE: text},
    }


def build_policy_state(job: JobRef, text: str) -> dict[str, Any]:
    """The policy core's state between evaluations (see `k8s.actuator`); no pod mounts it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, job.policy_state),
        "data": {POLICY_STATE_KEY: text},
    }


def config_map_mode(config_map: dict[str, Any]) -> str | None:
    try:
        return str(json.loads(config_map["data"][CONFIG_FILE])["mode"])
    except (KeyError, TypeError, ValueError):
        return None


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


# torch's c10d rendezvous waits last_call_timeout (30 s) for more nodes once min nodes are in, and
# counts a silent member gone after keep_alive_interval x keep_alive_max_attempt (5 s x 3). After a lost
# node the survivors pay both before they train again (e2e/test_chaos.py: 115 s back to training after a
# power cut with torch's values). A late pod still joins, at the price of one more restart of the world;
# 10 s of heartbeats leaves room for an agent starved of CPU for a few seconds.
# join_timeout: torch's 600 s would end an agent whose peers are away longer (two nodes lost under
# minReplicas, a gang not scheduled yet) with RendezvousTimeoutError, and torchrun then closes the
# rendezvous for good (launch_agent's shutdown), so every later pod of the job fails on a closed
# rendezvous. A day instead: the agent waits for its peers as a pod waits to be scheduled, the job
# shows the missing workers, and the operator brings them back.
K8S_JOIN_TIMEOUT_S = 24 * 3600
K8S_RDZV_CONF = {
    "join_timeout": K8S_JOIN_TIMEOUT_S,
    "last_call_timeout": 10,
    "keep_alive_interval": 2,
    "keep_alive_max_attempt": 5,
}


def torchrun_options(job: JobRef, spec: SGDJobSpec) -> TorchrunOptions:
    """The worker pods' torchrun options. Any pod may be lost, and the operator replaces and removes
    workers, so every agent's restart budget counts the members that may leave."""
    return TorchrunOptions(
        min_nodes=spec.min_workers,
        max_nodes=spec.max_workers,
        nproc_per_node=spec.nproc_per_node,
        rdzv_endpoint=job.rdzv_endpoint,
        rdzv_id=job.uid or job.name,
        max_restarts=restart_budget(spec.run_policy.backoff_limit, spec.max_workers, peers_may_leave=True),
        local_addr="$(POD_IP)",
        rdzv_conf=K8S_RDZV_CONF,
    )


def worker_env(job: JobRef, spec: SGDJobSpec, index: int) -> list[dict[str, Any]]:
    """torchrun's PET_* contract plus what the trainer reads. POD_IP comes first so later values
    can expand `$(POD_IP)`."""
    return [
        _field_env("POD_IP", "status.podIP"),
        _field_env(ENV_NODE_NAME, "spec.nodeName"),
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env(ENV_AGENT_ID, "metadata.uid"),  # the rendezvous' name for this agent, never reused
        *({"name": name, "value": value} for name, value in torchrun_options(job, spec).env().items()),
        {"name": ENV_UNSHARED_RDZV_STORE, "value": "1"},
        {"name": ENV_METRICS_HOST, "value": "$(POD_IP)"},
        {"name": ENV_CONTROL_TOKEN_FILE, "value": f"{TOKEN_DIR}/{TOKEN_KEY}"},
        {"name": ENV_RUN_CONFIG, "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},  # for a script on the adaptation API
        {"name": "SGDJOB_JOB_NAME", "value": job.name},
        {"name": "SGDJOB_WORKER_INDEX", "value": str(index)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _merge_named(user: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """User entries first (in their order), ours replacing any of the same name: the contract wins."""
    names = {item["name"] for item in ours}
    return [item for item in user if item.get("name") not in names] + ours


def _exclusion_affinity(affinity: dict[str, Any], excluded: Sequence[str]) -> dict[str, Any]:
    """Add `metadata.name NotIn [node]` for each excluded node to every required node-selector term
    (ANDed with the user's own terms, which are ORed among themselves), creating the term if there
    is none. One requirement per node: the API server refuses a node field selector with more than
    one value ("must be only one value when `operator` is 'In' or 'NotIn'"), which two lost nodes
    would otherwise make of every pod the job creates."""
    if not excluded:
        return affinity
    out = copy.deepcopy(affinity)
    required = out.setdefault("nodeAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    requirements = [{"key": "metadata.name", "operator": "NotIn", "values": [node]} for node in sorted(set(excluded))]
    for term in terms:
        term["matchFields"] = [*term.get("matchFields", []), *requirements]
    required["nodeSelectorTerms"] = terms
    return out


def _trainer_container(containers: list[dict[str, Any]]) -> int:
    for i, container in enumerate(containers):
        if container.get("name") == CONTAINER:
            return i
    return 0


# Command mode: `AGENT --no-python CMD args` (torchrun's options come as PET_* env), after a check
# that CMD exists, so a missing program fails the pod with 127 and a termination message naming the
# field (what `kubectl describe` and the job's message show), not a traceback. AGENT is our agent
# where the image's python3 has it (its rendezvous re-forms a rescaled world without torch's last
# call and heartbeats: seconds, not 20+), else the image's plain torchrun.
_COMMAND_CHECK = (
    'command -v "$1" >/dev/null 2>&1 || { echo "spec.training.command: $1 was not found in the worker image '
    '(PATH=$PATH); fix the command or the image" | tee "$SGDJOB_TERMINATION_LOG" >&2; exit 127; }; '
    "if python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec(\"sgdjob_trainer\") is None)' "
    f'2>/dev/null; then exec python3 -m {AGENT_MODULE} --no-python "$@"; fi; '
    'exec torchrun --no-python "$@"'
)


def worker_command(command: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """The trainer container's command and args: our torchrun agent running our trainer, or an agent
    running the user's training.command (its env and workingDir are the template container's own):
    ours where the image holds it, plain torchrun where it does not."""
    if command is None:
        # Our agent, torchrun with workers forked from it: every world a replacement, rescale or lost
        # peer restarts starts without a fresh interpreter importing torch and the trainer per worker
        # (about 6 s of CPU, several times that under a node's CPU quota), and a rendezvous closed or
        # timed out ends it with a status of its own (failures.py, rules 4 and 4a).
        return ["python", "-m", AGENT_MODULE], list(trainer_args(f"{CONFIG_DIR}/{CONFIG_FILE}"))
    return ["sh", "-c", _COMMAND_CHECK, "sgdjob-command"], list(command)


def build_worker_pod(
    job: JobRef, spec: SGDJobSpec, index: int, *, default_image: str, excluded_nodes: Sequence[str] = ()
) -> dict[str, Any]:
    """Worker pod `index`: the user's template with the operator's contract merged into the trainer
    container (named `trainer`, else the first). Everything else in the template is kept as written:
    resources (incl. nvidia.com/gpu), nodeSelector, tolerations, volumes, sidecars, extra env."""
    template = copy.deepcopy(spec.template)
    tmeta = template.get("metadata") or {}
    pod_spec: dict[str, Any] = template.get("spec") or {}
    name = job.worker(index)
    meta = _meta(job, name, ROLE_WORKER, {LABEL_INDEX: str(index)})
    group_labels, group_annotations, group_fields = gang.pod_scheduling(spec, job.pod_group)
    meta["labels"] = {**(tmeta.get("labels") or {}), **meta["labels"], **group_labels}
    # For a Prometheus that discovers pods by annotation: local rank 0's /metrics (the chart's
    # PodMonitor scrapes every rank's port). The template's own annotations win.
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(spec.training.metrics_port)}
    scrape["prometheus.io/path"] = "/metrics"
    meta["annotations"] = {**scrape, **(tmeta.get("annotations") or {}), **group_annotations}

    containers: list[dict[str, Any]] = pod_spec.get("containers") or [{"name": CONTAINER}]
    main = containers[_trainer_container(containers)]
    main.setdefault("name", CONTAINER)
    main["image"] = main.get("image") or default_image
    if not main.get("command") and not main.get("args"):
        main["command"], main["args"] = worker_command(spec.training.command)
    # Rank 0 writes how training ended there (a target reached after the last scrape included);
    # on an error the kubelet puts the log's tail there instead.
    main.setdefault("terminationMessagePath", TERMINATION_LOG)
    main.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    termination = {"name": ENV_TERMINATION_LOG, "value": main["terminationMessagePath"]}
    main["env"] = _merge_named(main.get("env") or [], [*worker_env(job, spec, index), termination])
    base = spec.training.metrics_port
    ports = [
        {"name": "metrics" if lr == 0 else f"metrics-{lr}", "containerPort": base + lr, "protocol": "TCP"}
        for lr in range(spec.nproc_per_node)
    ]
    taken = {p.get("containerPort") for p in main.get("ports") or []}
    main["ports"] = [*(main.get("ports") or []), *(p for p in ports if p["containerPort"] not in taken)]
    mounts = [
        {"name": "sgdjob-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "sgdjob-control", "mountPath": TOKEN_DIR, "readOnly": True},
    ]
    main["volumeMounts"] = _merge_named(main.get("volumeMounts") or [], mounts)
    volumes = [
        {"name": "sgdjob-config", "configMap": {"name": job.config_map}},
        {"name": "sgdjob-control", "secret": {"secretName": job.secret, "defaultMode": 0o400}},
    ]
    pod_spec["containers"] = containers
    pod_spec["volumes"] = _merge_named(pod_spec.get("volumes") or [], volumes)
    # The operator restarts failed workers itself (counting them against backoffLimit), so the
    # kubelet must not restart them behind its back.
    pod_spec["restartPolicy"] = "Never"
    # Trainers never call the Kubernetes API; a template that needs it can say so.
    pod_spec.setdefault("automountServiceAccountToken", False)
    # Docker-link variables of the namespace's Services (a Service `master` sets MASTER_PORT=tcp://...)
    # would overwrite torchrun's and the trainer's environment contract.
    pod_spec.setdefault("enableServiceLinks", False)
    harden(pod_spec, main, non_root=main["image"] == default_image)
    # The control token's file is mode 0400 and root's: a trainer running as a non-root user (the
    # project's image: 10001) reads it only through the group the kubelet gives the volume (fsGroup,
    # which the container's processes get as a supplementary group), else /control stays disabled.
    pod_spec["securityContext"].setdefault("fsGroup", TOKEN_GROUP)
    pod_spec.update(group_fields)
    pod_spec["hostname"] = name
    pod_spec["subdomain"] = job.service
    affinity = _exclusion_affinity(pod_spec.get("affinity") or {}, excluded_nodes)
    if affinity:
        pod_spec["affinity"] = affinity
    if excluded_nodes:
        meta["annotations"] = {
            **meta.get("annotations", {}),
            ANNOTATION_EXCLUDED: ",".join(sorted(set(excluded_nodes))),
        }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_pod_group(job: JobRef, spec: SGDJobSpec) -> dict[str, Any] | None:
    """The gang's PodGroup (Volcano or coscheduling), owned by the job; None without a gang."""
    return gang.pod_group(_meta(job, job.pod_group), spec)


def build_workload(
    job: JobRef, spec: SGDJobSpec, queue: str, *, default_image: str, priority: tuple[str, int] | None = None
) -> dict[str, Any]:
    """The Kueue Workload of a job labelled with a queue name: one pod set of `replicas` workers."""
    worker = build_worker_pod(job, spec, 0, default_image=default_image)
    return gang.workload(_meta(job, job.workload), queue, worker, spec.replicas, priority)


def build_rdzv_pod(
    job: JobRef, spec: SGDJobSpec, *, default_image: str, excluded_nodes: Sequence[str] = ()
) -> dict[str, Any]:
    """The rendezvous store's pod: the trainer image (it has torch), tiny resources, restarted in
    place by the kubelet, and the template's scheduling constraints so it can land where workers can,
    kept off `excluded_nodes` (a node its predecessor stopped answering on, storeloss.py)."""
    pod_spec: dict[str, Any] = copy.deepcopy(spec.template.get("spec") or {})
    containers = pod_spec.get("containers") or [{}]
    image = containers[_trainer_container(containers)].get("image") or default_image
    keep: dict[str, Any] = {
        k: pod_spec[k]
        for k in (
            "nodeSelector",
            "tolerations",
            "imagePullSecrets",
            "priorityClassName",
            "serviceAccountName",
            "securityContext",
        )
        if k in pod_spec
    }
    health = {"httpGet": {"path": STORE_HEALTH_PATH, "port": STORE_HEALTH_PORT_NAME}}
    container = {
        "name": "rendezvous",
        "image": image,
        "command": [
            *("python", "-m", STORE_MODULE, "--host", "$(POD_IP)"),
            *("--port", str(RDZV_PORT), "--health-port", str(RDZV_HEALTH_PORT)),
        ],
        "env": [_field_env("POD_IP", "status.podIP"), {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [
            {"name": "rendezvous", "containerPort": RDZV_PORT, "protocol": "TCP"},
            {"name": STORE_HEALTH_PORT_NAME, "containerPort": RDZV_HEALTH_PORT, "protocol": "TCP"},
        ],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        # The store's own health check, not a TCP connect: a hung store still accepts connections.
        # Liveness too, so a hung store is restarted in place even where no operator judges it (none
        # running, or one outside the pod network, storeloss.py): a hung store holds every agent up,
        # and its state is only the current rendezvous round, which the agents rebuild. The thresholds
        # are generous (a loopback round trip takes under a millisecond; 3 misses in a row, 5 s each,
        # is a store that does not serve), and the startup probe holds liveness off while torch loads.
        "startupProbe": {**health, "periodSeconds": 2, "timeoutSeconds": 5, "failureThreshold": 150},
        "readinessProbe": {**health, "periodSeconds": 5, "timeoutSeconds": 2},
        "livenessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
    }
    rdzv_spec = dict(keep)
    rdzv_spec.update(
        containers=[container],
        restartPolicy="Always",
        hostname=job.rdzv_pod,
        subdomain=job.service,
        automountServiceAccountToken=False,
        enableServiceLinks=False,
    )
    harden(rdzv_spec, container, non_root=image == default_image)
    meta = _meta(job, job.rdzv_pod, ROLE_RDZV)
    # Only the exclusion: the template's pod (anti-)affinity terms are about workers, not the store.
    if affinity := _exclusion_affinity({}, excluded_nodes):
        rdzv_spec["affinity"] = affinity
    if excluded_nodes:
        meta["annotations"] = {
            **meta.get("annotations", {}),
            ANNOTATION_EXCLUDED: ",".join(sorted(set(excluded_nodes))),
        }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": rdzv_spec}


def harden(pod_spec: dict[str, Any], container: dict[str, Any], *, non_root: bool) -> None:
    """Restricted-profile defaults wherever the template leaves them open: seccomp RuntimeDefault, no
    privilege escalation, all capabilities dropped (a template's `capabilities.add`, e.g. IPC_LOCK for
    RDMA, still applies), and runAsNonRoot only for the project's own trainer image (USER 10001): a
    user's image may need root, so that stays the template's choice. What the template sets wins."""
    pod_sc = pod_spec.setdefault("securityContext", {})
    sc = container.setdefault("securityContext", {})
    if "seccompProfile" not in pod_sc and "seccompProfile" not in sc:
        pod_sc["seccompProfile"] = {"type": "RuntimeDefault"}
    if (
        non_root
        and "runAsNonRoot" not in pod_sc
        and "runAsNonRoot" not in sc
        and pod_sc.get("runAsUser") != 0
        and sc.get("runAsUser") != 0
    ):
        pod_sc["runAsNonRoot"] = True
    if not sc.get("privileged"):  # the API refuses privileged with allowPrivilegeEscalation false
        sc.setdefault("allowPrivilegeEscalation", False)
        caps = sc.setdefault("capabilities", {})
        caps.setdefault("drop", ["ALL"])
