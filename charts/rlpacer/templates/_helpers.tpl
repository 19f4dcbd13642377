{{/* Chart name, truncated to a DNS label. */}}
{{- define "rlpacer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-rlpacer, or the release name if it already contains the chart name. */}}
{{- define "rlpacer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rlpacer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rlpacer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlpacer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rlpacer.labels" -}}
helm.sh/chart: {{ include "rlpacer.chart" . }}
{{ include "rlpacer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rlpacer
{{- end }}

{{- define "rlpacer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rlpacer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rlpacer.leaseName" -}}
{{- default (include "rlpacer.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* The namespaces the operator watches, as a list (empty list: the whole cluster). */}}
{{- define "rlpacer.watchNamespaces" -}}
{{- if eq .Values.rbac.scope "Namespaced" }}
{{- if .Values.rbac.watchNamespaces }}
{{- toJson (uniq .Values.rbac.watchNamespaces) }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- else }}
{{- toJson list }}
{{- end }}
{{- end }}

{{- define "rlpacer.webhookSecretName" -}}
{{- if eq .Values.webhook.certs.mode "Secret" }}
{{- required "webhook.certs.existingSecret is required when webhook.certs.mode is Secret" .Values.webhook.certs.existingSecret }}
{{- else }}
{{- printf "%s-webhook-tls" (include "rlpacer.fullname" .) }}
{{- end }}
{{- end }}

{{/*
The operator's RBAC rules in the namespaces it watches (a ClusterRole in scope Cluster, one Role
per namespace in scope Namespaced). Least privilege: what the reconciler applies (server-side
apply, owner references) and reads, nothing cluster-scoped, no RBAC, no nodes.
*/}}
{{- define "rlpacer.operatorRules" -}}
# Jobs: watch, patch (Kopf's finalizers/annotations), delete (ttlSecondsAfterFinished),
# status, and finalizers for blockOwnerDeletion on the children's owner references.
- apiGroups: ["rlpacer.io"]
  resources: ["rltrainingjobs"]
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["rlpacer.io"]
  resources: ["rltrainingjobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["rlpacer.io"]
  resources: ["rltrainingjobs/finalizers"]
  verbs: ["update"]
# Policies: read only (the admission webhook and run-time enforcement index them).
- apiGroups: ["rlpacer.io"]
  resources: ["rltrainingpolicies"]
  verbs: ["get", "list", "watch"]
# Children of a job: trainer and rollout workloads, their Services, the run-config ConfigMap
# and the per-job Secrets (step-report token, Ray auth token).
- apiGroups: [""]
  resources: ["pods", "services", "configmaps", "secrets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
{{- if and .Values.networkPolicy.enabled .Values.networkPolicy.jobs.enabled }}
# Each job's NetworkPolicies (networkPolicy.jobs).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
{{- end }}
{{- if .Values.kueue.enabled }}
# Kueue (kueue.enabled): each queued job's Workloads, made, deactivated when the job is
# suspended or a long round is held behind a higher-priority one (patch), deleted when a long
# round's extra replicas go back, and written back after an eviction (the quota returned) and
# at the end (Finished), as Kueue's own job integrations do.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["get", "update", "patch"]
# The LocalQueue a long round asks in, for the ClusterQueue it points at: the long rounds
# waiting for one ClusterQueue are ordered priority first (docs/kueue.md).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues"]
  verbs: ["get"]
{{- end }}
# Events on jobs (Kopf posts core/v1 Events; events.k8s.io for newer clients).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}
