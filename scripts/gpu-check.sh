#!/usr/bin/env bash
# The checks that need a real NVIDIA GPU and driver (run once on a GPU machine; no CUDA toolkit needed):
#  1. build gpumem and libgpumem_cuda.so;
#  2. `gpumem inspect` against the real NVML, table and JSON;
#  3. the tests that drive NVML and the agent, with the real library in the loader's path;
#  4. the shim on the real driver: the test probe (shim/tests/c/probe.c, compiled with gcc against the
#     driver's libcuda.so.1, reached the three ways real code does) must allocate exactly the limit on every
#     allocation kind and get CUDA_ERROR_OUT_OF_MEMORY (2) for one byte more, and cuMemGetInfo must report
#     the limit as the total.
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
step "done: $( [ $status -eq 0 ] && echo all steps ran || echo some steps FAILED ), outputs in $out"
exit $status
