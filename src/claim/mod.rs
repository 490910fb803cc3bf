//! GPU claims: the `GPUClaim` custom resource and its controller (`gpumem claims controller`).
//!
//! Kubernetes cannot lower a pod's extended-resource request (requests are immutable, and in-place
//! resize covers CPU and memory only), so a request that bends is a resource that owns the pod: the
//! controller creates the claim's pod at the current request and, while fragmentation keeps it
//! unschedulable, replaces it one step lower. It runs as its own Deployment rather than inside the
//! scorer: it needs to create and delete pods in every namespace, which the scorer must not be able
//! to do, and it can be left out where nobody uses claims.
//!
//! - [`resource`]: the CRD's types (spec, status, printer columns);
//! - [`policy`]: what a claim does next, pure;
//! - [`controller`]: the watches and the API calls;
//! - with `--dra-quotas`, the process also runs [`crate::quota`]'s controller under the same Lease;
//! - leader election, when more than one replica runs, is [`crate::lease`]'s (shared with the
//!   scorer's DRA placement).

pub mod controller;
pub mod policy;
pub mod resource;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::ListParams;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client};
use tokio::signal::unix::{SignalKind, signal};

use crate::lease;
use controller::{Context, Counts};
use resource::GpuClaim;

#[derive(Debug, clap::Args)]
pub struct ClaimsArgs {
    #[command(subcommand)]
    pub command: ClaimsCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum ClaimsCommand {
    /// Run the controller (Deployment): create each claim's pod, step its request down while it
    /// cannot be scheduled, record where it runs.
    Controller(ControllerArgs),
    /// Print the GPUClaim CustomResourceDefinition (YAML), as the chart and the manifests ship it.
    Crd,
}

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// Address for /healthz, /readyz and /metrics.
    #[arg(long, default_value = "0.0.0.0:8890")]
    pub listen: SocketAddr,
    /// MiB per `nvidia.com/gpu-mem` unit in this cluster: the agents' `memUnitMiB`.
    #[arg(long, default_value_t = 1)]
    pub mem_unit_mib: u64,
    /// Namespace of the leader-election Lease (the controller's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "gpumem-system")]
    pub lease_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "gpumem-claims")]
    pub lease_name: String,
    /// This replica's name in the Lease (the pod's name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Also record on each namespace's ResourceQuota `gpumem` the GPU memory and whole GPUs its
    /// ResourceClaims of `--dra-class` ask, which the chart's ValidatingAdmissionPolicy (`dra.quotas`)
    /// holds new claims to (Kubernetes 1.34+: the cluster must serve resource.k8s.io/v1).
    #[arg(long)]
    pub dra_quotas: bool,
    /// The DeviceClass of gpumem's GPUs on the DRA path, gpu.<the DRA driver's name>: the class whose
    /// claims count against the quota, and the one a GPUClaim of `path: dra` asks.
    #[arg(long, default_value = "gpu.gpumem.io")]
    pub dra_class: String,
}

pub fn run(args: &ClaimsArgs) -> anyhow::Result<()> {
    match &args.command {
        ClaimsCommand::Crd => {
            print!("{}", resource::crd_yaml()?);
            Ok(())
        }
        ClaimsCommand::Controller(args) => run_controller(args),
    }
}

fn run_controller(args: &ControllerArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=1024).contains(&args.mem_unit_mib),
        "--mem-unit-mib {} is not in 1..=1024",
        args.mem_unit_mib
    );
    crate::names::check_subdomain(&args.lease_name).map_err(|e| anyhow::anyhow!("--lease-name: {e}"))?;
    crate::names::check_label(&args.lease_namespace)
        .map_err(|e| anyhow::anyhow!("--lease-namespace: {e}"))?;
    let identity = match &args.identity {
        Some(id) if !id.is_empty() => id.clone(),
        _ => format!("gpumem-claims-{}", std::process::id()),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client = Client::try_default().await.context("connecting to the Kubernetes API")?;
        // A controller without its CRD would only log watch errors: say what is missing instead.
        Api::<GpuClaim>::all(client.clone())
            .list(&ListParams::default().limit(1))
            .await
            .context("listing GPUClaims (is the CRD installed? `gpumem claims crd | kubectl apply -f -`)")?;
        let counts = Counts::default();
        let registry = Arc::new(counts.registry());
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        tokio::spawn(crate::http::serve(
            listener,
            crate::http::Limits::default(),
            None,
            move |req: Request<crate::http::Body>| {
                let registry = Arc::clone(&registry);
                async move { answer(req.uri().path(), &registry) }
            },
            std::future::pending(),
        ));
        let election = lease::Election {
            name: args.lease_name.clone(),
            identity: identity.clone(),
            duration: Duration::from_secs(15),
            renew_every: Duration::from_secs(5),
        };
        let leases: Api<Lease> = Api::namespaced(client.clone(), &args.lease_namespace);
        let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        tokio::select! {
            () = lease::acquire(&leases, &election) => {}
            _ = terminate.recv() => return Ok(()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
        counts.leading.set(1);
        let reporter = Reporter {
            controller: "gpumem-claims".into(),
            instance: Some(identity),
        };
        if args.dra_quotas {
            tokio::spawn(crate::quota::controller::run(client.clone(), args.dra_class.clone()));
        }
        let ctx = Arc::new(Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            unit_mib: args.mem_unit_mib,
            dra_class: args.dra_class.clone(),
            counts,
        });
        tracing::info!(listen = %args.listen, mem_unit_mib = args.mem_unit_mib, "gpumem claim controller running");
        let outcome = tokio::select! {
            () = controller::run(ctx) => Err(anyhow::anyhow!("the controller's watches ended")),
            () = lease::keep(&leases, &election) => Err(anyhow::anyhow!("lost the leader lease: stopping")),
            _ = terminate.recv() => { tracing::info!("SIGTERM: stopping"); Ok(()) }
            _ = tokio::signal::ctrl_c() => { tracing::info!("interrupted: stopping"); Ok(()) }
        };
        if outcome.is_ok() {
            lease::release(&leases, &election).await;
        }
        outcome
    })
}

fn answer(path: &str, registry: &prometheus_client::registry::Registry) -> Response<Full<Bytes>> {
    let (status, body) = match path {
        "/healthz" | "/readyz" => (StatusCode::OK, "ok\n".to_string()),
        "/metrics" => {
            let mut text = String::new();
            // Writing into a String cannot fail.
            let _ = prometheus_client::encoding::text::encode(&mut text, registry);
            (StatusCode::OK, text)
        }
        _ => (StatusCode::NOT_FOUND, "not found\n".to_string()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}
