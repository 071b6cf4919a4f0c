//! Real `kvfabric agent` processes for the operator's tests: spawn one,
//! learn its HTTP address and name, read its JSON endpoints.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// `target/<profile>/kvfabric` next to the test binary, when built.
pub fn kvfabric_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?; // target/<profile>/deps/.. → target/<profile>
    let p = dir.join("kvfabric");
    p.is_file().then_some(p)
}

/// A `kvfabric agent` child, killed on drop.
pub struct AgentProc {
    /// The process.
    pub child: Child,
    /// Its HTTP API.
    pub addr: SocketAddr,
    /// Its NIXL agent name (incarnation included).
    pub name: String,
    /// The last 40 stderr lines (diagnostics of a failure).
    log: Arc<Mutex<std::collections::VecDeque<String>>>,
}

impl AgentProc {
    /// Starts `kvfabric agent --listen 127.0.0.1:0 ARGS...` with `envs`
    /// added; waits (30 s) for its address and (15 s) for `/v1/config` to
    /// name it. `Err(stderr tail)` when it never did.
    pub fn spawn(bin: &Path, args: &[&str], envs: &[(&str, &str)]) -> Result<Self, String> {
        let mut cmd = Command::new(bin);
        cmd.args(["agent", "--listen", "127.0.0.1:0"]).args(args);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.split("listening on http://").nth(1) {
                    if let Ok(a) = a.trim().parse::<SocketAddr>() {
                        let _ = tx.send(a);
                    }
                }
            }
        });
        let err = child.stderr.take().ok_or("no stderr")?;
        let log = Arc::new(Mutex::new(std::collections::VecDeque::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut l = log2.lock().unwrap_or_else(|p| p.into_inner());
                if l.len() >= 40 {
                    l.pop_front();
                }
                l.push_back(line);
            }
        });
        let tail = |log: &Arc<Mutex<std::collections::VecDeque<String>>>| {
            log.lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        };
        let addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                std::thread::sleep(Duration::from_millis(200));
                return Err(tail(&log));
            }
        };
        // The HTTP API may answer a moment after the address is printed.
        let deadline = Instant::now() + Duration::from_secs(15);
        let name = loop {
            let n = get_json(addr, "/v1/config")["agent"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if !n.is_empty() {
                break n;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("agent at {addr} never named itself on /v1/config"));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        Ok(Self {
            child,
            addr,
            name,
            log,
        })
    }

    /// The last stderr lines.
    pub fn log_tail(&self) -> String {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of `GET path` (HTTP/1.0; 5 s connect, 10 s read bounds; empty
/// on any error).
pub fn get_text(addr: SocketAddr, path: &str) -> String {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    if write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").is_err() {
        return String::new();
    }
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    raw.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// `GET path` as JSON (`Null` on any error).
pub fn get_json(addr: SocketAddr, path: &str) -> Value {
    serde_json::from_str(&get_text(addr, path)).unwrap_or(Value::Null)
}
