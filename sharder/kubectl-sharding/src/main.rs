//! `kubectl sharding`: the kubectl plugin, a thin shell around [`kube_sharder::cli`].

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = kube_sharder::cli::Cli::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: failed to start a runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(kube_sharder::cli::run(cli, &mut std::io::stdout().lock())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
