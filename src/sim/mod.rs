//! `gpumem simulate`: replays a cluster trace through the placement policies of [`crate::alloc`] (the
//! scorer's own code) and reports unallocated GPU and fragmentation against arrived workload, following
//! the FGD paper's protocol (see [`replay`]). `--bench` times single decisions instead.

pub mod bench;
pub mod bound;
pub mod realistic;
pub mod replay;
pub mod report;
pub mod restrict;
pub mod trace;
pub mod variants;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::alloc::{MixConfig, POLICY_NAMES, TypicalMix, canonical_policy_name};
use replay::{MixView, RunResult};
use report::{PolicyRuns, Published};
use trace::Trace;
use variants::uses_mix;

const DEFAULT_NODES: &str = "../shared/traces/openb/openb_node_list_gpu_node.csv";
const DEFAULT_PODS: &str = "../shared/traces/openb/openb_pod_list_default.csv";
const PUBLISHED_FILE: &str = "fgd_published_unallocated.csv";
/// The trace whose `gpu_spec` sets `--restrict` draws from, by default (next to `--pods`).
const RESTRICT_SOURCE: &str = "openb_pod_list_gpuspec20.csv";
/// `--mix-window`'s default, in pods.
pub const DEFAULT_MIX_WINDOW: f64 = 5000.0;

/// Replay a GPU cluster trace through the placement policies and report allocation and fragmentation.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// Node list CSV (openb: sn,cpu_milli,memory_mib,gpu,model; or gpumem format with gpu_capacity).
    #[arg(long, default_value = DEFAULT_NODES)]
    pub nodes: PathBuf,
    /// Pod list CSV (openb: name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec]; or gpumem format).
    #[arg(long, default_value = DEFAULT_PODS)]
    pub pods: PathBuf,
    /// Policies to run (repeat or comma-separate): Random, DotProduct, GpuClustering, GpuPacking, BestFit,
    /// KubeDRA, FGD, gpumem; variants `gpumem:<spec>`, `KubeDRA:pct=<N>`. Default: all eight.
    #[arg(long = "policy", value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Number of seeds (runs per policy).
    #[arg(long, default_value_t = 10)]
    pub seeds: u64,
    /// First seed (the paper's runs use 42..=51).
    #[arg(long, default_value_t = 42)]
    pub seed_base: u64,
    /// Inflate the workload with sampled clones to this multiple of the cluster's GPU capacity.
    #[arg(long, default_value_t = 1.3)]
    pub inflate: f64,
    /// Typical task types: the most popular ones covering this fraction of all tasks.
    #[arg(long, default_value_t = 0.95)]
    pub typical: f64,
    /// Give FGD and gpumem the whole trace's typical mix in advance (the FGD paper's protocol) instead
    /// of the online view (only the pods arrived before each decision). Without it, the report also has
    /// an `<policy>/oracle` row for each of them.
    #[arg(long)]
    pub oracle_mix: bool,
    /// Online view: decay window of the learned mix, in pods (an arrival's weight falls by e every
    /// this many arrivals after it); 0 = no decay.
    #[arg(long, default_value_t = DEFAULT_MIX_WINDOW)]
    pub mix_window: f64,
    /// Online view: the policy is rebuilt when the learned mix moved by more than this (total
    /// variation distance, 0..1) from the one it was built from.
    #[arg(long, default_value_t = MixConfig::default().tolerance)]
    pub mix_tolerance: f64,
    /// The workload: `trace` replays `--nodes` and `--pods` as they are; `realistic` replays the mix of
    /// `gpumem-scale --mix realistic` (`sim::realistic`): a fleet of `--profiles` with zones and
    /// reserved nodes, and the GPU pods of `--pods` with its zone and model choices.
    #[arg(long, value_enum, default_value_t = realistic::Mix::Trace)]
    pub mix: realistic::Mix,
    /// `--mix realistic`: how many nodes.
    #[arg(long, default_value_t = 1000)]
    pub fleet_nodes: usize,
    /// `--mix realistic`: the node profiles and their share in percent.
    #[arg(long, default_value = realistic::DEFAULT_PROFILES)]
    pub profiles: String,
    /// Replay a GPU-model-restricted variant of the trace: this fraction (0..1) of the GPU pods ask
    /// for a GPU model, the sets drawn from `--restrict-from` (`sim::restrict`).
    #[arg(long)]
    pub restrict: Option<f64>,
    /// The trace whose `gpu_spec` sets `--restrict` draws from (default: openb's gpuspec20 trace
    /// next to `--pods`).
    #[arg(long)]
    pub restrict_from: Option<PathBuf>,
    /// Directory for summary.csv, curves.csv, runs.csv and unallocated.svg.
    #[arg(long, default_value = "simulate-out")]
    pub out: PathBuf,
    /// Published numbers to compare with (default: fgd_published_unallocated.csv next to --pods, if any).
    #[arg(long)]
    pub published: Option<PathBuf>,
    /// Break ties between equally scored nodes at random (upstream kube-scheduler) instead of by a
    /// per-seed node ranking (the paper's patched scheduler picks the smallest node name).
    #[arg(long)]
    pub random_ties: bool,
    /// Worker threads (default: available cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Time single placement decisions per policy instead of replaying.
    #[arg(long)]
    pub bench: bool,
    /// Decisions timed per policy with --bench.
    #[arg(long, default_value_t = 2000)]
    pub bench_decisions: usize,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Resolves the policy list (canonical names, in the standard order when defaulted). A gpumem variant
/// `gpumem:<spec>` (see [`variants::parse_tuning`]) or a KubeDRA variant `KubeDRA:<spec>` (see
/// [`variants::parse_kube_dra`]) is kept as written.
pub fn policy_list(requested: &[String]) -> Result<Vec<&'static str>> {
    if requested.is_empty() {
        return Ok(POLICY_NAMES.to_vec());
    }
    let mut out = Vec::new();
    for r in requested {
        let r = r.trim();
        if let Some(spec) = r.strip_prefix(variants::KUBE_DRA_PREFIX) {
            if variants::parse_kube_dra(spec).is_none() {
                bail!("bad KubeDRA variant {r:?} (one key: pct=<0..100>, percentageOfNodesToScore)");
            }
            let name: &'static str = Box::leak(r.to_string().into_boxed_str());
            if !out.contains(&name) {
                out.push(name);
            }
            continue;
        }
        if let Some(spec) = r.strip_prefix("gpumem:") {
            if variants::parse_tuning(spec).is_none() {
                bail!("bad gpumem variant {r:?} (keys: see `sim::variants::parse_tuning`)");
            }
            // A few bytes per distinct variant, for the life of the command.
            let name: &'static str = Box::leak(r.to_string().into_boxed_str());
            if !out.contains(&name) {
                out.push(name);
            }
            continue;
        }
        let Some(p) = canonical_policy_name(r) else {
            bail!("unknown policy {r:?}; known: {}", POLICY_NAMES.join(", "));
        };
        if !out.contains(&p) {
            out.push(p);
        }
    }
    Ok(out)
}

/// One row of the report: a policy and what it knows of the workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Variant {
    /// The row's name: the policy's, with `/oracle` appended for an oracle row next to online ones.
    pub label: &'static str,
    pub policy: &'static str,
    pub view: MixView,
}

/// The rows for `policies`. With an online `view`, each policy that reads the mix is followed by its
/// `/oracle` row (the same policy given the whole-trace mix).
pub fn variants(policies: &[&'static str], view: MixView) -> Vec<Variant> {
    let mut out = Vec::new();
    for &policy in policies {
        out.push(Variant {
            label: policy,
            policy,
            view,
        });
        if view != MixView::Oracle && uses_mix(policy) {
            // A few bytes per policy, for the life of the command.
            let label: &'static str = Box::leak(format!("{policy}/oracle").into_boxed_str());
            out.push(Variant {
                label,
                policy,
                view: MixView::Oracle,
            });
        }
    }
    out
}

/// Runs every (variant, seed) pair on `threads` threads; results grouped by variant in `variants`
/// order. `mix` is the whole-trace mix (the oracle view's, and the fragmentation metric's).
#[allow(clippy::too_many_arguments)]
pub fn run_all(
    trace: &Trace,
    variants: &[Variant],
    seeds: &[u64],
    inflate: f64,
    mix: &TypicalMix,
    random_ties: bool,
    threads: usize,
    progress: &indicatif::ProgressBar,
) -> Result<Vec<PolicyRuns>> {
    let jobs: Vec<(&Variant, u64)> = variants
        .iter()
        .flat_map(|v| seeds.iter().map(move |s| (v, *s)))
        .collect();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<RunResult>>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1).min(jobs.len().max(1)) {
            scope.spawn(|| {
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(v, seed)) = jobs.get(j) else { break };
                    let r =
                        replay::replay_with(trace, v.policy, seed, inflate, mix, v.view, random_ties, |n| {
                            progress.inc(n)
                        });
                    if let Ok(r) = &r {
                        tracing::debug!(
                            variant = v.label,
                            seed,
                            seconds = r.seconds,
                            builds = r.builds,
                            "run finished"
                        );
                    }
                    if let Ok(mut guard) = results.lock() {
                        guard[j] = Some(r);
                    }
                }
            });
        }
    });
    let results = results
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a worker thread panicked"))?;
    let mut grouped: Vec<PolicyRuns> = variants
        .iter()
        .map(|v| PolicyRuns {
            policy: v.label,
            // The paper's numbers are for its protocol: the whole-trace mix (the other policies do not
            // read it).
            paper: (v.view == MixView::Oracle || !uses_mix(v.policy)).then_some(v.policy),
            runs: Vec::new(),
        })
        .collect();
    for (j, r) in results.into_iter().enumerate() {
        let r = r.ok_or_else(|| anyhow::anyhow!("job {j} did not run"))??;
        let (v, _) = jobs[j];
        if let Some(g) = grouped.iter_mut().find(|g| g.policy == v.label) {
            g.runs.push(r);
        }
    }
    Ok(grouped)
}

/// Per seed, the bound on the unallocated GPU % at 100% arrived ([`bound::unallocated_bound`] of the
/// seed's pods up to 100% of capacity).
fn bound_per_seed(trace: &Trace, seeds: &[u64], inflate: f64) -> Result<Vec<(u64, f64)>> {
    let capacity = trace.cluster.gpu_capacity_total();
    seeds
        .iter()
        .map(|&seed| {
            let mut arrived = 0u64;
            let pods: Vec<_> = replay::workload(trace, seed, inflate)
                .into_iter()
                .take_while(|p| {
                    arrived += trace.units(p);
                    arrived <= capacity
                })
                .collect();
            let b = bound::unallocated_bound(&trace.cluster, &pods)
                .with_context(|| format!("the bound of seed {seed}"))?;
            Ok((seed, b))
        })
        .collect()
}

fn find_published(args: &SimulateArgs) -> Option<PathBuf> {
    if let Some(p) = &args.published {
        return Some(p.clone());
    }
    let candidate = args.pods.parent().unwrap_or(Path::new(".")).join(PUBLISHED_FILE);
    candidate.is_file().then_some(candidate)
}

fn progress_bar(total: u64, quiet: bool) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(total);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{elapsed_precise} [{bar:40}] {percent}% pods placed, eta {eta}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// `gpumem simulate`.
pub fn run(args: &SimulateArgs) -> Result<()> {
    if !(args.inflate.is_finite() && args.inflate >= 0.0 && args.inflate <= 10.0) {
        bail!("--inflate must be between 0 and 10, got {}", args.inflate);
    }
    if !(args.typical > 0.0 && args.typical <= 1.0) {
        bail!("--typical must be in (0, 1], got {}", args.typical);
    }
    if !(args.mix_window.is_finite() && args.mix_window >= 0.0) {
        bail!(
            "--mix-window must be a number of pods (0: no decay), got {}",
            args.mix_window
        );
    }
    if !(0.0..=1.0).contains(&args.mix_tolerance) {
        bail!("--mix-tolerance must be in 0..1, got {}", args.mix_tolerance);
    }
    let policies = policy_list(&args.policies)?;
    let view = if args.oracle_mix {
        MixView::Oracle
    } else {
        MixView::Online(MixConfig {
            threshold: args.typical,
            window: if args.mix_window > 0.0 {
                args.mix_window
            } else {
                f64::INFINITY
            },
            // No prior in a replay: the policy knows nothing before the first pod.
            min_pods: 0,
            tolerance: args.mix_tolerance,
            ..MixConfig::default()
        })
    };
    let variants = variants(&policies, view);
    let mut trace = match args.mix {
        realistic::Mix::Trace => Trace::load(&args.nodes, &args.pods)?,
        realistic::Mix::Realistic => {
            let t = realistic::trace(&args.pods, &args.profiles, args.fleet_nodes, args.seed_base)?;
            tracing::info!(
                trace = %t.name,
                nodes = t.cluster.nodes.len(),
                gpus = t.cluster.gpu_count(),
                pods = t.pods.len(),
                "realistic mix"
            );
            t
        }
    };
    if let Some(fraction) = args.restrict {
        let from = args
            .restrict_from
            .clone()
            .unwrap_or_else(|| args.pods.parent().unwrap_or(Path::new(".")).join(RESTRICT_SOURCE));
        let sets = restrict::source_sets(&from, &trace.cluster)?;
        trace = restrict::restrict(&trace, fraction, &sets, args.seed_base)?;
    }
    let mix = TypicalMix::from_requests(&trace.pods, args.typical);
    tracing::info!(
        types = mix.types.len(),
        threshold = args.typical,
        "typical task mix"
    );
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));

    if args.bench {
        let rows = bench::run(&trace, &policies, &mix, args.bench_decisions, args.seed_base)?;
        print!("{}", bench::table(&trace, &rows));
        return Ok(());
    }
    if args.seeds == 0 {
        bail!("--seeds must be at least 1");
    }
    let seeds: Vec<u64> = (args.seed_base..args.seed_base + args.seeds).collect();
    let per_run = replay::workload(&trace, args.seed_base, args.inflate).len() as u64;
    let pb = progress_bar(per_run * seeds.len() as u64 * variants.len() as u64, args.quiet);
    let start = Instant::now();
    let all = run_all(
        &trace,
        &variants,
        &seeds,
        args.inflate,
        &mix,
        args.random_ties,
        threads,
        &pb,
    )?;
    pb.finish_and_clear();
    let elapsed = start.elapsed().as_secs_f64();

    let published: Published = match find_published(args) {
        Some(p) => report::load_published(&p, &trace.name)?,
        None => Published::new(),
    };
    print!("{}", report::table(&trace.name, &all, &published));
    let bounds = bound_per_seed(&trace, &seeds, args.inflate)?;
    if let Some(b) = report::Stat::of(&bounds.iter().map(|b| b.1).collect::<Vec<_>>()) {
        println!(
            "\nBound: no placement of the pods arrived by 100% leaves less than {:.2} ± {:.2} % of the GPU \
             capacity unallocated (LP relaxation with every pod known in advance, sim::bound)",
            b.mean, b.sd
        );
    }
    let cpu_seconds: f64 = all.iter().flat_map(|p| p.runs.iter().map(|r| r.seconds)).sum();
    let mix_note = match view {
        MixView::Oracle => "the whole-trace typical mix (--oracle-mix)".to_string(),
        MixView::Online(c) => format!(
            "FGD and gpumem learn the mix online (window {} pods, tolerance {}); /oracle rows know the whole trace's",
            if c.window.is_finite() {
                format!("{}", c.window)
            } else {
                "none".to_string()
            },
            c.tolerance
        ),
    };
    println!(
        "\n{} runs ({} rows x {} seeds, {} pods each) in {elapsed:.1} s wall, {cpu_seconds:.1} s of runs, {threads} threads; {mix_note}",
        all.iter().map(|p| p.runs.len()).sum::<usize>(),
        variants.len(),
        seeds.len(),
        per_run,
    );
    let w = all.iter().map(|p| p.policy.len() + 1).max().unwrap_or(0).max(14);
    for p in &all {
        let n = p.runs.len().max(1) as f64;
        let secs: f64 = p.runs.iter().map(|r| r.seconds).sum::<f64>() / n;
        let builds: f64 = p.runs.iter().map(|r| r.builds as f64).sum::<f64>() / n;
        let build_secs: f64 = p.runs.iter().map(|r| r.build_seconds).sum::<f64>() / n;
        if builds > 1.0 {
            println!(
                "  {:<w$}{secs:>8.2} s per run ({builds:.0} policy builds, {build_secs:.2} s)",
                p.policy
            );
        } else {
            println!("  {:<w$}{secs:>8.2} s per run", p.policy);
        }
    }

    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    let max_pct = (args.inflate.max(1.0) * 100.0).round() as usize;
    report::write_summary(&args.out.join("summary.csv"), &trace.name, &all, &published)?;
    report::write_curves(&args.out.join("curves.csv"), &trace.name, &all, max_pct)?;
    report::write_runs(&args.out.join("runs.csv"), &trace.name, &all)?;
    report::write_classes(&args.out.join("classes.csv"), &trace.name, &all)?;
    report::write_restricted(&args.out.join("restricted.csv"), &trace.name, &all)?;
    report::write_bounds(&args.out.join("bound.csv"), &trace.name, &bounds)?;
    report::write_chart(&args.out.join("unallocated.svg"), &trace.name, &all, max_pct)?;
    println!(
        "wrote {}/{{summary.csv,curves.csv,runs.csv,classes.csv,restricted.csv,bound.csv,unallocated.svg}}",
        args.out.display()
    );
    Ok(())
}
