use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Share GPUs in Kubernetes by memory.
#[derive(Parser)]
#[command(name = "gpumem", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent (DaemonSet): kubelet device plugins for whole GPUs and GPU memory.
    Agent(gpumem::agent::AgentArgs),
    /// Show what the agent sees on this node: GPUs, topology, labels and resources it would publish.
    Inspect(gpumem::inspect::InspectArgs),
    /// Replay a GPU cluster trace through the placement policies and report allocation and fragmentation.
    Simulate(gpumem::sim::SimulateArgs),
    /// Run the kube-scheduler extender (Deployment): filter, prioritize, bind and preempt for GPU pods.
    Scorer(gpumem::scorer::cli::ScorerArgs),
    /// Make the certificates that authenticate kube-scheduler and the scorer to each other.
    Certs(gpumem::tls::certs::CertsArgs),
    /// GPU claims: GPU memory requests that step down while fragmentation keeps them unscheduled.
    Claims(gpumem::claim::ClaimsArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal: container logs and files get plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Agent(args) => gpumem::agent::run(&args),
        Command::Inspect(args) => gpumem::inspect::run(&args),
        Command::Simulate(args) => gpumem::sim::run(&args),
        Command::Scorer(args) => gpumem::scorer::cli::run(&args, gpumem::placer::start),
        Command::Certs(args) => gpumem::tls::certs::run(&args),
        Command::Claims(args) => gpumem::claim::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // One line a user can act on; the chain of causes is joined, not dumped as a backtrace.
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
