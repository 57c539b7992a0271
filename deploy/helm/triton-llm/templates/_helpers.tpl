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

{{/* Whether the llm role runs as a LeaderWorkerSet (roles.llm.multiNode.enabled). */}}
{{- define "triton-llm.multiNode" -}}
{{- if and .Values.roles.llm.enabled (dig "multiNode" "enabled" false .Values.roles.llm) }}true{{ end }}
{{- end }}

{{/* The LeaderWorkerSet's name: not the client Service's, since LWS creates a headless Service of
its own name for the pods' DNS; short enough for the worker pods' "<name>-<group>-<worker>". */}}
{{- define "triton-llm.lwsName" -}}
{{- printf "%s-group" (include "triton-llm.roleName" (dict "root" . "role" "llm")) | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/* The multi-node model repository: a sibling of modelRepository.path (same depth, so relative
checkpoint paths in config.pbtxt resolve to the same place). */}}
{{- define "triton-llm.multiNodeRepository" -}}
{{- printf "%s-multinode" (.Values.modelRepository.path | trimSuffix "/") }}
{{- end }}

{{/* The multi-node pods' init container: the repository copy with the multi-node parameters. */}}
{{- define "triton-llm.multiNodeInit" -}}
{{- $root := .root -}}
- name: prepare-repository
  image: {{ include "triton-llm.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command:
    - python3
    - /etc/triton-llm-multinode/prepare_multinode_repository.py
    - {{ $root.Values.modelRepository.path }}
    - {{ include "triton-llm.multiNodeRepository" $root }}
    - {{ .model }}
    - /etc/triton-llm-multinode/parameters.json
  resources:
    requests: {cpu: 100m, memory: 64Mi}
    limits: {memory: 256Mi}
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    {{- include "triton-llm.volumeMounts" $root | nindent 4 }}
    - {name: multinode-repository, mountPath: {{ include "triton-llm.multiNodeRepository" $root }}}
    - {name: multinode-config, mountPath: /etc/triton-llm-multinode, readOnly: true}
{{- end }}

{{/* The engine's rendezvous, from the variables LWS adds to every container of a group (first
in the list, so $(...) expands them): the leader's address, this pod's index (leader 0). */}}
{{- define "triton-llm.multiNodeEnv" -}}
- {name: MASTER_ADDR, value: $(LWS_LEADER_ADDRESS)}
- {name: MASTER_PORT, value: {{ .Values.roles.llm.multiNode.masterPort | int | toString | quote }}}
- {name: NODE_RANK, value: $(LWS_WORKER_INDEX)}
{{- end }}

{{- define "triton-llm.multiNodeVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
- name: dshm  # the Python backend talks to its stubs through shared memory
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.roles.llm.shmSizeLimit }}
{{- if eq .Values.modelRepository.source "pvc" }}
- name: model-repository
  persistentVolumeClaim:
    claimName: {{ required "modelRepository.pvc.claimName is required when modelRepository.source=pvc" .Values.modelRepository.pvc.claimName }}
    readOnly: true
{{- end }}
- name: multinode-repository
  emptyDir: {}
- name: multinode-config
  configMap:
    name: {{ include "triton-llm.lwsName" . }}
{{- end }}

{{- define "triton-llm.multiNodeScheduling" -}}
{{- $cfg := .Values.roles.llm }}
{{- with $cfg.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $cfg.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $cfg.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The endpoint picker's Deployment and Service (endpointpicker.yaml). */}}
{{- define "triton-llm.endpointPickerName" -}}
{{- include "triton-llm.roleName" (dict "root" . "role" "epp") }}
{{- end }}

{{/* Whether this release renders llm-d's endpoint picker (the llm pods then publish KV events to it). */}}
{{- define "triton-llm.endpointPicker" -}}
{{- $x := .Values.gateway.inferenceExtension }}
{{- if and $x.enabled $x.endpointPicker.enabled }}true{{ end }}
{{- end }}

{{/* An llm pod's variables for its kv_events_config: its own IP (the topic) and the endpoint
picker's KV-events address. */}}
{{- define "triton-llm.kvEventsEnv" -}}
{{- if include "triton-llm.endpointPicker" . }}
- name: POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
- name: KV_EVENTS_ENDPOINT
  value: {{ printf "tcp://%s.%s.svc:%v" (include "triton-llm.endpointPickerName" .) .Release.Namespace .Values.gateway.inferenceExtension.endpointPicker.zmqPort | quote }}
{{- end }}
{{- end }}
