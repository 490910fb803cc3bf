# Placement on the DRA path (sourced by scripts/e2e.sh after dra.sh; Kubernetes 1.36+): with the
# MutatingAdmissionPolicy of components/dra-placement and the scorer's `dra:` configuration, gpumem,
# not kube-scheduler's first fit, chooses the GPU of each claim. The node serves the `mixed` profile:
# gpu-0 and gpu-1 are V100-SXM2-32GB, gpu-2 and gpu-3 are T4. Runs before dra_placer (placer.sh), which
# goes on with the policy on and then removes it.

DRA_SCENARIOS=${DRA_SCENARIOS/dra_uninstall/dra_placement dra_uninstall}

# gate_added: a pod with a claim gets the gate at admission (a server-side dry run).
gate_added() {
  kn create --dry-run=server -o 'jsonpath={.spec.schedulingGates[*].name}' -f - 2> /dev/null <<EOF | grep -q gpumem.io/placement
apiVersion: v1
kind: Pod
metadata: {name: gate-probe}
spec:
  resourceClaims: [{name: gpu, resourceClaimTemplateName: pl-5000mi}]
  containers: [{name: main, image: localhost/busybox:harness, resources: {claims: [{name: gpu}]}}]
EOF
}
# claim_finalizers CLASS: the finalizers a new claim of CLASS is made with (a server-side dry run).
claim_finalizers() {
  kn create --dry-run=server -o 'jsonpath={.metadata.finalizers}' -f - 2> /dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: finalizer-probe}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: $1}}]}}
EOF
}
claim_protected() { [ "$(claim_finalizers "gpu.$DRIVER")" == '["resource.kubernetes.io/delete-protection"]' ]; }
claim_gone() { ! kn get resourceclaim "$1" > /dev/null 2>&1; }
placement_leading() { curl -s "http://$SCORER_ADDR/metrics" | grep -q '^gpumem_scorer_dra_leading 1$'; }
claim_share_id() { claim_result "$1" shareID; }
claim_uid() { kn get resourceclaim "$(claim_name "$1")" -o 'jsonpath={.metadata.uid}' 2> /dev/null; }
is_gated() { [ "$(pod_field "$1" '.status.conditions[?(@.type=="PodScheduled")].reason')" == SchedulingGated ]; }
pod_unschedulable() { [ "$(pod_field "$1" '.status.conditions[?(@.type=="PodScheduled")].reason')" == Unschedulable ]; }
given_back() { [ -z "$(claim_device "$1")" ] && pod_unschedulable "$1"; }
scorer_said() { grep -F "$1" "$RUN_OUT/scorer.log" | grep -qF "$2"; }

scenario_dra_placement() {
  scenario "DRA: gpumem places the claims (a scheduling gate, the scorer's allocation), not kube-scheduler's first fit"
  if ! k apply -f "$ROOT/deploy/manifests/base/scorer-dra-rbac.yaml" \
    -f "$ROOT/deploy/manifests/components/dra-placement/placement.yaml" > "$RUN_OUT/placement-apply.log" 2>&1; then
    bad "the scorer's DRA role and the placement admission policy applied" "$(cat "$RUN_OUT/placement-apply.log")"
    return
  fi
  ok "the scorer's DRA role and the placement admission policy applied"
  stop_scorer
  # The configuration components/dra-placement/scorer-config.yaml gives the chart's scorer.
  SCORER_CONFIG_EXTRA=$(sed -n '/^    dra:/,$p' "$ROOT/deploy/manifests/components/dra-placement/scorer-config.yaml" | sed 's/^    //')
  start_scorer
  eventually "one scorer replica leads the DRA placement" 60 placement_leading
  claim_template pl-5000mi 5000Mi
  eventually "a new pod with a claim gets the gate gpumem.io/placement" 60 gate_added
  # The claims' policy: kube-scheduler's finalizer at creation, so the placer allocates in one write.
  eventually "a new claim of gpu.$DRIVER is made with the delete-protection finalizer" 60 claim_protected
  expect_eq "a claim of another class is made without it" "" "$(claim_finalizers other.example.com)"
  kn apply -f - > /dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: pl-unused}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.$DRIVER}}]}}
EOF
  kn delete resourceclaim pl-unused --wait=false > /dev/null 2>&1
  eventually "a claim no pod used is deleted all the same (the claim controller removes the finalizer)" 60 \
    claim_gone pl-unused

  new_claim_pod pl-a pl-5000mi
  eventually "a 5000Mi claim, placed by gpumem, runs" 60 is_running pl-a
  expect_eq "gpumem allocated it (the share is the claim's UID)" "$(claim_uid pl-a)" "$(claim_share_id pl-a)"
  expect_eq "on a T4 (gpu-2), keeping the V100s whole; kube-scheduler's first fit takes gpu-0" gpu-2 "$(claim_device pl-a)"
  expect_eq "the pod runs without the gate" "" "$(pod_field pl-a .spec.schedulingGates)"
  scorer_said "placed the pod's claim" "$NS/pl-a" && ok "the scorer logs the placement" || bad "the scorer logs the placement"
  check_claim_pod pl-a 5000
  new_claim_pod pl-b pl-5000mi
  eventually "a second 5000Mi claim runs" 60 is_running pl-b
  expect_eq "on the same T4, the tightest fit" gpu-2 "$(claim_device pl-b)"
  expect_eq "the usage annotation: both on gpu-2" 10000 "$(gpu_mib 2)"

  claim_template pl-40000mi 40000Mi
  new_claim_pod pl-big pl-40000mi
  eventually "40000Mi fits no GPU: the scorer says why" 60 scorer_said "waiting: no node has room for all of the pod's claims" "$NS/pl-big"
  expect_eq "the pod waits gated, its claim unallocated" "SchedulingGated/" \
    "$(pod_field pl-big '.status.conditions[?(@.type=="PodScheduled")].reason')/$(claim_device pl-big)"

  # A claim narrowed by a CEL selector: gpumem places it on a GPU the selector takes.
  claim_template pl-v100 2000Mi 'device.attributes["gpumem.io"].productName.startsWith("Tesla V100")'
  new_claim_pod pl-sel pl-v100
  eventually "a claim with a CEL selector runs" 60 is_running pl-sel
  expect_eq "gpumem placed it (the share is the claim's UID)" "$(claim_uid pl-sel)" "$(claim_share_id pl-sel)"
  case "$(claim_device pl-sel)" in
    gpu-0 | gpu-1) ok "on a V100, as its selector asks" ;;
    *) bad "on a V100, as its selector asks" "$(claim_device pl-sel)" ;;
  esac
  expect_eq "the T4 still holds the two 5000Mi claims" 10000 "$(gpu_mib 2)"

  # A pod that may not go where gpumem puts its claim, for a rule the placer does not read: it asks an
  # extended resource no node has. kube-scheduler finds it unschedulable, and after 30 s the scorer gives
  # the claim back to kube-scheduler's own allocator, rather than leave the pod pinned there for good.
  kn apply -f - > /dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: pl-nowhere}
spec:
  terminationGracePeriodSeconds: 1
  nodeSelector: {kubernetes.io/hostname: $REAL_NODE}
  resourceClaims: [{name: gpu, resourceClaimTemplateName: pl-5000mi}]
  containers:
    - name: main
      image: localhost/busybox:harness
      imagePullPolicy: Never
      command: [sleep, "3600"]
      resources: {claims: [{name: gpu}], requests: {example.com/dongle: "1"}, limits: {example.com/dongle: "1"}}
EOF
  eventually "a pod asking what no node has: its claim placed, kube-scheduler finds it unschedulable" 60 \
    pod_unschedulable pl-nowhere
  expect_eq "the claim is gpumem's (its share is the claim's UID)" "$(claim_uid pl-nowhere)" "$(claim_share_id pl-nowhere)"
  eventually "after 30 s unschedulable the scorer gives the claim back" 90 \
    scorer_said "the claim is given back, kube-scheduler allocates it itself" "$NS/pl-nowhere"
  eventually "the claim unallocated, the pod Pending for kube-scheduler's own reason" 30 given_back pl-nowhere
  delete_pods pl-a pl-b pl-big pl-sel pl-nowhere
  eventually "the pods' claims are gone" 60 no_claims
  wait_dra_idle

  # Six at once: the decisions are one at a time, their writes overlap; nothing is promised twice.
  local p
  for p in 1 2 3 4 5 6; do new_claim_pod "pl-burst-$p" pl-5000mi; done
  for p in 1 2 3 4 5 6; do eventually "burst pod $p runs" 90 is_running "pl-burst-$p"; done
  # The agent publishes the last prepare at most 500 ms after it: the pod may run before the Node shows it.
  eventually "three on each T4, the V100s untouched" 15 allocated_is "0 0 15000 15000"
  delete_pods pl-burst-1 pl-burst-2 pl-burst-3 pl-burst-4 pl-burst-5 pl-burst-6
  eventually "the burst's claims are gone" 60 no_claims
}

# placement_off: the placement policy removed and the scorer as it was (dra_placer, the last scenario
# with placement, calls it).
placement_off() {
  k delete -f "$ROOT/deploy/manifests/components/dra-placement/placement.yaml" --ignore-not-found > /dev/null 2>&1
  stop_scorer
  SCORER_CONFIG_EXTRA=""
  start_scorer
}
