#!/usr/bin/env bash
# Scheduling at scale through the REAL kube-scheduler (the kit in ../shared/k8s, Kubernetes 1.24, or
# 1.36 with GPUMEM_SCALE_K8S=1.36): API-only GPU nodes carrying what the agent publishes, pods with the
# openb trace's GPU sizes, once per mode: `extender` (the shipped default-scheduler config, the scorer as
# its service account over TLS, as scripts/e2e.sh sets them up), `alone` (kube-scheduler alone),
# `ceiling` (kube-scheduler alone on the same pods without their GPU asks: what this machine's control
# plane binds, the ceiling the other modes are a share of), and on
# 1.36 the DRA path: `dra-alone` (a ResourceSlice per node, pods with claims, kube-scheduler's own
# allocator) and `dra-gpumem` (the same with gpumem's placement: the admission policy of
# components/dra-placement and the scorer's `dra:` configuration). gpumem-scale (scale/)
# creates the nodes, keeps them Ready, plays the agent for the pods bound there and measures
# (docs/scale.md). Run as root:
#
#   sudo scripts/scale.sh
#
# Environment:
#   GPUMEM_K8S_KIT          the kit (../shared/k8s)
#   K8S_STATE               the kit's state dir (/tmp/gpumem-scale)
#   GPUMEM_SCALE_NODES      node counts, space-separated ("1000"; e.g. "1000 500")
#   GPUMEM_SCALE_MODES      "extender alone" (also: ceiling; dra-alone dra-gpumem, on 1.36)
#   GPUMEM_SCALE_K8S        the kit's Kubernetes: 1.24 or 1.36 (1.24)
#   GPUMEM_SCALE_SATURATE   saturation phase: trace pods offered, past those that wait, until their GPU
#                           demand reaches this % of the GPU memory (whole GPUs at the mean GPU's memory);
#                           then the memory left unallocated and each class's placed share (0: none)
#   GPUMEM_SCALE_RATE       steady phase, pods created per second (100)
#   GPUMEM_SCALE_DURATION   steady phase, seconds (30)
#   GPUMEM_SCALE_BURST      burst phase, pods (3000)
#   GPUMEM_SCALE_FILL       fill phase, pods of 1000 MiB left bound to read the scorer's memory (20000; 0: none)
#   GPUMEM_SCALE_SEED       seed of the pod order and of the node profiles' placement (1)
#   GPUMEM_SCALE_MIX        the pod/node mix: trace (the trace's sizes only) or realistic (zones, the GPU
#                           taint, reserved nodes, zone and GPU-model selectors; docs/scale.md) (trace)
#   GPUMEM_SCALE_TRACE      the openb pod list (../shared/traces/openb/openb_pod_list_default.csv)
#   GPUMEM_SCALE_OUT        results (target/scale): <nodes>-<mode>/{summary.json,pods.csv,stdout.txt,logs/}
#   GPUMEM_SCALE_QPS, GPUMEM_SCALE_QPS_BURST   kube-scheduler's client rate limit, both modes (500, 1000)
#   GPUMEM_SCALE_DRA_CONFIG YAML lines added to the scorer's `dra:` configuration in dra-gpumem (e.g.
#                           "pinToNode: false"), to compare its settings ("")
#   GPUMEM_SCALE_CHART      the SVG written from the first node count's two runs (docs/scale.svg, with the
#                           realistic mix $GPUMEM_SCALE_OUT/scale-realistic.svg; "" for none)

set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=$(cd "${GPUMEM_K8S_KIT:-$ROOT/../shared/k8s}" 2> /dev/null && pwd) || {
  echo "error: the Kubernetes kit is not at ${GPUMEM_K8S_KIT:-$ROOT/../shared/k8s} (set GPUMEM_K8S_KIT)" >&2
  exit 2
}
export K8S_STATE=${K8S_STATE:-/tmp/gpumem-scale}
NODE_COUNTS=${GPUMEM_SCALE_NODES:-1000}
MODES=${GPUMEM_SCALE_MODES:-extender alone}
RATE=${GPUMEM_SCALE_RATE:-100}
DURATION=${GPUMEM_SCALE_DURATION:-30}
BURST=${GPUMEM_SCALE_BURST:-3000}
FILL=${GPUMEM_SCALE_FILL:-20000}
SATURATE=${GPUMEM_SCALE_SATURATE:-0}
DRA_CONFIG=${GPUMEM_SCALE_DRA_CONFIG:-}
export K8S_VERSION=${GPUMEM_SCALE_K8S:-1.24}
for m in $MODES; do
  case "$m" in
    extender | alone | ceiling) ;;
    dra-alone | dra-gpumem)
      [ "$K8S_VERSION" != 1.24 ] || {
        echo "error: mode $m needs Kubernetes 1.36 (GPUMEM_SCALE_K8S=1.36)" >&2
        exit 2
      }
      ;;
    *)
      echo "error: unknown mode $m (extender, alone, ceiling, dra-alone, dra-gpumem)" >&2
      exit 2
      ;;
  esac
done
SEED=${GPUMEM_SCALE_SEED:-1}
MIX=${GPUMEM_SCALE_MIX:-trace}
case "$MIX" in
  trace | realistic) ;;
  *)
    echo "error: unknown mix $MIX (trace, realistic)" >&2
    exit 2
    ;;
esac
TRACE=${GPUMEM_SCALE_TRACE:-$ROOT/../shared/traces/openb/openb_pod_list_default.csv}
OUT=${GPUMEM_SCALE_OUT:-$ROOT/target/scale}
# The README's chart is of the trace mix: a realistic run draws its own beside its results.
default_chart=$ROOT/docs/scale.svg
[ "$MIX" == trace ] || default_chart=$OUT/scale-$MIX.svg
CHART=${GPUMEM_SCALE_CHART-$default_chart}
# kube-scheduler's client-side rate limit, raised the same way in both modes. 1.24's default (qps
# 50, burst 100) caps every request kube-scheduler makes, and with kube-scheduler alone each pod costs
# one binding POST: it could not bind more than ~50 pods/s, which would measure the limiter, not the
# scheduler. With the extender the scorer binds (its own client), so only the default would differ.
SCHED_QPS=${GPUMEM_SCALE_QPS:-500}
SCHED_QPS_BURST=${GPUMEM_SCALE_QPS_BURST:-1000}
if [ "$(id -u)" != 0 ]; then
  echo "error: the kit runs a kubelet and containerd: run as root" >&2
  exit 2
fi
[ -r "$TRACE" ] || {
  echo "error: no trace at $TRACE (set GPUMEM_SCALE_TRACE)" >&2
  exit 2
}

# kube-scheduler as itself (system:kube-scheduler, the kit's certificate), as in a cluster: API
# Priority and Fairness puts its requests in workload-high, where the scorer's FlowSchema puts the
# scorer's; as the kit's admin it was exempt, and the paths it was compared with were not.
SCHEDULER_KUBECONFIG='${K8S_STATE}/certs/scheduler.kubeconfig'
source "$ROOT/tests/e2e/lib.sh" # log, k, service_account_kubeconfig, scheduler_config

SCORER_ADDR=127.0.0.1:18888     # probes and metrics
SCORER_TLS_ADDR=127.0.0.1:18443 # the extender's verbs, for kube-scheduler's client certificate
ADMIN_KUBECONFIG=$K8S_STATE/admin.kubeconfig
started=$SECONDS

log "building the release binaries"
(cd "$ROOT" && cargo build --locked --release -p gpumem --bin gpumem -p gpumem-scale --bin gpumem-scale) || exit 1
# What is measured is what was just built: a later build must not swap the binary under a run.
BIN=$OUT/bin
mkdir -p "$BIN"
for f in gpumem gpumem-scale; do
  cp "$ROOT/target/release/$f" "$BIN/$f.new" && mv -f "$BIN/$f.new" "$BIN/$f" || exit 1
done

SCORER_PID=""
RUN_OUT=""
SCORER_LOG=info # start_scorer (tests/e2e/lib.sh): debug lines would cost the scorer CPU at this rate

cleanup() {
  stop_scorer
  if [ -n "$RUN_OUT" ]; then
    mkdir -p "$RUN_OUT/logs"
    for c in etcd kube-apiserver kube-controller-manager kube-scheduler; do
      cp "$K8S_STATE/logs/$c.log" "$RUN_OUT/logs/" 2> /dev/null
    done
    "$KIT/down.sh" > "$RUN_OUT/down.log" 2>&1
    RUN_OUT=""
  fi
}

# with_scheduler_qps FILE: kube-scheduler's clientConnection gets the raised qps/burst.
with_scheduler_qps() {
  sed -i -e "s|^  kubeconfig: \(.*\)|  kubeconfig: \1\n  qps: $SCHED_QPS\n  burst: $SCHED_QPS_BURST|" "$1" &&
    grep -q "^  qps: $SCHED_QPS" "$1"
}

# run_one NODES MODE: a fresh cluster, the setup of MODE, gpumem-scale's phases, the cluster down.
run_one() {
  local nodes=$1 mode=$2
  RUN_OUT=$OUT/$nodes-$mode
  rm -rf "$RUN_OUT"
  mkdir -p "$RUN_OUT"
  log "== $nodes nodes, $mode (results: $RUN_OUT)"
  "$KIT/down.sh" > /dev/null 2>&1
  CERTS=$RUN_OUT/certs
  if [ "$mode" == extender ] || [ "$mode" == dra-gpumem ]; then
    "$BIN/gpumem" certs --out "$CERTS" > "$RUN_OUT/certs.log" 2>&1 || {
      log "gpumem certs failed: $(cat "$RUN_OUT/certs.log")"
      return 1
    }
  fi
  local kit_config=$KIT/config/scheduler-config.yaml
  [ "$K8S_VERSION" == 1.24 ] || kit_config=$KIT/config/$K8S_VERSION/scheduler-config.yaml
  if [ "$mode" == extender ]; then
    scheduler_config || {
      log "the scheduler configuration did not render (see $RUN_OUT/scheduler.yaml)"
      return 1
    }
  else
    sed "s|^  kubeconfig: .*|  kubeconfig: $SCHEDULER_KUBECONFIG|" \
      "$kit_config" > "$RUN_OUT/scheduler.yaml"
  fi
  with_scheduler_qps "$RUN_OUT/scheduler.yaml" || {
    log "cannot raise kube-scheduler's qps in $RUN_OUT/scheduler.yaml"
    return 1
  }
  if ! SCHEDULER_CONFIG=$RUN_OUT/scheduler.yaml EXTRA_NODES=0 "$KIT/up.sh" > "$RUN_OUT/up.log" 2>&1; then
    log "the kit's cluster did not start (see $RUN_OUT/up.log)"
    return 1
  fi
  local base=$ROOT/deploy/manifests/base
  if ! k apply -f "$base/namespace.yaml" -f "$base/agent-rbac.yaml" -f "$base/scorer-rbac.yaml" \
    -f "$base/claims-rbac.yaml" -f "$base/gpuclaim-crd.yaml" -f "$base/priorityclasses.yaml" \
    > "$RUN_OUT/rbac.log" 2>&1 || ! apply_flow_schema >> "$RUN_OUT/rbac.log" 2>&1; then
    log "the shipped RBAC did not apply: $(cat "$RUN_OUT/rbac.log")"
    return 1
  fi
  # The DRA path: the DeviceClass; with gpumem's placement, the scorer's DRA role and the policy
  # that gates claim pods.
  local dra=()
  case "$mode" in
    dra-alone) dra=(-f "$ROOT/deploy/manifests/components/dra/dra.yaml") ;;
    dra-gpumem)
      dra=(-f "$ROOT/deploy/manifests/components/dra/dra.yaml" -f "$base/scorer-dra-rbac.yaml"
        -f "$ROOT/deploy/manifests/components/dra-placement/placement.yaml")
      ;;
  esac
  if [ ${#dra[@]} -gt 0 ] && ! k apply "${dra[@]}" > "$RUN_OUT/dra.log" 2>&1; then
    log "the DRA objects did not apply: $(cat "$RUN_OUT/dra.log")"
    return 1
  fi
  local scorer_args=()
  SCORER_CONFIG_EXTRA=""
  [ "$mode" != dra-gpumem ] ||
    SCORER_CONFIG_EXTRA=$(sed -n '/^    dra:/,$p' "$ROOT/deploy/manifests/components/dra-placement/scorer-config.yaml" | sed 's/^    //')
  [ "$mode" != dra-gpumem ] || [ -z "$DRA_CONFIG" ] ||
    SCORER_CONFIG_EXTRA="$SCORER_CONFIG_EXTRA
$(sed 's/^/  /' <<< "$DRA_CONFIG")"
  if [ "$mode" == extender ] || [ "$mode" == dra-gpumem ]; then
    service_account_kubeconfig gpumem-scorer "$RUN_OUT/scorer.kubeconfig" || {
      log "no token for the scorer's service account"
      return 1
    }
    # A scorer left by a killed run would answer for this one (kube-scheduler would talk to it).
    if curl -s -o /dev/null "http://$SCORER_ADDR/readyz"; then
      log "something already listens on $SCORER_ADDR (a scorer left by an earlier run?); stop it first"
      return 1
    fi
    start_scorer
    local i
    for ((i = 0; i < 60; i++)); do
      curl -sf "http://$SCORER_ADDR/readyz" > /dev/null && break
      sleep 0.5
    done
    curl -sf "http://$SCORER_ADDR/readyz" > /dev/null || {
      log "the scorer is not ready (see $RUN_OUT/scorer.log)"
      return 1
    }
    scorer_args=(--scorer-pid "$SCORER_PID")
  fi
  log "cluster up in $((SECONDS - started)) s so far; gpumem-scale runs"
  KUBECONFIG=$ADMIN_KUBECONFIG "$BIN/gpumem-scale" run --mode "$mode" --nodes "$nodes" \
    --rate "$RATE" --duration "$DURATION" --burst "$BURST" --fill "$FILL" --saturate "$SATURATE" --seed "$SEED" --mix "$MIX" \
    --trace "$TRACE" --out "$RUN_OUT" --k8s-state "$K8S_STATE" "${scorer_args[@]}" \
    > "$RUN_OUT/stdout.txt" 2> >(tee "$RUN_OUT/progress.log" >&2)
  local status=$?
  cat "$RUN_OUT/stdout.txt"
  # The nodes' readiness as kubectl shows it, after the whole run.
  k get nodes --no-headers 2> /dev/null | awk '{print $2}' | sort | uniq -c > "$RUN_OUT/nodes-ready.txt"
  log "nodes by status at the end: $(tr '\n' ' ' < "$RUN_OUT/nodes-ready.txt")"
  # The API server's own counts (requests by verb and resource, flow control's waits by priority
  # level): where a path's time goes when the API server is the limit.
  k get --raw /metrics > "$RUN_OUT/apiserver-metrics.txt" 2> /dev/null
  if [ -n "$SCORER_PID" ]; then
    curl -sf "http://$SCORER_ADDR/metrics" > "$RUN_OUT/scorer-metrics.txt" 2> /dev/null
  fi
  cleanup
  return $status
}

trap 'exit 130' INT TERM
trap cleanup EXIT
failed=0
for nodes in $NODE_COUNTS; do
  for mode in $MODES; do
    run_one "$nodes" "$mode" || {
      failed=1
      log "FAILED: $nodes nodes, $mode"
      cleanup
    }
  done
done

first=${NODE_COUNTS%% *}
if [ -n "$CHART" ] && [ -f "$OUT/$first-extender/summary.json" ] && [ -f "$OUT/$first-alone/summary.json" ]; then
  "$BIN/gpumem-scale" chart --extender "$OUT/$first-extender" --alone "$OUT/$first-alone" --out "$CHART" &&
    log "chart: $CHART"
fi
dirs=()
for nodes in $NODE_COUNTS; do
  for mode in $MODES; do
    [ -f "$OUT/$nodes-$mode/summary.json" ] && dirs+=("$OUT/$nodes-$mode")
  done
done
[ ${#dirs[@]} -gt 0 ] && "$BIN/gpumem-scale" table "${dirs[@]}"
log "scale finished in $((SECONDS - started)) s (results: $OUT)"
exit $failed
