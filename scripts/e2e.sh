#!/usr/bin/env bash
# The end-to-end suite: gpumem's real binaries on a real Kubernetes (the kit in ../shared/k8s:
# kube-apiserver, kube-scheduler, a kubelet on containerd; pods really run). Run as root:
#
#   sudo scripts/e2e.sh
#
# For each cluster of the kit it serves (Kubernetes 1.24 with its stock kubelet, which sends the socket
# path as HTTP/2 :authority; 1.24 with the kubelet that has the 1.26 `localhost` change; Kubernetes 1.36
# with containerd 2.3 and CDI) it starts a fresh cluster and sets it up as a user would: the project's RBAC from deploy/manifests/base, the agent and the scorer as their service
# accounts (tokens from `kubectl create token`), the GPUClaim CRD and its controller, certificates from `gpumem certs`, the project's
# scheduler configuration pointed at the scorer's TLS port with the scheduler's client certificate, the shim where the DaemonSet's init container puts it, the agent on a simulated node through
# the fake NVML, two API-only nodes carrying what an agent publishes. Then it runs the scenarios of
# tests/e2e/scenarios.sh and prints `N passed, N failed`. The enforcement scenarios (tests/e2e/enforce.sh)
# run real programs in pods of an image built here (tests/e2e/probe-image.sh: the test program over the
# fake libcuda.so.1, with this machine's loader and glibc) and imported into each cluster's containerd.
#
# On 1.36 the same node then moves to the DRA path (the agent restarted with `mode: dra`) and the DRA
# scenarios run. Last, the short fault run (scripts/faults.sh): faults under load, one check per fault.
#
# Environment: GPUMEM_K8S_KIT (the kit; ../shared/k8s), GPUMEM_E2E_CLUSTERS (VERSION/KUBELET pairs;
# "1.24/stock 1.24/localhost-authority 1.36/stock"),
# GPUMEM_E2E_OUT (logs; target/e2e), K8S_STATE (the kit's state dir; /tmp/gpumem-e2e),
# GPUMEM_E2E_SCENARIOS (a space-separated subset of the scenario names, for debugging; `faults` is the
# fault run), GPUMEM_E2E_KEEP=1
# (leave the last cluster, agent and scorer running to look around; the kit's down.sh stops the cluster).

set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=$(cd "${GPUMEM_K8S_KIT:-$ROOT/../shared/k8s}" 2> /dev/null && pwd) || {
  echo "error: the Kubernetes kit is not at ${GPUMEM_K8S_KIT:-$ROOT/../shared/k8s} (set GPUMEM_K8S_KIT)" >&2
  exit 2
}
CLUSTERS=${GPUMEM_E2E_CLUSTERS:-1.24/stock 1.24/localhost-authority 1.36/stock}
OUT=${GPUMEM_E2E_OUT:-$ROOT/target/e2e}
export K8S_STATE=${K8S_STATE:-/tmp/gpumem-e2e}
if [ "$(id -u)" != 0 ]; then
  echo "error: the kit runs a kubelet and containerd: run as root" >&2
  exit 2
fi

source "$ROOT/tests/e2e/lib.sh"
source "$ROOT/tests/e2e/scenarios.sh"
source "$ROOT/tests/e2e/dra.sh"
source "$ROOT/tests/e2e/placement.sh"
source "$ROOT/tests/e2e/placer.sh"
source "$ROOT/tests/e2e/preempt.sh"
source "$ROOT/tests/e2e/gpuclaim-dra.sh"
source "$ROOT/tests/e2e/quotas.sh"
source "$ROOT/tests/e2e/enforce.sh"

NS=e2e
REAL_NODE=gpu-node-1
PROFILE=mixed # 2 x V100-SXM2-32GB joined by NVLink + 2 x T4, two NUMA nodes
SCORER_ADDR=127.0.0.1:18888     # probes and metrics
SCORER_TLS_ADDR=127.0.0.1:18443 # the extender's verbs, for kube-scheduler's client certificate
AGENT_METRICS=127.0.0.1:19400
CLAIMS_ADDR=127.0.0.1:18890 # the claim controller's probes and metrics
PLUGIN_DIR=/var/lib/kubelet/device-plugins
STATE_DIR=/var/lib/gpumem
SHIM_DEST=$STATE_DIR/lib # where the DaemonSet's init container installs the shim
QUIET_PERIOD=30          # seconds a GPU stays unhealthy after its last XID (300 in production)
started=$SECONDS

log "building the binaries, the shim and the fake NVML"
(cd "$ROOT" && cargo build --locked --bin gpumem && cargo build --locked -p gpumem-cuda-shim -p gpumem-fake-cuda -p gpumem-fake-nvml) || exit 1
# What is tested is what was just built: a later build must not swap the binary under a restart.
BIN=$OUT/bin
mkdir -p "$BIN"
for f in gpumem libgpumem_cuda.so libgpumem_fake_nvml.so; do
  cp "$ROOT/target/debug/$f" "$BIN/$f.new" && mv -f "$BIN/$f.new" "$BIN/$f" || exit 1
done

# The kit's Debian packages (up.sh would install them too, but the probe image needs busybox-static
# before any cluster is up: a fresh machine has none of them).
env -u K8S_VERSION "$KIT/prepare.sh" > "$OUT/prepare.log" 2>&1 ||
  { echo "error: preparing the Kubernetes kit failed (see $OUT/prepare.log)" >&2; exit 1; }
# The image of the enforcement scenarios: the test program over the fake libcuda.so.1, glibc from here.
build_probe_image || { echo "error: building the probe image failed (see $OUT/probe-image.log)" >&2; exit 1; }

# The fake NVML, reachable under the name nvml-wrapper loads.
NVML_DIR=$OUT/nvml
mkdir -p "$NVML_DIR"
ln -sf "$BIN/libgpumem_fake_nvml.so" "$NVML_DIR/libnvidia-ml.so.1"

AGENT_PID=""
SCORER_PID=""
CLAIMS_PID=""

# start_agent: the agent as its DaemonSet runs it, on a simulated node (fake NVML).
start_agent() {
  cat > "$RUN_OUT/agent.yaml" <<EOF
health: {quietPeriodSeconds: $QUIET_PERIOD, probeIntervalSeconds: 1}
usedReportSeconds: 1
memCounting: $MEM_COUNTING
EOF
  KUBECONFIG=$RUN_OUT/agent.kubeconfig \
    GPUMEM_FAKE_NVML_PROFILE=$PROFILE GPUMEM_FAKE_NVML_INJECT=$RUN_OUT/nvml-inject.toml \
    RUST_LOG=info,gpumem=debug \
    "$BIN/gpumem" agent --config "$RUN_OUT/agent.yaml" --node-name "$REAL_NODE" \
    --nvml-lib "$NVML_DIR/libnvidia-ml.so.1" --device-plugin-dir "$PLUGIN_DIR" \
    --state-dir "$STATE_DIR" --shim-path "$SHIM_DEST/libgpumem_cuda.so" \
    --metrics-listen "$AGENT_METRICS" >> "$RUN_OUT/agent.log" 2>&1 &
  AGENT_PID=$!
}

stop_agent() {
  [ -n "$AGENT_PID" ] || return 0
  kill -TERM "$AGENT_PID" 2> /dev/null
  wait "$AGENT_PID" 2> /dev/null
  AGENT_PID=""
}

# start_claims: the claim controller as its Deployment runs it (POD_NAME and POD_NAMESPACE from the
# downward API: a restarted container keeps its name, so it takes its own Lease back at once).
start_claims() {
  KUBECONFIG=$RUN_OUT/claims.kubeconfig POD_NAME=gpumem-claims-e2e POD_NAMESPACE=gpumem-system \
    RUST_LOG=info,gpumem=debug \
    "$BIN/gpumem" claims controller --listen "$CLAIMS_ADDR" ${CLAIMS_EXTRA:-} >> "$RUN_OUT/claims.log" 2>&1 &
  CLAIMS_PID=$!
}

# stop_claims [SIGNAL]: TERM by default; returns the exit status.
stop_claims() {
  [ -n "$CLAIMS_PID" ] || return 0
  kill "-${1:-TERM}" "$CLAIMS_PID" 2> /dev/null
  local status=0
  wait "$CLAIMS_PID" 2> /dev/null || status=$?
  CLAIMS_PID=""
  return $status
}

# apply_dra_objects: what the chart ships for the DRA path with default values (the DeviceClass and the
# admission policy that holds each agent to its own node's slices).
apply_dra_objects() {
  k apply -f "$ROOT/deploy/manifests/components/dra/dra.yaml" > "$RUN_OUT/dra-apply.log" 2>&1
}

# fake_node_patch PROFILE: labels and annotations an agent publishes for PROFILE (its own code writes them).
fake_node_patch() {
  "$BIN/gpumem" inspect --profile "$1" --output json | python3 -c '
import json, sys
r = json.load(sys.stdin)
print(json.dumps({"metadata": {"labels": r["labels"], "annotations": r["annotations"]}}))'
}

cleanup() {
  if [ "${GPUMEM_E2E_KEEP:-}" == 1 ] && [ -n "${RUN_OUT:-}" ]; then
    log "kept: the cluster (KUBECONFIG=$ADMIN_KUBECONFIG), agent pid $AGENT_PID, scorer pid $SCORER_PID, claim controller pid $CLAIMS_PID"
    AGENT_PID="" SCORER_PID="" CLAIMS_PID="" RUN_OUT=""
    return
  fi
  stop_claims
  stop_scorer
  stop_agent
  [ -z "${RUN_OUT:-}" ] || "$KIT/down.sh" > "$RUN_OUT/down.log" 2>&1
}

# run_cluster VERSION KUBELET: one fresh cluster of that Kubernetes version with that kubelet, every
# scenario.
run_cluster() {
  export K8S_VERSION=$1
  KUBELET=$2
  KUBELET_KIND=$1/$2
  # As the chart's agent.memCounting=auto decides: shares where the API server serves
  # admissionregistration.k8s.io/v1 MutatingAdmissionPolicy (1.36), units before.
  MEM_COUNTING=units
  [ "$K8S_VERSION" == 1.24 ] || MEM_COUNTING=shares
  RUN_OUT=$OUT/$1-$2
  rm -rf "$RUN_OUT"
  mkdir -p "$RUN_OUT" "$SHIM_DEST"
  ADMIN_KUBECONFIG=$K8S_STATE/admin.kubeconfig
  SCENARIO=setup
  log "== [$KUBELET_KIND] cluster up (logs: $RUN_OUT, $K8S_STATE/logs)"
  # A cluster left by an interrupted run would make up.sh refuse to start.
  pkill -f "$BIN/gpumem (agent|scorer|claims)" # left by a run with GPUMEM_E2E_KEEP=1
  env -u K8S_VERSION "$KIT/down.sh" > /dev/null 2>&1
  CERTS=$RUN_OUT/certs
  "$BIN/gpumem" certs --out "$CERTS" > "$RUN_OUT/certs.log" 2>&1 ||
    { bad "gpumem certs" "$(cat "$RUN_OUT/certs.log")"; return; }
  scheduler_config || { bad "scheduler configuration rendered" "see $RUN_OUT/scheduler.yaml"; return; }
  if ! KUBELET=$KUBELET SCHEDULER_CONFIG=$RUN_OUT/scheduler.yaml EXTRA_NODES=2 \
    EXTRA_NODE_TAINT=harness.local/fake-node=true:NoSchedule \
    EXTRA_NODE_CAPACITY='{"nvidia.com/gpu":"8","nvidia.com/gpu-mem":"655360","gpumem.io/gpu-share":"256"}' \
    "$KIT/up.sh" > "$RUN_OUT/up.log" 2>&1; then
    bad "the kit's cluster starts" "see $RUN_OUT/up.log"
    return
  fi
  ok "Kubernetes $K8S_VERSION up with the $KUBELET kubelet"
  import_probe_image || bad "the probe image imported into containerd" "see $RUN_OUT/probe-image-import.log"

  # The shim, installed as the init container does: a new file, then a rename.
  cp "$BIN/libgpumem_cuda.so" "$SHIM_DEST/.libgpumem_cuda.so.new" &&
    mv -f "$SHIM_DEST/.libgpumem_cuda.so.new" "$SHIM_DEST/libgpumem_cuda.so"
  rm -f "$RUN_OUT/nvml-inject.toml"
  # What an agent of an earlier cluster prepared is not this cluster's.
  rm -rf "$STATE_DIR/dra" "$STATE_DIR/containers" /var/run/cdi/gpumem.io-*

  # The project's own RBAC and CRD; the agent, the scorer and the claim controller run as their
  # service accounts.
  local base=$ROOT/deploy/manifests/base
  if ! k apply -f "$base/namespace.yaml" -f "$base/agent-rbac.yaml" -f "$base/agent-dra-rbac.yaml" -f "$base/scorer-rbac.yaml" \
    -f "$base/claims-rbac.yaml" -f "$base/gpuclaim-crd.yaml" -f "$base/priorityclasses.yaml" \
    > "$RUN_OUT/rbac.log" 2>&1 || ! apply_flow_schema >> "$RUN_OUT/rbac.log" 2>&1; then
    bad "the shipped RBAC, FlowSchema and CRD apply" "$(cat "$RUN_OUT/rbac.log")"
    return
  fi
  service_account_kubeconfig gpumem-agent "$RUN_OUT/agent.kubeconfig" &&
    service_account_kubeconfig gpumem-scorer "$RUN_OUT/scorer.kubeconfig" &&
    service_account_kubeconfig gpumem-claims "$RUN_OUT/claims.kubeconfig" ||
    { bad "service account tokens" ""; return; }
  k wait --for condition=established --timeout=30s crd/gpuclaims.gpumem.io > /dev/null ||
    { bad "the GPUClaim CRD is established" ""; return; }
  k create namespace "$NS" > /dev/null
  # With shares, the policy that gives each container asking GPU memory its share (components/gpu-share).
  if [ "$MEM_COUNTING" == shares ] &&
    ! k apply -f "$ROOT/deploy/manifests/components/gpu-share/gpu-share.yaml" > "$RUN_OUT/gpu-share.log" 2>&1; then
    bad "the gpu-share admission policy applies" "$(cat "$RUN_OUT/gpu-share.log")"
    return
  fi

  # API-only nodes with what an agent on an A100 and on a T4 node publishes.
  k patch node gpu-node-2 --type merge -p "$(fake_node_patch dgx-a100)" > /dev/null &&
    k patch node gpu-node-3 --type merge -p "$(fake_node_patch t4x4)" > /dev/null ||
    bad "fake nodes annotated" ""

  start_scorer
  start_agent
  start_claims
  for s in ${GPUMEM_E2E_SCENARIOS:-$(scenarios_for "$K8S_VERSION")}; do
    [ "$s" == faults ] || "scenario_$s" # the fault run has its own cluster (run_faults)
  done
  cleanup
}

# run_faults: the short fault run (scripts/faults.sh: its own 1.24 cluster, two scorer replicas behind one
# address, two schedulers, API-only nodes and the real node, one of each fault), one check per fault row.
run_faults() {
  KUBELET_KIND=1.24/faults
  SCENARIO=faults
  log "== [$KUBELET_KIND] faults under load (scripts/faults.sh, short; log: $OUT/faults.log)"
  GPUMEM_FAULTS_SHORT=1 GPUMEM_FAULTS_OUT=$OUT/faults "$ROOT/scripts/faults.sh" > "$OUT/faults.log" 2>&1
  local rows
  rows=$(python3 - "$OUT/faults/summary.json" << 'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["faults"]
except (OSError, ValueError, KeyError) as e:
    print(f"bad\tthe fault run wrote its rows\t{e}")
    sys.exit()
for r in rows:
    what = (f"{r['fault']}: {r['failed_gpu']} pods failed for GPU reasons "
            f"({r['failed_plugin_down']} while the device plugin restarted), {r['over_capacity']} GPUs over capacity, "
            f"{r['pending_without_reason']} pending without a reason, recovered {r['recovered_s']} s after it")
    why = r['verdict']
    if not r['ok'] and r.get('failures'):
        # The kubelet's own words, so that a CI log's tail says which failure it was.
        said = "; ".join(" ".join(f.split()) for f in r['failures'])
        why = f"{why}; the first failures: {said}"
    print(f"{'ok' if r['ok'] else 'bad'}\t{what}\t{why}")
PY
  )
  local verdict what why
  while IFS=$'\t' read -r verdict what why; do
    if [ "$verdict" == ok ]; then ok "$what"; else bad "$what" "$why"; fi
  done <<< "$rows"
}

trap 'exit 130' INT TERM
trap cleanup EXIT
for cluster in $CLUSTERS; do
  run_cluster "${cluster%%/*}" "${cluster#*/}"
done
if [ -z "${GPUMEM_E2E_SCENARIOS:-}" ] || [[ " $GPUMEM_E2E_SCENARIOS " == *" faults "* ]]; then
  run_faults
fi

log "e2e finished in $((SECONDS - started)) s (logs: $OUT)"
for f in "${FAILURES[@]}"; do log "failed: $f"; done
echo "e2e: $PASSED passed, $FAILED failed"
[ "$FAILED" == 0 ]
