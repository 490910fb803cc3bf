//! gpumem-scale: scheduling through the real kube-scheduler onto API-only GPU nodes, with the gpumem
//! extender or with kube-scheduler alone (docs/scale.md; scripts/scale.sh runs it).
//!
//! - `run`: creates the nodes (what the agent and the kubelet would publish, from the agent's own
//!   code), keeps them Ready through their Leases, plays the agent for the pods bound there, and
//!   measures creation-to-bound latency and pods per second in a steady, a burst and a fill phase;
//! - `chart`: one SVG of two runs (extender, alone);
//! - `table`: markdown rows of runs.

mod chart;
mod k8s;
mod mix;
mod played;
mod procs;
mod run;
mod spread;
mod stats;
mod trace;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "gpumem-scale",
    about = "Scheduling at scale through the real kube-scheduler"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create the scale nodes and run the phases against the cluster of KUBECONFIG.
    Run(Box<run::RunArgs>),
    /// One SVG of an extender run and an alone run.
    Chart(chart::ChartArgs),
    /// Markdown rows for the README's benchmark table.
    Table(chart::TableArgs),
    /// One address spreading TCP connections over several backends (a Service, for the fault run).
    Spread(spread::SpreadArgs),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(run::run(*args))),
        Command::Spread(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(spread::spread(args))),
        Command::Chart(args) => chart::chart(&args),
        Command::Table(args) => chart::table(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
