# The DRA placer on the pods users write (sourced by scripts/e2e.sh after placement.sh; Kubernetes
# 1.36+): CEL selectors on the model and on memory, an NVLink pair, a claim of two requests, a pod of
# two claims, a prioritized list, a node selector, a required node affinity, a tainted node with and
# without the toleration, and a node without the CPU a pod asks. Each pod is placed by gpumem (the
# shares are the claim's UID), on a node and GPU it may use, within seconds; none is given back.
#
# The nodes: the real one (`mixed`: gpu-0 and gpu-1 V100-SXM2-32GB NVLinked, gpu-2 and gpu-3 T4) and
# the API-only gpu-node-3 (4 x T4, tainted harness.local/fake-node=true:NoSchedule, 8 CPUs), made a
# DRA node here with the ResourceSlice its agent would publish (`gpumem inspect`). Runs after
# dra_placement, with its placement policy and scorer configuration on (dra_preempt, next, turns them
# off at the end).

DRA_SCENARIOS=${DRA_SCENARIOS/dra_uninstall/dra_placer dra_uninstall}
FAKE_DRA_NODE=gpu-node-3

# fake_dra_slice: gpu-node-3's ResourceSlice, as an agent on a 4 x T4 node publishes it.
fake_dra_slice() {
  "$BIN/gpumem" inspect --profile t4x4 --output json | python3 -c '
import json, sys
spec = json.load(sys.stdin)["resourceSlice"]
node = sys.argv[1]
spec["nodeName"] = node
spec["pool"]["name"] = node
print(json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                  "metadata": {"name": node + "-" + spec["driver"]}, "spec": spec}))' "$FAKE_DRA_NODE"
}

# template NAME DEVICES: a ResourceClaimTemplate whose spec.devices is DEVICES (YAML, 6 spaces in).
template() {
  kn apply -f - > /dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: $1}
spec:
  spec:
    devices:
$2
EOF
}

# placer_pod NAME SPEC TEMPLATE...: a sleeping pod with one claim per TEMPLATE, each used by a container
# of its own, and SPEC (YAML lines under spec, 2 spaces in, each after a newline).
placer_pod() {
  local name=$1 spec=$2 claims="" containers="" i=0 t
  shift 2
  for t in "$@"; do
    claims+="
    - {name: c$i, resourceClaimTemplateName: $t}"
    containers+="
    - name: main$i
      image: localhost/busybox:harness
      imagePullPolicy: Never
      command: [sleep, \"3600\"]
      resources: {claims: [{name: c$i}]}"
    i=$((i + 1))
  done
  kn apply -f - > /dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $name}
spec:
  terminationGracePeriodSeconds: 1$spec
  resourceClaims:$claims
  containers:$containers
EOF
}

TOLERATES_FAKE="
  tolerations: [{key: harness.local/fake-node, operator: Exists, effect: NoSchedule}]"

# nth_claim POD N: the name of the pod's claim `cN` (the status lists them in no set order).
nth_claim() { pod_field "$1" ".status.resourceClaimStatuses[?(@.name==\"c$2\")].resourceClaimName"; }
# resource_claim_field POD N JSONPATH: a field of the pod's Nth claim.
resource_claim_field() { kn get resourceclaim "$(nth_claim "$1" "$2")" -o "jsonpath={$3}" 2> /dev/null; }
# results POD N FIELD: that field of every allocation result of the pod's Nth claim, sorted.
results() { resource_claim_field "$1" "$2" ".status.allocation.devices.results[*].$3" | tr ' ' '\n' | sort | tr '\n' ' ' | sed 's/ $//'; }
# placed_by_gpumem POD N: the Nth claim is allocated and its first share is the claim's UID.
placed_by_gpumem() {
  local uid share
  uid=$(resource_claim_field "$1" "$2" .metadata.uid)
  share=$(resource_claim_field "$1" "$2" '.status.allocation.devices.results[0].shareID')
  [ -n "$uid" ] && [ "$uid" == "$share" ]
}
# claim_managers POD N: who wrote the pod's Nth claim (its managedFields' managers).
claim_managers() {
  kn get resourceclaim "$(nth_claim "$1" "$2")" --show-managed-fields -o 'jsonpath={.metadata.managedFields[*].manager}' 2> /dev/null
}
# placer_writes POD N: the subresource of each of the placer's entries in the Nth claim's managedFields.
placer_writes() {
  kn get resourceclaim "$(nth_claim "$1" "$2")" --show-managed-fields \
    -o 'jsonpath={range .metadata.managedFields[?(@.manager=="gpumem-placer")]}{.subresource}{";"}{end}' 2> /dev/null
}
all_placed_by_gpumem() {
  local pod=$1 n=$2 i
  for ((i = 0; i < n; i++)); do placed_by_gpumem "$pod" "$i" || return 1; done
}
# container_env POD CONTAINER VAR: VAR in that container of the pod.
container_env() { kn exec "$1" -c "$2" -- env 2> /dev/null | sed -n "s/^$3=//p"; }
bound_to() { [ "$(pod_node "$1")" == "$2" ]; }
never_given_back() { ! grep "given back" "$RUN_OUT/scorer.log" | grep -qF "$NS/$1"; }

# check_placed POD CLAIMS NODE DEVICES...: the pod's CLAIMS claims are gpumem's, the pod is bound to
# NODE, and the first claim's devices are one of DEVICES (each a sorted, space-separated list).
check_placed() {
  local pod=$1 claims=$2 node=$3 got
  shift 3
  expect_eq "$pod: every claim placed by gpumem (shares are the claims' UIDs)" yes \
    "$(all_placed_by_gpumem "$pod" "$claims" && echo yes || echo no)"
  expect_eq "$pod: bound to $node" "$node" "$(pod_node "$pod")"
  # The placer reserves the claim for the pod, so kube-scheduler's PreBind has nothing to write.
  local managers
  managers=$(claim_managers "$pod" 0)
  if [ -n "$managers" ] && [[ " $managers " != *" kube-scheduler "* ]]; then
    ok "$pod: kube-scheduler made no write to its claim (written by: $managers)"
  else
    bad "$pod: kube-scheduler made no write to its claim" "written by: $managers"
  fi
  # The claim was made with its finalizer (the claims' admission policy): one write of the placer's.
  expect_eq "$pod: the placer wrote its claim once, the status" "status;" "$(placer_writes "$pod" 0)"
  got=$(results "$pod" 0 device)
  local want
  for want in "$@"; do
    if [ "$got" == "$want" ]; then
      ok "$pod: on $got"
      return
    fi
  done
  bad "$pod: on one of: $*" "$got"
}

scenario_dra_placer() {
  scenario "DRA placer: selectors, constraints, several requests and claims, node rules"
  local cpus ON_REAL_NODE="
  nodeSelector: {kubernetes.io/hostname: $REAL_NODE}"
  wait_dra_idle
  if ! fake_dra_slice | k apply -f - > "$RUN_OUT/fake-slice.log" 2>&1; then
    bad "$FAKE_DRA_NODE publishes a ResourceSlice" "$(cat "$RUN_OUT/fake-slice.log")"
    return
  fi
  ok "$FAKE_DRA_NODE publishes the ResourceSlice of a 4 x T4 node"

  # An NVLink island of two whole GPUs, while every GPU is free.
  template pr-pair "      requests:
        - name: gpus
          exactly: {deviceClassName: gpu.gpumem.io, count: 2}
      constraints:
        - {requests: [gpus], matchAttribute: gpumem.io/nvlinkDomain}"
  placer_pod pr-pair "$ON_REAL_NODE" pr-pair
  eventually "an NVLink pair (matchAttribute) runs" 30 is_running pr-pair
  check_placed pr-pair 1 "$REAL_NODE" "gpu-0 gpu-1"
  delete_pods pr-pair
  wait_dra_idle

  # The model by CEL, with a node selector.
  template pr-t4 "      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu.gpumem.io
            selectors: [{cel: {expression: 'device.attributes[\"gpumem.io\"].productName == \"Tesla T4\"'}}]
            capacity: {requests: {memory: 3000Mi}}"
  placer_pod pr-t4 "$ON_REAL_NODE" pr-t4
  eventually "a T4 by CEL selector, with a node selector, runs" 30 is_running pr-t4
  check_placed pr-t4 1 "$REAL_NODE" gpu-2 gpu-3
  expect_eq "pr-t4: its gpumem.io/placement annotation names the node, claim and GPU" \
    "on node $REAL_NODE: $(nth_claim pr-t4 0): $(results pr-t4 0 device) 3000Mi" \
    "$(pod_field pr-t4 '.metadata.annotations.gpumem\.io/placement')"
  check_claim_pod pr-t4 3000

  # Memory by CEL: the capacity as a quantity and the memoryMiB attribute. The fake node's taint keeps
  # the pod on the real node without a selector.
  template pr-big "      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu.gpumem.io
            selectors:
              - cel: {expression: 'device.capacity[\"gpumem.io\"].memory.compareTo(quantity(\"20Gi\")) >= 0 && device.attributes[\"gpumem.io\"].memoryMiB >= 30000'}
            capacity: {requests: {memory: 2000Mi}}"
  placer_pod pr-big "" pr-big
  eventually "a GPU of 20Gi or more by CEL selector runs" 30 is_running pr-big
  check_placed pr-big 1 "$REAL_NODE" gpu-0 gpu-1

  # Two requests of one claim: the agent serves a claim's memory from one GPU, so both go on one.
  template pr-two "      requests:
        - name: a
          exactly: {deviceClassName: gpu.gpumem.io, capacity: {requests: {memory: 1000Mi}}}
        - name: b
          exactly: {deviceClassName: gpu.gpumem.io, capacity: {requests: {memory: 2000Mi}}}"
  placer_pod pr-two "$ON_REAL_NODE" pr-two
  eventually "a claim of two requests runs" 30 is_running pr-two
  check_placed pr-two 1 "$REAL_NODE" "gpu-0 gpu-0" "gpu-1 gpu-1" "gpu-2 gpu-2" "gpu-3 gpu-3"
  expect_eq "pr-two: its results are requests a and b" "a b" "$(results pr-two 0 request)"
  expect_eq "pr-two: the limit is both requests' memory" 3000 "$(pod_env pr-two GPUMEM_LIMIT_MIB)"

  # Two claims in one pod, a container each.
  template pr-1000 "      requests:
        - name: gpu
          exactly: {deviceClassName: gpu.gpumem.io, capacity: {requests: {memory: 1000Mi}}}"
  placer_pod pr-duo "$ON_REAL_NODE" pr-t4 pr-1000
  eventually "a pod of two claims runs" 30 is_running pr-duo
  check_placed pr-duo 2 "$REAL_NODE" gpu-2 gpu-3
  expect_eq "pr-duo: each container has its claim's limit" "3000/1000" \
    "$(container_env pr-duo main0 GPUMEM_LIMIT_MIB)/$(container_env pr-duo main1 GPUMEM_LIMIT_MIB)"

  # A prioritized list: 40000Mi fits no GPU, the second choice does.
  template pr-first "      requests:
        - name: gpu
          firstAvailable:
            - {name: big, deviceClassName: gpu.gpumem.io, capacity: {requests: {memory: 40000Mi}}}
            - {name: small, deviceClassName: gpu.gpumem.io, capacity: {requests: {memory: 1000Mi}}}"
  placer_pod pr-first "$ON_REAL_NODE" pr-first
  eventually "a firstAvailable list runs on its second choice" 30 is_running pr-first
  check_placed pr-first 1 "$REAL_NODE" gpu-0 gpu-1 gpu-2 gpu-3
  expect_eq "pr-first: the result names the sub-request" gpu/small "$(results pr-first 0 request)"

  # A required node affinity.
  placer_pod pr-affinity "
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [$REAL_NODE]}]" pr-1000
  eventually "a pod with a required node affinity runs" 30 is_running pr-affinity
  check_placed pr-affinity 1 "$REAL_NODE" gpu-0 gpu-1 gpu-2 gpu-3
  # Placed, a pod is pinned to its node (kube-scheduler then filters that node alone): its one term
  # keeps its own requirement and gains the node's name.
  local term='.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms'
  expect_eq "pr-affinity: pinned to $REAL_NODE in its one term, its own requirement kept" \
    "kubernetes.io/hostname metadata.name In $REAL_NODE" \
    "$(kn get pod pr-affinity -o "jsonpath={$term[*].matchExpressions[0].key} {$term[*].matchFields[0].key} {$term[*].matchFields[0].operator} {$term[*].matchFields[0].values[*]}" 2> /dev/null)"

  # The tainted node: without the toleration the pod waits gated and the scorer says why; with it,
  # the pod is placed there.
  placer_pod pr-taint "
  nodeSelector: {kubernetes.io/hostname: $FAKE_DRA_NODE}" pr-1000
  eventually "a pod that does not tolerate the only node it may use waits: the scorer says why" 30 \
    scorer_said "untolerated taint" "$NS/pr-taint"
  expect_eq "pr-taint: gated, its claim unallocated" "SchedulingGated/" \
    "$(pod_field pr-taint '.status.conditions[?(@.type=="PodScheduled")].reason')/$(results pr-taint 0 device)"
  eventually "pr-taint: an Event on the pod says why it waits" 30 has_event pr-taint "untolerated taint"
  placer_pod pr-tolerates "
  nodeSelector: {kubernetes.io/hostname: $FAKE_DRA_NODE}$TOLERATES_FAKE" pr-1000
  eventually "with the toleration it is bound to $FAKE_DRA_NODE" 30 bound_to pr-tolerates "$FAKE_DRA_NODE"
  check_placed pr-tolerates 1 "$FAKE_DRA_NODE" gpu-0 gpu-1 gpu-2 gpu-3
  expect_eq "pr-tolerates: the claim's pool is $FAKE_DRA_NODE" "$FAKE_DRA_NODE" "$(results pr-tolerates 0 pool)"

  # More CPU than the real node has: the placer puts it on the node with room (8 CPUs).
  cpus=$(k get node "$REAL_NODE" -o jsonpath='{.status.allocatable.cpu}')
  cpus=$(python3 -c 'import sys; q = sys.argv[1]; print(int(q[:-1]) // 1000 + 1 if q.endswith("m") else int(q) + 1)' "$cpus")
  kn apply -f - > /dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: pr-cpu}
spec:
  terminationGracePeriodSeconds: 1$TOLERATES_FAKE
  resourceClaims: [{name: c0, resourceClaimTemplateName: pr-1000}]
  containers:
    - name: main0
      image: localhost/busybox:harness
      imagePullPolicy: Never
      command: [sleep, "3600"]
      resources: {claims: [{name: c0}], requests: {cpu: "$cpus"}}
EOF
  eventually "a pod asking $cpus CPUs (the real node has fewer) is bound to $FAKE_DRA_NODE" 30 \
    bound_to pr-cpu "$FAKE_DRA_NODE"
  check_placed pr-cpu 1 "$FAKE_DRA_NODE" gpu-0 gpu-1 gpu-2 gpu-3
  expect_eq "pr-cpu (no node affinity of its own): pinned to $FAKE_DRA_NODE by one term" "$FAKE_DRA_NODE" \
    "$(pod_field pr-cpu "$term[*].matchFields[?(@.key==\"metadata.name\")].values[*]")"

  local pod
  for pod in pr-t4 pr-big pr-two pr-duo pr-first pr-affinity pr-taint pr-tolerates pr-cpu; do
    never_given_back "$pod" && ok "$pod: never given back" || bad "$pod: never given back"
  done
  delete_pods pr-t4 pr-big pr-two pr-duo pr-first pr-affinity pr-taint
  delete_fake_pods pr-tolerates pr-cpu
  k delete resourceslice "$FAKE_DRA_NODE-$DRIVER" --ignore-not-found > /dev/null 2>&1
  eventually "the pods' claims are gone" 60 no_claims
  wait_dra_idle
}
