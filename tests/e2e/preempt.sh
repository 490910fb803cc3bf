# Preemption for gated pods on the DRA path (sourced by scripts/e2e.sh after placer.sh; Kubernetes
# 1.36+). kube-scheduler never preempts for a pod that still carries a scheduling gate, so the placer
# does: T4s filled by offline claim pods, an online claim pod that fits nowhere evicts the fewest of
# them through the Eviction API, waits for their grace period and runs on the freed GPU; a
# PodDisruptionBudget that allows no disruption keeps its pods, and the online pod waits with a reason.
# Runs after dra_placer with the placement on, and turns it off at the end.

DRA_SCENARIOS=${DRA_SCENARIOS/dra_uninstall/dra_preempt dra_uninstall}

# on_t4 NAME MIB [CEL]: a template of MIB on a T4 (and CEL, when given, ANDed).
on_t4() {
  local cel='device.attributes["gpumem.io"].productName == "Tesla T4"'
  [ -z "${3:-}" ] || cel="$cel && $3"
  template "$1" "      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu.gpumem.io
            selectors: [{cel: {expression: '$cel'}}]
            capacity: {requests: {memory: ${2}Mi}}"
}

# class_pod NAME CLASS TEMPLATE [LABEL]: a sleeping pod of PriorityClass gpumem-CLASS on the real node
# with the template's claim and a 5 s grace period (busybox's sleep ignores SIGTERM: it takes all 5),
# labelled app=LABEL (its name by default); offline pods offer themselves for preemption.
class_pod() {
  kn apply -f - > /dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $1
  labels: {app: ${4:-$1}$([ "$2" != offline ] || echo ', gpumem.io/preemptible: "true"')}
spec:
  priorityClassName: gpumem-$2
  terminationGracePeriodSeconds: 5
  nodeSelector: {kubernetes.io/hostname: $REAL_NODE}
  resourceClaims: [{name: c0, resourceClaimTemplateName: $3}]
  containers:
    - name: main0
      image: localhost/busybox:harness
      imagePullPolicy: Never
      command: [sleep, "3600"]
      resources: {claims: [{name: c0}]}
EOF
}

is_gone() { [ -z "$(kn get pod "$1" --no-headers 2> /dev/null)" ]; }

scenario_dra_preempt() {
  scenario "DRA placer: an online pod that fits nowhere preempts offline pods (Eviction API, grace, PDB)"
  wait_dra_idle
  # gpu-2: one offline pod of 12000 MiB; gpu-3: three of 4000. 8000 MiB fits on neither T4: one pod
  # goes from gpu-2, where gpu-3 would need two.
  on_t4 pe-gpu2 12000 'device.attributes["gpumem.io"].index == 2'
  on_t4 pe-gpu3 4000 'device.attributes["gpumem.io"].index == 3'
  on_t4 pe-online 8000
  class_pod pe-big offline pe-gpu2
  class_pod pe-small-1 offline pe-gpu3
  class_pod pe-small-2 offline pe-gpu3
  class_pod pe-small-3 offline pe-gpu3
  local pod
  for pod in pe-big pe-small-1 pe-small-2 pe-small-3; do
    eventually "offline $pod runs" 60 is_running "$pod"
  done
  # (The agent's usage annotation follows the prepares by a moment.)
  eventually "the offline pods fill the T4s (12000 MiB on each)" 30 \
    eval '[ "$(gpu_allocated "$REAL_NODE" | cut -d" " -f3-)" == "12000 12000" ]'
  local started=$SECONDS
  class_pod pe-online online pe-online
  eventually "the online pod evicts the offline pod on gpu-2" 30 has_event pe-big "PreemptedForGPU"
  eventually "the online pod's Event names its victim and node" 30 has_event pe-online \
    "Preempting: evicting $NS/pe-big on node $REAL_NODE"
  eventually "while its victim ends, the online pod is nominated to $REAL_NODE (status.nominatedNodeName)" 10 \
    eval '[ "$(pod_field pe-online .status.nominatedNodeName)" == "$REAL_NODE" ]'
  eventually "the online pod runs" 90 is_running pe-online
  local waited=$((SECONDS - started))
  if [ "$waited" -ge 5 ]; then
    ok "pe-online waited for its victim's grace period (5 s): ran after ${waited} s"
  else
    bad "pe-online waited for its victim's grace period (5 s)" "ran after ${waited} s"
  fi
  check_claim_pod pe-online 8000
  eventually "placed, its nomination is cleared" 10 eval '[ -z "$(pod_field pe-online .status.nominatedNodeName)" ]'
  expect_eq "pe-online: placed by gpumem on the freed gpu-2" "yes gpu-2" \
    "$(placed_by_gpumem pe-online 0 && echo yes || echo no) $(results pe-online 0 device)"
  expect_eq "pe-big is gone" yes "$(is_gone pe-big && echo yes || echo no)"
  for pod in pe-small-1 pe-small-2 pe-small-3; do
    expect_eq "$pod kept: the fewest pods are evicted" Running "$(pod_phase "$pod")"
  done
  if scorer_said "evicted to make GPU room" "$NS/pe-big"; then
    ok "the scorer's log names the victim"
  else
    bad "the scorer's log names the victim"
  fi
  delete_pods pe-online pe-small-1 pe-small-2 pe-small-3
  wait_dra_idle

  # A PodDisruptionBudget that allows no disruption: its pods stay, the online pod waits and says why.
  kn apply -f - > /dev/null <<EOF
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: pe-guard}
spec:
  minAvailable: 2
  selector: {matchLabels: {app: pe-guarded}}
EOF
  on_t4 pe-any 12000
  class_pod pe-guarded-1 offline pe-any pe-guarded
  class_pod pe-guarded-2 offline pe-any pe-guarded
  eventually "both guarded offline pods run" 60 is_running pe-guarded-1
  eventually "both guarded offline pods run" 60 is_running pe-guarded-2
  eventually "the budget counts both pods healthy" 60 \
    eval '[ "$(kn get pdb pe-guard -o jsonpath={.status.currentHealthy}/{.status.disruptionsAllowed})" == 2/0 ]'
  class_pod pe-online-2 online pe-online
  eventually "the online pod waits: a PodDisruptionBudget protects the pods that would make room" 30 \
    has_event pe-online-2 "PodDisruptionBudget"
  sleep 5
  expect_eq "pe-online-2: still gated" SchedulingGated \
    "$(pod_field pe-online-2 '.status.conditions[?(@.type=="PodScheduled")].reason')"
  expect_eq "pe-online-2: nominated nowhere" "" "$(pod_field pe-online-2 .status.nominatedNodeName)"
  expect_eq "the guarded pods stay" "Running Running" "$(pod_phase pe-guarded-1) $(pod_phase pe-guarded-2)"
  expect_eq "nothing was evicted" "" \
    "$({ pod_events pe-guarded-1; pod_events pe-guarded-2; } | grep PreemptedForGPU)"
  delete_pods pe-online-2 pe-guarded-1 pe-guarded-2
  kn delete pdb pe-guard --ignore-not-found > /dev/null 2>&1
  eventually "the pods' claims are gone" 60 no_claims
  placement_off
  wait_dra_idle
}
