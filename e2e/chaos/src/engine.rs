//! The engines of the suite: the KV geometry, the byte pattern both sides
//! compute, and the prefill engine process (`kvfabric-chaos engine`): a
//! separate process a fault can SIGKILL, attached to its prefill agent
//! through the engine API and driven by the suite over its stdin/stdout
//! (JSON lines).
//!
//! Protocol: the engine prints `{"ready":true,"agent":NAME}` once attached
//! with its pool registered, then for every command line on stdin
//! (`Command`) one answer line (`Answer`) when the transfer resolves.
//! It exits when stdin closes or its Attach stream ends (its agent died).

use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvfabric_client::{pb, Client, ShmPool};
use serde::{Deserialize, Serialize};

/// The suite's KV geometry (small blocks so that trace-sized requests of
/// hundreds of blocks stay cheap on a small machine).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Geometry {
    /// Layers.
    pub layers: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension (bf16 elements).
    pub head_dim: u32,
}

impl Default for Geometry {
    fn default() -> Self {
        Self {
            layers: 2,
            block_tokens: 128,
            kv_heads: 1,
            head_dim: 16,
        }
    }
}

impl Geometry {
    /// Bytes of one block of one layer and plane.
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.block_tokens) * u64::from(self.kv_heads) * u64::from(self.head_dim) * 2
    }

    /// The engine API layout of a pool of `num_blocks` blocks (K/V split,
    /// bf16, TP 1, host memory).
    pub fn layout(&self, num_blocks: u32) -> pb::KvLayout {
        pb::KvLayout {
            layers: self.layers,
            num_blocks,
            block_bytes: self.block_bytes(),
            kv_split: true,
            dtype: "bf16".into(),
            tp_rank: 0,
            tp_size: 1,
            block_tokens: self.block_tokens,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            device: -1,
            device_uuid: String::new(),
        }
    }

    /// Byte ranges, in descriptor order, of `blocks` in a pool of
    /// `num_blocks` blocks: every (layer, plane, block).
    pub fn ranges(&self, num_blocks: u32, blocks: &[u32]) -> Vec<(usize, usize)> {
        let bb = self.block_bytes();
        let mut out = Vec::with_capacity(blocks.len() * self.layers as usize * 2);
        for layer in 0..u64::from(self.layers) {
            for plane in 0..2u64 {
                for &b in blocks {
                    let off = ((layer * 2 + plane) * u64::from(num_blocks) + u64::from(b)) * bb;
                    out.push((off as usize, bb as usize));
                }
            }
        }
        out
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Word `w` of descriptor `d` of the request seeded `seed`.
fn word(seed: u64, d: usize, w: usize) -> u64 {
    splitmix(seed ^ ((d as u64) << 32) ^ w as u64)
}

/// Fills the descriptors `ranges` of `pool` with the pattern of `seed`.
pub fn fill(pool: &mut [u8], ranges: &[(usize, usize)], seed: u64) {
    for (d, &(off, len)) in ranges.iter().enumerate() {
        for (w, chunk) in pool[off..off + len].chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&word(seed, d, w).to_le_bytes());
        }
    }
}

/// Bytes of `ranges` in `pool` that differ from the pattern of `seed`
/// (0 = byte-exact).
pub fn corrupt_bytes(pool: &[u8], ranges: &[(usize, usize)], seed: u64) -> u64 {
    let mut bad = 0u64;
    for (d, &(off, len)) in ranges.iter().enumerate() {
        for (w, chunk) in pool[off..off + len].chunks_exact(8).enumerate() {
            let want = word(seed, d, w).to_le_bytes();
            if chunk != want {
                bad += chunk.iter().zip(want).filter(|(a, b)| **a != *b).count() as u64;
            }
        }
    }
    bad
}

/// How the suite starts a prefill engine process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EngineSpec {
    /// Its agent's engine socket.
    pub socket: String,
    /// Engine id.
    pub engine_id: String,
    /// UID of its pod.
    pub pod_uid: String,
    /// Blocks of its pool.
    pub num_blocks: u32,
    /// KV geometry.
    pub geometry: Geometry,
    /// Bound on connecting and attaching.
    pub attach_timeout_ms: u64,
}

/// One hand-off the suite asks a prefill engine for.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Command {
    /// Engine request id (unique per engine).
    pub id: u64,
    /// Destination engine.
    pub dst: String,
    /// Source blocks (filled with the pattern of `seed` first).
    pub src: Vec<u32>,
    /// Destination blocks.
    pub dst_blocks: Vec<u32>,
    /// The destination engine's incarnation when `dst_blocks` were
    /// allocated (0: unchecked): a destination that re-attached since is
    /// refused by the agent instead of written.
    #[serde(default)]
    pub dst_incarnation: u64,
    /// Pattern seed.
    pub seed: u64,
    /// The Transfer's `timeout_ms`.
    pub timeout_ms: u32,
    /// Cancel the request this long after submitting it (µs), if set.
    #[serde(default)]
    pub cancel_after_us: Option<u64>,
}

/// The engine's answer to one [`Command`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Answer {
    /// The request id.
    pub id: u64,
    /// `success`, `failure`, `timeout`, `cancelled`, `unspecified` or
    /// `error` (the call itself failed: gRPC status or no answer).
    pub outcome: String,
    /// The agent's reason or the call's error.
    pub reason: String,
    /// Whether a Cancel call found the request in flight.
    #[serde(default)]
    pub cancel_hit: bool,
}

/// Name of an outcome.
pub fn outcome_name(o: pb::Outcome) -> &'static str {
    match o {
        pb::Outcome::Success => "success",
        pb::Outcome::Failure => "failure",
        pb::Outcome::Timeout => "timeout",
        pb::Outcome::Cancelled => "cancelled",
        pb::Outcome::Unspecified => "unspecified",
    }
}

/// Runs the engine process (never returns on success: exits when stdin
/// closes or the session ends).
///
/// # Errors
/// Connect, attach, pool or register failures.
pub fn run_engine(spec: EngineSpec) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(engine_main(spec))
}

async fn engine_main(spec: EngineSpec) -> Result<(), String> {
    let layout = spec.geometry.layout(spec.num_blocks);
    let deadline = tokio::time::Instant::now() + Duration::from_millis(spec.attach_timeout_ms);
    let client = loop {
        match Client::connect(&spec.socket).await {
            Ok(c) => break c,
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e.to_string()),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let mut pool = ShmPool::create(
        &format!("/kvf-chaos-{}-{}", std::process::id(), spec.engine_id),
        kvfabric_client::pool_bytes(&layout),
    )
    .map_err(|e| e.to_string())?;
    let session = loop {
        match client
            .attach(
                &spec.engine_id,
                &spec.pod_uid,
                pb::Role::Prefill,
                layout.clone(),
            )
            .await
        {
            Ok(s) => break s,
            // The previous session of this id may still be detaching.
            Err(e)
                if e.code() == Some(tonic::Code::AlreadyExists)
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    session
        .register_shm(&pool)
        .await
        .map_err(|e| e.to_string())?;
    // The agent has mapped the pool: drop its name so this engine, which the
    // suite SIGKILLs, leaves nothing in /dev/shm (each leaked pool is RAM).
    pool.unlink().map_err(|e| e.to_string())?;
    let session = Arc::new(session);
    let pool = Arc::new(Mutex::new(pool));
    let out = Arc::new(Mutex::new(std::io::stdout()));
    {
        let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(
            o,
            "{}",
            serde_json::json!({"ready": true, "agent": session.agent()})
        );
        let _ = o.flush();
    }
    // Commands from stdin on a thread of their own.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Command>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if let Ok(c) = serde_json::from_str::<Command>(&line) {
                if tx.send(c).is_err() {
                    break;
                }
            }
        }
    });
    let geometry = spec.geometry;
    let num_blocks = spec.num_blocks;
    loop {
        let cmd = tokio::select! {
            c = rx.recv() => c,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                if !session.is_open() {
                    eprintln!("engine {}: session closed by the agent; exiting", spec.engine_id);
                    std::process::exit(3);
                }
                continue;
            }
        };
        let Some(cmd) = cmd else {
            // stdin closed: the suite is done with this engine.
            std::process::exit(0);
        };
        {
            let ranges = geometry.ranges(num_blocks, &cmd.src);
            let mut p = pool.lock().unwrap_or_else(|p| p.into_inner());
            fill(p.as_mut_slice(), &ranges, cmd.seed);
        }
        let (session, out) = (session.clone(), out.clone());
        tokio::spawn(async move {
            let req = pb::TransferRequest {
                request_id: cmd.id,
                dst_engine: cmd.dst.clone(),
                src_blocks: cmd.src.clone(),
                dst_blocks: cmd.dst_blocks.clone(),
                dst_incarnation: cmd.dst_incarnation,
                path: pb::Path::Bounce as i32,
                timeout_ms: cmd.timeout_ms,
                ..Default::default()
            };
            let (answer, hit) = if let Some(us) = cmd.cancel_after_us {
                let s2 = session.clone();
                let t = tokio::spawn(async move { s2.transfer(req).await });
                tokio::time::sleep(Duration::from_micros(us)).await;
                let hit = session.cancel(cmd.id).await.unwrap_or(false);
                (t.await.map_err(|e| e.to_string()), hit)
            } else {
                (Ok(session.transfer(req).await), false)
            };
            let a = match answer {
                Ok(Ok(r)) => Answer {
                    id: cmd.id,
                    outcome: outcome_name(r.outcome()).into(),
                    reason: r.reason,
                    cancel_hit: hit,
                },
                Ok(Err(e)) => Answer {
                    id: cmd.id,
                    outcome: "error".into(),
                    reason: e.to_string(),
                    cancel_hit: hit,
                },
                Err(e) => Answer {
                    id: cmd.id,
                    outcome: "error".into(),
                    reason: e,
                    cancel_hit: hit,
                },
            };
            let line = serde_json::to_string(&a).unwrap_or_default();
            let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writeln!(o, "{line}");
            let _ = o.flush();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_round_trips_and_detects_a_flipped_byte() {
        let g = Geometry::default();
        let n = 8;
        let mut src = vec![0u8; kvfabric_client::pool_bytes(&g.layout(n)) as usize];
        let mut dst = src.clone();
        let (rs, rd) = (g.ranges(n, &[1, 5]), g.ranges(n, &[7, 0]));
        fill(&mut src, &rs, 42);
        for (a, b) in rs.iter().zip(&rd) {
            dst[b.0..b.0 + b.1].copy_from_slice(&src[a.0..a.0 + a.1]);
        }
        assert_eq!(corrupt_bytes(&dst, &rd, 42), 0);
        assert!(corrupt_bytes(&dst, &rd, 43) > 0);
        dst[rd[3].0 + 17] ^= 0xFF;
        assert_eq!(corrupt_bytes(&dst, &rd, 42), 1);
    }
}
