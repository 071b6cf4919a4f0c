//! VRAM end-to-end bench (feature `cuda`; GPU issue "Must show"): two OS
//! processes, each a [`FabricAgent`] with a GPU arena (NIXL VRAM) and a
//! GPU KV pool (`cuMemAlloc`, registered as VRAM). The parent is the sender
//! on `--device`, the child (`kvfabric-gpu vram-peer`) the receiver on the
//! same GPU or on `--peer-device`. Side by side, the same bytes move as
//! (a) the standard per-descriptor NIXL path, (b) bounce (GPU gather →
//! one NIXL write per chunk → GPU scatter), (c) one contiguous descriptor.
//! Every transfer is verified byte-exact. With `--fill host` (the
//! default) the sender fills its pool on the host with the fast pattern
//! and uploads it; the receiver zeroes its pool before, downloads the whole
//! pool after and checks every byte (the pool is exactly the transferred
//! bytes, so a write outside a target fails too). That round trip through
//! host memory evicts the CPU caches between timed transfers; with
//! `--fill device` the pattern kernels (`kernels/pattern.cu`) fill the
//! source and check the destination on the GPUs, and the CPU caches stay
//! as a serving agent's would (issue 18, fifth session: both paths ≈ 40 %
//! faster, their ratio unchanged).
//!
//! The protocol with the child is the data-plane bench's
//! ([`super::dataplane::PeerProcess`]): `READY <file>`, then `ZERO`,
//! `VERIFY <seed> <descs file>` (download and check on the host),
//! `CHECK <seed> <descs file>` (check on the device with the pattern
//! kernels: descriptor `k` of the file against `kernels/pattern.cu`'s
//! pattern of `seed` and `k`; used by the GPU trace replay), `EXIT`;
//! answers `OK` / `ERR …`. The child
//! moves its own stdout to stderr so a library printing to stdout cannot
//! corrupt the protocol.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, Write};
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric_core::config::BounceConfig;
use kvfabric_core::Descriptor;
use serde::Serialize;

use super::dataplane::{read_descriptor, read_descs, write_descriptor, write_descs, PeerProcess};
use super::pattern::{check_fast, fill_fast, plane_slots, random_slots};
pub use super::timeline::BounceTimeline;
use crate::runtime::control::zmq::BindAddr;
use crate::runtime::cuda::pattern::{PatDesc, PatternKernels};
use crate::runtime::cuda::{CudaArena, CudaCopyConfig, CudaGpu};
use crate::runtime::engine::MemKind;
use crate::runtime::fabric::{ArenaChoice, FabricAgent, FabricOptions, PathKind, PeerMemory};
use crate::runtime::transport::TransferOutcome;

/// Bound on one transfer.
const XFER_TIMEOUT: Duration = Duration::from_secs(120);

/// Options of the VRAM bench.
#[derive(Clone, Debug)]
pub struct VramOptions {
    /// Bytes per transfer (also the size of each pool).
    pub total_bytes: u64,
    /// Descriptor size (bytes); `total_bytes / block_bytes` descriptors.
    pub block_bytes: u64,
    /// Timed iterations per path (after one untimed warm-up); the median
    /// is reported.
    pub iterations: usize,
    /// Bounce configs to run, one receiver process each (e.g. a sweep of
    /// max chunk sizes). The first also runs the standard and the
    /// one-descriptor paths.
    pub configs: Vec<BounceConfig>,
    /// The sender's GPU.
    pub device: usize,
    /// The receiver's GPU.
    pub peer_device: usize,
    /// CUDA copy-engine settings of both agents.
    pub copy: CudaCopyConfig,
    /// Skip the standard path (it takes ~0.1 s per 16,384 descriptors).
    pub skip_standard: bool,
    /// Destinations as this many planes of the same random blocks (a
    /// block hand-off into a layer-major pool, which DATA_BLOCKS names by
    /// block); 1: random slots in one plane. Divides the descriptor count.
    pub planes: usize,
    /// Where each iteration's payload is written and checked.
    pub fill: FillMode,
}

/// Where `vram-bench` writes each iteration's payload and checks it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FillMode {
    /// On the host: the pattern is written into a host buffer of the
    /// transfer's size and uploaded; the receiver downloads its whole pool
    /// and compares every byte, including that bytes no descriptor covers
    /// stayed zero. Between two timed transfers the host thus writes and
    /// reads ≈ 3 × the transfer size, which evicts the CPU caches the next
    /// transfer's code and data would otherwise find warm.
    #[default]
    Host,
    /// On the GPU (`kernels/pattern.cu`): the sender fills its source
    /// descriptors and the receiver checks every destination byte with a
    /// kernel; no payload crosses the host — as in serving, where the
    /// GPU writes the KV cache. Bytes outside the destinations are not
    /// checked.
    Device,
}

/// One measured row.
#[derive(Clone, Debug, Serialize)]
pub struct VramRow {
    /// "standard", "bounce" or "one-descriptor".
    pub path: String,
    /// Max chunk size of the bounce config in use (bytes).
    pub max_chunk_bytes: u64,
    /// Descriptors per transfer.
    pub descriptors: usize,
    /// Bytes per descriptor.
    pub block_bytes: u64,
    /// Timed iterations.
    pub iterations: usize,
    /// The untimed warm-up transfer (first use: IPC handles opened), ms.
    pub first_ms: f64,
    /// Median wall time submit → resolved (ms).
    pub median_ms: f64,
    /// Fastest iteration (ms).
    pub min_ms: f64,
    /// GB/s (1e9 B/s) at the median.
    pub gbps: f64,
    /// Bounce chunks written per transfer (0 for the other paths).
    pub chunks_per_transfer: f64,
    /// Every transfer (warm-up included) verified byte-exact.
    pub verified: bool,
    /// Bounce only: where the time of a request went, from the sender's
    /// stage events (medians over the timed iterations).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<BounceTimeline>,
}

/// The report of one run.
#[derive(Clone, Debug, Serialize)]
pub struct VramReport {
    /// Sender GPU ordinal.
    pub device: usize,
    /// Receiver GPU ordinal.
    pub peer_device: usize,
    /// Sender GPU name.
    pub device_name: String,
    /// Bytes per transfer.
    pub total_bytes: u64,
    /// Rows.
    pub rows: Vec<VramRow>,
    /// Best bounce GB/s over the standard path's.
    pub bounce_over_standard: Option<f64>,
    /// Best bounce GB/s over the one-descriptor write's.
    pub bounce_over_one_descriptor: Option<f64>,
}

impl VramReport {
    /// A plain-text table with the ratios.
    pub fn table(&self) -> String {
        let mut s = format!(
            "GPU {} -> GPU {} ({}), {} MiB per transfer\n{:>15} {:>9} {:>7} {:>10} {:>10} {:>10} {:>9} {:>7}\n",
            self.device,
            self.peer_device,
            self.device_name,
            self.total_bytes >> 20,
            "path",
            "chunk",
            "descs",
            "first ms",
            "median ms",
            "min ms",
            "GB/s",
            "chunks"
        );
        for r in &self.rows {
            s += &format!(
                "{:>15} {:>8}K {:>7} {:>10.3} {:>10.3} {:>10.3} {:>9.2} {:>7.1}\n",
                r.path,
                r.max_chunk_bytes / 1024,
                r.descriptors,
                r.first_ms,
                r.median_ms,
                r.min_ms,
                r.gbps,
                r.chunks_per_transfer
            );
        }
        for r in &self.rows {
            if let Some(t) = &r.timeline {
                s += &format!("{} {}K {}\n", r.path, r.max_chunk_bytes / 1024, t.line());
            }
        }
        if let Some(x) = self.bounce_over_standard {
            s += &format!("bounce / standard       = {x:.1}x\n");
        }
        if let Some(x) = self.bounce_over_one_descriptor {
            s += &format!("bounce / one-descriptor = {:.1}%\n", 100.0 * x);
        }
        s
    }
}

/// Moves the process's stdout to stderr and returns a writer on the
/// original stdout (the protocol channel).
fn protocol_stdout() -> Result<File, String> {
    // SAFETY: plain fd duplication; fd 1 and 2 are open in a child spawned
    // with piped stdout and inherited stderr.
    unsafe {
        let proto = libc::dup(1);
        if proto < 0 || libc::dup2(2, 1) < 0 {
            return Err(format!(
                "redirecting stdout: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(File::from_raw_fd(proto))
    }
}

fn copy_choice(gpu: &Arc<CudaGpu>, copy: CudaCopyConfig) -> ArenaChoice {
    ArenaChoice::Cuda {
        gpu: gpu.clone(),
        copy,
    }
}

/// Command-line arguments that start `kvfabric-gpu vram-peer` on GPU
/// `device` with a `pool_bytes` pool, writing its descriptor into `dir`.
pub(crate) fn peer_args(device: usize, dir: &Path, pool_bytes: u64) -> Vec<OsString> {
    vec![
        "--device".into(),
        device.to_string().into(),
        "vram-peer".into(),
        "--dir".into(),
        dir.as_os_str().to_owned(),
        "--pool-bytes".into(),
        pool_bytes.to_string().into(),
    ]
}

/// The receiver process (`kvfabric-gpu vram-peer`): a fabric agent with a
/// GPU arena and a `pool_bytes` GPU pool on `gpu`, driven over stdin/stdout.
/// The bounce config comes from `KVFABRIC_BOUNCE_*`.
///
/// # Errors
/// A text error when the agent cannot start or the parent misbehaves.
pub fn run_peer(
    gpu: &Arc<CudaGpu>,
    dir: &Path,
    pool_bytes: u64,
    copy: CudaCopyConfig,
) -> Result<(), String> {
    let mut out = protocol_stdout()?;
    let (config, warnings) = BounceConfig::from_env();
    for w in warnings {
        eprintln!("vram-peer: {w}");
    }
    let eff = config.validate().map_err(|e| e.to_string())?;
    let pool = CudaArena::new(gpu, pool_bytes as usize).map_err(|e| e.to_string())?;
    let agent = FabricAgent::with_arena(
        FabricOptions {
            name: format!("vram-peer-{}", std::process::id()),
            config: eff,
            kv_regions: vec![(MemKind::Vram, pool.mem_desc())],
            bind: BindAddr::Loopback,
            copy: None,
            control_auth: Default::default(),
        },
        copy_choice(gpu, copy),
    )
    .map_err(|e| e.to_string())?;
    if let Some(why) = &agent.bounce_unavailable() {
        eprintln!("vram-peer: bounce unavailable: {why}");
    }
    let desc = agent.local_descriptor().map_err(|e| e.to_string())?;
    let path = dir.join(format!("vram-receiver-{}.desc", std::process::id()));
    write_descriptor(&path, &desc, pool.base_addr(), pool_bytes).map_err(|e| e.to_string())?;
    writeln!(out, "READY {}", path.display()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    let mut host: Vec<u8> = Vec::new();
    let base = pool.base_addr();
    let mut pattern: Option<PatternKernels> = None;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let mut parts = line.split_whitespace();
        let reply = match parts.next() {
            Some("ZERO") => match pool.zero() {
                Ok(()) => "OK".to_string(),
                Err(e) => format!("ERR {e}"),
            },
            Some("CHECK") => {
                let seed: u64 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                let file = PathBuf::from(parts.next().unwrap_or(""));
                if pattern.is_none() {
                    match PatternKernels::new(gpu) {
                        Ok(p) => pattern = Some(p),
                        Err(e) => {
                            writeln!(out, "ERR pattern kernels: {e}").map_err(|e| e.to_string())?;
                            out.flush().map_err(|e| e.to_string())?;
                            continue;
                        }
                    }
                }
                let kernels = pattern.as_ref().expect("set above");
                match read_descs(&file) {
                    Err(e) => format!("ERR {e}"),
                    Ok(descs) => {
                        let table: Result<Vec<PatDesc>, String> = descs
                            .iter()
                            .enumerate()
                            .map(|(k, &(dst, len))| {
                                if dst < base || dst.saturating_add(len) > base + pool_bytes {
                                    Err(format!("descriptor {k} outside the pool"))
                                } else {
                                    Ok(PatDesc {
                                        addr: dst,
                                        len,
                                        k: k as u64,
                                    })
                                }
                            })
                            .collect();
                        match table.map(|t| kernels.check(&t, seed)) {
                            Err(e) => format!("ERR {e}"),
                            Ok(Err(e)) => format!("ERR pattern check: {e}"),
                            Ok(Ok(None)) => "OK".to_string(),
                            Ok(Ok(Some(m))) => format!(
                                "ERR {} words differ, first at descriptor {} byte {}",
                                m.count, m.descriptor, m.offset
                            ),
                        }
                    }
                }
            }
            Some("VERIFY") => {
                let seed: u64 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                let file = PathBuf::from(parts.next().unwrap_or(""));
                if host.len() != pool_bytes as usize {
                    host = vec![0u8; pool_bytes as usize];
                }
                match (read_descs(&file), pool.download(0, &mut host)) {
                    (Err(e), _) => format!("ERR {e}"),
                    (_, Err(e)) => format!("ERR {e}"),
                    (Ok(descs), Ok(())) => {
                        let bad = descs.iter().enumerate().find_map(|(k, &(dst, len))| {
                            if dst < base || dst + len > base + pool_bytes {
                                return Some(format!("descriptor {k} outside the pool"));
                            }
                            let at = host.as_ptr() as u64 + (dst - base);
                            // SAFETY: range checked inside `host` above.
                            unsafe { check_fast(at, len, seed, k as u64) }
                                .err()
                                .map(|j| format!("descriptor {k} byte {j} differs"))
                        });
                        // Bytes no descriptor covers must still be zero.
                        let covered: u64 = descs.iter().map(|d| d.1).sum();
                        match bad {
                            Some(e) => format!("ERR {e}"),
                            None if covered < pool_bytes => {
                                let mut mask = vec![false; host.len()];
                                for &(dst, len) in &descs {
                                    let o = (dst - base) as usize;
                                    mask[o..o + len as usize].fill(true);
                                }
                                match host.iter().zip(&mask).position(|(b, m)| !m && *b != 0) {
                                    Some(j) => format!("ERR byte {j} outside every target written"),
                                    None => "OK".to_string(),
                                }
                            }
                            None => "OK".to_string(),
                        }
                    }
                }
            }
            Some("EXIT") | None => break,
            Some(other) => format!("ERR unknown command {other}"),
        };
        writeln!(out, "{reply}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    drop(agent);
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs the bench: for each config, spawns `exe vram-peer` on the peer
/// device, builds the sending agent and times the paths, verifying every
/// transfer.
///
/// # Errors
/// Any setup failure, a failed transfer, a transfer routed to the wrong
/// path or a verification mismatch.
pub fn run(exe: &Path, gpu: &Arc<CudaGpu>, opts: &VramOptions) -> Result<VramReport, String> {
    let total = opts.total_bytes;
    let block = opts.block_bytes.max(1);
    let count = (total / block) as usize;
    if count == 0 || count as u64 * block != total {
        return Err(format!(
            "total {total} is not a multiple of the block {block}"
        ));
    }
    let dir = std::env::temp_dir().join(format!("kvfabric-vram-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let pool = CudaArena::new(gpu, total as usize).map_err(|e| e.to_string())?;
    let mut staging = match opts.fill {
        FillMode::Host => vec![0u8; total as usize],
        FillMode::Device => Vec::new(),
    };
    let fill_kernels = match opts.fill {
        FillMode::Host => None,
        FillMode::Device => {
            Some(PatternKernels::new(gpu).map_err(|e| format!("pattern kernels: {e}"))?)
        }
    };
    let descs_file = dir.join("descs.bin");
    let mut rows = Vec::new();
    let mut seed = 1u64;
    for (ci, config) in opts.configs.iter().enumerate() {
        let eff = config.validate().map_err(|e| e.to_string())?;
        let chunk = eff.max_chunk_size_bytes();
        let args = peer_args(opts.peer_device, &dir, total);
        let mut peer = PeerProcess::spawn_args(exe, &args, &config.to_env_vars())?;
        let (rdesc, rpool, rlen) = read_descriptor(&peer.descriptor)?;
        if rlen < total {
            return Err("receiver pool too small".into());
        }
        let agent = FabricAgent::with_arena(
            FabricOptions {
                name: format!("vram-bench-{}-{ci}", std::process::id()),
                config: eff,
                kv_regions: vec![(MemKind::Vram, pool.mem_desc())],
                bind: BindAddr::Loopback,
                copy: None,
                control_auth: Default::default(),
            },
            copy_choice(gpu, opts.copy),
        )
        .map_err(|e| e.to_string())?;
        if let Some(why) = &agent.bounce_unavailable() {
            return Err(format!("sender bounce unavailable: {why}"));
        }
        let state = agent.load_peer(&rdesc).map_err(|e| e.to_string())?;
        if let Err(why) = &state.bounce {
            return Err(format!("receiver is not bounce-capable: {why:?}"));
        }
        agent.set_peer_memory(
            &rdesc.name,
            PeerMemory {
                kind: MemKind::Vram,
                device_id: opts.peer_device as u64,
            },
        );
        let descs = if opts.planes > 1 {
            plane_slots(
                pool.base_addr(),
                rpool,
                count,
                opts.planes,
                block,
                block ^ 0x5eed,
            )
        } else {
            random_slots(pool.base_addr(), rpool, count, block, block ^ 0x5eed)
        };
        if !agent.should_use_bounce(&rdesc.name, &descs, MemKind::Vram, MemKind::Vram) {
            return Err("the routing gate does not send VRAM→VRAM to bounce".into());
        }
        let one = vec![Descriptor::new(pool.base_addr(), rpool, total)];
        let mut paths: Vec<(&str, &Vec<Descriptor>)> = Vec::new();
        if ci == 0 && !opts.skip_standard {
            paths.push(("standard", &descs));
        }
        paths.push(("bounce", &descs));
        if ci == 0 {
            paths.push(("one-descriptor", &one));
        }
        for (path, ds) in paths {
            let mut times = Vec::new();
            let mut timelines = Vec::new();
            let mut first_ms = 0.0;
            let chunks0 = agent
                .transport()
                .map_or(0, |t| t.stats().chunks_written.load(Ordering::Relaxed));
            for it in 0..=opts.iterations.max(1) {
                seed += 1;
                if let Some(kernels) = &fill_kernels {
                    let table: Vec<PatDesc> = ds
                        .iter()
                        .enumerate()
                        .map(|(k, d)| PatDesc {
                            addr: d.src,
                            len: d.len,
                            k: k as u64,
                        })
                        .collect();
                    kernels
                        .fill(&table, seed)
                        .map_err(|e| format!("pattern fill: {e}"))?;
                } else {
                    for (k, d) in ds.iter().enumerate() {
                        let off = d.src - pool.base_addr();
                        let at = staging.as_mut_ptr() as u64 + off;
                        // SAFETY: every src lies inside our pool, the same
                        // size as `staging`.
                        unsafe { fill_fast(at, d.len, seed, k as u64) };
                    }
                    pool.upload(0, &staging).map_err(|e| e.to_string())?;
                }
                write_descs(&descs_file, ds).map_err(|e| e.to_string())?;
                peer.command("ZERO")?;
                // The caller's own descriptor list, made before the clock
                // starts (a fresh 393 KB copy of 16,384 descriptors costs
                // tens of µs of page faults on the H200 host; the
                // transfer is what is timed).
                let owned = ds.clone();
                let t0 = Instant::now();
                let h = match path {
                    "bounce" => {
                        // Traced: the IO thread records each chunk's
                        // stages from instants it takes anyway.
                        let (kind, h) = agent.submit_write_kinds_traced(
                            &rdesc.name,
                            owned,
                            MemKind::Vram,
                            MemKind::Vram,
                            true,
                        );
                        if kind != PathKind::Bounce {
                            return Err(format!("bounce transfer routed to {kind:?}"));
                        }
                        h
                    }
                    _ => agent.submit_standard(&rdesc.name, owned),
                };
                match h.wait(XFER_TIMEOUT) {
                    Some(TransferOutcome::Success) => {}
                    other => return Err(format!("{path} transfer: {other:?}")),
                }
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                if path == "bounce" && it > 0 {
                    let (events, _) = h.take_timeline();
                    timelines.push(BounceTimeline::of(&events, t0, ms * 1e3));
                }
                let verify = match opts.fill {
                    FillMode::Host => "VERIFY",
                    FillMode::Device => "CHECK",
                };
                peer.command(&format!("{verify} {seed} {}", descs_file.display()))
                    .map_err(|e| format!("{path} verification: {e}"))?;
                if it == 0 {
                    first_ms = ms;
                    eprintln!(
                        "vram-bench: first {path} transfer (chunk {} KiB) {ms:.3} ms, verified",
                        chunk >> 10
                    );
                } else {
                    times.push(ms);
                }
            }
            let chunks1 = agent
                .transport()
                .map_or(0, |t| t.stats().chunks_written.load(Ordering::Relaxed));
            let n = times.len();
            let min_ms = times.iter().copied().fold(f64::INFINITY, f64::min);
            let med = median(&mut times);
            rows.push(VramRow {
                path: path.to_string(),
                max_chunk_bytes: chunk,
                descriptors: ds.len(),
                block_bytes: ds[0].len,
                iterations: n,
                first_ms,
                median_ms: med,
                min_ms,
                gbps: total as f64 / (med / 1e3) / 1e9,
                chunks_per_transfer: (chunks1 - chunks0) as f64 / (n + 1) as f64,
                verified: true,
                timeline: BounceTimeline::median_of(&timelines),
            });
        }
        drop(agent);
        drop(peer);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let best = |p: &str| {
        rows.iter()
            .filter(|r| r.path == p)
            .map(|r| r.gbps)
            .fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.max(x))))
    };
    let bounce = best("bounce");
    Ok(VramReport {
        device: opts.device,
        peer_device: opts.peer_device,
        device_name: gpu.info().name.clone(),
        total_bytes: total,
        bounce_over_standard: bounce.zip(best("standard")).map(|(b, s)| b / s),
        bounce_over_one_descriptor: bounce.zip(best("one-descriptor")).map(|(b, o)| b / o),
        rows,
    })
}

/// The flags of `kvfabric-gpu vram-bench` (sizes in bytes).
#[derive(Clone, Debug)]
pub struct VramBenchArgs {
    /// Bytes per transfer.
    pub total: u64,
    /// Descriptor size, at most `total`.
    pub block: u64,
    /// The receiver's GPU (default: the sender's).
    pub peer_device: Option<usize>,
    /// Bounce max chunk sizes to run (one receiver process each; the first
    /// also runs the other two paths); empty: the agents' own
    /// (`KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES`, else the bounce default,
    /// 64 MiB).
    pub chunks: Vec<u64>,
    /// Bounce arena size of both agents (default:
    /// `KVFABRIC_BOUNCE_ARENA_SIZE_BYTES`, else the bounce default, 512 MiB).
    pub arena: Option<u64>,
    /// Per-request in-flight chunk cap W (default:
    /// `KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST`, else 8).
    pub inflight: Option<u32>,
    /// Timed iterations per path (after one warm-up).
    pub iterations: usize,
    /// Skip the standard per-descriptor path.
    pub skip_standard: bool,
    /// Destinations in this many planes of the same blocks (1: random
    /// slots); must divide `total / block`.
    pub planes: usize,
    /// Per-descriptor scatter runs (no run merging).
    pub no_merge: bool,
    /// Copy worker threads per agent (default:
    /// `KVFABRIC_BOUNCE_SCATTER_WORKER_COUNT`, else 4).
    pub workers: Option<u32>,
    /// Write the JSON report here.
    pub json: Option<PathBuf>,
    /// Where each iteration's payload is written and checked.
    pub fill: FillMode,
}

/// `kvfabric-gpu vram-bench` on `gpu` (ordinal `device`): layers the flags
/// over the `KVFABRIC_BOUNCE_*` environment (the receiver process gets
/// the result), reports peer access between the two GPUs, runs [`run`]
/// with `exe` = this executable under a UCX [`OutputTap`](super::ucx_tap::OutputTap),
/// and prints the table and the transport report (and writes them as JSON
/// to `args.json`).
///
/// # Errors
/// A bounce config the flags make invalid (named by chunk size), a block
/// size of 0 or above the total, any failure of [`run`],
/// a report that cannot be written.
pub fn run_cli(gpu: &Arc<CudaGpu>, device: usize, a: &VramBenchArgs) -> Result<(), String> {
    use super::ucx_tap::OutputTap;
    use crate::core::config::ByteSize;
    use cudarc::driver::sys;

    let (total, block) = (a.total, a.block);
    if block == 0 || block > total {
        return Err(format!(
            "--block: expected 1 to --total ({total}) bytes, got {block}"
        ));
    }
    let count = total / block;
    if a.planes == 0 || count % a.planes as u64 != 0 {
        return Err(format!(
            "--planes: expected a divisor of the descriptor count ({count} = --total / --block), got {}",
            a.planes
        ));
    }
    let peer_device = a.peer_device.unwrap_or(device);
    // KVFABRIC_BOUNCE_* (e.g. CONTROL_TRANSPORT, IO_BUSY_POLL_US) under the
    // flags; the receiver process gets the result.
    let (base, warnings) = BounceConfig::from_env();
    for w in warnings {
        eprintln!("warning: {w}");
    }
    let arena = a.arena.map_or(base.arena_size_bytes, ByteSize);
    let inflight = a.inflight.unwrap_or(base.max_inflight_chunks_per_request);
    let workers = a.workers.unwrap_or(base.scatter_worker_count);
    let mut configs = Vec::new();
    let chunks = if a.chunks.is_empty() {
        vec![base.max_chunk_size_bytes.0]
    } else {
        a.chunks.clone()
    };
    for &chunk in &chunks {
        let cfg = BounceConfig {
            enabled: true,
            arena_size_bytes: arena,
            max_chunk_size_bytes: ByteSize(chunk),
            max_inflight_chunks_per_request: inflight,
            disable_scatter_run_merging: a.no_merge || base.disable_scatter_run_merging,
            scatter_worker_count: workers,
            copy_stream_count: workers.max(base.copy_stream_count),
            ..base.clone()
        };
        cfg.validate().map_err(|e| format!("chunk {chunk}: {e}"))?;
        configs.push(cfg);
    }
    let mut p2p = None;
    if peer_device != device {
        let (mut can, mut back) = (0, 0);
        // SAFETY: out-pointers to locals; ordinals are device handles
        // (CUdevice is the ordinal).
        unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, device as i32, peer_device as i32);
            sys::cuDeviceCanAccessPeer(&mut back, peer_device as i32, device as i32);
        }
        println!(
            "peer access GPU {device} -> GPU {}: {}, back: {}",
            peer_device,
            can != 0,
            back != 0
        );
        p2p = Some(can != 0 && back != 0);
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // UCX prints the transports it picks at info level and its protocol
    // choices with PROTO_INFO; the tap reads them back (before any NIXL
    // agent exists, so UCX reads these settings).
    for (k, v) in [("UCX_LOG_LEVEL", "info"), ("UCX_PROTO_INFO", "y")] {
        if std::env::var_os(k).is_none() {
            std::env::set_var(k, v);
        }
    }
    let tap = match OutputTap::start() {
        Ok(t) => Some(t),
        Err(e) => {
            eprintln!("warning: no transport report ({e})");
            None
        }
    };
    let opts = VramOptions {
        total_bytes: total,
        block_bytes: block,
        iterations: a.iterations,
        configs,
        device,
        peer_device,
        copy: CudaCopyConfig::default(),
        skip_standard: a.skip_standard,
        planes: a.planes,
        fill: a.fill,
    };
    let out = run(&exe, gpu, &opts);
    let report_tp = tap.map(OutputTap::finish);
    let report = out?;
    println!("{}", report.table());
    if let Some(t) = &report_tp {
        println!("{}", t.summary());
    }
    if let Some(p) = &a.json {
        let j = serde_json::json!({
            "bench": "vram-bench",
            "report": report,
            "peer_access": p2p,
            "fill": a.fill,
            "transport": report_tp,
        });
        std::fs::write(p, serde_json::to_string_pretty(&j).unwrap_or_default())
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    Ok(())
}
