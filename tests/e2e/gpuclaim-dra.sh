# A GPUClaim on the DRA path (sourced by scripts/e2e.sh after placer.sh; Kubernetes 1.36, with gpumem's
# placement on): `path: dra` makes each pod's ResourceClaimTemplate (gpu.gpumem.io, capacity.requests.
# memory, a CEL selector on the models), the placer says on the gated pod it finds no room for why it
# waits (condition gpumem.io/Placed), and the claim steps down the same way as on the device-plugin
# path: 20000 MiB of a T4 (15360 MiB) steps to 15000 and runs on the DRA node. A claim of `path: auto`
# runs on whichever path has room: on the DRA node, after the device-plugin path found no room for each
# request, and on the API-only gpu-node-2 (8 x A100, still on the device-plugin path) at once.

DRA_SCENARIOS=${DRA_SCENARIOS/dra_preempt/dra_gpuclaim dra_gpuclaim_auto dra_preempt}

template_memory() { kn get resourceclaimtemplate "$1" -o 'jsonpath={.spec.spec.devices.requests[0].exactly.capacity.requests.memory}' 2> /dev/null; }
claim_templates() { kn get resourceclaimtemplates -l "gpumem.io/claim=$1" -o name 2> /dev/null; }
no_templates() { [ -z "$(claim_templates "$1")" ]; }

scenario_dra_gpuclaim() {
  scenario "DRA: a GPUClaim of 20000 MiB on T4s steps down to 15000 and runs on the DRA node"
  wait_dra_idle
  gpu_claim dc-t4 dra 20000 '"Tesla T4"' "      nodeSelector: {kubernetes.io/hostname: $REAL_NODE}"
  eventually "the first pod's ResourceClaimTemplate asks 20000Mi of a T4" 20 \
    eval '[ "$(template_memory dc-t4-20000mib)" == 20000Mi ]'
  expect_contains "the template selects the claim's models by CEL" 'productName in ["Tesla T4"]' \
    "$(kn get resourceclaimtemplate dc-t4-20000mib -o 'jsonpath={.spec.spec.devices.requests[0].exactly.selectors[0].cel.expression}' 2> /dev/null)"
  eventually "it steps down to 15000 MiB and runs" 120 claim_phase_is dc-t4 Running
  expect_eq "five steps recorded, 1000 MiB each" "20000>19000 19000>18000 18000>17000 17000>16000 16000>15000" \
    "$(claim_steps dc-t4)"
  # The reason is the placer's, from the gated pod's condition gpumem.io/Placed.
  expect_contains "each step says why (the placer's words on the gated pod)" "no room for claim" \
    "$(claim_field dc-t4 '.status.steps[0].reason')"
  expect_eq "one pod and one template left, at 15000 MiB" \
    "pod/dc-t4-15000mib resourceclaimtemplate.resource.k8s.io/dc-t4-15000mib" "$(claim_pods dc-t4) $(claim_templates dc-t4)"
  local rc
  rc=$(pod_field dc-t4-15000mib '.status.resourceClaimStatuses[?(@.name=="gpumem")].resourceClaimName')
  expect_eq "placed by gpumem (the share is the claim's UID), on $REAL_NODE" \
    "$(kn get resourceclaim "$rc" -o jsonpath='{.metadata.uid}' 2> /dev/null) $REAL_NODE" \
    "$(kn get resourceclaim "$rc" -o jsonpath='{.status.allocation.devices.results[0].shareID}' 2> /dev/null) $(claim_field dc-t4 .status.node)"
  check_claim_pod dc-t4-15000mib 15000
  expect_eq "a pod placed at once carries no gpumem.io/Placed condition" "" \
    "$(pod_field dc-t4-15000mib '.status.conditions[?(@.type=="gpumem.io/Placed")].status')"
  kn delete gpuclaim dc-t4 --wait=true --timeout=30s > /dev/null
  eventually "deleting the claim deletes its pod" 60 no_claim_pods dc-t4
  eventually "and its template" 60 no_templates dc-t4
  wait_dra_idle
}

# gpu_claim NAME PATH MIB MODELS PLACEMENT: a GPUClaim of PATH asking MIB (down to 8000, 3 s per step) of
# one of MODELS (JSON strings, comma-separated), placed by PLACEMENT (YAML, 6 spaces in: a node selector,
# tolerations).
gpu_claim() {
  kn apply -f - > /dev/null <<EOF
apiVersion: gpumem.io/v1alpha1
kind: GPUClaim
metadata: {name: $1}
spec:
  path: $2
  gpuMemMiB: $3
  minGpuMemMiB: 8000
  fallbackAfter: 3s
  gpuModels: [$4]
  workloadClass: offline
  template:
    spec:
      terminationGracePeriodSeconds: 1
$5
      containers:
        - name: main
          image: localhost/busybox:harness
          imagePullPolicy: Never
          command: [sleep, "3600"]
EOF
}

BOTH_MODELS='"Tesla T4", "NVIDIA A100-SXM4-80GB"'

# claim_events CLAIM REASON: how many of the claim's events have that reason.
claim_events() { pod_events "$1" | grep -c "^$2: "; }

scenario_dra_gpuclaim_auto() {
  scenario "DRA: a GPUClaim of path auto runs on whichever path has room"
  wait_dra_idle
  gpu_claim da-t4 auto 16000 "$BOTH_MODELS" "      nodeSelector: {kubernetes.io/hostname: $REAL_NODE}"
  eventually "16000 MiB: no T4 has it on either path; 15000 runs on the DRA node" 120 claim_phase_is da-t4 Running
  expect_eq "one step, taken on the DRA path" "16000>15000" "$(claim_steps da-t4)"
  expect_contains "the step quotes the placer" "no room for claim" "$(claim_field da-t4 '.status.steps[0].reason')"
  expect_eq "the pod asks through the DRA path (status.path)" dra "$(claim_field da-t4 .status.path)"
  expect_eq "each request was tried on the device-plugin path first (two SwitchedPath events)" 2 \
    "$(claim_events da-t4 SwitchedPath)"
  expect_contains "the switch says why: no gpu-mem on the DRA node" "Insufficient nvidia.com/gpu-mem" \
    "$(pod_events da-t4 | grep '^SwitchedPath: ' | head -1)"
  expect_eq "one pod and one template left, at 15000 MiB" \
    "pod/da-t4-15000mib resourceclaimtemplate.resource.k8s.io/da-t4-15000mib" "$(claim_pods da-t4) $(claim_templates da-t4)"
  check_claim_pod da-t4-15000mib 15000

  gpu_claim da-a100 auto 8000 "$BOTH_MODELS" "      nodeSelector: {kubernetes.io/hostname: gpu-node-2}
      tolerations: [{key: harness.local/fake-node, operator: Exists, effect: NoSchedule}]"
  eventually "8000 MiB on the A100 node, still on the device-plugin path: bound at once" 60 \
    eval '[ "$(claim_field da-a100 .status.node)" == gpu-node-2 ]'
  expect_eq "through the device-plugin path, without a switch or a template" "devicePlugin 0 " \
    "$(claim_field da-a100 .status.path) $(claim_events da-a100 SwitchedPath) $(claim_templates da-a100)"
  expect_eq "its pod asks nvidia.com/gpu-mem (8000, which the API server stores as 8k)" 8k \
    "$(pod_field da-a100-8000mib '.spec.containers[0].resources.limits.nvidia\.com/gpu-mem')"

  kn delete gpuclaim da-t4 da-a100 --wait=true --timeout=30s > /dev/null
  delete_fake_pods da-a100-8000mib
  eventually "deleting the claims deletes their pods" 60 eval 'no_claim_pods da-t4 && no_claim_pods da-a100'
  eventually "and the template" 60 no_templates da-t4
  wait_dra_idle
}
