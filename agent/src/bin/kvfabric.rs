//! `kvfabric` — the kvfabric command line.
//!
//! * `kvfabric dataplane-bench` — 64 MiB of 4/8/64 KiB random slots through
//!   the standard per-descriptor path, bounce and one descriptor, side by
//!   side in two processes, every transfer verified.
//! * `kvfabric peer` — the receiver process the bench spawns (internal).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvfabric_agent::bench::dataplane::{self, DataplaneOptions};
use kvfabric_agent::core::config::{parse_byte_size, BounceConfig};

#[derive(Parser)]
#[command(name = "kvfabric", version, about = "KV-cache fabric for disaggregated LLM serving")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Data-plane bench: standard path vs bounce vs one descriptor, two processes.
    DataplaneBench {
        /// Bytes per transfer (suffixes K/M/G accepted).
        #[arg(long, default_value = "64MiB", value_parser = byte_size)]
        total: u64,
        /// Descriptor sizes, comma-separated (suffixes accepted).
        #[arg(long, default_value = "4KiB,8KiB,64KiB", value_delimiter = ',', value_parser = byte_size)]
        sizes: Vec<u64>,
        /// Timed iterations per path and size (median reported).
        #[arg(long, default_value_t = 5)]
        iterations: usize,
        /// Bounce chunk size.
        #[arg(long, default_value = "4MiB", value_parser = byte_size)]
        chunk: u64,
        /// In-flight chunks per request (W).
        #[arg(long, default_value_t = 8)]
        inflight: u32,
        /// Arena size.
        #[arg(long, default_value = "64MiB", value_parser = byte_size)]
        arena: u64,
        /// Skip the (slow) standard per-descriptor path.
        #[arg(long)]
        skip_standard: bool,
        /// Write the JSON report here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Receiver process of the data-plane bench (spawned by it).
    #[command(hide = true)]
    Peer {
        /// Exchange directory.
        #[arg(long)]
        dir: PathBuf,
        /// Pool size in bytes.
        #[arg(long)]
        pool_bytes: u64,
    },
}

fn byte_size(s: &str) -> Result<u64, String> {
    parse_byte_size(s).map_err(|e| format!("{s:?}: {e}"))
}

fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVFABRIC_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    init_logs();
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Peer { dir, pool_bytes } => dataplane::run_peer(&dir, pool_bytes),
        Cmd::DataplaneBench {
            total,
            sizes,
            iterations,
            chunk,
            inflight,
            arena,
            skip_standard,
            json,
        } => (|| {
            let mut config = BounceConfig::default();
            for w in config.apply_env_vars([
                ("KVFABRIC_BOUNCE_ENABLE", "1".to_string()),
                ("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", arena.to_string()),
                ("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", chunk.to_string()),
                ("KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST", inflight.to_string()),
                ("KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT", "1".to_string()),
            ]) {
                eprintln!("warning: {w}");
            }
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let report = dataplane::run(
                &exe,
                &DataplaneOptions {
                    total_bytes: total,
                    block_sizes: sizes,
                    iterations,
                    config,
                    skip_standard,
                },
            )?;
            print!("{}", report.table());
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
                std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
            }
            Ok(())
        })(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
