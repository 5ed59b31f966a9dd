//go:build tools

// Package tools records the etcd server command that hack/cluster/build compiles.
package tools

import _ "go.etcd.io/etcd/server/v3"
