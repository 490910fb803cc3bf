//! HTTP: the extender's routes, served by [`crate::http`] (HTTP/1.1; HTTP/2 over TLS, which
//! kube-scheduler prefers).
//!
//! Routes by the last path segment, so any `urlPrefix` works: `POST .../filter`, `.../prioritize`,
//! `.../bind`, `.../preempt`; `GET /healthz`, `GET /metrics`. Bodies over `maxBodyBytes` get 413,
//! bodies slower than the server's body timeout 408, malformed JSON 400 with serde's message, as do
//! requests past the extender's limits (more than `extender::MAX_NODES` nodes, say), refused while
//! they are parsed; an error inside a verb is reported in the protocol's `Error` field. `filter`,
//! `prioritize` and `preempt` decode and decide on tokio's blocking pool, so that a heavy request
//! never holds up `/healthz` or `/metrics`.
//!
//! With `tls` in the configuration the scorer has two ports: the verbs on the TLS one, for clients
//! with a certificate from `clientCAFile` (kube-scheduler); `/healthz`, `/readyz` and `/metrics` on
//! the plain one (kubelet probes, Prometheus), which answers the verbs 403.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Bytes;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tower_http::timeout::TimeoutError;

use super::metrics::ProtocolLabel;
use super::{BadRequest, Scorer};
use crate::http::{Body, Limits, Reply};
use crate::tls::TlsServer;

/// What a port of the scorer serves.
#[derive(Clone)]
pub enum Port {
    /// Everything, in plain HTTP: the extender without authentication (no `tls` configured).
    Open,
    /// `/healthz`, `/readyz` and `/metrics` in plain HTTP; the verbs are on the TLS port.
    Probes,
    /// Everything, over TLS, to clients with a verified certificate.
    Tls(Arc<TlsServer>),
}

/// Serves until `shutdown` completes (connections in progress finish on their own tasks).
pub async fn serve(
    listener: TcpListener,
    scorer: Arc<Scorer>,
    limits: Limits,
    port: Port,
    shutdown: impl Future<Output = ()>,
) {
    let verbs = !matches!(port, Port::Probes);
    let tls = match port {
        Port::Tls(tls) => Some(tls),
        Port::Open | Port::Probes => None,
    };
    let answer = move |req: Request<Body>| {
        let scorer = scorer.clone();
        async move { handle(&scorer, req, verbs).await }
    };
    crate::http::serve(listener, limits, tls, answer, shutdown).await;
}

/// Binds `addr` and serves `port` in the background with the default limits; returns the bound
/// address (tests bind 127.0.0.1:0).
pub async fn spawn(
    scorer: Arc<Scorer>,
    addr: std::net::SocketAddr,
) -> std::io::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let serving = serve(
        listener,
        scorer,
        Limits::default(),
        Port::Open,
        std::future::pending(),
    );
    Ok((local, tokio::spawn(serving)))
}

fn reply(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Reply {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn text(status: StatusCode, message: String) -> Reply {
    reply(status, "text/plain; charset=utf-8", message)
}

fn json<T: Serialize>(value: &T) -> Reply {
    match serde_json::to_vec(value) {
        Ok(body) => reply(StatusCode::OK, "application/json", body),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the answer: {e}"),
        ),
    }
}

/// Reads a body within the size limit and the server's body timeout.
async fn read_body(req: Request<Body>, limit: usize, what: &str) -> Result<Bytes, Reply> {
    let too_large = || {
        text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("{what} body exceeds {limit} bytes (maxBodyBytes)"),
        )
    };
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(too_large()),
        Err(e) if e.is::<TimeoutError>() => Err(text(
            StatusCode::REQUEST_TIMEOUT,
            format!("the {what} body did not arrive in time"),
        )),
        Err(e) => Err(text(
            StatusCode::BAD_REQUEST,
            format!("reading the {what} body: {e}"),
        )),
    }
}

/// Decodes a JSON body (the extender types refuse more than their limits while parsing, e.g.
/// `extender::MAX_NODES` nodes).
fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, BadRequest> {
    serde_json::from_slice(bytes).map_err(|e| BadRequest(format!("malformed {what} request: {e}")))
}

/// Runs `work` on tokio's blocking pool, so that the async workers keep serving `/healthz`, `/metrics`
/// and other requests meanwhile: a decision over thousands of nodes, or a few nodes with many GPUs,
/// takes milliseconds to seconds of CPU. `spawn_blocking` rather than `block_in_place`: it needs no
/// multi-threaded runtime (`block_in_place` panics on a current-thread one) and never holds a worker.
async fn off_workers<T: Send + 'static>(
    scorer: &Scorer,
    verb: &'static str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Reply> {
    tokio::task::spawn_blocking(work).await.map_err(|e| {
        // A panic in a decision is a bug: the caller gets an error, the scorer lives on.
        tracing::error!(verb, "decision failed: {e}");
        let message = format!("the {verb} decision failed: {e}");
        refused(scorer, verb, text(StatusCode::INTERNAL_SERVER_ERROR, message))
    })
}

/// `filter` and `prioritize`: the body is read here, then decoded, decided and encoded off the async
/// workers ([`off_workers`]).
async fn decide_off_workers<A: DeserializeOwned + 'static>(
    scorer: &Arc<Scorer>,
    req: Request<Body>,
    verb: &'static str,
    decide: fn(&Scorer, A) -> Result<Vec<u8>, BadRequest>,
) -> Reply {
    let bytes = match read_body(req, scorer.config.max_body_bytes, verb).await {
        Ok(bytes) => bytes,
        Err(r) => return refused(scorer, verb, r),
    };
    let s = scorer.clone();
    let answer = off_workers(scorer, verb, move || {
        let args = decode(&bytes, verb);
        // The request's text is not read again: not held beside the answer.
        drop(bytes);
        match args.and_then(|args| decide(&s, args)) {
            Ok(body) => reply(StatusCode::OK, "application/json", body),
            Err(e) => bad(&s, verb, e),
        }
    });
    answer.await.unwrap_or_else(|r| r)
}

/// How long a verb waits for the caches' first lists before answering 503: well inside kube-scheduler's
/// `httpTimeout` (5 s in the shipped configuration), which then retries the pod with backoff instead of
/// recording it unschedulable on every node.
const SYNC_WAIT: Duration = Duration::from_secs(3);

async fn handle(scorer: &Arc<Scorer>, req: Request<Body>, verbs: bool) -> Reply {
    let path = req.uri().path().trim_end_matches('/');
    let verb = path.rsplit('/').next().unwrap_or("").to_string();
    let limit = scorer.config.max_body_bytes;
    let decision: Option<&'static str> = match verb.as_str() {
        "filter" => Some("filter"),
        "prioritize" => Some("prioritize"),
        "bind" => Some("bind"),
        "preempt" => Some("preempt"),
        _ => None,
    };
    if let (false, Some(decision)) = (verbs, decision) {
        // Not counted as the verb's error: no scheduler sends it here once configured for TLS.
        tracing::debug!(verb = decision, "refused on the plain port");
        return text(
            StatusCode::FORBIDDEN,
            format!(
                "{decision} is served over TLS only, to clients with a certificate the scorer trusts (tls.clientCAFile)"
            ),
        );
    }
    if decision.is_some() {
        let protocol = match req.version() {
            hyper::Version::HTTP_2 => "HTTP/2",
            hyper::Version::HTTP_11 => "HTTP/1.1",
            _ => "other",
        };
        scorer
            .metrics
            .protocols
            .get_or_create(&ProtocolLabel { protocol })
            .inc();
    }
    if let (&Method::POST, Some(decision)) = (req.method(), decision)
        && let Err(missing) = scorer.wait_synced(SYNC_WAIT).await
    {
        tracing::warn!(verb = decision, "not answering: {missing}");
        let reply = text(StatusCode::SERVICE_UNAVAILABLE, format!("{missing}; retry"));
        return refused(scorer, decision, reply);
    }
    match (req.method(), verb.as_str()) {
        // Liveness: the process serves. Readiness: it can also decide (its caches have synced).
        (&Method::GET, "healthz") => text(StatusCode::OK, "ok".into()),
        (&Method::GET, "readyz") => match scorer.not_synced() {
            None => text(StatusCode::OK, "ok".into()),
            Some(missing) => text(StatusCode::SERVICE_UNAVAILABLE, missing.into()),
        },
        (&Method::GET, "metrics") => {
            scorer.refresh_gauges();
            reply(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                scorer.metrics.encode(),
            )
        }
        (&Method::POST, "filter") => {
            let filter = |s: &Scorer, args| s.filter(args).map(|r| r.to_json());
            decide_off_workers(scorer, req, "filter", filter).await
        }
        (&Method::POST, "prioritize") => {
            let prioritize = |s: &Scorer, args| s.prioritize(args).map(|r| r.to_json());
            decide_off_workers(scorer, req, "prioritize", prioritize).await
        }
        // A bind decides for one node (bounded work) between API calls, in a task of its own: when
        // kube-scheduler gives up waiting (its extender timeout) and resets the stream, the bind goes
        // on to its end (the pod bound, or its reservation and booking taken back) instead of being
        // dropped between its booking and its Binding, which left room held for no pod.
        (&Method::POST, "bind") => match read_body(req, limit, "bind").await {
            Ok(bytes) => match decode(&bytes, "bind") {
                Ok(args) => {
                    let bind = tokio::spawn({
                        let scorer = scorer.clone();
                        async move { scorer.bind(args).await }
                    });
                    match bind.await {
                        Ok(result) => json(&result),
                        Err(e) => {
                            scorer.error("bind");
                            text(
                                StatusCode::INTERNAL_SERVER_ERROR,
                                format!("the bind did not finish: {e}"),
                            )
                        }
                    }
                }
                Err(e) => bad(scorer, "bind", e),
            },
            Err(r) => refused(scorer, "bind", r),
        },
        // Decoded off the workers (whole Pods in the `Nodes` form); `preempt` chooses the victims off
        // them too, between the API calls it makes.
        (&Method::POST, "preempt") => match read_body(req, limit, "preempt").await {
            Ok(bytes) => match off_workers(scorer, "preempt", move || decode(&bytes, "preempt")).await {
                Ok(Ok(args)) => match scorer.preempt(args).await {
                    Ok(r) => json(&r),
                    Err(e) => bad(scorer, "preempt", e),
                },
                Ok(Err(e)) => bad(scorer, "preempt", e),
                Err(r) => r,
            },
            Err(r) => refused(scorer, "preempt", r),
        },
        (_, "healthz" | "readyz" | "metrics" | "filter" | "prioritize" | "bind" | "preempt") => text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{} is not allowed on {path}", req.method()),
        ),
        _ => text(StatusCode::NOT_FOUND, format!("no such endpoint: {path}")),
    }
}

fn bad(scorer: &Scorer, verb: &'static str, e: BadRequest) -> Reply {
    scorer.error(verb);
    text(StatusCode::BAD_REQUEST, e.0)
}

fn refused(scorer: &Scorer, verb: &'static str, r: Reply) -> Reply {
    scorer.error(verb);
    r
}
