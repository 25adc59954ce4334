{{/* The replica key root (docs/SECURITY.md): only the gateway and the operator get it. */}}

{{/* Where it comes from: "NAME KEY" (existingSecret, replicaKeyRootSecret, else the chart's). */}}
{{- define "kvfleet.replicaKeyRootRef" -}}
{{- if .Values.existingSecret -}}
{{- printf "%s replica-key-root" .Values.existingSecret -}}
{{- else if .Values.replicaKeyRootSecret.name -}}
{{- printf "%s %s" .Values.replicaKeyRootSecret.name .Values.replicaKeyRootSecret.key -}}
{{- else -}}
{{- printf "%s replica-key-root" (include "kvfleet.secretName" .) -}}
{{- end -}}
{{- end -}}

{{/* KVFLEET_REPLICA_KEY_ROOT from its Secret, as YAML list items. The reference is optional so that a Secret
without the key (an existingSecret made before the key existed) starts the component, which then stops at once
with a message naming the Secret and the key (KVFLEET_REPLICA_KEY_ROOT_SOURCE says where the root comes from
and makes it required), instead of a CreateContainerConfigError seen only in the pod's events. */}}
{{- define "kvfleet.replicaKeyRootEnv" -}}
{{- $ref := splitList " " (include "kvfleet.replicaKeyRootRef" .) -}}
{{- $option := ternary "existingSecret" (ternary "replicaKeyRootSecret" "the chart" (not (empty .Values.replicaKeyRootSecret.name))) (not (empty .Values.existingSecret)) -}}
- name: KVFLEET_REPLICA_KEY_ROOT
  valueFrom:
    secretKeyRef:
      name: {{ index $ref 0 }}
      key: {{ index $ref 1 }}
      optional: true
- name: KVFLEET_REPLICA_KEY_ROOT_SOURCE
  value: {{ printf "Secret %s, key %s, named by %s" (index $ref 0) (index $ref 1) $option | quote }}
{{- end -}}
