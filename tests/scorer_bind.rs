//! bind and preempt over HTTP, against a fake Kubernetes API server on 127.0.0.1 reached through kube's
//! client: the GPU choice recorded on the pod before the Binding, no double-booking under concurrent
//! binds, the ledger released on failure, and GPU-aware victim selection.

mod scorer_support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use gpumem::scorer::Scorer;
use gpumem::scorer::cache::NodeCache;
use gpumem::scorer::config::ScorerConfig;
use gpumem::scorer::metrics::HoldLabel;
use gpumem::scorer::pods::PodCache;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};

use scorer_support::*;

async fn setup(nodes: &[Value], pods: &[Value]) -> (std::net::SocketAddr, Arc<Scorer>, Arc<FakeApi>) {
    let api = Arc::new(FakeApi::default());
    nodes.iter().for_each(|n| api.add_node(n));
    pods.iter().for_each(|p| api.add_pod(p));
    let client = fake_api(api.clone()).await;
    let (addr, scorer) = start(Scorer::new(ScorerConfig::default(), Some(client), None, None)).await;
    (addr, scorer, api)
}

fn bind_args(pod: &str, node: &str) -> Value {
    json!({"PodName": pod, "PodNamespace": "team-a", "PodUID": format!("uid-{pod}"), "Node": node})
}

#[tokio::test]
async fn bind_creates_one_binding_that_carries_the_gpu_choice() {
    // The fixture pod (5000 MiB) onto the fixture node "one-big" (one GPU, 6000 MiB free).
    let nodes = fixture_json("nodes.json")["items"]
        .as_array()
        .expect("items")
        .clone();
    let (addr, _, api) = setup(&nodes, &[fixture_json("pod.json")]).await;
    let (status, r) = post_json(addr, "/bind", &fixture_json("bind.json")).await;
    assert_eq!(status, 200);
    assert_eq!(r, json!({"Error": ""}));
    let seen = api.seen();
    let writes: Vec<&Seen> = seen.iter().filter(|s| s.method != "GET").collect();
    assert_eq!(
        writes.len(),
        2,
        "two writes per bind, the booking and the Binding: {seen:?}"
    );
    let read = seen
        .iter()
        .find(|s| s.method == "GET" && s.path.contains("/pods/"))
        .expect("the pod is read");
    assert!(
        read.query.contains("resourceVersion=0"),
        "read from the API server's cache: {read:?}"
    );
    // The booking comes first: another replica sees the GPU taken before the pod is bound.
    assert_eq!(writes[0].method, "POST");
    assert_eq!(
        writes[0].path,
        "/apis/coordination.k8s.io/v1/namespaces/gpumem-system/leases"
    );
    assert_eq!(writes[0].body["metadata"]["name"], "gpumem-bookings-one-big");
    let booked: Value = serde_json::from_str(
        writes[0].body["metadata"]["annotations"]["gpumem.io/bookings"]
            .as_str()
            .expect("bookings"),
    )
    .expect("JSON");
    assert_eq!(booked[0]["pod"], "team-a/infer-0");
    assert_eq!(booked[0]["gpus"], json!(["GPU-big-0"]));
    assert_eq!(booked[0]["mib"], 5000);
    let writes = &writes[1..];
    assert_eq!(writes[0].method, "POST");
    assert_eq!(writes[0].path, "/api/v1/namespaces/team-a/pods/infer-0/binding");
    assert_eq!(
        writes[0].body["target"],
        json!({"apiVersion": "v1", "kind": "Node", "name": "one-big"})
    );
    assert_eq!(writes[0].body["metadata"]["name"], "infer-0");
    let ann = &writes[0].body["metadata"]["annotations"];
    assert_eq!(ann["gpumem.io/assigned-gpus"], "GPU-big-0");
    assert!(
        ann["gpumem.io/assigned-at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{ann}"
    );
    // As the API server does: the pod is bound with the annotations in one update.
    let pod = api.pod("team-a/infer-0").expect("pod");
    assert_eq!(pod["spec"]["nodeName"], "one-big");
    assert_eq!(
        pod["metadata"]["annotations"]["gpumem.io/assigned-gpus"],
        "GPU-big-0"
    );
    api.assert_all_granted();
}

/// kube-scheduler starts the next pod's cycle while a bind is on its way: a pod `filter` saw is reserved
/// as soon as its bind arrives, before the pod is read from the API server, so the next `filter` does
/// not offer the same room (and its bind then fail).
#[tokio::test]
async fn a_filtered_pod_is_reserved_before_its_bind_reads_the_api_server() {
    let node = || node_json("n", &[g(16384, 10384), g(16384, 14384)]);
    let pods = [
        pod_json("p1", 5000, 0, json!({}), json!({})),
        pod_json("p2", 5000, 0, json!({}), json!({})),
    ];
    let (addr, _, api) = setup(&[node()], &pods).await;
    let (_, r) = post_json(addr, "/filter", &args_nodes(&pods[0], &[node()])).await;
    assert_eq!(r["Nodes"]["items"].as_array().map(Vec::len), Some(1), "{r}");
    *api.pod_get_delay.lock().expect("lock") = Duration::from_millis(500);
    let bind = tokio::spawn(async move { post_json(addr, "/bind", &bind_args("p1", "n")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (_, r) = post_json(addr, "/filter", &args_nodes(&pods[1], &[node()])).await;
    assert_eq!(
        r["Nodes"]["items"],
        json!([]),
        "p1's room is held while its bind reads the pod: {r}"
    );
    let (_, r) = bind.await.expect("bind");
    assert_eq!(r["Error"], "", "{r}");
    // A bind kube-scheduler sends without a filter first (a restarted scorer) reads the pod, then reserves.
    let (_, r) = post_json(addr, "/bind", &bind_args("p2", "n")).await;
    assert!(
        r["Error"]
            .as_str()
            .is_some_and(|e| e.contains("largest free GPU has 2000 MiB")),
        "{r}"
    );
    api.assert_all_granted();
}

#[tokio::test]
async fn bind_uses_the_policy_choice_of_gpu() {
    // 4000 MiB: GPU 0 (8192 MiB, idle) is the first fit and the best fit, GPU 1 (16384 MiB) is already
    // shared, GPU 2 idle. Fragmentation-aware choice: GPU 1, keeping both idle GPUs whole.
    let node = node_json("n", &[g(8192, 0), g(16384, 6384), g(16384, 0)]);
    let pod = pod_json(
        "p",
        4000,
        0,
        json!({}),
        json!({"gpumem.io/workload-class": "offline"}),
    );
    let (addr, _, api) = setup(&[node], &[pod]).await;
    let (_, r) = post_json(addr, "/bind", &bind_args("p", "n")).await;
    assert_eq!(r["Error"], "");
    let binding = api
        .seen()
        .into_iter()
        .find(|s| s.method == "POST" && s.path.ends_with("/binding"))
        .expect("bound");
    assert_eq!(
        binding.body["metadata"]["annotations"]["gpumem.io/assigned-gpus"],
        uuid("n", 1)
    );
    api.assert_all_granted();
}

/// How many times the scorer read a bookings Lease.
fn lease_reads(api: &FakeApi) -> usize {
    api.seen()
        .iter()
        .filter(|s| s.method == "GET" && s.path.contains("/leases/"))
        .count()
}

/// The bookings annotation of `node`'s Lease.
fn bookings_of(api: &FakeApi, node: &str) -> String {
    let lease = api
        .lease(&format!("gpumem-system/gpumem-bookings-{node}"))
        .expect("the node's Lease");
    lease["metadata"]["annotations"]["gpumem.io/bookings"]
        .as_str()
        .expect("bookings")
        .to_string()
}

fn kept_names(r: &Value) -> Vec<String> {
    r["Nodes"]["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|n| n["metadata"]["name"].as_str().expect("name").to_string())
        .collect()
}

fn score_of(r: &Value, host: &str) -> i64 {
    r.as_array()
        .expect("host priorities")
        .iter()
        .find(|h| h["Host"] == host)
        .and_then(|h| h["Score"].as_i64())
        .expect("scored")
}

/// kube-scheduler tries a pod again after its extender timeout while the first bind still runs: the
/// second is refused, and the first's reservation and booking stay (the second's failed Binding used to
/// take them back, freeing the GPU the pod was just bound to).
#[tokio::test]
async fn a_second_bind_of_a_pod_in_flight_is_refused_and_takes_nothing_back() {
    let node = node_json("n", &[g(16384, 0), g(16384, 0)]);
    let pods = [pod_json("p1", 12000, 0, json!({}), json!({}))];
    let (addr, scorer, api) = setup(&[node], &pods).await;
    *api.binding_delay.lock().expect("lock") = Duration::from_millis(400);
    let first = tokio::spawn(async move { post_json(addr, "/bind", &bind_args("p1", "n")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (_, second) = post_json(addr, "/bind", &bind_args("p1", "n")).await;
    assert!(
        second["Error"]
            .as_str()
            .is_some_and(|e| e.contains("still on its way")),
        "{second}"
    );
    let (_, first) = first.await.expect("first bind");
    assert_eq!(first["Error"], "", "{first}");
    assert_eq!(scorer.ledger.len(), 1, "the first bind's reservation stays");
    let booked = bookings_of(&api, "n");
    assert!(booked.contains("team-a/p1"), "{booked}");
    // kube-scheduler's retry after the first ended (filtered, so reserved and bound without reading
    // the pod) finds the pod bound (the API server refuses its Binding): it takes back nothing,
    // neither its own reservation nor the first's.
    let nodes = [node_json("n", &[g(16384, 12000), g(16384, 0)])];
    post_json(addr, "/filter", &args_nodes(&pods[0], &nodes)).await;
    let (_, again) = post_json(addr, "/bind", &bind_args("p1", "n")).await;
    assert!(
        again["Error"]
            .as_str()
            .is_some_and(|e| e.contains("already assigned")),
        "{again}"
    );
    assert_eq!(
        scorer.ledger.len(),
        2,
        "both stay until the annotation shows the pod"
    );
    let booked = bookings_of(&api, "n");
    assert!(booked.contains("team-a/p1"), "{booked}");
    api.assert_all_granted();
}

/// A pod `filter` saw is bound without reading it again (the Binding names its UID, and the API server
/// refuses it for a pod bound or deleted meanwhile): two requests per bind, the booking and the Binding.
/// Its scheduler is still checked.
#[tokio::test]
async fn a_filtered_pod_is_bound_without_reading_it() {
    let node = node_json("n", &[g(16384, 0)]);
    let mut other = pod_json("p2", 4000, 0, json!({}), json!({}));
    other["spec"]["schedulerName"] = json!("someone-else");
    let pods = [pod_json("p1", 4000, 0, json!({}), json!({})), other];
    let (addr, _, api) = setup(std::slice::from_ref(&node), &pods).await;
    for pod in &pods {
        post_json(addr, "/filter", &args_nodes(pod, std::slice::from_ref(&node))).await;
    }
    let (_, r) = post_json(addr, "/bind", &bind_args("p1", "n")).await;
    assert_eq!(r["Error"], "", "{r}");
    assert_eq!(assigned(&api, "p1").as_deref(), Some("GPU-n-0"));
    let (_, r) = post_json(addr, "/bind", &bind_args("p2", "n")).await;
    assert!(
        r["Error"].as_str().is_some_and(|e| e.contains("someone-else")),
        "{r}"
    );
    let pod_reads: Vec<Seen> = api
        .seen()
        .into_iter()
        .filter(|s| s.method == "GET" && s.path.contains("/pods/"))
        .collect();
    assert!(pod_reads.is_empty(), "{pod_reads:?}");
    let binding = api
        .seen()
        .into_iter()
        .find(|s| s.method == "POST" && s.path.ends_with("/binding"))
        .expect("the Binding");
    assert_eq!(
        binding.body["metadata"]["uid"], "uid-p1",
        "the UID kube-scheduler sent"
    );
    api.assert_all_granted();
}

/// kube-scheduler does not call `prioritize` when one node passes `filter`: `filter` holds that node's
/// room, and the next pod is offered the others.
#[tokio::test]
async fn the_only_node_a_pod_passes_is_held_by_filter() {
    let nodes = [
        node_json("tight", &[g(16384, 10384)]),
        node_json("small", &[g(16384, 12384)]),
        node_json("roomy", &[g(16384, 0)]),
    ];
    let pods = [
        pod_json("p1", 16000, 0, json!({}), json!({})),
        pod_json("p2", 5000, 0, json!({}), json!({})),
    ];
    let (addr, scorer, _) = setup(&nodes, &pods).await;
    let (_, r) = post_json(addr, "/filter", &args_nodes(&pods[0], &nodes)).await;
    assert_eq!(kept_names(&r), ["roomy"], "{r}");
    assert_eq!(scorer.metrics.holds.get(), 1, "held by filter");
    let (_, r) = post_json(addr, "/filter", &args_nodes(&pods[1], &nodes)).await;
    assert_eq!(kept_names(&r), ["tight"], "roomy's room is p1's: {r}");
}

/// A bind refused for want of room wrote nothing: the next bind to the node goes on from the Lease as
/// read, without reading it again.
#[tokio::test]
async fn a_refused_bind_keeps_the_lease_as_read_for_the_next() {
    let node = node_json("n", &[g(16384, 0)]);
    let pods = [
        pod_json("p1", 12000, 0, json!({}), json!({})),
        pod_json("p2", 12000, 0, json!({}), json!({})),
        pod_json("p3", 4000, 0, json!({}), json!({})),
    ];
    let (addr, _, api) = setup(&[node], &pods).await;
    for (pod, fits) in [("p1", true), ("p2", false), ("p3", true)] {
        let (_, r) = post_json(addr, "/bind", &bind_args(pod, "n")).await;
        assert_eq!(r["Error"] == "", fits, "{pod}: {r}");
    }
    let lease_reads = lease_reads(&api);
    assert_eq!(lease_reads, 1, "{:?}", api.seen());
    api.assert_all_granted();
}

/// kube-scheduler ranks the next pod before the last pod's bind has arrived: the GPU `prioritize`
/// ranked first is held for its pod, so the next pod is filtered and ranked around it (without the
/// hold it went to the same node, and its bind was refused).
#[tokio::test]
async fn the_gpu_ranked_first_is_held_until_its_pods_bind() {
    // "tight": 6000 MiB free, the best fit for 5000; "roomy": an idle GPU.
    let nodes = [
        node_json("tight", &[g(16384, 10384)]),
        node_json("roomy", &[g(16384, 0)]),
    ];
    let pods = [
        pod_json("p1", 5000, 0, json!({}), json!({})),
        pod_json("p2", 5000, 0, json!({}), json!({})),
    ];
    let (addr, scorer, api) = setup(&nodes, &pods).await;
    let (_, r) = post_json(addr, "/prioritize", &args_nodes(&pods[0], &nodes)).await;
    assert!(score_of(&r, "tight") > score_of(&r, "roomy"), "{r}");
    assert_eq!(scorer.metrics.holds.get(), 1);

    let (_, r) = post_json(addr, "/filter", &args_nodes(&pods[1], &nodes)).await;
    assert_eq!(kept_names(&r), ["roomy"], "tight's room is p1's: {r}");
    let (_, r) = post_json(addr, "/filter", &args_nodes(&pods[0], &nodes)).await;
    assert_eq!(
        kept_names(&r),
        ["tight", "roomy"],
        "p1's own hold is not in its way: {r}"
    );

    let (_, r) = post_json(addr, "/bind", &bind_args("p1", "tight")).await;
    assert_eq!(r["Error"], "", "{r}");
    assert_eq!(assigned(&api, "p1").as_deref(), Some("GPU-tight-0"));
    assert_eq!(
        scorer.metrics.holds.get(),
        1,
        "the bind ends p1's hold; p2's stays (filter kept roomy alone for it)"
    );
    assert_eq!(binds(&scorer, "on_hold"), 1, "bound where it was held");
    assert_eq!(scorer.ledger.len(), 1, "the ledger holds the room now");
    let (_, r) = post_json(addr, "/filter", &args_nodes(&pods[1], &nodes)).await;
    assert_eq!(kept_names(&r), ["roomy"], "{r}");
    api.assert_all_granted();
}

/// The scorer's count of binds by where they went against the pod's hold.
fn binds(scorer: &Scorer, hold: &'static str) -> u64 {
    scorer.metrics.binds.get_or_create(&HoldLabel { hold }).get()
}

/// A bind waiting for its node's turn (another bind is writing the node's Lease) keeps its pod's hold
/// until its room is in the ledger: the next pod's `filter` meanwhile does not see that room free.
#[tokio::test]
async fn a_hold_stands_while_its_bind_waits_for_the_nodes_turn() {
    // Two GPUs with 6000 MiB free each: room for two 5000 MiB pods, not three.
    let node = node_json("n", &[g(16384, 10384), g(16384, 10384)]);
    let pods = [
        pod_json("p1", 5000, 0, json!({}), json!({})),
        pod_json("p2", 5000, 0, json!({}), json!({})),
        pod_json("p3", 5000, 0, json!({}), json!({})),
    ];
    let (addr, scorer, api) = setup(std::slice::from_ref(&node), &pods).await;
    let one = std::slice::from_ref(&node);
    post_json(addr, "/prioritize", &args_nodes(&pods[1], one)).await;
    assert_eq!(scorer.metrics.holds.get(), 1, "p2 holds a GPU");
    *api.lease_write_delay.lock().expect("lock") = Duration::from_millis(600);
    let first = tokio::spawn(async move { post_json(addr, "/bind", &bind_args("p1", "n")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let second = tokio::spawn(async move { post_json(addr, "/bind", &bind_args("p2", "n")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    // p1 reserved the other GPU and writes the Lease; p2 waits for its turn.
    let (_, r) = post_json(addr, "/filter", &args_nodes(&pods[2], one)).await;
    assert!(kept_names(&r).is_empty(), "both GPUs are spoken for: {r}");
    let (_, first) = first.await.expect("p1's bind");
    let (_, second) = second.await.expect("p2's bind");
    assert_eq!(first["Error"], "", "{first}");
    assert_eq!(second["Error"], "", "{second}");
    let gpus: BTreeSet<String> = ["p1", "p2"].iter().filter_map(|p| assigned(&api, p)).collect();
    assert_eq!(gpus.len(), 2, "one GPU each: {gpus:?}");
    assert_eq!(scorer.metrics.holds.get(), 0);
}

/// Among equal nodes kube-scheduler would pick at random, and mostly not the one holding the pod's
/// GPU: the node ranked first alone keeps the top score, and that is the node holding it.
#[tokio::test]
async fn of_equal_nodes_the_one_holding_the_gpu_alone_scores_top() {
    let nodes = [
        node_json("a", &[g(16384, 10384)]),
        node_json("b", &[g(16384, 10384)]),
        node_json("c", &[g(16384, 10384)]),
    ];
    let pods = [
        pod_json("p1", 5000, 0, json!({}), json!({})),
        pod_json("p2", 5000, 0, json!({}), json!({})),
    ];
    let (addr, scorer, _) = setup(&nodes, &pods).await;
    let (_, r) = post_json(addr, "/prioritize", &args_nodes(&pods[0], &nodes)).await;
    let scores: Vec<i64> = ["a", "b", "c"].iter().map(|n| score_of(&r, n)).collect();
    let top = *scores.iter().max().expect("scores");
    assert_eq!(scores.iter().filter(|s| **s == top).count(), 1, "{r}");
    let held = ["a", "b", "c"][scores.iter().position(|s| *s == top).expect("top")];
    // The next pod finds that node's room taken, the others' free.
    let (_, r) = post_json(addr, "/filter", &args_nodes(&pods[1], &nodes)).await;
    let kept = kept_names(&r);
    assert_eq!(kept.len(), 2, "{r}");
    assert!(!kept.iter().any(|n| n == held), "{held} holds p1's GPU: {r}");
    // kube-scheduler may still choose another node: the bind says so.
    let other = ["a", "b", "c"]
        .into_iter()
        .find(|n| *n != held)
        .expect("another node");
    let (_, r) = post_json(addr, "/bind", &bind_args("p1", other)).await;
    assert_eq!(r["Error"], "", "{r}");
    assert_eq!(binds(&scorer, "elsewhere"), 1);
    assert_eq!(
        scorer.metrics.holds.get(),
        0,
        "the bind ends the hold wherever it went"
    );
}

/// A hold is a guess at kube-scheduler's choice: a bind avoids held GPUs while another fits, and takes
/// held room when nothing else on the node does (kube-scheduler chose the node; the held pod's own
/// bind then chooses again).
#[tokio::test]
async fn a_bind_goes_around_holds_but_takes_held_room_when_only_that_fits() {
    // GPU 0: 6000 MiB free (p1 is ranked onto it), GPU 1: 7000.
    let node = node_json("n", &[g(16384, 10384), g(16384, 9384)]);
    let pods = [
        pod_json("p1", 5000, 0, json!({}), json!({})),
        pod_json("p2", 5000, 0, json!({}), json!({})),
        pod_json("p3", 5000, 0, json!({}), json!({})),
    ];
    let (addr, scorer, api) = setup(std::slice::from_ref(&node), &pods).await;
    post_json(
        addr,
        "/prioritize",
        &args_nodes(&pods[0], std::slice::from_ref(&node)),
    )
    .await;
    let (_, r) = post_json(addr, "/bind", &bind_args("p2", "n")).await;
    assert_eq!(r["Error"], "", "{r}");
    assert_eq!(
        assigned(&api, "p2").as_deref(),
        Some("GPU-n-1"),
        "around p1's hold"
    );
    assert_eq!(scorer.metrics.binds_past_holds.get(), 0);

    post_json(
        addr,
        "/prioritize",
        &args_nodes(&pods[0], std::slice::from_ref(&node)),
    )
    .await;
    let (_, r) = post_json(addr, "/bind", &bind_args("p3", "n")).await;
    assert_eq!(r["Error"], "", "only the held room fits p3: {r}");
    assert_eq!(assigned(&api, "p3").as_deref(), Some("GPU-n-0"));
    assert_eq!(scorer.metrics.binds_past_holds.get(), 1);
    assert_eq!(binds(&scorer, "none"), 2, "p2 and p3 were never ranked");
    assert_eq!(binds(&scorer, "on_hold"), 0);
    let (_, r) = post_json(addr, "/bind", &bind_args("p1", "n")).await;
    assert!(
        r["Error"]
            .as_str()
            .is_some_and(|e| e.contains("pod needs 5000 MiB")),
        "{r}"
    );
    api.assert_all_granted();
}

/// One replica's binds to one node take turns on its Lease: none loses to another of the same replica,
/// and each writes on top of the Lease the one before wrote (the Lease is read once).
#[tokio::test]
async fn one_replicas_binds_to_one_node_never_conflict() {
    let node = node_json("n", &[g(16384, 0), g(16384, 0), g(16384, 0), g(16384, 0)]);
    let names = ["p1", "p2", "p3", "p4"];
    let pods: Vec<Value> = names
        .iter()
        .map(|n| pod_json(n, 12000, 0, json!({}), json!({})))
        .collect();
    let (addr, scorer, api) = setup(&[node], &pods).await;
    let binds =
        names.map(|p| tokio::spawn(async move { post_json(addr, "/bind", &bind_args(p, "n")).await }));
    for bind in binds {
        let (_, r) = bind.await.expect("bind");
        assert_eq!(r["Error"], "", "{r}");
    }
    let mut gpus: Vec<String> = names.iter().map(|p| assigned(&api, p).expect("bound")).collect();
    gpus.sort();
    gpus.dedup();
    assert_eq!(gpus.len(), 4, "a GPU each");
    assert_eq!(scorer.metrics.booking_conflicts.get(), 0);
    let lease_reads = lease_reads(&api);
    assert_eq!(
        lease_reads, 1,
        "read once, then written on top of what was written"
    );
    let booked = bookings_of(&api, "n");
    for p in names {
        assert!(booked.contains(&format!("team-a/{p}")), "{booked}");
    }
    api.assert_all_granted();
}

#[tokio::test]
async fn concurrent_binds_never_double_book_a_gpu() {
    // GPU 0 has 6000 MiB free, GPU 1 only 2000: two 5000 MiB pods cannot both go to this node.
    let node = node_json("n", &[g(16384, 10384), g(16384, 14384)]);
    let pods = [
        pod_json("p1", 5000, 0, json!({}), json!({})),
        pod_json("p2", 5000, 0, json!({}), json!({})),
    ];
    let (addr, scorer, api) = setup(&[node], &pods).await;
    // Slow bindings: both binds are in flight at once, neither visible in the node's annotation.
    *api.binding_delay.lock().expect("lock") = Duration::from_millis(300);
    let (args1, args2) = (bind_args("p1", "n"), bind_args("p2", "n"));
    let (a, b) = tokio::join!(post_json(addr, "/bind", &args1), post_json(addr, "/bind", &args2));
    let errors: Vec<String> = [a.1, b.1]
        .iter()
        .map(|r| r["Error"].as_str().expect("Error").to_string())
        .collect();
    let ok = errors.iter().filter(|e| e.is_empty()).count();
    assert_eq!(ok, 1, "exactly one bind wins: {errors:?}");
    let refused = errors.iter().find(|e| !e.is_empty()).expect("one refused");
    assert!(
        refused.contains("largest free GPU has 2000 MiB, pod needs 5000 MiB"),
        "{refused}"
    );
    let bindings = api
        .seen()
        .iter()
        .filter(|s| s.method == "POST" && s.path.ends_with("/binding"))
        .count();
    assert_eq!(bindings, 1, "the loser never creates a Binding");
    assert_eq!(scorer.ledger.len(), 1);

    // Filter sees the reservation too: the node no longer fits another 5000 MiB pod.
    let p3 = pod_json("p3", 5000, 0, json!({}), json!({}));
    let (_, r) = post_json(
        addr,
        "/filter",
        &args_nodes(&p3, &[node_json("n", &[g(16384, 10384), g(16384, 14384)])]),
    )
    .await;
    assert_eq!(r["Nodes"]["items"], json!([]), "{r}");
    api.assert_all_granted();
}

#[tokio::test]
async fn a_failed_binding_releases_the_reservation() {
    let node = node_json("n", &[g(16384, 10384)]);
    let pods = [
        pod_json("p1", 5000, 0, json!({}), json!({})),
        pod_json("p2", 5000, 0, json!({}), json!({})),
    ];
    let (addr, scorer, api) = setup(&[node], &pods).await;
    api.refuse_binding.lock().expect("lock").push("p1".into());
    let (_, r) = post_json(addr, "/bind", &bind_args("p1", "n")).await;
    assert!(
        r["Error"]
            .as_str()
            .is_some_and(|e| e.contains("creating the binding")),
        "{r}"
    );
    assert_eq!(scorer.ledger.len(), 0);
    let (_, r) = post_json(addr, "/bind", &bind_args("p2", "n")).await;
    assert_eq!(r["Error"], "", "the GPU is free again");
    api.assert_all_granted();
}

#[tokio::test]
async fn bind_refuses_a_recreated_pod() {
    let node = node_json("n", &[g(16384, 0)]);
    let (addr, _, api) = setup(&[node], &[pod_json("p1", 5000, 0, json!({}), json!({}))]).await;
    let mut args = bind_args("p1", "n");
    args["PodUID"] = json!("some-older-uid");
    let (_, r) = post_json(addr, "/bind", &args).await;
    assert!(
        r["Error"].as_str().is_some_and(|e| e.contains("recreated")),
        "{r}"
    );
    assert!(api.seen().iter().all(|s| s.method == "GET"));
    api.assert_all_granted();
}

fn victim(name: &str, node: &str, gpu: usize, mib: u64, preemptible: bool, labels: Value) -> Value {
    let mut p = pod_json(
        name,
        mib,
        0,
        json!({"gpumem.io/assigned-gpus": uuid(node, gpu)}),
        labels,
    );
    if preemptible {
        p["metadata"]["annotations"]["gpumem.io/preemptible"] = json!("true");
    }
    p["spec"]["nodeName"] = json!(node);
    p["status"]["phase"] = json!("Running");
    p
}

/// Node "n": GPU 0 holds a + c (4096 each, both preemptible, c guarded by a PDB with no disruptions
/// left); GPU 1 holds b (preemptible) + d (not). Node "m": only a non-preemptible pod.
fn preemption_world() -> (Vec<Value>, Vec<Value>, Value) {
    let mut n_gpus = vec![g(8192, 8192), g(8192, 8192)];
    n_gpus[0].pods = vec!["team-a/a".into(), "team-a/c".into()];
    n_gpus[1].pods = vec!["team-a/b".into(), "team-a/d".into()];
    let mut m_gpus = vec![g(8192, 8192)];
    m_gpus[0].pods = vec!["team-a/e".into()];
    let nodes = vec![node_json("n", &n_gpus), node_json("m", &m_gpus)];
    let pods = vec![
        victim("a", "n", 0, 4096, true, json!({})),
        victim("b", "n", 1, 4096, true, json!({})),
        victim("c", "n", 0, 4096, true, json!({"app": "guarded"})),
        victim("d", "n", 1, 4096, false, json!({})),
        victim("e", "m", 0, 8192, false, json!({})),
    ];
    let pdb = json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "guard", "namespace": "team-a"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
        "status": {"disruptionsAllowed": 0, "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1,
            "observedGeneration": 1}});
    (nodes, pods, pdb)
}

fn check_victims(r: &Value) {
    let n = &r["NodeNameToMetaVictims"]["n"];
    assert_eq!(n["Pods"], json!([{"UID": "uid-a"}, {"UID": "uid-c"}]), "{r}");
    assert_eq!(n["NumPDBViolations"], 1, "c is guarded by a PDB: {r}");
    assert!(
        r["NodeNameToMetaVictims"].get("m").is_none(),
        "only a non-preemptible pod on m: {r}"
    );
}

#[tokio::test]
async fn preempt_keeps_only_victims_that_free_one_gpu() {
    let (nodes, pods, pdb) = preemption_world();
    let (addr, _, api) = setup(&nodes, &pods).await;
    api.pdbs.lock().expect("lock").push(pdb);
    let preemptor = pod_json("big", 5000, 0, json!({}), json!({}));
    let args = json!({
        "Pod": preemptor,
        "NodeNameToVictims": {
            "n": {"Pods": [pods[0], pods[1], pods[2], pods[3]], "NumPDBViolations": 1},
            "m": {"Pods": [pods[4]], "NumPDBViolations": 0}
        },
        "NodeNameToMetaVictims": null
    });
    let (status, r) = post_json(addr, "/preempt", &args).await;
    assert_eq!(status, 200, "{r}");
    check_victims(&r);
    api.assert_all_granted();
}

#[tokio::test]
async fn preempt_meta_victims_resolve_through_the_caches() {
    let (nodes, pods, pdb) = preemption_world();
    let api = Arc::new(FakeApi::default());
    api.pdbs.lock().expect("lock").push(pdb);
    let client = fake_api(api.clone()).await;
    let node_objs: Vec<Node> = nodes
        .iter()
        .map(|n| serde_json::from_value(n.clone()).expect("node"))
        .collect();
    let pod_objs: Vec<Pod> = pods
        .iter()
        .map(|p| serde_json::from_value(p.clone()).expect("pod"))
        .collect();
    let scorer = Scorer::new(
        ScorerConfig::default(),
        Some(client),
        Some(NodeCache::from_nodes(node_objs)),
        Some(PodCache::from_pods(pod_objs)),
    );
    let (addr, _) = start(scorer).await;
    let uids = |names: &[&str]| {
        names
            .iter()
            .map(|n| json!({"UID": format!("uid-{n}")}))
            .collect::<Vec<_>>()
    };
    let args = json!({
        "Pod": pod_json("big", 5000, 0, json!({}), json!({})),
        "NodeNameToVictims": null,
        "NodeNameToMetaVictims": {
            "n": {"Pods": uids(&["a", "b", "c", "d"]), "NumPDBViolations": 1},
            "m": {"Pods": uids(&["e"]), "NumPDBViolations": 0}
        }
    });
    let (status, r) = post_json(addr, "/preempt", &args).await;
    assert_eq!(status, 200, "{r}");
    check_victims(&r);
    assert!(
        api.seen().iter().all(|s| !s.path.contains("/nodes/")),
        "nodes come from the cache"
    );
    api.assert_all_granted();
}

/// A pod another scorer replica bound to node `n` on GPU 0 `age_secs` ago, not yet in the annotation.
fn bound_by_another_replica(age_secs: i64) -> Pod {
    let at = k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(age_secs);
    let mut pod = pod_json(
        "elsewhere",
        5000,
        0,
        json!({"gpumem.io/assigned-gpus": uuid("n", 0), "gpumem.io/assigned-at": at.to_string()}),
        json!({}),
    );
    pod["spec"]["nodeName"] = json!("n");
    serde_json::from_value(pod).expect("pod")
}

#[tokio::test]
async fn binds_of_other_replicas_count_until_the_annotation_shows_them() {
    // Filter and bind count them alike: a filter that did not would pass the node, and kube-scheduler's
    // bind would fail there, pod after pod, until the agent's next report.
    for (age, expect_refused) in [(5, true), (100_000, false)] {
        // GPU 0 has 6000 MiB free, GPU 1 2000: another replica just put a 5000 MiB pod on GPU 0.
        let node = node_json("n", &[g(16384, 10384), g(16384, 14384)]);
        let api = Arc::new(FakeApi::default());
        api.add_node(&node);
        api.add_pod(&pod_json("p1", 5000, 0, json!({}), json!({})));
        let client = fake_api(api.clone()).await;
        let pods = PodCache::from_pods([bound_by_another_replica(age)]);
        let (addr, _) = start(Scorer::new(
            ScorerConfig::default(),
            Some(client),
            None,
            Some(pods),
        ))
        .await;
        let pod = pod_json("p1", 5000, 0, json!({}), json!({}));
        let (status, r) = post_json(addr, "/filter", &args_nodes(&pod, std::slice::from_ref(&node))).await;
        assert_eq!(status, 200, "{r}");
        let reason = r["FailedNodes"]["n"].as_str().unwrap_or_default();
        if expect_refused {
            assert!(
                reason.contains("largest free GPU has 2000 MiB, pod needs 5000 MiB"),
                "filter: {r}"
            );
        } else {
            assert_eq!(reason, "", "filter: {r}");
        }
        let (_, r) = post_json(addr, "/bind", &bind_args("p1", "n")).await;
        let error = r["Error"].as_str().expect("Error");
        if expect_refused {
            assert!(
                error.contains("largest free GPU has 2000 MiB, pod needs 5000 MiB"),
                "{error}"
            );
        } else {
            assert_eq!(error, "", "a choice older than the ledger's TTL no longer counts");
        }
        api.assert_all_granted();
    }
}

/// A pending pod whose gpu-mem limit (and so request) is written `quantity`.
fn asking(name: &str, quantity: &str) -> Value {
    let mut pod = pod_json(name, 1, 0, json!({}), json!({}));
    let resources = &mut pod["spec"]["containers"][0]["resources"];
    resources["limits"]["nvidia.com/gpu-mem"] = json!(quantity);
    resources["requests"]["nvidia.com/gpu-mem"] = json!(quantity);
    pod
}

#[tokio::test]
async fn bind_reads_requests_in_every_form_the_api_server_returns() {
    // GPUs 0 and 2 have 5000 MiB free, GPU 1 1024: the two 5000 MiB pods take 0 and 2, 1Ki takes 1.
    let node = node_json("n", &[g(16384, 11384), g(16384, 15360), g(16384, 11384)]);
    let pods = [asking("e", "5e3"), asking("k", "5000"), asking("ki", "1Ki")];
    let (addr, _, api) = setup(&[node], &pods).await;
    for (pod, stored) in [("e", "5e3"), ("k", "5k"), ("ki", "1Ki")] {
        let pod = api.pod(&format!("team-a/{pod}")).expect("stored");
        assert_eq!(
            pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu-mem"],
            stored
        );
    }
    let mut chosen = Vec::new();
    for pod in ["e", "k", "ki"] {
        let (_, r) = post_json(addr, "/bind", &bind_args(pod, "n")).await;
        assert_eq!(r["Error"], "", "{pod}");
        let binding = api
            .seen()
            .into_iter()
            .rfind(|s| s.method == "POST")
            .expect("bound");
        chosen.push(binding.body["metadata"]["annotations"]["gpumem.io/assigned-gpus"].clone());
    }
    chosen[..2].sort_by_key(|u| u.to_string());
    assert_eq!(
        chosen,
        [json!(uuid("n", 0)), json!(uuid("n", 2)), json!(uuid("n", 1))]
    );
    api.assert_all_granted();
}

/// Least privilege: the scorer's reflectors, a bind whose node the cache does not have yet, and a
/// preemption counting PodDisruptionBudgets use every grant of the shipped role, and nothing else.
#[tokio::test]
async fn the_scorers_role_grants_exactly_what_it_uses() {
    let (nodes, pods, pdb) = preemption_world();
    let api = Arc::new(FakeApi::default());
    nodes.iter().for_each(|n| api.add_node(n));
    pods.iter().for_each(|p| api.add_pod(p));
    api.pdbs.lock().expect("lock").push(pdb);
    let client = fake_api(api.clone()).await;
    let (node_cache, pod_cache) = (NodeCache::start(client.clone()), PodCache::start(client.clone()));
    tokio::time::timeout(Duration::from_secs(20), async {
        node_cache.synced().wait().await;
        pod_cache.synced().wait().await;
    })
    .await
    .expect("the caches list what the API server has");
    // Added after the list, and the watch stays quiet: a cache miss.
    api.add_node(&node_json("late", &[g(16384, 0)]));
    api.add_pod(&pod_json("new", 5000, 0, json!({}), json!({})));
    api.add_pod(&pod_json("new-2", 5000, 0, json!({}), json!({})));
    let scorer = Scorer::new(
        ScorerConfig::default(),
        Some(client),
        Some(node_cache),
        Some(pod_cache),
    );
    let (addr, _) = start(scorer).await;
    let (_, r) = post_json(addr, "/bind", &bind_args("new", "late")).await;
    assert_eq!(r["Error"], "", "{r}");
    // A second bind on the node updates its bookings' Lease.
    let (_, r) = post_json(addr, "/bind", &bind_args("new-2", "late")).await;
    assert_eq!(r["Error"], "", "{r}");
    let args = json!({
        "Pod": pod_json("big", 5000, 0, json!({}), json!({})),
        "NodeNameToVictims": {"n": {"Pods": [pods[0], pods[1], pods[2], pods[3]], "NumPDBViolations": 1}},
        "NodeNameToMetaVictims": null
    });
    let (status, r) = post_json(addr, "/preempt", &args).await;
    assert_eq!(status, 200, "{r}");
    api.assert_role_is_exactly_what_was_used();
}

#[test]
fn the_fake_api_servers_see_requests_as_the_authorizer_does() {
    use scorer_support::k8s::request_info;
    for (method, path, query, want, namespace, name) in [
        (
            "GET",
            "/api/v1/namespaces/a/pods/p",
            "",
            "core/pods:get",
            Some("a"),
            Some("p"),
        ),
        (
            "GET",
            "/api/v1/pods",
            "fieldSelector=spec.nodeName%3Dn",
            "core/pods:list",
            None,
            None,
        ),
        (
            "GET",
            "/api/v1/pods",
            "watch=true&resourceVersion=1",
            "core/pods:watch",
            None,
            None,
        ),
        ("GET", "/api/v1/watch/nodes", "", "core/nodes:watch", None, None),
        ("GET", "/api/v1/nodes/n", "", "core/nodes:get", None, Some("n")),
        (
            "PATCH",
            "/api/v1/nodes/n",
            "fieldManager=x",
            "core/nodes:patch",
            None,
            Some("n"),
        ),
        (
            "PUT",
            "/api/v1/nodes/n/status",
            "",
            "core/nodes/status:update",
            None,
            Some("n"),
        ),
        (
            "POST",
            "/api/v1/namespaces/a/pods/p/binding",
            "",
            "core/pods/binding:create",
            Some("a"),
            Some("p"),
        ),
        (
            "DELETE",
            "/api/v1/namespaces/a/pods",
            "",
            "core/pods:deletecollection",
            Some("a"),
            None,
        ),
        (
            "GET",
            "/api/v1/namespaces/a",
            "",
            "core/namespaces:get",
            Some("a"),
            Some("a"),
        ),
        (
            "POST",
            "/apis/events.k8s.io/v1/namespaces/d/events",
            "",
            "events.k8s.io/events:create",
            Some("d"),
            None,
        ),
        (
            "GET",
            "/apis/policy/v1/namespaces/a/poddisruptionbudgets",
            "",
            "policy/poddisruptionbudgets:list",
            Some("a"),
            None,
        ),
    ] {
        let r = request_info(method, path, query);
        assert_eq!(r.access.to_string(), want, "{method} {path}?{query}");
        assert_eq!(
            (r.namespace.as_deref(), r.name.as_deref()),
            (namespace, name),
            "{path}"
        );
        assert!(r.non_resource_path.is_none(), "{path}");
    }
    assert!(request_info("GET", "/version", "").non_resource_path.is_some());
}

/// Finding: anyone who reaches the scorer could make it bind any pod. `bind` now binds only what
/// kube-scheduler itself would ask for, and checks names before they reach an API path.
#[tokio::test]
async fn bind_refuses_what_kube_scheduler_would_never_ask_for() {
    let node = node_json("n", &[g(16384, 0)]);
    let mut bound = pod_json("bound", 1000, 0, json!({}), json!({}));
    bound["spec"]["nodeName"] = json!("n");
    let mut other = pod_json("other", 1000, 0, json!({}), json!({}));
    other["spec"]["schedulerName"] = json!("team-scheduler");
    let mut leaving = pod_json("leaving", 1000, 0, json!({}), json!({}));
    leaving["metadata"]["deletionTimestamp"] = json!("2026-12-01T00:00:00Z");
    let fine = pod_json("fine", 1000, 0, json!({}), json!({}));
    let (addr, scorer, api) = setup(&[node], &[bound, other, leaving, fine]).await;

    let traversal = "victim/../../../../api/v1/nodes/n";
    let cases: Vec<(Value, &str, bool)> = vec![
        // (request, what the error says, whether the pod may be read first)
        (bind_args(traversal, "n"), "PodName: ", false),
        (
            json!({"PodName": "fine", "PodNamespace": "team-a/../kube-system", "PodUID": "uid-fine", "Node": "n"}),
            "PodNamespace: ",
            false,
        ),
        (bind_args("fine", "n/../../x"), "Node: ", false),
        (
            json!({"PodName": "fine", "PodNamespace": "team-a", "Node": "n"}),
            "bind needs PodName, PodUID and Node",
            false,
        ),
        (
            json!({"PodName": "fine", "PodNamespace": "team-a", "PodUID": "uid-someone-else", "Node": "n"}),
            "has UID uid-fine, not uid-someone-else",
            true,
        ),
        (bind_args("bound", "n"), "already bound to n", true),
        (
            bind_args("other", "n"),
            "belongs to scheduler \"team-scheduler\"",
            true,
        ),
        (bind_args("leaving", "n"), "is being deleted", true),
    ];
    for (args, expected, reads) in cases {
        let before = api.seen().len();
        let (status, r) = post_json(addr, "/bind", &args).await;
        assert_eq!(status, 200, "{args}");
        let error = r["Error"].as_str().expect("Error");
        assert!(error.contains(expected), "{args}: {error}");
        let seen = api.seen()[before..].to_vec();
        assert!(
            seen.iter().all(|s| s.method == "GET"),
            "{args}: refused binds write nothing: {seen:?}"
        );
        assert!(
            reads || seen.is_empty(),
            "{args}: checked before any request: {seen:?}"
        );
    }
    assert_eq!(scorer.ledger.len(), 0, "no refused bind holds a reservation");

    // The pod that passes every check still binds.
    let (_, r) = post_json(addr, "/bind", &bind_args("fine", "n")).await;
    assert_eq!(r["Error"], "", "{r}");
    // A pod the API server does not have: its 404, told apart from the refusals above.
    let (_, r) = post_json(addr, "/bind", &bind_args("gone", "n")).await;
    assert!(
        r["Error"]
            .as_str()
            .is_some_and(|e| e.contains("reading pod team-a/gone")),
        "{r}"
    );
    // Every refusal counted by its kind.
    let (_, text) = Conn::open(addr).await.request("GET", "/metrics", b"").await;
    for (kind, count) in [("bad_request", 4), ("not_bindable", 4), ("not_found", 1)] {
        let series = format!("gpumem_scorer_bind_failures_total{{kind=\"{kind}\"}} {count}");
        assert!(text.contains(&series), "{series} in:\n{text}");
    }
    api.assert_all_granted();
}

/// Two replicas that share nothing but the API server (no pod cache: neither sees the other's
/// Binding), binding at once onto one node: `n1` and `n2` (MiB free on its GPUs), pods of 5000 MiB.
async fn two_replicas_bind_at_once(
    free: &[u64],
    shared: bool,
) -> (Vec<String>, Arc<FakeApi>, [Arc<Scorer>; 2]) {
    let gpus: Vec<G> = free.iter().map(|f| g(16384, 16384 - f)).collect();
    let api = Arc::new(FakeApi::default());
    api.add_node(&node_json("n", &gpus));
    api.add_pod(&pod_json("p1", 5000, 0, json!({}), json!({})));
    api.add_pod(&pod_json("p2", 5000, 0, json!({}), json!({})));
    // Both read the node's bookings before either writes.
    *api.lease_gets_together.lock().expect("lock") = 2;
    let config = ScorerConfig {
        shared_bookings: shared,
        ..ScorerConfig::default()
    };
    let (a, sa) = start(Scorer::new(
        config.clone(),
        Some(fake_api(api.clone()).await),
        None,
        None,
    ))
    .await;
    let (b, sb) = start(Scorer::new(config, Some(fake_api(api.clone()).await), None, None)).await;
    let (args1, args2) = (bind_args("p1", "n"), bind_args("p2", "n"));
    let (ra, rb) = tokio::join!(post_json(a, "/bind", &args1), post_json(b, "/bind", &args2));
    let errors = [ra.1, rb.1]
        .iter()
        .map(|r| r["Error"].as_str().expect("Error").to_string())
        .collect();
    (errors, api, [sa, sb])
}

fn assigned(api: &FakeApi, pod: &str) -> Option<String> {
    let pod = api.pod(&format!("team-a/{pod}"))?;
    pod["spec"]["nodeName"].as_str()?;
    pod["metadata"]["annotations"]["gpumem.io/assigned-gpus"]
        .as_str()
        .map(String::from)
}

#[tokio::test]
async fn two_replicas_never_promise_the_same_room() {
    // GPU 0: 6000 MiB free, GPU 1: 5500. Each replica alone picks the same GPU for its pod; the
    // booking that loses chooses again, against the one that won.
    let (errors, api, scorers) = two_replicas_bind_at_once(&[6000, 5500], true).await;
    assert_eq!(errors, ["", ""], "both bind");
    let (g1, g2) = (
        assigned(&api, "p1").expect("p1 bound"),
        assigned(&api, "p2").expect("p2 bound"),
    );
    assert_ne!(g1, g2, "never the same GPU");
    let conflicts: u64 = scorers.iter().map(|s| s.metrics.booking_conflicts.get()).sum();
    assert_eq!(conflicts, 1, "one booking lost and was chosen again");
    let lease = api
        .lease("gpumem-system/gpumem-bookings-n")
        .expect("the node's bookings");
    let booked = lease["metadata"]["annotations"]["gpumem.io/bookings"]
        .as_str()
        .expect("bookings");
    assert!(
        booked.contains("team-a/p1") && booked.contains("team-a/p2"),
        "{booked}"
    );
    api.assert_all_granted();

    // Room for one only: the loser is refused (kube-scheduler tries it again) and creates no Binding.
    let (errors, api, _) = two_replicas_bind_at_once(&[6000, 3000], true).await;
    let refused: Vec<&String> = errors.iter().filter(|e| !e.is_empty()).collect();
    assert_eq!(refused.len(), 1, "{errors:?}");
    assert!(refused[0].contains("pod needs 5000 MiB"), "{refused:?}");
    let bound = ["p1", "p2"]
        .iter()
        .filter(|p| assigned(&api, p).is_some())
        .count();
    assert_eq!(bound, 1);
}

#[tokio::test]
async fn without_shared_bookings_two_replicas_can_promise_the_same_room() {
    // What the bookings prevent, and what a single replica may choose to risk (`sharedBookings: false`):
    // both replicas promise GPU 0's last 6000 MiB, and the kubelet would fail one pod.
    let (errors, api, _) = two_replicas_bind_at_once(&[6000, 3000], false).await;
    assert_eq!(errors, ["", ""]);
    assert_eq!(assigned(&api, "p1"), assigned(&api, "p2"), "the same GPU, twice");
    assert!(
        api.seen().iter().all(|s| !s.path.contains("leases")),
        "no Lease request without shared bookings"
    );
}

#[tokio::test]
async fn a_booking_whose_pod_is_gone_holds_no_room() {
    // GPU 0 has 6000 MiB free, GPU 1 2000. Another replica booked 5000 MiB of GPU 0 for a pod that then
    // left (deleted within the TTL): once the booking is past its settling time and the pod cache does
    // not show the pod on the node, the room is free again, and the next write drops the booking.
    // A booking still settling holds its room, unless the pod cache saw its pod (that UID) deleted; and
    // so does one past it while the pod watch is failing (after an API server restart the cache lacked
    // binds made since, for up to 30 s).
    for (age_s, watch_failed, deleted, expect_bound) in [
        (30, false, None, true),
        (2, false, None, false),
        (2, false, Some("u-gone"), true),
        (2, false, Some("u-before"), false),
        (30, true, None, false),
    ] {
        let node = node_json("n", &[g(16384, 10384), g(16384, 14384)]);
        let api = Arc::new(FakeApi::default());
        api.add_node(&node);
        api.add_pod(&pod_json("p1", 5000, 0, json!({}), json!({})));
        let at = k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(age_s);
        let booked = json!([{"pod": "team-a/gone", "uid": "u-gone", "gpus": [uuid("n", 0)], "mib": 5000,
                             "at": at.to_string()}]);
        api.add_lease(&json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "gpumem-bookings-n", "namespace": "gpumem-system",
                         "annotations": {"gpumem.io/bookings": booked.to_string()}},
            "spec": {}
        }));
        let pods = PodCache::from_pods(std::iter::empty::<Pod>());
        if let Some(uid) = deleted {
            // Deleted: "u-gone" is the booked pod; "u-before" an earlier pod of that name.
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": "gone", "namespace": "team-a", "uid": uid},
                "spec": {"nodeName": "n", "containers": []}
            }))
            .expect("pod");
            pods.apply(&kube::runtime::watcher::Event::Delete(pod));
        }
        if watch_failed {
            pods.watch_failed();
        }
        let (addr, _) = start(Scorer::new(
            ScorerConfig::default(),
            Some(fake_api(api.clone()).await),
            None,
            Some(pods),
        ))
        .await;
        let (_, r) = post_json(addr, "/bind", &bind_args("p1", "n")).await;
        let error = r["Error"].as_str().expect("Error");
        let lease = api.lease("gpumem-system/gpumem-bookings-n").expect("lease");
        let now_booked = lease["metadata"]["annotations"]["gpumem.io/bookings"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if expect_bound {
            assert_eq!(error, "", "a gone pod's booking held the room");
            assert_eq!(assigned(&api, "p1"), Some(uuid("n", 0)));
            assert!(!now_booked.contains("team-a/gone"), "{now_booked}");
            assert!(now_booked.contains("team-a/p1"), "{now_booked}");
        } else {
            assert!(
                error.contains("largest free GPU has 2000 MiB, pod needs 5000 MiB"),
                "{error}"
            );
            assert!(now_booked.contains("team-a/gone"), "{now_booked}");
        }
        api.assert_all_granted();
    }
}

#[tokio::test]
async fn no_gpu_pod_goes_to_a_node_whose_agent_is_restarting() {
    // The agent marks its Node on SIGTERM and the next one lifts the mark once registered; meanwhile the
    // kubelet would fail a GPU pod. A mark past its hold (an agent that never came back), one from a
    // clock far ahead, or one that is not a time does not keep pods away.
    let now = k8s_openapi::jiff::Timestamp::now();
    let ago = |s: i64| (now - k8s_openapi::jiff::SignedDuration::from_secs(s)).to_string();
    for (mark, refused) in [
        (Some(ago(5)), true),
        (Some(ago(-10)), true),
        (Some(ago(120)), false),
        (Some(ago(-3600)), false),
        (Some("soon".to_string()), false),
        (None, false),
    ] {
        let mut node = node_json("n", &[g(16384, 0)]);
        if let Some(mark) = &mark {
            node["metadata"]["annotations"]["gpumem.io/agent-restarting"] = json!(mark);
        }
        let pod = pod_json("p1", 5000, 0, json!({}), json!({}));
        let (addr, scorer, api) = setup(std::slice::from_ref(&node), std::slice::from_ref(&pod)).await;
        let (_, r) = post_json(addr, "/filter", &args_nodes(&pod, std::slice::from_ref(&node))).await;
        let reason = r["FailedNodes"]["n"].as_str().unwrap_or_default();
        let (_, b) = post_json(addr, "/bind", &bind_args("p1", "n")).await;
        let error = b["Error"].as_str().expect("Error");
        if refused {
            assert!(
                reason.starts_with("the gpumem agent on this node is restarting"),
                "{mark:?}: {r}"
            );
            assert_eq!(
                r["FailedAndUnresolvableNodes"]["n"], reason,
                "preempting pods would not help"
            );
            assert!(
                error.contains("the gpumem agent on this node is restarting"),
                "{error}"
            );
            assert_eq!(assigned(&api, "p1"), None);
            assert_eq!(
                scorer
                    .metrics
                    .bind_failures
                    .get_or_create(&gpumem::scorer::metrics::KindLabel {
                        kind: "agent_restarting"
                    })
                    .get(),
                1
            );
        } else {
            assert_eq!(reason, "", "{mark:?}: {r}");
            assert_eq!(error, "", "{mark:?}");
            assert_eq!(assigned(&api, "p1"), Some(uuid("n", 0)));
        }
        api.assert_all_granted();
    }
}
