{{/* Names and labels shared by every template. */}}
{{- define "kvfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.labels" -}}
app.kubernetes.io/part-of: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvfleet.selector" -}}
app.kubernetes.io/part-of: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvfleet.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{- define "kvfleet.image" -}}
{{- printf "%s/%s:%s" .root.Values.image.registry .name (include "kvfleet.tag" .root) -}}
{{- end -}}

{{- define "kvfleet.secretName" -}}
{{- .Values.existingSecret | default (printf "%s-credentials" (include "kvfleet.fullname" .)) -}}
{{- end -}}

{{- define "kvfleet.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "kvfleet.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* Environment every component reads: KVFLEET_REDIS_URL and KVFLEET_ADMIN_TOKEN from the Secret. */}}
{{- define "kvfleet.credentialsEnv" -}}
- name: KVFLEET_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.secretName" . }}
      key: redis-url
- name: KVFLEET_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.secretName" . }}
      key: admin-token
{{- end -}}

{{- define "kvfleet.podSecurity" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvfleet.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The OTLP/HTTP endpoint components export spans to: observability.otlpEndpoint, else the bundled
collector; empty when observability is off (then no component gets an exporter). */}}
{{- define "kvfleet.otlpEndpoint" -}}
{{- if .Values.observability.enabled -}}
{{- if .Values.observability.otlpEndpoint -}}
{{- .Values.observability.otlpEndpoint -}}
{{- else if .Values.observability.otelCollector.enabled -}}
{{- printf "http://%s-otel-collector.%s.svc:4318" (include "kvfleet.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* OTEL_* environment of a component the chart runs: (dict "root" $ "service" "kvfleet-gateway").
kvfleet_common.tracing reads these; empty when there is no endpoint. */}}
{{- define "kvfleet.otelEnv" -}}
{{- $endpoint := include "kvfleet.otlpEndpoint" .root -}}
{{- if $endpoint -}}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ .service | quote }}
- name: KVFLEET_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,k8s.pod.name=$(KVFLEET_POD_NAME)" .root.Release.Namespace | quote }}
{{- end -}}
{{- end -}}
