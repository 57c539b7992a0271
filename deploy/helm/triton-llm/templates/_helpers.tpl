{{/* Chart name, truncated to 63 characters. */}}
{{- define "triton-llm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; a role's objects are "<fullname>-<role>". */}}
{{- define "triton-llm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<role>"; call with (dict "root" $ "role" "llm"). */}}
{{- define "triton-llm.roleName" -}}
{{- printf "%s-%s" (include "triton-llm.fullname" .root) .role | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "triton-llm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object; with a role (dict "root" $ "role" "llm") also its component. */}}
{{- define "triton-llm.labels" -}}
{{- $root := .root | default . -}}
helm.sh/chart: {{ include "triton-llm.chart" $root }}
app.kubernetes.io/name: {{ include "triton-llm.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- with .role }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{/* Selector labels; with a role, only that role's pods. */}}
{{- define "triton-llm.selectorLabels" -}}
{{- $root := .root | default . -}}
app.kubernetes.io/name: {{ include "triton-llm.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- with .role }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{- define "triton-llm.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "triton-llm.adminSecretName" -}}
{{- default (printf "%s-admin" (include "triton-llm.fullname" .)) .Values.adminKey.existingSecret }}
{{- end }}

{{/* Longer than the longest generation: preStop wait + Triton's exit timeout + a margin. */}}
{{- define "triton-llm.terminationGracePeriodSeconds" -}}
{{- $d := .Values.drain }}
{{- add $d.preStopSeconds $d.longestGenerationSeconds $d.marginSeconds }}
{{- end }}

{{/* PromQL label matchers for this release's pods (any role, or one with .role). */}}
{{- define "triton-llm.podMatchers" -}}
{{- $root := .root | default . -}}
{{- $prefix := include "triton-llm.fullname" $root }}
{{- if .role -}}
namespace="{{ $root.Release.Namespace }}",pod=~"{{ $prefix }}-{{ .role }}-.*"
{{- else -}}
namespace="{{ $root.Release.Namespace }}",pod=~"{{ $prefix }}-.*"
{{- end }}
{{- end }}

{{/* Whether a role's replica count is owned by an autoscaler. */}}
{{- define "triton-llm.autoscaled" -}}
{{- if and .root.Values.autoscaling.enabled (hasKey .root.Values.autoscaling .role) }}true{{ end }}
{{- end }}

{{/* Caches on the writable emptyDir (the root filesystem is read-only). */}}
{{- define "triton-llm.cacheEnv" -}}
- {name: HOME, value: /tmp}
- {name: XDG_CACHE_HOME, value: /cache}
- {name: HF_HOME, value: /cache/huggingface}
- {name: TRITON_CACHE_DIR, value: /cache/triton}
- {name: TORCHINDUCTOR_CACHE_DIR, value: /cache/torchinductor}
- {name: MPLCONFIGDIR, value: /cache/matplotlib}
{{- end }}

{{- define "triton-llm.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: cache, mountPath: /cache}
- {name: dshm, mountPath: /dev/shm}
{{- if eq .Values.modelRepository.source "pvc" }}
- name: model-repository
  mountPath: {{ .Values.modelRepository.path }}
  readOnly: true
  {{- with .Values.modelRepository.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/* HPA behavior: fast scale-up, slow one-pod-at-a-time scale-down (running streams drain). */}}
{{- define "triton-llm.hpaBehavior" -}}
{{- $b := .Values.autoscaling.behavior }}
scaleUp:
  stabilizationWindowSeconds: {{ $b.scaleUp.stabilizationWindowSeconds }}
  selectPolicy: Max
  policies:
    - {type: Pods, value: {{ $b.scaleUp.podsPerPeriod }}, periodSeconds: {{ $b.scaleUp.periodSeconds }}}
scaleDown:
  stabilizationWindowSeconds: {{ $b.scaleDown.stabilizationWindowSeconds }}
  selectPolicy: Min
  policies:
    - {type: Pods, value: {{ $b.scaleDown.podsPerPeriod }}, periodSeconds: {{ $b.scaleDown.periodSeconds }}}
{{- end }}

{{/* The encoders' mean queue time over the rate window; `matchers` are PromQL label matchers. */}}
{{- define "triton-llm.encoderQueueMean" -}}
sum(rate(encoder_queue_seconds_sum{ {{- .matchers -}} }[{{ .window }}])) / clamp_min(sum(rate(encoder_queue_seconds_count{ {{- .matchers -}} }[{{ .window }}])), 1e-9)
{{- end }}
