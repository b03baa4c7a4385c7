{{/*
Named templates of the tether chart.

The ones meant for other charts (mode: sidecar) take a context with .Values (this chart's
values, i.e. the parent's .Values.tether) and .Release, and nothing else, so a parent chart
calls them as:

  {{- $tether := dict "Values" .Values.tether "Release" .Release }}
  containers:
    {{- include "tether.sidecar" $tether | nindent 4 }}
  volumes:
    {{- include "tether.volumes" $tether | nindent 4 }}
  terminationGracePeriodSeconds: {{ include "tether.terminationGracePeriodSeconds" $tether }}
  # on the engine container:
  lifecycle:
    {{- include "tether.engineLifecycle" $tether | nindent 4 }}

Inside this chart they get the root context, which has the same two fields.
*/}}

{{- define "tether.name" -}}
{{- default "tether" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name; does not use .Chart, so it is the same from a parent chart. */}}
{{- define "tether.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "tether.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tether.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tether.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Root context only (uses .Chart). */}}
{{- define "tether.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tether.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Name of the Secret the chart creates from adminToken.value / upstreamAdminKey.value. */}}
{{- define "tether.secretName" -}}
{{- printf "%s-secrets" (include "tether.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
One setting as an env var string. Helm reads every YAML number as float64, which would
print 33554432 as 3.3554432e+07: whole numbers are printed as integers. Lists are joined
with commas (TETHER_BLOCKED_PATHS).
*/}}
{{- define "tether.formatValue" -}}
{{- if kindIs "float64" . -}}
{{- if eq . (floor .) -}}{{- int64 . -}}{{- else -}}{{- . -}}{{- end -}}
{{- else if kindIs "slice" . -}}
{{- join "," . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/*
TETHER_* env vars from .Values.config; null, "" and [] are left to tether's default. With
fleet.enabled and the headless Service on, TETHER_FLEET_DNS is that Service's FQDN unless
config.fleetDns names another.
*/}}
{{- define "tether.configEnv" -}}
{{- range $key, $value := .Values.config }}
{{- $unset := or (kindIs "invalid" $value) (and (kindIs "string" $value) (eq $value "")) (and (kindIs "slice" $value) (eq (len $value) 0)) }}
{{- if not $unset }}
- name: {{ printf "TETHER_%s" ($key | snakecase | upper) }}
  value: {{ include "tether.formatValue" $value | quote }}
{{- end }}
{{- end }}
{{- if and .Values.fleet.enabled .Values.fleet.headlessService.enabled (not .Values.config.fleetDns) }}
- name: TETHER_FLEET_DNS
  value: {{ include "tether.fleetDns" . | quote }}
{{- end }}
{{- end -}}

{{/*
The labels of the pods that carry tether, as a YAML map: this chart's pods in deployment
mode, sidecarPodLabels (the parent chart's pods) in sidecar mode. (list ctx "what needs it")
*/}}
{{- define "tether.podSelector" -}}
{{- $ctx := index . 0 -}}
{{- if eq $ctx.Values.mode "deployment" -}}
{{- include "tether.selectorLabels" $ctx -}}
{{- else if $ctx.Values.sidecarPodLabels -}}
{{- toYaml $ctx.Values.sidecarPodLabels -}}
{{- else -}}
{{- fail (printf "sidecarPodLabels is required in sidecar mode for %s: the labels of the pods that carry the tether container" (index . 1)) -}}
{{- end -}}
{{- end -}}

{{/* The fleet's headless Service (admin port of every replica). */}}
{{- define "tether.fleetServiceName" -}}
{{- default (printf "%s-fleet" (include "tether.fullname" . | trunc 57 | trimSuffix "-")) .Values.fleet.headlessService.name -}}
{{- end -}}

{{/* Its FQDN, which resolves to every replica's address (TETHER_FLEET_DNS). */}}
{{- define "tether.fleetDns" -}}
{{- printf "%s.%s.svc.%s" (include "tether.fleetServiceName" .) .Release.Namespace .Values.fleet.clusterDomain -}}
{{- end -}}

{{/* (list ctx "ENV_NAME" spec): env var from existingSecret, or from the chart's Secret. */}}
{{- define "tether.secretEnv" -}}
{{- $ctx := index . 0 -}}
{{- $env := index . 1 -}}
{{- $spec := index . 2 -}}
{{- $name := "" -}}
{{- if $spec.existingSecret -}}
{{- $name = $spec.existingSecret -}}
{{- else if $spec.value -}}
{{- $name = include "tether.secretName" $ctx -}}
{{- end -}}
{{- if $name }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ $spec.key }}
{{- end }}
{{- end -}}

{{/*
terminationGracePeriodSeconds: preStop sleep + shutdown grace + abort deadline + 15 (after the
grace period, cancelled handlers get up to 5 s to hand over their aborts; then 1 s to close
connections; the rest is margin).
*/}}
{{- define "tether.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- $grace := 30 -}}
{{- if not (kindIs "invalid" .Values.config.shutdownGrace) }}{{ $grace = .Values.config.shutdownGrace }}{{ end -}}
{{- $deadline := 5 -}}
{{- if not (kindIs "invalid" .Values.config.abortDeadline) }}{{ $deadline = .Values.config.abortDeadline }}{{ end -}}
{{- add (int .Values.preStopSleepSeconds) (int (ceil $grace)) (int (ceil $deadline)) 15 -}}
{{- else -}}
{{- int .Values.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/* The tether container, as one item of a pod's containers list. */}}
{{- define "tether.sidecar" -}}
{{- if and .Values.fleet.enabled (not (or .Values.adminToken.existingSecret .Values.adminToken.value)) -}}
{{- fail "fleet.enabled needs adminToken (existingSecret or value): the replicas call each other's POST /admin/abort with it" -}}
{{- end -}}
{{- if and (eq (toString .Values.config.requestIdMode) "preserve") (ne (toString .Values.config.workers) "1") -}}
{{- fail "config.requestIdMode=preserve needs config.workers=1: its check that an ID is not already in flight sees one worker's requests only" -}}
{{- end -}}
{{- $env := include "tether.configEnv" . | trim -}}
{{- $secrets := printf "%s\n%s" (include "tether.secretEnv" (list . "TETHER_ADMIN_TOKEN" .Values.adminToken)) (include "tether.secretEnv" (list . "TETHER_UPSTREAM_ADMIN_KEY" .Values.upstreamAdminKey)) | trim -}}
- name: tether
  image: {{ printf "%s:%s" .Values.image.repository (toString .Values.image.tag) | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  ports:
    - name: tether-http
      containerPort: {{ int .Values.config.port }}
      protocol: TCP
    - name: tether-admin
      containerPort: {{ int .Values.config.adminPort }}
      protocol: TCP
  env:
    {{- $env | nindent 4 }}
    {{- with $secrets }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: tether-admin
    {{- with .Values.livenessProbe }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  readinessProbe:
    httpGet:
      path: /readyz
      port: tether-admin
    {{- with .Values.readinessProbe }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if gt (int .Values.preStopSleepSeconds) 0 }}
  lifecycle:
    preStop:
      exec:
        command:
          - sleep
          - {{ int .Values.preStopSleepSeconds | quote }}
  {{- end }}
  {{- with .Values.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: tether-tmp
      mountPath: /tmp
{{- end -}}

{{/* The volumes tether.sidecar mounts, as items of a pod's volumes list. */}}
{{- define "tether.volumes" -}}
- name: tether-tmp
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end -}}

{{/*
lifecycle for the ENGINE container: its preStop waits until tether has exited (its admin
port stops answering), bounded by the grace period, so the engine keeps serving while
tether drains and still receives tether's final aborts. Needs python3 in the engine image.
*/}}
{{- define "tether.engineLifecycle" -}}
{{- $budget := sub (int (include "tether.terminationGracePeriodSeconds" .)) 2 -}}
preStop:
  exec:
    command:
      - python3
      - -c
      - |
        import time, urllib.error, urllib.request
        deadline = time.monotonic() + {{ $budget }}
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen("http://127.0.0.1:{{ int .Values.config.adminPort }}/healthz", timeout=1)
            except urllib.error.HTTPError:
                pass
            except Exception:
                break
            time.sleep(1)
{{- end -}}

{{/* python3 exec command probing the engine's health path on loopback. */}}
{{- define "tether.engineProbeCommand" -}}
{{- $ctx := index . 0 -}}
{{- $timeout := index . 1 -}}
- python3
- -c
- {{ printf "import urllib.request as u; u.urlopen('%s%s', timeout=%d)" (trimSuffix "/" $ctx.Values.config.upstreamUrl) $ctx.Values.config.upstreamHealthPath (int (max 1 (sub (int $timeout) 1))) | quote }}
{{- end -}}
