{{- define "juneau.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
{{- define "juneau.pullPolicy" -}}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end -}}

{{- /* KUBERNETES_SERVICE_HOST/PORT for every container when apiServer.host is set: the
API server's real address, for clusters where the `kubernetes` Service's ClusterIP is not
reachable from the node components (no kube-proxy, or kube-proxy replaced). */ -}}
{{- define "juneau.apiServerEnv" -}}
- name: KUBERNETES_SERVICE_HOST
  value: {{ .Values.apiServer.host | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .Values.apiServer.port | default 443 | quote }}
{{- end -}}

{{- /* The host part of a node process's --metrics-addr (values.yaml, metrics.listenOn):
the node's own address (HOST_IP, from the Pod's status.hostIP: env below), or every
address of the host. */ -}}
{{- define "juneau.nodeMetricsHost" -}}
{{- if eq .Values.metrics.listenOn "node" -}}
$(HOST_IP)
{{- else if eq .Values.metrics.listenOn "all" -}}
0.0.0.0
{{- else -}}
{{- fail (printf "metrics.listenOn must be node or all, not %q" .Values.metrics.listenOn) -}}
{{- end -}}
{{- end -}}
{{- define "juneau.hostIPEnv" -}}
- name: HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
{{- end -}}
