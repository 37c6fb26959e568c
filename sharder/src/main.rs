//! The sharder binary: parses flags, initialises logging, and runs [`kube_sharder::run`].

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use kube_sharder::records;
use tokio_util::sync::CancellationToken;

/// Assigns objects of ClusterRings to shards and moves them when shards come and go.
#[derive(Parser, Debug)]
#[command(name = "sharder", version)]
struct Args {
    /// Path of the SharderConfig file; without it the defaults apply.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Log level or filter (e.g. `info`, `sharder=debug,info`).
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Overrides `leaderElection.leaderElect` from the config file (`--leader-elect=false`).
    #[arg(long)]
    leader_elect: Option<bool>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log_level)?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match args.log_format {
        LogFormat::Text => builder.init(),
        // Each record's fields at the top level, as the shard library's users print them: one
        // shape of record, `event` included, for every process of a ring.
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut config = kube_sharder::load_config(args.config.as_deref())?;
    if let Some(leader_elect) = args.leader_elect {
        config.leader_election.leader_elect = leader_elect;
    }
    tokio::runtime::Runtime::new()?.block_on(async move {
        let shutdown = CancellationToken::new();
        tokio::spawn(shutdown_on_signal(shutdown.clone()));
        kube_sharder::run(config, kube_sharder::default_identity(), shutdown).await
    })
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT; a second one exits at once.
async fn shutdown_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!(
            event = records::EVENT_SIGNAL_HANDLERS_FAILED,
            "failed to install signal handlers"
        );
        return;
    };
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::info!(
        event = records::EVENT_SHUTDOWN_SIGNALLED,
        "received shutdown signal"
    );
    shutdown.cancel();
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    std::process::exit(1);
}
