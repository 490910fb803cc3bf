//! `gpumem scorer`: its command line and the server's run loop (caches, ports, signals).

use super::cache::NodeCache;
use super::config::ScorerConfig;
use super::pods::PodCache;
use super::{Scorer, server};
use anyhow::Context;
use kube::Client;
use std::future::pending;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::signal::unix::{SignalKind, signal};

/// `gpumem scorer` command line.
#[derive(Debug, clap::Args)]
pub struct ScorerArgs {
    /// Address to serve on: the extender's verbs, `/healthz`, `/readyz` and `/metrics`; with `tls` in
    /// the configuration, all but the verbs.
    #[arg(long, default_value = "0.0.0.0:8888")]
    pub listen: SocketAddr,
    /// Address to serve the extender's verbs on over TLS, when the configuration has `tls`.
    #[arg(long, default_value = "0.0.0.0:8443")]
    pub tls_listen: SocketAddr,
    /// YAML configuration file (weights, policy, limits); see [`ScorerConfig`].
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Run without a Kubernetes API (filter and prioritize in the `Nodes` form only; for demos).
    #[arg(long)]
    pub without_kube: bool,
}

/// Starts the DRA placer beside the extender, with the configuration's `dra` (the lease namespace
/// filled in) and this replica's identity: the placer's `start` (`src/placer/`), handed in by `main`
/// so that the scorer does not depend on the placer that depends on it.
pub type StartPlacer = fn(Arc<Scorer>, Client, super::config::DraPlacementConfig, String);

/// `gpumem scorer`.
pub fn run(args: &ScorerArgs, start_placer: StartPlacer) -> anyhow::Result<()> {
    let config = match &args.config {
        Some(path) => ScorerConfig::load(path)?,
        None => ScorerConfig::default(),
    };
    // Before anything starts: a scorer that cannot authenticate its clients must not serve.
    let tls = match &config.tls {
        Some(files) => Some(Arc::new(
            crate::tls::TlsServer::new(files.clone()).context("tls")?,
        )),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let (client, nodes, pods) = if args.without_kube {
            (None, None, None)
        } else {
            let client = Client::try_default()
                .await
                .context("connecting to the Kubernetes API (use --without-kube for a demo)")?;
            let nodes = NodeCache::start(client.clone());
            let pods = PodCache::start(client.clone());
            (Some(client), Some(nodes), Some(pods))
        };
        let dra = config.dra.clone();
        let scorer = Arc::new(Scorer::new(config, client.clone(), nodes, pods));
        scorer.follow_caches();
        if let (Some(mut dra), Some(client)) = (dra, client) {
            if dra.lease_namespace.is_empty() {
                dra.lease_namespace = super::own_namespace();
            }
            let identity = std::env::var("POD_NAME")
                .ok()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| format!("gpumem-scorer-{}", std::process::id()));
            start_placer(scorer.clone(), client, dra, identity);
        }
        let limits = crate::http::Limits::default();
        let bind = |addr: SocketAddr| async move {
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listening on {addr}"))
        };
        let plain = bind(args.listen).await?;
        let (plain_port, verbs) = match tls {
            Some(tls) => {
                let listener = bind(args.tls_listen).await?;
                tracing::info!(
                    "gpumem scorer: extender verbs over TLS on {} (client certificates from {}), probes and metrics on {}",
                    args.tls_listen,
                    tls.client_ca_file().display(),
                    args.listen
                );
                let serving = server::serve(listener, scorer.clone(), limits, server::Port::Tls(tls), pending());
                (server::Port::Probes, Some(serving))
            }
            None => {
                tracing::warn!(
                    "gpumem scorer listening on {} in plain HTTP: anyone who reaches it can make the scorer bind \
                     pods; configure `tls` (docs/operate.md, \"Security\")",
                    args.listen
                );
                (server::Port::Open, None)
            }
        };
        let verbs = async move {
            match verbs {
                Some(serving) => serving.await,
                None => pending().await,
            }
        };
        // SIGTERM is how Kubernetes stops a pod; as PID 1 of its image the scorer gets no default handler.
        let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        // Dropping the servers stops the accepting; connections in progress finish on their own tasks.
        tokio::select! {
            () = server::serve(plain, scorer, limits, plain_port, pending()) => {}
            () = verbs => {}
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted: stopping"),
            _ = terminate.recv() => tracing::info!("SIGTERM: stopping"),
        }
        Ok(())
    })
}
