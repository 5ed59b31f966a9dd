# shellcheck shell=bash disable=SC2034  # the settings here are used by the scripts that source it
# Shared settings of hack/cluster/{up,down,env}. Source it; do not run it.
#
# Everything lives under <repo>/.cluster (git-ignored): pki/, etcd/, kubeconfigs/, logs/, pids/,
# and kubeconfig (the admin kubeconfig). Every listener binds to loopback only.

cluster_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$cluster_here/../.." && pwd)"
cluster_dir="${PDSERVE_CLUSTER_DIR:-$repo_root/.cluster}"
pki="$cluster_dir/pki"
logs="$cluster_dir/logs"
pids="$cluster_dir/pids"
kubeconfigs="$cluster_dir/kubeconfigs"
admin_kubeconfig="$cluster_dir/kubeconfig"

# Fixed defaults on loopback in a high range; each can be overridden.
etcd_port="${PDSERVE_CLUSTER_ETCD_PORT:-23790}"
etcd_peer_port="${PDSERVE_CLUSTER_ETCD_PEER_PORT:-23800}"
apiserver_port="${PDSERVE_CLUSTER_APISERVER_PORT:-26443}"
kcm_port="${PDSERVE_CLUSTER_CONTROLLER_MANAGER_PORT:-26257}"
scheduler_port="${PDSERVE_CLUSTER_SCHEDULER_PORT:-26259}"
# The LeaderWorkerSet controller: its admission webhooks (HTTPS, called by kube-apiserver at
# https://127.0.0.1:PORT) and its health probes (/readyz, /healthz).
lws_webhook_port="${PDSERVE_CLUSTER_LWS_WEBHOOK_PORT:-26260}"
lws_health_port="${PDSERVE_CLUSTER_LWS_HEALTH_PORT:-26261}"
node_count="${PDSERVE_CLUSTER_NODES:-4}"
gpus_per_node="${PDSERVE_CLUSTER_GPUS_PER_NODE:-8}"
# 127.128.0.0/16 split in two: kwok's fake pods take the lower half, the pod runner's the upper.
pod_cidr="${PDSERVE_CLUSTER_POD_CIDR:-127.128.0.1/17}"
node_ip="${PDSERVE_CLUSTER_NODE_IP:-127.0.0.2}"
runner_nodes="${PDSERVE_CLUSTER_RUNNER_NODES:-1}"
runner_cidr="${PDSERVE_CLUSTER_RUNNER_CIDR:-127.128.128.0/17}"
runner_dir="$cluster_dir/runner"
runner_python="${PDSERVE_CLUSTER_PYTHON:-$repo_root/.venv/bin/python}"

# Start order; down stops them in reverse.
components=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok lws)

declare -A component_port=(
  [etcd]="$etcd_port"
  [kube-apiserver]="$apiserver_port"
  [kube-controller-manager]="$kcm_port"
  [kube-scheduler]="$scheduler_port"
  [lws]="$lws_webhook_port"
  [lws-health]="$lws_health_port"
)
declare -A port_env=(
  [etcd]=PDSERVE_CLUSTER_ETCD_PORT
  [etcd-peer]=PDSERVE_CLUSTER_ETCD_PEER_PORT
  [kube-apiserver]=PDSERVE_CLUSTER_APISERVER_PORT
  [kube-controller-manager]=PDSERVE_CLUSTER_CONTROLLER_MANAGER_PORT
  [kube-scheduler]=PDSERVE_CLUSTER_SCHEDULER_PORT
  [lws]=PDSERVE_CLUSTER_LWS_WEBHOOK_PORT
  [lws-health]=PDSERVE_CLUSTER_LWS_HEALTH_PORT
)

# Serialises up/down (several test sessions may share one cluster). Children must not inherit
# fd 9, or they would hold the lock for their whole life.
cluster_lock() {
  [[ -n "${PDSERVE_CLUSTER_LOCKED:-}" ]] && return 0
  command -v flock >/dev/null 2>&1 || return 0
  mkdir -p "$cluster_dir"
  exec 9>"$cluster_dir/.lock"
  if ! flock -w "${PDSERVE_CLUSTER_LOCK_TIMEOUT:-300}" 9; then
    die "another hack/cluster/up or down holds $cluster_dir/.lock; wait for it to finish and retry"
  fi
  export PDSERVE_CLUSTER_LOCKED=1
}

die() {
  echo "hack/cluster: error: $*" >&2
  exit 1
}

log() {
  printf '[cluster %5.1fs] %s\n' "$(elapsed)" "$*"
}

_t0="$(date +%s.%N)"
elapsed() {
  local now
  now="$(date +%s.%N)"
  awk -v a="$_t0" -v b="$now" 'BEGIN { printf "%.1f", b - a }'
}

# Directory of the built binaries; fails with the next step if they are not built.
# PDSERVE_CLUSTER_BIN overrides it (binaries built elsewhere).
cluster_bin() {
  local b
  if [[ -n "${PDSERVE_CLUSTER_BIN:-}" ]]; then
    [[ -x "$PDSERVE_CLUSTER_BIN/kube-apiserver" ]] || die "PDSERVE_CLUSTER_BIN=$PDSERVE_CLUSTER_BIN has no kube-apiserver"
    echo "$PDSERVE_CLUSTER_BIN"
    return
  fi
  if ! b="$("$cluster_here/build" --print-bin 2>/dev/null)"; then
    die "the cluster binaries are not built; run hack/cluster/build first (or make cluster-build)"
  fi
  echo "$b"
}

# True if something accepts TCP connections on 127.0.0.1:$1.
port_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# PID recorded for component $1 if that process is alive and is really that component.
component_pid() {
  local name="$1" f="$pids/$1.pid" pid match="/$1 "
  [[ "$name" == pod-runner ]] && match="/podrunner.py "
  [[ -f "$f" ]] || return 1
  pid="$(<"$f")"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  process_alive "$pid" || return 1
  # Guard against a recycled PID: the process must run our binary for this component.
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$match" || return 1
  echo "$pid"
}

# Kills the container process groups a pod runner left behind (pid files: "PID STARTTIME").
kill_runner_leftovers() {
  local f pid start now
  for f in "$runner_dir"/pids/*.pid; do
    [[ -f "$f" ]] || continue
    read -r pid start <"$f" || true
    if [[ "$pid" =~ ^[0-9]+$ && -r "/proc/$pid/stat" ]]; then
      now="$(sed 's/.*) //' "/proc/$pid/stat" | awk '{print $20}')"
      [[ "$now" == "$start" ]] && kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
}

# Stops component $1 by its recorded PID: TERM, wait up to $2 seconds (default 15), then KILL.
stop_component() {
  local name="$1" wait_s="${2:-15}" pid i
  if pid="$(component_pid "$name")"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < wait_s * 10; i++)); do
      process_alive "$pid" || break
      sleep 0.1
    done
    if process_alive "$pid"; then
      echo "$name (pid $pid) still running ${wait_s}s after TERM; sending KILL"
      kill -KILL "$pid" 2>/dev/null || true
      for ((i = 0; i < 50; i++)); do
        process_alive "$pid" || break
        sleep 0.1
      done
    fi
    echo "stopped $name (pid $pid) in $(elapsed)s"
  fi
  rm -f "$pids/$name.pid"
}

# True if process $1 exists and is not a zombie (an exited process not reaped yet).
process_alive() {
  local state
  state="$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null)" || return 1
  [[ -n "$state" && "$state" != Z && "$state" != X ]]
}
