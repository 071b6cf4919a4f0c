{{/* Chart name. */}}
{{- define "kvfabric.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-based, at most 40 characters so suffixes fit. */}}
{{- define "kvfabric.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvfabric.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvfabric.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfabric
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: include "kvfabric.selectorLabels" (list . "agent") */}}
{{- define "kvfabric.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "kvfabric.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "kvfabric.componentLabels" -}}
{{ include "kvfabric.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* image: include "kvfabric.image" (list .Values.agent.image .Chart.AppVersion) */}}
{{- define "kvfabric.image" -}}
{{- $img := index . 0 }}
{{- $tag := default (index . 1) $img.tag }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository $tag }}
{{- end }}
{{- end }}

{{- define "kvfabric.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "kvfabric.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvfabric.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (printf "%s-agent" (include "kvfabric.fullname" .)) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvfabric.etcd.fullname" -}}
{{- printf "%s-etcd" (include "kvfabric.fullname" .) }}
{{- end }}

{{/* etcd client URLs the agents use (a list). */}}
{{- define "kvfabric.etcd.endpoints" -}}
{{- $eps := list }}
{{- if .Values.etcd.bundled.enabled }}
{{- $name := include "kvfabric.etcd.fullname" . }}
{{- range $i := until (int .Values.etcd.bundled.replicas) }}
{{- $eps = append $eps (printf "http://%s-%d.%s-headless.%s.svc:%d" $name $i $name $.Release.Namespace (int $.Values.etcd.bundled.clientPort)) }}
{{- end }}
{{- else }}
{{- $eps = .Values.etcd.external.endpoints }}
{{- end }}
{{- toJson $eps }}
{{- end }}

{{- define "kvfabric.etcd.tls" -}}
{{- if and (not .Values.etcd.bundled.enabled) .Values.etcd.external.tls.enabled }}true{{ end }}
{{- end }}

{{/* Whether the Prometheus Operator API is served (or forced). */}}
{{- define "kvfabric.monitoringApi" -}}
{{- if or .Values.monitoring.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") }}true{{ end }}
{{- end }}

{{/* Checks of value combinations a schema cannot express. */}}
{{- define "kvfabric.validate" -}}
{{- if and .Values.operator.enabled (gt (int .Values.operator.replicas) 1) (not .Values.operator.leaderElection.enabled) }}
{{- fail "operator.replicas > 1 needs operator.leaderElection.enabled=true (two operators would both act)" }}
{{- end }}
{{- if and (not .Values.etcd.bundled.enabled) (empty .Values.etcd.external.endpoints) }}
{{- fail "etcd.bundled.enabled=false needs etcd.external.endpoints" }}
{{- end }}
{{- if and .Values.etcd.bundled.enabled (not (empty .Values.etcd.external.endpoints)) }}
{{- fail "set either etcd.bundled.enabled or etcd.external.endpoints, not both" }}
{{- end }}
{{- if and (include "kvfabric.etcd.tls" .) (empty .Values.etcd.external.tls.secretName) }}
{{- fail "etcd.external.tls.enabled needs etcd.external.tls.secretName" }}
{{- end }}
{{- if and .Values.etcd.bundled.enabled (eq (mod (int .Values.etcd.bundled.replicas) 2) 0) }}
{{- fail "etcd.bundled.replicas must be odd (1, 3, 5)" }}
{{- end }}
{{- end }}
