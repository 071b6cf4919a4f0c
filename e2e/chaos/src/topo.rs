//! The topology the suite starts: the control plane of e2e/kube/up.sh
//! (its own etcd, kube-apiserver, controller-manager, scheduler, kwok fake
//! nodes), a separate etcd for the fabric (so that a fault can restart it
//! without touching the apiserver's), the operator binary, and `kvfabric
//! agent` processes. Every wait here is bounded.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Sends `sig` to `pid` (kill(2)); false when it failed.
pub fn signal(pid: u32, sig: libc::c_int) -> bool {
    // SAFETY: plain kill(2) on a child of this process.
    unsafe { libc::kill(pid as libc::pid_t, sig) == 0 }
}

/// Runs `cmd` to completion, `stdin` written to it (or /dev/null): its
/// stdout, or an error naming the program, its arguments and its stderr.
///
/// # Errors
/// A spawn failure or a non-zero exit.
pub fn run(cmd: &mut Command, stdin: Option<&str>) -> Result<String, String> {
    let line = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let what = || line.as_str();
    let mut c = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", what()))?;
    if let (Some(i), Some(mut s)) = (stdin, c.stdin.take()) {
        s.write_all(i.as_bytes())
            .map_err(|e| format!("{} (stdin): {e}", what()))?;
    }
    let out = c
        .wait_with_output()
        .map_err(|e| format!("{}: {e}", what()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{}: {}",
            what(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A free loopback TCP port (bound then released).
pub fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// A child process, SIGKILLed and reaped on drop.
pub struct Proc {
    /// The child.
    pub child: Child,
    /// What it is (for messages).
    pub what: String,
    /// Its log (stderr, and stdout when not read).
    pub log: PathBuf,
}

impl Proc {
    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then SIGKILL after `grace`; reaped.
    pub fn terminate(&mut self, grace: Duration) {
        signal(self.pid(), libc::SIGTERM);
        let t0 = Instant::now();
        while t0.elapsed() < grace {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }

    /// Whether it still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The last `n` bytes of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        s[s.len().saturating_sub(n)..].to_string()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGCONT first: a stopped process does not die of SIGKILL until
        // continued on some kernels' accounting (harmless otherwise).
        signal(self.pid(), libc::SIGCONT);
        self.kill();
    }
}

fn log_file(path: &Path) -> Result<std::fs::File, String> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// The repository root (this crate is e2e/chaos).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The control plane of e2e/kube/up.sh in `dir`; down (and purged) on drop.
pub struct Kube {
    /// Its directory (kubeconfig, env, logs).
    pub dir: PathBuf,
    env: BTreeMap<String, String>,
    keep: bool,
}

impl Kube {
    /// Whether the tools are installed (e2e/kube/install.sh --path).
    pub fn tools_installed() -> bool {
        Command::new(repo().join("e2e/kube/install.sh"))
            .arg("--path")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// Runs up.sh in `dir`.
    ///
    /// # Errors
    /// up.sh failing (its stderr).
    pub fn up(dir: &Path, keep: bool) -> Result<Self, String> {
        let out = Command::new(repo().join("e2e/kube/up.sh"))
            .arg(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("up.sh: {e}"))?;
        let mut k = Self {
            dir: dir.to_path_buf(),
            env: BTreeMap::new(),
            keep,
        };
        if !out.status.success() {
            return Err(format!(
                "up.sh failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let env = std::fs::read_to_string(dir.join("env")).map_err(|e| format!("DIR/env: {e}"))?;
        k.env = env
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        Ok(k)
    }

    /// A variable of DIR/env.
    pub fn var(&self, k: &str) -> Option<&str> {
        self.env.get(k).map(String::as_str)
    }

    /// The first fake node.
    pub fn node(&self) -> String {
        self.var("KVFABRIC_KUBE_NODES")
            .and_then(|n| n.split(',').next())
            .unwrap_or("kwok-gpu-0")
            .to_string()
    }

    /// An executable from the cached tools (`KVFABRIC_KUBE_PATH`).
    pub fn tool(&self, name: &str) -> PathBuf {
        for d in self.var("KVFABRIC_KUBE_PATH").unwrap_or("").split(':') {
            let p = Path::new(d).join(name);
            if p.is_file() {
                return p;
            }
        }
        PathBuf::from(name)
    }

    /// Runs kubectl with `args` (stdin `input`), bounded by 30 s.
    ///
    /// # Errors
    /// A non-zero exit (stderr) or no exit within the bound.
    pub fn kubectl(&self, args: &[&str], input: Option<&str>) -> Result<String, String> {
        let mut child = Command::new(self.tool("kubectl"))
            .args(args)
            .arg("--request-timeout=20s")
            .env("KUBECONFIG", self.dir.join("kubeconfig"))
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("kubectl: {e}"))?;
        if let (Some(i), Some(mut s)) = (input, child.stdin.take()) {
            let _ = s.write_all(i.as_bytes());
        }
        let (tx, rx) = mpsc::channel();
        let mut so = child.stdout.take();
        let mut se = child.stderr.take();
        std::thread::spawn(move || {
            let (mut a, mut b) = (String::new(), String::new());
            if let Some(s) = so.as_mut() {
                let _ = s.read_to_string(&mut a);
            }
            if let Some(s) = se.as_mut() {
                let _ = s.read_to_string(&mut b);
            }
            let _ = tx.send((a, b));
        });
        let Ok((out, err)) = rx.recv_timeout(Duration::from_secs(30)) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("kubectl {args:?}: no exit within 30 s"));
        };
        let st = child.wait().map_err(|e| e.to_string())?;
        if st.success() {
            Ok(out)
        } else {
            Err(format!("kubectl {args:?}: {err}"))
        }
    }

    /// Creates a pod `name` with `labels` on the first fake node; its UID.
    ///
    /// # Errors
    /// kubectl failing.
    pub fn create_pod(&self, name: &str, labels: &[(&str, &str)]) -> Result<String, String> {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), Value::from(*v)))
            .collect();
        let pod = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": labels},
            "spec": {"nodeName": self.node(), "containers": [{"name": "c", "image": "kvfabric:chaos"}]}
        });
        let out = self.kubectl(
            &["create", "-o", "jsonpath={.metadata.uid}", "-f", "-"],
            Some(&pod.to_string()),
        )?;
        Ok(out.trim().to_string())
    }

    /// Deletes pod `name` through the API (no wait for the kubelet).
    ///
    /// # Errors
    /// kubectl failing.
    pub fn delete_pod(&self, name: &str) -> Result<(), String> {
        self.kubectl(
            &["delete", "pod", name, "--wait=false", "--grace-period=0"],
            None,
        )
        .map(|_| ())
    }
}

impl Drop for Kube {
    fn drop(&mut self) {
        let mut c = Command::new(repo().join("e2e/kube/down.sh"));
        c.arg(&self.dir);
        if !self.keep {
            c.arg("--purge");
        }
        let _ = c.stdout(Stdio::null()).stderr(Stdio::null()).status();
    }
}

/// The fabric's etcd (single member), restartable on the same data dir and
/// ports.
pub struct Etcd {
    bin: PathBuf,
    dir: PathBuf,
    /// The address clients reach it on (127.0.0.1, or the agents' bridge).
    host: std::net::Ipv4Addr,
    port: u16,
    peer: u16,
    /// The running member.
    pub proc: Option<Proc>,
}

impl Etcd {
    /// Starts it in `dir`, serving clients on `host` (127.0.0.1, or the
    /// bridge address of [`crate::netns::Net`]), and waits (≤ 20 s) until
    /// it answers.
    ///
    /// # Errors
    /// Spawn failures or no answer.
    pub fn start(bin: &Path, dir: &Path, host: std::net::Ipv4Addr) -> Result<Self, String> {
        let mut e = Self {
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            host,
            port: free_port()?,
            peer: free_port()?,
            proc: None,
        };
        e.spawn()?;
        Ok(e)
    }

    /// The client endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }

    fn spawn(&mut self) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| e.to_string())?;
        let log = self.dir.join("etcd.log");
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let child = Command::new(&self.bin)
            .args(["--name", "fabric", "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("fabric={peer}")])
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log_file(&log)?))
            .stderr(Stdio::from(log_file(&log)?))
            .spawn()
            .map_err(|e| format!("etcd {}: {e}", self.bin.display()))?;
        self.proc = Some(Proc {
            child,
            what: "fabric etcd".into(),
            log,
        });
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            let addr: SocketAddr = (self.host, self.port).into();
            if http_get(addr, "/health")
                .map(|(_, b)| b.contains("true"))
                .unwrap_or(false)
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err("fabric etcd not healthy within 20 s".into())
    }

    /// SIGKILLs the member and starts it again on the same data and ports;
    /// the time it was away.
    ///
    /// # Errors
    /// The new member not answering.
    pub fn restart(&mut self) -> Result<Duration, String> {
        let t0 = Instant::now();
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
        self.spawn()?;
        Ok(t0.elapsed())
    }
}

/// One HTTP/1.0 GET (connect 2 s, read 5 s): (status line, body).
///
/// # Errors
/// Connect or IO failures.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(String, String), String> {
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).map_err(|e| e.to_string())?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    Ok((
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    ))
}

/// One HTTP/1.0 POST of a JSON `body` (connect 2 s, read 5 s): (status
/// line, body).
///
/// # Errors
/// Connect or IO failures.
pub fn http_post(addr: SocketAddr, path: &str, body: &str) -> Result<(String, String), String> {
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "POST {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).map_err(|e| e.to_string())?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    Ok((
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    ))
}

/// The discovery record of agent `name` (its NIXL name) of `fabric` in
/// etcd (`/kvfabric/<fabric>/agents/<name>`, JSON), read through etcd's
/// JSON gateway.
///
/// # Errors
/// etcd unreachable, or no (readable) record.
pub fn agent_record(etcd: &str, fabric: &str, name: &str) -> Result<Value, String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let addr: SocketAddr = etcd
        .trim_start_matches("http://")
        .parse()
        .map_err(|e| format!("etcd endpoint {etcd}: {e}"))?;
    let key = format!("/kvfabric/{fabric}/agents/{name}");
    let body = serde_json::json!({ "key": b64.encode(&key) }).to_string();
    let (status, resp) = http_post(addr, "/v3/kv/range", &body)?;
    let v: Value =
        serde_json::from_str(&resp).map_err(|e| format!("etcd range {key}: {status}: {e}"))?;
    let value = v["kvs"][0]["value"]
        .as_str()
        .ok_or_else(|| format!("no record at {key} ({status})"))?;
    serde_json::from_slice(&b64.decode(value).map_err(|e| e.to_string())?)
        .map_err(|e| format!("record {key}: {e}"))
}

/// The control-channel port of agent `name` of `fabric`: from its
/// discovery record ([`agent_record`]), the handshake's endpoint
/// `tcp://ip:port`.
///
/// # Errors
/// etcd unreachable, no record, no handshake or an endpoint without a port.
pub fn control_port(etcd: &str, fabric: &str, name: &str) -> Result<u16, String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let rec = agent_record(etcd, fabric, name)?;
    let hs = rec["handshake"]
        .as_str()
        .ok_or_else(|| format!("record of {name} has no handshake (bounce off?)"))?;
    let hs = kvfabric_core::wire::decode_handshake(&b64.decode(hs).map_err(|e| e.to_string())?)
        .map_err(|e| format!("handshake of {name}: {e:?}"))?;
    let ep = String::from_utf8_lossy(&hs.endpoint).into_owned();
    ep.rsplit_once(':')
        .and_then(|(_, p)| p.trim_end_matches('/').parse().ok())
        .ok_or_else(|| format!("control endpoint of {name} has no port: {ep:?}"))
}

/// Sum of the samples of metric `name` (any labels) whose label set
/// contains every one of `labels`.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Whether the agent of a role is a prefill or a decode agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Side {
    /// Prefill.
    Prefill,
    /// Decode.
    Decode,
}

/// How agents are started (common to all four).
#[derive(Clone, Debug)]
pub struct AgentConf {
    /// The `kvfabric` binary.
    pub bin: PathBuf,
    /// Fabric etcd endpoint.
    pub etcd: String,
    /// Fabric name.
    pub fabric: String,
    /// Lease TTL, s.
    pub lease_ttl_s: u64,
    /// Bounce requestTimeoutMs.
    pub request_timeout_ms: u64,
    /// Where sockets and logs go.
    pub dir: PathBuf,
}

/// A running `kvfabric agent`.
pub struct AgentProc {
    /// The process.
    pub proc: Proc,
    /// Its HTTP address.
    pub http: SocketAddr,
    /// Its NIXL name (incarnation included).
    pub name: String,
    /// Its engine socket.
    pub socket: PathBuf,
    /// The group id it runs under (its own: see [`crate::nft`]); its
    /// sockets carry it (`meta skgid`).
    pub gid: u32,
    /// Its network namespace (None: the suite's, on loopback).
    pub netns: Option<crate::netns::Slot>,
}

impl AgentProc {
    /// Starts agent `logical` (pod `pod_uid`) of `side`, generation `gen`
    /// (log file name), its HTTP API on `port` (0 = ephemeral) of
    /// 127.0.0.1 — or, given a network namespace `netns`, started in that
    /// namespace, its HTTP API and control channel on the namespace's
    /// address — and waits (≤ 60 s) for its HTTP API and name.
    ///
    /// # Errors
    /// The agent not coming up (its log tail).
    pub fn spawn(
        conf: &AgentConf,
        logical: &str,
        pod_uid: &str,
        side: Side,
        gen: u32,
        port: u16,
        netns: Option<crate::netns::Slot>,
    ) -> Result<Self, String> {
        let socket = conf.dir.join(format!("{logical}.sock"));
        let (listen, control_bind) = match &netns {
            Some(slot) => (format!("{}:{port}", slot.ip), slot.ip.to_string()),
            None => (format!("127.0.0.1:{port}"), "loopback".to_string()),
        };
        let ns_fd = netns
            .as_ref()
            .map(|slot| crate::netns::open(&slot.ns))
            .transpose()?;
        let log = conf.dir.join(format!("{logical}.{gen}.log"));
        let role = match side {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        };
        let gid = crate::nft::next_gid();
        let mut cmd = Command::new(&conf.bin);
        if let Some(fd) = &ns_fd {
            crate::netns::enter_in_child(&mut cmd, fd);
        }
        let mut child = cmd
            .arg("agent")
            .args(["--etcd", &conf.etcd, "--fabric", &conf.fabric])
            .args([
                "--logical-id",
                logical,
                "--pod-uid",
                pod_uid,
                "--role",
                role,
            ])
            .args(["--listen", &listen, "--pool-size", "4MiB"])
            .args(["--control-bind", &control_bind])
            .args(["--lease-ttl", &conf.lease_ttl_s.to_string()])
            .arg("--engine-socket")
            .arg(&socket)
            .env("KVFABRIC_BOUNCE_ENABLE", "1")
            .env(
                "KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS",
                conf.request_timeout_ms.to_string(),
            )
            .env("KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT", "1")
            .env("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "67108864")
            .env("KVFABRIC_LOG", "warn")
            .gid(gid)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file(&log)?))
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", conf.bin.display()))?;
        drop(ns_fd);
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            let mut f = log_file(&log2).ok();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.split("listening on http://").nth(1) {
                    if let Ok(a) = a.trim().parse::<SocketAddr>() {
                        let _ = tx.send(a);
                    }
                }
                if let Some(f) = f.as_mut() {
                    let _ = writeln!(f, "{line}");
                }
            }
        });
        let mut proc = Proc {
            child,
            what: format!("agent {logical}"),
            log,
        };
        let http = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a,
            Err(_) => {
                proc.kill();
                return Err(format!(
                    "agent {logical} never announced its address:\n{}",
                    proc.log_tail(3000)
                ));
            }
        };
        let t0 = Instant::now();
        let name = loop {
            let n = http_get(http, "/v1/config")
                .ok()
                .and_then(|(_, b)| serde_json::from_str::<Value>(&b).ok())
                .and_then(|v| v["agent"].as_str().map(String::from))
                .unwrap_or_default();
            if !n.is_empty() {
                break n;
            }
            if t0.elapsed() > Duration::from_secs(20) {
                return Err(format!("agent {logical} never named itself on /v1/config"));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        Ok(Self {
            proc,
            http,
            name,
            socket,
            gid,
            netns,
        })
    }

    /// Its /metrics text.
    ///
    /// # Errors
    /// HTTP failures.
    pub fn metrics(&self) -> Result<String, String> {
        http_get(self.http, "/metrics").map(|(_, b)| b)
    }

    /// Names of the peers it has loaded.
    pub fn peers(&self) -> Result<Vec<String>, String> {
        let (_, b) = http_get(self.http, "/v1/peers")?;
        let v: Value = serde_json::from_str(&b).map_err(|e| e.to_string())?;
        Ok(v["peers"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| p["name"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default())
    }
}

/// Local ports of process `pid`'s established TCP connections to remote
/// port `remote_port` (IPv4 and IPv6), from `/proc/<pid>/fd` and
/// `/proc/<pid>/net/tcp{,6}` (its own network namespace's table); empty
/// when none (or `/proc` is unreadable).
pub fn tcp_local_ports(pid: u32, remote_port: u16) -> Vec<u16> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("socket:[")
                        .and_then(|r| r.strip_suffix(']'))
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    let port_of = |addr: &str| {
        addr.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != "01" || !inodes.contains(f[9]) {
                continue;
            }
            if port_of(f[2]) == Some(remote_port) {
                if let Some(p) = port_of(f[1]) {
                    ports.push(p);
                }
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}
