"""The pod contract: what the operator gives every pod of a job, and what the trainer reads.

This module is the single definition of the interface between the operator's pod builders
(``rlpacer.operator.builders``) and the trainer's entrypoint (``rlpacer_trainer``), so the two
sides, built separately, cannot drift. It imports nothing heavy: the trainer imports it
without pulling Kubernetes clients, and the operator without pulling torch.

In end-to-end tests KWOK pods run no containers; the harness starts the trainer's entrypoint
as local processes with the env this module names, addresses rewritten to loopback and a local
folder standing in for the checkpoint volume (DESIGN.md "Pods and the processes that play
them").

Roles (label :data:`LABEL_ROLE`, env :data:`ENV_ROLE`):

* ``head``    the Ray head (one pod, StatefulSet ``<job>-head``, Service ``<job>-head``).
* ``driver``  the RL loop (one pod per attempt, ``<job>-driver-<attempt>``, restartPolicy
  Never). It owns the tail-batching planner and talks to the operator's step-report endpoint.
  Its exit decides the job: Succeeded -> the job Succeeded; Failed -> a new attempt from the
  last checkpoint (within ``backoffLimit``).
* ``learner`` the policy-update workers (StatefulSet ``<job>-learner``), joining Ray.
* ``rollout`` the generation engines (StatefulSet ``<job>-rollout``), joining Ray; the
  operator scales this StatefulSet for long rounds.
"""

from __future__ import annotations

import enum

# --- environment variables set on the pods -------------------------------------------------

#: The RLTrainingJob's name.
ENV_JOB = "RLPACER_JOB"
#: The RLTrainingJob's namespace.
ENV_NAMESPACE = "RLPACER_NAMESPACE"
#: The pod's role: one of :class:`Role`.
ENV_ROLE = "RLPACER_ROLE"
#: Rank within the role (the StatefulSet pod index; 0 for the head and the driver).
ENV_RANK = "RLPACER_RANK"
#: Replicas of the role when the pod was created (rollout: the short-round count).
ENV_WORLD_SIZE = "RLPACER_WORLD_SIZE"
#: The trainer's restart count (driver only): the ``attempt`` of every step report.
ENV_ATTEMPT = "RLPACER_ATTEMPT"
#: Base URL of the operator's step-report endpoint (``scheme://host:port``, no path); the
#: client appends ``rlpacer.api.protocol.plan_path`` / ``steps_path``.
ENV_REPORT_URL = "RLPACER_REPORT_URL"
#: File holding the job's step-report bearer token (mounted from the job's Secret).
ENV_TOKEN_FILE = "RLPACER_TOKEN_FILE"
#: PEM file of the CA the driver verifies an ``https://`` report URL with (driver only; the
#: job's ConfigMap key :data:`REPORT_CA_KEY`, written there by the operator). Unset: the
#: system's CAs.
ENV_REPORT_CA_FILE = "RLPACER_REPORT_CA_FILE"
#: Retries of a step report or plan read that failed in transit (network error, 5xx, a
#: certificate that does not verify) before the driver fails; default 8 (about 2 minutes).
#: A 503 (nothing persisted: the operator on standby, its API server or etcd away) is
#: retried for at least 5 minutes whatever the count.
ENV_REPORT_RETRIES = "RLPACER_REPORT_RETRIES"
#: File holding the run config: the RLTrainingJob manifest (``rlpacer run`` format).
ENV_CONFIG = "RLPACER_CONFIG"
#: Ray address for workers and the driver (``<head-service>:6379``); unset on the head.
ENV_RAY_ADDRESS = "RAY_ADDRESS"
#: Folder of the job's checkpoints (the mounted volume, or a local folder in tests).
ENV_CHECKPOINT_DIR = "RLPACER_CHECKPOINT_DIR"
#: The pod's own IP (downward API ``status.podIP``): the address its Ray node registers and
#: binds, so other pods reach it (every pod but the head's Service clients needs no DNS).
ENV_POD_IP = "RLPACER_POD_IP"
#: Root temp folder of the pod's Ray node. Never set by the builders (a pod's ``/tmp/ray``
#: is its own); set where several played pods share one filesystem (tests).
ENV_RAY_TEMP_DIR = "RLPACER_RAY_TEMP_DIR"
#: Ray's own: ``token`` (:data:`RAY_AUTH_MODE_TOKEN`) on every pod, so every Ray process of
#: the job (head, worker nodes, the driver) requires and presents the job's Ray token.
ENV_RAY_AUTH_MODE = "RAY_AUTH_MODE"
#: Ray's own: the file holding the job's Ray token (:data:`RAY_TOKEN_PATH`, every pod).
ENV_RAY_AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
RAY_AUTH_MODE_TOKEN = "token"
#: The pod user's home: a writable emptyDir (:data:`HOME_DIR`; the root filesystem is
#: read-only). Ray (``~/.ray``), vLLM (``~/.config/vllm``) and Triton (``~/.triton``) write here.
ENV_HOME = "HOME"
#: Caches (Hugging Face, torch, vLLM) under the writable home: :data:`CACHE_DIR`.
ENV_XDG_CACHE_HOME = "XDG_CACHE_HOME"

#: Every env name above, for harnesses that copy a pod's env onto a local process.
ALL_ENV = (
    ENV_JOB,
    ENV_NAMESPACE,
    ENV_ROLE,
    ENV_RANK,
    ENV_WORLD_SIZE,
    ENV_ATTEMPT,
    ENV_REPORT_URL,
    ENV_TOKEN_FILE,
    ENV_REPORT_CA_FILE,
    ENV_REPORT_RETRIES,
    ENV_CONFIG,
    ENV_RAY_ADDRESS,
    ENV_CHECKPOINT_DIR,
    ENV_HOME,
    ENV_XDG_CACHE_HOME,
    ENV_POD_IP,
    ENV_RAY_TEMP_DIR,
    ENV_RAY_AUTH_MODE,
    ENV_RAY_AUTH_TOKEN_PATH,
)

# --- files ----------------------------------------------------------------------------------

#: Where the job's ConfigMap is mounted.
CONFIG_MOUNT_DIR = "/etc/rlpacer"
#: Key of the run config in the ConfigMap (and file name under :data:`CONFIG_MOUNT_DIR`).
CONFIG_KEY = "job.yaml"
CONFIG_PATH = f"{CONFIG_MOUNT_DIR}/{CONFIG_KEY}"
#: Key of the step-report endpoint's CA in the ConfigMap (when the operator serves TLS); the
#: driver's :data:`ENV_REPORT_CA_FILE` names it under :data:`CONFIG_MOUNT_DIR`. A ConfigMap,
#: not the immutable token Secret: a renewed CA reaches running drivers (mounted files update).
REPORT_CA_KEY = "report-ca.crt"
REPORT_CA_PATH = f"{CONFIG_MOUNT_DIR}/{REPORT_CA_KEY}"

#: Where the job's Secret is mounted.
TOKEN_MOUNT_DIR = "/var/run/secrets/rlpacer"
#: Key of the bearer token in the Secret (and file name under :data:`TOKEN_MOUNT_DIR`).
TOKEN_KEY = "token"
TOKEN_PATH = f"{TOKEN_MOUNT_DIR}/{TOKEN_KEY}"

#: Where the job's Ray-token Secret (``<job>-ray-token``) is mounted, on every pod of the job.
#: A Secret of its own, apart from the step-report token: only the driver gets that one.
RAY_TOKEN_MOUNT_DIR = "/var/run/secrets/rlpacer-ray"
#: Key of the Ray token in its Secret (and file name under :data:`RAY_TOKEN_MOUNT_DIR`).
RAY_TOKEN_KEY = "token"
RAY_TOKEN_PATH = f"{RAY_TOKEN_MOUNT_DIR}/{RAY_TOKEN_KEY}"

#: Where the checkpoint volume is mounted (an emptyDir when spec.checkpoint.volumeClaim is
#: unset: checkpoints then survive a driver restart but not the loss of the pod).
CHECKPOINT_DIR = "/checkpoints"

# --- the pod's user and its writable folders (the root filesystem is read-only) -------------

#: Every container of a job runs as this non-root user and group (the trainer image creates
#: them: trainer_image/Dockerfile); mounted volumes are group-owned by it (``fsGroup``).
POD_UID = 1000
POD_GID = 1000
#: Mode of the files of every Secret mounted into a job's pods (owner and ``fsGroup`` read).
SECRET_FILE_MODE = 0o440
#: emptyDir mounts: temp files, Ray's temp dir and sockets (``/tmp/ray``), torch's caches.
TMP_DIR = "/tmp"
#: emptyDir mount: the user's home (:data:`ENV_HOME`), caches below it.
HOME_DIR = "/home/rlpacer"
CACHE_DIR = f"{HOME_DIR}/.cache"
#: emptyDir (medium Memory) mount: shared memory for Ray's object store, NCCL, torch.
SHM_DIR = "/dev/shm"

# --- entrypoint ---------------------------------------------------------------------------

#: Every pod runs ``python -m <this>``; the module reads :data:`ENV_ROLE` and the rest.
POD_ENTRYPOINT_MODULE = "rlpacer_trainer.pod"

# --- labels ---------------------------------------------------------------------------------

#: The owning job's name (a valid label value: job names are limited to 63 characters).
LABEL_JOB = "rlpacer.io/job"
#: The pod's role (a :class:`Role` value).
LABEL_ROLE = "rlpacer.io/role"
#: The attempt of a driver pod.
LABEL_ATTEMPT = "rlpacer.io/attempt"
#: The rollout pool of a rollout pod: :data:`POOL_WIDE` on the wide long-round engines'
#: pods (``tailBatching.longRound.tensorParallelSize``); absent on the rollout's own.
LABEL_POOL = "rlpacer.io/pool"
POOL_WIDE = "wide"
#: Annotation on every pod (template) of a job: SHA-256 (hex) of the Ray token the pod was
#: built with. A replaced token changes it, so the StatefulSets roll their pods and the
#: operator sees a driver that still runs with the old token.
ANNOTATION_RAY_TOKEN_HASH = "rlpacer.io/ray-token-sha256"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "rlpacer-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
#: Kueue's queue label (pods of a job carry none: the job's Workload names its queue).
LABEL_KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"

# --- ports ----------------------------------------------------------------------------------

RAY_GCS_PORT = 6379
RAY_CLIENT_PORT = 10001
#: The port the workers' headless Service names (a Service lists one; the Service exists for
#: the StatefulSets' pod DNS names). No trainer pod serves metrics: the operator exports each
#: job's from its step reports, and a job's NetworkPolicy admits no scraper.
TRAINER_METRICS_PORT = 9090

#: Extended resource name of GPUs.
GPU_RESOURCE = "nvidia.com/gpu"


class Role(enum.StrEnum):
    """The part a pod plays in a job (label :data:`LABEL_ROLE`, env :data:`ENV_ROLE`)."""

    HEAD = "head"
    DRIVER = "driver"
    LEARNER = "learner"
    ROLLOUT = "rollout"

# --- the driver's exit codes -------------------------------------------------------------------
# 0: the job's steps are done. 2: the run config or the pod's env is wrong (the message names
# the field). 3: the operator refused the driver, or its certificate did not verify. Any
# other non-zero code (a crash, an OOM kill): a new attempt from the last checkpoint.

#: The job's data is bad (spec.data: a file, a record, a field, a prompt over
#: rollout.maxPromptTokens); the driver checks it before anything heavy starts. Permanent:
#: the operator fails the job with reason DataInvalid and the driver's message, spending no
#: backoffLimit retries (the same data would fail the same way).
EXIT_DATA_INVALID = 4
#: The learner does not fit: its estimated memory per rank (the model, the ranks, the micro-batch
#: budget; rlpacer.control.memory) exceeds what a rank has. Checked before the engines start
#: (and by each learner rank before it loads the model). Permanent, as bad data: the operator
#: fails the job with reason LearnerDoesNotFit and the driver's message (the numbers and the
#: spec fields that fix it), spending no backoffLimit retries.
EXIT_LEARNER_DOES_NOT_FIT = 5
#: The driver's error message reaches the operator through the container's termination
#: message: the builders set this policy on the driver, so the log's tail stands in for it.
DRIVER_TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"
