//! One decision of the DRA placer (`placer::place` with the extender's ranking) over 1000 DRA nodes,
//! half 8 x A100-80GB, half 4 x T4, each as its agent would publish it (annotations and ResourceSlice):
//! a 5000Mi claim, with no selector, with a CEL selector on the model, and a pair of whole GPUs on one
//! NVLink island (`matchAttribute`); each with every device's selectors evaluated, and with the
//! answers kept between decisions (`SelectionMemo`, as the placer keeps them). What the placer's share
//! of a pod's time to bind is.
//!
//! `cargo bench --bench placer`

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use criterion::{Criterion, criterion_group, criterion_main};
use k8s_openapi::api::core::v1::Pod;

use gpumem::gpu::GpuInventory;
use gpumem::inspect::Report;
use gpumem::placer::cel::Selector;
use gpumem::placer::claims::{Alternative, ClaimPlan, Constraint, Need, RequestAsk};
use gpumem::placer::place::{DraNode, Ranked, SelectionMemo, place, select_each};
use gpumem::scorer::Scorer;
use gpumem::scorer::config::ScorerConfig;
use gpumem::scorer::state::{Demand, NodeSnapshot};
use gpumem_profile::Profile;

const NODES: usize = 1000;

fn nodes() -> Vec<DraNode> {
    let report = |profile: &str| {
        let inventory = GpuInventory::discover(&Profile::load(profile).expect("built-in")).expect("profile");
        Report::new(&inventory, profile.into(), 1)
    };
    let (a100, t4) = (report("dgx-a100"), report("t4x4"));
    (0..NODES)
        .map(|i| {
            let r = if i % 2 == 0 { &a100 } else { &t4 };
            let name = format!("node-{i:04}");
            let state =
                NodeSnapshot::from_parts(&name, "1", &r.labels, &r.annotations, Some("64"), Some("512Gi"));
            DraNode {
                state: Arc::new(state),
                devices: Arc::new(r.resource_slice.devices.clone().unwrap_or_default()),
            }
        })
        .collect()
}

fn plan(need: Need, selectors: &[&str], constraints: Vec<Constraint>) -> Vec<ClaimPlan> {
    vec![ClaimPlan {
        key: "bench/c".into(),
        requests: vec![RequestAsk {
            name: "gpu".into(),
            alternatives: vec![Alternative {
                result_name: "gpu".into(),
                class: "gpu.gpumem.io".into(),
                selectors: selectors.iter().map(|s| s.to_string()).collect(),
                need,
            }],
        }],
        constraints,
    }]
}

fn bench(c: &mut Criterion) {
    let nodes = nodes();
    let scorer = Scorer::new(ScorerConfig::default(), None, None, None);
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "p", "namespace": "bench", "uid": "u"}, "spec": {"containers": []}
    }))
    .expect("a pod");
    let rank = |states: &[Arc<NodeSnapshot>], need: Need| -> Vec<Option<Ranked>> {
        let demand = match need {
            Need::Mib(mib) => Demand::Memory { units: mib },
            Need::Whole(count) => Demand::Whole { count },
        };
        let Ok(d) = scorer.demand_of(&pod, demand) else {
            return vec![None; states.len()];
        };
        scorer
            .rank(states, &d)
            .into_iter()
            .map(|s| {
                s.map(|s| Ranked {
                    raw: s.raw,
                    gpus: s.gpus,
                })
            })
            .collect()
    };
    // Every request is also checked against its DeviceClass's selector (the shipped class's).
    const CLASS: &str = r#"device.driver == "gpumem.io""#;
    const T4: &str = r#"device.attributes["gpumem.io"].productName == "Tesla T4""#;
    let compiled: BTreeMap<String, Selector> = [CLASS, T4]
        .into_iter()
        .map(|e| (e.to_string(), Selector::compile(e).expect("compiles")))
        .collect();
    let evaluate = |node: &DraNode, alt: &Alternative| -> Result<Vec<usize>, String> {
        select_each(node, |device| {
            for e in std::iter::once(CLASS).chain(alt.selectors.iter().map(String::as_str)) {
                let selector = compiled.get(e).ok_or("not compiled")?;
                if !selector.matches("gpumem.io", device).map_err(|e| e.to_string())? {
                    return Ok(false);
                }
            }
            Ok(true)
        })
    };
    // As the placer does: each node's answers kept until its devices change.
    let memo = Mutex::new(SelectionMemo::default());
    let remembered = |node: &DraNode, alt: &Alternative| -> Result<Vec<usize>, String> {
        let list = std::iter::once(CLASS.to_string())
            .chain(alt.selectors.iter().cloned())
            .collect();
        let mut memo = memo.lock().unwrap_or_else(|e| e.into_inner());
        memo.select(node, list, || evaluate(node, alt))
    };
    let cases = [
        ("5000Mi", plan(Need::Mib(5000), &[], Vec::new())),
        (
            "5000Mi on a T4 by CEL",
            plan(
                Need::Mib(5000),
                &[r#"device.attributes["gpumem.io"].productName == "Tesla T4""#],
                Vec::new(),
            ),
        ),
        (
            "two whole GPUs on one NVLink island",
            plan(
                Need::Whole(2),
                &[],
                vec![Constraint {
                    requests: Vec::new(),
                    attribute: "gpumem.io/nvlinkDomain".into(),
                    same: true,
                }],
            ),
        ),
    ];
    for (name, plans) in &cases {
        let placed = place(plans, &nodes, "gpumem.io", &evaluate, &rank).expect("placed");
        eprintln!(
            "{name}: {} {:?}",
            placed.node,
            placed.picks[0].iter().map(|p| p.index).collect::<Vec<_>>()
        );
        let again = place(plans, &nodes, "gpumem.io", &remembered, &rank).expect("placed");
        assert_eq!(again, placed, "the memo answers as the selectors do");
        c.bench_function(
            &format!("placer: {name}, {NODES} nodes, every device evaluated"),
            |b| b.iter(|| place(plans, &nodes, "gpumem.io", &evaluate, &rank)),
        );
        c.bench_function(&format!("placer: {name}, {NODES} nodes, answers kept"), |b| {
            b.iter(|| place(plans, &nodes, "gpumem.io", &remembered, &rank))
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
