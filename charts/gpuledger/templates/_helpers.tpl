{{- define "gpuledger.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "gpuledger.labels" -}}
app.kubernetes.io/name: gpuledger
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "gpuledger.selector" -}}
app.kubernetes.io/name: gpuledger
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
