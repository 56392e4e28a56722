{{- define "tessera.labels" -}}
app.kubernetes.io/part-of: tessera
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* tessera.repository: an image repository with global.imageRegistry, when set, in place of its registry (the first path element when it names a host: has a dot or a port, or is localhost), else before it. Call with (list "ghcr.io/x/y" $). */}}
{{- define "tessera.repository" -}}
{{- $repo := index . 0 -}}
{{- $registry := (index . 1).Values.global.imageRegistry | trimSuffix "/" -}}
{{- if $registry -}}
{{- $parts := splitn "/" 2 $repo -}}
{{- if and $parts._1 (or (contains "." $parts._0) (contains ":" $parts._0) (eq $parts._0 "localhost")) -}}
{{ $registry }}/{{ $parts._1 }}
{{- else -}}
{{ $registry }}/{{ $repo }}
{{- end -}}
{{- else -}}
{{ $repo }}
{{- end -}}
{{- end }}

{{/* tessera.pullPolicy: a component's image pullPolicy, else image.pullPolicy. Call with (list .Values.image.node $). */}}
{{- define "tessera.pullPolicy" -}}
{{ (index . 0).pullPolicy | default (index . 1).Values.image.pullPolicy }}
{{- end }}

{{/* tessera.image: repository@digest, or repository:tag with the chart's appVersion as the default tag. Call with (list .Values.image.node $). */}}
{{- define "tessera.image" -}}
{{- $img := index . 0 -}}
{{- $root := index . 1 -}}
{{- $repo := include "tessera.repository" (list $img.repository $root) -}}
{{- if $img.digest -}}
{{ $repo }}@{{ $img.digest }}
{{- else -}}
{{ $repo }}:{{ $img.tag | default $root.Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/* tessera.schedulerImage: kube-scheduler of the cluster's own version unless a tag is set (a kube-scheduler must not be newer than its API server). */}}
{{- define "tessera.schedulerImage" -}}
{{ include "tessera.repository" (list .Values.image.scheduler.repository $) }}:{{ .Values.image.scheduler.tag | default (regexReplaceAll "[-+].*$" .Capabilities.KubeVersion.Version "") }}
{{- end }}


{{/* tessera.fullname: the prefix of every resource name: fullnameOverride, else the release name when it contains the chart's name (release "tessera": tessera-node, tessera-extender), else <release>-<chart>. At most 45 characters, so that the longest suffix keeps names within 63. */}}
{{- define "tessera.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{ .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else if contains .Chart.Name .Release.Name -}}
{{ .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else -}}
{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 45 | trimSuffix "-" }}
{{- end -}}
{{- end }}

{{/* tessera.selector: the labels a component's pods are selected by; call with (list $ "extender"). */}}
{{- define "tessera.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: tessera-{{ index . 1 }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- end }}

{{/* tessera.apiServerEnv: KUBERNETES_SERVICE_HOST/PORT when apiServer is set (clusters without kube-proxy). */}}
{{- define "tessera.apiServerEnv" -}}
{{- if .Values.apiServer.host }}
- {name: KUBERNETES_SERVICE_HOST, value: {{ .Values.apiServer.host | quote }}}
- {name: KUBERNETES_SERVICE_PORT, value: {{ .Values.apiServer.port | default "443" | quote }}}
{{- end }}
{{- end }}

{{/* tessera.probeHost: a probe's host field when the component listens on one address only (with hostNetwork the kubelet would probe the node's IP). Call with the listen host. */}}
{{- define "tessera.probeHost" -}}
{{- if and . (ne . "0.0.0.0") (ne . "::") }}
host: {{ . }}
{{- end }}
{{- end }}

{{/* tessera.schedulerName: the scheduler profile the chart configures with the extender (scheduler.name in mode second, the default scheduler's otherwise); the extender binds only its pods. */}}
{{- define "tessera.schedulerName" -}}
{{ if eq .Values.scheduler.mode "second" }}{{ .Values.scheduler.name }}{{ else }}default-scheduler{{ end }}
{{- end }}

{{/* tessera.extraArgs: a component's log flags (tessera-node and tessera-extender read -v and --log-format) and its extraArgs, as container args; call with the component's values. */}}
{{- define "tessera.logAndExtraArgs" -}}
- --v={{ .log.level }}
- --log-format={{ .log.format }}
{{- range .extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
