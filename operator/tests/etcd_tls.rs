//! The operator's etcd client speaks TLS with client certificates against
//! an etcd that serves TLS and requires client certificates (issue 14,
//! item 1). Certificates come from e2e/make-test-pki.sh (openssl) in a temp
//! dir: a CA, etcd's serving certificate (SAN 127.0.0.1) and a client
//! certificate.
//!
//! SKIP without `etcd` or `openssl` on PATH; fails instead under
//! `KVFABRIC_REQUIRE_SERVICES=1`.

mod kube_common;

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kube_common::skip;
use kvfabric_operator::store::{EtcdTls, FabricStore};

fn have(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// CA, server (SAN IP 127.0.0.1) and client key pairs in `dir`
/// (e2e/make-test-pki.sh).
fn make_pki(dir: &Path) {
    let script = kube_common::repo().join("e2e/make-test-pki.sh");
    let out = Command::new(script)
        .arg(dir)
        .output()
        .expect("run make-test-pki.sh");
    assert!(
        out.status.success(),
        "make-test-pki.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Etcd(Child);

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn tls(dir: &Path, ca: &str) -> EtcdTls {
    EtcdTls {
        ca_pem: std::fs::read(dir.join(format!("{ca}.crt"))).unwrap(),
        cert_pem: std::fs::read(dir.join("client.crt")).unwrap(),
        key_pem: std::fs::read(dir.join("client.key")).unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_store_speaks_tls_with_client_certificates() {
    if !have("etcd") || !have("openssl") {
        skip("etcd or openssl not on PATH (e2e/setup.sh installs both)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvf-etcd-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    make_pki(&dir);
    // A second CA that signed nothing etcd serves.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    make_pki(&other);

    let (client_port, peer_port) = (free_port(), free_port());
    let url = format!("https://127.0.0.1:{client_port}");
    let etcd = Etcd(
        Command::new("etcd")
            .args([
                "--data-dir",
                &dir.join("data").display().to_string(),
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{peer_port}"),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer_port}"),
                "--initial-cluster",
                &format!("default=http://127.0.0.1:{peer_port}"),
                "--cert-file",
                &dir.join("server.crt").display().to_string(),
                "--key-file",
                &dir.join("server.key").display().to_string(),
                "--trusted-ca-file",
                &dir.join("ca.crt").display().to_string(),
                "--client-cert-auth",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd"),
    );
    let good = tls(&dir, "ca");
    let endpoints = vec![url.clone()];
    // Up within 20 s: the first successful TLS round trip.
    let deadline = Instant::now() + Duration::from_secs(20);
    let store = loop {
        match FabricStore::connect(&endpoints, "tls", Duration::from_secs(2), Some(&good)).await {
            Ok(s) if s.agent_http_urls().await.is_ok() => break s,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "TLS etcd not usable with the right client certificate: {:?}",
                    other.err()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(store.delete_fabric().await.expect("delete over TLS"), 0);

    // Without a client certificate, or trusting another CA, or plain HTTP:
    // no request succeeds.
    let refused = |r: Result<FabricStore, kvfabric_operator::store::StoreError>| async move {
        match r {
            Err(_) => true,
            Ok(s) => s.agent_http_urls().await.is_err(),
        }
    };
    let wrong_ca = EtcdTls {
        ca_pem: std::fs::read(other.join("ca.crt")).unwrap(),
        ..good.clone()
    };
    assert!(
        refused(
            FabricStore::connect(&endpoints, "tls", Duration::from_secs(2), Some(&wrong_ca)).await
        )
        .await,
        "a server certificate from an untrusted CA was accepted"
    );
    let foreign_client = EtcdTls {
        cert_pem: std::fs::read(other.join("client.crt")).unwrap(),
        key_pem: std::fs::read(other.join("client.key")).unwrap(),
        ..good.clone()
    };
    assert!(
        refused(
            FabricStore::connect(
                &endpoints,
                "tls",
                Duration::from_secs(2),
                Some(&foreign_client)
            )
            .await
        )
        .await,
        "etcd accepted a client certificate it does not trust"
    );
    let plain = vec![format!("http://127.0.0.1:{client_port}")];
    assert!(
        refused(FabricStore::connect(&plain, "tls", Duration::from_secs(2), None).await).await,
        "plain HTTP to a TLS etcd succeeded"
    );
    drop(etcd);
    let _ = std::fs::remove_dir_all(&dir);
}
