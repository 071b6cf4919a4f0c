//! Data-plane side-by-side benchmark in two OS processes (issue "Bounce data
//! plane", DESIGN.md measurements): the parent is the sender, a child
//! process (`kvfabric peer`) is the receiver. For each descriptor size, the
//! same bytes move as (a) the standard per-descriptor NIXL path, (b) bounce,
//! (c) one contiguous descriptor; every run is verified byte-exact by the
//! receiver before the next.
//!
//! Parent ↔ child protocol (text lines on the child's stdin/stdout):
//! child prints `READY <descriptor file>`; parent sends `ZERO` (clear the
//! pool), `VERIFY <seed> <descs file>` (check every byte) or `EXIT`; child
//! answers `OK` or `ERR <reason>`. Every wait is bounded.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvfabric_core::config::BounceConfig;
use kvfabric_core::Descriptor;
use serde::Serialize;

use super::pattern::{check_raw, fill_raw, random_slots};
use super::timeline::BounceTimeline;
use crate::runtime::arena::HostArena;
use crate::runtime::control::zmq::BindAddr;
use crate::runtime::engine::{MemDesc, MemKind};
use crate::runtime::fabric::{FabricAgent, FabricOptions, PeerDescriptor};
use crate::runtime::transport::TransferOutcome;

/// Bound on one transfer in the bench.
const XFER_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on one child reply (verification of the whole pool included).
const REPLY_TIMEOUT: Duration = Duration::from_secs(120);

/// Options of the data-plane bench.
#[derive(Clone, Debug)]
pub struct DataplaneOptions {
    /// Bytes moved per transfer (all descriptor sizes move the same total).
    pub total_bytes: u64,
    /// Descriptor sizes to run (bytes).
    pub block_sizes: Vec<u64>,
    /// Timed iterations per path and size (the median is reported).
    pub iterations: usize,
    /// Untimed warm-up iterations before them (verified like the rest).
    pub warmup: usize,
    /// Bounce config for both processes (also passed to the child via
    /// `KVFABRIC_BOUNCE_*`).
    pub config: BounceConfig,
    /// Skip (a) for sizes where it would take very long.
    pub skip_standard: bool,
}

/// One measured row.
#[derive(Clone, Debug, Serialize)]
pub struct DataplaneRow {
    /// Descriptor size (bytes).
    pub block_bytes: u64,
    /// Descriptor count.
    pub descriptors: usize,
    /// Path: "standard", "bounce" or "one-descriptor".
    pub path: String,
    /// Median wall time per transfer (ms).
    pub median_ms: f64,
    /// Fastest iteration (ms).
    pub min_ms: f64,
    /// Slowest iteration (ms).
    pub max_ms: f64,
    /// GB/s (1e9 bytes/s) at the median.
    pub gbps: f64,
    /// Every iteration verified byte-exact.
    pub verified: bool,
    /// Bounce only: where a timed request's time went (stage medians, µs
    /// after submit; the IO thread stamps instants it takes anyway).
    pub timeline: Option<BounceTimeline>,
}

/// The report: rows plus ratios of bounce to the standard path and to the
/// single-descriptor write, per size.
#[derive(Clone, Debug, Serialize)]
pub struct DataplaneReport {
    /// Total bytes per transfer.
    pub total_bytes: u64,
    /// Iterations per row.
    pub iterations: usize,
    /// Rows.
    pub rows: Vec<DataplaneRow>,
}

impl DataplaneReport {
    /// Median GB/s of `path` at `block` bytes.
    pub fn gbps(&self, block: u64, path: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.block_bytes == block && r.path == path)
            .map(|r| r.gbps)
    }

    /// A plain-text table with ratios.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{:>9} {:>7} {:>15} {:>10} {:>8} {:>17}\n",
            "desc", "count", "path", "median ms", "GB/s", "min..max ms"
        );
        for r in &self.rows {
            s += &format!(
                "{:>8}K {:>7} {:>15} {:>10.2} {:>8.3} {:>8.2}..{:<8.2}\n",
                r.block_bytes / 1024,
                r.descriptors,
                r.path,
                r.median_ms,
                r.gbps,
                r.min_ms,
                r.max_ms
            );
        }
        for r in &self.rows {
            if let Some(t) = &r.timeline {
                s += &format!("{}K {}\n", r.block_bytes / 1024, t.line());
            }
        }
        let mut blocks: Vec<u64> = self.rows.iter().map(|r| r.block_bytes).collect();
        blocks.dedup();
        for b in blocks {
            let bounce = self.gbps(b, "bounce");
            if let (Some(x), Some(a)) = (bounce, self.gbps(b, "standard")) {
                s += &format!("{}K: bounce / standard = {:.2}x\n", b / 1024, x / a);
            }
            if let (Some(x), Some(c)) = (bounce, self.gbps(b, "one-descriptor")) {
                s += &format!(
                    "{}K: bounce / one-descriptor = {:.0}%\n",
                    b / 1024,
                    100.0 * x / c
                );
            }
        }
        s
    }
}

/// Writes a peer descriptor file: name, NIXL metadata, handshake, pool
/// address and length.
pub(crate) fn write_descriptor(
    path: &Path,
    d: &PeerDescriptor,
    pool: u64,
    pool_len: u64,
) -> std::io::Result<()> {
    let mut out = Vec::new();
    let put = |out: &mut Vec<u8>, b: &[u8]| {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(b);
    };
    put(&mut out, d.name.as_bytes());
    put(&mut out, &d.nixl_metadata);
    put(&mut out, d.handshake.as_deref().unwrap_or(&[]));
    out.extend_from_slice(&pool.to_le_bytes());
    out.extend_from_slice(&pool_len.to_le_bytes());
    std::fs::write(path, out)
}

/// Reads what [`write_descriptor`] wrote.
pub(crate) fn read_descriptor(path: &Path) -> Result<(PeerDescriptor, u64, u64), String> {
    let b = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut pos = 0usize;
    let u64_at = |pos: &mut usize| -> Result<u64, String> {
        let v = b
            .get(*pos..*pos + 8)
            .ok_or("truncated descriptor file")?
            .try_into()
            .map(u64::from_le_bytes)
            .map_err(|_| "truncated")?;
        *pos += 8;
        Ok(v)
    };
    let bytes = |pos: &mut usize| -> Result<Vec<u8>, String> {
        let n = u64_at(pos)? as usize;
        let v = b
            .get(*pos..*pos + n)
            .ok_or("truncated descriptor file")?
            .to_vec();
        *pos += n;
        Ok(v)
    };
    let name = String::from_utf8(bytes(&mut pos)?).map_err(|_| "bad name")?;
    let md = bytes(&mut pos)?;
    let hs = bytes(&mut pos)?;
    let pool = u64_at(&mut pos)?;
    let len = u64_at(&mut pos)?;
    Ok((
        PeerDescriptor {
            name,
            nixl_metadata: md,
            handshake: (!hs.is_empty()).then_some(hs),
            draining: false,
        },
        pool,
        len,
    ))
}

/// Writes the (destination, length) of each descriptor for the receiver.
pub(crate) fn write_descs(path: &Path, descs: &[Descriptor]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(descs.len() * 16);
    for d in descs {
        out.extend_from_slice(&d.dst.to_le_bytes());
        out.extend_from_slice(&d.len.to_le_bytes());
    }
    std::fs::write(path, out)
}

/// Reads what [`write_descs`] wrote.
pub(crate) fn read_descs(path: &Path) -> Result<Vec<(u64, u64)>, String> {
    let b = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(b.chunks_exact(16)
        .map(|c| {
            (
                u64::from_le_bytes(c[..8].try_into().expect("8")),
                u64::from_le_bytes(c[8..].try_into().expect("8")),
            )
        })
        .collect())
}

/// The receiver process (`kvfabric peer`): a fabric agent over a
/// `pool_bytes` host pool, driven by the parent over stdin/stdout.
///
/// # Errors
/// A text error when the agent cannot start or the parent misbehaves.
pub fn run_peer(dir: &Path, pool_bytes: u64) -> Result<(), String> {
    let (config, warnings) = BounceConfig::from_env();
    for w in warnings {
        eprintln!("peer: {w}");
    }
    let eff = config.validate().map_err(|e| e.to_string())?;
    let pool = HostArena::new_base_pages(pool_bytes as usize).map_err(|e| e.to_string())?;
    let name = format!("peer-{}", std::process::id());
    let agent = FabricAgent::new(FabricOptions {
        name,
        config: eff,
        kv_regions: vec![(MemKind::Dram, MemDesc::host(pool.base_addr(), pool_bytes))],
        bind: BindAddr::Loopback,
        copy: None,
        control_auth: Default::default(),
    })
    .map_err(|e| e.to_string())?;
    let desc = agent.local_descriptor().map_err(|e| e.to_string())?;
    let path = dir.join("receiver.desc");
    write_descriptor(&path, &desc, pool.base_addr(), pool_bytes).map_err(|e| e.to_string())?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(out, "READY {}", path.display()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let mut parts = line.split_whitespace();
        let reply = match parts.next() {
            Some("ZERO") => {
                // SAFETY: the pool is ours; no transfer is in flight (the
                // parent only sends ZERO between transfers).
                unsafe {
                    std::ptr::write_bytes(
                        pool.base_addr() as usize as *mut u8,
                        0,
                        pool_bytes as usize,
                    )
                };
                "OK".to_string()
            }
            Some("VERIFY") => {
                let seed: u64 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                let file = PathBuf::from(parts.next().unwrap_or(""));
                match read_descs(&file) {
                    Err(e) => format!("ERR {e}"),
                    Ok(descs) => {
                        let bad = descs.iter().enumerate().find_map(|(k, &(dst, len))| {
                            if dst < pool.base_addr() || dst + len > pool.base_addr() + pool_bytes {
                                return Some(format!("descriptor {k} outside the pool"));
                            }
                            // SAFETY: range checked inside the pool above.
                            unsafe { check_raw(dst, len, seed, k as u64) }
                                .err()
                                .map(|j| format!("descriptor {k} byte {j} differs"))
                        });
                        match bad {
                            None => "OK".to_string(),
                            Some(e) => format!("ERR {e}"),
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

/// A running receiver child.
pub struct PeerProcess {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    /// The descriptor file it wrote.
    pub descriptor: PathBuf,
}

impl PeerProcess {
    /// Spawns `exe peer --dir DIR --pool-bytes N` with `env` added, and waits
    /// (≤ 60 s) for READY.
    ///
    /// # Errors
    /// When the child cannot start or does not become ready in time.
    pub fn spawn(
        exe: &Path,
        dir: &Path,
        pool_bytes: u64,
        env: &[(String, String)],
    ) -> Result<Self, String> {
        let args = [
            "peer".into(),
            "--dir".into(),
            dir.as_os_str().to_owned(),
            "--pool-bytes".into(),
            pool_bytes.to_string().into(),
        ];
        Self::spawn_args(exe, &args, env)
    }

    /// Spawns `exe ARGS…` with `env` added, and waits (≤ 60 s) for its
    /// `READY <descriptor file>` line. Lines that are not part of the
    /// protocol (a library printing to stdout) are echoed to stderr and
    /// skipped.
    ///
    /// # Errors
    /// When the child cannot start or does not become ready in time.
    pub fn spawn_args(
        exe: &Path,
        args: &[std::ffi::OsString],
        env: &[(String, String)],
    ) -> Result<Self, String> {
        let mut child = Command::new(exe)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", exe.display()))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout: ChildStdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut p = Self {
            child,
            stdin,
            lines: rx,
            descriptor: PathBuf::new(),
        };
        let ready = p.read_line(Duration::from_secs(60))?;
        let path = ready
            .strip_prefix("READY ")
            .ok_or_else(|| format!("peer said {ready:?}, expected READY"))?;
        p.descriptor = PathBuf::from(path);
        Ok(p)
    }

    fn read_line(&mut self, timeout: Duration) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .map_err(|_| "peer process did not answer in time (or exited)".to_string())?;
            if line == "OK" || line.starts_with("ERR") || line.starts_with("READY ") {
                return Ok(line);
            }
            eprintln!("peer stdout: {line}");
        }
    }

    /// Sends a command line and returns `Ok(())` on `OK`.
    ///
    /// # Errors
    /// The child's `ERR` text, or a timeout.
    pub fn command(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.stdin, "{line}").map_err(|e| format!("writing to peer: {e}"))?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        let reply = self.read_line(REPLY_TIMEOUT)?;
        if reply == "OK" {
            Ok(())
        } else {
            Err(reply)
        }
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "EXIT");
        let _ = self.stdin.flush();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the side-by-side bench: spawns the receiver (`exe peer`), then for
/// each size times the three paths, verifying every transfer.
///
/// # Errors
/// Any setup failure, a failed transfer or a verification mismatch.
pub fn run(exe: &Path, opts: &DataplaneOptions) -> Result<DataplaneReport, String> {
    let eff = opts.config.validate().map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("kvfabric-dp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let total = opts.total_bytes;
    let mut peer = PeerProcess::spawn(exe, &dir, total, &opts.config.to_env_vars())?;
    let (rdesc, rpool, rlen) = read_descriptor(&peer.descriptor)?;
    if rlen < total {
        return Err("receiver pool too small".into());
    }
    let pool = HostArena::new_base_pages(total as usize).map_err(|e| e.to_string())?;
    let agent = FabricAgent::new(FabricOptions {
        name: format!("bench-{}", std::process::id()),
        config: eff,
        kv_regions: vec![(MemKind::Dram, MemDesc::host(pool.base_addr(), total))],
        bind: BindAddr::Loopback,
        copy: None,
        control_auth: Default::default(),
    })
    .map_err(|e| e.to_string())?;
    let state = agent.load_peer(&rdesc).map_err(|e| e.to_string())?;
    if let Err(why) = &state.bounce {
        return Err(format!("receiver is not bounce-capable: {why:?}"));
    }
    let mut rows = Vec::new();
    let mut seed = 1u64;
    let descs_file = dir.join("descs.bin");
    for &block in &opts.block_sizes {
        let count = (total / block) as usize;
        let descs = random_slots(pool.base_addr(), rpool, count, block, block);
        let one = vec![Descriptor::new(
            pool.base_addr(),
            rpool,
            count as u64 * block,
        )];
        let mut paths: Vec<(&str, &Vec<Descriptor>)> = Vec::new();
        if !opts.skip_standard {
            paths.push(("standard", &descs));
        }
        paths.push(("bounce", &descs));
        paths.push(("one-descriptor", &one));
        for (path, ds) in paths {
            let mut times = Vec::new();
            let mut timelines = Vec::new();
            let runs = opts.warmup + opts.iterations.max(1);
            for it in 0..runs {
                seed += 1;
                for (k, d) in ds.iter().enumerate() {
                    // SAFETY: every src lies inside our pool.
                    unsafe { fill_raw(d.src, d.len, seed, k as u64) };
                }
                write_descs(&descs_file, ds).map_err(|e| e.to_string())?;
                peer.command("ZERO")?;
                let t0 = Instant::now();
                let h = match path {
                    // Straight to the transport (every size is bounced,
                    // past the routing gate's average-size bound), traced:
                    // the IO thread records each chunk's stages.
                    "bounce" => {
                        let t = agent.transport().ok_or("bounce is not running")?;
                        t.submit_traced(&rdesc.name, ds.clone())
                    }
                    _ => agent.submit_standard(&rdesc.name, ds.clone()),
                };
                match h.wait(XFER_TIMEOUT) {
                    Some(TransferOutcome::Success) => {}
                    other => return Err(format!("{path} {block}B transfer: {other:?}")),
                }
                if it >= opts.warmup {
                    let secs = t0.elapsed().as_secs_f64();
                    times.push(secs);
                    if path == "bounce" {
                        let (events, _) = h.take_timeline();
                        timelines.push(BounceTimeline::of(&events, t0, secs * 1e6));
                    }
                }
                peer.command(&format!("VERIFY {seed} {}", descs_file.display()))
                    .map_err(|e| format!("{path} {block}B verification: {e}"))?;
            }
            times.sort_by(|a, b| a.total_cmp(b));
            let med = times[times.len() / 2];
            rows.push(DataplaneRow {
                block_bytes: block,
                descriptors: ds.len(),
                path: path.to_string(),
                median_ms: med * 1e3,
                min_ms: times[0] * 1e3,
                max_ms: times[times.len() - 1] * 1e3,
                gbps: total as f64 / med / 1e9,
                verified: true,
                timeline: BounceTimeline::median_of(&timelines),
            });
        }
    }
    drop(agent);
    drop(peer);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(DataplaneReport {
        total_bytes: total,
        iterations: opts.iterations,
        rows,
    })
}
