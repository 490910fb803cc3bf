//! The claim controller's I/O: it watches GPUClaims and the pods they own, lists a claim's pods,
//! asks [`policy::decide`] what to do, and does it against the API server in the order that keeps a
//! restart safe: delete (only the pod as it was seen), write the status (only over the claim as it
//! was read), create. A conflict at any step ends the pass; the next one decides again.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::watcher;
use kube::{Api, Client, Resource as _, ResourceExt as _};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_stream::StreamExt as _;

use super::policy::{self, CLAIM_LABEL, Decision, Note, Plan, PodView};
use super::resource::{ClaimPath, GpuClaim};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;

/// What the controller's reconciliations share.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    /// MiB per `nvidia.com/gpu-mem` unit in this cluster (the agents' `memUnitMiB`).
    pub unit_mib: u64,
    /// The DeviceClass a claim's pod asks on the DRA path (`path: dra`): gpu.<driver>.
    pub dra_class: String,
    pub counts: Counts,
}

/// What the controller has done, for its metrics.
#[derive(Default)]
pub struct Counts {
    pub steps: Counter,
    pub pods_created: Counter,
    pub errors: Counter,
    /// 1 while this replica holds the Lease.
    pub leading: Gauge,
}

impl Counts {
    /// The registry `/metrics` encodes.
    pub fn registry(&self) -> Registry {
        let mut registry = Registry::with_prefix("gpumem_claim");
        registry.register("steps", "Steps down of a claim's request", self.steps.clone());
        registry.register(
            "pods_created",
            "Pods created for claims",
            self.pods_created.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Reconciliations that failed and were retried",
            self.errors.clone(),
        );
        registry.register(
            "leading",
            "1 while this replica is the leader",
            self.leading.clone(),
        );
        registry
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("{action} {object}: {source}")]
    Api {
        action: &'static str,
        object: String,
        #[source]
        source: kube::Error,
    },
}

fn api_error(action: &'static str, object: impl Into<String>) -> impl FnOnce(kube::Error) -> ReconcileError {
    let object = object.into();
    move |source| ReconcileError::Api {
        action,
        object,
        source,
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Runs the controller until its stream ends (it does not, while the API server answers).
pub async fn run(ctx: Arc<Context>) {
    let claims: Api<GpuClaim> = Api::all(ctx.client.clone());
    let pods: Api<Pod> = Api::all(ctx.client.clone());
    let results = Controller::new(claims, watcher::Config::default())
        .owns(pods, watcher::Config::default().labels(CLAIM_LABEL))
        .run(reconcile, error_policy, ctx);
    let mut results = std::pin::pin!(results);
    while let Some(result) = results.next().await {
        // Reconcile errors are logged by error_policy; these are the queue's and the watches' own.
        match result {
            Ok(_) => {}
            // A retry or a pod event for a claim just deleted.
            Err(e @ kube::runtime::controller::Error::ObjectNotFound(_)) => {
                tracing::debug!("claim controller: {e}")
            }
            Err(e) => tracing::warn!("claim controller: {e}"),
        }
    }
}

fn error_policy(claim: Arc<GpuClaim>, error: &ReconcileError, ctx: Arc<Context>) -> Action {
    ctx.counts.errors.inc();
    tracing::warn!(claim = %claim.key(), "{error}");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(claim: Arc<GpuClaim>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    if claim.metadata.deletion_timestamp.is_some() {
        // The garbage collector deletes its pods (they name the claim as their controller).
        return Ok(Action::await_change());
    }
    let namespace = claim.namespace().unwrap_or_default();
    let name = claim.name_any();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let listed = pods
        .list(&ListParams::default().labels(&format!("{CLAIM_LABEL}={name}")))
        .await
        .map_err(api_error("listing the pods of", claim.key()))?;
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    let views: Vec<PodView> = listed
        .items
        .iter()
        // Only the pods this claim created: a label alone can be copied.
        .filter(|p| {
            p.owner_references()
                .iter()
                .any(|o| o.controller == Some(true) && o.uid == uid)
        })
        .map(PodView::from_pod)
        .collect();
    let plan = Plan::from_claim(&claim);
    let decision = policy::decide(&claim, &plan, &views, Timestamp::now());
    carry_out(&claim, &plan, decision, &pods, &ctx).await
}

async fn carry_out(
    claim: &GpuClaim,
    plan: &Result<Plan, String>,
    decision: Decision,
    pods: &Api<Pod>,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    for pod in &decision.delete {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(pod.uid.clone()),
                resource_version: Some(pod.resource_version.clone()),
            }),
            ..DeleteParams::default()
        };
        match pods.delete(&pod.name, &params).await {
            Ok(_) => tracing::info!(claim = %claim.key(), pod = %pod.name, "deleted pod"),
            Err(e) if is_status(&e, 404) => {}
            // The pod changed since it was seen (bound, say): decide again on what it is now.
            Err(e) if is_status(&e, 409) => return Ok(Action::requeue(Duration::from_secs(1))),
            Err(e) => return Err(api_error("deleting pod", pod.name.clone())(e)),
        }
        // On the DRA path its ResourceClaimTemplate goes with it (the claim made from it goes with
        // the pod, by the resource claim controller).
        if pod.path == ClaimPath::Dra {
            match templates(claim, ctx)
                .delete(&pod.name, &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(e) if is_status(&e, 404) => {}
                // Left behind, it costs nothing: the claim owns it, and it goes with the claim.
                Err(e) => {
                    tracing::warn!(claim = %claim.key(), template = %pod.name, "deleting the ResourceClaimTemplate: {e}")
                }
            }
        }
    }
    let stepped = decision.status.steps.len() > claim.status.as_ref().map_or(0, |s| s.steps.len());
    if claim.status.as_ref() != Some(&decision.status) {
        let claims: Api<GpuClaim> =
            Api::namespaced(ctx.client.clone(), &claim.namespace().unwrap_or_default());
        // The claim as read, resourceVersion included: a claim changed meanwhile is a 409.
        let mut updated = claim.clone();
        updated.status = Some(decision.status.clone());
        match claims
            .replace_status(&claim.name_any(), &PostParams::default(), &updated)
            .await
        {
            Ok(_) => {}
            Err(e) if is_status(&e, 409) || is_status(&e, 404) => {
                return Ok(Action::requeue(Duration::from_secs(1)));
            }
            Err(e) => return Err(api_error("writing the status of", claim.key())(e)),
        }
    }
    if stepped {
        ctx.counts.steps.inc();
    }
    if let (Some(name), Ok(plan)) = (&decision.create, plan) {
        let request = decision.status.request_mib.unwrap_or(plan.first_mib);
        let path = plan.pod_path(&decision.status);
        if path == ClaimPath::Dra {
            let template = policy::build_template(claim, plan, request, &ctx.dra_class);
            match templates(claim, ctx)
                .create(&PostParams::default(), &template)
                .await
            {
                Ok(_) => {}
                Err(e) if is_status(&e, 409) => {}
                Err(kube::Error::Api(status)) if status.code == 422 || status.code == 403 => {
                    let note = Note {
                        warning: true,
                        reason: "PodRefused",
                        message: format!("creating ResourceClaimTemplate {name}: {}", status.message),
                        pod: Some(name.clone()),
                    };
                    publish(ctx, claim, &note).await;
                    return Ok(Action::requeue(Duration::from_secs(30)));
                }
                Err(e) => return Err(api_error("creating the ResourceClaimTemplate", name.clone())(e)),
            }
        }
        let pod = policy::build_pod(claim, plan, path, request, ctx.unit_mib);
        match pods.create(&PostParams::default(), &pod).await {
            Ok(_) => {
                ctx.counts.pods_created.inc();
                tracing::info!(claim = %claim.key(), pod = %name, request_mib = request, path = path.describe(), "created pod");
            }
            Err(e) if is_status(&e, 409) => {}
            // The API server refused the template (a bad field, a quota): say so on the claim.
            Err(kube::Error::Api(status))
                if status.code == 422 || status.code == 403 || status.code == 400 =>
            {
                let note = Note {
                    warning: true,
                    reason: "PodRefused",
                    message: format!("creating pod {name}: {}", status.message),
                    pod: Some(name.clone()),
                };
                publish(ctx, claim, &note).await;
                return Ok(Action::requeue(Duration::from_secs(30)));
            }
            Err(e) => return Err(api_error("creating pod", name.clone())(e)),
        }
    }
    for note in &decision.notes {
        publish(ctx, claim, note).await;
    }
    Ok(decision
        .requeue
        .map_or_else(Action::await_change, Action::requeue))
}

/// The claim's namespace's ResourceClaimTemplates.
fn templates(claim: &GpuClaim, ctx: &Context) -> Api<ResourceClaimTemplate> {
    Api::namespaced(ctx.client.clone(), &claim.namespace().unwrap_or_default())
}

/// An Event on the claim (`kubectl describe gpuclaim` lists them), its pod as the related object; a
/// failure is only logged.
async fn publish(ctx: &Context, claim: &GpuClaim, note: &Note) {
    let event = Event {
        type_: if note.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: note.reason.to_string(),
        // The Events API takes at most 1 kB of note.
        note: Some(truncate(&note.message, 1000).to_string()),
        action: "Reconcile".to_string(),
        secondary: note.pod.as_ref().map(|name| ObjectReference {
            api_version: Some("v1".to_string()),
            kind: Some("Pod".to_string()),
            name: Some(name.clone()),
            namespace: claim.namespace(),
            ..ObjectReference::default()
        }),
    };
    if let Err(e) = ctx.recorder.publish(&event, &claim.object_ref(&())).await {
        tracing::warn!(claim = %claim.key(), "event {}: {e}", note.reason);
    }
}

fn truncate(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}
