# Helpers of the end-to-end suite (sourced by scripts/e2e.sh): assertions, kubectl, pods, the node's
# annotations. Everything is read the way a user would read it: kubectl, JSON paths, events. The
# cluster setup at the end is shared with scripts/scale.sh.

# --- results ------------------------------------------------------------------------------------

PASSED=0
FAILED=0
FAILURES=()
SCENARIO=""

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

scenario() {
  SCENARIO="$1"
  log "== [$KUBELET_KIND] $1"
}

ok() {
  PASSED=$((PASSED + 1))
  log "  ok   $1"
}

bad() {
  FAILED=$((FAILED + 1))
  FAILURES+=("[$KUBELET_KIND] $SCENARIO: $1${2:+ ($2)}")
  log "  FAIL $1${2:+: $2}"
}

# expect_eq DESCRIPTION EXPECTED ACTUAL
expect_eq() {
  if [ "$2" == "$3" ]; then ok "$1"; else bad "$1" "expected '$2', got '$3'"; fi
}

# expect_ne DESCRIPTION UNEXPECTED ACTUAL
expect_ne() {
  if [ "$2" != "$3" ]; then ok "$1"; else bad "$1" "got '$3'"; fi
}

# expect_contains DESCRIPTION NEEDLE HAYSTACK
expect_contains() {
  if [[ "$3" == *"$2"* ]]; then ok "$1"; else bad "$1" "'$2' not in '${3:0:300}'"; fi
}

# eventually DESCRIPTION TIMEOUT_S COMMAND...: polls COMMAND until it succeeds.
eventually() {
  local what=$1 timeout=$2
  shift 2
  local deadline=$((SECONDS + timeout))
  while ! "$@" > /dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      bad "$what" "not within ${timeout}s"
      return 1
    fi
    sleep 0.5
  done
  ok "$what"
}

# --- kubectl ------------------------------------------------------------------------------------

k() { kubectl --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }
kn() { k -n "$NS" "$@"; }

# apply_flow_schema: the scorer's FlowSchema (deploy/manifests/components/flow-schema, in
# flowcontrol.apiserver.k8s.io/v1) in the newest version the cluster serves, as the chart renders it
# (1.24 serves v1beta2; the object is the same in each).
apply_flow_schema() {
  local served version=""
  served=$(k api-versions) || return 1
  for v in v1 v1beta3 v1beta2; do
    grep -qx "flowcontrol.apiserver.k8s.io/$v" <<< "$served" && version=$v && break
  done
  [ -n "$version" ] || return 1
  sed "s|^apiVersion: flowcontrol.apiserver.k8s.io/v1$|apiVersion: flowcontrol.apiserver.k8s.io/$version|" \
    "$ROOT/deploy/manifests/components/flow-schema/scorer-flowschema.yaml" | k apply -f -
}

# pod_field POD JSONPATH
pod_field() { kn get pod "$1" -o "jsonpath={$2}" 2>/dev/null; }

pod_phase() { pod_field "$1" .status.phase; }
pod_node() { pod_field "$1" .spec.nodeName; }
pod_assigned() { pod_field "$1" ".metadata.annotations.gpumem\.io/assigned-gpus"; }
is_running() { [ "$(pod_phase "$1")" == Running ]; }
is_bound() { [ -n "$(pod_node "$1")" ]; }

# pod_env POD NAME: the variable as the container sees it.
pod_env() { kn exec "$1" -- env 2>/dev/null | sed -n "s/^$2=//p"; }

# node_alloc NODE RESOURCE: allocatable as kube-scheduler sees it.
node_alloc() {
  local escaped=${2//./\\.}
  k get node "$1" -o "jsonpath={.status.allocatable.$escaped}" 2>/dev/null
}

node_alloc_is() { [ "$(node_alloc "$1" "$2")" == "$3" ]; }

# pod_events POD: the messages of the pod's events, one per line.
pod_events() {
  kn get events --field-selector "involvedObject.name=$1" -o 'jsonpath={range .items[*]}{.reason}: {.message}{"\n"}{end}' 2>/dev/null
}

has_event() { pod_events "$1" | grep -qF -- "$2"; }

# new_pod NAME RESOURCE AMOUNT [ANNOTATIONS_JSON] [FAKE]: a sleeping busybox pod asking for RESOURCE.
# The amount is written as given (the API server stores its canonical form). FAKE=fake pins the pod
# to the API-only nodes (it tolerates their taint); otherwise it may only run on the real node.
new_pod() {
  local name=$1 resource=$2 amount=$3 annotations=${4:-"{}"} where=${5:-real}
  local placement
  if [ "$where" == fake ]; then
    placement='  tolerations: [{key: harness.local/fake-node, operator: Exists, effect: NoSchedule}]
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms: [{matchExpressions: [{key: harness.local/fake-node, operator: In, values: ["true"]}]}]'
  else
    placement="  nodeSelector: {kubernetes.io/hostname: $REAL_NODE}"
  fi
  kn apply -f - > /dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $name
  annotations: $annotations
spec:
  terminationGracePeriodSeconds: 1
$placement
  containers:
    - name: main
      image: localhost/busybox:harness
      imagePullPolicy: Never
      command: [sleep, "3600"]
      resources:
        limits: {$resource: "$amount"}
EOF
}

# delete_pods NAME...: deletes and waits until they are gone (the agent then sees them leave).
delete_pods() {
  [ $# -gt 0 ] || return 0
  kn delete pod "$@" --grace-period=1 --wait=true --timeout=240s > /dev/null 2>&1 || true
}

# delete_fake_pods NAME...: pods bound to API-only nodes never start; they go by force.
delete_fake_pods() {
  [ $# -gt 0 ] || return 0
  kn delete pod "$@" --grace-period=0 --force --wait=true --timeout=30s > /dev/null 2>&1 || true
}

# --- the node's annotations (as the agent publishes them) ---------------------------------------

node_json() { k get node "$1" -o json; }

# gpu_query NODE EXPR: evaluates a Python expression over the node's GPUs. In scope: `topo` (the
# gpumem.io/gpu-topology annotation's gpus), `usage` (gpumem.io/gpu-usage's gpus), `used`
# (gpumem.io/gpu-used's gpus: what the pods' processes hold), `by_uuid`.
gpu_query() {
  node_json "$1" | python3 -c '
import json, sys
node = json.load(sys.stdin)
ann = node["metadata"].get("annotations", {})
topo = json.loads(ann.get("gpumem.io/gpu-topology", "{\"gpus\": []}"))["gpus"]
usage = json.loads(ann.get("gpumem.io/gpu-usage", "{\"gpus\": []}"))["gpus"]
used = json.loads(ann.get("gpumem.io/gpu-used", "{\"gpus\": []}"))["gpus"]
by_uuid = {g["uuid"]: g for g in topo}
result = eval(sys.argv[1])
print(result if not isinstance(result, (list, tuple)) else " ".join(map(str, result)))
' "$2"
}

gpu_uuid() { gpu_query "$1" "[g['uuid'] for g in topo if g['index'] == $2][0]"; }
gpu_index() { gpu_query "$1" "by_uuid.get('$2', {}).get('index', 'none')"; }
gpu_health() { gpu_query "$1" "[g['health'] for g in topo if g['index'] == $2][0]"; }
# The allocated MiB of each GPU, in index order.
gpu_allocated() { gpu_query "$1" "[u['allocatedMiB'] for u in sorted(usage, key=lambda u: u['index'])]"; }
node_idle() { [ "$(gpu_query "$1" "sum(u['allocatedMiB'] for u in usage) + sum(u['mode'] != 'free' for u in usage)")" == 0 ]; }
# No GPU holds more than it has.
node_within_capacity() {
  [ "$(gpu_query "$1" "all(u['allocatedMiB'] <= [g['memoryMiB'] for g in topo if g['index'] == u['index']][0] for u in usage)")" == True ]
}

# --- cluster setup (scripts/e2e.sh, scripts/scale.sh) ---------------------------------------------

# service_account_kubeconfig NAME FILE [TOKEN_FLAGS...]: a kubeconfig with a token of gpumem-system/NAME
# (`kubectl create token` flags may bind it to a pod).
service_account_kubeconfig() {
  local token
  token=$(k -n gpumem-system create token "$1" --duration=2h "${@:3}") || return 1
  cat > "$2" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: kit
    cluster: {server: "https://127.0.0.1:6443", certificate-authority: "$K8S_STATE/certs/ca.crt"}
users:
  - name: $1
    user: {token: "$token"}
contexts:
  - name: $1
    context: {cluster: kit, user: $1, namespace: gpumem-system}
current-context: $1
EOF
}

# scheduler_config: the project's configuration for the default scheduler (v1beta3 for the kit's 1.24,
# v1 for 1.36), with what differs on this machine: the kubeconfig, no leader election, the scorer's local
# address, the directory of the certificates (its tlsConfig, serverName included, is the shipped one).
# SCHEDULER_KUBECONFIG: the kit's admin (system:masters, exempt from API Priority and Fairness) unless
# the script sets it; `${K8S_STATE}` in it is the kit's to substitute.
SCHEDULER_KUBECONFIG=${SCHEDULER_KUBECONFIG:-'${K8S_STATE}/admin.kubeconfig'}
scheduler_config() {
  local shipped=kube-scheduler-config.yaml
  [ "${K8S_VERSION:-1.24}" != 1.24 ] || shipped=kube-scheduler-config.v1beta3.yaml
  sed -e "s|^  kubeconfig: .*|  kubeconfig: $SCHEDULER_KUBECONFIG|" \
    -e 's|^  leaderElect: true|  leaderElect: false|' \
    -e "s|^  - urlPrefix: https://.*|  - urlPrefix: https://$SCORER_TLS_ADDR|" \
    -e "s|: /etc/kubernetes/gpumem/|: $CERTS/|" \
    "$ROOT/deploy/manifests/default-scheduler/$shipped" > "$RUN_OUT/scheduler.yaml"
  grep -q "urlPrefix: https://$SCORER_TLS_ADDR" "$RUN_OUT/scheduler.yaml" &&
    [ "$(grep -c ": $CERTS/" "$RUN_OUT/scheduler.yaml")" == 3 ] &&
    grep -q 'leaderElect: false' "$RUN_OUT/scheduler.yaml"
}

# start_scorer: as the chart runs it, its TLS files from `gpumem certs` as the Secret holds them, and
# $SCORER_CONFIG_EXTRA (YAML) in its configuration; logs at $SCORER_LOG (RUST_LOG syntax).
start_scorer() {
  cat > "$RUN_OUT/scorer.yaml" <<YAML
tls: {certFile: $CERTS/scorer.crt, keyFile: $CERTS/scorer.key, clientCAFile: $CERTS/ca.crt}
${SCORER_CONFIG_EXTRA:-}
YAML
  KUBECONFIG=$RUN_OUT/scorer.kubeconfig RUST_LOG=${SCORER_LOG:-info,gpumem=debug} \
    "$BIN/gpumem" scorer --listen "$SCORER_ADDR" --tls-listen "$SCORER_TLS_ADDR" \
    --config "$RUN_OUT/scorer.yaml" >> "$RUN_OUT/scorer.log" 2>&1 &
  SCORER_PID=$!
}

# stop_scorer: SIGTERM, as Kubernetes stops it; returns the exit status.
stop_scorer() {
  [ -n "${SCORER_PID:-}" ] || return 0
  kill -TERM "$SCORER_PID" 2> /dev/null
  local status=0
  wait "$SCORER_PID" 2> /dev/null || status=$?
  SCORER_PID=""
  return $status
}
