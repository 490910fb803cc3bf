# A GPUClaim on the DRA path (sourced by scripts/e2e.sh after placer.sh; Kubernetes 1.36, with gpumem's
# placement on): `path: dra` makes each pod's ResourceClaimTemplate (gpu.gpumem.io, capacity.requests.
# memory, a CEL selector on the models), the placer says on the gated pod it finds no room for why it
# waits (condition gpumem.io/Placed), and the claim steps down the same way as on the device-plugin
# path: 20000 MiB of a T4 (15360 MiB) steps to 15000 and runs on the DRA node.

DRA_SCENARIOS=${DRA_SCENARIOS/dra_preempt/dra_gpuclaim dra_preempt}

template_memory() { kn get resourceclaimtemplate "$1" -o 'jsonpath={.spec.spec.devices.requests[0].exactly.capacity.requests.memory}' 2> /dev/null; }
claim_templates() { kn get resourceclaimtemplates -l "gpumem.io/claim=$1" -o name 2> /dev/null; }
no_templates() { [ -z "$(claim_templates "$1")" ]; }

scenario_dra_gpuclaim() {
  scenario "DRA: a GPUClaim of 20000 MiB on T4s steps down to 15000 and runs on the DRA node"
  wait_dra_idle
  kn apply -f - > /dev/null <<EOF
apiVersion: gpumem.io/v1alpha1
kind: GPUClaim
metadata: {name: dc-t4}
spec:
  path: dra
  gpuMemMiB: 20000
  minGpuMemMiB: 8000
  fallbackAfter: 3s
  gpuModels: ["Tesla T4"]
  workloadClass: offline
  template:
    spec:
      terminationGracePeriodSeconds: 1
      nodeSelector: {kubernetes.io/hostname: $REAL_NODE}
      containers:
        - name: main
          image: localhost/busybox:harness
          imagePullPolicy: Never
          command: [sleep, "3600"]
EOF
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
