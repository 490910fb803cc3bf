#!/usr/bin/env bash
# Builds localhost/gpumem-probe:e2e, the image of the enforcement scenarios (tests/e2e/enforce.sh), as a
# docker-archive tarball the kit's containerd imports (the format of the kit's build-images.sh; nothing is
# pulled, pods use imagePullPolicy: Never). Everything in it is built or copied from this machine at test
# time, nothing is committed:
#   /usr/local/bin/probe            shim/tests/c/probe.c linked against libcuda.so.1 (dynamic, glibc)
#   /usr/local/bin/probe-procaddr   the same program reaching every entry point through cuGetProcAddress_v2
#   /usr/local/bin/probe-dlsym      the same through dlopen + dlsym (PROBE_LIBCUDA, PROBE_NEXT choose how)
#   /usr/local/bin/probe-static     the dlsym program statically linked (the loader never runs)
#   /usr/lib/x86_64-linux-gnu/libcuda.so.1   the project's fake driver (fake-cuda/), where the real one lives
#   the loader, libc, libdl and libgcc_s they need, from this machine; busybox (static) for sh and env.
#
# Usage: probe-image.sh ROOT OUT_TAR (ROOT: the repository, its fake driver built in target/debug).

set -euo pipefail
ROOT=$1
OUT_TAR=$2
IMAGE=localhost/gpumem-probe:e2e
W=$(mktemp -d "${TMPDIR:-/tmp}/gpumem-probe-image.XXXXXX")
trap 'rm -rf "$W"' EXIT
R=$W/rootfs
LIBDIR=/usr/lib/x86_64-linux-gnu
mkdir -p "$R/usr/local/bin" "$R$LIBDIR" "$R/bin" "$R/etc" "$R/tmp" "$R/proc" "$R/sys" "$R/dev" "$R/var/run" "$W/link"
chmod 1777 "$R/tmp"

fake=$ROOT/target/debug/libgpumem_fake_cuda.so
[ -f "$fake" ] || { echo "error: $fake not built (cargo build -p gpumem-fake-cuda)" >&2; exit 1; }
cp "$fake" "$R$LIBDIR/libcuda.so.1"
ln -s "$fake" "$W/link/libcuda.so.1"

cc_probe() { # MODE OUT [FLAGS...]
  local mode=$1 out=$2
  shift 2
  gcc -O2 -std=gnu11 -Wall -Wextra -D_GNU_SOURCE "-DMODE_$mode" -I"$ROOT/shim/tests/c" \
    "$ROOT/shim/tests/c/probe.c" -o "$R/usr/local/bin/$out" "$@"
}
cc_probe DIRECT probe -L"$W/link" -l:libcuda.so.1 -ldl
cc_probe PROCADDR probe-procaddr -ldl
cc_probe DLSYM probe-dlsym -ldl
# glibc warns that a static dlopen needs its own shared libraries at run time: they are in the image.
cc_probe DLSYM probe-static -static -ldl 2> /dev/null

# The loader and the libraries the programs and the fake driver need, at the paths they have here.
libs=$({
  for f in "$R/usr/local/bin/probe" "$R/usr/local/bin/probe-dlsym" "$fake"; do
    LD_LIBRARY_PATH=$W/link ldd "$f"
  done
  ls /lib/x86_64-linux-gnu/libdl.so.2
} | grep -o '/[^ ]*\.so[^ ]*' | grep -v libcuda | sort -u)
for lib in $libs; do
  mkdir -p "$R$(dirname "$lib")"
  cp -L "$lib" "$R$lib"
done
# The loader finds the fake driver in the multiarch directory whether /lib is /usr/lib or not; a static
# program's dlopen looks for the loader itself by name in the same directories.
[ -e "$R/lib/x86_64-linux-gnu/libcuda.so.1" ] || [ ! -d "$R/lib/x86_64-linux-gnu" ] ||
  ln -s "$LIBDIR/libcuda.so.1" "$R/lib/x86_64-linux-gnu/libcuda.so.1"
[ -e "$R$LIBDIR/ld-linux-x86-64.so.2" ] || cp -L /lib64/ld-linux-x86-64.so.2 "$R$LIBDIR/ld-linux-x86-64.so.2"

cp /bin/busybox "$R/bin/busybox"
for a in sh env sleep cat touch ls kill echo test grep seq unshare mount; do ln -s busybox "$R/bin/$a"; done
echo 'root:x:0:0:root:/root:/bin/sh' > "$R/etc/passwd"
echo 'root:x:0:' > "$R/etc/group"

# A docker-archive: one layer, its config, the manifest naming the image.
d=$W/archive
mkdir -p "$d"
tar --numeric-owner --owner=0 --group=0 --sort=name --mtime='2024-01-01' -C "$R" -cf "$W/layer.tar" .
diff=$(sha256sum "$W/layer.tar" | cut -d' ' -f1)
mkdir -p "$d/$diff"
mv "$W/layer.tar" "$d/$diff/layer.tar"
cat > "$W/config.json" << CFG
{"architecture":"amd64","os":"linux","created":"2024-01-01T00:00:00Z",
 "config":{"Env":["PATH=/usr/local/bin:/usr/bin:/bin"],"Cmd":["sh"],"WorkingDir":"/"},
 "rootfs":{"type":"layers","diff_ids":["sha256:$diff"]},
 "history":[{"created":"2024-01-01T00:00:00Z","created_by":"tests/e2e/probe-image.sh"}]}
CFG
cfgsum=$(sha256sum "$W/config.json" | cut -d' ' -f1)
mv "$W/config.json" "$d/$cfgsum.json"
echo "[{\"Config\":\"$cfgsum.json\",\"RepoTags\":[\"$IMAGE\"],\"Layers\":[\"$diff/layer.tar\"]}]" > "$d/manifest.json"
tar -C "$d" -cf "$OUT_TAR.tmp" manifest.json "$cfgsum.json" "$diff"
mv -f "$OUT_TAR.tmp" "$OUT_TAR"
echo "built $OUT_TAR ($IMAGE, $(du -k "$OUT_TAR" | cut -f1) KiB)"
