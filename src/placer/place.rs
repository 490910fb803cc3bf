//! Where a pod's claims go: one node for all of them, and the GPUs of each request there. Pure: the
//! controller hands in the nodes the pod may use (with their ResourceSlice devices), how a device is
//! matched against a request's selectors, and the extender's ranking.
//!
//! The search, as kube-scheduler's allocator orders it: claims in the pod's order, requests in the
//! claim's order, for each request the first alternative (`firstAvailable`) that fits. Where
//! kube-scheduler tries devices one by one and backtracks, the placer asks the ranking for the best
//! GPUs of each request on every node at once, and keeps each node's choice (greedy). A
//! `matchAttribute` constraint splits a node into one variant per value of the attribute (each NVLink
//! island, say), every covered request restricted to that value; `distinctAttribute` keeps each later
//! pick off the values taken. The node is the one whose picks rank best in sum.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute};

use super::claims::{Alternative, ClaimPlan, Need, Picked};
use crate::alloc::GpuMask;
use crate::node::slice::device_index;
use crate::scorer::state::NodeSnapshot;

/// A node the pod may use.
#[derive(Debug, Clone)]
pub struct DraNode {
    /// Its GPUs as the placer counts them (the agent's report, less allocations it does not show yet).
    pub state: Arc<NodeSnapshot>,
    /// The devices of the driver's ResourceSlice on it (shared with the placer's watch).
    pub devices: Arc<Vec<Device>>,
}

/// The ranking's answer for one node: how good (0..=1) and which GPU positions.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranked {
    pub raw: f64,
    pub gpus: GpuMask,
}

/// The extender's ranking of nodes (names unique within a call) for a need.
pub type Rank<'a> = dyn Fn(&[Arc<NodeSnapshot>], Need) -> Vec<Option<Ranked>> + 'a;
/// The devices of a node (positions in its `devices`) an alternative's selectors (the class's and the
/// request's) take; `Err`: they cannot be evaluated on one of them ([`select_each`] says which).
pub type Selects<'a> = dyn Fn(&DraNode, &Alternative) -> Result<Vec<usize>, String> + 'a;

/// [`Selects`] from an answer per device: every device of `node` that `matches` takes, or the first error.
pub fn select_each(
    node: &DraNode,
    matches: impl Fn(&Device) -> Result<bool, String>,
) -> Result<Vec<usize>, String> {
    let mut taken = Vec::new();
    for (d, device) in node.devices.iter().enumerate() {
        match matches(device) {
            Ok(true) => taken.push(d),
            Ok(false) => {}
            Err(e) => return Err(format!("node {} device {}: {e}", node.state.name, device.name)),
        }
    }
    Ok(taken)
}

/// What each node's devices answered to each list of selectors, kept while the node publishes the
/// same devices (the same `Arc` of its slices): selectors are evaluated on a device once, not once per
/// decision. Most of a decision's time otherwise (converting every attribute of every device of 1000
/// nodes, each time).
#[derive(Debug, Default)]
pub struct SelectionMemo {
    by_node: HashMap<String, NodeSelections>,
}

#[derive(Debug)]
struct NodeSelections {
    /// The devices the answers are for: held, so a new slice (a new `Arc`) is never taken for them.
    devices: Arc<Vec<Device>>,
    by_selectors: HashMap<Vec<String>, Result<Vec<usize>, String>>,
}

/// Selector lists kept per node; past it the node's answers start over (selectors come from claims,
/// which users write: their variety is theirs).
const SELECTIONS_PER_NODE: usize = 256;

impl SelectionMemo {
    /// The devices of `node` that `selectors` take, from the memo, else from `evaluate` (kept).
    pub fn select(
        &mut self,
        node: &DraNode,
        selectors: Vec<String>,
        evaluate: impl FnOnce() -> Result<Vec<usize>, String>,
    ) -> Result<Vec<usize>, String> {
        let entry = self
            .by_node
            .entry(node.state.name.clone())
            .or_insert_with(|| NodeSelections {
                devices: Arc::clone(&node.devices),
                by_selectors: HashMap::new(),
            });
        if !Arc::ptr_eq(&entry.devices, &node.devices) || entry.by_selectors.len() >= SELECTIONS_PER_NODE {
            entry.devices = Arc::clone(&node.devices);
            entry.by_selectors.clear();
        }
        if let Some(known) = entry.by_selectors.get(&selectors) {
            return known.clone();
        }
        let answer = evaluate();
        entry.by_selectors.insert(selectors, answer.clone());
        answer
    }

    /// Forgets the nodes `keep` says no to (nodes that no longer publish devices).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.by_node.retain(|node, _| keep(node));
    }

    /// Nodes with answers kept.
    pub fn nodes(&self) -> usize {
        self.by_node.len()
    }
}

/// Where the pod goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub node: String,
    /// Per claim of the plan, its picks.
    pub picks: Vec<Vec<Picked>>,
    pub score: f64,
}

/// Why the pod goes nowhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unplaced {
    /// A selector could not be evaluated on a device the pod's requests consider: kube-scheduler
    /// stops scheduling the pod at such an error (`placer::cel`), so the placer does not place it
    /// either.
    Selector(String),
    /// No node has room for all of the pod's claims (why, for the first few).
    NoRoom(String),
}

impl std::fmt::Display for Unplaced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unplaced::Selector(why) | Unplaced::NoRoom(why) => f.write_str(why),
        }
    }
}

/// The most variants a node is split into by `matchAttribute` constraints.
const MAX_VARIANTS: usize = 64;

/// One node, possibly restricted to a value of each match constraint, with what has been picked.
#[derive(Clone)]
struct Partial {
    candidate: usize,
    /// Per claim, per match constraint (by position in the claim's constraints): the value kept.
    restriction: Vec<HashMap<usize, String>>,
    state: Arc<NodeSnapshot>,
    picks: Vec<Vec<Picked>>,
    score: f64,
}

/// The fully qualified name of a device's attribute: an unqualified one is in the driver's domain.
fn attribute<'d>(device: &'d Device, qualified: &str, driver: &str) -> Option<&'d DeviceAttribute> {
    let attributes = device.attributes.as_ref()?;
    attributes.get(qualified).or_else(|| {
        let (domain, name) = qualified.split_once('/')?;
        (domain == driver).then(|| attributes.get(name)).flatten()
    })
}

/// An attribute's value, comparable across devices.
fn value_of(a: &DeviceAttribute) -> Option<String> {
    if let Some(v) = &a.string {
        return Some(format!("s:{v}"));
    }
    if let Some(v) = a.int {
        return Some(format!("i:{v}"));
    }
    if let Some(v) = a.bool {
        return Some(format!("b:{v}"));
    }
    a.version.as_ref().map(|v| format!("v:{v}"))
}

/// The GPU models (as the agents report them) of the devices `alt`'s selectors take on `candidates`,
/// when that is not every model they have: a pod restricted to them, whose demand the learned mix
/// counts on those models (the policy's scarcity term). `None`: it takes some of every model.
pub fn models_taken(
    candidates: &[DraNode],
    alt: &Alternative,
    selects: &Selects,
) -> Option<BTreeSet<String>> {
    let mut every: BTreeSet<&str> = BTreeSet::new();
    let mut taken: BTreeSet<String> = BTreeSet::new();
    for c in candidates {
        let gpus = c.state.gpus();
        every.extend(gpus.iter().map(|g| g.model.as_str()));
        let Ok(devices) = selects(c, alt) else { continue };
        for d in devices {
            let Some(index) = c.devices.get(d).and_then(|d| device_index(&d.name)) else {
                continue;
            };
            if let Some(g) = gpus.iter().find(|g| g.index == index)
                && !taken.contains(&g.model)
            {
                taken.insert(g.model.clone());
            }
        }
    }
    (taken.len() < every.len()).then_some(taken)
}

/// Places `plans` (the pod's claims) on one of `candidates`. `driver` qualifies attribute names.
pub fn place(
    plans: &[ClaimPlan],
    candidates: &[DraNode],
    driver: &str,
    selects: &Selects,
    rank: &Rank,
) -> Result<Placement, Unplaced> {
    if candidates.is_empty() {
        return Err(Unplaced::NoRoom(
            "no node the pod may use publishes GPUs of the driver".into(),
        ));
    }
    // Per candidate, per device: its position in the node's GPUs.
    let positions: Vec<Vec<Option<usize>>> = candidates
        .iter()
        .map(|c| {
            c.devices
                .iter()
                .map(|d| {
                    let index = device_index(&d.name)?;
                    c.state.gpus().iter().position(|g| g.index == index)
                })
                .collect()
        })
        .collect();
    // Per candidate, per (claim, request, alternative): the devices its selectors take.
    let mut selected: Vec<HashMap<(usize, usize, usize), Vec<usize>>> = Vec::new();
    for c in candidates {
        let mut by_alt = HashMap::new();
        for (i, plan) in plans.iter().enumerate() {
            for (j, request) in plan.requests.iter().enumerate() {
                for (k, alt) in request.alternatives.iter().enumerate() {
                    by_alt.insert((i, j, k), selects(c, alt).map_err(Unplaced::Selector)?);
                }
            }
        }
        selected.push(by_alt);
    }
    // The variants: each candidate once per combination of its match constraints' values.
    let mut partials: Vec<Partial> = Vec::new();
    for (ci, c) in candidates.iter().enumerate() {
        let mut variants: Vec<Vec<HashMap<usize, String>>> = vec![vec![HashMap::new(); plans.len()]];
        for (i, plan) in plans.iter().enumerate() {
            for (x, constraint) in plan.constraints.iter().enumerate().filter(|(_, c)| c.same) {
                let mut values = BTreeSet::new();
                for (j, request) in plan.requests.iter().enumerate() {
                    if !constraint.covers(&request.name) {
                        continue;
                    }
                    for k in 0..request.alternatives.len() {
                        for &d in &selected[ci][&(i, j, k)] {
                            if let Some(v) =
                                attribute(&c.devices[d], &constraint.attribute, driver).and_then(value_of)
                            {
                                values.insert(v);
                            }
                        }
                    }
                }
                let mut next = Vec::new();
                for variant in &variants {
                    for v in &values {
                        let mut with = variant.clone();
                        with[i].insert(x, v.clone());
                        next.push(with);
                    }
                }
                next.truncate(MAX_VARIANTS);
                variants = next;
            }
        }
        for restriction in variants {
            partials.push(Partial {
                candidate: ci,
                restriction,
                state: Arc::clone(&c.state),
                picks: vec![Vec::new(); plans.len()],
                score: 0.0,
            });
        }
    }
    let mut dead: Vec<String> = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        for (j, request) in plan.requests.iter().enumerate() {
            // Which partials still need this request, and which took an alternative.
            let mut open: Vec<usize> = (0..partials.len()).collect();
            let mut done: Vec<(usize, Picked, usize, f64)> = Vec::new();
            for (k, alt) in request.alternatives.iter().enumerate() {
                if open.is_empty() {
                    break;
                }
                // The room a memory request ranks with: its own, and the later memory requests of the
                // claim, which go on the same GPU.
                let lookahead: u64 = plan.requests[j + 1..]
                    .iter()
                    .filter_map(|r| match r.alternatives.first()?.need {
                        Need::Mib(m) => Some(m),
                        Need::Whole(_) => None,
                    })
                    .sum();
                let mut asks: Vec<(usize, Arc<NodeSnapshot>)> = Vec::new();
                for &p in &open {
                    let partial = &partials[p];
                    let eligible = eligible(
                        plan,
                        j,
                        &partial.picks[i],
                        &partial.restriction[i],
                        &selected[partial.candidate][&(i, j, k)],
                        &candidates[partial.candidate],
                        &positions[partial.candidate],
                        alt.need,
                        driver,
                    );
                    if eligible.is_empty() {
                        continue;
                    }
                    asks.push((p, restricted(&partial.state, eligible)));
                }
                let need = match alt.need {
                    Need::Mib(m) => Need::Mib(m.saturating_add(lookahead)),
                    whole => whole,
                };
                for (p, ranked) in rank_unique(&asks, need, rank) {
                    let Some(ranked) = ranked else { continue };
                    let state = &partials[p].state;
                    let gpus: Vec<usize> = ranked.gpus.iter().collect();
                    let expected = match alt.need {
                        Need::Mib(_) => 1,
                        Need::Whole(n) => n as usize,
                    };
                    if gpus.len() != expected {
                        continue;
                    }
                    let unit = state.unit_mib.max(1);
                    for (n, &g) in gpus.iter().enumerate() {
                        let gpu = &state.gpus()[g];
                        let mib = match alt.need {
                            Need::Mib(m) => m.div_ceil(unit) * unit,
                            Need::Whole(_) => {
                                crate::plugin::devices::units_per_gpu(gpu.memory_mib, unit) * unit
                            }
                        };
                        let pick = Picked {
                            result_name: alt.result_name.clone(),
                            class: alt.class.clone(),
                            index: gpu.index,
                            mib,
                        };
                        // The score counts once per request.
                        let raw = if n == 0 { ranked.raw } else { 0.0 };
                        done.push((p, pick, g, raw));
                    }
                }
                let took: BTreeSet<usize> = done.iter().map(|(p, ..)| *p).collect();
                open.retain(|p| !took.contains(p));
            }
            for p in open {
                let name = &partials[p].state.name;
                dead.push(format!(
                    "{name}: no room for claim {} request {:?}",
                    plan.key, request.name
                ));
            }
            let last = i + 1 == plans.len() && j + 1 == plan.requests.len();
            let mut next: Vec<Partial> = Vec::new();
            let mut index: HashMap<usize, usize> = HashMap::new();
            for (p, pick, g, raw) in done {
                let slot = *index.entry(p).or_insert_with(|| {
                    next.push(partials[p].clone());
                    next.len() - 1
                });
                let partial = &mut next[slot];
                // What the pick takes, for the requests after it (the last one has none after it).
                if !last {
                    let mut state = (*partial.state).clone();
                    {
                        let mut gpus = state.gpus_mut();
                        if is_memory(plan, &pick.result_name) {
                            gpus[g].allocated_mib = gpus[g].allocated_mib.saturating_add(pick.mib);
                        } else {
                            gpus[g].whole = true;
                        }
                    }
                    partial.state = Arc::new(state);
                }
                partial.picks[i].push(pick);
                partial.score += raw;
            }
            partials = next
                .into_iter()
                .filter(|p| satisfies(plan, i, p, candidates, driver))
                .collect();
        }
    }
    let best = partials.into_iter().max_by(|a, b| {
        a.score
            .total_cmp(&b.score)
            .then_with(|| b.state.name.cmp(&a.state.name))
    });
    match best {
        Some(p) => Ok(Placement {
            node: p.state.name.clone(),
            picks: p.picks,
            score: p.score,
        }),
        None => {
            let mut reasons = dead;
            reasons.sort();
            reasons.dedup();
            let shown: Vec<&str> = reasons.iter().take(3).map(String::as_str).collect();
            Err(Unplaced::NoRoom(format!(
                "no node has room for all of the pod's claims{}{}",
                if shown.is_empty() { "" } else { ": " },
                shown.join("; ")
            )))
        }
    }
}

/// The GPU positions request `j` of claim `i` may take through an alternative on this partial: the
/// devices its selectors take, within the match constraints' values, off the values distinct
/// constraints have used, and as the agent serves a claim (its memory from one GPU, beside no whole
/// GPU).
#[allow(clippy::too_many_arguments)]
fn eligible(
    plan: &ClaimPlan,
    j: usize,
    picked: &[Picked],
    restriction: &HashMap<usize, String>,
    selected: &[usize],
    candidate: &DraNode,
    positions: &[Option<usize>],
    need: Need,
    driver: &str,
) -> GpuMask {
    let request = &plan.requests[j].name;
    let memory_gpu = picked
        .iter()
        .find(|p| is_memory(plan, &p.result_name))
        .map(|p| p.index);
    let has_whole = picked.iter().any(|p| !is_memory(plan, &p.result_name));
    match need {
        Need::Mib(_) if has_whole => return GpuMask::EMPTY,
        Need::Whole(_) if memory_gpu.is_some() => return GpuMask::EMPTY,
        _ => {}
    }
    let mut mask = GpuMask::EMPTY;
    'device: for &d in selected {
        let device = &candidate.devices[d];
        let Some(position) = positions[d] else { continue };
        if let Some(g) = memory_gpu
            && candidate.state.gpus()[position].index != g
        {
            continue;
        }
        for (x, constraint) in plan.constraints.iter().enumerate() {
            if !constraint.covers(request) {
                continue;
            }
            let value = attribute(device, &constraint.attribute, driver).and_then(value_of);
            let Some(value) = value else { continue 'device };
            if constraint.same {
                if restriction.get(&x).is_some_and(|v| *v != value) {
                    continue 'device;
                }
            } else {
                let used = picked
                    .iter()
                    .filter(|p| constraint.covers(request_of(&p.result_name)))
                    .any(|p| {
                        candidate
                            .devices
                            .iter()
                            .find(|d| device_index(&d.name) == Some(p.index))
                            .and_then(|d| attribute(d, &constraint.attribute, driver))
                            .and_then(value_of)
                            .is_some_and(|v| v == value)
                    });
                if used {
                    continue 'device;
                }
            }
        }
        mask = mask.with(position);
    }
    // Several GPUs of one request under a distinct constraint: one candidate per value (the freest),
    // so whatever set the ranking takes meets it.
    if let Need::Whole(n) = need
        && n > 1
    {
        for constraint in plan.constraints.iter().filter(|c| !c.same && c.covers(request)) {
            let mut best: HashMap<String, usize> = HashMap::new();
            for (d, device) in candidate.devices.iter().enumerate() {
                let Some(p) = positions[d].filter(|&p| mask.contains(p)) else {
                    continue;
                };
                let Some(value) = attribute(device, &constraint.attribute, driver).and_then(value_of) else {
                    continue;
                };
                let free = |p: usize| candidate.state.gpus()[p].free_mib();
                let slot = best.entry(value).or_insert(p);
                if free(p) > free(*slot) {
                    *slot = p;
                }
            }
            mask = best.into_values().fold(GpuMask::EMPTY, GpuMask::with);
        }
    }
    mask
}

/// The request's part of a result name (`request/subrequest`).
fn request_of(result_name: &str) -> &str {
    result_name.split('/').next().unwrap_or(result_name)
}

/// Whether the alternative a pick came from asks memory.
fn is_memory(plan: &ClaimPlan, result_name: &str) -> bool {
    plan.requests
        .iter()
        .flat_map(|r| &r.alternatives)
        .find(|a| a.result_name == result_name)
        .is_some_and(|a| matches!(a.need, Need::Mib(_)))
}

/// Whether claim `i`'s picks on `p` so far meet its distinct constraints (a request of several GPUs
/// may have taken two of one value).
fn satisfies(plan: &ClaimPlan, i: usize, p: &Partial, candidates: &[DraNode], driver: &str) -> bool {
    let devices = &candidates[p.candidate].devices;
    plan.constraints.iter().filter(|c| !c.same).all(|c| {
        let mut seen = BTreeSet::new();
        p.picks[i]
            .iter()
            .filter(|pick| c.covers(request_of(&pick.result_name)))
            .all(|pick| {
                devices
                    .iter()
                    .find(|d| device_index(&d.name) == Some(pick.index))
                    .and_then(|d| attribute(d, &c.attribute, driver))
                    .and_then(value_of)
                    .is_some_and(|v| seen.insert(v))
            })
    })
}

/// `state` with only the GPUs of `eligible` usable (the others shown unhealthy), shared when that is
/// all of its healthy GPUs already.
fn restricted(state: &Arc<NodeSnapshot>, eligible: GpuMask) -> Arc<NodeSnapshot> {
    if eligible == state.summary().healthy {
        return Arc::clone(state);
    }
    let mut copy = (**state).clone();
    for (p, gpu) in copy.gpus_mut().iter_mut().enumerate() {
        gpu.healthy &= eligible.contains(p);
    }
    Arc::new(copy)
}

/// Ranks `asks` (partial, state) for `need`, in calls where each node name appears once.
fn rank_unique(asks: &[(usize, Arc<NodeSnapshot>)], need: Need, rank: &Rank) -> Vec<(usize, Option<Ranked>)> {
    let mut out = Vec::with_capacity(asks.len());
    let mut rest: Vec<&(usize, Arc<NodeSnapshot>)> = asks.iter().collect();
    while !rest.is_empty() {
        let mut names = BTreeSet::new();
        let (batch, later): (Vec<_>, Vec<_>) =
            rest.into_iter().partition(|(_, s)| names.insert(s.name.clone()));
        let states: Vec<Arc<NodeSnapshot>> = batch.iter().map(|(_, s)| Arc::clone(s)).collect();
        for ((p, _), ranked) in batch.iter().zip(rank(&states, need)) {
            out.push((*p, ranked));
        }
        rest = later;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::claims::{Constraint, RequestAsk};
    use super::*;
    use crate::scorer::state::GpuSnapshot;

    /// A device of the driver for GPU `index`, with string attributes.
    fn device(index: u32, attributes: &[(&str, &str)]) -> Device {
        Device {
            name: format!("gpu-{index}"),
            attributes: Some(
                attributes
                    .iter()
                    .map(|(k, v)| {
                        let value = DeviceAttribute {
                            string: Some(v.to_string()),
                            ..Default::default()
                        };
                        (k.to_string(), value)
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    /// Node `name`: GPUs of (model, MiB, allocated MiB), each a device with its model, NVLink island
    /// and PCIe root as attributes.
    fn node(name: &str, gpus: &[(&str, u64, u64, &str, &str)]) -> DraNode {
        let snapshots = gpus
            .iter()
            .enumerate()
            .map(|(i, (model, memory, used, _, _))| GpuSnapshot::for_tests(i, model, *memory, *used))
            .collect();
        let devices = gpus
            .iter()
            .enumerate()
            .map(|(i, (model, _, _, island, root))| {
                device(
                    i as u32,
                    &[
                        ("productName", model),
                        ("nvlinkDomain", island),
                        ("resource.kubernetes.io/pcieRoot", root),
                    ],
                )
            })
            .collect();
        DraNode {
            state: Arc::new(NodeSnapshot::with_gpus(name, 1, snapshots)),
            devices: Arc::new(devices),
        }
    }

    /// A ranking that packs: memory on the GPU it fills most, whole GPUs the lowest idle ones; a
    /// fuller node ranks higher.
    fn rank(nodes: &[Arc<NodeSnapshot>], need: Need) -> Vec<Option<Ranked>> {
        let mut names = BTreeSet::new();
        assert!(
            nodes.iter().all(|n| names.insert(n.name.clone())),
            "a name twice in one call"
        );
        nodes
            .iter()
            .map(|n| {
                let usable = |p: &usize| n.gpus()[*p].healthy;
                let used: u64 = n.gpus().iter().map(|g| g.allocated_mib).sum();
                match need {
                    Need::Mib(m) => (0..n.gpus().len())
                        .filter(usable)
                        .filter(|&p| n.gpus()[p].free_mib() >= m)
                        .min_by_key(|&p| n.gpus()[p].free_mib())
                        .map(|p| Ranked {
                            raw: used as f64 / 1e6,
                            gpus: GpuMask::single(p),
                        }),
                    Need::Whole(c) => {
                        let idle: Vec<usize> = (0..n.gpus().len())
                            .filter(usable)
                            .filter(|&p| n.gpus()[p].is_idle())
                            .take(c as usize)
                            .collect();
                        (idle.len() == c as usize).then(|| Ranked {
                            raw: used as f64 / 1e6,
                            gpus: idle.into_iter().fold(GpuMask::EMPTY, GpuMask::with),
                        })
                    }
                }
            })
            .collect()
    }

    /// Selectors written as `attribute=value` (fully qualified), each needing the device's string.
    fn selects(node: &DraNode, alt: &Alternative) -> Result<Vec<usize>, String> {
        select_each(node, |device| {
            Ok(alt.selectors.iter().all(|s| {
                let (name, value) = s.split_once('=').unwrap_or((s, ""));
                match attribute(device, name, "gpumem.io").and_then(|a| a.string.as_deref()) {
                    Some(v) => v == value,
                    None => false,
                }
            }))
        })
    }

    fn alt(result_name: &str, need: Need, selectors: &[&str]) -> Alternative {
        Alternative {
            result_name: result_name.into(),
            class: "gpu.gpumem.io".into(),
            selectors: selectors.iter().map(|s| s.to_string()).collect(),
            need,
        }
    }

    fn plan(key: &str, requests: Vec<(&str, Vec<Alternative>)>, constraints: Vec<Constraint>) -> ClaimPlan {
        ClaimPlan {
            key: key.into(),
            requests: requests
                .into_iter()
                .map(|(name, alternatives)| RequestAsk {
                    name: name.into(),
                    alternatives,
                })
                .collect(),
            constraints,
        }
    }

    fn one(key: &str, a: Alternative) -> ClaimPlan {
        plan(key, vec![(a.result_name.clone().as_str(), vec![a])], Vec::new())
    }

    /// Each claim's picks: (result, index, MiB).
    type Picks = Vec<Vec<(String, u32, u64)>>;

    /// The node and the picks.
    fn run(plans: &[ClaimPlan], nodes: &[DraNode]) -> Result<(String, Picks), String> {
        let p = place(plans, nodes, "gpumem.io", &selects, &rank).map_err(|e| e.to_string())?;
        let picks = p
            .picks
            .iter()
            .map(|c| {
                c.iter()
                    .map(|p| (p.result_name.clone(), p.index, p.mib))
                    .collect()
            })
            .collect();
        Ok((p.node, picks))
    }

    const T4: &str = "Tesla T4";
    const V100: &str = "Tesla V100";

    #[test]
    fn selectors_narrow_the_gpus_and_the_fullest_node_wins() {
        let a = node("a", &[(V100, 32768, 0, "i0", "r0"), (T4, 15360, 0, "", "r1")]);
        let b = node("b", &[(T4, 15360, 8000, "", "r0"), (V100, 32768, 0, "", "r1")]);
        let t4 = one(
            "ns/c",
            alt("gpu", Need::Mib(5000), &["gpumem.io/productName=Tesla T4"]),
        );
        let (node, picks) = run(&[t4], &[a.clone(), b.clone()]).expect("placed");
        assert_eq!(
            (node.as_str(), picks[0][0].1),
            ("b", 0),
            "the T4 already in use, on the fuller node"
        );
        let v100 = one(
            "ns/c",
            alt("gpu", Need::Mib(30000), &["gpumem.io/productName=Tesla V100"]),
        );
        let (_, picks) = run(&[v100], &[a.clone(), b.clone()]).expect("placed");
        assert_eq!(picks[0][0].2, 30000);
        let none = one(
            "ns/c",
            alt("gpu", Need::Mib(40000), &["gpumem.io/productName=Tesla V100"]),
        );
        let err = run(&[none], &[a, b]).expect_err("no V100 has 40000 MiB");
        assert!(err.contains("no room for claim ns/c request \"gpu\""), "{err}");
    }

    #[test]
    fn a_match_constraint_keeps_a_pair_on_one_island() {
        // Island i0 has one idle GPU left, i1 two: the pair goes to i1 though GPU 0 is lower.
        let n = node(
            "n",
            &[
                (V100, 32768, 0, "i0", "r0"),
                (V100, 32768, 1000, "i0", "r0"),
                (V100, 32768, 0, "i1", "r1"),
                (V100, 32768, 0, "i1", "r1"),
            ],
        );
        let pair = plan(
            "ns/c",
            vec![("gpu", vec![alt("gpu", Need::Whole(2), &[])])],
            vec![Constraint {
                requests: Vec::new(),
                attribute: "gpumem.io/nvlinkDomain".into(),
                same: true,
            }],
        );
        let (_, picks) = run(std::slice::from_ref(&pair), std::slice::from_ref(&n)).expect("placed");
        let gpus: Vec<u32> = picks[0].iter().map(|p| p.1).collect();
        assert_eq!(gpus, [2, 3]);
        assert_eq!(picks[0][0].2, 32768, "a whole GPU consumes all its memory");
        // Without the constraint the ranking takes the lowest idle ones.
        let free = plan(
            "ns/c",
            pair.requests
                .iter()
                .map(|r| (r.name.as_str(), r.alternatives.clone()))
                .collect(),
            Vec::new(),
        );
        let (_, picks) = run(&[free], &[n]).expect("placed");
        assert_eq!(picks[0].iter().map(|p| p.1).collect::<Vec<_>>(), [0, 2]);
    }

    #[test]
    fn a_claims_memory_requests_share_one_gpu_with_room_for_all() {
        // GPU 0 has room for the first request only; GPU 1 for both.
        let n = node("n", &[(T4, 15360, 12000, "", "r0"), (T4, 15360, 5000, "", "r0")]);
        let two = plan(
            "ns/c",
            vec![
                ("a", vec![alt("a", Need::Mib(3000), &[])]),
                ("b", vec![alt("b", Need::Mib(4000), &[])]),
            ],
            Vec::new(),
        );
        let (_, picks) = run(&[two], &[n]).expect("placed");
        assert_eq!(picks[0], [("a".to_string(), 1, 3000), ("b".to_string(), 1, 4000)]);
    }

    #[test]
    fn the_first_alternative_that_fits_is_taken() {
        let n = node(
            "n",
            &[
                (T4, 15360, 0, "", "r0"),
                (T4, 15360, 0, "", "r0"),
                (V100, 32768, 9, "", "r1"),
            ],
        );
        let any = plan(
            "ns/c",
            vec![(
                "any",
                vec![
                    alt("any/v100", Need::Whole(1), &["gpumem.io/productName=Tesla V100"]),
                    alt("any/four", Need::Whole(4), &[]),
                    alt("any/two", Need::Whole(2), &[]),
                ],
            )],
            Vec::new(),
        );
        let (_, picks) = run(&[any], &[n]).expect("placed");
        assert_eq!(
            picks[0].iter().map(|p| p.0.as_str()).collect::<Vec<_>>(),
            ["any/two", "any/two"]
        );
    }

    #[test]
    fn several_claims_go_to_one_node_and_see_each_other() {
        let a = node("a", &[(T4, 15360, 0, "", "r0")]);
        let b = node("b", &[(T4, 15360, 0, "", "r0"), (T4, 15360, 0, "", "r1")]);
        let first = one("ns/one", alt("gpu", Need::Whole(1), &[]));
        let second = one("ns/two", alt("gpu", Need::Whole(1), &[]));
        let (chosen, picks) = run(&[first, second], &[a, b]).expect("placed");
        assert_eq!(chosen, "b", "only b has two GPUs");
        assert_eq!((picks[0][0].1, picks[1][0].1), (0, 1));
        // A memory request and a whole GPU in one claim: never on one GPU, never both.
        let n = node("n", &[(T4, 15360, 0, "", "r0"), (T4, 15360, 0, "", "r1")]);
        let mixed = plan(
            "ns/c",
            vec![
                ("mem", vec![alt("mem", Need::Mib(1000), &[])]),
                ("whole", vec![alt("whole", Need::Whole(1), &[])]),
            ],
            Vec::new(),
        );
        let err = run(&[mixed], &[n]).expect_err("the agent serves a claim's memory from one GPU alone");
        assert!(err.contains("request \"whole\""), "{err}");
    }

    #[test]
    fn a_distinct_constraint_spreads_the_picks() {
        let n = node(
            "n",
            &[
                (T4, 15360, 0, "", "r0"),
                (T4, 15360, 0, "", "r0"),
                (T4, 15360, 0, "", "r1"),
            ],
        );
        let spread = plan(
            "ns/c",
            vec![
                ("a", vec![alt("a", Need::Whole(1), &[])]),
                ("b", vec![alt("b", Need::Whole(1), &[])]),
            ],
            vec![Constraint {
                requests: Vec::new(),
                attribute: "resource.kubernetes.io/pcieRoot".into(),
                same: false,
            }],
        );
        let (_, picks) = run(&[spread], std::slice::from_ref(&n)).expect("placed");
        assert_eq!((picks[0][0].1, picks[0][1].1), (0, 2));
        // Two GPUs of one request under the constraint: each must differ too.
        let pair = plan(
            "ns/c",
            vec![("a", vec![alt("a", Need::Whole(2), &[])])],
            vec![Constraint {
                requests: Vec::new(),
                attribute: "resource.kubernetes.io/pcieRoot".into(),
                same: false,
            }],
        );
        let (_, picks) = run(&[pair], &[n]).expect("placed");
        assert_eq!((picks[0][0].1, picks[0][1].1), (0, 2), "one GPU of each root");
    }

    #[test]
    fn a_selector_that_cannot_be_evaluated_stops_the_placement_as_in_kube_scheduler() {
        let n = node("n", &[(T4, 15360, 0, "", "r0")]);
        let failing =
            |node: &DraNode, _: &Alternative| select_each(node, |_| Err("no such key: memoryGiB".into()));
        let err = place(
            &[one("ns/c", alt("gpu", Need::Mib(1), &[]))],
            &[n],
            "gpumem.io",
            &failing,
            &rank,
        )
        .expect_err("no answer for the device");
        assert_eq!(
            err,
            Unplaced::Selector("node n device gpu-0: no such key: memoryGiB".into())
        );
        assert!(matches!(
            place(&[], &[], "gpumem.io", &selects, &rank),
            Err(Unplaced::NoRoom(_))
        ));
    }

    #[test]
    fn the_memo_evaluates_a_node_once_per_selector_list_until_its_devices_change() {
        let t4 = node("n", &[(T4, 15360, 0, "", "r0"), (V100, 32768, 0, "", "r0")]);
        let evaluations = std::cell::Cell::new(0);
        let mut memo = SelectionMemo::default();
        let mut select = |n: &DraNode, selectors: &[&str]| {
            let list = selectors.iter().map(|s| s.to_string()).collect();
            memo.select(n, list, || {
                evaluations.set(evaluations.get() + 1);
                selects(n, &alt("gpu", Need::Mib(1), selectors))
            })
        };
        let on_t4 = format!("gpumem.io/productName={T4}");
        assert_eq!(select(&t4, &[&on_t4]), Ok(vec![0]));
        assert_eq!(select(&t4, &[&on_t4]), Ok(vec![0]), "the same answer again");
        assert_eq!(evaluations.get(), 1, "from the memo the second time");
        assert_eq!(select(&t4, &[]), Ok(vec![0, 1]), "another list is its own entry");
        assert_eq!(evaluations.get(), 2);
        // The node publishes again (a new slice, the same name): its answers start over.
        let republished = node("n", &[(V100, 32768, 0, "", "r0"), (T4, 15360, 0, "", "r0")]);
        assert_eq!(select(&republished, &[&on_t4]), Ok(vec![1]));
        assert_eq!(evaluations.get(), 3);
        // An error is an answer too, kept as such.
        let mut failing = 0;
        for _ in 0..2 {
            let got = memo.select(&t4, vec!["broken".into()], || {
                failing += 1;
                select_each(&t4, |_| Err("no such key".into()))
            });
            assert_eq!(got, Err("node n device gpu-0: no such key".into()));
        }
        assert_eq!(failing, 1);
        memo.retain(|n| n != "n");
        assert_eq!(memo.nodes(), 0, "a node gone is forgotten");
    }

    #[test]
    fn the_models_a_request_is_restricted_to_are_those_its_selectors_take() {
        let a = node("a", &[(V100, 32768, 0, "i0", "r0"), (T4, 15360, 0, "", "r1")]);
        let b = node("b", &[(T4, 15360, 8000, "", "r0")]);
        let candidates = [a, b];
        let t4 = alt("gpu", Need::Mib(4000), &[&format!("productName={T4}")]);
        assert_eq!(
            models_taken(&candidates, &t4, &selects),
            Some(BTreeSet::from([T4.to_string()]))
        );
        let any = alt("gpu", Need::Mib(4000), &[]);
        assert_eq!(
            models_taken(&candidates, &any, &selects),
            None,
            "every model: no restriction"
        );
        let none = alt("gpu", Need::Mib(4000), &["productName=H100"]);
        assert_eq!(models_taken(&candidates, &none, &selects), Some(BTreeSet::new()));
    }
}
