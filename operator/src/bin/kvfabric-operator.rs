//! `kvfabric-operator`: runs the controller against the cluster of the
//! ambient kubeconfig (or in-cluster config) and serves `/metrics`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use kvfabric_operator::{controller, metrics::Metrics};

#[derive(Parser)]
#[command(
    version,
    about = "kvfabric operator: KvFabric CRD, pod lifecycle → peer lifecycle"
)]
struct Args {
    /// Address of the /metrics endpoint (port 0 = ephemeral; the bound
    /// address is printed).
    #[arg(long, default_value = "0.0.0.0:9090")]
    metrics_listen: SocketAddr,
    /// kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long)]
    kubeconfig: Option<std::path::PathBuf>,
    /// kubeconfig context.
    #[arg(long)]
    context: Option<String>,
}

async fn client(args: &Args) -> Result<kube::Client, String> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| e.to_string())?;
            let opts = kube::config::KubeConfigOptions {
                context: args.context.clone(),
                ..Default::default()
            };
            kube::Config::from_custom_kubeconfig(kc, &opts)
                .await
                .map_err(|e| e.to_string())?
        }
        None => kube::Config::infer().await.map_err(|e| e.to_string())?,
    };
    kube::Client::try_from(config).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVFABRIC_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let metrics = match Metrics::new() {
        Ok(m) => Arc::new(m),
        Err(e) => {
            eprintln!("kvfabric-operator: metrics: {e}");
            return ExitCode::FAILURE;
        }
    };
    let client = match client(&args).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvfabric-operator: kube client: {e}");
            return ExitCode::FAILURE;
        }
    };
    match metrics.serve(args.metrics_listen).await {
        Ok(addr) => println!("kvfabric-operator: metrics on http://{addr}/metrics"),
        Err(e) => {
            eprintln!(
                "kvfabric-operator: cannot serve metrics on {}: {e}",
                args.metrics_listen
            );
            return ExitCode::FAILURE;
        }
    }
    tokio::select! {
        _ = controller::run(client, metrics) => {}
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted; exiting"),
    }
    ExitCode::SUCCESS
}
