#!/usr/bin/env bash
# The checks that need a real NVIDIA GPU and driver (run once on a GPU machine; no CUDA toolkit needed):
#  1. build gpumem and libgpumem_cuda.so;
#  2. `gpumem inspect` against the real NVML, table and JSON;
#  3. the tests that drive NVML and the agent, with the real library in the loader's path;
#  4. the shim on the real driver: the test probe (shim/tests/c/probe.c, compiled with gcc against the
#     driver's libcuda.so.1, reached the three ways real code does) must allocate exactly the limit on every
#     allocation kind and get CUDA_ERROR_OUT_OF_MEMORY (2) for one byte more, and cuMemGetInfo must report
#     the limit as the total;
#  5. the e2e suite's enforcement scenario on the real driver (the same program, `paths`: every path
#     frameworks allocate through, the VMM one mapped, filled to the limit in chunks, one MiB more refused,
#     cuMemGetInfo_v2 while full), with the primary context and with cuCtxCreate, and a second process
#     sharing the container's limit. Array kinds may be refused by the hardware's size limits
#     (CUDA_ERROR_INVALID_VALUE, 1): that is the driver's answer, not the shim's.
# Output goes to stdout and, when $OUT is set, into files under it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$(mktemp -d)}
limit_mib=${GPUMEM_CHECK_LIMIT_MIB:-512}
status=0
step() { printf '\n== %s\n' "$*"; }

step "build"
cargo build --release -p gpumem -p gpumem-cuda-shim || exit 1
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 | tee "$out/nvidia-smi.csv"

step "gpumem inspect (real NVML)"
./target/release/gpumem inspect | tee "$out/inspect.txt" || status=1
./target/release/gpumem inspect --output json > "$out/inspect.json" || status=1

step "tests with the real driver present"
cargo nextest run --release --workspace 2>&1 | tail -5 | tee "$out/tests.txt" || status=1

step "shim on the real driver, limit ${limit_mib} MiB"
shim=$PWD/target/release/libgpumem_cuda.so
libcuda=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
[ -n "$libcuda" ] || { echo "libcuda.so.1 not found"; exit 1; }
bytes=$((limit_mib * 1024 * 1024))
for mode in DIRECT DLSYM PROCADDR; do
  probe="$out/probe-$mode"
  link=()
  [ "$mode" = DIRECT ] && link=(-L"$(dirname "$libcuda")" -l:libcuda.so.1)
  gcc -O2 -std=gnu11 -D_GNU_SOURCE -DMODE_$mode -Ishim/tests/c shim/tests/c/probe.c -o "$probe" "${link[@]}" -ldl \
    || { status=1; continue; }
  acct=$(mktemp -d)
  echo "-- $mode: without the shim"
  "$probe" info | tee "$out/probe-$mode-plain.txt"
  echo "-- $mode: with the shim"
  GPUMEM_LIMIT_MIB=$limit_mib GPUMEM_ACCOUNTING_DIR=$acct LD_PRELOAD=$shim \
    "$probe" info check "$bytes" 2>&1 | tee "$out/probe-$mode-limited.txt" || status=1
done
step "the e2e enforcement scenario on the real driver, limit ${limit_mib} MiB"
acct=$(mktemp -d)
chunk=$(((limit_mib + 3) / 4))
for mode in DIRECT PROCADDR; do
  for context in primary create; do
    echo "-- $mode, $context context"
    GPUMEM_LIMIT_MIB=$limit_mib GPUMEM_ACCOUNTING_DIR=$acct LD_PRELOAD=$shim PROBE_CONTEXT=$context \
      "$out/probe-$mode" paths "$limit_mib" "$chunk" 2>&1 | tee "$out/paths-$mode-$context.txt" || status=1
    held=$(grep -c "^path .* rc=0 one_more_mib=2 info=0 free=0 total=$bytes freed=0\$" "$out/paths-$mode-$context.txt")
    echo "   $held of 13 paths held at exactly ${limit_mib} MiB"
  done
done
echo "-- two processes of one container share the limit"
GPUMEM_LIMIT_MIB=$limit_mib GPUMEM_ACCOUNTING_DIR=$acct LD_PRELOAD=$shim \
  "$out/probe-DIRECT" fill alloc "$((limit_mib / 2))" "$chunk" wait "$acct/go" > "$out/holder.txt" 2>&1 &
holder=$!
until grep -q waiting "$out/holder.txt" 2> /dev/null || ! kill -0 "$holder" 2> /dev/null; do sleep 0.2; done
GPUMEM_LIMIT_MIB=$limit_mib GPUMEM_ACCOUNTING_DIR=$acct LD_PRELOAD=$shim \
  "$out/probe-PROCADDR" fill vmm "$limit_mib" "$chunk" info 2>&1 | tee "$out/second.txt" || status=1
touch "$acct/go"
wait "$holder"
cat "$out/holder.txt"

step "done: $( [ $status -eq 0 ] && echo all steps ran || echo some steps FAILED ), outputs in $out"
exit $status
