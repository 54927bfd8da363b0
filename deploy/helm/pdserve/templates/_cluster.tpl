{{/*
What the target cluster serves, read from .Capabilities, so one chart installs on Kubernetes 1.20 (the
local kind lane) and on current releases alike.

Against a cluster (helm install / upgrade / template --validate) Helm lists every served group/version
AND every served group/version/Kind. Offline `helm template` lists only its built-in group/versions and a
fixed KubeVersion (v1.20.0 for Helm 3.6) unless --api-versions / --kube-version say otherwise. So an older
form is chosen only on positive evidence, a kind-level entry: offline renders without such flags keep the
current forms, and a 1.20 render is `helm template --kube-version 1.20.2 --api-versions policy/v1beta1/
PodDisruptionBudget ...` (tests/deploy/test_chart_api_versions.py).
*/}}

{{/* "true" when the capabilities list served kinds (a real cluster, or one described by --api-versions). */}}
{{- define "pdserve.clusterKnown" -}}
{{- if .Capabilities.APIVersions.Has "apps/v1/Deployment" }}true{{ end -}}
{{- end }}

{{/* policy/v1 (Kubernetes >= 1.21) unless only policy/v1beta1 is served. */}}
{{- define "pdserve.pdbApiVersion" -}}
{{- $a := .Capabilities.APIVersions }}
{{- if and ($a.Has "policy/v1beta1/PodDisruptionBudget") (not ($a.Has "policy/v1/PodDisruptionBudget")) -}}
policy/v1beta1
{{- else -}}
policy/v1
{{- end }}
{{- end }}

{{/* autoscaling/v2 (Kubernetes >= 1.23) unless only autoscaling/v2beta2 is served (same spec fields). */}}
{{- define "pdserve.hpaApiVersion" -}}
{{- $a := .Capabilities.APIVersions }}
{{- if and ($a.Has "autoscaling/v2beta2/HorizontalPodAutoscaler") (not ($a.Has "autoscaling/v2/HorizontalPodAutoscaler")) -}}
autoscaling/v2beta2
{{- else -}}
autoscaling/v2
{{- end }}
{{- end }}

{{/* "true" when the kubelet has native gRPC probes (beta and on by default from 1.24). Older clusters get
the image's pdserve-healthcheck as an exec probe: the same grpc.health.v1 check, a small process. */}}
{{- define "pdserve.grpcProbes" -}}
{{- if or (not (include "pdserve.clusterKnown" .)) (semverCompare ">=1.24-0" .Capabilities.KubeVersion.Version) }}true{{ end -}}
{{- end }}

{{/* "true" when NetworkPolicy ports take endPort (beta and on by default from 1.22). */}}
{{- define "pdserve.netpolEndPort" -}}
{{- if or (not (include "pdserve.clusterKnown" .)) (semverCompare ">=1.22-0" .Capabilities.KubeVersion.Version) }}true{{ end -}}
{{- end }}

{{/* The host pods dial for one of the release's Services: (dict "root" $ "service" "<fullname>-redis").
serviceAddresses=dns: the Service name (cluster DNS). env: the kubelet's <NAME>_SERVICE_HOST variable,
expanded by the kubelet in env values (pods then set enableServiceLinks), for clusters without DNS. */}}
{{- define "pdserve.serviceHost" -}}
{{- if eq .root.Values.serviceAddresses "env" -}}
{{- printf "$(%s_SERVICE_HOST)" (.service | upper | replace "-" "_") }}
{{- else -}}
{{- .service }}
{{- end }}
{{- end }}

{{/* Checks against what the cluster serves. */}}
{{- define "pdserve.validateCluster" -}}
{{- $a := .Capabilities.APIVersions }}
{{- if and (eq .Values.router.discovery "k8s") (include "pdserve.clusterKnown" .) }}
{{- if not (or ($a.Has "discovery.k8s.io/v1/EndpointSlice") ($a.Has "discovery.k8s.io/v1beta1/EndpointSlice")) }}
{{- fail "router.discovery=k8s watches EndpointSlices (discovery.k8s.io/v1, or v1beta1 on Kubernetes 1.17-1.20) and this cluster serves neither: use router.discovery=redis" }}
{{- end }}
{{- end }}
{{- end }}
