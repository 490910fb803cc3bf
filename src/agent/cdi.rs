//! CDI specs for prepared DRA claims: what the container runtime (containerd 1.7+, CRI-O) adds to a
//! container that uses a claim. One file per claim in the runtime's CDI directory, written whole and
//! renamed into place (the runtime reads the directory at each container creation), removed when the
//! claim is unprepared.
//!
//! The claim-wide edits (which GPUs the container sees, its memory limit, the shim, the preload file
//! and the accounting directory: what Allocate hands a gpu-mem container) sit at the spec level, which
//! CDI applies once however many of the claim's devices a container gets; each device adds only its
//! own name, as CDI wants every device to edit something.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::Serialize;

use crate::plugin::proto::v1beta1::Mount;

/// The CDI specification version written: spec-level edits and mount options are in it, and
/// containerd 1.7+ and CRI-O read it.
pub const CDI_VERSION: &str = "0.6.0";
/// The class of every device we write, under the driver's name as vendor (`gpumem.io/claim`).
const CDI_CLASS: &str = "claim";

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    cdi_version: &'static str,
    kind: String,
    devices: Vec<Device>,
    container_edits: Edits,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    container_edits: Edits,
}

#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
struct Edits {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    env: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    mounts: Vec<CdiMount>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct CdiMount {
    host_path: String,
    container_path: String,
    #[serde(rename = "type")]
    kind: &'static str,
    options: Vec<&'static str>,
}

/// What a container using one claim gets.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ClaimEdits {
    pub env: BTreeMap<String, String>,
    pub mounts: Vec<Mount>,
    /// Per device of the claim: its name in the allocation (`gpu-2`) and its GPU's UUID.
    pub devices: Vec<(String, String)>,
}

/// The CDI directory and the names of what the driver writes there.
#[derive(Debug, Clone)]
pub struct CdiSpecs {
    dir: PathBuf,
    kind: String,
}

impl CdiSpecs {
    pub fn new(dir: &Path, driver: &str) -> Self {
        Self {
            dir: dir.to_path_buf(),
            kind: format!("{driver}/{CDI_CLASS}"),
        }
    }

    /// The file holding a claim's spec.
    pub fn path(&self, claim_uid: &str) -> PathBuf {
        let vendor = self.kind.replace('/', "-");
        self.dir.join(format!("{vendor}_{claim_uid}.json"))
    }

    /// The fully qualified CDI name of one of a claim's devices (`gpumem.io/claim=<uid>-gpu-2`):
    /// device names are unique per kind across every spec, so the claim's UID is part of each.
    pub fn device_id(&self, claim_uid: &str, device: &str) -> String {
        format!("{}={claim_uid}-{device}", self.kind)
    }

    /// Writes (or rewrites) a claim's spec.
    pub fn write(&self, claim_uid: &str, edits: &ClaimEdits) -> anyhow::Result<()> {
        let spec = Spec {
            cdi_version: CDI_VERSION,
            kind: self.kind.clone(),
            devices: edits
                .devices
                .iter()
                .map(|(device, uuid)| Device {
                    name: format!("{claim_uid}-{device}"),
                    container_edits: Edits {
                        env: vec![format!("GPUMEM_DEVICE_{}={uuid}", env_name(device))],
                        mounts: Vec::new(),
                    },
                })
                .collect(),
            container_edits: Edits {
                env: edits.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
                mounts: edits
                    .mounts
                    .iter()
                    .map(|m| CdiMount {
                        host_path: m.host_path.clone(),
                        container_path: m.container_path.clone(),
                        kind: "bind",
                        options: vec![if m.read_only { "ro" } else { "rw" }, "nosuid", "nodev", "rbind"],
                    })
                    .collect(),
            },
        };
        std::fs::create_dir_all(&self.dir).with_context(|| format!("creating {}", self.dir.display()))?;
        let path = self.path(claim_uid);
        // Its temporary is not *.json: the runtime never reads a half-written spec.
        crate::durable::write(&path, &serde_json::to_vec_pretty(&spec)?, 0o644)
            .with_context(|| format!("writing the CDI spec {}", path.display()))
    }

    /// Removes a claim's spec; a spec already gone is fine.
    pub fn remove(&self, claim_uid: &str) -> anyhow::Result<()> {
        let path = self.path(claim_uid);
        match std::fs::remove_file(&path) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                Err(err).with_context(|| format!("removing the CDI spec {}", path.display()))
            }
            _ => Ok(()),
        }
    }
}

/// `gpu-2` → `GPU_2`: a device name as part of an environment variable's name.
fn env_name(device: &str) -> String {
    device
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claims_spec_has_its_edits_once_and_a_named_device_each() {
        let dir = tempfile::tempdir().unwrap();
        let specs = CdiSpecs::new(dir.path(), "gpumem.io");
        let edits = ClaimEdits {
            env: BTreeMap::from([
                ("GPUMEM_LIMIT_MIB".to_string(), "5000".to_string()),
                ("NVIDIA_VISIBLE_DEVICES".to_string(), "GPU-a".to_string()),
            ]),
            mounts: vec![Mount {
                container_path: "/etc/ld.so.preload".into(),
                host_path: "/var/lib/gpumem/ld.so.preload".into(),
                read_only: true,
            }],
            devices: vec![("gpu-2".into(), "GPU-a".into())],
        };
        specs.write("u-1", &edits).unwrap();
        let path = specs.path("u-1");
        assert_eq!(path.file_name().unwrap(), "gpumem.io-claim_u-1.json");
        let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(spec["cdiVersion"], CDI_VERSION);
        assert_eq!(spec["kind"], "gpumem.io/claim");
        assert_eq!(spec["devices"][0]["name"], "u-1-gpu-2");
        assert_eq!(
            spec["devices"][0]["containerEdits"]["env"][0],
            "GPUMEM_DEVICE_GPU_2=GPU-a"
        );
        let env = &spec["containerEdits"]["env"];
        assert_eq!(env[0], "GPUMEM_LIMIT_MIB=5000");
        assert_eq!(env[1], "NVIDIA_VISIBLE_DEVICES=GPU-a");
        let mount = &spec["containerEdits"]["mounts"][0];
        assert_eq!(mount["containerPath"], "/etc/ld.so.preload");
        assert_eq!(mount["options"][0], "ro");
        assert_eq!(specs.device_id("u-1", "gpu-2"), "gpumem.io/claim=u-1-gpu-2");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
        specs.remove("u-1").unwrap();
        assert!(!path.exists());
        specs.remove("u-1").unwrap();
    }
}
