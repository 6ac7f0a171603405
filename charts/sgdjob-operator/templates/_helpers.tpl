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

{{- /* Exactly what the operator calls; tests/packaging/test_chart.py compares this with the code. */}}
{{- define "sgdjob-operator.rules" -}}
- apiGroups: ["sgdjob.dev"]
  resources: ["sgdjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["sgdjob.dev"]
  resources: ["sgdjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services", "secrets"]
  verbs: ["get", "list", "create", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
