//! The typical task mix learned from the pods seen so far: what the fragmentation-aware policies protect.
//!
//! The FGD paper builds its mix from the whole trace, known in advance ([`TypicalMix::from_requests`]).
//! A cluster sees pods as they arrive: [`MixLearner`] counts task types as they are observed, each
//! observation's weight decaying with the number of observations made after it (a window of
//! [`MixConfig::window`] pods), and builds the same [`TypicalMix`] from those decayed counts. A prior mix
//! stands in until [`MixConfig::min_pods`] pods were seen. Without decay (an infinite window) the
//! learner's mix is exactly the whole-history mix: `from_requests` is the learner fed every request.
//!
//! A policy is compiled from a mix (per cluster, with caches), so rebuilding it at every arrival would
//! cost more than deciding. [`OnlineMix`] keeps the mix a policy was last built from and moves on (a new
//! [`OnlineMix::generation`]) only when the learned mix drifted from it by more than
//! [`MixConfig::tolerance`] ([`distance`]). The scorer (from its pod cache) and `gpumem simulate` (at
//! each arrival) share it. Pure: no I/O, no clock.

use std::collections::HashMap;

use super::frag::{TypicalMix, TypicalType};
use super::{GpuDemand, ModelSet, Request};

/// What makes a task type: CPU, GPU demand and allowed models (memory is averaged per type).
type TypeKey = (u64, GpuDemand, Option<ModelSet>);

/// How the mix is learned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixConfig {
    /// Typical types: the most popular ones covering this fraction of the (decayed) tasks (the paper: 0.95).
    pub threshold: f64,
    /// Decay window, in observed pods: an observation's weight falls by a factor e for every `window`
    /// pods observed after it (`f64::INFINITY`: no decay, every pod seen counts the same).
    pub window: f64,
    /// The prior mix is used until this many pods were observed (when the prior is not empty).
    pub min_pods: u64,
    /// [`OnlineMix`] moves to the learned mix when it is farther than this from the current one
    /// ([`distance`], 0..=1; 0: at every check).
    pub tolerance: f64,
    /// [`OnlineMix`] compares the learned mix with the current one at most every this many
    /// observations (and more often early on, when each pod moves the mix more).
    pub check_every: u64,
}

impl Default for MixConfig {
    fn default() -> MixConfig {
        MixConfig {
            threshold: 0.95,
            window: 5000.0,
            min_pods: 100,
            tolerance: 0.02,
            check_every: 32,
        }
    }
}

/// Decayed count and decayed memory sum of one task type, in units of [`MixLearner::scale`].
#[derive(Debug, Clone, Copy, Default)]
struct Weights {
    count: f64,
    memory: f64,
}

/// Counts task types as pods are observed, with decay; [`MixLearner::mix`] builds the mix.
#[derive(Debug, Clone)]
pub struct MixLearner {
    cfg: MixConfig,
    prior: TypicalMix,
    types: HashMap<TypeKey, Weights>,
    /// Sum of all counts (same units).
    total: f64,
    /// Weight of the next observation. Decay is lazy: instead of shrinking every count at each
    /// observation, later observations weigh more (by `1 / keep` each), and everything is rescaled
    /// now and then. Without decay it stays 1, so counts are exact integers.
    scale: f64,
    /// `exp(-1 / window)`: what one observation leaves of the weight of the ones before it.
    keep: f64,
    seen: u64,
}

/// Rescale (and drop negligible types) once the next observation weighs this much.
const RESCALE_AT: f64 = 1e100;
/// A type whose weight fell below this share of the total is forgotten at a rescale.
const FORGET_BELOW: f64 = 1e-9;

impl MixLearner {
    /// A learner that has seen nothing; `prior` is its mix until `cfg.min_pods` pods were observed.
    pub fn new(cfg: MixConfig, prior: TypicalMix) -> MixLearner {
        let keep = if cfg.window.is_finite() && cfg.window > 0.0 {
            (-1.0 / cfg.window).exp()
        } else {
            1.0
        };
        MixLearner {
            cfg,
            prior,
            types: HashMap::new(),
            total: 0.0,
            scale: 1.0,
            keep,
            seen: 0,
        }
    }

    pub fn config(&self) -> &MixConfig {
        &self.cfg
    }

    /// Pods observed so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Whether [`MixLearner::mix`] is still the prior.
    pub fn using_prior(&self) -> bool {
        self.seen < self.cfg.min_pods && !self.prior.types.is_empty()
    }

    /// Counts one pod (a new arrival; the same pod should be observed once).
    pub fn observe(&mut self, req: &Request) {
        let w = self
            .types
            .entry((req.cpu_milli, req.gpu, req.models))
            .or_default();
        w.count += self.scale;
        w.memory += self.scale * req.memory_mib as f64;
        self.total += self.scale;
        self.seen += 1;
        if self.keep < 1.0 {
            self.scale /= self.keep;
            if self.scale > RESCALE_AT {
                self.rescale();
            }
        }
    }

    /// Brings the next observation's weight back to 1, and forgets types that decayed to nothing.
    fn rescale(&mut self) {
        let s = self.scale;
        let floor = self.total / s * FORGET_BELOW;
        self.types.retain(|_, w| {
            w.count /= s;
            w.memory /= s;
            w.count >= floor
        });
        self.total = self.types.values().map(|w| w.count).sum();
        self.scale = 1.0;
    }

    /// The mix of the pods seen so far (the prior until enough were seen), built as the paper's
    /// simulator does: task types sorted by decreasing (decayed) count, the most popular kept until
    /// they cover `threshold` of the tasks, popularities renormalised; `all` has every type, its
    /// popularity its share of all tasks. Memory per type is its (decayed) mean.
    pub fn mix(&self) -> TypicalMix {
        if self.using_prior() {
            return self.prior.clone();
        }
        let mut sorted: Vec<(TypeKey, Weights)> = self.types.iter().map(|(k, w)| (*k, *w)).collect();
        // Most popular first; equal counts in the artifact's order (larger resources first).
        let order_key = |g: GpuDemand| match g {
            GpuDemand::None => (0u32, 0u32),
            GpuDemand::Shared { amount } => (amount, 1),
            GpuDemand::Whole { count } => (u32::MAX, count),
        };
        sorted.sort_by(|(ka, wa), (kb, wb)| {
            wb.count
                .total_cmp(&wa.count)
                .then(kb.0.cmp(&ka.0))
                .then(order_key(kb.1).cmp(&order_key(ka.1)))
                .then(kb.2.cmp(&ka.2))
        });
        let typ = |&((cpu_milli, gpu, models), w): &(TypeKey, Weights), of: f64| TypicalType {
            cpu_milli,
            // Exact integer division when the counts are (no decay).
            memory_mib: (w.memory / w.count.max(f64::MIN_POSITIVE)).floor() as u64,
            gpu,
            models,
            popularity: w.count / of.max(f64::MIN_POSITIVE),
        };
        let total = if self.total > 0.0 { self.total } else { 1.0 };
        let all = sorted.iter().map(|e| typ(e, total)).collect();
        let expected = self.cfg.threshold * self.total;
        let mut kept = 0usize;
        let mut cum = 0.0;
        for (_, w) in &sorted {
            if kept == 0 || cum < expected {
                cum += w.count;
                kept += 1;
            } else {
                break;
            }
        }
        let cum = if cum > 0.0 { cum } else { 1.0 };
        let types = sorted[..kept].iter().map(|e| typ(e, cum)).collect();
        TypicalMix { types, all }
    }
}

/// How far apart two mixes are: the larger of the total variation distances (0..=1) between their
/// typical types and between all their types (a type missing from one has popularity 0 there).
pub fn distance(a: &TypicalMix, b: &TypicalMix) -> f64 {
    fn tv(a: &[TypicalType], b: &[TypicalType]) -> f64 {
        let mut p: HashMap<TypeKey, f64> = HashMap::with_capacity(a.len() + b.len());
        for t in a {
            *p.entry((t.cpu_milli, t.gpu, t.models)).or_default() += t.popularity;
        }
        for t in b {
            *p.entry((t.cpu_milli, t.gpu, t.models)).or_default() -= t.popularity;
        }
        p.values().map(|d| d.abs()).sum::<f64>() / 2.0
    }
    tv(&a.types, &b.types).max(tv(&a.all, &b.all))
}

/// A learned mix for a policy to be built from, moved on only when the pods seen since drift from it.
///
/// Feed it every arriving pod ([`OnlineMix::observe`]); before a decision call [`OnlineMix::refresh`],
/// and rebuild the policy from [`OnlineMix::mix`] when [`OnlineMix::generation`] changed since it was
/// built. The mix then reflects only pods observed before the call.
#[derive(Debug, Clone)]
pub struct OnlineMix {
    learner: MixLearner,
    current: TypicalMix,
    generation: u64,
    /// Observations since the last comparison.
    pending: u64,
}

impl OnlineMix {
    pub fn new(cfg: MixConfig, prior: TypicalMix) -> OnlineMix {
        let learner = MixLearner::new(cfg, prior);
        let current = learner.mix();
        OnlineMix {
            learner,
            current,
            generation: 0,
            pending: 0,
        }
    }

    /// Counts one arriving pod.
    pub fn observe(&mut self, req: &Request) {
        self.learner.observe(req);
        self.pending += 1;
    }

    /// Compares the learned mix with the current one when due (every [`MixConfig::check_every`]
    /// observations, and after every observation while they are few: when the pending ones are at
    /// least an eighth of all), and moves to it when they differ by more than [`MixConfig::tolerance`]
    /// or the current one is empty. Returns whether it moved.
    pub fn refresh(&mut self) -> bool {
        let cfg = *self.learner.config();
        if self.pending == 0 {
            return false;
        }
        let seen = self.learner.seen();
        let prior_ends = seen == cfg.min_pods;
        if !(prior_ends || self.pending >= cfg.check_every.max(1) || self.pending * 8 >= seen) {
            return false;
        }
        self.pending = 0;
        let next = self.learner.mix();
        let moved = (self.current.types.is_empty() && !next.types.is_empty())
            || (next != self.current && distance(&next, &self.current) > cfg.tolerance);
        if moved {
            self.current = next;
            self.generation += 1;
        }
        moved
    }

    /// The mix to build policies from.
    pub fn mix(&self) -> &TypicalMix {
        &self.current
    }

    /// Bumped whenever [`OnlineMix::mix`] changes: a policy built at another generation is stale.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn learner(&self) -> &MixLearner {
        &self.learner
    }
}

/// The typical mix of a whole workload, learnt at once (the simulator's view, and the configured
/// prior's).
impl TypicalMix {
    /// Builds the mix from a workload, as the paper's simulator does: task types are (cpu, GPU demand,
    /// allowed models), counted, sorted by decreasing count, and the most popular ones are kept until
    /// they cover `threshold` (0..=1; the paper uses 0.95) of the tasks; popularities are renormalised.
    pub fn from_requests<'a>(requests: impl IntoIterator<Item = &'a Request>, threshold: f64) -> TypicalMix {
        // The online learner without decay, fed the whole workload: one construction for both views.
        let cfg = MixConfig {
            threshold,
            window: f64::INFINITY,
            min_pods: 0,
            ..MixConfig::default()
        };
        let mut learner = MixLearner::new(cfg, TypicalMix::default());
        for r in requests {
            learner.observe(r);
        }
        learner.mix()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    fn no_decay(threshold: f64) -> MixConfig {
        MixConfig {
            threshold,
            window: f64::INFINITY,
            min_pods: 0,
            ..MixConfig::default()
        }
    }

    fn learned(cfg: MixConfig, reqs: &[Request]) -> TypicalMix {
        let mut l = MixLearner::new(cfg, TypicalMix::default());
        reqs.iter().for_each(|r| l.observe(r));
        l.mix()
    }

    fn popularity(mix: &[TypicalType], req: &Request) -> f64 {
        mix.iter()
            .find(|t| (t.cpu_milli, t.gpu, t.models) == (req.cpu_milli, req.gpu, req.models))
            .map_or(0.0, |t| t.popularity)
    }

    /// The whole-trace mix as the paper's simulator counts it (integer counts), written out apart.
    fn reference(reqs: &[Request], threshold: f64) -> (Vec<(TypeKey, u64, u64)>, usize) {
        let mut counts: HashMap<TypeKey, (u64, u64)> = HashMap::new();
        for r in reqs {
            let e = counts.entry((r.cpu_milli, r.gpu, r.models)).or_default();
            e.0 += 1;
            e.1 += r.memory_mib;
        }
        let mut v: Vec<(TypeKey, u64, u64)> = counts.into_iter().map(|(k, (c, m))| (k, c, m / c)).collect();
        let ok = |g: GpuDemand| match g {
            GpuDemand::None => (0u32, 0u32),
            GpuDemand::Shared { amount } => (amount, 1),
            GpuDemand::Whole { count } => (u32::MAX, count),
        };
        v.sort_by(|a, b| {
            b.1.cmp(&a.1)
                .then(b.0.0.cmp(&a.0.0))
                .then(ok(b.0.1).cmp(&ok(a.0.1)))
                .then(b.0.2.cmp(&a.0.2))
        });
        let (mut kept, mut cum) = (0, 0u64);
        for e in &v {
            if kept == 0 || (cum as f64) < threshold * reqs.len() as f64 {
                cum += e.1;
                kept += 1;
            } else {
                break;
            }
        }
        (v, kept)
    }

    fn random_requests(n: usize, seed: u64) -> Vec<Request> {
        let mut r = rand_pcg::Pcg64Mcg::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let cpu = [1000, 2000, 4000, 8000][r.random_range(0..4)];
                let mem = r.random_range(0..40_000u64);
                let req = match r.random_range(0..5) {
                    0 => Request::cpu_only(cpu, mem),
                    1 | 2 => Request::shared(cpu, mem, [250, 500, 300][r.random_range(0..3)]),
                    _ => Request::whole(cpu, mem, [1, 2, 8][r.random_range(0..3)]),
                };
                if r.random_bool(0.1) {
                    req.with_models(ModelSet::NONE.with(r.random_range(0..3u8)))
                } else {
                    req
                }
            })
            .collect()
    }

    #[test]
    fn without_decay_it_is_exactly_the_whole_history_mix() {
        for (seed, threshold) in [(1, 0.95), (2, 0.5), (3, 1.0)] {
            let reqs = random_requests(3000, seed);
            let mix = learned(no_decay(threshold), &reqs);
            assert_eq!(mix, TypicalMix::from_requests(&reqs, threshold));
            let (v, kept) = reference(&reqs, threshold);
            assert_eq!(mix.all.len(), v.len());
            assert_eq!(mix.types.len(), kept);
            let cum: u64 = v[..kept].iter().map(|e| e.1).sum();
            for (t, (key, count, mem)) in mix.all.iter().zip(&v) {
                assert_eq!(((t.cpu_milli, t.gpu, t.models), t.memory_mib), (*key, *mem));
                assert_eq!(t.popularity, *count as f64 / reqs.len() as f64);
            }
            for (t, (key, count, _)) in mix.types.iter().zip(&v) {
                assert_eq!((t.cpu_milli, t.gpu, t.models), *key);
                assert_eq!(t.popularity, *count as f64 / cum as f64);
            }
        }
    }

    #[test]
    fn decay_follows_a_changing_workload() {
        let (a, b) = (Request::shared(1000, 0, 500), Request::whole(8000, 0, 1));
        let cfg = MixConfig {
            window: 100.0,
            min_pods: 0,
            threshold: 1.0,
            ..MixConfig::default()
        };
        let mut l = MixLearner::new(cfg, TypicalMix::default());
        (0..1000).for_each(|_| l.observe(&a));
        (0..100).for_each(|_| l.observe(&b));
        // After 1000 a's then 100 b's (one window): b weighs 1 - e^-1 of all, a e^-1 (to 1000 a's e^-10).
        let m = l.mix();
        let want_a = (-1.0f64).exp() * (1.0 - (-10.0f64).exp());
        assert!((popularity(&m.all, &a) - want_a).abs() < 1e-3, "{m:?}");
        assert!((popularity(&m.all, &b) - (1.0 - want_a)).abs() < 1e-3);
        assert_eq!(m.all[0].gpu, b.gpu, "the recent type leads");
        // Without decay, the same history still says "mostly a".
        let mut flat = MixLearner::new(no_decay(1.0), TypicalMix::default());
        (0..1000).for_each(|_| flat.observe(&a));
        (0..100).for_each(|_| flat.observe(&b));
        assert!((popularity(&flat.mix().all, &a) - 1000.0 / 1100.0).abs() < 1e-12);
    }

    #[test]
    fn long_runs_rescale_and_forget_types_that_decayed_away() {
        let (a, b) = (Request::shared(1000, 64, 500), Request::whole(8000, 0, 1));
        let cfg = MixConfig {
            window: 10.0,
            min_pods: 0,
            threshold: 1.0,
            ..MixConfig::default()
        };
        let mut l = MixLearner::new(cfg, TypicalMix::default());
        l.observe(&b);
        // e^(n / 10) passes 1e100 at n = 2303: several rescales on the way.
        for _ in 0..10_000 {
            l.observe(&a);
        }
        assert!(l.scale.is_finite() && l.scale <= RESCALE_AT);
        let m = l.mix();
        assert_eq!(m.all.len(), 1, "b was forgotten");
        assert_eq!((m.all[0].popularity, m.all[0].memory_mib), (1.0, 64));
        assert_eq!(l.seen(), 10_001);
    }

    #[test]
    fn the_prior_holds_until_enough_pods_were_seen() {
        let prior = TypicalMix::from_requests(&[Request::whole(4000, 0, 8)], 0.95);
        let cfg = MixConfig {
            min_pods: 3,
            ..MixConfig::default()
        };
        let mut l = MixLearner::new(cfg, prior.clone());
        assert_eq!(l.mix(), prior);
        let seen = Request::shared(1000, 0, 250);
        l.observe(&seen);
        l.observe(&seen);
        assert!(l.using_prior());
        assert_eq!(l.mix(), prior);
        l.observe(&seen);
        assert!(!l.using_prior());
        assert_eq!(l.mix(), TypicalMix::from_requests(&[seen; 3], 0.95));
        // An empty prior is no prior: the learner's own mix from the first pod on.
        let mut l = MixLearner::new(cfg, TypicalMix::default());
        assert_eq!(l.mix(), TypicalMix::default());
        l.observe(&seen);
        assert_eq!(l.mix(), TypicalMix::from_requests(&[seen], 0.95));
    }

    #[test]
    fn online_mix_knows_only_the_pods_observed_before() {
        // At every step the online mix equals the mix of a prefix of the history (never a later pod),
        // and a policy is rebuilt only when the generation moves.
        let reqs = random_requests(2000, 9);
        let cfg = MixConfig {
            window: f64::INFINITY,
            min_pods: 0,
            threshold: 1.0,
            tolerance: 0.03,
            check_every: 16,
        };
        let mut online = OnlineMix::new(cfg, TypicalMix::default());
        let mut built_at = 0usize; // the prefix length the current mix was built from
        let mut generations = 0;
        for i in 0..reqs.len() {
            if online.refresh() {
                built_at = i;
                generations += 1;
            }
            assert_eq!(online.generation(), generations);
            // The mix used for pod i is the mix of pods[..built_at], built_at <= i.
            assert_eq!(
                online.mix(),
                &TypicalMix::from_requests(&reqs[..built_at], 1.0),
                "pod {i}"
            );
            // And it is not staler than the tolerance, plus what the pods since the last check (at
            // most 16, each moving the mix by at most 1 / pods seen) can add.
            let drift = distance(&learned(cfg, &reqs[..i]), online.mix());
            assert!(
                i < 64 || drift <= 0.03 + 17.0 / (i - 17) as f64,
                "pod {i}: drift {drift}"
            );
            online.observe(&reqs[i]);
        }
        assert!(generations > 3 && generations < 200, "{generations} rebuilds");
    }

    #[test]
    fn distance_is_total_variation() {
        let (a, b, c) = (
            Request::shared(1000, 0, 500),
            Request::whole(1000, 0, 1),
            Request::cpu_only(1000, 0),
        );
        let x = TypicalMix::from_requests(&[a, a, b, b], 1.0);
        let y = TypicalMix::from_requests(&[a, a, a, c], 1.0);
        assert_eq!(distance(&x, &x), 0.0);
        // all: a 0.5 vs 0.75, b 0.5 vs 0, c 0 vs 0.25: (0.25 + 0.5 + 0.25) / 2.
        assert!((distance(&x, &y) - 0.5).abs() < 1e-12);
        assert_eq!(distance(&x, &y), distance(&y, &x));
    }
}
