{{- define "sgdjob-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sgdjob-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sgdjob-operator.labels" -}}
app.kubernetes.io/name: {{ include "sgdjob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "sgdjob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sgdjob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sgdjob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sgdjob-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /*
Exactly what the operator calls, kopf's own requests included; nothing more. The test
tests/packaging/test_helm_install.py records every request of the installed operator pod and
compares the set with these rules (kopf: list/watch of sgdjobs and pods, patch of sgdjobs for its
annotations; the operator: get sgdjobs, patch status, create/delete pods and the job's Service,
Secret and ConfigMaps (run config, policy state), get them for the clean-up, get and patch the
ConfigMaps, delete finished jobs, Events).
rbac.integrations adds what gang scheduling (PodGroups: get, create, patch minMember) and Kueue
(Workloads: get, create, delete; PriorityClasses: get, in the ClusterRole) need; off by default.
*/}}
{{- define "sgdjob-operator.rules" -}}
- apiGroups: ["sgdjob.dev"]
  resources: ["sgdjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["sgdjob.dev"]
  resources: ["sgdjobs/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services", "secrets"]
  verbs: ["get", "create", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- with .Values.rbac.integrations }}
{{- if .volcano }}
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- if .coscheduling }}
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- if .kueue }}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "create", "delete"]
{{- end }}
{{- end }}
{{- end }}

{{- /*
"true" when the operator runs with leader election (README "High availability"): `auto` turns it on
for more than one replica; two replicas without it would both act on every job, so that fails.
*/}}
{{- define "sgdjob-operator.leaderElection" -}}
{{- $le := .Values.leaderElection -}}
{{- $on := false -}}
{{- if eq (toString $le.enabled) "auto" -}}
{{- $on = gt (int .Values.replicaCount) 1 -}}
{{- else if $le.enabled -}}
{{- $on = true -}}
{{- else if gt (int .Values.replicaCount) 1 -}}
{{- fail "replicaCount > 1 needs leaderElection.enabled (auto or true): two operators without it would both act on every job" -}}
{{- end -}}
{{- if $on -}}
{{- if ge (float64 $le.renewDeadlineSeconds) (float64 $le.leaseDurationSeconds) -}}
{{- fail "leaderElection.renewDeadlineSeconds must be shorter than leaderElection.leaseDurationSeconds" -}}
{{- end -}}
{{- if gt (mulf 2 $le.retryPeriodSeconds) (float64 $le.renewDeadlineSeconds) -}}
{{- fail "leaderElection.retryPeriodSeconds must be at most half of leaderElection.renewDeadlineSeconds" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}
