//! Shared by the operator's tests against a real kube-apiserver: the
//! control plane of e2e/kube/up.sh, SKIP handling, bounded polling.
#![allow(dead_code)]

pub mod agent;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// SKIP (or, under KVFABRIC_REQUIRE_SERVICES=1, fail) with `why`.
pub fn skip(why: &str) {
    if std::env::var("KVFABRIC_REQUIRE_SERVICES").as_deref() == Ok("1") {
        panic!("required service missing: {why}");
    }
    println!("SKIP: {why}");
}

/// A control plane started by e2e/kube/up.sh in its own directory; stopped
/// (and the directory removed) on drop.
pub struct Cluster {
    /// Its directory (kubeconfig, env, logs).
    pub dir: PathBuf,
    env: BTreeMap<String, String>,
}

impl Cluster {
    /// Starts one in a fresh temp dir named `tag-<pid>`; `None` after a
    /// SKIP (tools missing).
    pub fn up(tag: &str) -> Option<Self> {
        let kube = repo().join("e2e/kube");
        if !kube.join("up.sh").is_file() {
            skip("e2e/kube/up.sh not present");
            return None;
        }
        let cached = Command::new(kube.join("install.sh"))
            .arg("--path")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !cached {
            skip("control-plane tools not installed (run e2e/kube/install.sh)");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
        let out = Command::new(kube.join("up.sh"))
            .arg(&dir)
            .stdin(Stdio::null())
            .output()
            .expect("run up.sh");
        let mut cluster = Self {
            dir: dir.clone(),
            env: BTreeMap::new(),
        };
        assert!(
            out.status.success(),
            "up.sh failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let env = std::fs::read_to_string(dir.join("env")).expect("DIR/env");
        cluster.env = env
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Some(cluster)
    }

    /// A variable of DIR/env (panics when missing).
    pub fn var(&self, k: &str) -> &str {
        self.env
            .get(k)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("{k} missing from env"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(repo().join("e2e/kube/down.sh"))
            .arg(&self.dir)
            .arg("--purge")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Polls `cond` every 20 ms until true; panics naming `what` after `within`.
pub async fn wait_for<F, Fut>(what: &str, within: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !cond().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `cond` every 20 ms until true (→ `true`) or `within` passed (→
/// `false`), for callers that add diagnostics to a failure.
pub async fn poll_until<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Cluster {
    /// A kube client on this cluster's kubeconfig (bearer-token context).
    pub async fn client(&self) -> kube::Client {
        let kc =
            kube::config::Kubeconfig::read_from(self.dir.join("kubeconfig")).expect("kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("kube config");
        kube::Client::try_from(config).expect("kube client")
    }
}

/// Server-side applies `crds/` and waits (30 s) until it is Established.
pub async fn apply_crd(client: &kube::Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Api, Patch, PatchParams};
    let crd: CustomResourceDefinition = serde_yaml::from_str(
        &std::fs::read_to_string(repo().join(kvfabric_operator::crd::CRD_PATH))
            .expect("read crds/"),
    )
    .expect("CRD YAML");
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(
        "kvfabrics.kvfabric.io",
        &PatchParams::apply("kvfabric-test").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("apply CRD");
    wait_for("CRD established", Duration::from_secs(30), || {
        let crds = crds.clone();
        async move {
            crds.get("kvfabrics.kvfabric.io")
                .await
                .ok()
                .and_then(|c| c.status)
                .and_then(|s| s.conditions)
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                })
        }
    })
    .await;
}
