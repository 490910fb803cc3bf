# syntax=docker/dockerfile:1.7
#
# gpumem image: the `gpumem` binary (agent, scorer, inspect, simulate) and libgpumem_cuda.so.
#
#   docker build -t ghcr.io/gpumem/gpumem:0.1.0 .
#
# Both artifacts are linked against glibc 2.17 (manylinux2014's baseline) with cargo-zigbuild:
# - libgpumem_cuda.so is preloaded into every gpu-mem container, whatever its image: built against
#   a newer glibc it would fail to load in older images (the loader prints an error and the program
#   runs unenforced). docs/enforcement.md, "glibc".
# - gpumem is NOT a static musl binary: the agent loads the driver's libnvidia-ml.so.1 with dlopen
#   at run time, and a static musl executable cannot dlopen a glibc library. A glibc 2.17 binary on
#   a small glibc base (distroless/cc) runs wherever the driver's libraries do.
# docs/install.md, "The image", says why the agent needs what it needs at run time.

ARG RUST_VERSION=1.89
ARG ZIG_VERSION=0.13.0
ARG CARGO_ZIGBUILD_VERSION=0.19.8

FROM rust:${RUST_VERSION}-bookworm AS build
ARG ZIG_VERSION
ARG CARGO_ZIGBUILD_VERSION
# zig from PyPI (the ziglang wheel) as cargo-zigbuild's linker; protoc is not needed (build.rs
# compiles the kubelet protos with protox).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-pip \
 && pip3 install --break-system-packages "ziglang==${ZIG_VERSION}" \
 && cargo install --locked "cargo-zigbuild@${CARGO_ZIGBUILD_VERSION}" \
 && rustup target add x86_64-unknown-linux-gnu \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo zigbuild --release --locked --target x86_64-unknown-linux-gnu.2.17 \
        --package gpumem --bin gpumem \
        --package gpumem-cuda-shim --lib \
 && mkdir -p /out \
 && cp target/x86_64-unknown-linux-gnu/release/gpumem /out/gpumem \
 && cp target/x86_64-unknown-linux-gnu/release/libgpumem_cuda.so /out/libgpumem_cuda.so \
 && strip /out/gpumem /out/libgpumem_cuda.so

# A static busybox: the agent's init container needs mkdir/cp/chmod/mv to install the shim on the
# host atomically; the runtime image has no shell of its own.
FROM busybox:1.36.1-musl AS busybox

FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="gpumem" \
      org.opencontainers.image.description="Share GPUs in Kubernetes by memory: agent, scheduler extender, CUDA memory-limit shim" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gpumem/gpumem"
COPY --from=busybox /bin/busybox /bin/busybox
COPY --from=build /out/gpumem /usr/local/bin/gpumem
COPY --from=build /out/libgpumem_cuda.so /usr/local/lib/gpumem/libgpumem_cuda.so
# The scorer and `gpumem inspect` run as this user. The agent's pod overrides it with uid 0 (it
# creates sockets in the kubelet's root-owned directories) but keeps no capability.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpumem"]
CMD ["--help"]
