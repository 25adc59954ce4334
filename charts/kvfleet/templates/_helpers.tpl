{{/* Names and labels shared by every template. */}}
{{- define "kvfleet.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "kvfleet.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Cluster-scoped objects (ClusterRoles, the peering object, the admission policy) carry the release
namespace too: two releases of one name in two namespaces must not share them. */}}
{{- define "kvfleet.globalName" -}}
{{- printf "%s.%s" .Release.Namespace (include "kvfleet.fullname" .) -}}
{{- end -}}

{{/* The kopf peering object the operator replicas of this release share (and only they). */}}
{{- define "kvfleet.peeringName" -}}
{{- include "kvfleet.globalName" . -}}
{{- end -}}

{{- define "kvfleet.version" -}}
{{- include "kvfleet.tag" . | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfleet.labels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/version: {{ include "kvfleet.version" . | quote }}
app.kubernetes.io/part-of: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Deployment selectors: fixed for a Deployment's life, so name and version are not part of them. */}}
{{- define "kvfleet.selector" -}}
app.kubernetes.io/part-of: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of a component's pods: (dict "root" $ "component" "gateway"). */}}
{{- define "kvfleet.podLabels" -}}
{{ include "kvfleet.selector" .root }}
app.kubernetes.io/name: {{ include "kvfleet.name" .root }}
app.kubernetes.io/version: {{ include "kvfleet.version" .root | quote }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* A component's extra pod annotations (its own over the chart-wide podAnnotations):
(dict "root" $ "component" .Values.gateway); a YAML map, empty when there are none. */}}
{{- define "kvfleet.podAnnotations" -}}
{{- $own := dict -}}
{{- if .component -}}
{{- $own = .component.podAnnotations | default dict -}}
{{- end -}}
{{- $annotations := merge (dict) $own (.root.Values.podAnnotations | default dict) -}}
{{- if $annotations -}}
{{- toYaml $annotations -}}
{{- end -}}
{{- end -}}

{{/* priorityClassName of a component's pods (its own, else the chart-wide one), or nothing. */}}
{{- define "kvfleet.priorityClassName" -}}
{{- $name := .root.Values.priorityClassName -}}
{{- if and .component .component.priorityClassName -}}
{{- $name = .component.priorityClassName -}}
{{- end -}}
{{- with $name -}}
priorityClassName: {{ . }}
{{- end -}}
{{- end -}}

{{/* A component's affinity: its own, else spread its replicas over nodes (preferred, so that a small
cluster still schedules them all): (dict "root" $ "component" .Values.gateway "name" "gateway"). */}}
{{- define "kvfleet.affinity" -}}
{{- if .component.affinity -}}
{{- toYaml .component.affinity -}}
{{- else -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "kvfleet.selector" .root | nindent 12 }}
            app.kubernetes.io/component: {{ .name }}
{{- end -}}
{{- end -}}

{{/* A PodDisruptionBudget for a component: (dict "root" $ "component" .Values.gateway "name" "gateway"). */}}
{{- define "kvfleet.pdb" -}}
{{- with .component.podDisruptionBudget }}
{{- if .enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kvfleet.fullname" $.root }}-{{ $.name }}
  namespace: {{ $.root.Release.Namespace }}
  labels:
    {{- include "kvfleet.labels" $.root | nindent 4 }}
    app.kubernetes.io/component: {{ $.name }}
spec:
  maxUnavailable: {{ .maxUnavailable }}
  unhealthyPodEvictionPolicy: AlwaysAllow
  selector:
    matchLabels:
      {{- include "kvfleet.selector" $.root | nindent 6 }}
      app.kubernetes.io/component: {{ $.name }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvfleet.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{- define "kvfleet.image" -}}
{{- printf "%s/%s:%s" .root.Values.image.registry .name (include "kvfleet.tag" .root) -}}
{{- end -}}

{{/* The Secret the chart creates for the credentials no existing Secret provides. */}}
{{- define "kvfleet.secretName" -}}
{{- printf "%s-credentials" (include "kvfleet.fullname" .) -}}
{{- end -}}

{{/* Where the admin token comes from: "NAME KEY" (existingSecret, adminTokenSecret, else the chart's). */}}
{{- define "kvfleet.adminTokenRef" -}}
{{- if .Values.existingSecret -}}
{{- printf "%s admin-token" .Values.existingSecret -}}
{{- else if .Values.adminTokenSecret.name -}}
{{- printf "%s %s" .Values.adminTokenSecret.name .Values.adminTokenSecret.key -}}
{{- else -}}
{{- printf "%s admin-token" (include "kvfleet.secretName" .) -}}
{{- end -}}
{{- end -}}

{{/* Whether the bundled Redis requires a password: "true" or "". */}}
{{- define "kvfleet.redisAuth" -}}
{{- if and .Values.redis.enabled .Values.redis.auth.enabled -}}true{{- end -}}
{{- end -}}

{{/* Where the bundled Redis's password comes from: "NAME KEY" (redis.auth.existingSecret, existingSecret,
else the chart's). */}}
{{- define "kvfleet.redisPasswordRef" -}}
{{- if .Values.redis.auth.existingSecret.name -}}
{{- printf "%s %s" .Values.redis.auth.existingSecret.name .Values.redis.auth.existingSecret.key -}}
{{- else if .Values.existingSecret -}}
{{- printf "%s redis-password" .Values.existingSecret -}}
{{- else -}}
{{- printf "%s redis-password" (include "kvfleet.secretName" .) -}}
{{- end -}}
{{- end -}}

{{/* Where the Redis URL comes from: "NAME KEY" (existingSecret, redis.externalUrlSecret, else the chart's),
or nothing for the bundled Redis with a password: then the components compose it from the password's Secret
(kvfleet.credentialsEnv), so no URL with a password is ever rendered. */}}
{{- define "kvfleet.redisUrlRef" -}}
{{- if .Values.existingSecret -}}
{{- printf "%s redis-url" .Values.existingSecret -}}
{{- else if and (not .Values.redis.enabled) .Values.redis.externalUrlSecret.name -}}
{{- printf "%s %s" .Values.redis.externalUrlSecret.name .Values.redis.externalUrlSecret.key -}}
{{- else if not (include "kvfleet.redisAuth" .) -}}
{{- printf "%s redis-url" (include "kvfleet.secretName" .) -}}
{{- end -}}
{{- end -}}

{{/* The bundled Redis's host:port. */}}
{{- define "kvfleet.redisAddress" -}}
{{- printf "%s-redis.%s.svc:6379" (include "kvfleet.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "kvfleet.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s/0" (include "kvfleet.redisAddress" .) -}}
{{- else -}}
{{- required "redis.externalUrl (or redis.externalUrlSecret.name) is required when redis.enabled is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* Environment every component reads: KVFLEET_REDIS_URL and KVFLEET_ADMIN_TOKEN from their Secrets. For the
bundled Redis with a password, the URL is composed by the kubelet from KVFLEET_REDIS_PASSWORD (a Secret ref
defined before it): the pod spec holds $(KVFLEET_REDIS_PASSWORD), never the password. */}}
{{- define "kvfleet.credentialsEnv" -}}
{{- $urlRef := include "kvfleet.redisUrlRef" . -}}
{{- $token := splitList " " (include "kvfleet.adminTokenRef" .) -}}
{{- if $urlRef }}
{{- $redis := splitList " " $urlRef -}}
- name: KVFLEET_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ index $redis 0 }}
      key: {{ index $redis 1 }}
{{- else }}
{{- $password := splitList " " (include "kvfleet.redisPasswordRef" .) -}}
- name: KVFLEET_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ index $password 0 }}
      key: {{ index $password 1 }}
- name: KVFLEET_REDIS_URL
  value: {{ printf "redis://:$(KVFLEET_REDIS_PASSWORD)@%s/0" (include "kvfleet.redisAddress" .) | quote }}
{{- end }}
- name: KVFLEET_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ index $token 0 }}
      key: {{ index $token 1 }}
{{- end -}}

{{/* The CA of an external TLS Redis (redis.tls.caSecret), for the gateway and the operator: a volumeMount and
a volume, each a YAML list item (or nothing). The Redis URL names the file: ?ssl_ca_certs=/etc/kvfleet/redis-tls/ca.crt */}}
{{- define "kvfleet.redisTlsMount" -}}
{{- if .Values.redis.tls.caSecret.name -}}
- name: redis-tls
  mountPath: /etc/kvfleet/redis-tls
  readOnly: true
{{- end -}}
{{- end -}}

{{- define "kvfleet.redisTlsVolume" -}}
{{- with .Values.redis.tls.caSecret -}}
{{- if .name -}}
- name: redis-tls
  secret:
    secretName: {{ .name }}
    items:
      - key: {{ .key }}
        path: ca.crt
{{- end -}}
{{- end -}}
{{- end -}}

{{/* What the operator does where models live (operator-rbac.yaml binds it cluster-wide, or as a Role in
each of operator.watchNamespaces). Every verb, and why: docs/SECURITY.md. Secrets are written (each model's
credentials), never read; Pods only listed. */}}
{{- define "kvfleet.operatorModelRules" -}}
- apiGroups: [kvfleet.io]
  resources: [inferencemodels]
  verbs: [get, list, watch, patch]
- apiGroups: [kvfleet.io]
  resources: [inferencemodels/status]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion need it where OwnerReferencesPermissionEnforcement is on (OpenShift).
- apiGroups: [kvfleet.io]
  resources: [inferencemodels/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps, secrets]
  verbs: [create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch, delete]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch, delete]
{{- end }}
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
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
kvfleet_common.server_kit.tracing reads these; empty when there is no endpoint. */}}
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
