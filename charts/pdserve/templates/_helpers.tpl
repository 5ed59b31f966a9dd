{{/* Names and labels shared by every template. */}}

{{- define "pdserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, with the chart name appended unless the release already contains it. */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator's leader-election Lease, in the release namespace: one per release. */}}
{{- define "pdserve.leaseName" -}}
{{- printf "%s-operator" (include "pdserve.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespaces the operator watches with scope=namespaced, as a list (default: the release namespace). */}}
{{- define "pdserve.watchedNamespaces" -}}
{{- $namespaces := .Values.operator.namespaces | default (list .Release.Namespace) -}}
{{- toJson $namespaces -}}
{{- end -}}

{{/*
The RBAC documents of the operator, read from files/rbac/ (a verbatim copy of deploy/rbac/, kept in
step by hack/sync-chart and checked by tests/unit/test_chart.py). Returns {"docs": [...]} for the
chosen scope.
*/}}
{{- define "pdserve.rbacDocs" -}}
{{- $file := ternary "files/rbac/cluster.yaml" "files/rbac/namespaced.yaml" (eq .Values.operator.scope "cluster") -}}
{{- $docs := list -}}
{{- range $raw := regexSplit "(?m)^---\\s*$" (.Files.Get $file) -1 -}}
{{- $doc := fromYaml $raw -}}
{{- if and $doc (hasKey $doc "kind") -}}
{{- $docs = append $docs $doc -}}
{{- end -}}
{{- end -}}
{{- toJson (dict "docs" $docs) -}}
{{- end -}}
