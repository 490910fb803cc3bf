//! Loading cluster traces.
//!
//! Two CSV formats are read, told apart by their header:
//!
//! **openb** (the Alibaba GPU cluster trace of the FGD paper), GPUs in milli (1000 per GPU):
//! - nodes: `sn,cpu_milli,memory_mib,gpu,model`
//! - pods: `name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]`; `gpu_milli` is per GPU:
//!   `num_gpu = 1, gpu_milli < 1000` shares one GPU, `gpu_milli = 1000` asks for `num_gpu` whole GPUs;
//!   `gpu_spec` is an optional `|`-separated list of allowed models. Other columns are ignored.
//!
//! **gpumem** (for other clusters, GPUs in any unit, e.g. MiB, and of differing capacity):
//! - nodes: `name,cpu_milli,memory_mib,gpu,model,gpu_capacity` (`gpu` GPUs of `gpu_capacity` units each)
//! - pods: `name,cpu_milli,memory_mib,num_gpu,gpu_mem[,gpu_spec]`: `gpu_mem > 0` asks for that many units
//!   on ONE shared GPU, `num_gpu > 0` for whole GPUs; a pod asking for both is refused.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};

use crate::alloc::{Cluster, Gpu, GpuDemand, ModelTable, Node, Request};

/// Units per GPU in the openb format.
pub const MILLI: u32 = 1000;

/// A loaded trace: the cluster and the pods, in file order.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Short name (`default` for `openb_pod_list_default.csv`).
    pub name: String,
    pub cluster: Cluster,
    pub pods: Vec<Request>,
}

impl Trace {
    pub fn load(nodes: &Path, pods: &Path) -> Result<Trace> {
        let cluster = load_nodes(nodes)?;
        let pods_list = load_pods(pods, &cluster.models)?;
        let stem = pods.file_stem().and_then(|s| s.to_str()).unwrap_or("trace");
        let name = stem.strip_prefix("openb_pod_list_").unwrap_or(stem).to_string();
        tracing::info!(
            trace = %name,
            nodes = cluster.nodes.len(),
            gpus = cluster.gpu_count(),
            pods = pods_list.len(),
            "trace loaded"
        );
        Ok(Trace {
            name,
            cluster,
            pods: pods_list,
        })
    }

    /// Units a request counts for in "arrived workload" (a whole GPU counts as the mean GPU capacity).
    pub fn units(&self, req: &Request) -> u64 {
        req.gpu.units(self.cluster.mean_gpu_capacity())
    }
}

struct Columns {
    headers: csv::StringRecord,
}

impl Columns {
    fn find(&self, names: &[&str]) -> Option<usize> {
        self.headers.iter().position(|h| names.contains(&h.trim()))
    }

    fn need(&self, names: &[&str], file: &Path) -> Result<usize> {
        self.find(names).ok_or_else(|| {
            anyhow!(
                "{}: no column {} in the header",
                file.display(),
                names.join(" or ")
            )
        })
    }
}

fn reader(path: &Path) -> Result<(csv::Reader<std::fs::File>, Columns)> {
    let mut rdr = csv::ReaderBuilder::new()
        .flexible(true)
        .from_path(path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let headers = rdr
        .headers()
        .with_context(|| format!("{}: cannot read the header", path.display()))?
        .clone();
    Ok((rdr, Columns { headers }))
}

fn field<'r>(rec: &'r csv::StringRecord, i: usize, what: &str, file: &Path, line: u64) -> Result<&'r str> {
    rec.get(i)
        .map(str::trim)
        .ok_or_else(|| anyhow!("{}:{line}: missing field {what}", file.display()))
}

fn number<T: std::str::FromStr>(
    rec: &csv::StringRecord,
    i: usize,
    what: &str,
    file: &Path,
    line: u64,
) -> Result<T> {
    let raw = field(rec, i, what, file, line)?;
    raw.parse().map_err(|_| {
        anyhow!(
            "{}:{line}: {what} = {raw:?} is not a non-negative integer",
            file.display()
        )
    })
}

/// Reads a node list (openb or gpumem format).
pub fn load_nodes(path: &Path) -> Result<Cluster> {
    let (mut rdr, cols) = reader(path)?;
    let name_c = cols.need(&["sn", "name"], path)?;
    let cpu_c = cols.need(&["cpu_milli"], path)?;
    let mem_c = cols.need(&["memory_mib"], path)?;
    let gpu_c = cols.need(&["gpu", "num_gpu"], path)?;
    let model_c = cols.need(&["model"], path)?;
    let cap_c = cols.find(&["gpu_capacity"]);
    let mut models = ModelTable::default();
    let mut nodes = Vec::new();
    for rec in rdr.records() {
        let rec = rec.with_context(|| format!("{}: malformed CSV", path.display()))?;
        let line = rec.position().map_or(0, |p| p.line());
        let name = field(&rec, name_c, "name", path, line)?;
        let cpu: u64 = number(&rec, cpu_c, "cpu_milli", path, line)?;
        let mem: u64 = number(&rec, mem_c, "memory_mib", path, line)?;
        let count: usize = number(&rec, gpu_c, "gpu", path, line)?;
        let model = field(&rec, model_c, "model", path, line)?;
        let cap: u32 = match cap_c {
            Some(c) => number(&rec, c, "gpu_capacity", path, line)?,
            None => MILLI,
        };
        if count > crate::alloc::MAX_GPUS_PER_NODE {
            bail!(
                "{}:{line}: {count} GPUs on one node (at most {})",
                path.display(),
                crate::alloc::MAX_GPUS_PER_NODE
            );
        }
        if count > 0 && cap == 0 {
            bail!("{}:{line}: gpu_capacity must be positive", path.display());
        }
        let id = models
            .intern(model)
            .map_err(|e| anyhow!("{}:{line}: {e}", path.display()))?;
        nodes.push(Node::new(name, id, cpu, mem, vec![Gpu::new(cap); count]));
    }
    if nodes.is_empty() {
        bail!("{}: no nodes", path.display());
    }
    Ok(Cluster::new(models, nodes))
}

/// Reads a pod list (openb or gpumem format); `models` resolves `gpu_spec`.
pub fn load_pods(path: &Path, models: &ModelTable) -> Result<Vec<Request>> {
    let (mut rdr, cols) = reader(path)?;
    let cpu_c = cols.need(&["cpu_milli"], path)?;
    let mem_c = cols.need(&["memory_mib"], path)?;
    let num_c = cols.need(&["num_gpu"], path)?;
    let milli_c = cols.find(&["gpu_milli"]);
    let gmem_c = cols.find(&["gpu_mem"]);
    let spec_c = cols.find(&["gpu_spec"]);
    if milli_c.is_none() && gmem_c.is_none() {
        bail!(
            "{}: no column gpu_milli (openb) or gpu_mem (gpumem) in the header",
            path.display()
        );
    }
    let mut pods = Vec::new();
    for rec in rdr.records() {
        let rec = rec.with_context(|| format!("{}: malformed CSV", path.display()))?;
        let line = rec.position().map_or(0, |p| p.line());
        let cpu_milli: u64 = number(&rec, cpu_c, "cpu_milli", path, line)?;
        let memory_mib: u64 = number(&rec, mem_c, "memory_mib", path, line)?;
        let num: u32 = number(&rec, num_c, "num_gpu", path, line)?;
        let gpu = if let Some(c) = milli_c {
            let milli: u32 = number(&rec, c, "gpu_milli", path, line)?;
            match (num, milli) {
                (0, 0) => GpuDemand::None,
                (0, _) => bail!("{}:{line}: gpu_milli = {milli} with num_gpu = 0", path.display()),
                (_, 0) => bail!("{}:{line}: num_gpu = {num} with gpu_milli = 0", path.display()),
                (1, m) if m < MILLI => GpuDemand::Shared { amount: m },
                (n, MILLI) => GpuDemand::Whole { count: n },
                (n, m) => bail!(
                    "{}:{line}: num_gpu = {n} with gpu_milli = {m}: a pod shares one GPU or takes whole GPUs",
                    path.display()
                ),
            }
        } else {
            let c = gmem_c.unwrap_or_default();
            let amount: u32 = number(&rec, c, "gpu_mem", path, line)?;
            match (num, amount) {
                (0, 0) => GpuDemand::None,
                (0, a) => GpuDemand::Shared { amount: a },
                (n, 0) => GpuDemand::Whole { count: n },
                (n, a) => bail!(
                    "{}:{line}: asks for num_gpu = {n} whole GPUs and gpu_mem = {a} at once; \
                     a pod asks for one or the other",
                    path.display()
                ),
            }
        };
        let mut req = Request {
            cpu_milli,
            memory_mib,
            gpu,
            models: None,
            pools: None,
        };
        if let Some(c) = spec_c {
            let spec = rec.get(c).map(str::trim).unwrap_or("");
            let names: Vec<&str> = spec.split('|').map(str::trim).filter(|s| !s.is_empty()).collect();
            if !names.is_empty() {
                req.models = Some(models.set_of(names));
            }
        }
        pods.push(req);
    }
    if pods.is_empty() {
        bail!("{}: no pods", path.display());
    }
    Ok(pods)
}
