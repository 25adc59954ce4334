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

{{/* KVFLEET_REPLICA_KEY_ROOT from its Secret, as a YAML list item. */}}
{{- define "kvfleet.replicaKeyRootEnv" -}}
{{- $ref := splitList " " (include "kvfleet.replicaKeyRootRef" .) -}}
- name: KVFLEET_REPLICA_KEY_ROOT
  valueFrom:
    secretKeyRef:
      name: {{ index $ref 0 }}
      key: {{ index $ref 1 }}
{{- end -}}
