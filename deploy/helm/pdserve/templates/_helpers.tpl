{{/*
Names, labels and the pieces every pdserve pod shares. The prefill and decode pools are rendered by ONE
named template ("pdserve.pool", _pool.tpl) called with the role, so the two pools are mirror images
that differ only in their values block.
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/* Full name, truncated to 50 so "<fullname>-prefill-xxxxxxxxxx-xxxxx" stays a valid pod name. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "decode"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Label selector of one pool's EndpointSlices (what the router's k8s discovery lists/watches): the
label Kubernetes itself puts on every EndpointSlice of the pool's headless Service. */}}
{{- define "pdserve.selectorString" -}}
{{- printf "kubernetes.io/service-name=%s-%s" (include "pdserve.fullname" .root) .component }}
{{- end }}

{{/* Metadata labels of one component. */}}
{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ include "pdserve.chart" .root }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Instance-wide pod selector (every pod of the release, any component). */}}
{{- define "pdserve.instanceSelector" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) }}
{{- if eq $tag "latest" }}{{ fail "image.tag must not be \"latest\": pin a version" }}{{ end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "pdserve.routerServiceAccount" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (printf "%s-router" (include "pdserve.fullname" .)) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Directory holding config.json inside the container. */}}
{{- define "pdserve.modelDir" -}}
{{- $sub := .Values.model.subPath }}
{{- if and (eq .Values.model.source "init") (not $sub) }}{{ $sub = .Values.model.init.preset }}{{ end }}
{{- if $sub }}{{ printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) $sub }}{{ else }}{{ .Values.model.mountPath }}{{ end }}
{{- end }}

{{/* The model volume. */}}
{{- define "pdserve.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source=hostPath" .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.init.sizeLimit }}
{{- end }}
{{- end }}

{{- define "pdserve.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}

{{/* Init container writing the random preset checkpoint (model.source=init only). */}}
{{- define "pdserve.modelInitContainer" -}}
{{- if eq .Values.model.source "init" }}
- name: model-init
  image: {{ include "pdserve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - model
    - init
    - --preset
    - {{ .Values.model.init.preset | quote }}
    - --out
    - {{ include "pdserve.modelDir" . | quote }}
    - --seed
    - {{ .Values.model.init.seed | quote }}
    {{- range .Values.model.init.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: HOME
      value: /tmp
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .Values.model.init.resources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* Env shared by every role: bind/advertise addresses, identity, metrics, model, drain. */}}
{{- define "pdserve.commonEnv" -}}
- name: PDSERVE_MODEL
  value: {{ include "pdserve.modelDir" . | quote }}
- name: PDSERVE_HOST
  value: "0.0.0.0"
- name: PDSERVE_PORT
  value: {{ .Values.ports.grpc | quote }}
- name: PDSERVE_METRICS_PORT
  value: {{ ternary .Values.metrics.port 0 .Values.metrics.enabled | quote }}
- name: PDSERVE_ADVERTISE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: PDSERVE_WORKER_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: PDSERVE_DRAIN_TIMEOUT
  value: {{ .Values.drain.timeoutSeconds | quote }}
- name: HOME
  value: /tmp
{{- end }}

{{/* Redis password + URL env (the URL embeds $(PDSERVE_REDIS_PASSWORD), expanded by the kubelet). */}}
{{- define "pdserve.redisEnv" -}}
{{- $r := .Values.redis }}
{{- if ne $r.mode "none" }}
{{- $secret := include "pdserve.redisSecretName" . }}
{{- if $secret }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $r.auth.secretKey }}
{{- end }}
- name: PDSERVE_REDIS
{{- if eq $r.mode "bundled" }}
  {{- $host := include "pdserve.serviceHost" (dict "root" . "service" (printf "%s-redis" (include "pdserve.fullname" .))) }}
  value: {{ printf "redis://:$(PDSERVE_REDIS_PASSWORD)@%s:6379/0" $host | quote }}
{{- else }}
{{- $u := urlParse (required "redis.external.url is required when redis.mode=external" $r.external.url) }}
{{- if $secret }}
  value: {{ printf "%s://:$(PDSERVE_REDIS_PASSWORD)@%s%s" $u.scheme $u.host $u.path | quote }}
{{- else }}
  value: {{ $r.external.url | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of the Secret holding the Redis password ("" = no password, external mode only). */}}
{{- define "pdserve.redisSecretName" -}}
{{- $r := .Values.redis }}
{{- if $r.auth.existingSecret }}
{{- $r.auth.existingSecret }}
{{- else if or (eq $r.mode "bundled") $r.auth.password }}
{{- printf "%s-redis" (include "pdserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* gRPC health probes; readiness checks the role's own service. Native gRPC probes, or with tls.enabled
the image's pdserve-healthcheck over TLS with the pod's own certificate (the kubelet's gRPC probes speak
plaintext only), so readiness still reads the role's serving status. Where the kubelet has no gRPC probes
(Kubernetes < 1.24, _cluster.tpl) the same plaintext check runs as pdserve-healthcheck.
(dict "root" $ "role" "decode" "service" "pdserve.v1.Decode") */}}
{{- define "pdserve.probes" -}}
{{- $p := .root.Values.probes }}
{{- $root := .root }}
{{- $role := .role }}
{{- range $kind := list "startup" "liveness" "readiness" }}
{{- $service := ternary $.service "" (eq $kind "readiness") }}
{{- $k := index $p $kind }}
{{ $kind }}Probe:
  {{- if $root.Values.tls.enabled }}
  exec:
    command: ["pdserve-healthcheck", "--port", {{ $root.Values.ports.grpc | quote }}, "--service", {{ $service | quote }}, "--timeout", {{ $k.timeoutSeconds | quote }}, "--tls-dir", {{ $root.Values.tls.mountPath | quote }}, "--tls-name", {{ $role | quote }}]
  {{- else if not (include "pdserve.grpcProbes" $root) }}
  exec:
    command: ["pdserve-healthcheck", "--port", {{ $root.Values.ports.grpc | quote }}, "--service", {{ $service | quote }}, "--timeout", {{ $k.timeoutSeconds | quote }}]
  {{- else }}
  grpc:
    port: {{ $root.Values.ports.grpc }}
    service: {{ $service | quote }}
  {{- end }}
  periodSeconds: {{ $k.periodSeconds }}
  failureThreshold: {{ $k.failureThreshold }}
  timeoutSeconds: {{ $k.timeoutSeconds }}
{{- end }}
{{- end }}

{{/* The Secret holding a role's certificates: (dict "root" $ "role" "decode"). */}}
{{- define "pdserve.tlsSecretName" -}}
{{- (index .root.Values.tls.secrets .role) | default (printf "%s-%s-tls" (include "pdserve.fullname" .root) .role) }}
{{- end }}

{{/* PDSERVE_TLS_DIR when TLS is on (the KV plane reads the same directory through settings.tls_dir). */}}
{{- define "pdserve.tlsEnv" -}}
{{- if .Values.tls.enabled }}
- name: PDSERVE_TLS_DIR
  value: {{ .Values.tls.mountPath | quote }}
{{- end }}
{{- end }}

{{- define "pdserve.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* A role's kubernetes.io/tls Secret laid out as `pdserve certs init` writes it: ca.crt, <role>.crt,
<role>.key (a directory mount, so cert-manager's renewals reach the files). (dict "root" $ "role" r) */}}
{{- define "pdserve.tlsVolume" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "pdserve.tlsSecretName" . }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: {{ printf "%s.crt" .role }}}
      - {key: tls.key, path: {{ printf "%s.key" .role }}}
{{- end }}
{{- end }}

{{/* preStop sleep + grace period check (drain must fit inside the grace period). */}}
{{- define "pdserve.lifecycle" -}}
{{- $d := .Values.drain }}
{{- if le (int $d.terminationGracePeriodSeconds) (add $d.preStopSleepSeconds $d.timeoutSeconds | int) }}
{{- fail (printf "drain.terminationGracePeriodSeconds (%v) must be greater than drain.preStopSleepSeconds + drain.timeoutSeconds (%v)" $d.terminationGracePeriodSeconds (add $d.preStopSleepSeconds $d.timeoutSeconds)) }}
{{- end }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ $d.preStopSleepSeconds | quote }}]
{{- end }}

{{/* Checks across values that the JSON schema cannot express. */}}
{{- define "pdserve.validate" -}}
{{- if and (gt (int .Values.router.replicas) 1) (eq .Values.redis.mode "none") }}
{{- fail "router.replicas > 1 needs shared state: set redis.mode to bundled or external" }}
{{- end }}
{{- if and .Values.router.autoscaling.enabled (eq .Values.redis.mode "none") }}
{{- fail "router.autoscaling needs shared state: set redis.mode to bundled or external" }}
{{- end }}
{{- if and (eq .Values.router.discovery "redis") (eq .Values.redis.mode "none") }}
{{- fail "router.discovery=redis needs redis.mode bundled or external" }}
{{- end }}
{{- if and (eq .Values.redis.mode "bundled") (not .Values.redis.auth.existingSecret) (not .Values.redis.auth.password) }}
{{- fail "redis.mode=bundled needs a password: set redis.auth.existingSecret (recommended) or redis.auth.password" }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $.Values $role }}
{{- if and (not (kindIs "invalid" $pool.numBlocks)) (not (kindIs "invalid" $pool.kvMemoryGb)) }}
{{- fail (printf "%s: give numBlocks or kvMemoryGb, not both" $role) }}
{{- end }}
{{- end }}
{{- end }}
