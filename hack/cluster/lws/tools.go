//go:build tools

// Package tools records the LeaderWorkerSet controller command that hack/cluster/build compiles.
package tools

import _ "sigs.k8s.io/lws/cmd"
