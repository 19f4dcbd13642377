"""Pure builders of a job's children: plain dicts, no I/O, no clocks, no randomness.

``build_children(inputs)`` returns every object the job should have *now*: the run-config
ConfigMap, the Services and, while the job runs (not suspended, not finished), the workloads
(the job's two Secrets are built apart, by :func:`token_secret` and :func:`ray_token_secret`:
their content is random, minted once by the runtime):

* Ray head    StatefulSet ``<job>-head`` (1 replica) + headless Service ``<job>-head``
* learners    StatefulSet ``<job>-learner`` (spec.trainer.replicas, GPUs)
* rollout     StatefulSet ``<job>-rollout`` (the plan's desired replicas; the operator scales
              it for long rounds; ``podManagementPolicy: Parallel`` so a long round's extra
              replicas start together)
* driver      Pod ``<job>-driver-<attempt>`` (restartPolicy Never: its exit decides the job;
              a failure starts attempt+1 from the last checkpoint)
* network     NetworkPolicies ``<job>-pods`` and ``<job>-driver`` where the operator is set
              to give jobs policies (:func:`network_policies`)

Everything carries an owner reference to the job (garbage collection on deletion) and the
labels of :mod:`rlpacer.operator.names`. The handlers apply these with server-side apply under
one field manager, so applying the same inputs twice changes nothing (idempotent on replay).
The pod contract (env names, paths, roles) is :mod:`rlpacer.api.contract`.

Secrets and who mounts them:

* ``<job>-token`` (step-report token): the driver only (``RLPACER_TOKEN_FILE``).
* ``<job>-ray-token`` (the job's Ray auth token): every pod (head, learner, rollout, driver),
  read-only, mode 0440, with ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` pointing at
  it, so the job's Ray cluster runs with token auth (``rlpacer_trainer.topology``). Every pod
  (template) is annotated with the token's SHA-256 (:data:`~rlpacer.api.contract.
  ANNOTATION_RAY_TOKEN_HASH`): a replaced token rolls the StatefulSets' pods.
Every pod passes the "restricted" Pod Security Standard (:func:`_restrict`;
charts/rlpacer/README.md "Job pods").
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from rlpacer.api import contract, sources
from rlpacer.api import job as job_api
from rlpacer.api.job import API_VERSION, KIND, PodSettings, RLTrainingJobSpec
from rlpacer.operator import names
from rlpacer.operator.queue import Placement

Obj = dict[str, Any]

#: The module the trainer image runs in every pod (it reads the env of rlpacer.api.contract).
#: ``python3``: the one name every Python image has (PEP 394; a bare ``python`` is absent from
#: Debian's and Ubuntu's python3 packages). The trainer image's ENTRYPOINT is this same list
#: (trainer_image/Dockerfile; tests/unit/test_dockerfiles.py and tests/container run it).
POD_COMMAND = ["python3", "-m", contract.POD_ENTRYPOINT_MODULE]
GPU_TOLERATION = {"key": contract.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
#: File mode of the mounted Ray token: read-only, owner and group (0440; group for an fsGroup).
RAY_TOKEN_MODE = 0o440

#: Kinds of children the operator creates, for listing and cleanup: (apiVersion, kind, plural).
WORKLOAD_KINDS = (("apps/v1", "StatefulSet", "statefulsets"), ("v1", "Pod", "pods"))


@dataclass(frozen=True)
class BuildInputs:
    """Everything the builders need, already decided by the reconciler."""

    name: str
    namespace: str
    uid: str
    spec: RLTrainingJobSpec
    attempt: int
    rollout_replicas: int
    report_url: str
    #: False while suspended or finished: only ConfigMap, Secret and Services remain.
    workloads: bool = True
    #: SHA-256 (hex) of the job's Ray token, annotated on every pod (None: not known).
    ray_token_sha256: str | None = None
    #: PEM of the CA that signed the step-report endpoint's certificate (None: plain HTTP).
    #: Goes into the ConfigMap; the driver verifies the operator with it.
    report_ca: str | None = None
    #: The job's NetworkPolicies (None: none; operator setting ``job_network_policy``).
    network: JobNetwork | None = None
    #: Per role (pod set name), what the flavors Kueue admitted the job with add to its pods
    #: (node labels, tolerations); empty without Kueue (:mod:`rlpacer.operator.queue`).
    placement: Mapping[str, Placement] = field(default_factory=dict)


@dataclass(frozen=True)
class JobNetwork:
    """What a job's NetworkPolicies let through beyond the job's own pods (operator settings
    ``job_network_policy``, ``job_report_to``, ``job_egress``; the
    chart's ``networkPolicy`` values)."""

    #: Ports of the step-report endpoint as the driver's packets meet a policy: the operator
    #: pod's container port and the report URL's port (a Service may map one to the other).
    report_ports: tuple[int, ...]
    #: NetworkPolicyPeers the driver may send step reports to (empty: any address).
    report_to: tuple[Obj, ...] = ()
    #: Extra NetworkPolicyEgressRules for every pod of the job (e.g. a model store).
    egress: tuple[Obj, ...] = ()


def owner_reference(inputs: BuildInputs) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": inputs.name,
        "uid": inputs.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(inputs: BuildInputs, name: str, role: contract.Role | None = None) -> Obj:
    return {
        "name": name,
        "namespace": inputs.namespace,
        "labels": names.labels(inputs.name, role),
        "ownerReferences": [owner_reference(inputs)],
    }


def run_config(inputs: BuildInputs) -> str:
    """The run config the pods load: the job's manifest (``rlpacer run`` format)."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": inputs.name, "namespace": inputs.namespace},
        "spec": inputs.spec.to_wire(),
    }
    # libyaml's emitter when present: this runs on every pass that applies the ConfigMap.
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(doc, Dumper=dumper, sort_keys=False)


def config_map(inputs: BuildInputs) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(inputs, names.config_map(inputs.name)),
        "data": {contract.CONFIG_KEY: run_config(inputs),
                 **({contract.REPORT_CA_KEY: inputs.report_ca} if inputs.report_ca else {})},
    }


def token_secret(inputs: BuildInputs, token: str) -> Obj:
    """The per-job Secret with the step-report token (immutable: never rotated under a run)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(inputs, names.secret(inputs.name)),
        "type": "Opaque",
        "immutable": True,
        "data": {contract.TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def ray_token_secret(inputs: BuildInputs, token: str) -> Obj:
    """The per-job Secret with the Ray auth token every pod of the job mounts (immutable: a
    token is never rotated under a running Ray cluster; see ``Jobs._ensure_ray_token``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(inputs, names.ray_secret(inputs.name)),
        "type": "Opaque",
        "immutable": True,
        "data": {contract.RAY_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def head_service(inputs: BuildInputs) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(inputs, names.head_service(inputs.name), contract.Role.HEAD),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.selector(inputs.name, contract.Role.HEAD),
            "ports": [
                {"name": "gcs", "port": contract.RAY_GCS_PORT, "protocol": "TCP"},
                {"name": "client", "port": contract.RAY_CLIENT_PORT, "protocol": "TCP"},
            ],
        },
    }


def workers_service(inputs: BuildInputs) -> Obj:
    """Headless Service governing the learner and rollout StatefulSets (pod DNS names)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(inputs, names.workers_service(inputs.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.selector(inputs.name),
            "ports": [
                {"name": "metrics", "port": contract.TRAINER_METRICS_PORT, "protocol": "TCP"}
            ],
        },
    }


def ray_address(inputs: BuildInputs) -> str:
    svc = names.head_service(inputs.name)
    return f"{svc}.{inputs.namespace}.svc:{contract.RAY_GCS_PORT}"


def _env(inputs: BuildInputs, role: contract.Role, world_size: int) -> list[Obj]:
    env: list[Obj] = [
        {"name": contract.ENV_JOB, "value": inputs.name},
        {"name": contract.ENV_NAMESPACE, "value": inputs.namespace},
        {"name": contract.ENV_ROLE, "value": role.value},
    ]
    if role in (contract.Role.LEARNER, contract.Role.ROLLOUT):
        env.append({
            "name": contract.ENV_RANK,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
        })
    else:
        env.append({"name": contract.ENV_RANK, "value": "0"})
    env += [
        # the address the pod's Ray node binds and registers (rlpacer_trainer.topology)
        {"name": contract.ENV_POD_IP,
         "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": contract.ENV_WORLD_SIZE, "value": str(world_size)},
        {"name": contract.ENV_CONFIG, "value": contract.CONFIG_PATH},
        {"name": contract.ENV_CHECKPOINT_DIR, "value": contract.CHECKPOINT_DIR},
        # every Ray process of the job requires and presents the job's token
        {"name": contract.ENV_RAY_AUTH_MODE, "value": contract.RAY_AUTH_MODE_TOKEN},
        {"name": contract.ENV_RAY_AUTH_TOKEN_PATH, "value": contract.RAY_TOKEN_PATH},
    ]
    if role is not contract.Role.HEAD:
        env.append({"name": contract.ENV_RAY_ADDRESS, "value": ray_address(inputs)})
    if role is contract.Role.DRIVER:
        env += [
            {"name": contract.ENV_ATTEMPT, "value": str(inputs.attempt)},
            {"name": contract.ENV_REPORT_URL, "value": inputs.report_url},
            {"name": contract.ENV_TOKEN_FILE, "value": contract.TOKEN_PATH},
        ]
        if inputs.report_ca:
            env.append({"name": contract.ENV_REPORT_CA_FILE, "value": contract.REPORT_CA_PATH})
    return env


def role_settings(spec: RLTrainingJobSpec, role: contract.Role) -> PodSettings | None:
    """The spec's Pod API settings of ``role``'s pods: rollout, trainer (learners), driver,
    head."""
    return {contract.Role.ROLLOUT: spec.rollout, contract.Role.LEARNER: spec.trainer,
            contract.Role.DRIVER: spec.driver, contract.Role.HEAD: spec.head}[role]


def read_claims(spec: RLTrainingJobSpec, role: contract.Role) -> list[str]:
    """The claims the spec's sources name (``pvc://CLAIM/PATH``) that ``role``'s pods read:
    the model's in the driver (tokenizer, config), learner and rollout pods; the data's
    (``source``, ``evalSource``) in the driver's. In first-seen order, each once."""
    want: list[str] = []
    if role in (contract.Role.DRIVER, contract.Role.LEARNER, contract.Role.ROLLOUT):
        want.append(spec.model.source)
    if role is contract.Role.DRIVER:
        want += [s for s in (spec.data.source, spec.data.eval_source) if s is not None]
    out: list[str] = []
    for src in want:
        pvc = sources.parse_pvc(src, "spec")
        if pvc is not None and pvc.claim not in out:
            out.append(pvc.claim)
    return out


def _pod_spec(
    inputs: BuildInputs, role: contract.Role, image: str, gpus: int, world_size: int
) -> Obj:
    spec = inputs.spec
    sched = spec.scheduling
    mounts: list[Obj] = [
        {"name": "config", "mountPath": contract.CONFIG_MOUNT_DIR, "readOnly": True},
        {"name": "ray-token", "mountPath": contract.RAY_TOKEN_MOUNT_DIR, "readOnly": True},
    ]
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": names.config_map(inputs.name)}},
        {"name": "ray-token", "secret": {"secretName": names.ray_secret(inputs.name),
                                         "defaultMode": RAY_TOKEN_MODE}},
    ]
    if role is contract.Role.DRIVER:
        mounts.append(
            {"name": "token", "mountPath": contract.TOKEN_MOUNT_DIR, "readOnly": True}
        )
        volumes.append({"name": "token", "secret": {"secretName": names.secret(inputs.name)}})
    if role in (contract.Role.DRIVER, contract.Role.LEARNER):
        mounts.append({"name": "checkpoints", "mountPath": contract.CHECKPOINT_DIR})
        claim = spec.checkpoint.volume_claim
        volumes.append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}}
            if claim
            else {"name": "checkpoints", "emptyDir": {}}
        )
    for i, claim in enumerate(read_claims(spec, role)):
        vol = f"source-{i}"
        if claim == spec.checkpoint.volume_claim and any(
                v["name"] == "checkpoints" for v in volumes):
            vol = "checkpoints"  # one volume, mounted again read-only under the claims root
        else:
            volumes.append({"name": vol, "persistentVolumeClaim": {"claimName": claim,
                                                                   "readOnly": True}})
        mounts.append({"name": vol, "mountPath": sources.claim_mount(claim), "readOnly": True})
    container: Obj = {
        "name": "main",
        "image": image,
        "command": list(POD_COMMAND),
        "env": _env(inputs, role, world_size),
        "volumeMounts": mounts,
    }
    if role is contract.Role.DRIVER:  # its last error line becomes the pod's message
        container["terminationMessagePolicy"] = contract.DRIVER_TERMINATION_MESSAGE_POLICY
    if role is contract.Role.HEAD:
        container["ports"] = [
            {"name": "gcs", "containerPort": contract.RAY_GCS_PORT},
            {"name": "client", "containerPort": contract.RAY_CLIENT_PORT},
        ]
    settings = role_settings(spec, role)
    res = settings.resources if settings is not None else None
    resources: Obj = {}
    for kind in ("limits", "requests"):
        given = dict(getattr(res, kind) or {}) if res is not None else {}
        if gpus > 0:
            given[contract.GPU_RESOURCE] = str(gpus)
        if given:
            resources[kind] = given
    if resources:
        container["resources"] = resources
    if settings is not None and settings.env:
        container["env"] += [{"name": e.name, "value": e.value} for e in settings.env]
    tolerations = [t.to_wire() for t in (sched.tolerations or [])]
    if gpus > 0 and GPU_TOLERATION not in tolerations:
        tolerations.append(dict(GPU_TOLERATION))
    pod: Obj = {
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": volumes,
    }
    if role is contract.Role.DRIVER:
        pod["restartPolicy"] = "Never"
        pod["hostname"] = "driver"
        pod["subdomain"] = names.workers_service(inputs.name)
    selector = dict(sched.node_selector or {})
    placed = inputs.placement.get(role.value)
    if placed is not None:  # the flavor Kueue admitted this role with
        selector.update(placed.node_selector)
        tolerations += [dict(t) for t in placed.tolerations if t not in tolerations]
    if tolerations:
        pod["tolerations"] = tolerations
    if selector:
        pod["nodeSelector"] = selector
    if sched.priority_class_name:
        pod["priorityClassName"] = sched.priority_class_name
    if settings is not None and settings.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": r.name} for r in settings.image_pull_secrets]
    _restrict(pod)
    return pod


def _pod_annotations(inputs: BuildInputs) -> dict[str, str]:
    if inputs.ray_token_sha256 is None:
        return {}
    return {contract.ANNOTATION_RAY_TOKEN_HASH: inputs.ray_token_sha256}


#: Pod-level securityContext of every job pod (Pod Security Standard "restricted"): the
#: image's non-root user, volumes group-owned by it (chown only when the root's owner differs,
#: so a large checkpoint claim is not walked on every start), the runtime's seccomp profile.
POD_SECURITY_CONTEXT: Obj = {
    "runAsNonRoot": True,
    "runAsUser": contract.POD_UID,
    "runAsGroup": contract.POD_GID,
    "fsGroup": contract.POD_GID,
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
#: The container's: no privilege escalation, no capabilities, a read-only root filesystem
#: (the writable folders are the emptyDirs of :data:`WRITABLE_VOLUMES` and the checkpoints).
CONTAINER_SECURITY_CONTEXT: Obj = {
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
#: (volume name, mount path, emptyDir) added to every job pod. /dev/shm has no sizeLimit: a
#: memory-backed emptyDir is bounded by the container's memory limit (it counts against it),
#: and Ray sizes its object store to fit what /dev/shm offers.
WRITABLE_VOLUMES: tuple[tuple[str, str, Obj], ...] = (
    ("tmp", contract.TMP_DIR, {}),
    ("home", contract.HOME_DIR, {}),
    ("shm", contract.SHM_DIR, {"medium": "Memory"}),
)


def _restrict(pod: Obj) -> None:
    """Least privilege for a job pod (no pod of a job talks to the Kubernetes API): no
    ServiceAccount token, the security contexts above, writable emptyDirs for what the read-only
    root filesystem would refuse, and every Secret's files readable by the pod's user alone."""
    pod["automountServiceAccountToken"] = False
    pod["securityContext"] = copy.deepcopy(POD_SECURITY_CONTEXT)
    for vol in pod["volumes"]:
        if "secret" in vol:
            vol["secret"]["defaultMode"] = contract.SECRET_FILE_MODE
    for name, _path, empty_dir in WRITABLE_VOLUMES:
        pod["volumes"].append({"name": name, "emptyDir": dict(empty_dir)})
    for c in pod["containers"]:
        c["securityContext"] = copy.deepcopy(CONTAINER_SECURITY_CONTEXT)
        c["volumeMounts"] += [{"name": n, "mountPath": path} for n, path, _ in WRITABLE_VOLUMES]
        c["env"] += [
            {"name": contract.ENV_HOME, "value": contract.HOME_DIR},
            {"name": contract.ENV_XDG_CACHE_HOME, "value": contract.CACHE_DIR},
        ]


def _pod_labels(inputs: BuildInputs, role: contract.Role) -> dict[str, str]:
    # No kueue.x-k8s.io/queue-name label: the job is admitted as a whole through its own
    # Workload (rlpacer.operator.queue); the label would make Kueue's pod integration, where
    # enabled, gate and charge each pod a second time.
    return names.labels(inputs.name, role)


def statefulset(
    inputs: BuildInputs, role: contract.Role, replicas: int, image: str, gpus: int,
    *, wide: bool = False,
) -> Obj:
    """The StatefulSet of ``role``'s pods; ``wide``: the wide long-round engines' (rollout
    pods labelled :data:`~rlpacer.api.contract.LABEL_POOL`, ordinals from
    ``rollout.replicas`` on, so that replica indices run on across both StatefulSets)."""
    name = names.wide_statefulset(inputs.name) if wide else names.statefulset(inputs.name, role)
    meta = _meta(inputs, name, role)
    labels = _pod_labels(inputs, role)
    selector = names.selector(inputs.name, role)
    if wide:
        labels[contract.LABEL_POOL] = selector[contract.LABEL_POOL] = contract.POOL_WIDE
    meta["labels"] = dict(labels)
    service = (
        names.head_service(inputs.name)
        if role is contract.Role.HEAD
        else names.workers_service(inputs.name)
    )
    # The template's world size is the short-round count for rollout: changing it with the
    # replica count would roll every pod on each scale action.
    world = {
        contract.Role.HEAD: 1,
        contract.Role.LEARNER: inputs.spec.trainer.replicas,
        contract.Role.ROLLOUT: inputs.spec.rollout.replicas,
    }[role]
    out: Obj = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "replicas": replicas,
            "serviceName": service,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels, **_annotated(_pod_annotations(inputs))},
                "spec": _pod_spec(inputs, role, image, gpus, world),
            },
        },
    }
    if wide:  # StatefulSetStartOrdinal: GA in Kubernetes 1.31, on by default since 1.27
        out["spec"]["ordinals"] = {"start": inputs.spec.rollout.replicas}
    return out


def driver_pod(inputs: BuildInputs) -> Obj:
    role = contract.Role.DRIVER
    meta = _meta(inputs, names.driver_pod(inputs.name, inputs.attempt), role)
    meta["labels"] = {
        **_pod_labels(inputs, role),
        contract.LABEL_ATTEMPT: str(inputs.attempt),
    }
    meta.update(_annotated(_pod_annotations(inputs)))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": _pod_spec(inputs, role, inputs.spec.trainer.image, 0, 1),
    }


#: Cluster DNS (every resolver: CoreDNS as a pod or on a node's address).
DNS_EGRESS: Obj = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}


def network_policies(inputs: BuildInputs) -> list[Obj]:
    """The job's NetworkPolicies (none without :attr:`BuildInputs.network`):

    * ``<job>-pods`` selects every pod of the job. Ingress only from the same job's pods (Ray's
      GCS and client ports and the random ports of its workers and object store; the
      learners' and engines' transports); no job pod serves anything else. Egress
      only to the same job's pods and DNS (port 53), plus ``egress``. A pod of another job or
      with no job labels reaches none of the job's ports; a job's pods reach nothing else.
    * ``<job>-driver`` adds the driver's egress to the step-report endpoint (``report_to`` on
      ``report_ports``).

    Policies are additive: the driver's traffic is what either allows. Traffic from a pod's
    own node (kubelet probes, ``kubectl logs`` and ``exec`` go through the kubelet) is not
    subject to NetworkPolicies."""
    net = inputs.network
    if net is None:
        return []
    job_pods = {"podSelector": {"matchLabels": names.selector(inputs.name)}}
    ingress: list[Obj] = [{"from": [job_pods]}]
    egress: list[Obj] = [{"to": [job_pods]}, copy.deepcopy(DNS_EGRESS),
                         *(copy.deepcopy(r) for r in net.egress)]
    pods = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(inputs, names.network_policy(inputs.name)),
        "spec": {
            "podSelector": {"matchLabels": names.selector(inputs.name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }
    report: Obj = {"ports": [{"port": p, "protocol": "TCP"} for p in net.report_ports]}
    if net.report_to:
        report["to"] = [copy.deepcopy(p) for p in net.report_to]
    driver = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(inputs, names.network_policy(inputs.name, contract.Role.DRIVER),
                          contract.Role.DRIVER),
        "spec": {
            "podSelector": {"matchLabels": names.selector(inputs.name, contract.Role.DRIVER)},
            "policyTypes": ["Egress"],
            "egress": [report],
        },
    }
    return [pods, driver]


def _annotated(annotations: dict[str, str]) -> Obj:
    return {"annotations": annotations} if annotations else {}


def build_children(inputs: BuildInputs) -> list[Obj]:
    """Every object the job should have now, except the two Secrets (created once, by
    :func:`token_secret` and :func:`ray_token_secret`, because their content is random and
    must never change)."""
    spec = inputs.spec
    out = [config_map(inputs), head_service(inputs), workers_service(inputs),
           *network_policies(inputs)]
    if inputs.workloads:
        out += [
            statefulset(inputs, contract.Role.HEAD, 1, spec.trainer.image, 0),
            statefulset(
                inputs, contract.Role.LEARNER, spec.trainer.replicas, spec.trainer.image,
                spec.trainer.gpus_per_replica,
            ),
            *rollout_statefulsets(inputs),
            driver_pod(inputs),
        ]
    return out


def rollout_statefulsets(inputs: BuildInputs) -> list[Obj]:
    """The rollout StatefulSet at ``inputs.rollout_replicas``; with wide long-round engines
    (``tailBatching.longRound.tensorParallelSize``) the rollout's at ``rollout.replicas`` at
    most and the wide one at the rest (0 between long rounds)."""
    spec = inputs.spec
    total = inputs.rollout_replicas
    if not job_api.wide_long_rounds(spec):
        return [statefulset(inputs, contract.Role.ROLLOUT, total, spec.rollout.image,
                            spec.rollout.gpus_per_replica)]
    base = min(total, spec.rollout.replicas)
    return [
        statefulset(inputs, contract.Role.ROLLOUT, base, spec.rollout.image,
                    spec.rollout.gpus_per_replica),
        statefulset(inputs, contract.Role.ROLLOUT, max(0, total - spec.rollout.replicas),
                    spec.rollout.image, job_api.extra_replica_gpus(spec), wide=True),
    ]


def pod_template_spec(inputs: BuildInputs, role: contract.Role, *, extra: bool = False) -> Obj:
    """The pod spec of one role as the workloads run it (the Kueue Workload's pod sets);
    ``extra``: a long round's extra rollout replica's (a wide engine's GPUs with
    ``tailBatching.longRound.tensorParallelSize``)."""
    spec = inputs.spec
    if role is contract.Role.ROLLOUT:
        gpus = job_api.extra_replica_gpus(spec) if extra else spec.rollout.gpus_per_replica
        return _pod_spec(inputs, role, spec.rollout.image, gpus, spec.rollout.replicas)
    if role is contract.Role.LEARNER:
        return _pod_spec(inputs, role, spec.trainer.image, spec.trainer.gpus_per_replica,
                         spec.trainer.replicas)
    return _pod_spec(inputs, role, spec.trainer.image, 0, 1)


def workload_names(name: str, attempt: int) -> list[tuple[str, str, str]]:
    """(apiVersion, plural, name) of the workloads, for deletion on suspend and finish."""
    return [
        ("apps/v1", "statefulsets", names.statefulset(name, contract.Role.HEAD)),
        ("apps/v1", "statefulsets", names.statefulset(name, contract.Role.LEARNER)),
        ("apps/v1", "statefulsets", names.statefulset(name, contract.Role.ROLLOUT)),
        ("apps/v1", "statefulsets", names.wide_statefulset(name)),
        ("v1", "pods", names.driver_pod(name, attempt)),
    ]
