"""KWOK Stage configuration for the local control plane.

KWOK runs no containers: Stages describe how a simulated kubelet moves node and pod status.
These are KWOK's own "fast" stages (sigs.k8s.io/kwok kustomize/stage/{node,pod}/fast and
node/heartbeat-with-lease, v0.8.0) with two deliberate changes:

* No ``pod-complete`` stage: upstream makes every Job-owned pod succeed as soon as it runs. Here
  a pod stays Running until it is told to exit, because end-to-end tests play pods with local
  processes and report their real outcome.
* Two ``pod-exit-*`` stages: setting the annotation ``rlpacer.io/kwok-exit`` on a Running pod to
  an exit code (an integer as a string) ends it the way a kubelet would report it: ``"0"`` ->
  phase Succeeded (containers terminated, reason Completed, exit code 0); any other integer ->
  phase Failed (reason Error, that exit code). See ``LocalCluster.mark_pod_exit``.
"""

from __future__ import annotations

#: Annotation that makes a Running KWOK pod exit with the given code ("0" -> Succeeded).
EXIT_ANNOTATION = "rlpacer.io/kwok-exit"
#: Annotation (value "fake") by which KWOK recognises the nodes it manages.
NODE_ANNOTATION = "kwok.x-k8s.io/node"

_NODE_INITIALIZE = r"""
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-initialize
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'NotIn'
      values:
      - 'True'
  next:
    statusTemplate: |
      {{ $now := Now }}
      {{ $lastTransitionTime := or .metadata.creationTimestamp $now }}
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $lastTransitionTime | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type  | Quote}}
      {{ end }}

      {{ $hasInternalIP := false }}
      {{ $hasHostname := false }}
      {{ range .status.addresses }}
        {{ if eq .type "InternalIP" }}
          {{ $hasInternalIP = true }}
        {{ end }}
        {{ if eq .type "Hostname" }}
          {{ $hasHostname = true }}
        {{ end }}
      {{ end }}
      {{ if or (not $hasInternalIP) (not $hasHostname) }}
      addresses:
      {{ end }}
      {{ if not $hasInternalIP }}
      {{ with NodeIP }}
      - address: {{ . | Quote }}
        type: InternalIP
      {{ end }}
      {{ end }}
      {{ if not $hasHostname }}
      {{ with NodeName }}
      - address: {{ . | Quote }}
        type: Hostname
      {{ end }}
      {{ end }}

      {{ with NodePort }}
      daemonEndpoints:
        kubeletEndpoint:
          Port: {{ . }}
      {{ end }}

      allocatable:
      {{ with .status.allocatable }}
      {{ YAML . 1 }}
      {{ else }}
        cpu: 1k
        memory: 1Ti
        pods: 1M
      {{ end }}
      capacity:
      {{ with .status.capacity }}
      {{ YAML . 1 }}
      {{ else }}
        cpu: 1k
        memory: 1Ti
        pods: 1M
      {{ end }}

      {{ $nodeInfo := .status.nodeInfo }}
      {{ $kwokVersion := printf "kwok-%s" Version }}
      nodeInfo:
        architecture: {{ or $nodeInfo.architecture "amd64" }}
        bootID: {{ or $nodeInfo.bootID `""` }}
        containerRuntimeVersion: {{ or $nodeInfo.containerRuntimeVersion $kwokVersion }}
        kernelVersion: {{ or $nodeInfo.kernelVersion $kwokVersion }}
        kubeProxyVersion: {{ or $nodeInfo.kubeProxyVersion $kwokVersion }}
        kubeletVersion: {{ or $nodeInfo.kubeletVersion $kwokVersion }}
        machineID: {{ or $nodeInfo.machineID `""` }}
        operatingSystem: {{ or $nodeInfo.operatingSystem "linux" }}
        osImage: {{ or $nodeInfo.osImage `""` }}
        systemUUID: {{ or $nodeInfo.systemUUID `""` }}
      phase: Running
"""

_NODE_HEARTBEAT_WITH_LEASE = r"""
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-heartbeat-with-lease
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Running'
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'In'
      values:
      - 'True'
  delay:
    durationMilliseconds: 600000
    jitterDurationMilliseconds: 610000
  next:
    statusTemplate: |
      {{ $now := Now }}
      {{ $lastTransitionTime := or .metadata.creationTimestamp $now }}
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $lastTransitionTime | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}

      addresses:
      {{ with .status.addresses }}
      {{ YAML . 1 }}
      {{ else }}
      {{ with NodeIP }}
      - address: {{ . | Quote }}
        type: InternalIP
      {{ end }}
      {{ with NodeName }}
      - address: {{ . | Quote }}
        type: Hostname
      {{ end }}
      {{ end }}

      {{ with NodePort }}
      daemonEndpoints:
        kubeletEndpoint:
          Port: {{ . }}
      {{ end }}
"""

_POD_READY = r"""
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Pending'
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'NotIn'
      values:
      - 'True'
  next:
    statusTemplate: |
      {{ $now := Now }}

      conditions:
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Ready
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: ContainersReady
      {{ range .spec.readinessGates }}
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: {{ .conditionType | Quote }}
      {{ end }}

      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        started: true
        state:
          running:
            startedAt: {{ $now | Quote }}
      {{ end }}

      initContainerStatuses:
      {{ range .spec.initContainers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        {{ if eq .restartPolicy "Always" }}
        started: true
        state:
          running:
            startedAt: {{ $now | Quote }}
        {{ else }}
        state:
          terminated:
            exitCode: 0
            finishedAt: {{ $now | Quote }}
            reason: Completed
            startedAt: {{ $now | Quote }}
        {{ end }}
      {{ end }}
      {{ $hostIPs := NodeIPsWith .spec.nodeName }}
      {{ with $hostIPs }}
      hostIP: {{ index . 0 | Quote }}
      hostIPs:
      {{ range . }}
      - ip: {{ . | Quote }}
      {{ end }}
      {{ end }}
      {{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
      {{ with $podIPs }}
      podIP: {{ index . 0 | Quote }}
      podIPs:
      {{ range . }}
      - ip: {{ . | Quote }}
      {{ end }}
      {{ end }}
      phase: Running
      startTime: {{ $now | Quote }}
"""  # noqa: E501


def _pod_exit(name: str, operator: str, phase: str, reason: str) -> str:
    # The exit code is the annotation's value, rendered unquoted so it is a YAML integer.
    return rf"""
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: {name}
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Running'
    - key: '.metadata.annotations["{EXIT_ANNOTATION}"]'
      operator: 'Exists'
    - key: '.metadata.annotations["{EXIT_ANNOTATION}"]'
      operator: '{operator}'
      values:
      - '0'
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      {{{{ $code := index .metadata.annotations "{EXIT_ANNOTATION}" }}}}
      conditions:
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "False"
        type: Ready
        reason: PodCompleted
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "False"
        type: ContainersReady
        reason: PodCompleted
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: {{{{ $code }}}}
            finishedAt: {{{{ $now | Quote }}}}
            reason: {reason}
            startedAt: {{{{ $now | Quote }}}}
      {{{{ end }}}}
      phase: {phase}
"""


_POD_DELETE = r"""
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
  next:
    delete: true
"""


def stages_yaml() -> str:
    """The KWOK ``--config`` file: node and pod Stages, as a multi-document YAML string."""
    docs = [
        _NODE_INITIALIZE,
        _NODE_HEARTBEAT_WITH_LEASE,
        _POD_READY,
        _pod_exit("pod-exit-succeeded", "In", "Succeeded", "Completed"),
        _pod_exit("pod-exit-failed", "NotIn", "Failed", "Error"),
        _POD_DELETE,
    ]
    return "---\n".join(d.strip("\n") + "\n" for d in docs)
