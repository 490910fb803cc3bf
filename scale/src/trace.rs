//! The pods' sizes: the openb trace's GPU pods, mapped to what a gpumem user would ask for.
//!
//! openb's GPUs are 16 GB-class (its nodes hold V100-16GB, T4, P100, ...): a share of `gpu_milli`
//! thousandths of a GPU becomes `ceil(gpu_milli * 16384 / 1000)` MiB of `nvidia.com/gpu-mem`
//! (memory unit 1 MiB), a whole GPU (`gpu_milli` 1000) becomes `nvidia.com/gpu: num_gpu`. CPU-only
//! pods (`num_gpu` 0) are left out: they never reach the extender and are not what is measured.

use std::path::Path;

use anyhow::{Context as _, bail};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_pcg::Pcg64Mcg;
use serde::Serialize;

/// MiB of one openb GPU (16 GB-class).
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
            Size::Share { mib } => (gpumem::plugin::devices::MEM_RESOURCE, mib),
            Size::Whole { count } => (gpumem::plugin::devices::GPU_RESOURCE, u64::from(count)),
        }
    }

    /// As written in pods.csv: `share:4916` or `whole:2`.
    pub fn label(self) -> String {
        match self {
            Size::Share { mib } => format!("share:{mib}"),
            Size::Whole { count } => format!("whole:{count}"),
        }
    }

    #[cfg(test)]
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

/// The trace's GPU pods, and how many CPU-only ones were left out.
#[derive(Debug)]
pub struct TracePods {
    pub sizes: Vec<Size>,
    pub cpu_only: usize,
}

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

/// An endless sequence of the trace's sizes in a seeded random order: each pass over the trace is a
/// new shuffle of it.
pub struct Sampler {
    sizes: Vec<Size>,
    next: usize,
    rng: Pcg64Mcg,
}

impl Sampler {
    pub fn new(sizes: Vec<Size>, seed: u64) -> Self {
        let mut rng = Pcg64Mcg::seed_from_u64(seed);
        let mut sizes = sizes;
        sizes.shuffle(&mut rng);
        Self { sizes, next: 0, rng }
    }

    pub fn next_size(&mut self) -> Size {
        if self.next == self.sizes.len() {
            self.sizes.shuffle(&mut self.rng);
            self.next = 0;
        }
        self.next += 1;
        self.sizes[self.next - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn sampler_is_seeded_and_covers_each_pass() {
        let sizes: Vec<Size> = (1..=10).map(|mib| Size::Share { mib }).collect();
        let take = |seed| {
            let mut s = Sampler::new(sizes.clone(), seed);
            (0..20).map(|_| s.next_size()).collect::<Vec<_>>()
        };
        let a = take(7);
        assert_eq!(a, take(7));
        assert_ne!(a, take(8));
        let mut first: Vec<Size> = a[..10].to_vec();
        first.sort_by_key(|s| s.label());
        let mut all = sizes.clone();
        all.sort_by_key(|s| s.label());
        assert_eq!(first, all);
    }
}
