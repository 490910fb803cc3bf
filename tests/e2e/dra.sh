# The DRA scenarios of the end-to-end suite (Kubernetes 1.34+; sourced by scripts/e2e.sh after
# scenarios.sh). The real node moves from the device plugins to the DRA path as docs/install.md tells a
# user to (label gpumem.io/mode=dra, the agent restarted), then claims are placed by kube-scheduler's
# own allocator on the agent's ResourceSlice and prepared by the agent. The node serves the `mixed`
# profile: gpu-0 and gpu-1 are V100-SXM2-32GB (32Gi), gpu-2 and gpu-3 are T4 (15Gi).

DRA_SCENARIOS="dra_switch dra_claims dra_enforce dra_fragmentation dra_whole dra_nvlink_pair dra_xid dra_restarts \
dra_node_restriction dra_uninstall"
DRIVER=gpumem.io
# The node's ResourceSlice.
slice_name() { echo "$REAL_NODE-$DRIVER"; }

# new_claim_pod NAME TEMPLATE: a sleeping busybox pod on the real node with one claim from TEMPLATE.
new_claim_pod() {
  kn apply -f - > /dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $1
spec:
  terminationGracePeriodSeconds: 1
  nodeSelector: {kubernetes.io/hostname: ${3:-$REAL_NODE}}
  resourceClaims:
    - name: gpu
      resourceClaimTemplateName: $2
  containers:
    - name: main
      image: localhost/busybox:harness
      imagePullPolicy: Never
      command: [sleep, "3600"]
      resources:
        claims:
          - name: gpu
EOF
}

# claim_template NAME MEMORY [CEL]: a ResourceClaimTemplate for MEMORY of one GPU ("" : a whole GPU),
# narrowed by the CEL selector if given.
claim_template() {
  local capacity="" selector=""
  [ -z "${3:-}" ] || selector="
            selectors:
              - cel: {expression: '$3'}"
  [ -z "$2" ] || capacity="
            capacity:
              requests:
                memory: $2"
  kn apply -f - > /dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: $1
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: gpu.gpumem.io$selector$capacity
EOF
}

claim_name() { pod_field "$1" '.status.resourceClaimStatuses[0].resourceClaimName'; }
# claim_result POD FIELD: a field of the first allocation result of the pod's claim.
claim_result() { kn get resourceclaim "$(claim_name "$1")" -o "jsonpath={.status.allocation.devices.results[0].$2}" 2> /dev/null; }
claim_device() { claim_result "$1" device; }
slice_devices() { k get resourceslice "$(slice_name)" -o 'jsonpath={.spec.devices[*].name}' 2> /dev/null; }
slice_devices_are() { [ "$(slice_devices)" == "$1" ]; }
slice_generation() { k get resourceslice "$(slice_name)" -o 'jsonpath={.spec.pool.generation}' 2> /dev/null; }
dra_registrations() { grep -c 'registered with the kubelet as a DRA driver' "$RUN_OUT/agent.log"; }
dra_registered_since() { [ "$(dra_registrations)" -gt "$1" ]; }
has_pending_reason() { has_event "$1" "cannot allocate all claims"; }
# gpu_mib INDEX: the allocated MiB of GPU INDEX in the usage annotation.
gpu_mib() { gpu_query "$REAL_NODE" "[u['allocatedMiB'] for u in usage if u['index'] == $1][0]"; }
# check_claim_pod POD MIB: the pod runs on ONE GPU, the one its claim was allocated, with its limit.
check_claim_pod() {
  local pod=$1 mib=$2 device uuid visible
  device=$(claim_device "$pod")
  uuid=$(gpu_uuid "$REAL_NODE" "${device#gpu-}")
  visible=$(pod_env "$pod" NVIDIA_VISIBLE_DEVICES)
  if [[ -n "$uuid" && "$visible" == "$uuid" ]]; then
    ok "$pod: NVIDIA_VISIBLE_DEVICES is the GPU of its allocation ($device)"
  else
    bad "$pod: NVIDIA_VISIBLE_DEVICES is the GPU of its allocation" "device '$device' ($uuid), visible '$visible'"
  fi
  check_limit "$pod" "$mib"
  expect_eq "$pod: its accounting directory" /var/run/gpumem "$(pod_env "$pod" GPUMEM_ACCOUNTING_DIR)"
  expect_eq "$pod: the usage annotation lists it on that GPU" True \
    "$(gpu_query "$REAL_NODE" "'$NS/$pod' in [u for u in usage if u['index'] == ${device#gpu-}][0]['pods']" 2> /dev/null)"
}

stand_in_runs() { [ "$(k -n gpumem-system get pod agent-e2e -o jsonpath='{.status.phase}')" == Running ]; }
no_claims() { [ -z "$(kn get resourceclaims --no-headers 2> /dev/null)" ]; }
specs_left_are() { [ "$(ls /var/run/cdi 2> /dev/null | grep -c "^$DRIVER-")" == "$1" ]; }

dra_idle() { node_idle "$REAL_NODE" && [ -z "$(ls /var/run/cdi/ 2> /dev/null | grep "^$DRIVER-")" ]; }

wait_dra_idle() {
  eventually "node idle again (usage annotation, CDI specs)" 60 dra_idle
  eventually "every GPU in the slice again" 30 slice_devices_are "gpu-0 gpu-1 gpu-2 gpu-3"
}

scenario_dra_switch() {
  scenario "DRA: the node moves from the device plugins to the DRA path"
  apply_dra_objects || { bad "DeviceClass and admission policy applied" "$(cat "$RUN_OUT/dra-apply.log")"; return; }
  ok "DeviceClass and admission policy applied"
  # The agent's token bound to a pod on the node, as the DaemonSet pod's projected token is: it
  # carries the node's name, which the admission policy holds the agent's slice writes to.
  k -n gpumem-system apply -f - > /dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: agent-e2e}
spec:
  serviceAccountName: gpumem-agent
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: 1
  nodeSelector: {kubernetes.io/hostname: $REAL_NODE}
  containers:
    - {name: main, image: localhost/busybox:harness, imagePullPolicy: Never, command: [sleep, "36000"]}
EOF
  eventually "the agent's stand-in pod runs" 60 stand_in_runs
  service_account_kubeconfig gpumem-agent "$RUN_OUT/agent.kubeconfig" --bound-object-kind=Pod --bound-object-name=agent-e2e \
    "--bound-object-uid=$(k -n gpumem-system get pod agent-e2e -o jsonpath='{.metadata.uid}')" ||
    bad "a token bound to the agent's pod"
  k label node "$REAL_NODE" gpumem.io/mode=dra --overwrite > /dev/null
  local registrations
  registrations=$(dra_registrations)
  stop_agent
  start_agent
  eventually "the agent registers with the kubelet as a DRA driver" 60 dra_registered_since "$registrations"
  eventually "the ResourceSlice shows every GPU" 30 slice_devices_are "gpu-0 gpu-1 gpu-2 gpu-3"
  expect_eq "no nvidia.com/gpu-mem left in the Node's capacity (written while it counted shares)" "" \
    "$(k get node "$REAL_NODE" -o 'jsonpath={.status.capacity.nvidia\.com/gpu-mem}')"
  expect_eq "each device's memory capacity" "32Gi 32Gi 15Gi 15Gi" \
    "$(k get resourceslice "$(slice_name)" -o 'jsonpath={.spec.devices[*].capacity.memory.value}')"
  expect_eq "each device shareable" "true true true true" \
    "$(k get resourceslice "$(slice_name)" -o 'jsonpath={.spec.devices[*].allowMultipleAllocations}')"
  expect_eq "the request policy: 1Mi steps" "1Mi 1Mi 1Mi 1Mi" \
    "$(k get resourceslice "$(slice_name)" -o 'jsonpath={.spec.devices[*].capacity.memory.requestPolicy.validRange.step}')"
  local described
  described=$(k describe resourceslice "$(slice_name)")
  printf '%s\n' "$described" > "$RUN_OUT/resourceslice.txt"
  expect_contains "kubectl describe resourceslice: the model" "Tesla V100-SXM2-32GB" "$described"
  expect_contains "kubectl describe resourceslice: the PCIe root" "resource.kubernetes.io/pcieRoot" "$described"
  expect_eq "kubectl get resourceslices: driver and node" "$(slice_name) $REAL_NODE $DRIVER" \
    "$(k get resourceslices --no-headers | awk -v s="$(slice_name)" '$1 == s {print $1, $2, $3}')"
  eventually "the device plugins are gone: no allocatable nvidia.com/gpu" 60 node_alloc_is "$REAL_NODE" nvidia.com/gpu 0
  expect_contains "agent metrics: the driver registered" 'gpumem_plugin_registered{resource="gpumem.io"} 1' \
    "$(curl -s "http://$AGENT_METRICS/metrics")"
}

scenario_dra_claims() {
  scenario "DRA: a claim of 5000Mi runs on ONE GPU with its limit; deleting the pod gives it back"
  claim_template gpu-5000mi 5000Mi
  new_claim_pod d-a gpu-5000mi
  eventually "a pod with a 5000Mi claim runs" 60 is_running d-a
  expect_eq "its claim: allocated 5000Mi" 5000Mi "$(claim_result d-a 'consumedCapacity.memory')"
  expect_ne "a share of the device (shareID)" "" "$(claim_result d-a shareID)"
  expect_contains "kubectl get resourceclaims: allocated and reserved" "allocated,reserved" \
    "$(kn get resourceclaims "$(claim_name d-a)" --no-headers)"
  check_claim_pod d-a 5000
  local gpu
  gpu=$(claim_device d-a)
  expect_eq "the usage annotation: 5000 MiB on its GPU" 5000 "$(gpu_mib "${gpu#gpu-}")"
  expect_eq "agent metrics: the claim's memory counted on its GPU" $((5000 * 1048576)) \
    "$(curl -s "http://$AGENT_METRICS/metrics" | sed -n "s/^gpumem_gpu_memory_allocated_bytes{gpu=\"${gpu#gpu-}\"[^}]*} //p")"
  delete_pods d-a
  eventually "the pod's claim is gone" 30 no_claims
  wait_dra_idle
}

scenario_dra_fragmentation() {
  scenario "DRA: two claims that do not fit one GPU together; one no GPU can hold; a deletion makes room"
  claim_template gpu-20000mi 20000Mi
  claim_template gpu-30000mi 30000Mi
  claim_template gpu-40000mi 40000Mi
  new_claim_pod d-20a gpu-20000mi
  new_claim_pod d-20b gpu-20000mi
  eventually "a 20000Mi claim runs" 60 is_running d-20a
  eventually "a second 20000Mi claim runs" 60 is_running d-20b
  expect_ne "on two different GPUs" "$(claim_device d-20a)" "$(claim_device d-20b)"
  new_claim_pod d-40 gpu-40000mi
  eventually "40000Mi fits no GPU: Pending with kube-scheduler's reason" 60 has_pending_reason d-40
  expect_eq "it stays Pending, unbound" "Pending/" "$(pod_phase d-40)/$(pod_node d-40)"
  new_claim_pod d-30 gpu-30000mi
  eventually "30000Mi fits no GPU while both V100s hold 20000: Pending" 60 has_pending_reason d-30
  local freed
  freed=$(claim_device d-20a)
  delete_pods d-20a
  eventually "once a V100 is free the 30000Mi claim runs" 60 is_running d-30
  expect_eq "on the GPU the deletion freed" "$freed" "$(claim_device d-30)"
  check_claim_pod d-30 30000
  if node_within_capacity "$REAL_NODE"; then ok "no GPU over capacity"; else bad "no GPU over capacity" "$(gpu_allocated "$REAL_NODE")"; fi
  delete_pods d-20b d-30 d-40
  wait_dra_idle
}

scenario_dra_whole() {
  scenario "DRA: a whole-GPU claim and a memory claim never share a GPU"
  claim_template gpu-whole ""
  claim_template gpu-12000mi 12000Mi
  # Fill what the V100s offer so that the T4s are where things land.
  claim_template gpu-32768mi 32768Mi
  new_claim_pod d-v0 gpu-32768mi
  new_claim_pod d-v1 gpu-32768mi
  eventually "a full V100 claim runs" 60 is_running d-v0
  eventually "a second full V100 claim runs" 60 is_running d-v1
  new_claim_pod d-whole gpu-whole
  eventually "a whole-GPU claim runs" 60 is_running d-whole
  local whole
  whole=$(claim_device d-whole)
  expect_eq "it consumed the whole T4" 15Gi "$(claim_result d-whole 'consumedCapacity.memory')"
  expect_eq "a whole GPU has no memory limit" "" "$(pod_env d-whole GPUMEM_LIMIT_MIB)"
  new_claim_pod d-mem gpu-12000mi
  eventually "a 12000Mi claim runs" 60 is_running d-mem
  expect_ne "not on the whole GPU" "$whole" "$(claim_device d-mem)"
  new_claim_pod d-whole2 gpu-whole
  eventually "no GPU is whole-free: the second whole claim waits" 60 has_pending_reason d-whole2
  expect_eq "usage modes of the T4s" "whole shared" \
    "$(gpu_query "$REAL_NODE" "[u['mode'] for u in usage if u['index'] == ${whole#gpu-}] + [u['mode'] for u in usage if u['index'] == $((5 - ${whole#gpu-}))]")"
  delete_pods d-v0 d-v1 d-whole d-mem d-whole2
  wait_dra_idle
}

scenario_dra_nvlink_pair() {
  scenario "DRA: two whole GPUs on one NVLink island (matchAttribute gpumem.io/nvlinkDomain)"
  kn apply -f - > /dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: gpu-nvlink-pair
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly:
            deviceClassName: gpu.gpumem.io
            count: 2
      constraints:
        - requests: [gpus]
          matchAttribute: gpumem.io/nvlinkDomain
EOF
  new_claim_pod d-pair gpu-nvlink-pair
  eventually "a claim for an NVLinked pair runs" 60 is_running d-pair
  expect_eq "the two NVLinked V100s" "gpu-0 gpu-1" \
    "$(kn get resourceclaim "$(claim_name d-pair)" -o 'jsonpath={.status.allocation.devices.results[*].device}' | tr ' ' '\n' | sort | tr '\n' ' ' | sed 's/ $//')"
  expect_eq "the container sees both" "$(printf '%s\n' "$(gpu_uuid "$REAL_NODE" 0)" "$(gpu_uuid "$REAL_NODE" 1)" | sort | tr '\n' ' ')" \
    "$(pod_env d-pair NVIDIA_VISIBLE_DEVICES | tr ',' '\n' | sort | tr '\n' ' ')"
  expect_eq "whole GPUs have no memory limit" "" "$(pod_env d-pair GPUMEM_LIMIT_MIB)"
  expect_eq "usage modes" "whole whole" \
    "$(gpu_query "$REAL_NODE" "[u['mode'] for u in sorted(usage, key=lambda u: u['index'])][:2]")"
  new_claim_pod d-pair2 gpu-nvlink-pair
  eventually "no second NVLink island: the next pair waits" 60 has_pending_reason d-pair2
  delete_pods d-pair d-pair2
  wait_dra_idle
}

scenario_dra_xid() {
  scenario "DRA: a GPU fails (XID 48), leaves the slice, and comes back after the quiet period"
  local generation
  generation=$(slice_generation)
  inject_nvml '[[xid]]
gpu = 3
xid = 48'
  eventually "the slice withdraws gpu-3" 15 slice_devices_are "gpu-0 gpu-1 gpu-2"
  if [ "$(slice_generation)" -gt "$generation" ]; then ok "a new pool generation"; else bad "a new pool generation" "$generation -> $(slice_generation)"; fi
  claim_template gpu-32768mi 32768Mi
  claim_template gpu-12000mi 12000Mi
  new_claim_pod d-x1 gpu-32768mi
  new_claim_pod d-x2 gpu-32768mi
  eventually "the V100s fill" 60 is_running d-x2
  eventually "and the other" 60 is_running d-x1
  new_claim_pod d-xa gpu-12000mi
  eventually "a 12000Mi claim runs on the healthy T4" 60 is_running d-xa
  expect_eq "on gpu-2" gpu-2 "$(claim_device d-xa)"
  new_claim_pod d-xb gpu-12000mi
  eventually "a second one waits while gpu-3 is sick" 60 has_pending_reason d-xb
  eventually "after the quiet period gpu-3 is back in the slice" 90 slice_devices_are "gpu-0 gpu-1 gpu-2 gpu-3"
  eventually "the waiting claim runs, on gpu-3" 90 is_running d-xb
  expect_eq "on gpu-3" gpu-3 "$(claim_device d-xb)"
  inject_nvml ''
  delete_pods d-x1 d-x2 d-xa d-xb
  wait_dra_idle
}

scenario_dra_restarts() {
  scenario "DRA: kubelet and agent restarts with prepared claims lose nothing"
  claim_template gpu-20000mi 20000Mi
  new_claim_pod d-r1 gpu-20000mi
  eventually "a 20000Mi claim runs" 60 is_running d-r1
  local before registrations
  before=$(gpu_allocated "$REAL_NODE")
  registrations=$(dra_registrations)
  if "$KIT/restart-kubelet.sh" >> "$RUN_OUT/restart-kubelet.log" 2>&1; then ok "kubelet restarted"; else bad "kubelet restarted"; fi
  eventually "the kubelet deleted the node's slice and the agent published it again" 30 slice_devices_are "gpu-0 gpu-1 gpu-2 gpu-3"
  expect_eq "the pod kept running, never restarted" "Running 0" "$(pod_phase d-r1) $(pod_field d-r1 '.status.containerStatuses[0].restartCount')"
  eventually "the usage annotation unchanged" 30 allocated_is "$before"
  new_claim_pod d-r2 gpu-20000mi
  eventually "after the kubelet restart a new claim runs" 60 is_running d-r2
  check_claim_pod d-r2 20000
  before=$(gpu_allocated "$REAL_NODE")
  registrations=$(dra_registrations)
  stop_agent
  k annotate node "$REAL_NODE" gpumem.io/gpu-usage- > /dev/null
  start_agent
  eventually "the agent registers again" 60 dra_registered_since "$registrations"
  eventually "the usage annotation is rebuilt from the prepared claims" 30 allocated_is "$before"
  expect_eq "the pods kept running" "Running Running" "$(pod_phase d-r1) $(pod_phase d-r2)"
  delete_pods d-r1
  eventually "a claim prepared before the restart is unprepared after it" 30 specs_left_are 1
  if node_within_capacity "$REAL_NODE"; then ok "no GPU over capacity"; else bad "no GPU over capacity" "$(gpu_allocated "$REAL_NODE")"; fi
  delete_pods d-r2
  wait_dra_idle
}

scenario_dra_node_restriction() {
  scenario "DRA: the agent's credentials write only its own node's slice"
  local other
  other=$(sed "s/$REAL_NODE/gpu-node-2/g" <<< "$(k get resourceslice "$(slice_name)" -o json | python3 -c '
import json, sys
s = json.load(sys.stdin)
print(json.dumps({"apiVersion": s["apiVersion"], "kind": s["kind"], "metadata": {"name": s["metadata"]["name"]}, "spec": s["spec"]}))')")
  local out
  out=$(kubectl --kubeconfig "$RUN_OUT/agent.kubeconfig" create -f - 2>&1 <<< "$other")
  expect_contains "a slice for another node is refused by the admission policy" "gpumem-agent-slices' denied" "$out"
  out=$(kubectl --kubeconfig "$RUN_OUT/agent.kubeconfig" delete resourceslice "$(slice_name)" --dry-run=server 2>&1)
  expect_contains "deleting its own node's slice is allowed" "deleted" "$out"
}

no_slice() { [ -z "$(k get resourceslices --no-headers 2> /dev/null | grep "^$(slice_name) ")" ]; }

scenario_dra_uninstall() {
  scenario "DRA: the driver gone, its ResourceSlice goes (the kubelet removes it after 30 s)"
  stop_agent
  if [ -e "/var/lib/kubelet/plugins_registry/$DRIVER-reg.sock" ]; then
    bad "the agent removed its registration socket on SIGTERM"
  else
    ok "the agent removed its registration socket on SIGTERM"
  fi
  eventually "the node's ResourceSlice is deleted" 90 no_slice
}
