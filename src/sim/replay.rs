//! One replay: a trace, a policy, a seed. The paper's protocol: pods are shuffled with the seed, then
//! clones of uniformly sampled pods are appended until the GPU request reaches `inflate` times the
//! cluster's GPU capacity; pods arrive one at a time, never leave, and a pod that fits nowhere fails.

use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;

use crate::alloc::frag::{FragModel, TypicalMix};
use crate::alloc::{
    self, Candidate, Cluster, GpuDemand, MAX_MODELS, MixConfig, ModelSet, ModelTable, OnlineMix, Request,
    TieBreak,
};

use super::trace::Trace;

/// Per-arrival metrics, averaged in buckets of 1% arrived workload (as the paper's analysis does).
#[derive(Debug, Clone, Default)]
pub struct Curve {
    /// Per bucket: number of arrivals, sums of unallocated %, fragmentation % and fragmentation rate %.
    pub count: Vec<u32>,
    pub unalloc: Vec<f64>,
    pub frag: Vec<f64>,
    pub frag_rate: Vec<f64>,
}

impl Curve {
    fn new(buckets: usize) -> Curve {
        Curve {
            count: vec![0; buckets],
            unalloc: vec![0.0; buckets],
            frag: vec![0.0; buckets],
            frag_rate: vec![0.0; buckets],
        }
    }

    fn add(&mut self, bucket: usize, unalloc: f64, frag: f64, frag_rate: f64) {
        if bucket < self.count.len() {
            self.count[bucket] += 1;
            self.unalloc[bucket] += unalloc;
            self.frag[bucket] += frag;
            self.frag_rate[bucket] += frag_rate;
        }
    }

    /// Mean (unallocated %, fragmentation %, fragmentation rate %) at `pct` arrived: the arrivals in that
    /// bucket, or, if there are none, in the buckets next to it.
    pub fn at(&self, pct: usize) -> Option<(f64, f64, f64)> {
        let lo = pct.saturating_sub(1);
        for range in [pct..pct + 1, lo..pct + 2] {
            let range = range.start..range.end.min(self.count.len());
            let n: u32 = self.count[range.clone()].iter().sum();
            if n > 0 {
                let mean = |v: &[f64]| v[range.clone()].iter().sum::<f64>() / f64::from(n);
                return Some((mean(&self.unalloc), mean(&self.frag), mean(&self.frag_rate)));
            }
        }
        None
    }
}

/// The kinds of GPU pod whose fate a user feels apart: how much GPU they ask, and whether they name
/// their GPU model. A policy that starves one class to pack another shows in [`Classes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodClass {
    Shared,
    /// One whole GPU.
    Whole,
    /// Two or more whole GPUs.
    Multi,
}

impl PodClass {
    pub const ALL: [PodClass; 3] = [PodClass::Shared, PodClass::Whole, PodClass::Multi];

    pub fn name(self) -> &'static str {
        match self {
            PodClass::Shared => "shared",
            PodClass::Whole => "whole",
            PodClass::Multi => "multi",
        }
    }

    /// The class of `req`; `None` for a pod without GPUs.
    pub fn of(req: &Request) -> Option<PodClass> {
        match req.gpu {
            GpuDemand::None => None,
            GpuDemand::Shared { .. } => Some(PodClass::Shared),
            GpuDemand::Whole { count: 1 } => Some(PodClass::Whole),
            GpuDemand::Whole { .. } => Some(PodClass::Multi),
        }
    }
}

/// Pods of one class that arrived, and how many of them were placed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Placed {
    pub arrived: u32,
    pub placed: u32,
}

impl Placed {
    /// Placed % of arrived (`None` when none arrived).
    pub fn pct(self) -> Option<f64> {
        (self.arrived > 0).then(|| f64::from(self.placed) / f64::from(self.arrived) * 100.0)
    }
}

/// Per class ([`PodClass`]) and restriction (index 1: pods that name their GPU model), what arrived
/// and what was placed: the seed's "scheduling success rate", class by class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Classes(pub [[Placed; 2]; 3]);

impl Classes {
    fn count(&mut self, req: &Request, placed: bool) {
        if let Some(c) = PodClass::of(req) {
            let cell = &mut self.0[c as usize][usize::from(req.models.is_some())];
            cell.arrived += 1;
            cell.placed += u32::from(placed);
        }
    }

    pub fn get(&self, class: PodClass, restricted: bool) -> Placed {
        self.0[class as usize][usize::from(restricted)]
    }

    /// All classes of one restriction (`None`: every GPU pod).
    pub fn total(&self, restricted: Option<bool>) -> Placed {
        let mut t = Placed::default();
        for c in &self.0 {
            for (r, p) in c.iter().enumerate() {
                if restricted.is_none_or(|x| x == (r == 1)) {
                    t.arrived += p.arrived;
                    t.placed += p.placed;
                }
            }
        }
        t
    }
}

/// Restricted GPU pods that name one model set: what arrived and what was placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetPlaced {
    pub models: ModelSet,
    /// The set's model names in model id order, joined by `|` ([`set_name`]).
    pub name: String,
    pub placed: Placed,
}

/// The name of a model set: its models' names in model id order, joined by `|` (`none` for the empty
/// set, which a pod names when none of the models it asks for is in the cluster).
pub fn set_name(models: &ModelTable, set: ModelSet) -> String {
    let names: Vec<&str> = (0..MAX_MODELS as u8)
        .filter(|&id| set.contains(id))
        .map(|id| models.name(id))
        .collect();
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join("|")
    }
}

/// Restricted GPU pods per model set they name, sorted by the set's bits (a run sees few distinct
/// sets: a lookup is a binary search, a new set the only allocation).
#[derive(Debug, Clone, Default)]
struct BySet(Vec<(ModelSet, Placed)>);

impl BySet {
    fn count(&mut self, req: &Request, placed: bool) {
        let (Some(models), Some(_)) = (req.models, PodClass::of(req)) else {
            return;
        };
        let i = match self.0.binary_search_by_key(&models, |e| e.0) {
            Ok(i) => i,
            Err(i) => {
                self.0.insert(i, (models, Placed::default()));
                i
            }
        };
        let cell = &mut self.0[i].1;
        cell.arrived += 1;
        cell.placed += u32::from(placed);
    }

    fn named(&self, models: &ModelTable) -> Vec<SetPlaced> {
        self.0
            .iter()
            .map(|&(set, placed)| SetPlaced {
                models: set,
                name: set_name(models, set),
                placed,
            })
            .collect()
    }
}

/// The outcome of one replay.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub policy: &'static str,
    pub seed: u64,
    pub curve: Curve,
    pub pods: usize,
    pub failed: usize,
    /// Per class, what was placed of what arrived until 100% of capacity had arrived, and until the end.
    pub classes_at_100: Classes,
    pub classes: Classes,
    /// The restricted GPU pods of `classes_at_100` and `classes`, per model set they name (sorted by the
    /// set's bits; a set appears once a pod naming it arrived). They sum to `total(Some(true))`.
    pub restricted_at_100: Vec<SetPlaced>,
    pub restricted: Vec<SetPlaced>,
    /// Final arrived workload, % of GPU capacity.
    pub arrived_pct: f64,
    /// Final allocated GPU units and capacity.
    pub allocated: u64,
    pub capacity: u64,
    pub seconds: f64,
    /// Times the policy was built (1 with the oracle mix; with the online one, once per mix it moved to).
    pub builds: usize,
    /// Seconds spent building policies (included in `seconds`).
    pub build_seconds: f64,
}

/// What the policy knows of the workload when it decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MixView {
    /// The trace's whole-trace mix, known in advance (the FGD paper's protocol).
    Oracle,
    /// Only the pods that arrived before the decision, learned as [`OnlineMix`] does (no prior).
    Online(MixConfig),
}

/// The pod sequence of one seed: the trace shuffled, then inflated (or trimmed) to `inflate` x capacity.
pub fn workload(trace: &Trace, seed: u64, inflate: f64) -> Vec<Request> {
    workload_and_ranks(trace, seed, inflate).0
}

/// The pod sequence of one seed and the node ranking used to break ties (a random permutation drawn
/// after the workload, as the paper's simulator prefixes node names with one).
pub fn workload_and_ranks(trace: &Trace, seed: u64, inflate: f64) -> (Vec<Request>, Vec<u32>) {
    let mut rng = Pcg64Mcg::seed_from_u64(seed);
    let mut pods = trace.pods.clone();
    pods.shuffle(&mut rng);
    if inflate > 0.0 {
        inflate_to(trace, &mut pods, inflate, &mut rng);
    }
    let mut ranks: Vec<u32> = (0..trace.cluster.nodes.len() as u32).collect();
    ranks.shuffle(&mut rng);
    (pods, ranks)
}

fn inflate_to(trace: &Trace, pods: &mut Vec<Request>, inflate: f64, rng: &mut Pcg64Mcg) {
    let target = inflate * trace.cluster.gpu_capacity_total() as f64;
    let mut total: u64 = pods.iter().map(|p| trace.units(p)).sum();
    while total as f64 > target && !pods.is_empty() {
        let i = rng.random_range(0..pods.len());
        total -= trace.units(&pods.remove(i));
    }
    let n = trace.pods.len();
    loop {
        let clone = trace.pods[rng.random_range(0..n)];
        let u = trace.units(&clone);
        if (total + u) as f64 > target {
            break;
        }
        total += u;
        pods.push(clone);
    }
}

/// Replays `trace` with the policy called `policy` and `seed`. `mix` is the trace's typical workload
/// (used by the fragmentation-aware policies and by the fragmentation metric). With `random_ties`,
/// equal scores are broken at random instead of by the per-seed node ranking. `progress` is called
/// with the number of pods placed since the last call.
#[allow(clippy::too_many_arguments)]
pub fn replay(
    trace: &Trace,
    policy: &str,
    seed: u64,
    inflate: f64,
    mix: &TypicalMix,
    random_ties: bool,
    progress: impl FnMut(u64),
) -> anyhow::Result<RunResult> {
    replay_with(
        trace,
        policy,
        seed,
        inflate,
        mix,
        MixView::Oracle,
        random_ties,
        progress,
    )
}

/// [`replay`] with the policy's view of the workload given by `view`: with [`MixView::Online`] the
/// policy (if it reads a mix, [`super::variants::uses_mix`]) is built from the pods arrived so far, and rebuilt
/// whenever the learned mix moves. `mix` is still what the fragmentation metric measures against.
#[allow(clippy::too_many_arguments)]
pub fn replay_with(
    trace: &Trace,
    policy: &str,
    seed: u64,
    inflate: f64,
    mix: &TypicalMix,
    view: MixView,
    random_ties: bool,
    progress: impl FnMut(u64),
) -> anyhow::Result<RunResult> {
    let start = std::time::Instant::now();
    let (pods, ranks) = workload_and_ranks(trace, seed, inflate);
    let mut r = replay_sequence(
        trace,
        policy,
        seed,
        &pods,
        &ranks,
        inflate,
        mix,
        view,
        random_ties,
        progress,
    )?;
    r.seconds = start.elapsed().as_secs_f64();
    Ok(r)
}

/// [`replay_with`] of a given pod sequence and node ranking (`inflate` only sizes the curve). Seed:
/// of the policy's random stream.
#[allow(clippy::too_many_arguments)]
pub fn replay_sequence(
    trace: &Trace,
    policy: &str,
    seed: u64,
    pods: &[Request],
    ranks: &[u32],
    inflate: f64,
    mix: &TypicalMix,
    view: MixView,
    random_ties: bool,
    mut progress: impl FnMut(u64),
) -> anyhow::Result<RunResult> {
    let start = std::time::Instant::now();
    let mut cluster: Cluster = trace.cluster.clone();
    let build = |cluster: &Cluster, mix: &TypicalMix| {
        super::variants::build_policy(policy, cluster, mix)
            .ok_or_else(|| anyhow::anyhow!("unknown policy {policy:?}"))
    };
    let mut online = match view {
        MixView::Online(cfg) if super::variants::uses_mix(policy) => {
            Some(OnlineMix::new(cfg, TypicalMix::default()))
        }
        _ => None,
    };
    let mut pol = build(&cluster, online.as_ref().map_or(mix, |o| o.mix()))?;
    let (mut builds, mut build_seconds) = (1usize, 0.0f64);
    let name = pol.name();
    let tie = if random_ties {
        TieBreak::Random
    } else {
        TieBreak::Rank(ranks)
    };
    // The policy's tie-breaking stream is separate from the workload's.
    let mut rng = Pcg64Mcg::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let metric = FragModel::new(mix, &cluster.models, false);
    let mut node_frag: Vec<f64> = cluster.nodes.iter().map(|n| metric.node_frag(n)).collect();
    let mut frag_sum: f64 = node_frag.iter().sum();

    let capacity = cluster.gpu_capacity_total();
    let cap = capacity.max(1) as f64;
    let buckets = (inflate.max(1.0) * 100.0).ceil() as usize + 3;
    let mut curve = Curve::new(buckets);
    let (mut arrived, mut allocated, mut failed) = (0u64, 0u64, 0usize);
    let mut scratch: Vec<Candidate> = Vec::with_capacity(cluster.nodes.len());
    let mut since = 0u64;
    let (mut classes, mut classes_at_100) = (Classes::default(), Classes::default());
    let (mut by_set, mut by_set_at_100) = (BySet::default(), BySet::default());
    for req in pods {
        let units = trace.units(req);
        arrived += units;
        if arrived > capacity && classes_at_100 == Classes::default() {
            classes_at_100 = classes;
            by_set_at_100.0.clone_from(&by_set.0);
        }
        if let Some(o) = online.as_mut() {
            // The pods before this one, as a policy could know them when this one arrives.
            if o.refresh() {
                let t = std::time::Instant::now();
                pol = build(&cluster, o.mix())?;
                build_seconds += t.elapsed().as_secs_f64();
                builds += 1;
            }
        }
        let chosen = alloc::place(pol.as_mut(), &mut cluster, req, tie, &mut rng, &mut scratch)?;
        classes.count(req, chosen.is_some());
        by_set.count(req, chosen.is_some());
        match chosen {
            Some(c) => {
                let n = &cluster.nodes[c.node as usize];
                allocated += match req.gpu {
                    GpuDemand::Shared { amount } => u64::from(amount),
                    _ => c.gpus.iter().map(|g| u64::from(n.gpus[g].capacity)).sum(),
                };
                let f = metric.node_frag(n);
                frag_sum += f - node_frag[c.node as usize];
                node_frag[c.node as usize] = f;
            }
            None => failed += 1,
        }
        if let Some(o) = online.as_mut() {
            o.observe(req);
        }
        let idle = (capacity - allocated) as f64;
        let bucket = (arrived as f64 / cap * 100.0).round_ties_even() as usize;
        let rate = if idle > 0.0 { frag_sum / idle * 100.0 } else { 0.0 };
        curve.add(
            bucket,
            100.0 - allocated as f64 / cap * 100.0,
            frag_sum / cap * 100.0,
            rate,
        );
        since += 1;
        if since == 512 {
            progress(since);
            since = 0;
        }
    }
    progress(since);
    if classes_at_100 == Classes::default() {
        classes_at_100 = classes;
        by_set_at_100.0.clone_from(&by_set.0);
    }
    tracing::debug!(policy = name, seed, failed, pods = pods.len(), "replay done");
    Ok(RunResult {
        policy: name,
        seed,
        curve,
        pods: pods.len(),
        failed,
        classes_at_100,
        classes,
        restricted_at_100: by_set_at_100.named(&cluster.models),
        restricted: by_set.named(&cluster.models),
        arrived_pct: arrived as f64 / cap * 100.0,
        allocated,
        capacity,
        seconds: start.elapsed().as_secs_f64(),
        builds,
        build_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::testutil::{random_cluster, random_request};
    use crate::alloc::{Gpu, Node};

    fn replay_pods(trace: &Trace, pods: &[Request]) -> RunResult {
        let ranks: Vec<u32> = (0..trace.cluster.nodes.len() as u32).collect();
        replay_sequence(
            trace,
            "BestFit",
            1,
            pods,
            &ranks,
            1.3,
            &TypicalMix::default(),
            MixView::Oracle,
            false,
            |_| {},
        )
        .expect("the replay runs")
    }

    fn sum(sets: &[SetPlaced]) -> Placed {
        sets.iter().fold(Placed::default(), |t, s| Placed {
            arrived: t.arrived + s.placed.arrived,
            placed: t.placed + s.placed.placed,
        })
    }

    fn row(sets: &[SetPlaced]) -> Vec<(&str, u32, u32)> {
        sets.iter()
            .map(|s| (s.name.as_str(), s.placed.arrived, s.placed.placed))
            .collect()
    }

    #[test]
    fn restricted_pods_are_counted_per_model_set_they_name() {
        // Models T4 (0), A100 (1), H100 (2); GPUs: two T4s and one A100, no H100.
        let mut models = ModelTable::default();
        for m in ["T4", "A100", "H100"] {
            models.intern(m).expect("a model");
        }
        let node = |name: &str, model, gpus: usize| {
            Node::new(name, model, 64_000, 64_000, vec![Gpu::new(1000); gpus])
        };
        let trace = Trace {
            name: "tiny".into(),
            cluster: Cluster::new(models, vec![node("t4", 0, 2), node("a100", 1, 1)]),
            pods: Vec::new(),
        };
        let t4 = ModelSet::NONE.with(0);
        let big = ModelSet::NONE.with(1).with(2);
        let h100 = ModelSet::NONE.with(2);
        let whole = Request::whole(0, 0, 1);
        let pods = [
            Request::cpu_only(100, 100).with_models(t4), // no GPU: in no class
            whole.with_models(t4),
            Request::shared(0, 0, 500).with_models(t4),
            whole.with_models(big),
            // 2500 of 3000 units arrived before this one, 3500 with it: past 100%. The A100 is taken
            // and no H100 exists; the second T4 holds a share, so no whole GPU is left.
            whole.with_models(big),
            whole.with_models(h100),
            whole,
        ];
        let r = replay_pods(&trace, &pods);
        assert_eq!(
            row(&r.restricted_at_100),
            [("T4", 2, 2), ("A100|H100", 1, 1)],
            "until 100% arrived"
        );
        // Sorted by the set's bits: T4 (1), H100 (4), A100|H100 (6).
        assert_eq!(
            row(&r.restricted),
            [("T4", 2, 2), ("H100", 1, 0), ("A100|H100", 2, 1)],
            "until the end"
        );
        assert_eq!(r.restricted[2].models, big);
        assert_eq!(sum(&r.restricted_at_100), r.classes_at_100.total(Some(true)));
        assert_eq!(sum(&r.restricted), r.classes.total(Some(true)));
        assert_eq!(
            r.classes.total(Some(false)),
            Placed {
                arrived: 1,
                placed: 0
            }
        );
        assert_eq!(set_name(&trace.cluster.models, ModelSet::NONE), "none");
    }

    #[test]
    fn the_sets_sum_to_the_restricted_pods_of_every_class() {
        use rand::SeedableRng;
        let mut r = Pcg64Mcg::seed_from_u64(11);
        let cluster = random_cluster(&mut r, 12, 8);
        // One model or the other (`random_request`), and now and then both.
        let both = ModelSet::NONE.with(0).with(1);
        let pods: Vec<Request> = (0..400)
            .map(|i| match random_request(&mut r) {
                req if req.models.is_some() && i % 3 == 0 => req.with_models(both),
                req => req,
            })
            .collect();
        let trace = Trace {
            name: "random".into(),
            cluster,
            pods: Vec::new(),
        };
        let res = replay_pods(&trace, &pods);
        let restricted = res.classes.total(Some(true));
        assert!(restricted.arrived > 0 && restricted.placed > 0, "{restricted:?}");
        assert!(
            restricted.placed < restricted.arrived,
            "some fail: {restricted:?}"
        );
        assert_eq!(sum(&res.restricted), restricted);
        assert_eq!(sum(&res.restricted_at_100), res.classes_at_100.total(Some(true)));
        let names: Vec<&str> = res.restricted.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["G", "H", "G|H"], "sorted by the set's bits");
        for s in &res.restricted {
            let at_100 = res.restricted_at_100.iter().find(|a| a.models == s.models);
            let before = at_100.map_or(Placed::default(), |a| a.placed);
            assert!(before.arrived <= s.placed.arrived && before.placed <= s.placed.placed);
        }
    }
}
