//go:build tools

// Package tools records the helm command that hack/cluster/build compiles.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
