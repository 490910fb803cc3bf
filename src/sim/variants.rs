//! Experiments with the gpumem policy's knobs: `gpumem simulate --policy gpumem:<spec>` builds the
//! policy with another [`Tuning`]. The knobs live here, with the simulator: the scorer can only name a
//! policy ([`alloc::build_policy`]), and runs gpumem with its one configuration. Likewise
//! `KubeDRA:pct=<N>` is kube-scheduler with `percentageOfNodesToScore: N` instead of its adaptive
//! default ([`parse_kube_dra`]).

use crate::alloc::gpumem::{Gpumem, Tuning};
use crate::alloc::kube_dra::KubeDra;
use crate::alloc::{self, Cluster, Policy, TypicalMix};

/// Prefix of a KubeDRA variant (`KubeDRA:pct=100`).
pub const KUBE_DRA_PREFIX: &str = "KubeDRA:";

/// Parses a KubeDRA variant's spec `pct=<N>` (`percentageOfNodesToScore`, 0..=100; 0 = adaptive).
pub fn parse_kube_dra(spec: &str) -> Option<KubeDra> {
    let mut pct = 0u32;
    for kv in spec.split(':').filter(|s| !s.is_empty()) {
        match kv.split_once('=')? {
            ("pct", v) => pct = v.parse().ok().filter(|p| *p <= 100)?,
            _ => return None,
        }
    }
    Some(KubeDra::new(pct))
}

/// Parses `key=value` pairs separated by `:` (`dw=1:q=0.04:pack=0`), starting from the defaults.
/// Keys: `dw` demand-weighted, `q` quantum, `pack`, `fill`, `mem`, `all`, `gn`, `ft` fill tie weight,
/// `fgn` fill tie by GPUs needed, `sig` sigmoid score, `rv` reserve weight, `rx` reserve exponent,
/// `sc` scarcity weight, `dyn` dynamic scarcity, `idle` idle term weight (booleans: 0 or 1).
pub fn parse_tuning(spec: &str) -> Option<Tuning> {
    let mut o = Tuning::default();
    for kv in spec.split(':').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=')?;
        let x: f64 = v.parse().ok()?;
        match k {
            "dw" => o.demand_weighted = x != 0.0,
            "q" => o.quantum = x,
            "pack" => o.pack = x,
            "fill" => o.fill = x != 0.0,
            "mem" => o.memory = x != 0.0,
            "all" => o.all_types = x != 0.0,
            "gn" => o.gpus_needed = x != 0.0,
            "ft" => o.fill_tie = x,
            "fgn" => o.fill_tie_gpus = x != 0.0,
            "sig" => o.sigmoid = x != 0.0,
            "rv" => o.reserve = x,
            "sc" => o.scarcity = x,
            "dyn" => o.dynamic = x != 0.0,
            "rx" => o.reserve_exp = x,
            "idle" => o.idle = x,
            "wg" => o.whole_in_mean_gpus = x != 0.0,
            _ => return None,
        }
    }
    Some(o)
}

/// The policy called `name`: one of [`alloc::POLICY_NAMES`], or a variant `gpumem:<spec>` or
/// `KubeDRA:<spec>`.
pub fn build_policy(name: &str, cluster: &Cluster, mix: &TypicalMix) -> Option<Box<dyn Policy>> {
    if let Some(spec) = name.strip_prefix(KUBE_DRA_PREFIX) {
        return Some(Box::new(parse_kube_dra(spec)?));
    }
    match name.strip_prefix("gpumem:") {
        Some(spec) => Some(Box::new(Gpumem::with_tuning(mix, cluster, parse_tuning(spec)?))),
        None => alloc::build_policy(name, cluster, mix),
    }
}

/// Whether the policy called `name` (a variant too) reads the typical mix.
pub fn uses_mix(name: &str) -> bool {
    name.starts_with("gpumem:") || alloc::uses_mix(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_start_from_the_production_tuning() {
        assert_eq!(parse_tuning(""), Some(Tuning::default()));
        let t = parse_tuning("ft=0:rv=0:sc=0:dyn=0").expect("valid");
        assert_eq!(
            (t.fill_tie, t.reserve, t.scarcity, t.dynamic),
            (0.0, 0.0, 0.0, false)
        );
        assert_eq!(t.reserve_exp, Tuning::default().reserve_exp);
        let o = parse_tuning("q=0.08:ft=0.01:fgn=1:sig=0").expect("valid");
        assert!(o.quantum == 0.08 && o.fill_tie == 0.01 && o.fill_tie_gpus && !o.sigmoid);
        assert_eq!(parse_tuning("nope=1"), None);
        assert_eq!(parse_tuning("rv"), None);
        assert_eq!(parse_tuning("rv=x"), None);
    }

    #[test]
    fn only_the_simulator_builds_variants() {
        let (cluster, mix) = (Cluster::default(), TypicalMix::default());
        assert!(build_policy("gpumem:rv=0", &cluster, &mix).is_some());
        assert!(
            alloc::build_policy("gpumem:rv=0", &cluster, &mix).is_none(),
            "the scorer names policies only"
        );
        assert!(build_policy("gpumem", &cluster, &mix).is_some());
        assert!(uses_mix("gpumem:rv=0") && uses_mix("FGD") && !uses_mix("BestFit"));
        assert!(build_policy("KubeDRA", &cluster, &mix).is_some());
        assert!(build_policy("KubeDRA:pct=100", &cluster, &mix).is_some());
        assert!(alloc::build_policy("KubeDRA:pct=100", &cluster, &mix).is_none());
        assert!(!uses_mix("KubeDRA") && !uses_mix("KubeDRA:pct=100"));
    }

    #[test]
    fn kube_dra_specs_set_the_percentage_of_nodes_to_score() {
        assert!(parse_kube_dra("").is_some());
        assert!(parse_kube_dra("pct=100").is_some());
        assert!(parse_kube_dra("pct=0").is_some());
        assert!(parse_kube_dra("pct=101").is_none());
        assert!(parse_kube_dra("pct=-1").is_none());
        assert!(parse_kube_dra("rv=1").is_none());
        assert!(parse_kube_dra("pct").is_none());
    }
}
