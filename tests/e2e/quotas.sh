# Quotas by GPU memory on the DRA path (sourced by scripts/e2e.sh; Kubernetes 1.36): the namespace's
# ResourceQuota gpumem limits its ResourceClaims of gpu.gpumem.io by memory and by whole GPUs. The claim
# controller runs with --dra-quotas and records what the claims ask on the quota; the chart's
# ValidatingAdmissionPolicy (components/dra-quotas) refuses a claim past it, with a clear message, and
# nothing else changes.

DRA_SCENARIOS=${DRA_SCENARIOS/dra_uninstall/dra_quotas dra_uninstall}
QUOTA_NS=e2e-quota

kq() { k -n "$QUOTA_NS" "$@"; }
# quota_claim NAME REQUEST [FLAG]: creates a ResourceClaim whose one request is REQUEST (YAML flow,
# inside exactly), with kubectl's FLAG (--dry-run=server); prints kubectl's answer.
quota_claim() {
  kq create ${3:-} -f - 2>&1 <<EOF2
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: $1}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.gpumem.io$2}}]}}
EOF2
}
recorded_use() {
  kq get resourcequota gpumem \
    -o 'jsonpath={.metadata.annotations.gpumem\.io/dra-memory-mib}/{.metadata.annotations.gpumem\.io/dra-gpus}' 2> /dev/null
}
recorded_is() { [ "$(recorded_use)" == "$1" ]; }

scenario_dra_quotas() {
  scenario "DRA quotas: the namespace's ResourceQuota gpumem limits its claims by GPU memory and whole GPUs"
  stop_claims
  CLAIMS_EXTRA=--dra-quotas start_claims
  if ! k apply -f "$ROOT/deploy/manifests/components/dra-quotas/dra-quotas.yaml" > "$RUN_OUT/dra-quotas.log" 2>&1; then
    bad "the quota admission policy applies" "$(cat "$RUN_OUT/dra-quotas.log")"
    return
  fi
  k create namespace "$QUOTA_NS" > /dev/null
  kq apply -f - > /dev/null <<EOF2
apiVersion: v1
kind: ResourceQuota
metadata: {name: gpumem}
spec: {hard: {requests.nvidia.com/gpu-mem: "10000", requests.nvidia.com/gpu: "1"}}
EOF2
  eventually "the claim controller records that no claim holds anything" 30 recorded_is 0/0
  local out
  # The API server sees a new policy and its binding within a second or so.
  eventually "the policy is in force (a dry run of 20000Mi is refused)" 30 \
    eval '[[ "$(quota_claim probe ", capacity: {requests: {memory: 20000Mi}}" --dry-run=server)" == *"quota exceeded"* ]]'
  # The policy reads a claim as src/quota/mod.rs does (its test a_claim_the_policy_reads_so: 43072).
  out=$(kq create --dry-run=server -f - 2>&1 <<EOF2
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: mixed}
spec: {devices: {requests: [{name: gpu, firstAvailable: [{name: big, deviceClassName: gpu.gpumem.io, capacity: {requests: {memory: 40000Mi}}}, {name: small, deviceClassName: gpu.gpumem.io, capacity: {requests: {memory: 1000Mi}}}]}, {name: two, exactly: {deviceClassName: gpu.gpumem.io, count: 2, capacity: {requests: {memory: 1.5Gi}}}}]}}
EOF2
  )
  expect_contains "the policy counts a prioritized list and a count as the controller does" "the claim asks 43072 MiB" "$out"
  out=$(quota_claim q1 ", capacity: {requests: {memory: 6000Mi}}")
  expect_contains "a 6000Mi claim is admitted" "created" "$out"
  eventually "the quota records 6000 MiB" 30 recorded_is 6000/0
  out=$(quota_claim q2 ", capacity: {requests: {memory: 6000Mi}}")
  expect_contains "a second 6000Mi claim is refused, saying why" \
    "GPU memory quota exceeded in namespace $QUOTA_NS: the claim asks 6000 MiB, the namespace's claims hold 6000 MiB of the 10000 MiB its ResourceQuota gpumem allows" "$out"
  expect_eq "nothing else changed: one claim, 6000 MiB recorded" "q1 6000/0" \
    "$(kq get resourceclaims -o 'jsonpath={.items[*].metadata.name}') $(recorded_use)"
  out=$(quota_claim q3 ", capacity: {requests: {memory: 4000Mi}}")
  expect_contains "a 4000Mi claim fits the rest exactly" "created" "$out"
  out=$(quota_claim w1 "")
  expect_contains "a whole GPU is admitted" "created" "$out"
  eventually "the quota records 10000 MiB and 1 GPU" 30 recorded_is 10000/1
  out=$(quota_claim w2 ", count: 1")
  expect_contains "a second whole GPU is refused" \
    "GPU quota exceeded in namespace $QUOTA_NS: the claim asks 1 whole GPUs, the namespace's claims hold 1 of the 1" "$out"
  kq delete resourceclaim q1 > /dev/null 2>&1
  eventually "a deleted claim gives its memory back to the quota" 30 recorded_is 4000/1
  out=$(quota_claim q4 ", capacity: {requests: {memory: 6000Mi}}")
  expect_contains "then 6000Mi fits again" "created" "$out"
  # An edited record is written again.
  kq annotate --overwrite resourcequota gpumem gpumem.io/dra-memory-mib=nonsense > /dev/null
  eventually "a record edited by hand is written again" 30 recorded_is 10000/1
  k delete namespace "$QUOTA_NS" --wait=false > /dev/null 2>&1
  k delete -f "$ROOT/deploy/manifests/components/dra-quotas/dra-quotas.yaml" --ignore-not-found > /dev/null 2>&1
  stop_claims
  start_claims
}
