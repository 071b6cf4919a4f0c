//! Agents reach an etcd that serves TLS and requires client certificates
//! (issue 14, item 1: "the agent's and the operator's etcd clients speak
//! TLS with client certificates, tested against an etcd serving TLS"): two
//! `kvfabric agent` processes given `--etcd-ca-file`, `--etcd-cert-file`
//! and `--etcd-key-file` publish and load each other over `https://`; an
//! agent whose client certificate etcd does not trust never becomes ready
//! and is never loaded. PKI from e2e/make-test-pki.sh (openssl).
//!
//! SKIP without etcd, openssl or the NIXL runtime; fails instead under
//! `KVFABRIC_REQUIRE_SERVICES=1`.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::proc::Agent;

fn have(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    let code = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

struct Etcd(Child);

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pki(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../e2e/make-test-pki.sh");
    let out = Command::new(script)
        .arg(dir)
        .output()
        .expect("make-test-pki.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn agents_publish_and_load_over_tls_with_client_certificates() {
    if !have("etcd") || !have("openssl") {
        common::skip("etcd or openssl not on PATH (e2e/setup.sh installs both)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvf-agent-etcd-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    pki(&dir);
    let other = dir.join("other");
    pki(&other);
    let (cp, pp) = (free_port(), free_port());
    let url = format!("https://127.0.0.1:{cp}");
    let f = |p: &Path| p.display().to_string();
    let _etcd = Etcd(
        Command::new("etcd")
            .args([
                "--data-dir",
                &f(&dir.join("data")),
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{pp}"),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{pp}"),
                "--initial-cluster",
                &format!("default=http://127.0.0.1:{pp}"),
                "--cert-file",
                &f(&dir.join("server.crt")),
                "--key-file",
                &f(&dir.join("server.key")),
                "--trusted-ca-file",
                &f(&dir.join("ca.crt")),
                "--client-cert-auth",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd"),
    );
    let fabric = format!("tls-{}", std::process::id());
    let tls = |d: &Path| {
        vec![
            "--etcd-ca-file".to_string(),
            f(&dir.join("ca.crt")),
            "--etcd-cert-file".to_string(),
            f(&d.join("client.crt")),
            "--etcd-key-file".to_string(),
            f(&d.join("client.key")),
        ]
    };
    let spawn = |logical: &str, client_dir: &Path| {
        let args = tls(client_dir);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Agent::spawn_with(&url, &fabric, logical, "both", &args, &[])
    };
    let mut a = spawn("tls-a", &dir);
    let a_addr = match a.addr.recv_timeout(Duration::from_secs(30)) {
        Ok(x) => x,
        Err(_) => {
            let log = a.kill_and_log();
            if log.contains("NIXL runtime") {
                common::skip(&format!("NIXL runtime not available: {log}"));
                return;
            }
            panic!("agent a never announced its address:\n{log}");
        }
    };
    let mut b = spawn("tls-b", &dir);
    let b_addr = b
        .addr
        .recv_timeout(Duration::from_secs(30))
        .expect("agent b address");
    // An agent whose client certificate etcd does not trust.
    let mut c = spawn("tls-untrusted", &other);
    let c_addr = c
        .addr
        .recv_timeout(Duration::from_secs(30))
        .expect("agent c address");

    // a and b: ready (published over TLS) and each loads the other.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ready = get(a_addr, "/readyz").0 == 200 && get(b_addr, "/readyz").0 == 200;
        let a_peers = get(a_addr, "/v1/peers").1;
        let b_peers = get(b_addr, "/v1/peers").1;
        if ready && a_peers.contains("\"tls-b\"") && b_peers.contains("\"tls-a\"") {
            assert!(!a_peers.contains("tls-untrusted") && !b_peers.contains("tls-untrusted"));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "agents over TLS did not publish and load each other: a {a_peers} b {b_peers}\n--- a ---\n{}",
            a.kill_and_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The untrusted one never publishes: not ready, never loaded.
    std::thread::sleep(Duration::from_secs(2));
    assert_ne!(
        get(c_addr, "/readyz").0,
        200,
        "agent with an untrusted client certificate is ready"
    );
    assert!(!get(a_addr, "/v1/peers").1.contains("tls-untrusted"));
    drop(c.kill_and_log());
    drop(b.kill_and_log());
    drop(a.kill_and_log());
    let _ = std::fs::remove_dir_all(&dir);
}
