//! Placement policy: which node, and which GPU(s) on it, a pod should get.
//!
//! This module is pure: no I/O, no clock, and no randomness except the seeded RNG a caller passes in.
//! The scorer (filter / prioritize / bind), the agent and `gpumem simulate` all drive it through one
//! call, [`Policy::score`]: cluster state and a request in, every feasible node with a score and the
//! GPU(s) the pod would get out. [`select`] picks the winner the way kube-scheduler does (highest score,
//! ties broken uniformly at random).
//!
//! Units: GPU capacity is counted in abstract units per GPU. The Alibaba trace uses milli-GPUs (1000 per
//! GPU); real nodes use MiB, and GPUs in one cluster may differ (a T4 has 15360, an A100 81920). CPU is
//! in milli-cores, memory in MiB.
//!
//! Policies: the FGD paper's baselines ([`baselines`]: Random, DotProduct, GpuClustering, GpuPacking,
//! BestFit), stock kube-scheduler 1.36 on gpumem's DRA path ([`kube_dra`]: KubeDRA, a model for the
//! simulator), FGD itself ([`fgd`]), and gpumem's own policy ([`gpumem`]). The fragmentation measure
//! they share lives in [`frag`].
//!
//! One file, over the usual ~600 lines: the types every policy shares (cluster, node, GPU, request,
//! candidate) and the one selection and placement they all go through.

pub mod baselines;
pub mod fgd;
pub mod frag;
pub mod gpumem;
pub mod kube_dra;
pub mod local;
pub mod mix;

use std::fmt;

use rand::{Rng, RngExt};

pub use frag::{FragModel, TypicalMix};
pub use mix::{MixConfig, MixLearner, OnlineMix};

/// Index of a GPU model in a [`ModelTable`].
pub type ModelId = u8;

/// At most this many distinct GPU models per cluster (they are kept in a 64-bit set).
pub const MAX_MODELS: usize = 64;
/// At most this many GPUs per node (a chosen set is a 64-bit mask).
pub const MAX_GPUS_PER_NODE: usize = 64;

/// The GPU models of a cluster, interned so that a model set is a bit mask.
#[derive(Debug, Clone, Default)]
pub struct ModelTable {
    names: Vec<String>,
}

impl ModelTable {
    /// The id of `name`, adding it if new. Fails when the table is full.
    pub fn intern(&mut self, name: &str) -> Result<ModelId, AllocError> {
        if let Some(id) = self.get(name) {
            return Ok(id);
        }
        if self.names.len() >= MAX_MODELS {
            return Err(AllocError::TooManyModels(MAX_MODELS));
        }
        self.names.push(name.to_string());
        Ok((self.names.len() - 1) as ModelId)
    }

    /// The id of `name`, if known.
    pub fn get(&self, name: &str) -> Option<ModelId> {
        self.names.iter().position(|n| n == name).map(|i| i as ModelId)
    }

    /// The name of model `id`.
    pub fn name(&self, id: ModelId) -> &str {
        self.names.get(id as usize).map_or("?", String::as_str)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The set of models named in `names` (unknown names match no node, as in the paper's simulator).
    pub fn set_of<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> ModelSet {
        let mut set = ModelSet::NONE;
        for n in names {
            if let Some(id) = self.get(n) {
                set = set.with(id);
            }
        }
        set
    }
}

/// A set of GPU models (bit i = model id i).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelSet(pub u64);

impl ModelSet {
    pub const NONE: ModelSet = ModelSet(0);

    pub fn with(self, id: ModelId) -> ModelSet {
        ModelSet(self.0 | (1u64 << id))
    }

    pub fn contains(self, id: ModelId) -> bool {
        self.0 & (1u64 << id) != 0
    }
}

/// A set of node pools (bit i = pool i): where a pod may run as taints, tolerations and node selectors
/// decide it. kube-scheduler applies them before the scorer sees a node, so the scorer's requests name
/// no pool; the simulator's realistic mix gives its nodes pools and its pods the pools they may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolSet(pub u64);

impl PoolSet {
    pub const NONE: PoolSet = PoolSet(0);

    pub fn with(self, pool: u8) -> PoolSet {
        PoolSet(self.0 | (1u64 << pool))
    }

    pub fn contains(self, pool: u8) -> bool {
        self.0 & (1u64 << pool) != 0
    }
}

/// A set of GPUs on one node (bit i = GPU index i).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct GpuMask(pub u64);

impl GpuMask {
    pub const EMPTY: GpuMask = GpuMask(0);

    pub fn single(index: usize) -> GpuMask {
        GpuMask(1u64 << index)
    }

    pub fn with(self, index: usize) -> GpuMask {
        GpuMask(self.0 | (1u64 << index))
    }

    pub fn contains(self, index: usize) -> bool {
        index < 64 && self.0 & (1u64 << index) != 0
    }

    pub fn count(self) -> u32 {
        self.0.count_ones()
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// GPU indices in increasing order.
    pub fn iter(self) -> impl Iterator<Item = usize> {
        let mut bits = self.0;
        std::iter::from_fn(move || {
            if bits == 0 {
                None
            } else {
                let i = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                Some(i)
            }
        })
    }
}

impl fmt::Display for GpuMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<String> = self.iter().map(|i| i.to_string()).collect();
        f.write_str(&ids.join(","))
    }
}

/// One GPU: capacity and free amount, in the cluster's units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpu {
    pub capacity: u32,
    pub free: u32,
}

impl Gpu {
    pub fn new(capacity: u32) -> Gpu {
        Gpu {
            capacity,
            free: capacity,
        }
    }

    /// No unit in use: the GPU can be handed out whole.
    pub fn is_idle(&self) -> bool {
        self.free == self.capacity
    }
}

/// What a pod asks of GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GpuDemand {
    /// No GPU.
    None,
    /// `amount` units on ONE GPU, shared with other pods.
    Shared { amount: u32 },
    /// `count` whole GPUs, exclusive.
    Whole { count: u32 },
}

impl GpuDemand {
    /// Does a GPU in this state serve one share of this demand?
    #[inline]
    pub fn fits_gpu(self, capacity: u32, free: u32) -> bool {
        match self {
            GpuDemand::None => false,
            GpuDemand::Shared { amount } => free >= amount,
            GpuDemand::Whole { .. } => free == capacity,
        }
    }

    /// How many GPUs must fit.
    pub fn gpus_needed(self) -> u32 {
        match self {
            GpuDemand::None => 0,
            GpuDemand::Shared { .. } => 1,
            GpuDemand::Whole { count } => count,
        }
    }

    /// Total units asked for, counting a whole GPU as `whole_capacity` units.
    pub fn units(self, whole_capacity: u32) -> u64 {
        match self {
            GpuDemand::None => 0,
            GpuDemand::Shared { amount } => u64::from(amount),
            GpuDemand::Whole { count } => u64::from(count) * u64::from(whole_capacity),
        }
    }
}

/// A pod's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Request {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpu: GpuDemand,
    /// Allowed GPU models; `None` = any.
    pub models: Option<ModelSet>,
    /// Node pools the pod may run in; `None` = any.
    pub pools: Option<PoolSet>,
}

impl Request {
    pub fn cpu_only(cpu_milli: u64, memory_mib: u64) -> Request {
        Request {
            cpu_milli,
            memory_mib,
            gpu: GpuDemand::None,
            models: None,
            pools: None,
        }
    }

    pub fn shared(cpu_milli: u64, memory_mib: u64, amount: u32) -> Request {
        Request {
            cpu_milli,
            memory_mib,
            gpu: GpuDemand::Shared { amount },
            models: None,
            pools: None,
        }
    }

    pub fn whole(cpu_milli: u64, memory_mib: u64, count: u32) -> Request {
        Request {
            cpu_milli,
            memory_mib,
            gpu: GpuDemand::Whole { count },
            models: None,
            pools: None,
        }
    }

    pub fn with_models(mut self, models: ModelSet) -> Request {
        self.models = Some(models);
        self
    }

    pub fn with_pools(mut self, pools: PoolSet) -> Request {
        self.pools = Some(pools);
        self
    }

    /// The "GPU clustering" tag of the paper's simulator: 0 = shared, k = k whole GPUs.
    pub fn workload_tag(&self) -> Option<u32> {
        match self.gpu {
            GpuDemand::None => None,
            GpuDemand::Shared { .. } => Some(0),
            GpuDemand::Whole { count } => Some(count),
        }
    }
}

/// One node's state.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    /// The node's model: its GPUs' (the first GPU's on a node of several models).
    pub model: ModelId,
    /// Each GPU's model on a node of several models (a `mixed` node); empty when all are `model`.
    pub gpu_models: Vec<ModelId>,
    pub cpu_capacity: u64,
    pub cpu_free: u64,
    pub memory_capacity: u64,
    pub memory_free: u64,
    pub gpus: Vec<Gpu>,
    /// How many running GPU pods of each workload tag ([`Request::workload_tag`]) the node hosts.
    pub tags: Vec<(u32, u32)>,
    /// The node's pool ([`PoolSet`]); 0 where pools are not modelled.
    pub pool: u8,
}

impl Node {
    pub fn new(name: impl Into<String>, model: ModelId, cpu: u64, memory: u64, gpus: Vec<Gpu>) -> Node {
        Node {
            name: name.into(),
            model,
            gpu_models: Vec::new(),
            cpu_capacity: cpu,
            cpu_free: cpu,
            memory_capacity: memory,
            memory_free: memory,
            gpus,
            tags: Vec::new(),
            pool: 0,
        }
    }

    /// The model of GPU `g`.
    #[inline]
    pub fn gpu_model(&self, g: usize) -> ModelId {
        self.gpu_models.get(g).copied().unwrap_or(self.model)
    }

    pub fn gpu_free_total(&self) -> u64 {
        self.gpus.iter().map(|g| u64::from(g.free)).sum()
    }

    pub fn gpu_capacity_total(&self) -> u64 {
        self.gpus.iter().map(|g| u64::from(g.capacity)).sum()
    }

    pub fn idle_gpus(&self) -> usize {
        self.gpus.iter().filter(|g| g.is_idle()).count()
    }

    /// The GPUs whose model `req` allows (every GPU of an unrestricted request).
    #[inline]
    pub fn allowed(&self, req: &Request) -> GpuMask {
        let all = GpuMask(if self.gpus.len() >= 64 {
            u64::MAX
        } else {
            (1u64 << self.gpus.len()) - 1
        });
        match req.models {
            None => all,
            Some(m) if self.gpu_models.is_empty() => {
                if m.contains(self.model) {
                    all
                } else {
                    GpuMask::EMPTY
                }
            }
            Some(m) => GpuMask(
                (0..self.gpus.len())
                    .filter(|&g| m.contains(self.gpu_model(g)))
                    .fold(0u64, |acc, g| acc | (1u64 << g)),
            ),
        }
    }

    /// Pool, CPU and memory allow the request.
    #[inline]
    fn admits_pod(&self, req: &Request) -> bool {
        self.cpu_free >= req.cpu_milli
            && self.memory_free >= req.memory_mib
            && req.pools.is_none_or(|p| p.contains(self.pool))
    }

    /// Pool, model, CPU and memory allow the request (free GPUs not checked).
    #[inline]
    pub fn admits(&self, req: &Request) -> bool {
        self.admits_pod(req) && (req.gpu == GpuDemand::None || !self.allowed(req).is_empty())
    }

    /// The node can host the request (the scorer's filter).
    pub fn fits(&self, req: &Request) -> bool {
        if !self.admits_pod(req) {
            return false;
        }
        let need = req.gpu.gpus_needed();
        need == 0
            || self
                .allowed(req)
                .iter()
                .filter(|&g| req.gpu.fits_gpu(self.gpus[g].capacity, self.gpus[g].free))
                .count()
                >= need as usize
    }

    /// The first idle GPUs by index, as many as `req` asks for whole, of the models it allows; `None`
    /// when there are not that many.
    pub fn first_idle(&self, req: &Request) -> Option<GpuMask> {
        let mut mask = GpuMask::EMPTY;
        let mut left = req.gpu.gpus_needed();
        for i in self.allowed(req).iter() {
            if left == 0 {
                break;
            }
            if self.gpus[i].is_idle() {
                mask = mask.with(i);
                left -= 1;
            }
        }
        (left == 0).then_some(mask)
    }

    /// For a shared request: the fitting GPU of an allowed model with the least free units (lowest
    /// index on ties).
    pub fn best_fit_gpu(&self, req: &Request, amount: u32) -> Option<usize> {
        let mut best: Option<usize> = None;
        for i in self.allowed(req).iter() {
            let g = self.gpus[i];
            if g.free >= amount && best.is_none_or(|b| g.free < self.gpus[b].free) {
                best = Some(i);
            }
        }
        best
    }

    /// The GPUs `req` would use under best fit: the tightest GPU for a shared request, the first idle
    /// ones for whole GPUs.
    pub fn best_fit_choice(&self, req: &Request) -> Option<GpuMask> {
        match req.gpu {
            GpuDemand::None => Some(GpuMask::EMPTY),
            GpuDemand::Shared { amount } => self.best_fit_gpu(req, amount).map(GpuMask::single),
            GpuDemand::Whole { .. } => self.first_idle(req),
        }
    }

    fn tag_count(&self, tag: u32) -> u32 {
        self.tags.iter().find(|(t, _)| *t == tag).map_or(0, |(_, c)| *c)
    }

    fn bump_tag(&mut self, tag: u32, add: bool) {
        if let Some(entry) = self.tags.iter_mut().find(|(t, _)| *t == tag) {
            if add {
                entry.1 += 1;
            } else {
                entry.1 = entry.1.saturating_sub(1);
            }
        } else if add {
            self.tags.push((tag, 1));
        }
        self.tags.retain(|(_, c)| *c > 0);
    }
}

/// Why a placement was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("no node with index {0}")]
    NoSuchNode(usize),
    #[error("node {node}: {reason}")]
    DoesNotFit { node: String, reason: String },
    #[error("more than {0} GPU models in one cluster")]
    TooManyModels(usize),
}

/// The cluster: nodes and the model table their `model` ids refer to.
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    pub models: ModelTable,
    pub nodes: Vec<Node>,
}

impl Cluster {
    pub fn new(models: ModelTable, nodes: Vec<Node>) -> Cluster {
        Cluster { models, nodes }
    }

    pub fn gpu_capacity_total(&self) -> u64 {
        self.nodes.iter().map(Node::gpu_capacity_total).sum()
    }

    pub fn gpu_free_total(&self) -> u64 {
        self.nodes.iter().map(Node::gpu_free_total).sum()
    }

    pub fn gpu_count(&self) -> usize {
        self.nodes.iter().map(|n| n.gpus.len()).sum()
    }

    /// Mean units per GPU (1000 on the Alibaba trace): what a whole GPU counts as in "arrived workload".
    pub fn mean_gpu_capacity(&self) -> u32 {
        let n = self.gpu_count() as u64;
        self.gpu_capacity_total().checked_div(n).unwrap_or(0) as u32
    }

    /// Checks that `gpus` on `node` can serve `req`, without changing anything.
    pub fn check(&self, node: usize, req: &Request, gpus: GpuMask) -> Result<(), AllocError> {
        let n = self.nodes.get(node).ok_or(AllocError::NoSuchNode(node))?;
        let refuse = |reason: String| {
            Err(AllocError::DoesNotFit {
                node: n.name.clone(),
                reason,
            })
        };
        if !n.admits(req) {
            return refuse(format!("pool, model, cpu or memory do not admit {req:?}"));
        }
        if gpus.iter().any(|i| i >= n.gpus.len()) {
            return refuse(format!("GPU set {gpus} out of range ({} GPUs)", n.gpus.len()));
        }
        if gpus.count() != req.gpu.gpus_needed() {
            return refuse(format!("{} GPUs chosen for {:?}", gpus.count(), req.gpu));
        }
        if let Some(i) = gpus
            .iter()
            .find(|&i| !req.gpu.fits_gpu(n.gpus[i].capacity, n.gpus[i].free))
        {
            return refuse(format!("GPU {i} cannot serve {:?}", req.gpu));
        }
        if let Some(i) = gpus.iter().find(|&i| !n.allowed(req).contains(i)) {
            return refuse(format!("GPU {i} is of a model {req:?} does not allow"));
        }
        Ok(())
    }

    /// Places `req` on `gpus` of `node`.
    pub fn allocate(&mut self, node: usize, req: &Request, gpus: GpuMask) -> Result<(), AllocError> {
        self.check(node, req, gpus)?;
        let n = &mut self.nodes[node];
        n.cpu_free -= req.cpu_milli;
        n.memory_free -= req.memory_mib;
        for i in gpus.iter() {
            let g = &mut n.gpus[i];
            g.free -= match req.gpu {
                GpuDemand::Shared { amount } => amount,
                _ => g.capacity,
            };
        }
        if let Some(tag) = req.workload_tag() {
            n.bump_tag(tag, true);
        }
        Ok(())
    }

    /// Undoes [`Cluster::allocate`] of the same request and GPUs.
    pub fn release(&mut self, node: usize, req: &Request, gpus: GpuMask) -> Result<(), AllocError> {
        let n = self.nodes.get_mut(node).ok_or(AllocError::NoSuchNode(node))?;
        let give_back = |g: &Gpu| match req.gpu {
            GpuDemand::Shared { amount } => amount,
            _ => g.capacity,
        };
        let bad_gpu = gpus
            .iter()
            .any(|i| i >= n.gpus.len() || n.gpus[i].free + give_back(&n.gpus[i]) > n.gpus[i].capacity);
        if bad_gpu
            || n.cpu_free + req.cpu_milli > n.cpu_capacity
            || n.memory_free + req.memory_mib > n.memory_capacity
        {
            return Err(AllocError::DoesNotFit {
                node: n.name.clone(),
                reason: format!("releasing {req:?} on GPUs {gpus} would exceed capacity"),
            });
        }
        n.cpu_free += req.cpu_milli;
        n.memory_free += req.memory_mib;
        for i in gpus.iter() {
            let back = give_back(&n.gpus[i]);
            n.gpus[i].free += back;
        }
        if let Some(tag) = req.workload_tag() {
            n.bump_tag(tag, false);
        }
        Ok(())
    }
}

/// One feasible node: its score (higher is better) and the GPUs the pod would get there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub node: u32,
    pub score: f64,
    pub gpus: GpuMask,
}

impl Candidate {
    /// Adds a scored GPU choice on `node` to `out`, where one node's choices arrive one after another:
    /// the node's best choice is kept (the first of equals: only a strictly greater score replaces).
    pub fn keep_best(out: &mut Vec<Candidate>, node: u32, score: f64, gpus: GpuMask) {
        match out.last_mut() {
            Some(last) if last.node == node => {
                if score > last.score {
                    last.score = score;
                    last.gpus = gpus;
                }
            }
            _ => out.push(Candidate { node, score, gpus }),
        }
    }
}

/// A placement policy. Implementations may keep caches between calls (hence `&mut self`), but their
/// answer depends only on the cluster state, the request and the RNG — with one exception:
/// [`kube_dra::KubeDra`] models kube-scheduler, whose `nextStartNodeIndex` carries over from one
/// scheduling decision to the next, so its answer also depends on the calls before, and it must be
/// asked once per decision, in arrival order (as [`place`] and the simulator do).
pub trait Policy: Send {
    /// Display name, as on the command line.
    fn name(&self) -> &'static str;

    /// Appends to `out` one [`Candidate`] per node that can host `req` (`out` is cleared first).
    fn score(&mut self, cluster: &Cluster, req: &Request, rng: &mut dyn Rng, out: &mut Vec<Candidate>);

    /// [`Policy::score`] restricted to `nodes` (indices into `cluster.nodes`, ascending, no duplicates):
    /// the listed nodes get exactly the candidates `score` would give them, the others none. The
    /// cluster is still the whole view: cluster-wide terms (model scarcity) count every node.
    ///
    /// This default scores every node and drops the unlisted ones; policies that are costly per node
    /// override it to skip them.
    fn score_nodes(
        &mut self,
        cluster: &Cluster,
        nodes: &[u32],
        req: &Request,
        rng: &mut dyn Rng,
        out: &mut Vec<Candidate>,
    ) {
        self.score(cluster, req, rng, out);
        out.retain(|c| nodes.binary_search(&c.node).is_ok());
    }
}

/// `nodes` (as [`Policy::score_nodes`] takes them) as `usize` indices.
pub(crate) fn indices(nodes: &[u32]) -> impl Iterator<Item = usize> + Clone + '_ {
    debug_assert!(nodes.windows(2).all(|w| w[0] < w[1]), "node indices must ascend");
    nodes.iter().map(|&i| i as usize)
}

/// How [`select`] breaks ties between equally scored nodes.
#[derive(Debug, Clone, Copy)]
pub enum TieBreak<'a> {
    /// Uniformly at random (upstream kube-scheduler's selectHost).
    Random,
    /// The node with the lowest rank (`rank[node]`) wins. The FGD artifact's patched kube-scheduler
    /// picks the smallest node name, and names carry a random per-run prefix: a fixed random ranking.
    Rank(&'a [u32]),
}

/// The highest-scoring candidate, ties broken by `tie`.
pub fn select(candidates: &[Candidate], tie: TieBreak<'_>, rng: &mut dyn Rng) -> Option<Candidate> {
    let mut best: Option<Candidate> = None;
    let mut ties = 0u32;
    for c in candidates {
        match best {
            Some(b) if c.score < b.score => {}
            Some(b) if c.score == b.score => match tie {
                TieBreak::Random => {
                    ties += 1;
                    if rng.random_range(0..ties) == 0 {
                        best = Some(*c);
                    }
                }
                TieBreak::Rank(rank) => {
                    let r = |n: u32| rank.get(n as usize).copied().unwrap_or(u32::MAX);
                    if r(c.node) < r(b.node) {
                        best = Some(*c);
                    }
                }
            },
            _ => {
                best = Some(*c);
                ties = 1;
            }
        }
    }
    best
}

/// Scores `req` with `policy`, picks the winner and allocates it. Returns the chosen candidate, or
/// `None` when no node can host the pod.
pub fn place(
    policy: &mut dyn Policy,
    cluster: &mut Cluster,
    req: &Request,
    tie: TieBreak<'_>,
    rng: &mut dyn Rng,
    scratch: &mut Vec<Candidate>,
) -> Result<Option<Candidate>, AllocError> {
    policy.score(cluster, req, rng, scratch);
    let Some(best) = select(scratch, tie, rng) else {
        return Ok(None);
    };
    cluster.allocate(best.node as usize, req, best.gpus)?;
    Ok(Some(best))
}

/// The policies `gpumem simulate` knows, in the order it reports them.
pub const POLICY_NAMES: [&str; 8] = [
    "Random",
    "DotProduct",
    "GpuClustering",
    "GpuPacking",
    "BestFit",
    "KubeDRA",
    "FGD",
    "gpumem",
];

/// Builds the policy called `name` (case-insensitive; "DotProd" is accepted for DotProduct) for a
/// cluster like `cluster`, with `mix` as the typical workload the fragmentation-aware policies protect.
pub fn build_policy(name: &str, cluster: &Cluster, mix: &TypicalMix) -> Option<Box<dyn Policy>> {
    let spec = baselines::MaxSpec::of(cluster);
    let p: Box<dyn Policy> = match name.to_ascii_lowercase().as_str() {
        "random" => Box::new(baselines::Random),
        "dotproduct" | "dotprod" => Box::new(baselines::DotProduct::new(spec)),
        "gpuclustering" => Box::new(baselines::GpuClustering::new(spec)),
        "gpupacking" => Box::new(baselines::GpuPacking),
        "bestfit" => Box::new(baselines::BestFit::new(spec)),
        "kubedra" => Box::new(kube_dra::KubeDra::new(0)),
        "fgd" => Box::new(fgd::Fgd::new(FragModel::new(mix, &cluster.models, false))),
        "gpumem" => Box::new(gpumem::Gpumem::new(mix, cluster)),
        _ => return None,
    };
    Some(p)
}

/// Whether the policy called `name` reads the typical mix (FGD and gpumem): the others rank the same
/// whatever the mix, so an online view changes nothing for them.
pub fn uses_mix(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower == "fgd" || lower == "gpumem"
}

/// The canonical spelling of a policy name, if known.
pub fn canonical_policy_name(name: &str) -> Option<&'static str> {
    let lower = name.to_ascii_lowercase();
    if lower == "dotprod" {
        return Some("DotProduct");
    }
    POLICY_NAMES
        .iter()
        .copied()
        .find(|p| p.to_ascii_lowercase() == lower)
}

#[cfg(test)]
pub(crate) mod testutil {
    use super::*;
    use rand::SeedableRng;

    pub fn rng() -> rand_pcg::Pcg64Mcg {
        rand_pcg::Pcg64Mcg::seed_from_u64(7)
    }

    /// A node of `frees.len()` GPUs of 1000 milli with the given free amounts.
    pub fn node(name: &str, cpu_free: u64, frees: &[u32]) -> Node {
        let mut n = Node::new(
            name,
            0,
            64_000,
            256_000,
            frees.iter().map(|_| Gpu::new(1000)).collect(),
        );
        n.cpu_free = cpu_free;
        for (g, &f) in n.gpus.iter_mut().zip(frees) {
            g.free = f;
        }
        n
    }

    pub fn cluster(nodes: Vec<Node>) -> Cluster {
        let mut models = ModelTable::default();
        models.intern("G").expect("one model");
        Cluster::new(models, nodes)
    }

    /// A node of model 0 ("G", 1000 units per GPU) or 1 ("H", 2000) with up to `max_gpus` GPUs, in a
    /// random state ([`scramble`]).
    pub fn random_node(r: &mut impl Rng, name: usize, max_gpus: usize) -> Node {
        let model = r.random_range(0..2);
        let cap = if model == 0 { 1000 } else { 2000 };
        let gpus = vec![Gpu::new(cap); r.random_range(0..=max_gpus)];
        let mut n = Node::new(format!("n{name}"), model, 32_000, 128_000, gpus);
        scramble(r, &mut n);
        n
    }

    /// Random free amounts, in quarters, so that equal amounts, idle and full GPUs are common.
    pub fn scramble(r: &mut impl Rng, n: &mut Node) {
        n.cpu_free = n.cpu_capacity / 8 * r.random_range(0..=8);
        n.memory_free = n.memory_capacity / 4 * r.random_range(0..=4);
        for g in &mut n.gpus {
            g.free = g.capacity / 4 * r.random_range(0..=4);
        }
    }

    /// `n` random nodes of models "G" and "H".
    pub fn random_cluster(r: &mut impl Rng, n: usize, max_gpus: usize) -> Cluster {
        let mut c = cluster(Vec::new());
        c.models.intern("H").expect("two models");
        c.nodes = (0..n).map(|i| random_node(r, i, max_gpus)).collect();
        c
    }

    /// A random request of any kind, one in five restricted to one of two models.
    pub fn random_request(r: &mut impl Rng) -> Request {
        let (cpu, mem) = (r.random_range(0..=8) * 1000, r.random_range(0..=4) * 8000);
        let req = match r.random_range(0..4) {
            0 => Request::cpu_only(cpu, mem),
            1 | 2 => Request::shared(cpu, mem, r.random_range(1..=4) * 250),
            _ => Request::whole(cpu, mem, r.random_range(1..=4)),
        };
        if r.random_bool(0.2) {
            req.with_models(ModelSet::NONE.with(r.random_range(0..2)))
        } else {
            req
        }
    }

    /// A candidate list with scores as bits: equal means identical.
    pub fn to_bits(out: &[Candidate]) -> Vec<(u32, u64, GpuMask)> {
        out.iter().map(|c| (c.node, c.score.to_bits(), c.gpus)).collect()
    }

    /// The candidate for `node`, if it was scored.
    pub fn cand(out: &[Candidate], node: u32) -> Option<Candidate> {
        out.iter().copied().find(|c| c.node == node)
    }

    /// The winner (ties must not exist in the tests that use this).
    pub fn winner(p: &mut dyn Policy, c: &Cluster, req: &Request) -> Candidate {
        let mut out = Vec::new();
        p.score(c, req, &mut rng(), &mut out);
        let best = out.iter().map(|c| c.score).fold(f64::NEG_INFINITY, f64::max);
        let top: Vec<_> = out.iter().filter(|c| c.score == best).collect();
        assert_eq!(top.len(), 1, "{} has a tie at the top: {out:?}", p.name());
        *top[0]
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_pcg::Pcg64Mcg;

    use super::testutil::*;
    use super::*;

    #[test]
    fn score_nodes_is_score_restricted_to_the_listed_nodes_for_every_policy() {
        let mut r = rng();
        let base = random_cluster(&mut r, 24, 8);
        let reqs: Vec<Request> = (0..300).map(|_| random_request(&mut r)).collect();
        let mix = TypicalMix::from_requests(&reqs, 0.95);
        for name in POLICY_NAMES {
            // One instance scores subsets call after call (its caches partly synced), the other all;
            // nodes change in between, listed or not.
            let mut part = build_policy(name, &base, &mix).expect("known policy");
            let mut all = build_policy(name, &base, &mix).expect("known policy");
            let mut c = base.clone();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for req in &reqs[..60] {
                let k = r.random_range(0..c.nodes.len());
                scramble(&mut r, &mut c.nodes[k]);
                let nodes: Vec<u32> = (0..c.nodes.len() as u32).filter(|_| r.random_bool(0.6)).collect();
                let seed = r.random::<u64>();
                part.score_nodes(&c, &nodes, req, &mut Pcg64Mcg::seed_from_u64(seed), &mut a);
                all.score(&c, req, &mut Pcg64Mcg::seed_from_u64(seed), &mut b);
                b.retain(|x| nodes.contains(&x.node));
                assert_eq!(to_bits(&a), to_bits(&b), "{name} on {nodes:?} for {req:?}");
            }
        }
    }

    #[test]
    fn filter_is_per_gpu_not_node_sum() {
        // 2 x 400 free = 800 on the node, but no single GPU has 500.
        let c = cluster(vec![node("a", 64_000, &[400, 400]), node("b", 64_000, &[0, 600])]);
        let req = Request::shared(1000, 1000, 500);
        assert!(!c.nodes[0].fits(&req));
        assert!(c.nodes[1].fits(&req));
    }

    #[test]
    fn whole_gpus_need_idle_gpus_and_models_are_respected() {
        let mut c = cluster(vec![node("a", 64_000, &[1000, 999, 1000])]);
        let g2 = c.models.intern("G2").expect("intern");
        assert!(c.nodes[0].fits(&Request::whole(0, 0, 2)));
        assert!(!c.nodes[0].fits(&Request::whole(0, 0, 3)));
        assert_eq!(
            c.nodes[0].first_idle(&Request::whole(0, 0, 2)),
            Some(GpuMask(0b101))
        );
        let only_g2 = Request::whole(0, 0, 1).with_models(ModelSet::NONE.with(g2));
        assert!(!c.nodes[0].fits(&only_g2));
    }

    #[test]
    fn on_a_node_of_two_models_a_restricted_pod_gets_only_its_models_gpus() {
        // GPU 0 and 2 of model G (0), GPU 1 and 3 of T4; GPU 1 is the tightest.
        let mut c = cluster(vec![node("mixed", 64_000, &[1000, 600, 1000, 1000])]);
        let t4 = c.models.intern("T4").expect("intern");
        c.nodes[0].gpu_models = vec![0, t4, 0, t4];
        let only_t4 = ModelSet::NONE.with(t4);
        let n = &c.nodes[0];
        let share = Request::shared(0, 0, 700).with_models(only_t4);
        assert_eq!(n.allowed(&share), GpuMask(0b1010));
        assert!(n.fits(&share), "GPU 3, a T4, has room");
        assert_eq!(n.best_fit_choice(&share), Some(GpuMask::single(3)));
        let two = Request::whole(0, 0, 2).with_models(only_t4);
        assert!(!n.fits(&two), "one idle T4 only");
        assert_eq!(n.first_idle(&Request::whole(0, 0, 2)), Some(GpuMask(0b101)));
        assert!(
            c.check(0, &share, GpuMask::single(0)).is_err(),
            "GPU 0 is not a T4"
        );
        assert!(c.check(0, &share, GpuMask::single(3)).is_ok());
        let elsewhere = Request::shared(0, 0, 100).with_models(ModelSet::NONE.with(5));
        assert!(!n.admits(&elsewhere));
    }

    #[test]
    fn a_pod_runs_only_in_its_pools() {
        let mut c = cluster(vec![node("a", 64_000, &[1000]), node("b", 64_000, &[1000])]);
        c.nodes[1].pool = 3;
        let req = Request::shared(0, 0, 100).with_pools(PoolSet::NONE.with(3));
        assert!(!c.nodes[0].fits(&req) && c.nodes[1].fits(&req));
        assert!(c.check(0, &req, GpuMask::single(0)).is_err());
        assert!(c.nodes[0].fits(&Request::shared(0, 0, 100)), "no pools: anywhere");
    }

    #[test]
    fn allocate_and_release_round_trip_and_refuse_overcommit() {
        let mut c = cluster(vec![node("a", 4000, &[1000, 300])]);
        let before = c.nodes[0].clone();
        let req = Request::shared(1000, 10, 250);
        c.allocate(0, &req, GpuMask::single(1)).expect("fits");
        assert_eq!(c.nodes[0].gpus[1].free, 50);
        assert!(c.allocate(0, &req, GpuMask::single(1)).is_err(), "only 50 left");
        assert!(
            c.allocate(0, &Request::whole(1000, 0, 1), GpuMask::single(1))
                .is_err(),
            "GPU 1 is shared"
        );
        c.release(0, &req, GpuMask::single(1)).expect("release");
        assert_eq!(c.nodes[0], before);
        assert!(c.release(0, &req, GpuMask::single(1)).is_err(), "double release");
    }

    #[test]
    fn select_breaks_ties_uniformly_or_by_rank() {
        let cands: Vec<Candidate> = (0..4)
            .map(|i| Candidate {
                node: i,
                score: if i == 0 { 1.0 } else { 5.0 },
                gpus: GpuMask::EMPTY,
            })
            .collect();
        let mut r = rng();
        let mut hits = [0u32; 4];
        for _ in 0..3000 {
            hits[select(&cands, TieBreak::Random, &mut r).expect("some").node as usize] += 1;
        }
        assert_eq!(hits[0], 0);
        for h in &hits[1..] {
            assert!((800..1200).contains(h), "{hits:?}");
        }
        assert!(select(&[], TieBreak::Random, &mut r).is_none());
        let rank = [0, 9, 2, 5];
        assert_eq!(
            select(&cands, TieBreak::Rank(&rank), &mut r).map(|c| c.node),
            Some(2)
        );
    }
}
