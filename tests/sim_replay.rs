//! End-to-end checks of `gpumem simulate` on small synthetic traces (never the Alibaba trace itself).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use gpumem::alloc::{self, POLICY_NAMES, TieBreak, TypicalMix};
use gpumem::sim::replay;
use gpumem::sim::trace::Trace;
use rand::SeedableRng;

/// A small openb-format cluster: 2-, 4- and 8-GPU nodes of two models, and a pod mix of shared,
/// whole-GPU, multi-GPU and CPU-only pods (some restricted to one model).
fn synthetic(dir: &Path) -> (PathBuf, PathBuf) {
    let mut nodes = String::from("sn,cpu_milli,memory_mib,gpu,model\n");
    for i in 0..12 {
        let (gpus, cpu, model) = match i % 3 {
            0 => (2, 16_000, "P100"),
            1 => (4, 48_000, "T4"),
            _ => (8, 96_000, "G2"),
        };
        let _ = writeln!(nodes, "node-{i:02},{cpu},262144,{gpus},{model}");
    }
    let mut pods = String::from("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n");
    let shapes = [
        (4000, 8192, 1, 500, ""),
        (3000, 4096, 1, 250, ""),
        (8000, 16384, 1, 1000, ""),
        (2000, 4096, 1, 810, "T4"),
        (16_000, 65536, 2, 1000, ""),
        (32_000, 131072, 8, 1000, "G2"),
        (6000, 8192, 0, 0, ""),
        (4000, 8192, 1, 330, "P100|T4"),
    ];
    for i in 0..60 {
        let (cpu, mem, n, milli, spec) = shapes[i % shapes.len()];
        let _ = writeln!(pods, "pod-{i:03},{cpu},{mem},{n},{milli},{spec}");
    }
    let (n, p) = (dir.join("nodes.csv"), dir.join("openb_pod_list_synthetic.csv"));
    std::fs::write(&n, nodes).expect("write nodes");
    std::fs::write(&p, pods).expect("write pods");
    (n, p)
}

#[test]
fn every_policy_respects_capacity_and_the_protocol() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, pods) = synthetic(dir.path());
    let trace = Trace::load(&nodes, &pods).expect("load");
    assert_eq!(trace.name, "synthetic");
    let mix = TypicalMix::from_requests(&trace.pods, 0.95);
    let capacity = trace.cluster.gpu_capacity_total();
    let inflate = 1.3;
    for seed in [1u64, 2] {
        let (pods_seq, ranks) = replay::workload_and_ranks(&trace, seed, inflate);
        let arrived: u64 = pods_seq.iter().map(|p| trace.units(p)).sum();
        let target = inflate * capacity as f64;
        let largest = trace.pods.iter().map(|p| trace.units(p)).max().unwrap_or(0) as f64;
        assert!(
            arrived as f64 <= target && arrived as f64 > target - largest,
            "arrived {arrived} vs {target}"
        );
        for name in POLICY_NAMES {
            let mut cluster = trace.cluster.clone();
            let mut policy = alloc::build_policy(name, &cluster, &mix).expect("known policy");
            let mut rng = rand_pcg::Pcg64Mcg::seed_from_u64(seed);
            let mut out = Vec::new();
            let mut allocated = 0u64;
            for req in &pods_seq {
                let placed = alloc::place(
                    policy.as_mut(),
                    &mut cluster,
                    req,
                    TieBreak::Rank(&ranks),
                    &mut rng,
                    &mut out,
                )
                .expect("the chosen placement is valid");
                if let Some(c) = placed {
                    let node = &cluster.nodes[c.node as usize];
                    assert!(
                        req.models
                            .is_none_or(|m| req.gpu == alloc::GpuDemand::None || m.contains(node.model))
                    );
                    allocated += match req.gpu {
                        alloc::GpuDemand::Shared { amount } => u64::from(amount),
                        _ => c.gpus.iter().map(|g| u64::from(node.gpus[g].capacity)).sum(),
                    };
                } else {
                    assert!(
                        !cluster.nodes.iter().any(|n| n.fits(req)),
                        "{name} failed a pod that fits"
                    );
                }
                for n in &cluster.nodes {
                    assert!(n.cpu_free <= n.cpu_capacity && n.memory_free <= n.memory_capacity);
                    assert!(n.gpus.iter().all(|g| g.free <= g.capacity));
                }
                assert_eq!(
                    allocated,
                    capacity - cluster.gpu_free_total(),
                    "{name}: allocation bookkeeping"
                );
            }
            assert!(allocated <= capacity);
        }
    }
}

#[test]
fn curves_are_monotone_and_runs_are_reproducible() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, pods) = synthetic(dir.path());
    let trace = Trace::load(&nodes, &pods).expect("load");
    let mix = TypicalMix::from_requests(&trace.pods, 0.95);
    for name in POLICY_NAMES {
        let r = replay::replay(&trace, name, 7, 1.3, &mix, false, |_| {}).expect("replay");
        assert!(r.allocated <= r.capacity);
        assert!(
            r.arrived_pct <= 130.0 + 1e-9 && r.arrived_pct > 100.0,
            "{name}: {}",
            r.arrived_pct
        );
        // Pods never leave: the unallocated share can only fall as work arrives.
        let points: Vec<f64> = (0..=130)
            .filter_map(|p| r.curve.at(p))
            .map(|(u, _, _)| u)
            .collect();
        assert!(points.len() > 10);
        assert!(
            points.windows(2).all(|w| w[1] <= w[0] + 1e-9),
            "{name}: {points:?}"
        );
        for p in 0..=130 {
            if let Some((u, f, rate)) = r.curve.at(p) {
                assert!(
                    (0.0..=100.0).contains(&u)
                        && f >= -1e-9
                        && f <= u + 1e-9
                        && (0.0..=100.0 + 1e-9).contains(&rate)
                );
            }
        }
        let again = replay::replay(&trace, name, 7, 1.3, &mix, false, |_| {}).expect("replay");
        assert_eq!(
            (r.failed, r.allocated),
            (again.failed, again.allocated),
            "{name} is not reproducible"
        );
    }
}

#[test]
fn simulate_writes_table_csvs_and_chart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, pods) = synthetic(dir.path());
    let out = dir.path().join("out");
    let args = gpumem::sim::SimulateArgs {
        nodes,
        pods,
        policies: vec!["BestFit".into(), "fgd".into(), "gpumem".into()],
        seeds: 2,
        seed_base: 42,
        inflate: 1.3,
        typical: 0.95,
        oracle_mix: false,
        mix_window: 5000.0,
        mix_tolerance: 0.02,
        mix: gpumem::sim::realistic::Mix::Trace,
        fleet_nodes: 1000,
        profiles: gpumem::sim::realistic::DEFAULT_PROFILES.into(),
        restrict: None,
        restrict_from: None,
        out: out.clone(),
        published: None,
        random_ties: false,
        threads: Some(2),
        bench: false,
        bench_decisions: 10,
        quiet: true,
    };
    gpumem::sim::run(&args).expect("simulate");
    let summary = std::fs::read_to_string(out.join("summary.csv")).expect("summary");
    assert!(summary.starts_with("trace,policy,arrived_pct,unallocated_gpu_pct_mean"));
    assert!(summary.contains("synthetic,FGD,") && summary.contains("synthetic,gpumem,"));
    // The online view by default, each mix-reading policy next to its oracle row; BestFit reads no mix.
    assert!(summary.contains("synthetic,FGD/oracle,") && summary.contains("synthetic,gpumem/oracle,"));
    assert!(!summary.contains("BestFit/oracle"));
    let runs = std::fs::read_to_string(out.join("runs.csv")).expect("runs");
    assert_eq!(runs.lines().count(), 1 + 5 * 2, "5 rows x 2 seeds: {runs}");
    assert!(runs.contains("synthetic,gpumem/oracle,43,"));
    let bound = std::fs::read_to_string(out.join("bound.csv")).expect("bound");
    let values: Vec<f64> = bound
        .lines()
        .skip(1)
        .map(|l| {
            l.rsplit(',')
                .next()
                .and_then(|v| v.parse().ok())
                .expect("a number")
        })
        .collect();
    assert_eq!(values.len(), 2, "one bound per seed: {bound}");
    let gpumem_at_100: Vec<f64> = runs
        .lines()
        .filter(|l| l.contains(",gpumem,"))
        .map(|l| l.split(',').nth(3).and_then(|v| v.parse().ok()).unwrap_or(100.0))
        .collect();
    for (b, g) in values.iter().zip(&gpumem_at_100) {
        assert!(
            (0.0..=*g + 1e-9).contains(b),
            "the bound {b} is above what gpumem reached, {g}"
        );
    }
    let classes = std::fs::read_to_string(out.join("classes.csv")).expect("classes");
    // Per run: 2 points x 3 classes x restricted or not.
    assert_eq!(classes.lines().count(), 1 + 5 * 2 * 2 * 3 * 2, "{classes}");
    assert!(
        classes.contains("synthetic,gpumem,42,100,shared,true,"),
        "{classes}"
    );
    // The restricted pods per model set they name, summing to the restricted rows of classes.csv.
    let restricted = std::fs::read_to_string(out.join("restricted.csv")).expect("restricted");
    assert!(restricted.starts_with("trace,policy,seed,point,models,arrived,placed\n"));
    for set in ["T4", "P100|T4", "G2"] {
        assert!(
            restricted.contains(&format!("synthetic,gpumem,42,end,{set},")),
            "{restricted}"
        );
    }
    let sum = |csv: &str, prefix: &str, restricted_col: Option<usize>| -> (u32, u32) {
        csv.lines()
            .filter(|l| l.starts_with(prefix))
            .map(|l| l.split(',').collect::<Vec<_>>())
            .filter(|c| restricted_col.is_none_or(|i| c[i] == "true"))
            .fold((0, 0), |(a, p), c| {
                let n = c.len();
                let num = |v: &str| v.parse::<u32>().expect("a count");
                (a + num(c[n - 2]), p + num(c[n - 1]))
            })
    };
    for point in ["100", "end"] {
        let prefix = format!("synthetic,gpumem,42,{point},");
        let by_set = sum(&restricted, &prefix, None);
        assert!(by_set.0 > 0, "{restricted}");
        assert_eq!(by_set, sum(&classes, &prefix, Some(5)), "{restricted}\n{classes}");
    }
    let curves = std::fs::read_to_string(out.join("curves.csv")).expect("curves");
    assert!(curves.lines().count() > 100);
    let svg = std::fs::read_to_string(out.join("unallocated.svg")).expect("chart");
    assert!(svg.contains("<svg") && svg.contains("gpumem"));

    let oracle_out = dir.path().join("oracle");
    let oracle = gpumem::sim::SimulateArgs {
        oracle_mix: true,
        out: oracle_out.clone(),
        ..args.clone()
    };
    gpumem::sim::run(&oracle).expect("simulate --oracle-mix");
    let summary = std::fs::read_to_string(oracle_out.join("summary.csv")).expect("summary");
    assert!(summary.contains("synthetic,gpumem,") && !summary.contains("/oracle"));

    let bench = gpumem::sim::SimulateArgs { bench: true, ..args };
    gpumem::sim::run(&bench).expect("bench");
}

#[test]
fn malformed_rows_name_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, _) = synthetic(dir.path());
    let bad = dir.path().join("bad.csv");
    std::fs::write(
        &bad,
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,10,1,500\np1,lots,10,1,500\n",
    )
    .expect("write");
    let err = Trace::load(&nodes, &bad).expect_err("bad cpu").to_string();
    assert!(err.contains("bad.csv:3") && err.contains("cpu_milli"), "{err}");

    std::fs::write(
        &bad,
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,10,2,500\n",
    )
    .expect("write");
    let err = Trace::load(&nodes, &bad).expect_err("2 shared GPUs").to_string();
    assert!(err.contains("bad.csv:2"), "{err}");

    std::fs::write(
        &bad,
        "name,cpu_milli,memory_mib,num_gpu,gpu_mem\np0,1000,10,1,5000\n",
    )
    .expect("write");
    let err = Trace::load(&nodes, &bad).expect_err("both resources").to_string();
    assert!(err.contains("at once"), "{err}");

    let missing = dir.path().join("missing.csv");
    let err = Trace::load(&missing, &bad).expect_err("missing").to_string();
    assert!(err.contains("missing.csv"), "{err}");
}

#[test]
fn gpumem_format_with_mixed_capacities() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nodes = dir.path().join("nodes.csv");
    let pods = dir.path().join("pods.csv");
    std::fs::write(&nodes, "name,cpu_milli,memory_mib,gpu,model,gpu_capacity\nt4,64000,256000,4,T4,15360\na100,64000,256000,2,A100,81920\n")
        .expect("write");
    let mut p = String::from("name,cpu_milli,memory_mib,num_gpu,gpu_mem,gpu_spec\n");
    for i in 0..20 {
        let (n, mem) = if i % 4 == 0 {
            (1, 0)
        } else {
            (0, 5000 + 1000 * (i % 7))
        };
        let _ = writeln!(p, "p{i},2000,4096,{n},{mem},");
    }
    std::fs::write(&pods, p).expect("write");
    let trace = Trace::load(&nodes, &pods).expect("load");
    assert_eq!(trace.cluster.nodes[1].gpus[0].capacity, 81_920);
    let mix = TypicalMix::from_requests(&trace.pods, 1.0);
    let r = replay::replay(&trace, "gpumem", 1, 1.3, &mix, false, |_| {}).expect("replay");
    assert!(r.allocated <= r.capacity && r.allocated > 0);
}

#[test]
fn openb_trace_loads_when_present() {
    let nodes = Path::new("../shared/traces/openb/openb_node_list_gpu_node.csv");
    let pods = Path::new("../shared/traces/openb/openb_pod_list_default.csv");
    if !nodes.is_file() || !pods.is_file() {
        return;
    }
    let trace = Trace::load(nodes, pods).expect("load openb");
    assert_eq!(trace.cluster.nodes.len(), 1213);
    assert_eq!(trace.cluster.gpu_count(), 6212);
    assert_eq!(trace.pods.len(), 8152);
}

#[test]
fn gpumem_with_its_knobs_off_replays_exactly_like_fgd() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, pods) = synthetic(dir.path());
    let trace = Trace::load(&nodes, &pods).expect("load");
    let mix = TypicalMix::from_requests(&trace.pods, 0.95);
    for seed in [3u64, 4] {
        let fgd = replay::replay(&trace, "FGD", seed, 1.3, &mix, false, |_| {}).expect("replay");
        let off =
            replay::replay(&trace, "gpumem:ft=0:rv=0:sc=0", seed, 1.3, &mix, false, |_| {}).expect("replay");
        assert_eq!((fgd.failed, fgd.allocated), (off.failed, off.allocated));
        for p in 0..=130 {
            assert_eq!(fgd.curve.at(p), off.curve.at(p), "seed {seed} at {p}%");
        }
    }
}

#[test]
fn policy_list_takes_gpumem_variants_and_refuses_bad_ones() {
    use gpumem::sim::policy_list;
    let ok = policy_list(&["fgd".into(), "gpumem:rv=0:sc=5".into(), "gpumem".into()]).expect("valid");
    assert_eq!(ok, vec!["FGD", "gpumem:rv=0:sc=5", "gpumem"]);
    assert!(policy_list(&["gpumem:nope=1".into()]).is_err());
    assert!(policy_list(&["Tetris".into()]).is_err());
    let ok = policy_list(&["kubedra".into(), "KubeDRA:pct=100".into()]).expect("valid");
    assert_eq!(ok, vec!["KubeDRA", "KubeDRA:pct=100"]);
    assert!(policy_list(&["KubeDRA:pct=150".into()]).is_err());
}

#[test]
fn kube_dra_breaks_its_own_ties_and_scores_a_subset_only_on_large_clusters() {
    // kube-scheduler's tie-breaking is part of the model: the simulator's rank or random tie-breaking
    // must not change a KubeDRA replay.
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, pods) = synthetic(dir.path());
    let trace = Trace::load(&nodes, &pods).expect("load");
    let mix = TypicalMix::from_requests(&trace.pods, 0.95);
    for seed in [1u64, 2] {
        let ranked = replay::replay(&trace, "KubeDRA", seed, 1.3, &mix, false, |_| {}).expect("replay");
        let random = replay::replay(&trace, "KubeDRA", seed, 1.3, &mix, true, |_| {}).expect("replay");
        assert_eq!(
            (ranked.failed, ranked.allocated),
            (random.failed, random.allocated)
        );
        for p in 0..=130 {
            assert_eq!(ranked.curve.at(p), random.curve.at(p), "seed {seed} at {p}%");
        }
        // Under 100 nodes kube-scheduler filters and scores them all: pct=100 is the same policy.
        let all = replay::replay(&trace, "KubeDRA:pct=100", seed, 1.3, &mix, false, |_| {}).expect("replay");
        for p in 0..=130 {
            assert_eq!(ranked.curve.at(p), all.curve.at(p), "seed {seed} at {p}%");
        }
    }
}

fn online() -> replay::MixView {
    replay::MixView::Online(alloc::MixConfig {
        min_pods: 0,
        ..alloc::MixConfig::default()
    })
}

#[test]
fn the_online_view_knows_no_pod_before_it_arrives() {
    // Two workloads with the same first pods and different later ones: with the online view, every
    // decision on the common prefix is the same (under the oracle view, the later pods would change
    // the mix the first decisions are made with).
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, pods) = synthetic(dir.path());
    let trace = Trace::load(&nodes, &pods).expect("load");
    let mix = TypicalMix::from_requests(&trace.pods, 0.95);
    let (seq, ranks) = replay::workload_and_ranks(&trace, 5, 1.3);
    let k = seq.len() / 2;
    let mut other = seq[..k].to_vec();
    // The rest: only the rarest shape of the trace, the 8-GPU pods.
    let big = *trace
        .pods
        .iter()
        .find(|p| p.gpu == alloc::GpuDemand::Whole { count: 8 })
        .expect("an 8-GPU pod");
    other.extend(std::iter::repeat_n(big, seq.len() - k));
    let arrived: u64 = seq[..k].iter().map(|p| trace.units(p)).sum();
    let prefix_pct = arrived as f64 / trace.cluster.gpu_capacity_total() as f64 * 100.0;
    let common = prefix_pct.round() as usize; // buckets below this one hold prefix arrivals only
    assert!(common > 20, "{common}");
    for name in ["FGD", "gpumem"] {
        let run = |pods: &[alloc::Request]| {
            replay::replay_sequence(&trace, name, 5, pods, &ranks, 1.3, &mix, online(), false, |_| {})
                .expect("replay")
        };
        let (a, b) = (run(&seq), run(&other));
        assert!(a.builds > 1, "{name}: the policy never learned");
        assert_eq!(a.curve.count[..common], b.curve.count[..common], "{name}");
        assert_eq!(a.curve.unalloc[..common], b.curve.unalloc[..common], "{name}");
        assert_eq!(a.curve.frag[..common], b.curve.frag[..common], "{name}");
        assert_ne!(
            a.curve.count, b.curve.count,
            "{name}: the workloads differ after the prefix"
        );
    }
}

#[test]
fn the_online_view_changes_only_the_policies_that_read_the_mix() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (nodes, pods) = synthetic(dir.path());
    let trace = Trace::load(&nodes, &pods).expect("load");
    let mix = TypicalMix::from_requests(&trace.pods, 0.95);
    let with = |name: &str, view| {
        replay::replay_with(&trace, name, 3, 1.3, &mix, view, false, |_| {}).expect("replay")
    };
    let (on, off) = (
        with("BestFit", online()),
        with("BestFit", replay::MixView::Oracle),
    );
    assert_eq!((on.builds, off.builds), (1, 1));
    assert_eq!((on.failed, on.allocated), (off.failed, off.allocated));
    // gpumem with its knobs off is FGD, online too: both are rebuilt at the same arrivals.
    let (fgd, off) = (with("FGD", online()), with("gpumem:ft=0:rv=0:sc=0", online()));
    assert!(fgd.builds > 1 && fgd.builds == off.builds);
    for p in 0..=130 {
        assert_eq!(fgd.curve.at(p), off.curve.at(p), "at {p}%");
    }
    let again = with("gpumem", online());
    let once = with("gpumem", online());
    assert_eq!(
        (again.failed, again.allocated, again.builds),
        (once.failed, once.allocated, once.builds),
        "online replays are reproducible"
    );
}
