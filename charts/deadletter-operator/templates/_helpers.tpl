{{/* The chart name, or nameOverride. */}}
{{- define "dlo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name; the release name alone when it already contains the chart name. */}}
{{- define "dlo.fullname" -}}
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

{{- define "dlo.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dlo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dlo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "dlo.labels" -}}
helm.sh/chart: {{ include "dlo.chart" . }}
{{ include "dlo.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: deadletter-operator
{{- end }}

{{- define "dlo.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dlo.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "dlo.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The watched namespaces, deduplicated, in the order given. */}}
{{- define "dlo.watchNamespaces" -}}
{{- .Values.watchNamespaces | uniq | join "," }}
{{- end }}

{{- define "dlo.leaseName" -}}
{{- default (include "dlo.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{- define "dlo.recordsLedger" -}}
{{- printf "%s-records" (include "dlo.leaseName" .) }}
{{- end }}

{{- define "dlo.metricsServiceName" -}}
{{- printf "%s-metrics" (include "dlo.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dlo.revealServiceName" -}}
{{- printf "%s-reveal" (include "dlo.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dlo.parkServiceName" -}}
{{- printf "%s-park" (include "dlo.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The park endpoint's advertised URL: parkEndpoint.url, else its Service's in-cluster name.
*/}}
{{- define "dlo.parkUrl" -}}
{{- if .Values.parkEndpoint.url -}}
{{- .Values.parkEndpoint.url -}}
{{- else -}}
{{- printf "https://%s.%s.svc:%d" (include "dlo.parkServiceName" .) .Release.Namespace (int .Values.parkEndpoint.port) -}}
{{- end -}}
{{- end }}

{{/*
What the operator does against the API in the namespaces it watches, and nothing more:
- deadletters: read, park (create / server-side apply), retention (delete);
- deadletters/status and deadletterqueues/status: phase, counters, conditions (CAS writes);
- deadletterqueues: read only;
- events.k8s.io events: the Parked/Redriven/Dropped/RequeueFailed/ResolveConflict events
  (create, and patch to aggregate a repeated event into a series);
- secrets: get, for a queue's urlSecretRef (never list or watch: it reads only the named keys).
*/}}
{{- define "dlo.operatorRules" -}}
- apiGroups: [dlq.dev]
  resources: [deadletters]
  # patch: a replay's decisions (spec.action/by/note, the dlq.dev/replay label) and their
  # withdrawal when it stops.
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [dlq.dev]
  resources: [deadletters/status]
  verbs: [patch]
- apiGroups: [dlq.dev]
  resources: [deadletterreplays]
  verbs: [get, list, watch]
- apiGroups: [dlq.dev]
  resources: [deadletterreplays/status]
  verbs: [patch]
- apiGroups: [dlq.dev]
  resources: [deadletterqueues]
  verbs: [get, list, watch]
- apiGroups: [dlq.dev]
  resources: [deadlettergroups]
  # the operator creates, keeps and deletes every failure group (server-side apply: patch)
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [dlq.dev]
  resources: [deadlettergroups/status]
  verbs: [patch]
- apiGroups: [dlq.dev]
  resources: [deadletterqueues/status]
  verbs: [patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [resourcequotas]
  # a queue's Full condition names a used-up ResourceQuota on its namespace's records
  verbs: [get, list, watch]
{{- if .Values.rbac.readSecrets }}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
{{- end }}

{{/*
CEL: a DeadLetterReplay's frozen fields (all of spec but `stop` and `paused`) are unchanged by this UPDATE.
The same list as dlq_core::replay::FROZEN_FIELDS (tests/chart_admission.rs checks).
*/}}
{{- define "dlo.replayFrozenUnchanged" -}}
{{- $parts := list -}}
{{- range list "queue" "selector" "action" "rate" "max" "stopWhen" "dryRun" "by" "note" "settleSeconds" "standing" "canary" -}}
{{- $parts = append $parts (printf "has(object.spec.%s) == has(oldObject.spec.%s) && (!has(object.spec.%s) || object.spec.%s == oldObject.spec.%s)" . . . . .) -}}
{{- end -}}
{{- join " && " $parts -}}
{{- end }}
