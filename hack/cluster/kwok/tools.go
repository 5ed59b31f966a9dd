//go:build tools

// Package tools records the kwok command that hack/cluster/build compiles.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
