//! Aggregation over seeds and the outputs: the table, the CSVs and the chart.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};

use super::replay::{Classes, Placed, PodClass, RunResult, SetPlaced};
use crate::alloc::{ModelSet, canonical_policy_name};

/// Arrived-workload points of the table (% of GPU capacity).
pub const TABLE_PCTS: [usize; 7] = [90, 95, 100, 105, 110, 120, 130];

/// Mean and sample standard deviation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub sd: f64,
    pub n: usize,
}

impl Stat {
    pub fn of(values: &[f64]) -> Option<Stat> {
        let n = values.len();
        if n == 0 {
            return None;
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        let var = if n > 1 {
            values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64
        } else {
            0.0
        };
        Some(Stat {
            mean,
            sd: var.sqrt(),
            n,
        })
    }
}

/// Which metric of a curve point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    Unallocated,
    Frag,
    FragRate,
}

/// All runs of one policy.
#[derive(Debug, Clone)]
pub struct PolicyRuns {
    /// The row's name.
    pub policy: &'static str,
    /// The policy whose published numbers this row compares with, if any (none for a row whose view
    /// of the workload is not the paper's).
    pub paper: Option<&'static str>,
    pub runs: Vec<RunResult>,
}

impl PolicyRuns {
    /// Mean ± sd over seeds of `metric` at `pct` arrived.
    pub fn at(&self, pct: usize, metric: Metric) -> Option<Stat> {
        let vals: Vec<f64> = self
            .runs
            .iter()
            .filter_map(|r| r.curve.at(pct))
            .map(|(u, f, fr)| match metric {
                Metric::Unallocated => u,
                Metric::Frag => f,
                Metric::FragRate => fr,
            })
            .collect();
        Stat::of(&vals)
    }

    /// Mean ± sd over seeds of the placed % of the pods `pick` selects from each run's classes
    /// (`at_end`: the whole run; otherwise up to 100% arrived). `None` when no run had such pods.
    pub fn placed(&self, at_end: bool, pick: impl Fn(&Classes) -> Placed) -> Option<Stat> {
        let vals: Vec<f64> = self
            .runs
            .iter()
            .filter_map(|r| pick(if at_end { &r.classes } else { &r.classes_at_100 }).pct())
            .collect();
        Stat::of(&vals)
    }

    /// Mean ± sd over seeds of the placed % of the restricted GPU pods that name `models` (`at_end`: the
    /// whole run; otherwise up to 100% arrived). `None` when no run had such pods.
    pub fn placed_naming(&self, at_end: bool, models: ModelSet) -> Option<Stat> {
        let vals: Vec<f64> = self
            .runs
            .iter()
            .filter_map(|r| {
                let sets = if at_end {
                    &r.restricted
                } else {
                    &r.restricted_at_100
                };
                sets.iter().find(|s| s.models == models)?.placed.pct()
            })
            .collect();
        Stat::of(&vals)
    }

    pub fn failed(&self) -> Option<Stat> {
        Stat::of(&self.runs.iter().map(|r| r.failed as f64).collect::<Vec<_>>())
    }
}

/// Published unallocated GPU % (mean, sd) by (policy, arrived %), for one trace.
pub type Published = HashMap<(&'static str, usize), (f64, f64)>;

/// Reads `fgd_published_unallocated.csv` (`trace,policy,arrived_pct,unallocated_gpu_pct_mean,..._sd,seeds`).
pub fn load_published(path: &Path, trace: &str) -> Result<Published> {
    let mut rdr = csv::Reader::from_path(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Published::new();
    for rec in rdr.records() {
        let rec = rec.with_context(|| format!("{}: malformed CSV", path.display()))?;
        let line = rec.position().map_or(0, |p| p.line());
        let get = |i: usize| rec.get(i).map(str::trim).unwrap_or("");
        if get(0) != trace {
            continue;
        }
        let Some(policy) = canonical_policy_name(get(1)) else {
            continue;
        };
        let bad = || anyhow::anyhow!("{}:{line}: malformed number", path.display());
        let pct: usize = get(2).parse().map_err(|_| bad())?;
        let mean: f64 = get(3).parse().map_err(|_| bad())?;
        let sd: f64 = get(4).parse().unwrap_or(0.0);
        out.insert((policy, pct), (mean, sd));
    }
    Ok(out)
}

fn cell(s: Option<Stat>) -> String {
    s.map_or_else(|| "-".to_string(), |s| format!("{:.2} ± {:.2}", s.mean, s.sd))
}

/// The human table: unallocated GPU % and fragmentation % at each arrived point, mean ± sd over seeds,
/// with the published value at 100% when known.
pub fn table(trace: &str, all: &[PolicyRuns], published: &Published) -> String {
    let mut s = String::new();
    let seeds = all.iter().map(|p| p.runs.len()).max().unwrap_or(0);
    // Wide enough for the longest row name (variants such as `KubeDRA:pct=100`).
    let w = all.iter().map(|p| p.policy.len() + 1).max().unwrap_or(0).max(14);
    for (title, metric) in [
        (
            "Unallocated GPU % (100 - allocated / capacity)",
            Metric::Unallocated,
        ),
        (
            "Fragmentation (% of GPU capacity idle but unusable by the typical mix)",
            Metric::Frag,
        ),
    ] {
        let _ = writeln!(
            s,
            "\n{title}, trace {trace}, mean ± sd over {seeds} seeds, by arrived workload:"
        );
        let _ = write!(s, "{:<w$}", "policy");
        for p in TABLE_PCTS {
            let _ = write!(s, "{:>15}", format!("{p}%"));
        }
        if metric == Metric::Unallocated {
            let _ = write!(s, "{:>12}{:>9}", "paper@100", "diff");
        }
        let _ = writeln!(s);
        for p in all {
            let _ = write!(s, "{:<w$}", p.policy);
            for pct in TABLE_PCTS {
                let _ = write!(s, "{:>15}", cell(p.at(pct, metric)));
            }
            if metric == Metric::Unallocated {
                let paper = p.paper.and_then(|name| published.get(&(name, 100)));
                match (paper, p.at(100, metric)) {
                    (Some((m, _)), Some(ours)) => {
                        let _ = write!(s, "{m:>12.2}{:>+9.2}", ours.mean - m);
                    }
                    _ => {
                        let _ = write!(s, "{:>12}{:>9}", "-", "");
                    }
                }
            }
            let _ = writeln!(s);
        }
    }
    for (at_end, when) in [(false, "until 100% arrived"), (true, "until the end")] {
        let _ = writeln!(
            s,
            "\nGPU pods placed, % of those arrived {when} (mean ± sd; restricted: pods that name a GPU model):"
        );
        let _ = write!(s, "{:<w$}", "policy");
        let columns = class_columns();
        for (name, _) in &columns {
            let _ = write!(s, "{name:>15}");
        }
        let _ = writeln!(s);
        for p in all {
            let _ = write!(s, "{:<w$}", p.policy);
            for (_, pick) in &columns {
                let _ = write!(s, "{:>15}", cell(p.placed(at_end, pick)));
            }
            let _ = writeln!(s);
        }
    }
    let sets = named_sets(all);
    if !sets.is_empty() {
        let _ = writeln!(
            s,
            "\nRestricted pods placed by the models they name, % of those arrived until 100% arrived (mean ± sd):"
        );
        let _ = write!(s, "{:<w$}", "policy");
        let widths: Vec<usize> = sets.values().map(|name| name.len().max(14) + 1).collect();
        for (name, cw) in sets.values().zip(&widths) {
            let _ = write!(s, "{name:>cw$}");
        }
        let _ = writeln!(s);
        for p in all {
            let _ = write!(s, "{:<w$}", p.policy);
            for (models, cw) in sets.keys().zip(&widths) {
                let _ = write!(s, "{:>cw$}", cell(p.placed_naming(false, *models)));
            }
            let _ = writeln!(s);
        }
    }
    let _ = writeln!(s, "\nFailed pods (mean ± sd):");
    for p in all {
        let _ = writeln!(s, "  {:<w$}{}", p.policy, cell(p.failed()));
    }
    s
}

/// A placed-share column of the table: its name and the pods it counts.
type ClassColumn = (&'static str, Box<dyn Fn(&Classes) -> Placed>);

/// The table's placed-share columns: all GPU pods, by restriction, then by class.
fn class_columns() -> Vec<ClassColumn> {
    let mut out: Vec<ClassColumn> = vec![
        ("all", Box::new(|c: &Classes| c.total(None))),
        ("unrestricted", Box::new(|c: &Classes| c.total(Some(false)))),
        ("restricted", Box::new(|c: &Classes| c.total(Some(true)))),
    ];
    for class in PodClass::ALL {
        out.push((
            class.name(),
            Box::new(move |c: &Classes| {
                let (a, b) = (c.get(class, false), c.get(class, true));
                Placed {
                    arrived: a.arrived + b.arrived,
                    placed: a.placed + b.placed,
                }
            }),
        ));
    }
    out
}

/// `classes.csv`: per run, point (`100`: up to 100% arrived, `end`), class and restriction, the GPU pods
/// that arrived and those placed.
pub fn write_classes(path: &Path, trace: &str, all: &[PolicyRuns]) -> Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    w.write_record([
        "trace",
        "policy",
        "seed",
        "point",
        "class",
        "restricted",
        "arrived",
        "placed",
    ])?;
    for p in all {
        for r in &p.runs {
            for (point, classes) in [("100", &r.classes_at_100), ("end", &r.classes)] {
                for class in PodClass::ALL {
                    for restricted in [false, true] {
                        let c = classes.get(class, restricted);
                        w.write_record([
                            trace.to_string(),
                            p.policy.to_string(),
                            r.seed.to_string(),
                            point.to_string(),
                            class.name().to_string(),
                            restricted.to_string(),
                            c.arrived.to_string(),
                            c.placed.to_string(),
                        ])?;
                    }
                }
            }
        }
    }
    w.flush()?;
    Ok(())
}

/// The model sets that restricted GPU pods named in any run up to 100% arrived, by the set's bits, with
/// their names: the columns of the table's restricted breakdown.
fn named_sets(all: &[PolicyRuns]) -> BTreeMap<ModelSet, &str> {
    let mut sets = BTreeMap::new();
    for set in all
        .iter()
        .flat_map(|p| &p.runs)
        .flat_map(|r| &r.restricted_at_100)
    {
        sets.entry(set.models).or_insert(set.name.as_str());
    }
    sets
}

/// `restricted.csv`: per run, point (`100`: up to 100% arrived, `end`) and model set the restricted GPU
/// pods named (the models' names joined by `|`), the pods that arrived and those placed; a set no pod of
/// the run named by that point has no row.
pub fn write_restricted(path: &Path, trace: &str, all: &[PolicyRuns]) -> Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    w.write_record(["trace", "policy", "seed", "point", "models", "arrived", "placed"])?;
    for p in all {
        for r in &p.runs {
            let points: [(&str, &[SetPlaced]); 2] = [("100", &r.restricted_at_100), ("end", &r.restricted)];
            for (point, sets) in points {
                for set in sets {
                    w.write_record([
                        trace.to_string(),
                        p.policy.to_string(),
                        r.seed.to_string(),
                        point.to_string(),
                        set.name.clone(),
                        set.placed.arrived.to_string(),
                        set.placed.placed.to_string(),
                    ])?;
                }
            }
        }
    }
    w.flush()?;
    Ok(())
}

/// `bound.csv`: per seed, the least unallocated GPU % any placement of the pods arrived by 100% can
/// reach (`sim::bound`).
pub fn write_bounds(path: &Path, trace: &str, bounds: &[(u64, f64)]) -> Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    w.write_record(["trace", "seed", "unallocated_gpu_pct_bound_at_100"])?;
    for (seed, b) in bounds {
        w.write_record([trace.to_string(), seed.to_string(), format!("{b:.4}")])?;
    }
    w.flush()?;
    Ok(())
}

/// `summary.csv`: one row per policy and table point.
pub fn write_summary(path: &Path, trace: &str, all: &[PolicyRuns], published: &Published) -> Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    w.write_record([
        "trace",
        "policy",
        "arrived_pct",
        "unallocated_gpu_pct_mean",
        "unallocated_gpu_pct_sd",
        "frag_pct_mean",
        "frag_pct_sd",
        "frag_rate_pct_mean",
        "frag_rate_pct_sd",
        "published_unallocated_gpu_pct",
        "seeds",
    ])?;
    for p in all {
        for pct in TABLE_PCTS {
            let (Some(u), Some(f), Some(r)) = (
                p.at(pct, Metric::Unallocated),
                p.at(pct, Metric::Frag),
                p.at(pct, Metric::FragRate),
            ) else {
                continue;
            };
            let publ = p
                .paper
                .and_then(|name| published.get(&(name, pct)))
                .map_or(String::new(), |(m, _)| format!("{m:.2}"));
            w.write_record([
                trace.to_string(),
                p.policy.to_string(),
                pct.to_string(),
                format!("{:.4}", u.mean),
                format!("{:.4}", u.sd),
                format!("{:.4}", f.mean),
                format!("{:.4}", f.sd),
                format!("{:.4}", r.mean),
                format!("{:.4}", r.sd),
                publ,
                u.n.to_string(),
            ])?;
        }
    }
    w.flush()?;
    Ok(())
}

/// `runs.csv`: one row per run (policy and seed): unallocated GPU % at 100% arrived, failed pods, how
/// many times the policy was built (more than once: rebuilt as its online mix moved) and seconds.
pub fn write_runs(path: &Path, trace: &str, all: &[PolicyRuns]) -> Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    w.write_record([
        "trace",
        "policy",
        "seed",
        "unallocated_gpu_pct_at_100",
        "failed",
        "builds",
        "seconds",
    ])?;
    for p in all {
        for r in &p.runs {
            w.write_record([
                trace.to_string(),
                p.policy.to_string(),
                r.seed.to_string(),
                r.curve
                    .at(100)
                    .map_or(String::new(), |(u, _, _)| format!("{u:.4}")),
                r.failed.to_string(),
                r.builds.to_string(),
                format!("{:.3}", r.seconds),
            ])?;
        }
    }
    w.flush()?;
    Ok(())
}

/// `curves.csv`: every 1% of arrived workload, per policy.
pub fn write_curves(path: &Path, trace: &str, all: &[PolicyRuns], max_pct: usize) -> Result<()> {
    let mut w = csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    w.write_record([
        "trace",
        "policy",
        "arrived_pct",
        "unallocated_gpu_pct_mean",
        "unallocated_gpu_pct_sd",
        "frag_pct_mean",
        "frag_pct_sd",
        "frag_rate_pct_mean",
        "frag_rate_pct_sd",
        "seeds",
    ])?;
    for p in all {
        for pct in 0..=max_pct {
            let (Some(u), Some(f), Some(r)) = (
                p.at(pct, Metric::Unallocated),
                p.at(pct, Metric::Frag),
                p.at(pct, Metric::FragRate),
            ) else {
                continue;
            };
            w.write_record([
                trace.to_string(),
                p.policy.to_string(),
                pct.to_string(),
                format!("{:.4}", u.mean),
                format!("{:.4}", u.sd),
                format!("{:.4}", f.mean),
                format!("{:.4}", f.sd),
                format!("{:.4}", r.mean),
                format!("{:.4}", r.sd),
                u.n.to_string(),
            ])?;
        }
    }
    w.flush()?;
    Ok(())
}

/// The chart: unallocated GPU % against arrived workload, one line per policy (SVG).
pub fn write_chart(path: &Path, trace: &str, all: &[PolicyRuns], max_pct: usize) -> Result<()> {
    use plotters::prelude::*;

    let from = 50usize.min(max_pct);
    let series: Vec<(&str, Vec<(f64, f64)>)> = all
        .iter()
        .map(|p| {
            let pts = (from..=max_pct)
                .filter_map(|x| p.at(x, Metric::Unallocated).map(|s| (x as f64, s.mean)))
                .collect();
            (p.policy, pts)
        })
        .collect();
    let y_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().map(|p| p.1))
        .fold(1.0f64, f64::max)
        * 1.05;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("chart {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Unallocated GPU % vs arrived workload ({trace})"),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(from as f64..max_pct as f64, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("arrived workload (% of GPU capacity)")
        .y_desc("unallocated GPU %")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (name, pts)) in series.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::replay::Curve;

    fn run(seed: u64, sets: &[(u64, &str, u32, u32)]) -> RunResult {
        let sets: Vec<SetPlaced> = sets
            .iter()
            .map(|&(bits, name, arrived, placed)| SetPlaced {
                models: ModelSet(bits),
                name: name.to_string(),
                placed: Placed { arrived, placed },
            })
            .collect();
        RunResult {
            policy: "BestFit",
            seed,
            // No arrival recorded: every curve cell of the table is empty.
            curve: Curve {
                count: vec![0; 140],
                unalloc: vec![0.0; 140],
                frag: vec![0.0; 140],
                frag_rate: vec![0.0; 140],
            },
            pods: 0,
            failed: 0,
            classes_at_100: Classes::default(),
            classes: Classes::default(),
            restricted_at_100: sets.clone(),
            restricted: sets,
            arrived_pct: 0.0,
            allocated: 0,
            capacity: 0,
            seconds: 0.0,
            builds: 1,
            build_seconds: 0.0,
        }
    }

    #[test]
    fn the_table_breaks_restricted_pods_down_by_the_models_they_name() {
        let long = "NVIDIA A100-SXM4-80GB|NVIDIA H100 80GB HBM3";
        let all = [
            PolicyRuns {
                policy: "BestFit",
                paper: None,
                runs: vec![
                    run(1, &[(1, "Tesla T4", 4, 2), (6, long, 2, 2)]),
                    // Seed 2 had no pod naming the A100 or H100: that seed has no value there.
                    run(2, &[(1, "Tesla T4", 4, 4)]),
                ],
            },
            PolicyRuns {
                policy: "gpumem",
                paper: None,
                runs: vec![run(1, &[(6, long, 4, 1)])],
            },
        ];
        let t = table("tiny", &all, &Published::new());
        let title = "Restricted pods placed by the models they name, % of those arrived until 100% arrived";
        let rows: Vec<&str> = t
            .lines()
            .skip_while(|l| !l.starts_with(title))
            .skip(1)
            .take(3)
            .collect();
        assert_eq!(rows.len(), 3, "{t}");
        assert_eq!(
            rows[0],
            format!("{:<14}{:>15} {long}", "policy", "Tesla T4"),
            "a column as wide as its name, at least 14: {t}"
        );
        assert!(rows[1].starts_with("BestFit"), "{t}");
        // Seeds 1 and 2 of T4: 50% and 100%; the set of two models, one seed: 100%.
        assert!(
            rows[1].contains("75.00 ± 35.36") && rows[1].ends_with("100.00 ± 0.00"),
            "{t}"
        );
        assert!(
            rows[2].contains(" - ") && rows[2].ends_with("25.00 ± 0.00"),
            "{t}"
        );
        // The columns line up under their names.
        for r in &rows[1..] {
            assert_eq!(r.chars().count(), rows[0].chars().count(), "{t}");
        }

        let none = [PolicyRuns {
            policy: "BestFit",
            paper: None,
            runs: vec![run(1, &[])],
        }];
        assert!(!table("tiny", &none, &Published::new()).contains(title));
    }

    #[test]
    fn restricted_csv_has_a_row_per_run_point_and_set() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("restricted.csv");
        let all = [PolicyRuns {
            policy: "gpumem",
            paper: None,
            runs: vec![run(3, &[(1, "T4", 4, 3), (6, "A100|H100", 2, 0)])],
        }];
        write_restricted(&path, "tiny", &all).expect("written");
        let csv = std::fs::read_to_string(&path).expect("read");
        assert_eq!(
            csv.lines().collect::<Vec<_>>(),
            [
                "trace,policy,seed,point,models,arrived,placed",
                "tiny,gpumem,3,100,T4,4,3",
                "tiny,gpumem,3,100,A100|H100,2,0",
                "tiny,gpumem,3,end,T4,4,3",
                "tiny,gpumem,3,end,A100|H100,2,0",
            ]
        );
    }
}
