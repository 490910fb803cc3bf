//! Generates the Rust code for the kubelet's gRPC APIs (Device Plugin v1beta1, Pod Resources v1, the
//! DRA plugin API v1, DRA resource health v1alpha1 and plugin registration v1) from `proto/`.
//!
//! The `.proto` files are parsed by `protox`, a pure-Rust protobuf compiler, into a
//! `FileDescriptorSet`, which `tonic-prost-build` turns into prost messages plus tonic clients and
//! servers. No system `protoc` is needed.

use std::path::Path;

/// Root the proto imports are resolved against; also what Cargo watches for changes.
const PROTO_ROOT: &str = "proto";

/// The files to compile, relative to [`PROTO_ROOT`].
const PROTOS: &[&str] = &[
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
    "dra/v1/api.proto",
    "pluginregistration/v1/api.proto",
    "drahealth/v1alpha1/api.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={PROTO_ROOT}");
    for proto in PROTOS {
        println!(
            "cargo:rerun-if-changed={}",
            Path::new(PROTO_ROOT).join(proto).display()
        );
    }

    let fds = protox::compile(PROTOS, [PROTO_ROOT])?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
