{{/*
One worker pool (prefill or decode): Deployment, headless Service, PodDisruptionBudget, optional HPA
(never with planner.enabled: the planner sizes the pools through their scale subresource instead).
Called as (dict "root" $ "role" "prefill"|"decode"). Everything pool-specific comes from
.Values.<role>; everything shared comes from the top-level values. The pod template reads only its own
pool's values and shared values, so changing one pool's replicas or resources re-renders only that
pool's objects: `helm upgrade --set decode.replicas=4` never restarts prefill pods.
*/}}
{{- define "pdserve.pool" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $pool := index $root.Values $role }}
{{- $v := $root.Values }}
{{- $ctx := dict "root" $root "component" $role }}
{{- $name := printf "%s-%s" (include "pdserve.fullname" $root) $role }}
{{- $service := printf "pdserve.v1.%s" (title $role) }}
{{- $t := $v.kvTransport }}
{{- $rdma := and (eq $t.type "nixl") $t.rdma.enabled (not $t.simulatedRdma) }}
{{- $tp := include "pdserve.poolTP" (dict "root" $root "role" $role) | int }}
{{- $sourceTP := include "pdserve.kvSourceTP" $root | int }}
{{- $gpus := and (gt $tp 1) (ne $v.engine.device "cpu") }}
{{- $tiers := $pool.kvTiers }}
{{- $hostTier := not (kindIs "invalid" $tiers.hostGb) }}
{{- if and (gt $tp 1) (or $tiers.disk.enabled (and $hostTier (gt (float64 $tiers.hostGb) 0.0))) }}
{{- fail (printf "%s.kvTiers: KV tiers do not support tensor parallelism yet (%s.tensorParallelSize is %d); set hostGb to null or 0 and disk.enabled to false" $role $role $tp) }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  {{- /* an HPA or the planner (planner.yaml) owns the replicas: a helm upgrade must not reset them */}}
  {{- if not (or $pool.autoscaling.enabled $v.planner.enabled) }}
  replicas: {{ $pool.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 0
      maxSurge: 1
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.selectorLabels" $ctx | nindent 8 }}
        {{- with $pool.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $pool.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      terminationGracePeriodSeconds: {{ $v.drain.terminationGracePeriodSeconds }}
      automountServiceAccountToken: false
      enableServiceLinks: {{ eq $v.serviceAddresses "env" }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "pdserve.modelInitContainer" $root | trim) }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          args: ["serve", "--role", {{ $role | quote }}]
          env:
            {{- include "pdserve.commonEnv" $root | trim | nindent 12 }}
            - name: PDSERVE_DTYPE
              value: {{ $v.engine.dtype | quote }}
            - name: PDSERVE_DEVICE
              value: {{ $v.engine.device | quote }}
            - name: PDSERVE_BLOCK_SIZE
              value: {{ $v.engine.blockSize | quote }}
            - name: PDSERVE_MAX_NUM_SEQS
              value: {{ $pool.maxNumSeqs | quote }}
            {{- if gt $tp 1 }}
            - name: PDSERVE_TENSOR_PARALLEL_SIZE
              value: {{ $tp | quote }}
            {{- end }}
            {{- if and (eq $role "decode") (gt $sourceTP $tp) }}
            - name: PDSERVE_KV_SOURCE_TP
              value: {{ $sourceTP | quote }}
            {{- end }}
            {{- if not (kindIs "invalid" $pool.maxNumBatchedTokens) }}
            - name: PDSERVE_MAX_NUM_BATCHED_TOKENS
              value: {{ $pool.maxNumBatchedTokens | quote }}
            {{- end }}
            {{- if not (kindIs "invalid" $pool.numBlocks) }}
            - name: PDSERVE_NUM_BLOCKS
              value: {{ $pool.numBlocks | quote }}
            {{- end }}
            {{- if not (kindIs "invalid" $pool.kvMemoryGb) }}
            - name: PDSERVE_KV_MEMORY_GB
              value: {{ $pool.kvMemoryGb | quote }}
            {{- end }}
            {{- if $hostTier }}
            - name: PDSERVE_KV_HOST_GB
              value: {{ $tiers.hostGb | quote }}
            {{- end }}
            {{- if $tiers.disk.enabled }}
            - name: PDSERVE_KV_DISK_DIR
              value: {{ $tiers.disk.mountPath | quote }}
            - name: PDSERVE_KV_DISK_GB
              value: {{ $tiers.disk.sizeGb | quote }}
            {{- end }}
            - name: PDSERVE_TRANSPORT
              value: {{ $t.type | quote }}
            - name: PDSERVE_KV_PORT
              value: {{ $v.ports.kv | quote }}
            {{- if ne $t.type "tcp" }}
            {{- $tls := ternary "tcp" $t.ucx.tls $t.simulatedRdma }}
            {{- if $tls }}
            - name: UCX_TLS
              value: {{ $tls | quote }}
            {{- end }}
            {{- with $t.ucx.netDevices }}
            - name: UCX_NET_DEVICES
              value: {{ . | quote }}
            {{- end }}
            {{- range $k, $val := $t.ucx.extraEnv }}
            - name: {{ $k }}
              value: {{ $val | quote }}
            {{- end }}
            {{- end }}
            {{- if eq $v.router.discovery "redis" }}
            {{- with (include "pdserve.redisEnv" $root | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- end }}
            {{- with (include "pdserve.tlsEnv" $root | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
            # compiled kernels (engine.kernelCache): Triton's cache and flashinfer's JIT workspace
            - name: TRITON_CACHE_DIR
              value: /var/cache/pdserve-kernels/triton
            - name: FLASHINFER_WORKSPACE_BASE
              value: /var/cache/pdserve-kernels
            {{- with $pool.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.ports.grpc }}
              protocol: TCP
            - name: kv
              containerPort: {{ $v.ports.kv }}
              protocol: TCP
            {{- if $v.metrics.enabled }}
            - name: metrics
              containerPort: {{ $v.metrics.port }}
              protocol: TCP
            {{- end }}
          {{- include "pdserve.probes" (dict "root" $root "role" $role "service" $service) | trim | nindent 10 }}
          {{- include "pdserve.lifecycle" $root | trim | nindent 10 }}
          securityContext:
            {{- if and $rdma $t.rdma.ipcLock }}
            {{- $caps := deepCopy ($v.securityContext.capabilities | default dict) }}
            {{- $_ := set $caps "add" (append ($caps.add | default list) "IPC_LOCK" | uniq) }}
            {{- toYaml (merge (dict "capabilities" $caps) (deepCopy $v.securityContext)) | nindent 12 }}
            {{- else }}
            {{- toYaml $v.securityContext | nindent 12 }}
            {{- end }}
          resources:
            {{- if or $rdma $gpus }}
            {{- $res := deepCopy $pool.resources }}
            {{- $req := $res.requests | default dict }}
            {{- $lim := $res.limits | default dict }}
            {{- if $rdma }}
            {{- $_ := set $req $t.rdma.resourceName $t.rdma.count }}
            {{- $_ := set $lim $t.rdma.resourceName $t.rdma.count }}
            {{- end }}
            {{- if $gpus }}
            {{- $g := $v.engine.gpuResource }}
            {{- range $given := list (index $req $g) (index $lim $g) }}
            {{- if and $given (ne (int $given) $tp) }}
            {{- fail (printf "%s.resources asks for %v %s but %s.tensorParallelSize is %d (one per rank)" $role $given $g $role $tp) }}
            {{- end }}
            {{- end }}
            {{- $_ := set $req $g $tp }}
            {{- $_ := set $lim $g $tp }}
            {{- end }}
            {{- toYaml (dict "requests" $req "limits" $lim) | nindent 12 }}
            {{- else }}
            {{- toYaml $pool.resources | nindent 12 }}
            {{- end }}
          volumeMounts:
            {{- include "pdserve.modelMount" $root | trim | nindent 12 }}
            - name: tmp
              mountPath: /tmp
            - name: shm
              mountPath: /dev/shm
            - name: kernel-cache
              mountPath: /var/cache/pdserve-kernels
            {{- if $tiers.disk.enabled }}
            - name: kv-disk
              mountPath: {{ $tiers.disk.mountPath | quote }}
            {{- end }}
            {{- with (include "pdserve.tlsMount" $root | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "pdserve.modelVolume" $root | trim | nindent 8 }}
        - name: tmp
          emptyDir: {}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $pool.shmSize }}
        {{- $kc := $v.engine.kernelCache }}
        - name: kernel-cache
          {{- if eq $kc.type "pvc" }}
          persistentVolumeClaim:
            claimName: {{ required "engine.kernelCache.claimName is required when type is pvc" $kc.claimName }}
          {{- else if eq $kc.type "hostPath" }}
          hostPath:
            path: {{ $kc.hostPath }}
            type: Directory
          {{- else }}
          emptyDir:
            sizeLimit: {{ $kc.sizeLimit }}
          {{- end }}
        {{- with $tiers.disk }}
        {{- if .enabled }}
        # the disk KV tier (<pool>.kvTiers.disk): writable by the pod's user (emptyDir; fsGroup for claims)
        - name: kv-disk
          {{- if .volume }}
          {{- toYaml .volume | nindent 10 }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ include "pdserve.kvDiskSizeLimit" .sizeGb }}
          {{- end }}
        {{- end }}
        {{- end }}
        {{- with (include "pdserve.tlsVolume" (dict "root" $root "role" $role) | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
---
# Headless: the router dials each worker pod directly (discovered through its pods / EndpointSlices).
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "pdserve.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.ports.grpc }}
      targetPort: grpc
      protocol: TCP
    - name: kv
      port: {{ $v.ports.kv }}
      targetPort: kv
      protocol: TCP
    {{- if $v.metrics.enabled }}
    - name: metrics
      port: {{ $v.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
{{- if $pool.pdb.enabled }}
---
apiVersion: {{ include "pdserve.pdbApiVersion" $root }}
kind: PodDisruptionBudget
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $pool.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- if and $pool.autoscaling.enabled (not $v.planner.enabled) }}
---
{{ include "pdserve.hpa" (dict "root" $root "component" $role "name" $name "spec" $pool.autoscaling) }}
{{- end }}
{{- end }}

{{/* HPA for a Deployment, autoscaling/v2 (v2beta2 where only that is served: _cluster.tpl):
(dict "root" $ "component" c "name" n "spec" .Values.x.autoscaling) */}}
{{- define "pdserve.hpa" -}}
{{- $a := .spec }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "%s.autoscaling.minReplicas must be <= maxReplicas" .component) }}
{{- end }}
{{- if and (kindIs "invalid" $a.targetCPUUtilizationPercentage) (not $a.metrics) }}
{{- fail (printf "%s.autoscaling needs targetCPUUtilizationPercentage or metrics" .component) }}
{{- end }}
apiVersion: {{ include "pdserve.hpaApiVersion" .root }}
kind: HorizontalPodAutoscaler
metadata:
  name: {{ .name }}
  labels:
    {{- include "pdserve.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ .name }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    {{- if not (kindIs "invalid" $a.targetCPUUtilizationPercentage) }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $a.targetCPUUtilizationPercentage }}
    {{- end }}
    {{- with $a.metrics }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* The disk KV tier's emptyDir sizeLimit from its sizeGb: the tier's own bound (it keeps at most sizeGb
GiB of block files) plus 5% and at least 1Gi for what it does not count (a file being written before the
oldest is removed, filesystem rounding), so the kubelet never evicts a pod for a size the tier keeps. */}}
{{- define "pdserve.kvDiskSizeLimit" -}}
{{- $mi := ceil (mulf (float64 .) 1024.0) | int64 }}
{{- printf "%dMi" (add $mi (max 1024 (div (add $mi 19) 20))) -}}
{{- end }}

{{/* A pool's tensor parallel size: (dict "root" $ "role" "prefill"|"decode") */}}
{{- define "pdserve.poolTP" -}}
{{- (index .root.Values .role).tensorParallelSize | default 1 | int -}}
{{- end }}

{{/* The prefill TP size the decode pool takes KV from: decode.kvSourceTensorParallelSize, else the prefill
pool's when it is larger than the decode pool's (then each decode rank receives its heads in pieces). */}}
{{- define "pdserve.kvSourceTP" -}}
{{- $given := .Values.decode.kvSourceTensorParallelSize | default 0 | int }}
{{- $p := include "pdserve.poolTP" (dict "root" . "role" "prefill") | int }}
{{- $d := include "pdserve.poolTP" (dict "root" . "role" "decode") | int }}
{{- if gt $given 0 }}{{ $given }}{{ else if gt $p $d }}{{ $p }}{{ else }}{{ $d }}{{ end -}}
{{- end }}

{{/* The decode pods' KV ports end (inclusive): rank r listens on kv + r, its piece transport on
kv + TP + r (pdserve/app/tp_ranks.py), so a TP-N decode worker taking pieces uses [kv, kv + 2N). */}}
{{- define "pdserve.decodeKvPortEnd" -}}
{{- $d := include "pdserve.poolTP" (dict "root" . "role" "decode") | int }}
{{- $src := include "pdserve.kvSourceTP" . | int }}
{{- if gt $src $d }}{{ add .Values.ports.kv (mul 2 $d) -1 }}{{ else }}{{ add .Values.ports.kv $d -1 }}{{ end -}}
{{- end }}
