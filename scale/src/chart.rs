//! `gpumem-scale chart` and `gpumem-scale table`: the results of two runs (extender, alone) as one SVG
//! and as markdown rows.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use clap::Args;
use serde_json::Value;

use crate::stats;

#[derive(Args, Debug)]
pub struct ChartArgs {
    /// Results of the run with the extender.
    #[arg(long)]
    pub extender: PathBuf,
    /// Results of the run with kube-scheduler alone.
    #[arg(long)]
    pub alone: PathBuf,
    #[arg(long, default_value = "docs/scale.svg")]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub struct TableArgs {
    /// Results directories (each with summary.json).
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
}

fn read_summary(dir: &Path) -> anyhow::Result<Value> {
    let path = dir.join("summary.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

/// The latencies (ms) of one phase's placed pods, from pods.csv.
pub fn phase_latencies(dir: &Path, phase: &str) -> anyhow::Result<Vec<f64>> {
    let path = dir.join("pods.csv");
    let mut reader = csv::Reader::from_path(&path).with_context(|| format!("reading {}", path.display()))?;
    let headers = reader
        .headers()
        .with_context(|| format!("{}: no header", path.display()))?
        .clone();
    let col = |name: &str| {
        headers
            .iter()
            .position(|h| h == name)
            .with_context(|| format!("{}: no column {name}", path.display()))
    };
    let (phase_col, lat_col) = (col("phase")?, col("latency_ms")?);
    // Bindings seen after the phase ended (while its pods were deleted) are not the phase's.
    let late_col = headers.iter().position(|h| h == "bound_after_phase");
    let mut out = Vec::new();
    for record in reader.records() {
        let record = record.with_context(|| format!("reading {}", path.display()))?;
        if record.get(phase_col) != Some(phase) || late_col.and_then(|c| record.get(c)) == Some("true") {
            continue;
        }
        match record.get(lat_col).unwrap_or("") {
            "" => {}
            text => out.push(
                text.parse::<f64>()
                    .with_context(|| format!("{}: latency {text:?}", path.display()))?,
            ),
        }
    }
    Ok(out)
}

fn phase<'a>(summary: &'a Value, name: &str) -> Option<&'a Value> {
    summary["phases"].as_array()?.iter().find(|p| p["phase"] == name)
}

fn per_second(summary: &Value, name: &str) -> Vec<u64> {
    phase(summary, name)
        .and_then(|p| p["bound_per_second"].as_array())
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

pub fn chart(args: &ChartArgs) -> anyhow::Result<()> {
    use plotters::prelude::*;

    let runs = [
        ("extender", &args.extender),
        ("kube-scheduler alone", &args.alone),
    ];
    let mut cdfs = Vec::new();
    let mut rates = Vec::new();
    let mut nodes = 0;
    for (label, dir) in runs {
        let summary = read_summary(dir)?;
        nodes = summary["nodes"].as_u64().unwrap_or(0);
        let lat = phase_latencies(dir, "steady")?;
        if lat.is_empty() {
            bail!("{}: no placed pod in the steady phase", dir.display());
        }
        cdfs.push((label, stats::cdf(&lat, 400)));
        let series: Vec<(f64, f64)> = per_second(&summary, "burst")
            .into_iter()
            .enumerate()
            .map(|(s, n)| (s as f64 + 0.5, n as f64))
            .collect();
        rates.push((label, series));
    }
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("chart {}: {e}", args.out.display());
    if let Some(parent) = args.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    let root = SVGBackend::new(&args.out, (1200, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(600);

    let x_min = cdfs
        .iter()
        .flat_map(|(_, c)| c.iter().map(|p| p.0))
        .fold(f64::INFINITY, f64::min)
        .max(0.1)
        * 0.8;
    let x_max = cdfs
        .iter()
        .flat_map(|(_, c)| c.iter().map(|p| p.0))
        .fold(1.0f64, f64::max)
        * 1.25;
    let mut chart = ChartBuilder::on(&left)
        .caption(
            format!("Creation to bound, steady phase ({nodes} nodes)"),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((x_min..x_max).log_scale(), 0.0..1.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("latency (ms, log scale)")
        .y_desc("fraction of placed pods")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (label, pts)) in cdfs.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;

    let t_max = rates
        .iter()
        .flat_map(|(_, r)| r.iter().map(|p| p.0))
        .fold(1.0f64, f64::max)
        + 0.5;
    let y_max = rates
        .iter()
        .flat_map(|(_, r)| r.iter().map(|p| p.1))
        .fold(1.0f64, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&right)
        .caption("Pods bound per second, burst phase", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..t_max, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("seconds since the first create")
        .y_desc("pods bound in that second")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (label, pts)) in rates.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(label)
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

fn num(v: &Value, digits: usize) -> String {
    v.as_f64().map_or("-".into(), |x| format!("{x:.digits$}"))
}

fn process<'a>(p: Option<&'a Value>, name: &str) -> Option<&'a Value> {
    p?["processes"].as_array()?.iter().find(|u| u["name"] == name)
}

/// One markdown row per results directory.
pub fn table_rows(summaries: &[Value]) -> Vec<String> {
    let mut rows = vec![
        "| nodes | mode | steady: created/s, bound/s | steady p50 / p95 / p99 (ms) | share / whole-1 / multi-GPU p99 (ms) | burst bound/s | burst p50 / p99 (ms) | placed (steady, burst) | misfits (burst) | CPU % of a core in the burst: apiserver, etcd, scheduler, scorer | scorer peak RSS (fill) | claims placed by gpumem (steady, burst) | burst bound/s, share of the ceiling | binds the scorer refused |".to_string(),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|".to_string(),
    ];
    for s in summaries {
        let steady = phase(s, "steady");
        let burst = phase(s, "burst");
        let fill = phase(s, "fill");
        let get = |p: Option<&Value>, k: &str| p.map_or(Value::Null, |p| p[k].clone());
        let lat = |p: Option<&Value>, k: &str| p.map_or(Value::Null, |p| p["latency"][k].clone());
        let kind_p99 = |k: &str| steady.map_or(Value::Null, |p| p["latency_by_kind"][k]["p99_ms"].clone());
        let cpu = |name: &str| process(burst, name).map_or("-".into(), |u| num(&u["cpu_pct"], 0));
        let rss = process(fill, "gpumem-scorer").map_or("-".to_string(), |u| {
            format!(
                "{} MiB at {} pods",
                num(&u["peak_rss_mib"], 0),
                get(fill, "placed").as_u64().unwrap_or(0)
            )
        });
        // Only DRA runs read who allocated the claims.
        let by_gpumem = |p: Option<&Value>| {
            p.map(|p| &p["placed_by_gpumem"]["fraction"])
                .and_then(Value::as_f64)
                .map_or("-".to_string(), |x| format!("{:.1}%", x * 100.0))
        };
        // The same node count's ceiling run, if among the summaries.
        let ceiling = summaries
            .iter()
            .find(|c| c["mode"] == "ceiling" && c["nodes"] == s["nodes"])
            .and_then(|c| get(phase(c, "burst"), "pods_per_s").as_f64());
        let of_ceiling = match (get(burst, "pods_per_s").as_f64(), ceiling) {
            (Some(bound), Some(ceiling)) if ceiling > 0.0 => format!("{:.0}%", 100.0 * bound / ceiling),
            _ => "-".to_string(),
        };
        let refused = match (
            s["scorer_binds"]["refused"].as_u64(),
            s["scorer_binds"]["binds"].as_u64(),
        ) {
            (Some(r), Some(b)) if b > 0 => format!("{r} of {b} ({:.1}%)", 100.0 * r as f64 / b as f64),
            _ => "-".to_string(),
        };
        // Runs before the mix existed have no `mix`: the trace's.
        let mode = match s["mix"].as_str() {
            Some(mix) if mix != "trace" => format!("{} ({mix})", s["mode"].as_str().unwrap_or("?")),
            _ => s["mode"].as_str().unwrap_or("?").to_string(),
        };
        rows.push(format!(
            "| {} | {} | {} / {} | {} / {} / {} | {} / {} / {} | {} | {} / {} | {}%, {}% | {} | {}, {}, {}, {} | {} | {}, {} | {} | {} |",
            s["nodes"],
            mode,
            num(&get(steady, "created_per_s"), 0),
            num(&get(steady, "pods_per_s"), 0),
            num(&lat(steady, "p50_ms"), 0),
            num(&lat(steady, "p95_ms"), 0),
            num(&lat(steady, "p99_ms"), 0),
            num(&kind_p99("share"), 0),
            num(&kind_p99("whole-1"), 0),
            num(&kind_p99("multi-gpu"), 0),
            num(&get(burst, "pods_per_s"), 0),
            num(&lat(burst, "p50_ms"), 0),
            num(&lat(burst, "p99_ms"), 0),
            num(&get(steady, "fraction_placed").as_f64().map(|x| x * 100.0).into(), 1),
            num(&get(burst, "fraction_placed").as_f64().map(|x| x * 100.0).into(), 1),
            get(burst, "misfits"),
            cpu("kube-apiserver"),
            cpu("etcd"),
            cpu("kube-scheduler"),
            cpu("gpumem-scorer"),
            rss,
            by_gpumem(steady),
            by_gpumem(burst),
            of_ceiling,
            refused,
        ));
    }
    rows
}

/// The binds a scorer answered and refused, from its metrics (`gpumem_scorer_bind_failures_total` of
/// every kind, and the bind calls it timed).
pub fn scorer_binds(metrics: &str) -> Option<(u64, u64)> {
    let value = |line: &str| line.rsplit(' ').next()?.parse::<f64>().ok();
    let mut refused = 0.0;
    let mut binds = None;
    for line in metrics.lines() {
        if line.starts_with("gpumem_scorer_bind_failures_total{") {
            refused += value(line)?;
        } else if line.starts_with("gpumem_scorer_request_duration_seconds_count{")
            && line.contains(r#"verb="bind""#)
        {
            binds = value(line);
        }
    }
    Some((refused as u64, binds? as u64))
}

pub fn table(args: &TableArgs) -> anyhow::Result<()> {
    let mut summaries = Vec::new();
    for dir in &args.dirs {
        let mut s = read_summary(dir)?;
        // scripts/scale.sh keeps the scorer's metrics beside the results of the runs with one.
        if let Some((refused, binds)) = std::fs::read_to_string(dir.join("scorer-metrics.txt"))
            .ok()
            .and_then(|m| scorer_binds(&m))
        {
            s["scorer_binds"] = serde_json::json!({"refused": refused, "binds": binds});
        }
        summaries.push(s);
    }
    for row in table_rows(&summaries) {
        println!("{row}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_of_a_phase_leave_out_late_and_unbound_pods() {
        let dir = std::env::temp_dir().join(format!("gpumem-scale-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("pods.csv"),
            "phase,pod,latency_ms,bound_after_phase\nsteady,a,12.5,false\nsteady,b,,false\nsteady,c,900000,true\nburst,d,7,false\n",
        )
        .unwrap();
        assert_eq!(phase_latencies(&dir, "steady").unwrap(), vec![12.5]);
        assert_eq!(phase_latencies(&dir, "burst").unwrap(), vec![7.0]);
        std::fs::write(dir.join("pods.csv"), "phase,latency_ms\nsteady,x\n").unwrap();
        assert!(phase_latencies(&dir, "steady").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_row_per_summary() {
        let s = serde_json::json!({"nodes": 1000, "mode": "alone", "phases": [
            {"phase": "steady", "created_per_s": 99.6, "pods_per_s": 48.2, "fraction_placed": 1.0,
             "latency": {"p50_ms": 12.0, "p95_ms": 40.0, "p99_ms": 90.0},
             "latency_by_kind": {"share": {"p99_ms": 80.0}}},
            {"phase": "burst", "pods_per_s": 70.0, "misfits": 12, "fraction_placed": 0.5,
             "latency": {"p50_ms": 100.0, "p99_ms": 900.0},
             "processes": [{"name": "kube-scheduler", "cpu_pct": 95.2}]}]});
        let rows = table_rows(&[s]);
        assert_eq!(rows.len(), 3);
        assert!(rows[2].starts_with("| 1000 | alone | 100 / 48 | 12 / 40 / 90 | 80 / - / - | 70 | 100 / 900 | 100.0%, 50.0% | 12 |"), "{}", rows[2]);
        assert!(rows[2].contains("-, -, 95, -"), "{}", rows[2]);
        assert!(
            rows[2].ends_with("| -, - | - | - |"),
            "no claims read, no ceiling run, no scorer: {}",
            rows[2]
        );
        assert_eq!(rows[0].matches('|').count(), rows[2].matches('|').count());
        assert_eq!(rows[0].matches('|').count(), rows[1].matches('|').count());
    }

    #[test]
    fn each_row_is_a_share_of_the_ceiling_of_its_node_count() {
        let run = |nodes: u64, mode: &str, burst: f64| serde_json::json!({"nodes": nodes, "mode": mode, "phases": [{"phase": "burst", "pods_per_s": burst}]});
        let mut extender = run(1000, "extender", 180.0);
        extender["scorer_binds"] = serde_json::json!({"refused": 3, "binds": 1000});
        let rows = table_rows(&[run(1000, "ceiling", 200.0), extender, run(200, "alone", 100.0)]);
        assert!(rows[2].ends_with("| 100% | - |"), "{}", rows[2]);
        assert!(rows[3].ends_with("| 90% | 3 of 1000 (0.3%) |"), "{}", rows[3]);
        assert!(
            rows[4].ends_with("| - | - |"),
            "no ceiling at 200 nodes: {}",
            rows[4]
        );
    }

    #[test]
    fn the_scorers_binds_and_refusals_are_read_from_its_metrics() {
        let metrics = "# HELP x\n\
            gpumem_scorer_request_duration_seconds_count{verb=\"filter\"} 900\n\
            gpumem_scorer_request_duration_seconds_count{verb=\"bind\"} 1200\n\
            gpumem_scorer_bind_failures_total{kind=\"does_not_fit\"} 7\n\
            gpumem_scorer_bind_failures_total{kind=\"contended\"} 2\n";
        assert_eq!(scorer_binds(metrics), Some((9, 1200)));
        assert_eq!(
            scorer_binds("gpumem_scorer_errors_total 1\n"),
            None,
            "no bind timed"
        );
    }

    #[test]
    fn a_realistic_dra_row_names_its_mix_and_who_placed_the_claims() {
        let s = serde_json::json!({"nodes": 1000, "mode": "dra-gpumem", "mix": "realistic", "phases": [
            {"phase": "steady", "placed_by_gpumem": {"fraction": 0.9975}},
            {"phase": "burst", "placed_by_gpumem": {"fraction": 1.0}}]});
        let rows = table_rows(&[s]);
        assert!(
            rows[2].starts_with("| 1000 | dra-gpumem (realistic) |"),
            "{}",
            rows[2]
        );
        assert!(rows[2].contains("| 99.8%, 100.0% |"), "{}", rows[2]);
        let trace = serde_json::json!({"nodes": 10, "mode": "extender", "mix": "trace", "phases": []});
        assert!(table_rows(&[trace])[2].starts_with("| 10 | extender |"));
    }
}
