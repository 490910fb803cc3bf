//! The realistic mix: what a real GPU fleet adds to the openb trace's sizes (docs/scale.md, "What is
//! measured"): a fleet of node profiles, zones, the GPU nodes' taint, a tenth of the nodes reserved for
//! training, and pods that select a zone or a GPU model. One generator for `gpumem-scale`, which makes
//! these nodes and pods on a real API server, and `gpumem simulate --mix realistic`, which replays them
//! through the placement policies ([`trace`]): a policy is measured on the mix before it reaches a
//! cluster.
//!
//! The pods' sizes: openb's GPUs are 16 GB-class (V100-16GB, T4, P100, ...), so a share of `gpu_milli`
//! thousandths of a GPU becomes `ceil(gpu_milli * 16384 / 1000)` MiB of one GPU and a whole GPU
//! (`gpu_milli` 1000) `num_gpu` whole GPUs. CPU-only pods are left out: they never reach a GPU.

use std::path::Path;

use anyhow::{Context as _, bail};
use clap::ValueEnum;
use rand::seq::SliceRandom;
use rand::{RngExt as _, SeedableRng};
use rand_pcg::Pcg64Mcg;
use serde::Serialize;

use crate::alloc::{Cluster, Gpu, GpuDemand, ModelSet, ModelTable, Node, PoolSet, Request};

use super::trace::Trace;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mix {
    /// The trace's sizes; nodes with only the scale label and taint.
    #[default]
    Trace,
    /// Zones, the GPU taint, reserved nodes, pods selecting a zone or a GPU model.
    Realistic,
}

impl Mix {
    pub fn as_str(self) -> &'static str {
        match self {
            Mix::Trace => "trace",
            Mix::Realistic => "realistic",
        }
    }
}

/// The well-known zone label, and the zones the nodes are spread over (round robin by node number).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
pub const ZONES: [&str; 3] = ["zone-a", "zone-b", "zone-c"];
/// The taint users put on GPU nodes to keep other pods off them; every realistic-mix pod tolerates it.
pub const GPU_TAINT: (&str, &str) = ("nvidia.com/gpu", "present");
/// Nodes kept for training: only the multi-GPU pods tolerate it.
pub const RESERVED_TAINT: (&str, &str) = ("gpumem.io/reserved", "training");
/// Share of the nodes reserved, percent (rounded to whole nodes).
pub const RESERVED_PERCENT: usize = 10;
/// Of the pods, one in this many selects a zone.
pub const ZONE_ONE_IN: u32 = 3;
/// Of the share pods, one in this many selects a GPU model.
pub const MODEL_ONE_IN: u32 = 4;

/// The agent's product name of the T4, and its memory (the `t4x4` and `mixed` profiles).
pub const T4_PRODUCT: &str = "Tesla T4";
pub const T4_MIB: u64 = 15_360;
/// The "large GPU" choice: at least this much memory (40Gi).
pub const LARGE_MIB: u64 = 40 * 1024;
/// The node label with the product (`node::labels`: `mixed` on a node of several models).
pub const PRODUCT_LABEL: &str = "nvidia.com/gpu.product";
/// The node label with the memory of the node's smallest GPU, MiB (`node::labels`).
pub const MEMORY_LABEL: &str = "nvidia.com/gpu.memory";

/// What one scale node carries beyond the scale label and taint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeShape {
    pub zone: Option<&'static str>,
    /// Carries [`GPU_TAINT`].
    pub gpu_taint: bool,
    /// Carries [`RESERVED_TAINT`].
    pub reserved: bool,
}

/// The shapes of `nodes` nodes (index i = `scale-node-{i+1}`): zones round robin, and
/// [`RESERVED_PERCENT`] of the nodes, chosen by `seed`, reserved. All default in the trace mix.
pub fn node_shapes(mix: Mix, nodes: usize, seed: u64) -> Vec<NodeShape> {
    if mix == Mix::Trace {
        return vec![NodeShape::default(); nodes];
    }
    let mut shapes: Vec<NodeShape> = (0..nodes)
        .map(|i| NodeShape {
            zone: Some(ZONES[i % ZONES.len()]),
            gpu_taint: true,
            reserved: false,
        })
        .collect();
    let mut order: Vec<usize> = (0..nodes).collect();
    // Its own stream: the profiles' placement (seeded by `seed` itself) stays as it was.
    order.shuffle(&mut Pcg64Mcg::seed_from_u64(seed ^ 0x7265_7365_7276_6564));
    let reserved = (nodes * RESERVED_PERCENT + 50) / 100;
    for &i in &order[..reserved] {
        shapes[i].reserved = true;
    }
    shapes
}

/// A GPU model a pod selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Model {
    /// A Tesla T4.
    #[serde(rename = "t4")]
    T4,
    /// A GPU of 40Gi or more (A100 80GB, H100 in the default profiles).
    #[serde(rename = "40gi+")]
    Large,
}

impl Model {
    pub const ALL: [Model; 2] = [Model::T4, Model::Large];

    pub fn as_str(self) -> &'static str {
        match self {
            Model::T4 => "t4",
            Model::Large => "40gi+",
        }
    }

    /// Whether the CEL selector picks a GPU of `product` with `memory_mib` (1 MiB units: the
    /// slice's memory capacity is the GPU's memory).
    pub fn admits_gpu(self, product: &str, memory_mib: u64) -> bool {
        match self {
            Model::T4 => product == T4_PRODUCT,
            Model::Large => memory_mib >= LARGE_MIB,
        }
    }
}

/// What one pod asks beyond its size. All empty in the trace mix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// Runs only in this zone (a node selector).
    pub zone: Option<&'static str>,
    /// Runs only on this GPU model (a claim's CEL selector, or node labels on the device-plugin path).
    pub model: Option<Model>,
    /// Tolerates [`GPU_TAINT`].
    pub tolerate_gpu: bool,
    /// Tolerates [`RESERVED_TAINT`].
    pub tolerate_reserved: bool,
}

/// FNV-1a: a hash that stays the same across Rust releases (std's does not promise to).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Shape {
    /// The shape of pod `name` of `size`: drawn from (`seed`, `name`) alone, so a pod gets the same
    /// shape whatever order the concurrent creates go out in. One pod in [`ZONE_ONE_IN`] selects a
    /// zone; one share in [`MODEL_ONE_IN`] a model, half of them the T4 (if it fits one), the others
    /// 40Gi+; every pod tolerates the GPU taint, multi-GPU pods the reserved one too.
    pub fn of(mix: Mix, seed: u64, name: &str, size: Size) -> Shape {
        if mix == Mix::Trace {
            return Shape::default();
        }
        let mut rng = Pcg64Mcg::seed_from_u64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ fnv1a(name));
        let zoned = rng.random_ratio(1, ZONE_ONE_IN);
        let zone = ZONES[rng.random_range(0..ZONES.len())];
        let choosing = rng.random_ratio(1, MODEL_ONE_IN);
        let t4 = rng.random_ratio(1, 2);
        let model = match size {
            Size::Share { mib } if choosing => Some(if t4 && mib <= T4_MIB {
                Model::T4
            } else {
                Model::Large
            }),
            _ => None,
        };
        Shape {
            zone: zoned.then_some(zone),
            model,
            tolerate_gpu: true,
            tolerate_reserved: matches!(size, Size::Whole { count } if count >= 2),
        }
    }
}

pub const OPENB_GPU_MIB: u64 = 16_384;

/// What one pod asks of GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Size {
    /// `mib` MiB of one GPU, shared (`nvidia.com/gpu-mem`).
    Share { mib: u64 },
    /// `count` whole GPUs (`nvidia.com/gpu`).
    Whole { count: u32 },
}

/// The three kinds results are broken down by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Kind {
    #[serde(rename = "share")]
    Share,
    #[serde(rename = "whole-1")]
    Whole1,
    #[serde(rename = "multi-gpu")]
    MultiGpu,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Share, Kind::Whole1, Kind::MultiGpu];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Share => "share",
            Kind::Whole1 => "whole-1",
            Kind::MultiGpu => "multi-gpu",
        }
    }
}

impl Size {
    pub fn kind(self) -> Kind {
        match self {
            Size::Share { .. } => Kind::Share,
            Size::Whole { count: 1 } => Kind::Whole1,
            Size::Whole { .. } => Kind::MultiGpu,
        }
    }

    /// The resource and amount the pod's container asks for.
    pub fn resource(self) -> (&'static str, u64) {
        match self {
            Size::Share { mib } => (crate::plugin::devices::MEM_RESOURCE, mib),
            Size::Whole { count } => (crate::plugin::devices::GPU_RESOURCE, u64::from(count)),
        }
    }

    /// As written in pods.csv: `share:4916` or `whole:2`.
    pub fn label(self) -> String {
        match self {
            Size::Share { mib } => format!("share:{mib}"),
            Size::Whole { count } => format!("whole:{count}"),
        }
    }

    pub fn parse_label(text: &str) -> Option<Size> {
        let (kind, n) = text.split_once(':')?;
        match kind {
            "share" => Some(Size::Share { mib: n.parse().ok()? }),
            "whole" => Some(Size::Whole {
                count: n.parse().ok()?,
            }),
            _ => None,
        }
    }
}

/// One trace row's GPU columns as the size asked; `None` for a CPU-only pod.
pub fn map_row(num_gpu: u32, gpu_milli: u32) -> anyhow::Result<Option<Size>> {
    match (num_gpu, gpu_milli) {
        (0, _) => Ok(None),
        (1, m @ 1..=999) => Ok(Some(Size::Share {
            mib: (u64::from(m) * OPENB_GPU_MIB).div_ceil(1000),
        })),
        (n, 1000) => Ok(Some(Size::Whole { count: n })),
        (n, m) => bail!("num_gpu {n} with gpu_milli {m}: neither a share of one GPU nor whole GPUs"),
    }
}

/// The profile mix: (profile, percent).
pub fn parse_profiles(text: &str) -> anyhow::Result<Vec<(String, f64)>> {
    let mut out = Vec::new();
    for part in text.split(',').filter(|p| !p.trim().is_empty()) {
        let (name, pct) = part
            .split_once('=')
            .with_context(|| format!("profile mix {part:?}: expected NAME=PERCENT"))?;
        let pct: f64 = pct
            .trim()
            .parse()
            .with_context(|| format!("profile mix {part:?}: {pct:?} is not a number"))?;
        if pct < 0.0 {
            bail!("profile mix {part:?}: negative share");
        }
        out.push((name.trim().to_string(), pct));
    }
    if out.iter().map(|p| p.1).sum::<f64>() <= 0.0 {
        bail!("profile mix {text:?}: no node");
    }
    Ok(out)
}

/// How many of `total` nodes each profile gets (largest remainder, so they add up to `total`).
pub fn apportion(mix: &[(String, f64)], total: usize) -> Vec<usize> {
    let sum: f64 = mix.iter().map(|p| p.1).sum();
    let exact: Vec<f64> = mix.iter().map(|p| p.1 / sum * total as f64).collect();
    let mut counts: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
    let mut order: Vec<usize> = (0..mix.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    let mut left = total - counts.iter().sum::<usize>();
    for i in order.into_iter().cycle().take(mix.len() * 2) {
        if left == 0 {
            break;
        }
        counts[i] += 1;
        left -= 1;
    }
    counts
}

/// The trace's GPU pods, and how many CPU-only ones were left out.
#[derive(Debug)]
pub struct TracePods {
    pub sizes: Vec<Size>,
    pub cpu_only: usize,
}

/// The GPU pods' sizes of the openb pod list at `path` ([`map_row`]).
pub fn read(path: &Path) -> anyhow::Result<TracePods> {
    let mut reader =
        csv::Reader::from_path(path).with_context(|| format!("cannot read the trace {}", path.display()))?;
    let headers = reader
        .headers()
        .with_context(|| format!("{}: no header line", path.display()))?
        .clone();
    let column = |name: &str| {
        headers
            .iter()
            .position(|h| h == name)
            .with_context(|| format!("{}: no column {name:?}", path.display()))
    };
    let (num_gpu, gpu_milli) = (column("num_gpu")?, column("gpu_milli")?);
    let mut sizes = Vec::new();
    let mut cpu_only = 0;
    for (line, record) in reader.records().enumerate() {
        let record = record.with_context(|| format!("{}: row {}", path.display(), line + 2))?;
        let field = |i: usize, name: &str| -> anyhow::Result<u32> {
            let text = record.get(i).unwrap_or("");
            text.trim().parse().with_context(|| {
                format!(
                    "{}: row {}: {name} {text:?} is not a number",
                    path.display(),
                    line + 2
                )
            })
        };
        match map_row(field(num_gpu, "num_gpu")?, field(gpu_milli, "gpu_milli")?)
            .with_context(|| format!("{}: row {}", path.display(), line + 2))?
        {
            Some(size) => sizes.push(size),
            None => cpu_only += 1,
        }
    }
    if sizes.is_empty() {
        bail!("{}: no GPU pod in the trace", path.display());
    }
    Ok(TracePods { sizes, cpu_only })
}

/// The default fleet of `gpumem-scale` and `simulate --mix realistic`: profile=percent.
pub const DEFAULT_PROFILES: &str = "t4x4=40,mixed=20,dgx-a100=20,hgx-h100=20";
/// A scale node's CPU and memory, as the API-only nodes of `gpumem-scale` report them.
pub const NODE_CPU_MILLI: u64 = 96_000;
pub const NODE_MEMORY_MIB: u64 = 768 * 1024;
/// A scale pod's CPU and memory requests: small, so that GPUs are what runs out (the trace's would
/// make CPU the limit on these nodes).
pub const POD_CPU_MILLI: u64 = 100;
pub const POD_MEMORY_MIB: u64 = 128;

/// The profile (index into `mix`) of each of `nodes` nodes: the profiles apportioned, then spread
/// over the nodes in an order drawn from `seed`.
pub fn node_profiles(mix: &[(String, f64)], nodes: usize, seed: u64) -> Vec<usize> {
    let mut assignment: Vec<usize> = apportion(mix, nodes)
        .iter()
        .enumerate()
        .flat_map(|(i, &n)| std::iter::repeat_n(i, n))
        .collect();
    assignment.shuffle(&mut Pcg64Mcg::seed_from_u64(seed));
    assignment
}

/// The pool of a node of `shape` ([`PoolSet`]): its zone and whether it is reserved. Every node
/// carries the GPU taint and every pod tolerates it, so that taint sets no pool apart.
pub fn pool(shape: &NodeShape) -> u8 {
    let zone = shape
        .zone
        .and_then(|z| ZONES.iter().position(|&x| x == z))
        .unwrap_or(ZONES.len());
    (zone * 2 + usize::from(shape.reserved)) as u8
}

/// The pools a pod of `shape` may run in, as kube-scheduler reads its zone selector and tolerations;
/// `None` when it may run in all.
pub fn pools(shape: &Shape) -> Option<PoolSet> {
    if shape.zone.is_none() && shape.tolerate_reserved {
        return None;
    }
    let mut set = PoolSet::NONE;
    for &zone in &ZONES {
        if shape.zone.is_some_and(|s| s != zone) {
            continue;
        }
        for reserved in [false, true] {
            if !reserved || shape.tolerate_reserved {
                set = set.with(pool(&NodeShape {
                    zone: Some(zone),
                    gpu_taint: true,
                    reserved,
                }));
            }
        }
    }
    Some(set)
}

/// The realistic mix as a trace the simulator replays: `nodes` nodes of the `profiles` fleet (GPU
/// capacity in MiB, each GPU its product's model, the nodes' zones and reservations as pools), and
/// the GPU pods of the openb pod list `pods` with the shapes `gpumem-scale` gives them (pod `i` is
/// named `pod-i`): a model choice becomes the set of the fleet's models its CEL selector admits (the
/// DRA path's reading, GPU by GPU: a T4 pod may use a `mixed` node's T4s), a zone and the reserved
/// taint become pools. `seed` draws the profiles' placement, the reserved nodes and the shapes, as in
/// `gpumem-scale --seed`.
pub fn trace(pods: &Path, profiles: &str, nodes: usize, seed: u64) -> anyhow::Result<Trace> {
    if nodes == 0 {
        bail!("the realistic mix needs at least one node");
    }
    let mix = parse_profiles(profiles)?;
    let mut models = ModelTable::default();
    // Per profile: each GPU's model and memory.
    let mut shapes_of_profile: Vec<Vec<(u8, u32)>> = Vec::new();
    // Per model: its product and memory, for the selectors.
    let mut products: Vec<(String, u64)> = Vec::new();
    for (name, _) in &mix {
        let profile = gpumem_profile::Profile::load(name).with_context(|| format!("profile {name}"))?;
        let mut gpus = Vec::new();
        for g in &profile.gpus {
            let id = models.intern(&g.product)?;
            if usize::from(id) == products.len() {
                products.push((g.product.clone(), g.memory_mib));
            }
            let mib = u32::try_from(g.memory_mib)
                .with_context(|| format!("profile {name}: {} MiB", g.memory_mib))?;
            gpus.push((id, mib));
        }
        if gpus.len() > crate::alloc::MAX_GPUS_PER_NODE {
            bail!("profile {name}: more GPUs than a node may have");
        }
        shapes_of_profile.push(gpus);
    }
    let node_shapes = node_shapes(Mix::Realistic, nodes, seed);
    let cluster_nodes: Vec<Node> = node_profiles(&mix, nodes, seed)
        .into_iter()
        .zip(&node_shapes)
        .enumerate()
        .map(|(i, (p, shape))| {
            let gpus = &shapes_of_profile[p];
            let first = gpus.first().map_or(0, |g| g.0);
            let mut n = Node::new(
                format!("scale-node-{}", i + 1),
                first,
                NODE_CPU_MILLI,
                NODE_MEMORY_MIB,
                gpus.iter().map(|g| Gpu::new(g.1)).collect(),
            );
            if gpus.iter().any(|g| g.0 != first) {
                n.gpu_models = gpus.iter().map(|g| g.0).collect();
            }
            n.pool = pool(shape);
            n
        })
        .collect();
    let selected = |m: Model| {
        products
            .iter()
            .enumerate()
            .filter(|(_, (product, mib))| m.admits_gpu(product, *mib))
            .fold(ModelSet::NONE, |set, (id, _)| set.with(id as u8))
    };
    let requests = read(pods)?
        .sizes
        .into_iter()
        .enumerate()
        .map(|(i, size)| {
            let shape = Shape::of(Mix::Realistic, seed, &format!("pod-{i}"), size);
            let gpu = match size {
                Size::Share { mib } => GpuDemand::Shared {
                    amount: u32::try_from(mib).unwrap_or(u32::MAX),
                },
                Size::Whole { count } => GpuDemand::Whole { count },
            };
            Request {
                cpu_milli: POD_CPU_MILLI,
                memory_mib: POD_MEMORY_MIB,
                gpu,
                models: shape.model.map(selected),
                pools: pools(&shape),
            }
        })
        .collect();
    let stem = pods.file_stem().and_then(|s| s.to_str()).unwrap_or("trace");
    Ok(Trace {
        name: format!(
            "realistic-{}",
            stem.strip_prefix("openb_pod_list_").unwrap_or(stem)
        ),
        cluster: Cluster::new(models, cluster_nodes),
        pods: requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_are_zoned_round_robin_and_a_tenth_reserved_by_the_seed() {
        let shapes = node_shapes(Mix::Realistic, 1000, 1);
        assert_eq!(shapes, node_shapes(Mix::Realistic, 1000, 1));
        assert_ne!(shapes, node_shapes(Mix::Realistic, 1000, 2));
        for (i, zone) in ZONES.iter().enumerate() {
            let n = shapes.iter().filter(|s| s.zone == Some(zone)).count();
            assert_eq!(n, if i == 0 { 334 } else { 333 }, "{zone}");
        }
        assert_eq!(shapes.iter().filter(|s| s.reserved).count(), 100);
        // Reserved nodes are spread, not the first hundred.
        assert!(shapes[..100].iter().filter(|s| s.reserved).count() < 30);
        assert_eq!(
            node_shapes(Mix::Realistic, 7, 1)
                .iter()
                .filter(|s| s.reserved)
                .count(),
            1
        );
        assert_eq!(node_shapes(Mix::Trace, 5, 1), vec![NodeShape::default(); 5]);
    }

    #[test]
    fn pod_shapes_are_seeded_per_name_in_the_stated_proportions() {
        let share = Size::Share { mib: 4096 };
        let names: Vec<String> = (0..6000).map(|i| format!("steady-{i:06}")).collect();
        let shapes: Vec<Shape> = names
            .iter()
            .map(|n| Shape::of(Mix::Realistic, 1, n, share))
            .collect();
        assert_eq!(shapes[17], Shape::of(Mix::Realistic, 1, &names[17], share));
        assert!(
            (0..50).any(|i| shapes[i] != Shape::of(Mix::Realistic, 2, &names[i], share)),
            "another seed, other shapes"
        );
        let zoned = shapes.iter().filter(|s| s.zone.is_some()).count();
        assert!((1800..2200).contains(&zoned), "a third zoned: {zoned}");
        for zone in ZONES {
            let n = shapes.iter().filter(|s| s.zone == Some(zone)).count();
            assert!((500..800).contains(&n), "{zone}: {n}");
        }
        let t4 = shapes.iter().filter(|s| s.model == Some(Model::T4)).count();
        let large = shapes.iter().filter(|s| s.model == Some(Model::Large)).count();
        assert!(
            (1300..1700).contains(&(t4 + large)),
            "a quarter choose: {t4} + {large}"
        );
        assert!(
            (600..900).contains(&t4) && (600..900).contains(&large),
            "{t4} / {large}"
        );
        assert!(shapes.iter().all(|s| s.tolerate_gpu && !s.tolerate_reserved));
        // A share too big for a T4 never chooses one; whole GPUs choose no model.
        for n in &names[..400] {
            let big = Shape::of(Mix::Realistic, 1, n, Size::Share { mib: T4_MIB + 1 });
            assert_ne!(big.model, Some(Model::T4));
            let whole = Shape::of(Mix::Realistic, 1, n, Size::Whole { count: 1 });
            assert_eq!((whole.model, whole.tolerate_reserved), (None, false));
            let multi = Shape::of(Mix::Realistic, 1, n, Size::Whole { count: 2 });
            assert!(multi.tolerate_reserved && multi.tolerate_gpu && multi.model.is_none());
        }
        assert_eq!(Shape::of(Mix::Trace, 1, &names[0], share), Shape::default());
    }

    #[test]
    fn shares_become_mib_of_a_16_gb_gpu_rounded_up() {
        assert_eq!(map_row(1, 500).unwrap(), Some(Size::Share { mib: 8192 }));
        // 460 * 16384 / 1000 = 7536.64
        assert_eq!(map_row(1, 460).unwrap(), Some(Size::Share { mib: 7537 }));
        assert_eq!(map_row(1, 1).unwrap(), Some(Size::Share { mib: 17 }));
        assert_eq!(map_row(1, 999).unwrap(), Some(Size::Share { mib: 16368 }));
    }

    #[test]
    fn whole_gpus_and_cpu_only_pods() {
        assert_eq!(map_row(1, 1000).unwrap(), Some(Size::Whole { count: 1 }));
        assert_eq!(map_row(8, 1000).unwrap(), Some(Size::Whole { count: 8 }));
        assert_eq!(map_row(0, 0).unwrap(), None);
        assert!(map_row(2, 500).is_err());
        assert_eq!(Size::Whole { count: 8 }.kind(), Kind::MultiGpu);
        assert_eq!(Size::Whole { count: 1 }.kind(), Kind::Whole1);
        assert_eq!(Size::Share { mib: 5 }.kind(), Kind::Share);
        assert_eq!(Size::Share { mib: 7537 }.resource(), ("nvidia.com/gpu-mem", 7537));
        assert_eq!(Size::Whole { count: 4 }.resource(), ("nvidia.com/gpu", 4));
    }

    #[test]
    fn labels_round_trip() {
        for s in [Size::Share { mib: 7537 }, Size::Whole { count: 8 }] {
            assert_eq!(Size::parse_label(&s.label()), Some(s));
        }
        assert_eq!(Size::parse_label("half:3"), None);
    }

    #[test]
    fn reads_a_trace_and_skips_cpu_pods() {
        let dir = std::env::temp_dir().join(format!("gpumem-scale-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.csv");
        std::fs::write(
            &path,
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,1,250\nb,1,1,0,0\nc,1,1,2,1000\n",
        )
        .unwrap();
        let pods = read(&path).unwrap();
        assert_eq!(
            pods.sizes,
            vec![Size::Share { mib: 4096 }, Size::Whole { count: 2 }]
        );
        assert_eq!(pods.cpu_only, 1);
        std::fs::write(&path, "name,num_gpu,gpu_milli\na,x,1\n").unwrap();
        let err = read(&path).unwrap_err();
        assert!(
            format!("{err:#}").contains("num_gpu \"x\" is not a number"),
            "{err:#}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn profile_mix_adds_up() {
        let mix = parse_profiles("t4x4=40,mixed=20,dgx-a100=20,hgx-h100=20").unwrap();
        assert_eq!(apportion(&mix, 1000), vec![400, 200, 200, 200]);
        let odd = apportion(&mix, 7);
        assert_eq!(odd.iter().sum::<usize>(), 7);
        assert_eq!(odd[0], 3);
        assert!(parse_profiles("t4x4").is_err());
        assert!(parse_profiles("t4x4=x").is_err());
        assert!(parse_profiles("t4x4=0").is_err());
    }

    /// A pod list in openb's format: shares of 0.5 and 0.9 GPU, one and two whole GPUs, a CPU pod.
    fn pods_csv(dir: &std::path::Path) -> std::path::PathBuf {
        let mut text = String::from("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n");
        for i in 0..400 {
            let (n, m) = [(1, 500), (1, 900), (1, 1000), (2, 1000), (0, 0)][i % 5];
            text += &format!("p{i},1000,1024,{n},{m}\n");
        }
        let path = dir.join("openb_pod_list_small.csv");
        std::fs::write(&path, text).expect("write");
        path
    }

    #[test]
    fn the_simulated_fleet_is_the_scale_runs_fleet_with_pools_and_models() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = trace(&pods_csv(dir.path()), DEFAULT_PROFILES, 30, 7).expect("realistic trace");
        assert_eq!(t.name, "realistic-small");
        assert_eq!(t.cluster.nodes.len(), 30);
        assert_eq!(t.pods.len(), 320, "the CPU pods are left out");
        let profiles = node_profiles(&parse_profiles(DEFAULT_PROFILES).expect("mix"), 30, 7);
        let shapes = node_shapes(Mix::Realistic, 30, 7);
        let models = &t.cluster.models;
        let t4 = models.get(T4_PRODUCT).expect("the T4 is a model");
        for ((n, &p), shape) in t.cluster.nodes.iter().zip(&profiles).zip(&shapes) {
            assert_eq!(n.pool, pool(shape), "{}", n.name);
            assert_eq!(
                (n.cpu_capacity, n.memory_capacity),
                (NODE_CPU_MILLI, NODE_MEMORY_MIB)
            );
            // t4x4, mixed, dgx-a100, hgx-h100: the mixed node names each GPU's model.
            let caps: Vec<u32> = n.gpus.iter().map(|g| g.capacity).collect();
            match p {
                0 => assert!(n.model == t4 && caps == [15_360; 4] && n.gpu_models.is_empty()),
                1 => assert_eq!(n.gpu_models.iter().filter(|&&m| m == t4).count(), 2),
                2 => assert_eq!(caps, [81_920; 8]),
                _ => assert_eq!(caps, [81_559; 8]),
            }
        }
        let large: Vec<u8> = (0..models.len() as u8)
            .filter(|&m| ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"].contains(&models.name(m)))
            .collect();
        let (mut chose_t4, mut chose_large, mut zoned) = (0, 0, 0);
        for r in &t.pods {
            assert_eq!((r.cpu_milli, r.memory_mib), (POD_CPU_MILLI, POD_MEMORY_MIB));
            match r.models {
                Some(m) if m == ModelSet::NONE.with(t4) => chose_t4 += 1,
                Some(m) => {
                    assert_eq!(m, large.iter().fold(ModelSet::NONE, |s, &x| s.with(x)));
                    chose_large += 1;
                }
                None => {}
            }
            let multi = matches!(r.gpu, GpuDemand::Whole { count } if count >= 2);
            match r.pools {
                None => assert!(multi, "only multi-GPU pods may use every pool: {r:?}"),
                Some(p) => {
                    let reserved = (0..3u8).any(|z| p.contains(z * 2 + 1));
                    assert_eq!(reserved, multi, "{r:?}");
                    zoned += usize::from((0..3u8).filter(|&z| p.contains(z * 2)).count() == 1);
                }
            }
        }
        assert!(
            chose_t4 > 0 && chose_large > 0 && zoned > 0,
            "{chose_t4} {chose_large} {zoned}"
        );
        let again = trace(&pods_csv(dir.path()), DEFAULT_PROFILES, 30, 7).expect("again");
        assert_eq!(again.pods, t.pods);
    }

    #[test]
    fn a_t4_pod_gets_a_mixed_nodes_t4_and_a_zoned_pod_its_zone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = trace(&pods_csv(dir.path()), "mixed=100", 6, 1).expect("realistic trace");
        let t4 = t.cluster.models.get(T4_PRODUCT).expect("T4");
        let req = Request::shared(100, 128, 4000).with_models(ModelSet::NONE.with(t4));
        for n in &t.cluster.nodes {
            let allowed: Vec<usize> = n.allowed(&req).iter().collect();
            assert_eq!(allowed, [2, 3], "the mixed profile's T4s are GPUs 2 and 3");
            let choice = n.best_fit_choice(&req).expect("a T4 fits");
            assert!(choice.iter().all(|g| n.gpu_model(g) == t4));
        }
        let zone_b = pools(&Shape {
            zone: Some("zone-b"),
            model: None,
            tolerate_gpu: true,
            tolerate_reserved: false,
        })
        .expect("a zone is a restriction");
        let zoned = Request::shared(100, 128, 1000).with_pools(zone_b);
        for (n, shape) in t.cluster.nodes.iter().zip(node_shapes(Mix::Realistic, 6, 1)) {
            assert_eq!(
                n.fits(&zoned),
                shape.zone == Some("zone-b") && !shape.reserved,
                "{}",
                n.name
            );
        }
    }
}
