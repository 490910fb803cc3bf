//! Hard memory limits: what Allocate hands a gpu-mem container so that `libgpumem_cuda.so`
//! enforces its limit inside every process (contract in docs/enforcement.md).
//!
//! On the host, under the agent's state directory:
//! - `ld.so.preload`: one line naming the shim's path inside the container, mounted read-only at
//!   `/etc/ld.so.preload`;
//! - `containers/<allocation>/`: one accounting directory per allocation, mounted read-write at
//!   `/var/run/gpumem`. An allocation is named by its GPU and first memory unit (`g<index>-u<n>`):
//!   the kubelet never hands one unit to two live containers, so the name is unique while the
//!   container lives, and the same name in PodResources tells the agent when it is gone.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use anyhow::Context as _;
use gpumem_accounting::{Reason, Usage};

use crate::plugin::proto::v1beta1::Mount;

/// Where the shim appears inside containers.
pub const SHIM_CONTAINER_PATH: &str = "/usr/local/gpumem/libgpumem_cuda.so";
/// Where the per-container accounting directory appears inside containers.
pub const ACCOUNTING_CONTAINER_DIR: &str = "/var/run/gpumem";
/// Environment variables the shim reads.
pub const ACCOUNTING_ENV: &str = "GPUMEM_ACCOUNTING_DIR";
pub const DEVICE_ORDER_ENV: &str = "CUDA_DEVICE_ORDER";

/// What the pods' processes hold, as the shim counted it ([`Enforcement::held`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Bytes, by GPU index and holder (`namespace/name`).
    pub bytes: BTreeMap<u32, BTreeMap<String, u64>>,
    /// Why each accounting file refused at this reading was refused.
    pub refused: Vec<Reason>,
}

impl Held {
    /// Bytes held on GPU index `gpu`, all holders together.
    pub fn on_gpu(&self, gpu: u32) -> u64 {
        self.bytes
            .get(&gpu)
            .map_or(0, |by| by.values().fold(0u64, |a, &b| a.saturating_add(b)))
    }
}

#[derive(Debug)]
pub struct Enforcement {
    shim: PathBuf,
    preload: PathBuf,
    containers: PathBuf,
    /// Allocations whose accounting file was rejected and logged, until it reads valid again: a
    /// container that keeps spoiling its file gets one log line, not one per scrape.
    rejected: Mutex<HashSet<String>>,
}

impl Enforcement {
    /// Checks the shim is installed and lays out the state directory.
    pub fn prepare(state_dir: &Path, shim: &Path) -> anyhow::Result<Self> {
        anyhow::ensure!(
            shim.is_file(),
            "libgpumem_cuda.so not found at {}: install it there (the DaemonSet's init container does), \
             point --shim-path at it, or run with --memory-limits off (pods could then use more GPU \
             memory than they asked for)",
            shim.display()
        );
        let containers = state_dir.join("containers");
        std::fs::create_dir_all(&containers).with_context(|| format!("creating {}", containers.display()))?;
        let preload = state_dir.join("ld.so.preload");
        crate::durable::write(&preload, format!("{SHIM_CONTAINER_PATH}\n").as_bytes(), 0o644)
            .with_context(|| format!("writing {}", preload.display()))?;
        Ok(Self {
            shim: shim.to_path_buf(),
            preload,
            containers,
            rejected: Mutex::default(),
        })
    }

    /// The name of the allocation holding these units of GPU `gpu_index`.
    pub fn allocation_name(gpu_index: u32, units: &[u64]) -> String {
        format!("g{gpu_index}-u{}", units.iter().min().copied().unwrap_or(0))
    }

    /// The name of the allocation a prepared DRA claim holds on GPU `gpu_index`: the claim's UID
    /// names it as the first unit does on the device-plugin path.
    pub fn claim_allocation_name(gpu_index: u32, claim_uid: &str) -> String {
        format!("g{gpu_index}-c{claim_uid}")
    }

    /// The name of the allocation share slot `slot` of GPU `gpu_index` holds (`memCounting: shares`):
    /// the kubelet never hands one slot to two live containers.
    pub fn share_allocation_name(gpu_index: u32, slot: u32) -> String {
        format!("g{gpu_index}-s{slot}")
    }

    /// The GPU index an allocation name carries.
    pub fn gpu_index_of(allocation: &str) -> Option<u32> {
        let (index, rest) = allocation.strip_prefix('g')?.split_once('-')?;
        if !(rest.starts_with('u') || rest.starts_with('c') || rest.starts_with('s')) {
            return None;
        }
        index.parse().ok()
    }

    /// Mounts and environment for a new container's allocation; starts its accounting afresh.
    pub fn container(&self, allocation: &str) -> anyhow::Result<(Vec<Mount>, HashMap<String, String>)> {
        let dir = self.containers.join(allocation);
        // A directory of this name belonged to an earlier container that held the same units.
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        self.rejected().remove(allocation);
        Ok(self.edits(allocation))
    }

    /// Mounts and environment of an allocation's containers, touching nothing: what a restarted
    /// agent hands out again for a container that already runs.
    pub fn edits(&self, allocation: &str) -> (Vec<Mount>, HashMap<String, String>) {
        let dir = self.containers.join(allocation);
        let mount = |host: &Path, container: &str, read_only| Mount {
            container_path: container.into(),
            host_path: host.display().to_string(),
            read_only,
        };
        let mounts = vec![
            mount(&self.shim, SHIM_CONTAINER_PATH, true),
            mount(&self.preload, "/etc/ld.so.preload", true),
            mount(&dir, ACCOUNTING_CONTAINER_DIR, false),
        ];
        let envs = HashMap::from([
            (ACCOUNTING_ENV.to_string(), ACCOUNTING_CONTAINER_DIR.to_string()),
            (DEVICE_ORDER_ENV.to_string(), "PCI_BUS_ID".to_string()),
        ]);
        (mounts, envs)
    }

    /// Makes an allocation's accounting directory if it is missing (a restart keeps what is there).
    pub fn ensure(&self, allocation: &str) -> anyhow::Result<()> {
        let dir = self.containers.join(allocation);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))
    }

    /// Removes the accounting directories of allocations that are no longer live.
    pub fn forget_all_but(&self, live: &BTreeSet<String>) {
        let Ok(entries) = std::fs::read_dir(&self.containers) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !live.contains(&name) {
                match std::fs::remove_dir_all(entry.path()) {
                    Ok(()) => tracing::debug!(allocation = %name, "container gone: accounting removed"),
                    Err(err) => tracing::warn!(allocation = %name, error = %err, "cannot remove accounting"),
                }
            }
        }
    }

    /// What each live container's processes use, per allocation, as the shim counted it; for a
    /// file the agent refuses (the container writes it: see `gpumem_accounting::read_usage`), why.
    /// A refused file is logged once, until it reads valid again or its container is gone.
    pub fn usage(&self) -> Vec<(String, Result<Usage, Reason>)> {
        let Ok(entries) = std::fs::read_dir(&self.containers) else {
            return Vec::new();
        };
        let mut rejected = self.rejected();
        let mut still_rejected = HashSet::new();
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let allocation = entry.file_name().to_string_lossy().into_owned();
            match gpumem_accounting::read_usage(&entry.path()) {
                Ok(Some(usage)) => out.push((allocation, Ok(usage))),
                Ok(None) => {}
                Err(err) => {
                    if !rejected.contains(&allocation) {
                        tracing::warn!(
                            allocation = %allocation,
                            reason = %err.reason(),
                            error = %err,
                            "accounting file rejected: its usage is not counted (logged again only \
                             after it reads valid)"
                        );
                    }
                    out.push((allocation.clone(), Err(err.reason())));
                    still_rejected.insert(allocation);
                }
            }
        }
        *rejected = still_rejected;
        out
    }

    /// Bytes the shim counted in each live allocation (`live`: accounting name → who holds it, as
    /// [`super::state::NodeState::live_allocations`] gives it), summed by GPU index and holder; and why
    /// each refused file was refused. A directory of an allocation that is no longer live (its container
    /// is gone, the directory not yet removed) counts for no one.
    pub fn held(&self, live: &BTreeMap<String, String>) -> Held {
        let mut held = Held::default();
        for (allocation, counted) in self.usage() {
            match counted {
                Err(reason) => held.refused.push(reason),
                Ok(usage) => {
                    if let (Some(gpu), Some(holder)) =
                        (Self::gpu_index_of(&allocation), live.get(&allocation))
                    {
                        let bytes = held
                            .bytes
                            .entry(gpu)
                            .or_default()
                            .entry(holder.clone())
                            .or_default();
                        *bytes = bytes.saturating_add(usage.total_used());
                    }
                }
            }
        }
        held
    }

    fn rejected(&self) -> MutexGuard<'_, HashSet<String>> {
        // A set of names: a panic while it was held cannot leave it inconsistent.
        self.rejected.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_shim_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = Enforcement::prepare(dir.path(), &dir.path().join("nope.so"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--memory-limits off"), "{err}");
    }

    #[test]
    fn containers_get_fresh_accounting_and_gone_ones_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let shim = dir.path().join("libgpumem_cuda.so");
        std::fs::write(&shim, b"").unwrap();
        let enforcement = Enforcement::prepare(&dir.path().join("state"), &shim).unwrap();
        let preload = std::fs::read_to_string(dir.path().join("state/ld.so.preload")).unwrap();
        assert_eq!(preload, format!("{SHIM_CONTAINER_PATH}\n"));

        let name = Enforcement::allocation_name(2, &[7, 5, 9]);
        assert_eq!(name, "g2-u5");
        assert_eq!(Enforcement::gpu_index_of(&name), Some(2));
        assert_eq!(Enforcement::gpu_index_of("stray"), None);
        let claim = Enforcement::claim_allocation_name(3, "0b1c-77");
        assert_eq!(claim, "g3-c0b1c-77");
        assert_eq!(Enforcement::gpu_index_of(&claim), Some(3));
        assert_eq!(
            Enforcement::gpu_index_of(&Enforcement::share_allocation_name(1, 7)),
            Some(1)
        );
        assert_eq!(Enforcement::gpu_index_of("g3-x1"), None);
        let (mounts, envs) = enforcement.container(&name).unwrap();
        assert_eq!(mounts.len(), 3);
        assert!(mounts[0].read_only && mounts[1].read_only && !mounts[2].read_only);
        assert_eq!(mounts[1].container_path, "/etc/ld.so.preload");
        let host = PathBuf::from(&mounts[2].host_path);
        assert!(host.is_dir());
        assert_eq!(envs[ACCOUNTING_ENV], ACCOUNTING_CONTAINER_DIR);
        std::fs::write(host.join("leftover"), b"x").unwrap();
        enforcement.container(&name).unwrap();
        assert!(!host.join("leftover").exists(), "a reused name starts afresh");

        enforcement.container("g0-u0").unwrap();
        enforcement.forget_all_but(&BTreeSet::from(["g0-u0".to_string()]));
        assert!(!host.exists());
        assert!(dir.path().join("state/containers/g0-u0").is_dir());
    }

    #[test]
    fn what_is_held_is_summed_by_gpu_and_pod_for_live_allocations_only() {
        use gpumem_accounting::{Accounting, MAX_DEVICES, UNLIMITED};
        let dir = tempfile::tempdir().unwrap();
        let shim = dir.path().join("libgpumem_cuda.so");
        std::fs::write(&shim, b"").unwrap();
        let enforcement = Enforcement::prepare(&dir.path().join("state"), &shim).unwrap();
        let limits = [UNLIMITED; MAX_DEVICES];
        let mut attached = Vec::new();
        for (name, bytes) in [
            ("g0-u0", 1u64 << 30),
            ("g0-u9", 5),
            ("g1-u0", 7),
            ("g2-cuid-1", 512 << 20),
        ] {
            let (mounts, _) = enforcement.container(name).unwrap();
            let (accounting, _) =
                Accounting::open_or_create(Path::new(&mounts[2].host_path), &limits).unwrap();
            assert!(accounting.try_reserve(0, bytes));
            attached.push(accounting);
        }
        let live = BTreeMap::from([
            ("g0-u0".to_string(), "ns/a".to_string()),
            ("g0-u9".to_string(), "ns/a".to_string()),
            ("g2-cuid-1".to_string(), "ns/c".to_string()),
        ]);
        let held = enforcement.held(&live);
        assert_eq!(
            held.bytes,
            BTreeMap::from([
                (0, BTreeMap::from([("ns/a".to_string(), (1 << 30) + 5)])),
                (2, BTreeMap::from([("ns/c".to_string(), 512 << 20)])),
            ]),
            "g1-u0 is not live: it counts for no one"
        );
        assert_eq!(held.on_gpu(0), (1 << 30) + 5);
        assert_eq!(held.on_gpu(1), 0);
        assert!(held.refused.is_empty());
    }

    #[test]
    fn a_rejected_file_is_logged_once_until_it_reads_valid() {
        let dir = tempfile::tempdir().unwrap();
        let shim = dir.path().join("libgpumem_cuda.so");
        std::fs::write(&shim, b"").unwrap();
        let enforcement = Enforcement::prepare(&dir.path().join("state"), &shim).unwrap();
        let (mounts, _) = enforcement.container("g0-u0").unwrap();
        let file = PathBuf::from(&mounts[2].host_path).join(gpumem_accounting::FILE_NAME);
        std::fs::create_dir(&file).unwrap();
        let rejected = vec![("g0-u0".to_string(), Err(Reason::NotRegularFile))];
        assert_eq!(enforcement.usage(), rejected);
        assert!(
            enforcement.rejected().contains("g0-u0"),
            "logged, and remembered as such"
        );
        assert_eq!(enforcement.usage(), rejected, "counted at every read");
        assert!(enforcement.rejected().contains("g0-u0"));
        std::fs::remove_dir(&file).unwrap();
        assert!(enforcement.usage().is_empty());
        assert!(
            enforcement.rejected().is_empty(),
            "logged again if it goes bad again"
        );
    }
}
