# The enforcement scenarios of the end-to-end suite (sourced by scripts/e2e.sh after scenarios.sh and
# dra.sh): real processes in real containers, the shim where the DaemonSet's init container puts it and
# nothing else than what the agent's Allocate (or, on the DRA path, its prepared claim) hands the kubelet.
# The containers run localhost/gpumem-probe:e2e (tests/e2e/probe-image.sh): shim/tests/c/probe.c, dynamically
# linked against glibc, over the project's fake libcuda.so.1 (each process has its own fake device of
# GPUMEM_FAKE_CUDA_TOTAL_MIB: the GPU's memory; every limit below comes from the shim).
#
# What is measured (held or not, and what the agent reports) is written to $RUN_OUT/enforcement.txt, and
# docs/enforcement.md's table says the same: a change in behaviour fails here.

ENFORCE_SCENARIOS="enforce_paths enforce_usage enforce_neighbours enforce_restarts"
DRA_ENFORCE_SCENARIOS="dra_enforce"
PROBE_IMAGE=localhost/gpumem-probe:e2e
MIB_BYTES=1048576

# build_probe_image: once per run, before the clusters.
build_probe_image() {
  PROBE_TAR=$OUT/probe-image.tar
  "$ROOT/tests/e2e/probe-image.sh" "$ROOT" "$PROBE_TAR" > "$OUT/probe-image.log" 2>&1
}

# import_probe_image: into this cluster's containerd, as the kit imports its own images.
import_probe_image() {
  local ctr=ctr
  [ "$K8S_VERSION" == 1.24 ] || ctr=$K8S_STATE/bin/containerd-2.3.4/ctr
  "$ctr" -a "$K8S_STATE/run/containerd/containerd.sock" -n k8s.io images import "$PROBE_TAR" \
    > "$RUN_OUT/probe-image-import.log" 2>&1
}

# measured WHAT RESULT: one line of the measurements' record.
measured() { printf '%-44s %s\n' "$1" "$2" >> "$RUN_OUT/enforcement.txt"; }

# probe_pod NAME MIB MODEL SCRIPT [MEMORY] [RESTART]: a pod of the probe image asking for MIB of gpu-mem on a
# GPU of MODEL (the fake device gets that GPU's memory), running SCRIPT with sh; MEMORY: its memory limit;
# RESTART: its restartPolicy (Never). An emptyDir at /state outlives the container's restarts.
probe_pod() {
  local name=$1 mib=$2 model=$3 script=$4 memory=${5:-256Mi} restart=${6:-Never} total=32768
  [ "$model" != "Tesla T4" ] || total=$T4_MIB
  kn apply -f - > /dev/null << EOF
apiVersion: v1
kind: Pod
metadata:
  name: $name
  labels: {gpumem.io/workload-class: offline}
  annotations: {gpumem.io/gpu-models: "$model"}
spec:
  terminationGracePeriodSeconds: 1
  restartPolicy: $restart
  nodeSelector: {kubernetes.io/hostname: $REAL_NODE}
  volumes: [{name: state, emptyDir: {}}]
  containers:
    - name: main
      image: $PROBE_IMAGE
      imagePullPolicy: Never
      command: [sh, -c, '$script']
      env: [{name: GPUMEM_FAKE_CUDA_TOTAL_MIB, value: "$total"}]
      volumeMounts: [{name: state, mountPath: /state}]
      resources:
        limits: {nvidia.com/gpu-mem: "$mib", memory: $memory}
EOF
}

# in_pod POD SCRIPT: runs SCRIPT with sh in the pod's container (its environment and /etc/ld.so.preload,
# as every process of the container has them); stdout and stderr.
in_pod() { kn exec "$1" -- sh -c "$2" 2>&1; }

pod_log() { kn logs "$1" 2> /dev/null; }
pod_log_has() { pod_log "$1" | grep -qF -- "$2"; }

# shim_used GPU: the agent's gpumem_gpu_memory_used_bytes{source="shim"} of GPU index GPU.
shim_used() {
  curl -s "http://$AGENT_METRICS/metrics" |
    sed -n "s/^gpumem_gpu_memory_used_bytes{gpu=\"$1\",[^}]*source=\"shim\"} //p"
}
shim_used_is() { [ "$(shim_used "$1")" == "$2" ]; }

# rejected_reads: reads of accounting files the agent refused, all reasons.
rejected_reads() {
  curl -s "http://$AGENT_METRICS/metrics" |
    awk '/^gpumem_accounting_rejected_total/ {n += $2} END {print n + 0}'
}

pod_gpu() { gpu_index "$REAL_NODE" "$(pod_assigned "$1")"; }
# shim_used_are "GPU..." "BYTES...": the agent's metric for each GPU listed.
shim_used_are() {
  local g got=()
  for g in $1; do got+=("$(shim_used "$g")"); done
  [ "${got[*]}" == "$2" ]
}
# allocated_are "GPU..." "MIB...": the usage annotation's allocatedMiB for each GPU listed.
allocated_are() {
  local g got=()
  for g in $1; do got+=("$(gpu_query "$REAL_NODE" "[u['allocatedMiB'] for u in usage if u['index'] == $g][0]")"); done
  [ "${got[*]}" == "$2" ]
}
pod_exit_is() { [ "$(pod_field "$1" '.status.containerStatuses[0].state.terminated.reason')" == "$2" ]; }
# last_exit_is POD REASON: why the pod's container last ended.
last_exit_is() { [ "$(pod_field "$1" '.status.containerStatuses[0].lastState.terminated.reason')" == "$2" ]; }

# check_paths POD MIB BINARY: every path frameworks allocate through stops at MIB, one MiB more is refused
# with CUDA_ERROR_OUT_OF_MEMORY (2), cuMemGetInfo_v2 says total = MIB, free = 0 while full; all freed.
check_paths() {
  local pod=$1 mib=$2 bin=$3 out kind bytes=$(($2 * MIB_BYTES)) held=0
  out=$(in_pod "$pod" "${4:-} $bin paths $mib 1000")
  printf '%s\n' "$out" >> "$RUN_OUT/probe-$pod.log"
  for kind in alloc pitch managed async stream async_ptsz pool pool_ptsz create vmm array array3d mipmap; do
    if grep -qx "path $kind held=$bytes rc=0 one_more_mib=2 info=0 free=0 total=$bytes freed=0" <<< "$out"; then
      held=$((held + 1))
    else
      bad "$pod: $bin ${4:-}: $kind up to $mib MiB, 1 MiB more refused (2), cuMemGetInfo total $mib MiB" \
        "$(grep "^path $kind " <<< "$out" || echo "${out:0:300}")"
    fi
  done
  expect_eq "$pod: $bin${4:+ ($4)}: 13 paths stop at $mib MiB, one MiB more is CUDA_ERROR_OUT_OF_MEMORY" 13 "$held"
  measured "paths held ($bin${4:+ $4})" "$held of 13"
}

scenario_enforce_paths() {
  scenario "enforcement: a 5000 MiB pod allocates up to its limit on every path, not one MiB more"
  : > "$RUN_OUT/enforcement.txt"
  probe_pod e-paths 5000 "Tesla T4" 'sleep 3600'
  eventually "a probe pod of 5000 MiB runs" 60 is_running e-paths || return
  check_limit e-paths 5000
  check_paths e-paths 5000 probe
  check_paths e-paths 5000 probe-procaddr
  check_paths e-paths 5000 probe-dlsym
  check_paths e-paths 5000 probe-procaddr PROBE_CONTEXT=create
  expect_eq "cuMemGetInfo_v2: total = the limit, all free" \
    "info rc=0 free=$((5000 * MIB_BYTES)) total=$((5000 * MIB_BYTES))" "$(in_pod e-paths 'probe info')"
  expect_contains "the shim says why it refused" "GPU memory limit reached" "$(in_pod e-paths 'probe fill alloc 5001 5001')"
  delete_pods e-paths
}

# usage_shows POD GPU "MIB True|False": the usage annotation's MiB on GPU and whether it names POD.
usage_shows() {
  [ "$(gpu_query "$REAL_NODE" "[(u['allocatedMiB'], '$NS/$1' in u['pods']) for u in usage if u['index'] == $2][0]" |
    tr -d "(),'")" == "$3" ]
}

# used_shows POD GPU "MIB POD_MIB": the Node's gpumem.io/gpu-used on GPU: what all its pods' processes
# hold, and what POD's hold (MiB).
used_shows() {
  [ "$(gpu_query "$REAL_NODE" "[(u['usedMiB'], u['pods'].get('$NS/$1', 0)) for u in used if u['index'] == $2][0]" |
    tr -d "(),")" == "$3" ]
}
used_mib() { gpu_query "$REAL_NODE" "[u['usedMiB'] for u in used if u['index'] == $1][0]"; }

scenario_enforce_usage() {
  scenario "enforcement: the agent reports what the container really holds, and the drop when it frees or exits"
  probe_pod e-use 5000 "Tesla T4" \
    'probe fill alloc 3000 1000 fill vmm 1000 1000 wait /tmp/free freeall wait /tmp/exit; probe fill managed 2000 500 wait /tmp/exit2; sleep 3600'
  eventually "a probe pod holding 4000 of its 5000 MiB runs" 60 pod_log_has e-use waiting || return
  local gpu
  gpu=$(pod_gpu e-use)
  eventually "agent metrics: 4000 MiB used on its GPU (source=shim)" 15 shim_used_is "$gpu" $((4000 * MIB_BYTES))
  measured "accounting error, holding 4000 MiB (bytes)" "$(($(shim_used "$gpu") - 4000 * MIB_BYTES))"
  # The agent names the pod at Allocate (shares) or once the kubelet's PodResources lists it (units).
  eventually "the usage annotation: the pod's 5000 MiB granted on that GPU, the pod named" 60 \
    usage_shows e-use "$gpu" "5000 True"
  # What it holds, beside what it was granted: the agent's gpumem.io/gpu-used (written at most every
  # usedReportSeconds, 1 here; 30 by default).
  eventually "the Node's gpu-used: the pod's processes hold 4000 MiB on that GPU" 15 used_shows e-use "$gpu" "4000 4000"
  measured "gpu-used annotation error, 4000 MiB (bytes)" "$((($(used_mib "$gpu") - 4000) * MIB_BYTES))"
  in_pod e-use 'touch /tmp/free' > /dev/null
  eventually "freed: the metric drops to 0" 15 shim_used_is "$gpu" 0
  eventually "freed: the Node's gpu-used drops to 0, the pod no longer listed" 15 used_shows e-use "$gpu" "0 0"
  in_pod e-use 'touch /tmp/exit' > /dev/null
  eventually "a new process holds 2000 MiB: the metric says 2000 MiB" 15 shim_used_is "$gpu" $((2000 * MIB_BYTES))
  measured "accounting error, holding 2000 MiB (bytes)" "$(($(shim_used "$gpu") - 2000 * MIB_BYTES))"
  eventually "the Node's gpu-used says 2000 MiB" 15 used_shows e-use "$gpu" "2000 2000"
  measured "gpu-used annotation error, 2000 MiB (bytes)" "$((($(used_mib "$gpu") - 2000) * MIB_BYTES))"
  in_pod e-use 'touch /tmp/exit2' > /dev/null
  eventually "it exits: the metric drops to 0" 15 shim_used_is "$gpu" 0
  eventually "it exits: the Node's gpu-used drops to 0" 15 used_shows e-use "$gpu" "0 0"
  expect_contains "the program saw what it held" "fill managed held=$((2000 * MIB_BYTES)) rc=0" "$(pod_log e-use)"
  delete_pods e-use
}

# escape POD GPU SCRIPT: runs an escape in POD (on GPU index GPU) that tries for 2000 MiB against its 1000
# MiB limit (SCRIPT's probe ends with `wait /tmp/go`, holding what it got), and reads the agent's metrics meanwhile.
# Prints "HELD_MIB REPORTED_MIB REJECTED" (REJECTED 1: the agent refused the container's accounting file
# meanwhile); the program's output is left in the file $ESCAPE_LOG.
escape_state() { in_pod "$1" "grep -q '$2' /tmp/escape.log"; }
escape() {
  local pod=$1 gpu=$2 script=$3 rejected got reported
  ESCAPE_LOG=$RUN_OUT/escape-last.log
  rejected=$(rejected_reads)
  in_pod "$pod" "rm -f /tmp/go /tmp/escape.log; ( ($script; echo exit=\$?) > /tmp/escape.log 2>&1 &)" > /dev/null
  local deadline=$((SECONDS + 30))
  until escape_state "$pod" 'waiting\|^exit=' > /dev/null || [ $SECONDS -ge $deadline ]; do sleep 0.5; done
  sleep 2 # the agent's metrics are read every second
  reported=$(($(shim_used "$gpu") / MIB_BYTES))
  in_pod "$pod" 'touch /tmp/go' > /dev/null
  deadline=$((SECONDS + 30))
  until escape_state "$pod" '^exit=' > /dev/null || [ $SECONDS -ge $deadline ]; do sleep 0.5; done
  in_pod "$pod" 'cat /tmp/escape.log' > "$ESCAPE_LOG"
  got=$(sed -n 's/^fill [a-z_0-9]* held=\([0-9]*\) .*/\1/p' "$ESCAPE_LOG" | awk '{n += $1} END {print n / 1048576}')
  echo "${got:-0} $reported $(($(rejected_reads) > rejected ? 1 : 0))"
}

# held_escape COMMAND CHECK MEASURE: COMMAND in the escape pod on $gpu is held at its 1000 MiB and
# reported as such ("1000 1000 0").
held_escape() {
  local r
  r=$(escape e-esc "$gpu" "$1")
  expect_eq "$2" "1000 1000 0" "$r"
  measured "$3" "held ($r)"
}

scenario_enforce_neighbours() {
  scenario "enforcement: two pods on one GPU at their limits take nothing from each other; a third tries escapes"
  local hold='probe fill alloc 5000 1000 fill alloc 1 1 info wait /tmp/exit; sleep 3600'
  probe_pod e-n1 5000 "Tesla T4" "$hold"
  eventually "a first 5000 MiB pod holds its limit" 60 pod_log_has e-n1 waiting || return
  probe_pod e-n2 5000 "Tesla T4" "$hold"
  probe_pod e-esc 1000 "Tesla V100-SXM2-32GB" 'sleep 3600'
  # The container's first process itself started without the variable.
  probe_pod e-pid1 1000 "Tesla V100-SXM2-32GB" 'exec env -u GPUMEM_LIMIT_MIB probe fill alloc 2000 100 wait /tmp/go'
  eventually "a second 5000 MiB pod holds its limit" 60 pod_log_has e-n2 waiting || return
  local tgpu pod
  tgpu=$(pod_gpu e-n1)
  expect_eq "both on the same GPU" "$tgpu" "$(pod_gpu e-n2)"
  for pod in e-n1 e-n2; do
    expect_eq "$pod: all of its 5000 MiB, not one MiB more, cuMemGetInfo shows only its own" \
      "fill alloc held=$((5000 * MIB_BYTES)) rc=0|fill alloc held=0 rc=2|info rc=0 free=0 total=$((5000 * MIB_BYTES))" \
      "$(pod_log "$pod" | grep -v '^GPUMEM\|^waiting' | paste -sd '|')"
  done
  eventually "agent metrics: 10000 MiB used on that GPU" 15 shim_used_is "$tgpu" $((10000 * MIB_BYTES))
  measured "accounting error, two pods at 5000 MiB (bytes)" "$(($(shim_used "$tgpu") - 10000 * MIB_BYTES))"

  eventually "a third pod, of 1000 MiB, runs" 60 is_running e-esc || return
  local gpu r lib=/usr/lib/x86_64-linux-gnu/libcuda.so.1
  gpu=$(pod_gpu e-esc)
  eventually "a pod whose first process started without GPUMEM_LIMIT_MIB runs" 60 pod_log_has e-pid1 waiting
  sleep 2 # the agent's metrics are read every second
  local pgpu
  pgpu=$(pod_gpu e-pid1)
  r="$(($(pod_log e-pid1 | sed -n 's/^fill alloc held=\([0-9]*\) .*/\1/p') / MIB_BYTES)) $(($(shim_used "$pgpu") / MIB_BYTES))"
  expect_eq "the container's first process without GPUMEM_LIMIT_MIB: not held (2000 MiB), not reported" "2000 0" "$r"
  measured "escape: PID 1 started without GPUMEM_LIMIT_MIB" "NOT held, NOT reported ($r)"
  delete_pods e-pid1
  held_escape 'probe fill alloc 2000 100 wait /tmp/go' "control (linked program): 1000 MiB, no more; the agent reports 1000" "escape: none (linked program)"
  held_escape 'env -u GPUMEM_LIMIT_MIB -u GPUMEM_ACCOUNTING_DIR probe fill alloc 2000 100 wait /tmp/go' "GPUMEM_LIMIT_MIB unset (the container's first process has it): held" "escape: unset GPUMEM_LIMIT_MIB in a process"
  held_escape 'env -i /usr/local/bin/probe fill alloc 2000 100 wait /tmp/go' "a cleared environment (env -i): held" "escape: env -i"
  held_escape "PROBE_LIBCUDA=$lib probe-dlsym fill alloc 2000 100 wait /tmp/go" "dlopen of the driver by its path: held" "escape: dlopen($lib)"
  held_escape 'PROBE_NEXT=1 probe-dlsym fill alloc 2000 100 wait /tmp/go' "dlsym(RTLD_NEXT, ...): held" "escape: dlsym(RTLD_NEXT, ...)"
  r=$(escape e-esc "$gpu" 'probe-static fill alloc 2000 100 wait /tmp/go')
  expect_eq "a statically linked program: no memory, nothing reported" "0 0 0" "$r"
  expect_contains "(the shim is not in it; its dlopen of the driver dies of SIGSEGV)" "exit=139" "$(cat "$RUN_OUT/escape-last.log")"
  measured "escape: statically linked program" "no memory: static dlopen of the driver crashes ($r)"
  r=$(escape e-esc "$gpu" 'probe fill alloc 1000 100 zero_accounting fill alloc 1000 100 wait /tmp/go')
  expect_eq "0 written over its accounting counter: not held (2000 MiB), reported (the agent refuses the file)" \
    "2000 0 1" "$r"
  measured "escape: write 0 over the accounting counter" "NOT held, reported: file rejected ($r)"
  r=$(escape e-esc "$gpu" 'unshare -Urm sh -c "mount -t tmpfs none /proc && exec probe fill alloc 2000 100 wait /tmp/go"')
  expect_eq "/proc hidden (a tmpfs over it in a user and mount namespace of its own): held" "1000 1000 0" "$r"
  measured "escape: /proc hidden (unshare -Urm, tmpfs)" "held ($r)"
  expect_eq "meanwhile the neighbours' GPU: their 10000 MiB" $((10000 * MIB_BYTES)) "$(shim_used "$tgpu")"
  in_pod e-n1 'touch /tmp/exit' > /dev/null
  eventually "one neighbour exits: 5000 MiB on that GPU, the other's" 15 shim_used_is "$tgpu" $((5000 * MIB_BYTES))
  log "  measured: $(tr -s ' ' < "$RUN_OUT/enforcement.txt" | paste -sd ';')"
  delete_pods e-n1 e-n2 e-esc
}

scenario_enforce_restarts() {
  scenario "enforcement: a container OOM-killed and restarted, a pod deleted while allocating: nothing leaks"
  # The first run holds 5000 MiB, then touches host memory until its 64Mi limit kills it; the restarted
  # container must get all 5000 MiB again (the dead process's share reclaimed).
  probe_pod e-oom 5000 "Tesla T4" \
    'if [ -e /state/ran ]; then probe fill alloc 5000 1000 wait /tmp/exit; else touch /state/ran; exec probe fill alloc 5000 1000 eat 1024; fi; sleep 3600' \
    64Mi Always
  eventually "its process is OOM-killed and the container restarted" 90 last_exit_is e-oom OOMKilled || return
  eventually "the restarted container holds all 5000 MiB again" 60 pod_log_has e-oom waiting
  expect_eq "the restarted container: 5000 MiB, all of it" "fill alloc held=$((5000 * MIB_BYTES)) rc=0" \
    "$(pod_log e-oom | grep '^fill')"
  local gpu
  gpu=$(pod_gpu e-oom)
  eventually "agent metrics: 5000 MiB on its GPU, not the dead process's as well" 15 shim_used_is "$gpu" $((5000 * MIB_BYTES))
  measured "accounting error after an OOM restart (bytes)" "$(($(shim_used "$gpu") - 5000 * MIB_BYTES))"
  # Killed for good (restartPolicy Never): what does the agent read until the pod is deleted?
  probe_pod e-dead 3000 "Tesla T4" 'exec probe fill alloc 3000 1000 eat 1024' 64Mi Never
  eventually "a container whose only process is OOM-killed, not restarted" 60 pod_exit_is e-dead OOMKilled
  local xgpu others=0
  xgpu=$(pod_gpu e-dead)
  [ "$xgpu" != "$gpu" ] || others=$((5000 * MIB_BYTES))
  eventually "killed for good: the agent counts none of the 3000 MiB it held" 15 shim_used_is "$xgpu" "$others"
  measured "accounting error, killed and not restarted (bytes)" "$(($(shim_used "$xgpu") - others))"
  delete_pods e-dead
  # Deleted while allocating and freeing in a loop.
  probe_pod e-del 5000 "Tesla T4" 'while true; do probe fill alloc 5000 250 freeall > /dev/null; done'
  eventually "a pod allocating in a loop runs" 60 is_running e-del || return
  local dgpu
  dgpu=$(pod_gpu e-del)
  sleep 2
  delete_pods e-del e-oom
  eventually "both gone: the agent reports nothing in use on their GPUs" 30 shim_used_are "$gpu $dgpu" "0 0"
  eventually "the usage annotation: nothing allocated on them" 30 allocated_are "$gpu $dgpu" "0 0"
  probe_pod e-next 5000 "Tesla T4" 'probe fill alloc 5000 1000 fill alloc 1 1 wait /tmp/exit; sleep 3600'
  eventually "the next pod holds the whole room again" 60 pod_log_has e-next waiting
  expect_eq "the next pod: 5000 MiB, not one more" "fill alloc held=$((5000 * MIB_BYTES)) rc=0|fill alloc held=0 rc=2" \
    "$(pod_log e-next | grep '^fill' | paste -sd '|')"
  eventually "agent metrics: its 5000 MiB" 15 shim_used_is "$(pod_gpu e-next)" $((5000 * MIB_BYTES))
  delete_pods e-next
  wait_idle
}

# DRA: the same limit through a prepared claim (its CDI spec carries the limit, the shim and the
# accounting directory).
scenario_dra_enforce() {
  scenario "DRA enforcement: a 5000Mi claim allocates up to its limit on every path; the agent reports its use"
  claim_template gpu-5000mi 5000Mi
  kn apply -f - > /dev/null << EOF
apiVersion: v1
kind: Pod
metadata:
  name: d-enf
spec:
  terminationGracePeriodSeconds: 1
  restartPolicy: Never
  nodeSelector: {kubernetes.io/hostname: $REAL_NODE}
  resourceClaims: [{name: gpu, resourceClaimTemplateName: gpu-5000mi}]
  containers:
    - name: main
      image: $PROBE_IMAGE
      imagePullPolicy: Never
      command: [sh, -c, 'probe fill alloc 3000 1000 fill vmm 1000 1000 wait /tmp/free freeall wait /tmp/exit; sleep 3600']
      env: [{name: GPUMEM_FAKE_CUDA_TOTAL_MIB, value: "32768"}]
      resources: {claims: [{name: gpu}]}
EOF
  eventually "a probe pod with a 5000Mi claim holds 4000 MiB" 60 pod_log_has d-enf waiting || return
  check_limit d-enf 5000
  local device gpu
  device=$(claim_device d-enf)
  gpu=${device#gpu-}
  eventually "agent metrics: 4000 MiB used on the claim's GPU" 15 shim_used_is "$gpu" $((4000 * MIB_BYTES))
  measured "DRA: accounting error, holding 4000 MiB (bytes)" "$(($(shim_used "$gpu") - 4000 * MIB_BYTES))"
  eventually "the Node's gpu-used: the claim's pod holds 4000 MiB on that GPU" 30 used_shows d-enf "$gpu" "4000 4000"
  in_pod d-enf 'touch /tmp/free' > /dev/null
  eventually "freed: the metric drops to 0" 15 shim_used_is "$gpu" 0
  eventually "freed: the Node's gpu-used drops to 0" 15 used_shows d-enf "$gpu" "0 0"
  check_paths d-enf 5000 probe
  check_paths d-enf 5000 probe-procaddr
  in_pod d-enf 'touch /tmp/exit' > /dev/null
  delete_pods d-enf
  eventually "the pod's claim is gone" 30 no_claims
  eventually "agent metrics: nothing used on that GPU" 15 shim_used_is "$gpu" 0
  wait_dra_idle
}
