//! `gpumem inspect`: what the agent sees on this node and what it would publish.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use serde::Serialize;

use crate::gpu::{GpuInfo, GpuInventory, NvLinkPeer, NvmlSource};
use crate::node::{self, TopologyAnnotation, UsageAnnotation};
use crate::plugin::devices::{self, GPU_RESOURCE, MEM_RESOURCE};
use crate::plugin::proto::KUBELET_MAX_RECV_BYTES;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Inspect a simulated node instead of this machine: a built-in profile (dgx-a100, hgx-h100,
    /// t4x4, mixed) or a profile file (.toml).
    #[arg(long, value_name = "NAME|FILE", conflicts_with = "nvml_lib")]
    pub profile: Option<String>,
    /// Load NVML from this file instead of libnvidia-ml.so.1 on the loader's path.
    #[arg(long, value_name = "PATH")]
    pub nvml_lib: Option<PathBuf>,
    /// Memory unit of nvidia.com/gpu-mem, in MiB.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub mem_unit_mib: u64,
    #[arg(long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

/// Everything `inspect` reports, in the JSON shape it prints.
#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub source: String,
    pub driver_version: String,
    pub cuda_version: String,
    pub gpus: Vec<GpuReport>,
    pub topology: TopologyMatrix,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub resources: Vec<ResourceReport>,
    /// What the agent publishes on the DRA path (`mode: dra`), for a node called [`NODE_PLACEHOLDER`].
    pub resource_slice: k8s_openapi::api::resource::v1::ResourceSliceSpec,
}

/// The node name in [`Report::resource_slice`]: the agent uses its own.
pub const NODE_PLACEHOLDER: &str = "NODE";

#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct GpuReport {
    #[serde(flatten)]
    pub gpu: GpuInfo,
    pub pcie_switch: Option<u32>,
    pub nvlink_peers: Vec<NvLinkPeer>,
}

/// `nvidia-smi topo -m`: for each pair, `NV#` (NVLink links) or the PCIe level.
#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct TopologyMatrix {
    pub matrix: Vec<Vec<String>>,
    pub numa_affinity: Vec<Option<u32>>,
}

#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct ResourceReport {
    pub name: &'static str,
    pub devices: u64,
    #[serde(rename = "memUnitMiB", skip_serializing_if = "Option::is_none")]
    pub mem_unit_mib: Option<u64>,
    /// Encoded size of one ListAndWatch response (worst case: every device Unhealthy).
    pub list_and_watch_bytes: usize,
    pub kubelet_limit_bytes: usize,
    pub fits: bool,
    #[serde(rename = "smallestFittingUnitMiB", skip_serializing_if = "Option::is_none")]
    pub smallest_fitting_unit_mib: Option<u64>,
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    let (inventory, source) = match &args.profile {
        Some(name) => {
            let profile = gpumem_profile::Profile::load(name)?;
            let inventory = GpuInventory::discover(&profile)?;
            (inventory, format!("simulated node, profile {}", profile.name))
        }
        None => {
            let nvml = NvmlSource::open(args.nvml_lib.as_deref())?;
            let inventory = GpuInventory::discover(&nvml).context("reading GPUs through NVML")?;
            (inventory, "NVML".to_string())
        }
    };
    let report = Report::new(&inventory, source, args.mem_unit_mib);
    let text = match args.output {
        Output::Json => serde_json::to_string_pretty(&report)? + "\n",
        Output::Table => report.render_table(),
    };
    print!("{text}");
    Ok(())
}

impl Report {
    pub fn new(inventory: &GpuInventory, source: String, mem_unit_mib: u64) -> Self {
        let n = inventory.gpus.len();
        let gpus = (0..n)
            .map(|a| GpuReport {
                gpu: inventory.gpus[a].clone(),
                pcie_switch: inventory.pcie_switch(a),
                nvlink_peers: inventory.nvlink_peers(a),
            })
            .collect();
        let matrix = (0..n)
            .map(|a| {
                (0..n)
                    .map(|b| match inventory.nvlink_links(a, b) {
                        0 => inventory.topology(a, b).smi_name().to_string(),
                        links => format!("NV{links}"),
                    })
                    .collect()
            })
            .collect();
        let topology = TopologyMatrix {
            matrix,
            numa_affinity: inventory.gpus.iter().map(|g| g.numa_node).collect(),
        };
        let topology_annotation = TopologyAnnotation::new(inventory, mem_unit_mib, |_| true);
        let usage = UsageAnnotation::idle(inventory);

        let gpu_bytes = devices::list_bytes(devices::gpu_devices(inventory, |_| false));
        let mem_bytes = devices::mem_list_bytes(inventory, mem_unit_mib);
        let mem_devices: u64 = inventory
            .gpus
            .iter()
            .map(|g| devices::units_per_gpu(g.memory_mib, mem_unit_mib))
            .sum();
        let resources = vec![
            ResourceReport {
                name: GPU_RESOURCE,
                devices: n as u64,
                mem_unit_mib: None,
                list_and_watch_bytes: gpu_bytes,
                kubelet_limit_bytes: KUBELET_MAX_RECV_BYTES,
                fits: gpu_bytes <= KUBELET_MAX_RECV_BYTES,
                smallest_fitting_unit_mib: None,
            },
            ResourceReport {
                name: MEM_RESOURCE,
                devices: mem_devices,
                mem_unit_mib: Some(mem_unit_mib),
                list_and_watch_bytes: mem_bytes,
                kubelet_limit_bytes: KUBELET_MAX_RECV_BYTES,
                fits: mem_bytes <= KUBELET_MAX_RECV_BYTES,
                smallest_fitting_unit_mib: devices::smallest_fitting_unit(inventory),
            },
        ];
        Self {
            source,
            driver_version: inventory.driver_version.clone(),
            cuda_version: format!("{}.{}", inventory.cuda_version.0, inventory.cuda_version.1),
            gpus,
            topology,
            labels: node::labels(inventory, mem_unit_mib),
            annotations: node::annotations(&topology_annotation, &usage),
            resources,
            resource_slice: node::slice::resource_slice_spec(
                inventory,
                &node::slice::SliceInputs {
                    driver: crate::plugin::proto::DRA_DRIVER_NAME,
                    node: NODE_PLACEHOLDER,
                    unit_mib: mem_unit_mib,
                    healthy: &vec![true; n],
                    pcie_roots: &crate::gpu::pcie_roots(inventory, None),
                    generation: 1,
                },
            ),
        }
    }

    /// The human-readable form.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} GPU(s) via {}; driver {}, CUDA {}\n",
            self.gpus.len(),
            self.source,
            self.driver_version,
            self.cuda_version
        );

        let mut rows = vec![
            [
                "GPU", "UUID", "PRODUCT", "MEMORY", "BUS ID", "NUMA", "SWITCH", "CC", "MINOR",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for g in &self.gpus {
            rows.push(vec![
                g.gpu.index.to_string(),
                g.gpu.uuid.clone(),
                g.gpu.product.clone(),
                format!("{} MiB", g.gpu.memory_mib),
                g.gpu.pci_bus_id.clone(),
                or_na(g.gpu.numa_node),
                or_na(g.pcie_switch),
                format!("{}.{}", g.gpu.compute_capability.0, g.gpu.compute_capability.1),
                g.gpu.minor_number.to_string(),
            ]);
        }
        out += &columns(&rows);

        out += "\nTopology (as nvidia-smi topo -m)\n";
        let mut header = vec![String::new()];
        header.extend((0..self.gpus.len()).map(|a| format!("GPU{a}")));
        header.push("NUMA Affinity".into());
        let mut rows = vec![header];
        for (a, row) in self.topology.matrix.iter().enumerate() {
            let mut cells = vec![format!("GPU{a}")];
            cells.extend(row.iter().cloned());
            cells.push(or_na(self.topology.numa_affinity[a]));
            rows.push(cells);
        }
        out += &columns(&rows);
        out += "Legend: X = self, SYS = across NUMA nodes (CPU interconnect), NODE = within a NUMA node \
                across host bridges,\n        PHB = one host bridge, PXB = several PCIe switches, \
                PIX = one PCIe switch, NV# = # NVLink links\n";

        out += "\nResources the agent advertises\n";
        for r in &self.resources {
            let what = match r.mem_unit_mib {
                Some(unit) => format!("{} devices of {unit} MiB", r.devices),
                None => format!("{} devices", r.devices),
            };
            let verdict = if r.fits {
                format!("fits the kubelet's {} B limit", r.kubelet_limit_bytes)
            } else {
                format!("EXCEEDS the kubelet's {} B limit", r.kubelet_limit_bytes)
            };
            let _ = write!(
                out,
                "  {:<20} {what}; one ListAndWatch = {} B, {verdict}",
                r.name, r.list_and_watch_bytes
            );
            match (r.fits, r.smallest_fitting_unit_mib) {
                (false, Some(unit)) => {
                    let _ = write!(
                        out,
                        "; smallest unit that fits: {unit} MiB (use --mem-unit-mib {unit})"
                    );
                }
                (false, None) => out += "; no unit fits",
                (true, Some(unit)) if r.mem_unit_mib != Some(unit) => {
                    let _ = write!(out, " (smallest unit that fits: {unit} MiB)");
                }
                _ => {}
            }
            out += "\n";
        }

        let _ = writeln!(
            out,
            "\nDRA path (mode dra): ResourceSlice {}, one shareable device per GPU",
            node::slice::slice_name(NODE_PLACEHOLDER, &self.resource_slice.driver)
        );
        for device in self.resource_slice.devices.iter().flatten() {
            let memory = device
                .capacity
                .as_ref()
                .and_then(|c| c.get(node::slice::MEMORY_CAPACITY));
            let step = memory
                .and_then(|m| m.request_policy.as_ref())
                .and_then(|p| p.valid_range.as_ref())
                .and_then(|r| r.step.as_ref());
            let _ = writeln!(
                out,
                "  {}: memory {} in steps of {}, {} attributes",
                device.name,
                memory.map_or("?", |m| m.value.0.as_str()),
                step.map_or("?", |q| q.0.as_str()),
                device.attributes.as_ref().map_or(0, BTreeMap::len)
            );
        }

        out += "\nNode labels\n";
        for (k, v) in &self.labels {
            let _ = writeln!(out, "  {k}={v}");
        }
        out += "\nNode annotations\n";
        for (k, v) in &self.annotations {
            let _ = writeln!(out, "  {k}: {v}");
        }
        out
    }
}

fn or_na(value: Option<u32>) -> String {
    value.map_or_else(|| "N/A".to_string(), |v| v.to_string())
}

/// Left-aligned columns, two spaces apart.
fn columns(rows: &[Vec<String>]) -> String {
    let width = |c: usize| {
        rows.iter()
            .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..rows.first().map_or(0, Vec::len)).map(width).collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out += line.join("  ").trim_end();
        out += "\n";
    }
    out
}
