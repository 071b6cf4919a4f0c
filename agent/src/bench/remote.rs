//! Distributed mode of `kvfabric bench`: the bench is a client of two
//! `kvfabric agent` daemons registered in etcd.
//!
//! 1. [`lookup_agents`] reads the fabric's records
//!    (`/kvfabric/<fabric>/agents/`) until the prefill and decode logical
//!    ids are there (bounded); each [`AgentRecord`] carries the agent's
//!    HTTP URL (`http`) and its KV pool (`buffers`, label `kv`).
//! 2. [`wait_until_paired`] waits (bounded) until both answer `/readyz` 200
//!    and each has loaded the other through discovery (`/v1/peers`).
//! 3. The replay ([`super::trace::replay_with`]) allocates blocks over the
//!    *remote* pool bases ([`super::trace::BlockPool`]) and hands each
//!    request to [`RemoteHandOff`]: `POST /v1/debug/transfer` to the prefill
//!    agent (it fills the sources with the request's pattern, writes them
//!    to the decode agent through the chosen path and measures the
//!    latency), then `POST /v1/debug/verify` to the decode agent (every
//!    destination byte checked).
//!
//! HTTP is spoken with a minimal HTTP/1.0 client ([`http_json`]: one
//! request per connection, read to EOF), so the bench needs no HTTP client
//! dependency.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, GetOptions};
use serde_json::Value;

use super::trace::{BenchPath, HandOff, HandOffResult};
use crate::core::Descriptor;
use crate::service::discovery::etcd::agents_prefix;
use crate::service::discovery::{AgentRecord, BufferRegion};
use crate::service::http::{
    TransferDescriptor, TransferRequest, TransferResponse, VerifyDescriptor, VerifyRequest,
    VerifyResponse, TRANSFER_WAIT,
};

/// Bound on connecting to an agent's HTTP API.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on an ordinary (non-transfer) HTTP call.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on one etcd read.
const ETCD_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends one HTTP/1.0 request to `base` (`http://host:port`) and parses the
/// JSON answer; `timeout` bounds each read and write.
///
/// # Errors
/// Connection, IO or protocol errors, or a body that is not JSON.
pub fn http_json(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<(u16, Value), String> {
    let hostport = base
        .strip_prefix("http://")
        .ok_or_else(|| format!("{base}: only http:// URLs are supported"))?
        .trim_end_matches('/');
    let addr = hostport
        .to_socket_addrs()
        .map_err(|e| format!("{base}: {e}"))?
        .next()
        .ok_or_else(|| format!("{base}: no address"))?;
    let url = format!("{base}{path}");
    let mut s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|e| format!("{method} {url}: connect: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|e| format!("{method} {url}: {e}"))?;
    let body = body.unwrap_or("");
    let head = format!(
        "{method} {path} HTTP/1.0\r\nHost: {hostport}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())
        .and_then(|()| s.write_all(body.as_bytes()))
        .map_err(|e| format!("{method} {url}: send: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("{method} {url}: read: {e}"))?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("{method} {url}: truncated response"))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| format!("{method} {url}: bad status line in {head:?}"))?;
    if head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding:"))
    {
        return Err(format!(
            "{method} {url}: chunked responses are not supported"
        ));
    }
    let body = &raw[split + 4..];
    let v = serde_json::from_slice(body).map_err(|e| {
        format!(
            "{method} {url}: HTTP {status}, body is not JSON ({e}): {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        )
    })?;
    Ok((status, v))
}

/// Reads every valid record under the fabric's prefix (one bounded etcd
/// read).
///
/// # Errors
/// When etcd cannot be reached or read within the bound.
pub fn read_records(endpoints: &[String], fabric: &str) -> Result<Vec<AgentRecord>, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let prefix = agents_prefix(fabric);
    rt.block_on(async {
        tokio::time::timeout(ETCD_TIMEOUT, async {
            let mut c = Client::connect(
                endpoints,
                Some(ConnectOptions::new().with_connect_timeout(ETCD_TIMEOUT)),
            )
            .await?;
            c.get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                .await
        })
        .await
        .map_err(|_| format!("etcd {endpoints:?}: no answer within {ETCD_TIMEOUT:?}"))?
        .map_err(|e| format!("etcd {endpoints:?}: {e}"))
    })
    .map(|resp| {
        resp.kvs()
            .iter()
            .filter_map(|kv| match AgentRecord::decode(kv.value()) {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::warn!(key = %String::from_utf8_lossy(kv.key()), error = %e, "skipping an unreadable agent record");
                    None
                }
            })
            .collect()
    })
}

/// The live (newest) record of each of `logical_ids` in `fabric`, waiting
/// at most `wait` for all of them to be published (etcd errors are retried
/// until then).
///
/// # Errors
/// The ids still missing (and the last etcd error) when `wait` runs out.
pub fn lookup_agents(
    endpoints: &[String],
    fabric: &str,
    logical_ids: &[&str],
    wait: Duration,
) -> Result<Vec<AgentRecord>, String> {
    let deadline = Instant::now() + wait;
    loop {
        let (found, why) = match read_records(endpoints, fabric) {
            Ok(records) => {
                let found: Vec<Option<AgentRecord>> = logical_ids
                    .iter()
                    .map(|id| {
                        records
                            .iter()
                            .filter(|r| r.logical_id == *id)
                            .cloned()
                            .reduce(|a, b| if b.newer_than(&a) { b } else { a })
                    })
                    .collect();
                let missing: Vec<&str> = logical_ids
                    .iter()
                    .zip(&found)
                    .filter(|(_, r)| r.is_none())
                    .map(|(id, _)| *id)
                    .collect();
                let seen: Vec<&str> = records.iter().map(|r| r.logical_id.as_str()).collect();
                (
                    found,
                    format!(
                        "agents {missing:?} not registered under {} (registered: {seen:?})",
                        agents_prefix(fabric)
                    ),
                )
            }
            Err(e) => (vec![None], e),
        };
        if found.iter().all(Option::is_some) && found.len() == logical_ids.len() {
            return Ok(found.into_iter().flatten().collect());
        }
        if Instant::now() >= deadline {
            return Err(format!("after {wait:?}: {why}"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// An agent daemon as the bench sees it: its record, HTTP URL and KV pool.
#[derive(Clone, Debug)]
pub struct RemoteAgent {
    /// The record it published.
    pub record: AgentRecord,
    /// The KV pool it published (label `kv`, else its first buffer).
    pub pool: BufferRegion,
}

impl RemoteAgent {
    /// From a published record.
    ///
    /// # Errors
    /// When the record carries no HTTP URL or no buffer.
    pub fn from_record(record: AgentRecord) -> Result<Self, String> {
        if record.http.is_empty() {
            return Err(format!(
                "agent {} publishes no HTTP address (an older kvfabric agent?)",
                record.name
            ));
        }
        let pool = record
            .buffers
            .iter()
            .find(|b| b.label == "kv")
            .or_else(|| record.buffers.first())
            .cloned()
            .ok_or_else(|| format!("agent {} publishes no KV pool buffer", record.name))?;
        Ok(Self { record, pool })
    }

    /// The agent's NIXL name (incarnation included).
    pub fn name(&self) -> &str {
        &self.record.name
    }

    /// `GET path` → (status, JSON).
    ///
    /// # Errors
    /// As [`http_json`].
    pub fn get(&self, path: &str) -> Result<(u16, Value), String> {
        http_json(&self.record.http, "GET", path, None, CALL_TIMEOUT)
    }

    /// `POST path` with a JSON `body` → (status, JSON).
    ///
    /// # Errors
    /// As [`http_json`].
    pub fn post(&self, path: &str, body: &str, timeout: Duration) -> Result<(u16, Value), String> {
        http_json(&self.record.http, "POST", path, Some(body), timeout)
    }

    /// Whether `/v1/peers` lists `peer` (and, with `need_bounce`, as
    /// bounce-compatible).
    fn has_peer(&self, peer: &str, need_bounce: bool) -> Result<bool, String> {
        let (code, v) = self.get("/v1/peers")?;
        if code != 200 {
            return Err(format!("{}/v1/peers: HTTP {code}: {v}", self.record.http));
        }
        Ok(v["peers"].as_array().is_some_and(|ps| {
            ps.iter().any(|p| {
                p["name"] == peer && (!need_bounce || p["bounce_compatible"] == Value::Bool(true))
            })
        }))
    }

    /// Whether bounce is running on the agent (`/v1/config`).
    ///
    /// # Errors
    /// When `/v1/config` cannot be read.
    pub fn bounce_active(&self) -> Result<bool, String> {
        let (code, v) = self.get("/v1/config")?;
        if code != 200 {
            return Err(format!("{}/v1/config: HTTP {code}: {v}", self.record.http));
        }
        Ok(v["bounce_effective"]["active"] == Value::Bool(true))
    }
}

/// Waits at most `wait` until both agents are ready (`/readyz` 200) and
/// each has loaded the other (`/v1/peers`; the prefill agent sees the
/// decode agent as bounce-compatible when `need_bounce`).
///
/// # Errors
/// What was still missing when `wait` ran out.
pub fn wait_until_paired(
    prefill: &RemoteAgent,
    decode: &RemoteAgent,
    need_bounce: bool,
    wait: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + wait;
    loop {
        let check = || -> Result<Result<(), String>, String> {
            for a in [prefill, decode] {
                let (code, v) = a.get("/readyz")?;
                if code != 200 {
                    return Ok(Err(format!("{} not ready: {}", a.name(), v["reason"])));
                }
            }
            if !prefill.has_peer(decode.name(), need_bounce)? {
                return Ok(Err(format!(
                    "{} has not loaded {}{}",
                    prefill.name(),
                    decode.name(),
                    if need_bounce {
                        " (bounce-compatible)"
                    } else {
                        ""
                    }
                )));
            }
            if !decode.has_peer(prefill.name(), false)? {
                return Ok(Err(format!(
                    "{} has not loaded {}",
                    decode.name(),
                    prefill.name()
                )));
            }
            Ok(Ok(()))
        };
        let why = match check() {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(why)) | Err(why) => why,
        };
        if Instant::now() >= deadline {
            return Err(format!("agents not paired after {wait:?}: {why}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// [`HandOff`] through two agent daemons' HTTP APIs (distributed mode).
pub struct RemoteHandOff {
    /// The sending agent.
    pub prefill: RemoteAgent,
    /// The receiving agent.
    pub decode: RemoteAgent,
}

impl HandOff for RemoteHandOff {
    fn check_path(&self, path: BenchPath) -> Result<(), String> {
        if path == BenchPath::Bounce && !self.prefill.bounce_active()? {
            return Err(format!(
                "bounce is not running on the prefill agent {} (start it with KVFABRIC_BOUNCE_ENABLE=1; see its /v1/config)",
                self.prefill.name()
            ));
        }
        Ok(())
    }

    fn sender(&self) -> String {
        self.prefill.name().to_string()
    }

    fn hand_off(&self, path: BenchPath, seed: u64, descs: Vec<Descriptor>) -> HandOffResult {
        let mut request_id = None;
        let outcome = self.transfer_and_verify(path, seed, &descs, &mut request_id);
        HandOffResult {
            request_id,
            outcome,
        }
    }
}

impl RemoteHandOff {
    /// [`HandOff::hand_off`]: `request_id` is set from the prefill agent's
    /// answer when it carries one (`request_id`, the id its log lines
    /// name as `rid`).
    fn transfer_and_verify(
        &self,
        path: BenchPath,
        seed: u64,
        descs: &[Descriptor],
        request_id: &mut Option<u64>,
    ) -> Result<f64, String> {
        let req = TransferRequest {
            peer: self.decode.name().to_string(),
            path: match path {
                BenchPath::Bounce => "bounce",
                BenchPath::Standard => "standard",
            }
            .into(),
            seed,
            descriptors: descs
                .iter()
                .map(|d| TransferDescriptor {
                    src: d.src,
                    dst: d.dst,
                    len: d.len,
                })
                .collect(),
        };
        let body = serde_json::to_string(&req).map_err(|e| e.to_string())?;
        let (code, v) = self.prefill.post(
            "/v1/debug/transfer",
            &body,
            TRANSFER_WAIT + Duration::from_secs(30),
        )?;
        if code != 200 {
            return Err(format!("prefill /v1/debug/transfer: HTTP {code}: {v}"));
        }
        *request_id = v.get("request_id").and_then(Value::as_u64);
        let t: TransferResponse = serde_json::from_value(v)
            .map_err(|e| format!("prefill /v1/debug/transfer answer: {e}"))?;
        if t.outcome != "success" {
            return Err(format!(
                "transfer {}: {}",
                t.outcome,
                t.error.unwrap_or_default()
            ));
        }
        let verify = VerifyRequest {
            seed,
            descriptors: descs
                .iter()
                .map(|d| VerifyDescriptor {
                    dst: d.dst,
                    len: d.len,
                })
                .collect(),
        };
        let body = serde_json::to_string(&verify).map_err(|e| e.to_string())?;
        let (code, v) = self.decode.post("/v1/debug/verify", &body, CALL_TIMEOUT)?;
        if code != 200 {
            return Err(format!("decode /v1/debug/verify: HTTP {code}: {v}"));
        }
        let r: VerifyResponse = serde_json::from_value(v)
            .map_err(|e| format!("decode /v1/debug/verify answer: {e}"))?;
        if !r.ok {
            let m = r.first_mismatch;
            return Err(format!(
                "verification failed: descriptor {}, byte {}",
                m.map_or(0, |m| m.descriptor),
                m.map_or(0, |m| m.offset)
            ));
        }
        Ok(t.latency_ms)
    }
}
