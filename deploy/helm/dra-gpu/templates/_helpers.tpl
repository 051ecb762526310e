{{/* Names and labels shared by the templates. */}}

{{- define "dra-gpu.name" -}}
{{- default "dra-gpu" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dra-gpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "dra-gpu.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dra-gpu.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "dra-gpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "dra-gpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dra-gpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The image: image.repository as given, or the release's registry/name pinned by digest; the
simulator's image when simulatedProfile is set. No default registry: a name that exists only on
the machine that built it would fail on every node. */}}
{{- define "dra-gpu.image" -}}
{{- $img := .Values.image -}}
{{- $tag := $img.tag | default .Chart.AppVersion -}}
{{- $simulated := ne (toString .Values.simulatedProfile) "" -}}
{{- if $img.repository -}}
{{ $img.repository }}:{{ $tag }}
{{- else if $img.registry -}}
{{- $name := ternary $img.simulatorName $img.name $simulated -}}
{{- $digest := ternary $img.simulatorDigest $img.digest $simulated -}}
{{ trimSuffix "/" $img.registry }}/{{ $name }}:{{ $tag }}{{ if $digest }}@{{ $digest }}{{ end }}
{{- else -}}
{{- fail "image.registry is not set: set it to the registry that holds the release's images (--set image.registry=HOST[:PORT][/PATH]; a chart installed from a release has it), or set image.repository to a full image name" -}}
{{- end -}}
{{- end -}}

{{- define "dra-gpu.pluginName" -}}
{{ include "dra-gpu.fullname" . | trunc 48 | trimSuffix "-" }}-kubelet-plugin
{{- end -}}

{{- define "dra-gpu.controllerName" -}}
{{ include "dra-gpu.fullname" . | trunc 52 | trimSuffix "-" }}-controller
{{- end -}}

{{/* The plugin's and the controller's service account user names, as the apiserver sees them. */}}
{{- define "dra-gpu.pluginUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "dra-gpu.pluginName" . }}
{{- end -}}

{{/* The containers' `-v=N`: verbosity (0..10, as klog's -v); the deprecated `verbose: true` is
at least 4 (debug), the bare `-v` it used to pass. */}}
{{- define "dra-gpu.verbosity" -}}
{{- $v := int (.Values.verbosity | default 0) -}}
{{- if and .Values.verbose (lt $v 4) -}}{{- $v = 4 -}}{{- end -}}
{{- $v -}}
{{- end -}}

{{/* The driver name: gpu.nvidia.com in NVIDIA-compatible mode, else driverName. */}}
{{- define "dra-gpu.driverName" -}}
{{- if .Values.nvidiaCompatible -}}
{{- if not (has .Values.driverName (list "gpu.dra-gpu.io" "gpu.nvidia.com")) -}}
{{- fail (printf "nvidiaCompatible: true runs the driver as gpu.nvidia.com; driverName %q contradicts it: unset one of them" .Values.driverName) -}}
{{- end -}}
gpu.nvidia.com
{{- else -}}
{{ .Values.driverName }}
{{- end -}}
{{- end -}}

{{/* mig.<domain>: gpu.dra-gpu.io -> mig.dra-gpu.io; any other driver name d -> mig.d */}}
{{- define "dra-gpu.migClassName" -}}
{{- $d := include "dra-gpu.driverName" . -}}
{{- if hasPrefix "gpu." $d -}}
mig.{{ trimPrefix "gpu." $d }}
{{- else -}}
mig.{{ $d }}
{{- end -}}
{{- end -}}

{{- define "dra-gpu.webhookSecretName" -}}
{{- if .Values.controller.tls.existingSecret -}}
{{ .Values.controller.tls.existingSecret }}
{{- else -}}
{{ include "dra-gpu.controllerName" . }}-tls
{{- end -}}
{{- end -}}
