//! `kvfabric-operator`: runs the controller against the cluster of the
//! ambient kubeconfig (or in-cluster config) and serves `/metrics`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kvfabric_operator::leader::{ElectionConfig, LeaderElector};
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
    /// Elect a leader among replicas on a `coordination.k8s.io` Lease; only
    /// the leader acts. Off: this process acts at once (one replica only).
    #[arg(long)]
    leader_elect: bool,
    /// Namespace of the leader-election Lease (default: $POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE")]
    leader_election_namespace: Option<String>,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "kvfabric-operator")]
    leader_election_lease_name: String,
    /// This replica's identity in the Lease (default: $POD_NAME or the
    /// hostname, plus the process id).
    #[arg(long)]
    leader_election_identity: Option<String>,
    /// Lease duration, ms: how long after the leader's last renewal another
    /// replica may take over.
    #[arg(long, default_value_t = 15_000, value_parser = clap::value_parser!(u64).range(1000..=3_600_000))]
    leader_election_lease_duration_ms: u64,
    /// Renew deadline, ms: the leader stops (exits) when it could not renew
    /// for this long. Must be below the lease duration.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    leader_election_renew_deadline_ms: u64,
    /// Retry period, ms, between election attempts and renewals. Must be
    /// below the renew deadline.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    leader_election_retry_ms: u64,
}

impl Args {
    /// The election settings, validated; `Ok(None)` without `--leader-elect`.
    fn election(&self) -> Result<Option<ElectionConfig>, String> {
        if !self.leader_elect {
            return Ok(None);
        }
        let namespace = self.leader_election_namespace.clone().ok_or(
            "--leader-elect needs --leader-election-namespace (or $POD_NAMESPACE)".to_string(),
        )?;
        let identity = self.leader_election_identity.clone().unwrap_or_else(|| {
            let host = std::env::var("POD_NAME")
                .or_else(|_| std::env::var("HOSTNAME"))
                .unwrap_or_else(|_| "kvfabric-operator".into());
            format!("{host}_{}", std::process::id())
        });
        let cfg = ElectionConfig {
            namespace,
            lease_name: self.leader_election_lease_name.clone(),
            identity,
            lease_duration: Duration::from_millis(self.leader_election_lease_duration_ms),
            renew_deadline: Duration::from_millis(self.leader_election_renew_deadline_ms),
            retry: Duration::from_millis(self.leader_election_retry_ms),
        };
        cfg.validate()?;
        Ok(Some(cfg))
    }
}

/// Resolves on SIGINT or SIGTERM (the kubelet's stop signal).
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
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
    let election = match args.election() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kvfabric-operator: {e}");
            return ExitCode::from(2);
        }
    };
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
    let Some(cfg) = election else {
        metrics.leader.set(1);
        tokio::select! {
            _ = controller::run(client, metrics) => {}
            _ = shutdown_signal() => tracing::info!("signalled; exiting"),
        }
        return ExitCode::SUCCESS;
    };
    // Campaign; act only while leading; step down (exit non-zero, as
    // client-go does) when the lease is lost.
    let elector = Arc::new(LeaderElector::new(client.clone(), cfg));
    let (tx, mut leading) = tokio::sync::watch::channel(false);
    let campaign = {
        let elector = elector.clone();
        tokio::spawn(async move { elector.run(tx).await })
    };
    let became_leader = async {
        while !*leading.borrow_and_update() {
            if leading.changed().await.is_err() {
                return false;
            }
        }
        true
    };
    let leader = tokio::select! {
        l = became_leader => l,
        _ = shutdown_signal() => {
            tracing::info!("signalled before becoming leader; exiting");
            campaign.abort();
            return ExitCode::SUCCESS;
        }
    };
    if !leader {
        eprintln!("kvfabric-operator: leader election ended without leadership");
        return ExitCode::FAILURE;
    }
    metrics.leader.set(1);
    let lost = async {
        while *leading.borrow_and_update() {
            if leading.changed().await.is_err() {
                break;
            }
        }
    };
    let code = tokio::select! {
        _ = controller::run(client, metrics.clone()) => ExitCode::SUCCESS,
        _ = lost => {
            eprintln!("kvfabric-operator: leadership lost; exiting so that only the new leader acts");
            ExitCode::FAILURE
        }
        _ = shutdown_signal() => {
            tracing::info!("signalled; releasing the lease");
            campaign.abort();
            elector.release().await;
            ExitCode::SUCCESS
        }
    };
    metrics.leader.set(0);
    code
}
