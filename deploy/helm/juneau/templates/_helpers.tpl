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
