{{- define "tessera.labels" -}}
app.kubernetes.io/part-of: tessera
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* tessera.image: repository@digest, or repository:tag with the chart's appVersion as the default tag. Call with (list .Values.image.node $). */}}
{{- define "tessera.image" -}}
{{- $img := index . 0 -}}
{{- $root := index . 1 -}}
{{- if $img.digest -}}
{{ $img.repository }}@{{ $img.digest }}
{{- else -}}
{{ $img.repository }}:{{ $img.tag | default $root.Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/* tessera.schedulerImage: kube-scheduler of the cluster's own version unless a tag is set (a kube-scheduler must not be newer than its API server). */}}
{{- define "tessera.schedulerImage" -}}
{{ .Values.image.scheduler.repository }}:{{ .Values.image.scheduler.tag | default (regexReplaceAll "[-+].*$" .Capabilities.KubeVersion.Version "") }}
{{- end }}

