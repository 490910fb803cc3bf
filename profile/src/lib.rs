//! Simulated GPU nodes.
//!
//! A profile describes a GPU node the way NVML would report it: the GPUs, their PCIe placement
//! (NUMA node, PCIe switch, host bridge) and their NVLink wiring. Two consumers read the same
//! profiles, so that what the demo shows and what the tests drive through NVML cannot drift apart:
//! `gpumem` itself (`--profile`, no GPU needed) and the test-only fake `libnvidia-ml.so.1`.
//!
//! The file format is TOML; see `profiles/*.toml` for the built-in ones and the README for the
//! field reference.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::Deserialize;

/// The built-in profiles, by name.
pub const BUILTIN: &[(&str, &str)] = &[
    ("dgx-a100", include_str!("../profiles/dgx-a100.toml")),
    ("hgx-h100", include_str!("../profiles/hgx-h100.toml")),
    ("t4x4", include_str!("../profiles/t4x4.toml")),
    ("mixed", include_str!("../profiles/mixed.toml")),
];

/// Why a profile could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("unknown profile {name:?}: built-in profiles are {known}, or give a path to a .toml file")]
    Unknown { name: String, known: String },
    #[error("cannot read profile {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("profile {origin} is not valid TOML for a gpumem profile: {message}")]
    Parse { origin: String, message: String },
    #[error("profile {origin}: {message}")]
    Invalid { origin: String, message: String },
}

/// How two GPUs are connected over PCIe, closest first. The numeric values are NVML's
/// `nvmlGpuTopologyLevel_t`, so the fake NVML library can hand them out as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum TopologyLevel {
    /// The same board (or the same GPU).
    Internal = 0,
    /// Behind one PCIe switch (nvidia-smi `PIX`).
    Single = 10,
    /// Behind several PCIe switches, without crossing a host bridge (`PXB`).
    Multiple = 20,
    /// Through one PCIe host bridge (`PHB`).
    HostBridge = 30,
    /// Host bridges of the same NUMA node (`NODE`).
    Node = 40,
    /// Across NUMA nodes, over the CPU interconnect (`SYS`).
    System = 50,
}

impl TopologyLevel {
    /// From NVML's numeric value.
    pub fn from_nvml(value: u32) -> Option<Self> {
        Some(match value {
            0 => Self::Internal,
            10 => Self::Single,
            20 => Self::Multiple,
            30 => Self::HostBridge,
            40 => Self::Node,
            50 => Self::System,
            _ => return None,
        })
    }

    /// The abbreviation `nvidia-smi topo -m` prints.
    pub fn smi_name(self) -> &'static str {
        match self {
            Self::Internal => "X",
            Self::Single => "PIX",
            Self::Multiple => "PXB",
            Self::HostBridge => "PHB",
            Self::Node => "NODE",
            Self::System => "SYS",
        }
    }
}

impl fmt::Display for TopologyLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.smi_name())
    }
}

/// One GPU of a profile, with every default applied.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSpec {
    pub index: u32,
    pub uuid: String,
    pub minor_number: u32,
    pub product: String,
    pub memory_mib: u64,
    pub compute_capability: (u32, u32),
    /// NVML's form: `DDDDDDDD:BB:DD.F`, upper-case hex.
    pub bus_id: String,
    pub numa_node: Option<u32>,
    pub pcie_switch: Option<u32>,
    pub host_bridge: Option<u32>,
}

/// One active NVLink link of a GPU, as NVML reports it: where its far end sits on PCIe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvLinkSpec {
    pub link: u32,
    /// Bus id of the peer GPU, or of the NVSwitch the link goes into.
    pub remote_bus_id: String,
    pub remote_is_switch: bool,
}

/// A whole simulated node.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    pub name: String,
    pub description: String,
    pub driver_version: String,
    /// CUDA driver API version as NVML encodes it: 1000 * major + 10 * minor.
    pub cuda_version: i32,
    pub gpus: Vec<GpuSpec>,
    nvswitch_links: u32,
    pairs: Vec<(u32, u32, u32)>,
}

/// NVML reports at most this many NVLink links per GPU (`NVML_NVLINK_MAX_LINKS`).
pub const MAX_NVLINKS: u32 = 18;

impl Profile {
    /// A built-in profile by name, or a profile file by path.
    pub fn load(name_or_path: &str) -> Result<Self, ProfileError> {
        if let Some((_, text)) = BUILTIN.iter().find(|(name, _)| *name == name_or_path) {
            return Self::parse(text, name_or_path);
        }
        let path = Path::new(name_or_path);
        let looks_like_path = name_or_path.contains('/') || name_or_path.ends_with(".toml");
        if looks_like_path || path.is_file() {
            let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
                path: name_or_path.to_string(),
                source,
            })?;
            return Self::parse(&text, name_or_path);
        }
        Err(ProfileError::Unknown {
            name: name_or_path.to_string(),
            known: builtin_names().join(", "),
        })
    }

    /// Parses profile text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ProfileError> {
        let raw: RawProfile = toml::from_str(text).map_err(|e| ProfileError::Parse {
            origin: origin.to_string(),
            message: e.message().to_string(),
        })?;
        raw.resolve().map_err(|message| ProfileError::Invalid {
            origin: origin.to_string(),
            message,
        })
    }

    /// How GPUs `a` and `b` (indices) are connected over PCIe.
    pub fn topology_level(&self, a: usize, b: usize) -> TopologyLevel {
        let (ga, gb) = (&self.gpus[a], &self.gpus[b]);
        let same = |x: Option<u32>, y: Option<u32>| x.is_some() && x == y;
        if a == b {
            TopologyLevel::Internal
        } else if same(ga.pcie_switch, gb.pcie_switch) {
            TopologyLevel::Single
        } else if same(ga.host_bridge, gb.host_bridge) {
            TopologyLevel::HostBridge
        } else if same(ga.numa_node, gb.numa_node) {
            TopologyLevel::Node
        } else {
            TopologyLevel::System
        }
    }

    /// The active NVLink links of GPU `index`, in link order.
    pub fn nvlinks(&self, index: usize) -> Vec<NvLinkSpec> {
        let mut links = Vec::new();
        if self.nvswitch_links > 0 {
            // Spread the links over the switch chips, as HGX boards do (6 chips on A100, 4 on H100).
            for link in 0..self.nvswitch_links {
                links.push(NvLinkSpec {
                    link,
                    remote_bus_id: nvswitch_bus_id(link % self.nvswitch_chips()),
                    remote_is_switch: true,
                });
            }
            return links;
        }
        let me = index as u32;
        for &(a, b, count) in &self.pairs {
            let peer = if a == me {
                b
            } else if b == me {
                a
            } else {
                continue;
            };
            for _ in 0..count {
                links.push(NvLinkSpec {
                    link: links.len() as u32,
                    remote_bus_id: self.gpus[peer as usize].bus_id.clone(),
                    remote_is_switch: false,
                });
            }
        }
        links
    }

    /// Whether the GPUs have NVLink hardware at all (NVML answers NotSupported otherwise).
    pub fn has_nvlink(&self) -> bool {
        self.nvswitch_links > 0 || !self.pairs.is_empty()
    }

    fn nvswitch_chips(&self) -> u32 {
        if self.nvswitch_links.is_multiple_of(6) {
            6
        } else {
            4
        }
    }

    /// The GPU with this bus id, if any (case-insensitive, with or without the 8-digit domain).
    pub fn gpu_by_bus_id(&self, bus_id: &str) -> Option<&GpuSpec> {
        let wanted = normalize_bus_id(bus_id)?;
        self.gpus
            .iter()
            .find(|g| normalize_bus_id(&g.bus_id).as_deref() == Some(wanted.as_str()))
    }
}

/// Names of the built-in profiles.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(name, _)| *name).collect()
}

/// PCI bus id of the n-th simulated NVSwitch chip.
fn nvswitch_bus_id(chip: u32) -> String {
    format!("00000000:{:02X}:00.0", 0xC4 + chip)
}

/// Parses `[domain:]bus:device.function` into NVML's canonical `DDDDDDDD:BB:DD.F` form.
pub fn normalize_bus_id(bus_id: &str) -> Option<String> {
    let (domain, rest) = match bus_id.matches(':').count() {
        2 => bus_id.split_once(':')?,
        1 => ("0", bus_id),
        _ => return None,
    };
    let (bus, dev_fn) = rest.split_once(':')?;
    let (device, function) = dev_fn.split_once('.')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let device = u8::from_str_radix(device, 16).ok()?;
    let function = u8::from_str_radix(function, 16).ok()?;
    if device > 0x1f || function > 7 {
        return None;
    }
    Some(format!("{domain:08X}:{bus:02X}:{device:02X}.{function:X}"))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    name: String,
    #[serde(default)]
    description: String,
    driver_version: String,
    cuda_version: String,
    #[serde(default)]
    gpu: RawGpu,
    #[serde(default)]
    nvlink: RawNvLink,
    gpus: Vec<RawGpu>,
}

#[derive(Deserialize, Default, Clone)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    uuid: Option<String>,
    minor_number: Option<u32>,
    product: Option<String>,
    memory_mib: Option<u64>,
    compute_capability: Option<String>,
    bus_id: Option<String>,
    numa_node: Option<u32>,
    pcie_switch: Option<u32>,
    host_bridge: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawNvLink {
    /// Every GPU attaches to an NVSwitch fabric with this many links.
    #[serde(default)]
    nvswitch_links: u32,
    /// Direct bridges: `[gpu a, gpu b, links]`.
    #[serde(default)]
    pairs: Vec<[u32; 3]>,
}

impl RawProfile {
    fn resolve(self) -> Result<Profile, String> {
        if self.gpus.is_empty() {
            return Err("a profile needs at least one [[gpus]] entry".into());
        }
        let (major, minor) = parse_major_minor(&self.cuda_version)
            .ok_or_else(|| format!("cuda_version {:?} is not MAJOR.MINOR", self.cuda_version))?;
        let cuda_version = nvml_cuda_version(major, minor).ok_or_else(|| {
            format!(
                "cuda_version {:?} is out of range: NVML encodes it as 1000 * major + 10 * minor in a \
                 32-bit signed integer, so minor must be below 100 and the total at most {}",
                self.cuda_version,
                i32::MAX
            )
        })?;
        let mut gpus = Vec::with_capacity(self.gpus.len());
        for (i, raw) in self.gpus.iter().enumerate() {
            let index = i as u32;
            let field = |name: &str| format!("gpus[{i}]: no {name} here and none under [gpu]");
            let product = raw
                .product
                .clone()
                .or(self.gpu.product.clone())
                .ok_or_else(|| field("product"))?;
            let memory_mib = raw
                .memory_mib
                .or(self.gpu.memory_mib)
                .ok_or_else(|| field("memory_mib"))?;
            if memory_mib == 0 {
                return Err(format!("gpus[{i}]: memory_mib must be positive"));
            }
            let cc_text = raw
                .compute_capability
                .clone()
                .or(self.gpu.compute_capability.clone())
                .ok_or_else(|| field("compute_capability"))?;
            let compute_capability = parse_major_minor(&cc_text)
                .ok_or_else(|| format!("gpus[{i}]: compute_capability {cc_text:?} is not MAJOR.MINOR"))?;
            let bus_id = match &raw.bus_id {
                Some(text) => normalize_bus_id(text)
                    .ok_or_else(|| format!("gpus[{i}]: bus_id {text:?} is not DOMAIN:BUS:DEVICE.FUNCTION"))?,
                None => format!("00000000:{:02X}:00.0", 0x10 + i * 0x10),
            };
            gpus.push(GpuSpec {
                index,
                uuid: raw
                    .uuid
                    .clone()
                    .unwrap_or_else(|| derived_uuid(&self.name, index)),
                minor_number: raw.minor_number.unwrap_or(index),
                product,
                memory_mib,
                compute_capability,
                bus_id,
                numa_node: raw.numa_node.or(self.gpu.numa_node),
                pcie_switch: raw.pcie_switch.or(self.gpu.pcie_switch),
                host_bridge: raw.host_bridge.or(self.gpu.host_bridge),
            });
        }
        check_unique(gpus.iter().map(|g| g.uuid.as_str()), "uuid")?;
        check_unique(gpus.iter().map(|g| g.bus_id.as_str()), "bus_id")?;
        let mut minors: Vec<String> = gpus.iter().map(|g| g.minor_number.to_string()).collect();
        minors.sort();
        check_unique(minors.iter().map(String::as_str), "minor_number")?;

        let n = gpus.len() as u32;
        if self.nvlink.nvswitch_links > MAX_NVLINKS {
            return Err(format!("nvlink.nvswitch_links is at most {MAX_NVLINKS}"));
        }
        if self.nvlink.nvswitch_links > 0 && !self.nvlink.pairs.is_empty() {
            return Err("nvlink: give either nvswitch_links or pairs, not both".into());
        }
        let mut per_gpu: BTreeMap<u32, u32> = BTreeMap::new();
        for &[a, b, links] in &self.nvlink.pairs {
            if a >= n || b >= n || a == b || links == 0 {
                return Err(format!(
                    "nvlink.pairs entry [{a}, {b}, {links}] must join two different GPUs below {n} with at least one link"
                ));
            }
            *per_gpu.entry(a).or_default() += links;
            *per_gpu.entry(b).or_default() += links;
        }
        if let Some((gpu, links)) = per_gpu.into_iter().find(|&(_, l)| l > MAX_NVLINKS) {
            return Err(format!(
                "GPU {gpu} has {links} NVLink links; NVML reports at most {MAX_NVLINKS}"
            ));
        }
        Ok(Profile {
            name: self.name,
            description: self.description,
            driver_version: self.driver_version,
            cuda_version,
            gpus,
            nvswitch_links: self.nvlink.nvswitch_links,
            pairs: self.nvlink.pairs.iter().map(|&[a, b, l]| (a, b, l)).collect(),
        })
    }
}

fn check_unique<'a>(values: impl Iterator<Item = &'a str>, what: &str) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for v in values {
        if !seen.insert(v) {
            return Err(format!("two GPUs share the {what} {v:?}"));
        }
    }
    Ok(())
}

/// NVML's form of a CUDA version, 1000 * major + 10 * minor; None where it does not fit (a minor
/// of 100 would read back as the next major).
fn nvml_cuda_version(major: u32, minor: u32) -> Option<i32> {
    if minor >= 100 {
        return None;
    }
    let encoded = major.checked_mul(1000)?.checked_add(minor * 10)?;
    i32::try_from(encoded).ok()
}

fn parse_major_minor(text: &str) -> Option<(u32, u32)> {
    let (major, minor) = text.trim().split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// A stable, unique-looking UUID for a simulated GPU (FNV-1a over the profile name and index).
fn derived_uuid(profile: &str, index: u32) -> String {
    fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    }
    let hi = fnv1a(
        fnv1a(0xcbf2_9ce4_8422_2325, profile.as_bytes()),
        &index.to_le_bytes(),
    );
    let lo = fnv1a(hi, b"gpumem");
    let hex = format!("{hi:016x}{lo:016x}");
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_loads() {
        for name in builtin_names() {
            let profile = Profile::load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(profile.name, name);
            assert!(!profile.gpus.is_empty());
        }
    }

    #[test]
    fn dgx_a100_is_nvswitch_all_to_all_on_two_numa_nodes() {
        let p = Profile::load("dgx-a100").unwrap();
        assert_eq!(p.gpus.len(), 8);
        assert_eq!(p.cuda_version, 12040);
        assert_eq!(p.topology_level(0, 1), TopologyLevel::Single);
        assert_eq!(p.topology_level(0, 2), TopologyLevel::Node);
        assert_eq!(p.topology_level(0, 7), TopologyLevel::System);
        let links = p.nvlinks(3);
        assert_eq!(links.len(), 12);
        assert!(
            links
                .iter()
                .all(|l| l.remote_is_switch && p.gpu_by_bus_id(&l.remote_bus_id).is_none())
        );
    }

    #[test]
    fn mixed_pairs_link_only_the_v100s() {
        let p = Profile::load("mixed").unwrap();
        let links = p.nvlinks(0);
        assert_eq!(links.len(), 6);
        assert!(links.iter().all(|l| l.remote_bus_id == p.gpus[1].bus_id));
        assert!(p.nvlinks(2).is_empty());
        assert_eq!(p.gpus[2].product, "Tesla T4");
    }

    #[test]
    fn derived_uuids_are_distinct_and_stable() {
        let p = Profile::load("t4x4").unwrap();
        let mut uuids: Vec<_> = p.gpus.iter().map(|g| g.uuid.clone()).collect();
        assert_eq!(uuids[0], Profile::load("t4x4").unwrap().gpus[0].uuid);
        assert!(uuids[0].starts_with("GPU-") && uuids[0].len() == 40);
        uuids.dedup();
        assert_eq!(uuids.len(), 4);
    }

    #[test]
    fn bus_ids_are_normalized() {
        assert_eq!(
            normalize_bus_id("0000:3b:00.0").as_deref(),
            Some("00000000:3B:00.0")
        );
        assert_eq!(normalize_bus_id("3b:00.0").as_deref(), Some("00000000:3B:00.0"));
        assert_eq!(normalize_bus_id("zz:00.0"), None);
        assert_eq!(normalize_bus_id("00:20.0"), None);
    }

    #[test]
    fn bad_profiles_say_what_is_wrong() {
        let unknown = Profile::load("dgx-z").unwrap_err().to_string();
        assert!(unknown.contains("dgx-a100"), "{unknown}");
        let text = "name='x'\ndriver_version='1'\ncuda_version='12.0'\n[[gpus]]\nproduct='A'\ncompute_capability='8.0'\n";
        let err = Profile::parse(text, "inline").unwrap_err().to_string();
        assert!(err.contains("memory_mib"), "{err}");
        let bad_pair = "name='x'\ndriver_version='1'\ncuda_version='12.0'\n[gpu]\nproduct='A'\nmemory_mib=1\ncompute_capability='8.0'\n[nvlink]\npairs=[[0,0,2]]\n[[gpus]]\n";
        let err = Profile::parse(bad_pair, "inline").unwrap_err().to_string();
        assert!(err.contains("two different GPUs"), "{err}");
        let typo = "name='x'\ndriver_version='1'\ncuda_version='12.0'\nnvlnk=1\n[[gpus]]\n";
        assert!(matches!(
            Profile::parse(typo, "inline"),
            Err(ProfileError::Parse { .. })
        ));
    }

    #[test]
    fn a_cuda_version_nvml_cannot_encode_is_an_error() {
        let with = |cuda: &str| {
            let text = format!(
                "name='x'\ndriver_version='1'\ncuda_version='{cuda}'\n[[gpus]]\nproduct='A'\n\
                 memory_mib=1\ncompute_capability='8.0'\n"
            );
            Profile::parse(&text, "inline").map(|p| p.cuda_version)
        };
        assert_eq!(with("12.4").unwrap(), 12040);
        assert_eq!(with("2147483.64").unwrap(), i32::MAX - 7);
        // Overflows u32 arithmetic, then i32, then the minor's two digits.
        for cuda in ["4294968.0", "2147484.0", "2147483.65", "12.100"] {
            let err = with(cuda).unwrap_err().to_string();
            assert!(
                err.contains("out of range") && err.contains(cuda),
                "{cuda}: {err}"
            );
        }
    }
}
