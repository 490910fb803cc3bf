#!/usr/bin/env bash
# Faults under load (docs/operate.md, "What a fault costs"): the kit's Kubernetes 1.24 set up as the
# chart ships gpumem (two scorer replicas behind one address that spreads kube-scheduler's connections
# between them, as the Service does; the agent on the kit's real node, through the fake NVML, so the
# kubelet's Allocate really refuses), plus API-only GPU nodes as the scale runs make them. gpumem-scale
# keeps pods arriving with the openb trace's sizes at about 90% of the GPU memory allocated, half of them
# for the chart's second scheduler (gpumem-scheduler, a second kube-scheduler with its own connection
# to the scorers: two replicas then bind onto the same nodes at once), injects
# each fault in turn and then all together, and prints one row per fault. Run as root:
#
#   sudo scripts/faults.sh
#
# The faults: a scorer replica SIGKILLed every 20 s (each replica is restarted after 1 s, as the kubelet
# restarts a container), the agent SIGKILLed (a crash: the kubelet fails what it admits until the plugin
# registers again, counted apart), the agent restarted by SIGTERM (a rolling update: fenced, so no pod may
# fail), the kubelet restarted, kube-apiserver stopped for 30 s,
# kube-scheduler SIGKILLed (started again, as the kubelet restarts its static pod; the new process takes
# the leader Lease over once the dead one's expires), an API-only node lost (no Lease, no status) under
# a Deployment's pods.
#
# Environment:
#   GPUMEM_K8S_KIT        the kit (../shared/k8s)
#   K8S_STATE             the kit's state dir (/tmp/gpumem-faults)
#   GPUMEM_FAULTS_NODES   API-only nodes (40)
#   GPUMEM_FAULTS_SHORT   1: the short version CI runs (fewer nodes and kills, shorter windows, debug build)
#   GPUMEM_FAULTS_ONLY    a space-separated subset of the fault names, for debugging
#   GPUMEM_FAULTS_OUT     results (target/faults): summary.json (its `faults` rows), pods.csv, logs
#   GPUMEM_FAULTS_SHARED  0: the scorers run with sharedBookings false (to measure what the bookings prevent)
#   GPUMEM_FAULTS_SPLIT   1: each scheduler calls its own replica directly, not the spreading address (the
#                         case where two replicas bind onto the same nodes all the time)
#   GPUMEM_FAULTS_SCORER_LOG  the scorers' RUST_LOG (info; `info,gpumem::scorer::bind=debug` logs each
#                         bind's choice)
#   GPUMEM_SCALE_TRACE    the openb pod list (../shared/traces/openb/openb_pod_list_default.csv)
# Exits non-zero when a row is over the bar: a pod failed for GPU reasons, a GPU over capacity, a pod
# pending with no reason, or the placement rate not back within 60 s of the fault's end (90 s in the
# short run).

set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=$(cd "${GPUMEM_K8S_KIT:-$ROOT/../shared/k8s}" 2> /dev/null && pwd) || {
  echo "error: the Kubernetes kit is not at ${GPUMEM_K8S_KIT:-$ROOT/../shared/k8s} (set GPUMEM_K8S_KIT)" >&2
  exit 2
}
export K8S_STATE=${K8S_STATE:-/tmp/gpumem-faults}
export K8S_VERSION=1.24
SHORT=${GPUMEM_FAULTS_SHORT:-}
NODES=${GPUMEM_FAULTS_NODES:-40}
OUT=${GPUMEM_FAULTS_OUT:-$ROOT/target/faults}
TRACE=${GPUMEM_SCALE_TRACE:-$ROOT/../shared/traces/openb/openb_pod_list_default.csv}
if [ "$(id -u)" != 0 ]; then
  echo "error: the kit runs a kubelet and containerd: run as root" >&2
  exit 2
fi
[ -r "$TRACE" ] || {
  echo "error: no trace at $TRACE (set GPUMEM_SCALE_TRACE)" >&2
  exit 2
}

source "$ROOT/tests/e2e/lib.sh" # log, k, service_account_kubeconfig, scheduler_config

REAL_NODE=gpu-node-1
PROFILE=mixed
SCORER_TLS_ADDR=127.0.0.1:18443 # the spreading address kube-scheduler calls
REPLICA_TLS=(127.0.0.1:18441 127.0.0.1:18442)
REPLICA_PROBES=(127.0.0.1:18881 127.0.0.1:18882)
AGENT_METRICS=127.0.0.1:19400
ADMIN_KUBECONFIG=$K8S_STATE/admin.kubeconfig
RUN_OUT=$OUT
CERTS=$RUN_OUT/certs
started=$SECONDS

profile=release
[ -z "$SHORT" ] || profile=debug # CI has built the debug binaries already
log "building the $profile binaries"
build_flags=(--locked)
[ "$profile" == debug ] || build_flags+=(--release)
(cd "$ROOT" && cargo build "${build_flags[@]}" -p gpumem --bin gpumem -p gpumem-scale --bin gpumem-scale &&
  cargo build "${build_flags[@]}" -p gpumem-fake-nvml -p gpumem-cuda-shim) || exit 1
rm -rf "$RUN_OUT"
mkdir -p "$RUN_OUT/bin" "$RUN_OUT/nvml"
BIN=$RUN_OUT/bin
for f in gpumem gpumem-scale libgpumem_fake_nvml.so libgpumem_cuda.so; do
  cp "$ROOT/target/$profile/$f" "$BIN/$f" || exit 1
done
ln -sf "$BIN/libgpumem_fake_nvml.so" "$RUN_OUT/nvml/libnvidia-ml.so.1"

SUPERVISORS=()
# supervise NAME COMMAND...: runs COMMAND again 1 s after it exits (as the kubelet restarts a
# container), its PID in $RUN_OUT/NAME.pid, its output in $RUN_OUT/NAME.log, until $RUN_OUT/stop exists.
supervise() {
  local name=$1
  shift
  (
    while [ ! -e "$RUN_OUT/stop" ]; do
      "$@" >> "$RUN_OUT/$name.log" 2>&1 &
      echo $! > "$RUN_OUT/$name.pid"
      wait $!
      local rc=$?
      echo "[$(date +%H:%M:%S)] supervisor: $name exited with $rc; started again in 1 s" >> "$RUN_OUT/$name.log"
      sleep 1
    done
  ) 2>> "$RUN_OUT/$name.log" &
  SUPERVISORS+=($!)
}

SCALE_PID=""
cleanup() {
  [ -z "$SCALE_PID" ] || kill -TERM -- "-$SCALE_PID" 2> /dev/null
  touch "$RUN_OUT/stop"
  for f in "$RUN_OUT"/*.pid; do
    [ -e "$f" ] && kill -TERM "$(cat "$f")" 2> /dev/null
  done
  # As the kubelet stops a container: SIGTERM, then SIGKILL after a grace period.
  sleep 5
  for f in "$RUN_OUT"/*.pid; do
    [ -e "$f" ] && kill -KILL "$(cat "$f")" 2> /dev/null
  done
  for p in "${SUPERVISORS[@]}"; do wait "$p" 2> /dev/null; done
  SUPERVISORS=()
  mkdir -p "$RUN_OUT/logs"
  for c in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
    cp "$K8S_STATE/logs/$c.log" "$RUN_OUT/logs/" 2> /dev/null
  done
  "$KIT/down.sh" > "$RUN_OUT/down.log" 2>&1
}

"$KIT/down.sh" > /dev/null 2>&1
"$BIN/gpumem" certs --out "$CERTS" > "$RUN_OUT/certs.log" 2>&1 || {
  log "gpumem certs failed: $(cat "$RUN_OUT/certs.log")"
  exit 1
}
scheduler_config || {
  log "the scheduler configuration did not render (see $RUN_OUT/scheduler.yaml)"
  exit 1
}
[ "${GPUMEM_FAULTS_SPLIT:-}" != 1 ] ||
  sed -i "s|urlPrefix: https://$SCORER_TLS_ADDR|urlPrefix: https://${REPLICA_TLS[0]}|" "$RUN_OUT/scheduler.yaml"
# Leader election on, as shipped (the e2e suite turns it off): a restarted kube-scheduler takes the
# leader Lease over, and one that loses it (kube-apiserver down) exits and is started again.
sed -i 's|^  leaderElect: false$|  leaderElect: true|' "$RUN_OUT/scheduler.yaml"
grep -q '^  leaderElect: true$' "$RUN_OUT/scheduler.yaml" || {
  log "leader election is not on in $RUN_OUT/scheduler.yaml"
  exit 1
}
trap 'exit 130' INT TERM
trap cleanup EXIT
log "cluster up (logs: $RUN_OUT, $K8S_STATE/logs)"
SCHEDULER_CONFIG=$RUN_OUT/scheduler.yaml EXTRA_NODES=0 "$KIT/up.sh" > "$RUN_OUT/up.log" 2>&1 || {
  log "the kit's cluster did not start (see $RUN_OUT/up.log)"
  exit 1
}
base=$ROOT/deploy/manifests/base
k apply -f "$base/namespace.yaml" -f "$base/agent-rbac.yaml" -f "$base/scorer-rbac.yaml" \
  -f "$base/priorityclasses.yaml" > "$RUN_OUT/rbac.log" 2>&1 && apply_flow_schema >> "$RUN_OUT/rbac.log" 2>&1 || {
  log "the shipped RBAC did not apply: $(cat "$RUN_OUT/rbac.log")"
  exit 1
}
service_account_kubeconfig gpumem-agent "$RUN_OUT/agent.kubeconfig" &&
  service_account_kubeconfig gpumem-scorer "$RUN_OUT/scorer.kubeconfig" || {
  log "no service account tokens"
  exit 1
}

# Two scorer replicas as the chart runs them (scorer.replicas: 2), one address in front.
cat > "$RUN_OUT/scorer.yaml" << YAML
tls: {certFile: $CERTS/scorer.crt, keyFile: $CERTS/scorer.key, clientCAFile: $CERTS/ca.crt}
sharedBookings: $([ "${GPUMEM_FAULTS_SHARED:-1}" == 0 ] && echo false || echo true)
YAML
for i in 0 1; do
  replica=$([ $i == 0 ] && echo a || echo b)
  supervise "scorer-$replica" env KUBECONFIG="$RUN_OUT/scorer.kubeconfig" RUST_LOG=${GPUMEM_FAULTS_SCORER_LOG:-info} \
    POD_NAME="gpumem-scorer-$replica" POD_NAMESPACE=gpumem-system \
    "$BIN/gpumem" scorer --listen "${REPLICA_PROBES[$i]}" --tls-listen "${REPLICA_TLS[$i]}" \
    --config "$RUN_OUT/scorer.yaml"
done
supervise spread "$BIN/gpumem-scale" spread --listen "$SCORER_TLS_ADDR" --to "${REPLICA_TLS[0]}" --to "${REPLICA_TLS[1]}"
# The chart's second scheduler (scheduler.mode: second): the same configuration for the profile
# gpumem-scheduler, on its own port.
sed -e 's|^  - schedulerName: default-scheduler$|  - schedulerName: gpumem-scheduler|' \
  -e 's|^  leaderElect: true$|  leaderElect: true\n  resourceName: gpumem-scheduler|' \
  -e "s|\${K8S_STATE}|$K8S_STATE|g" "$RUN_OUT/scheduler.yaml" > "$RUN_OUT/scheduler-2.yaml"
[ "${GPUMEM_FAULTS_SPLIT:-}" != 1 ] ||
  sed -i "s|urlPrefix: https://${REPLICA_TLS[0]}|urlPrefix: https://${REPLICA_TLS[1]}|" "$RUN_OUT/scheduler-2.yaml"
grep -q 'schedulerName: gpumem-scheduler' "$RUN_OUT/scheduler-2.yaml" &&
  grep -q '^  resourceName: gpumem-scheduler$' "$RUN_OUT/scheduler-2.yaml" || {
  log "the second scheduler's configuration did not render (see $RUN_OUT/scheduler-2.yaml)"
  exit 1
}
supervise scheduler-2 "$K8S_STATE/bin/kube-scheduler" --config="$RUN_OUT/scheduler-2.yaml" \
  --bind-address=127.0.0.1 --secure-port=10260 --authentication-kubeconfig="$ADMIN_KUBECONFIG" \
  --authorization-kubeconfig="$ADMIN_KUBECONFIG" --v=1
# The kit's kube-scheduler as the kubelet keeps a static pod: started again when it has exited (killed,
# or its leader Lease lost), once kube-apiserver runs.
(
  while [ ! -e "$RUN_OUT/stop" ]; do
    sleep 1
    read -r pid _ < "$K8S_STATE/run/kube-scheduler.pid" 2> /dev/null && kill -0 "$pid" 2> /dev/null && continue
    echo "[$(date +%H:%M:%S)] kube-scheduler is not running: starting it" >> "$RUN_OUT/scheduler-watch.log"
    SCHEDULER_CONFIG=$RUN_OUT/scheduler.yaml "$KIT/restart-scheduler.sh" >> "$RUN_OUT/scheduler-watch.log" 2>&1
  done
) &
SUPERVISORS+=($!)
# The agent as its DaemonSet runs it, on the real node through the fake NVML.
supervise agent env KUBECONFIG="$RUN_OUT/agent.kubeconfig" GPUMEM_FAKE_NVML_PROFILE=$PROFILE RUST_LOG=info \
  "$BIN/gpumem" agent --node-name "$REAL_NODE" --nvml-lib "$RUN_OUT/nvml/libnvidia-ml.so.1" \
  --device-plugin-dir /var/lib/kubelet/device-plugins --state-dir "$RUN_OUT/agent-state" \
  --shim-path "$BIN/libgpumem_cuda.so" \
  --metrics-listen "$AGENT_METRICS"
for addr in "${REPLICA_PROBES[@]}"; do
  for _ in $(seq 60); do curl -sf "http://$addr/readyz" > /dev/null && break; sleep 0.5; done
  curl -sf "http://$addr/readyz" > /dev/null || {
    log "the scorer at $addr is not ready (see $RUN_OUT/scorer-*.log)"
    exit 1
  }
done
for _ in $(seq 60); do node_alloc_is "$REAL_NODE" nvidia.com/gpu 4 && break; sleep 0.5; done
node_alloc_is "$REAL_NODE" nvidia.com/gpu 4 || {
  log "the agent did not register its GPUs (see $RUN_OUT/agent.log)"
  exit 1
}

# The faults, as commands on this machine.
kills=3
[ -z "$SHORT" ] || kills=2
declare -A FAULT=(
  [scorer-kill]="for i in \$(seq $kills); do r=\$([ \$((i % 2)) == 1 ] && echo a || echo b); kill -KILL \$(cat $RUN_OUT/scorer-\$r.pid); echo killed scorer-\$r; [ \$i == $kills ] || sleep 20; done"
  [agent-kill]="kill -KILL \$(cat $RUN_OUT/agent.pid)"
  [agent-restart]="kill -TERM \$(cat $RUN_OUT/agent.pid)"
  [kubelet-restart]="$KIT/restart-kubelet.sh"
  [apiserver-down]="source $KIT/lib.sh && stop_pid kube-apiserver 20 && sleep 30 && start_apiserver && wait_apiserver"
  [scheduler-restart]="kill -KILL \$(cut -d' ' -f1 $K8S_STATE/run/kube-scheduler.pid) && echo killed kube-scheduler"
  [node-lost]="@node-lost"
)
ORDER="scorer-kill agent-kill agent-restart kubelet-restart apiserver-down scheduler-restart node-lost"
fault_args=()
for f in ${GPUMEM_FAULTS_ONLY:-$ORDER}; do
  [ -n "${FAULT[$f]:-}" ] || {
    log "no fault named $f (one of: $ORDER)"
    exit 2
  }
  fault_args+=(--fault "$f=${FAULT[$f]}")
done
if [ -n "$SHORT" ]; then
  [ "${GPUMEM_FAULTS_NODES:-}" ] || NODES=8
  # 8 nodes place about 2 pods a second, so a 15 s window holds ~30 placements and one slow window
  # reads as "not recovered": the short run's bar is 90 s; the full run keeps the 60 s of the issue.
  shape=(--fault-lifetime 30 --fault-baseline 10 --fault-observe 90 --fault-rate 10 --fault-deployment 4
    --fault-recovery-limit 90)
else
  shape=(--fault-lifetime 60 --fault-baseline 20 --fault-observe 120 --fault-rate 20 --fault-together)
fi

log "cluster ready in $((SECONDS - started)) s; gpumem-scale runs ($NODES API-only nodes + $REAL_NODE)"
# In a session of its own: the cleanup stops it with the fault commands it started.
# A restarted kubelet has no device plugin registered until the agent's registration reaches it, as
# after an agent SIGKILL: a pod it admits in that window fails as with any device plugin (counted apart).
KUBECONFIG=$ADMIN_KUBECONFIG setsid "$BIN/gpumem-scale" run --mode extender --nodes "$NODES" \
  --rate 1 --duration 0 --burst 0 --fill 0 --saturate 0 --trace "$TRACE" --out "$RUN_OUT" \
  --k8s-state "$K8S_STATE" --real-node "$REAL_NODE" "${shape[@]}" "${fault_args[@]}" \
  --fault-scheduler default-scheduler --fault-scheduler gpumem-scheduler --fault-plugin-crash agent-kill \
  --fault-plugin-crash kubelet-restart \
  > "$RUN_OUT/stdout.txt" 2> >(tee "$RUN_OUT/progress.log" >&2) &
SCALE_PID=$!
wait $SCALE_PID
status=$?
SCALE_PID=""
sed -n '/^faults:/,$p' "$RUN_OUT/stdout.txt"
log "faults finished in $((SECONDS - started)) s with status $status (results: $RUN_OUT)"
exit $status
