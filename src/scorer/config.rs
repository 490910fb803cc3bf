//! The scorer's configuration file (`--config`): weights, policy, limits, the typical mix, TLS; read
//! and checked before anything starts.

use crate::tls::TlsFiles;
use anyhow::Context;
use serde::Deserialize;

/// One entry of the typical request mix.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TypicalEntry {
    /// GPU memory on one GPU, MiB.
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// Whole GPUs.
    #[serde(default)]
    pub whole_gpus: Option<u32>,
    /// Share of requests of this kind.
    pub share: f64,
}

/// The default `maxBodyBytes`: 16 MiB. The largest request kube-scheduler sends in the `NodeNames` form
/// is under 4 MiB (15,000 names of 253 bytes, [`extender::MAX_NODES`]); in the `Nodes` form, 16 MiB is
/// 1,000 nodes of 16 KiB (kube-scheduler sends a sample: 500 of 5,000 nodes by default). Measured
/// (`cargo test --release --test scorer_bounds -- --ignored --nocapture peak_memory`: VmHWM of the
/// test process, which holds the scorer and the client's request text; node cache of 5,000 nodes of
/// 8 GPUs: 52 MB): 15,000 unknown names of 253 bytes, filter then prioritize: 103 MB; twelve
/// different `Nodes`-form requests just under 16 MiB (6,585 nodes of 8 GPUs each), filter then
/// prioritize each: 419 MB. With 64 MiB the `Nodes` form alone reached 376 MB in one request, 729 MB
/// in six: the deployed limit is 512 Mi.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// The default `filterShortlist`.
pub const DEFAULT_FILTER_SHORTLIST: usize = 10;

/// The scorer's configuration (`--config`, YAML, camelCase keys; every key optional).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct ScorerConfig {
    /// The placement policy ranking nodes (as `gpumem simulate --policy`).
    pub policy: String,
    /// Weight of "spread" (room left) against the policy's fragmentation ranking, for online pods.
    pub online_weight: f64,
    /// Weight of "pack" (little room left) against the policy's ranking, for offline pods.
    pub offline_weight: f64,
    /// The online weight when the cluster's GPU memory is more than `hotThreshold` allocated.
    pub hot_online_weight: f64,
    pub hot_threshold: f64,
    /// PriorityClass names whose pods are online (without a `gpumem.io/workload-class`).
    pub online_priority_classes: Vec<String>,
    /// Pods with at least this priority are online.
    pub online_min_priority: Option<i32>,
    /// How long a bind's reservation lasts if the agent never reports the pod.
    pub ledger_ttl_seconds: u64,
    /// Book each bind in its node's Lease before the Binding, so that replicas side by side never
    /// promise the same room ([`super::bookings`]). Costs a read and a write per bind; a single replica
    /// can do without (`false`).
    pub shared_bookings: bool,
    /// Largest request body accepted (see [`DEFAULT_MAX_BODY_BYTES`]).
    pub max_body_bytes: usize,
    /// The kube-scheduler profiles whose pods `bind` binds (a pod's `spec.schedulerName`); a pod of
    /// any other scheduler is refused, so a stray caller cannot make the scorer bind it.
    pub scheduler_names: Vec<String>,
    /// The request mix the fragmentation measure protects until the scorer has seen
    /// [`crate::alloc::MixConfig::min_pods`] (100) GPU pods of its own; from then on, the mix it learned
    /// from them ([`super::workload`]).
    pub typical_mix: Vec<TypicalEntry>,
    /// The learned mix weighs each pod by how many pods came after it: a pod's weight falls by a
    /// factor e every `mixWindowPods` pods (0: no decay, every pod seen counts the same).
    pub mix_window_pods: f64,
    /// `filter` hands back at most this many nodes, the ones ranked best (0: every node that fits).
    /// kube-scheduler scores, and asks `prioritize` about, only those; its own preferences choose
    /// among them. See `Scorer::shortlist` and docs/scale.md.
    pub filter_shortlist: usize,
    /// Serve the verbs over TLS to clients with a certificate (`--tls-listen`); see [`TlsFiles`].
    pub tls: Option<TlsFiles>,
    /// Place pods on the DRA path (Kubernetes 1.34+): allocate their ResourceClaims with gpumem's
    /// policy before kube-scheduler sees them; see the placer (`src/placer/`). Absent: kube-scheduler's own
    /// allocator places them.
    pub dra: Option<DraPlacementConfig>,
}

/// The scheduling gate that keeps a pod from kube-scheduler until the placer has allocated its claims
/// (the chart's MutatingAdmissionPolicy adds it).
pub const PLACEMENT_GATE: &str = "gpumem.io/placement";

/// `dra` in the configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct DraPlacementConfig {
    /// The agents' DRA driver name (their `dra.driverName`).
    pub driver_name: String,
    /// The DeviceClasses whose requests gpumem places (every GPU of the driver).
    pub device_classes: Vec<String>,
    /// The scheduling gate that holds a pod back from kube-scheduler until its claim is allocated
    /// (the chart's MutatingAdmissionPolicy adds it).
    pub scheduling_gate: String,
    /// Namespace and name of the Lease that elects the one replica that places (namespace: the
    /// scorer's own, `POD_NAMESPACE`, when empty).
    pub lease_namespace: String,
    pub lease_name: String,
    /// Whether a placed pod is also pinned to its node when its gate is removed (a required node
    /// affinity on `metadata.name`, as a DaemonSet's pods have): kube-scheduler then runs its filters
    /// on that node alone, where the claims already bind the pod, rather than on every node. A pinned
    /// pod that cannot run there after all (a pod kube-scheduler placed took the CPU meanwhile) waits
    /// for that node.
    pub pin_to_node: bool,
}

impl Default for DraPlacementConfig {
    fn default() -> DraPlacementConfig {
        DraPlacementConfig {
            driver_name: "gpumem.io".into(),
            device_classes: vec!["gpu.gpumem.io".into()],
            scheduling_gate: PLACEMENT_GATE.into(),
            lease_namespace: String::new(),
            lease_name: "gpumem-dra-placement".into(),
            pin_to_node: true,
        }
    }
}

impl Default for ScorerConfig {
    fn default() -> ScorerConfig {
        let mem = |m, share| TypicalEntry {
            memory_mib: Some(m),
            whole_gpus: None,
            share,
        };
        let whole = |c, share| TypicalEntry {
            memory_mib: None,
            whole_gpus: Some(c),
            share,
        };
        ScorerConfig {
            policy: "gpumem".into(),
            online_weight: 0.7,
            offline_weight: 0.3,
            hot_online_weight: 0.9,
            hot_threshold: 0.8,
            online_priority_classes: Vec::new(),
            online_min_priority: None,
            ledger_ttl_seconds: 120,
            shared_bookings: true,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            scheduler_names: vec!["default-scheduler".into(), "gpumem-scheduler".into()],
            typical_mix: vec![
                mem(2048, 0.15),
                mem(4096, 0.2),
                mem(8192, 0.2),
                mem(16384, 0.1),
                whole(1, 0.25),
                whole(2, 0.05),
                whole(4, 0.03),
                whole(8, 0.02),
            ],
            filter_shortlist: DEFAULT_FILTER_SHORTLIST,
            tls: None,
            dra: None,
            mix_window_pods: crate::alloc::MixConfig::default().window,
        }
    }
}

impl ScorerConfig {
    /// The configured typical request mix (`typicalMix`), in MiB: the prior of the learned one
    /// ([`super::workload`]).
    pub fn prior_mix(&self) -> crate::alloc::TypicalMix {
        use crate::alloc::GpuDemand;
        let total: f64 = self.typical_mix.iter().map(|t| t.share.max(0.0)).sum();
        let types = self
            .typical_mix
            .iter()
            .filter(|t| t.share > 0.0)
            .map(|t| crate::alloc::frag::TypicalType {
                cpu_milli: 0,
                memory_mib: 0,
                gpu: match (t.memory_mib, t.whole_gpus) {
                    (Some(m), _) => GpuDemand::Shared {
                        amount: u32::try_from(m).unwrap_or(u32::MAX),
                    },
                    (None, Some(c)) => GpuDemand::Whole { count: c },
                    (None, None) => GpuDemand::None,
                },
                models: None,
                popularity: t.share / total,
            })
            .collect();
        crate::alloc::TypicalMix {
            types,
            all: Vec::new(),
        }
    }

    pub fn load(path: &std::path::Path) -> anyhow::Result<ScorerConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let cfg: ScorerConfig =
            serde_norway::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        // KubeDRA models kube-scheduler's own choice on the DRA path (a sampled subset of nodes, first
        // fit in the node): the simulator's baseline, not a ranking an extender could give.
        if crate::alloc::canonical_policy_name(&self.policy) == Some("KubeDRA") {
            anyhow::bail!(
                "policy KubeDRA is kube-scheduler's own placement on the DRA path, for `gpumem simulate`; \
                 the scorer ranks with one of the others"
            );
        }
        if crate::alloc::build_policy(
            &self.policy,
            &crate::alloc::Cluster::default(),
            &crate::alloc::TypicalMix::default(),
        )
        .is_none()
        {
            anyhow::bail!(
                "unknown policy {:?} (one of {:?})",
                self.policy,
                crate::alloc::POLICY_NAMES
            );
        }
        for (name, w) in [
            ("onlineWeight", self.online_weight),
            ("offlineWeight", self.offline_weight),
            ("hotOnlineWeight", self.hot_online_weight),
            ("hotThreshold", self.hot_threshold),
        ] {
            if !(0.0..=1.0).contains(&w) {
                anyhow::bail!("{name} is {w}, must be within 0..1");
            }
        }
        if self
            .typical_mix
            .iter()
            .any(|t| t.memory_mib.is_some() == t.whole_gpus.is_some())
        {
            anyhow::bail!("each typicalMix entry needs exactly one of memoryMiB and wholeGpus");
        }
        if !(self.mix_window_pods >= 0.0 && self.mix_window_pods.is_finite()) {
            anyhow::bail!("mixWindowPods is {}, must be 0 or more", self.mix_window_pods);
        }
        if self.max_body_bytes == 0 {
            anyhow::bail!("maxBodyBytes is 0");
        }
        if self.scheduler_names.is_empty() {
            anyhow::bail!("schedulerNames is empty: the scorer would bind no pod");
        }
        if let Some(dra) = &self.dra {
            crate::names::check_subdomain(&dra.driver_name)
                .map_err(|e| anyhow::anyhow!("dra.driverName: {e}"))?;
            crate::names::check_subdomain(&dra.lease_name)
                .map_err(|e| anyhow::anyhow!("dra.leaseName: {e}"))?;
            if !dra.lease_namespace.is_empty() {
                crate::names::check_label(&dra.lease_namespace)
                    .map_err(|e| anyhow::anyhow!("dra.leaseNamespace: {e}"))?;
            }
            if dra.device_classes.is_empty() {
                anyhow::bail!("dra.deviceClasses is empty: the scorer would place no claim");
            }
            if dra.scheduling_gate.is_empty() {
                anyhow::bail!("dra.schedulingGate is empty");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scorer_runs_named_policies_only() {
        let with = |policy: &str| ScorerConfig {
            policy: policy.into(),
            ..ScorerConfig::default()
        };
        assert!(with("gpumem").validate().is_ok());
        assert!(with("FGD").validate().is_ok());
        // The knobs are the simulator's (`gpumem simulate --policy gpumem:<spec>`), not a deployment's.
        let err = with("gpumem:rv=0").validate().expect_err("a variant");
        assert!(err.to_string().contains("unknown policy"), "{err}");
        let err = with("kubedra")
            .validate()
            .expect_err("the simulator's model of kube-scheduler");
        assert!(err.to_string().contains("gpumem simulate"), "{err}");
    }
}
