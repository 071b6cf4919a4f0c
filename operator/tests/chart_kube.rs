//! charts/kvfabric against a REAL kube-apiserver (e2e/kube/up.sh: etcd
//! 3.6, kube-apiserver, controller-manager, scheduler, kwok fake nodes),
//! plus one fake node WITHOUT GPUs:
//!
//! 1. `helm install --wait` (release `kvfabric`, namespace `kvfabric`, the
//!    names examples/kvfabric.yaml assumes): every rendered object exists;
//!    the agent DaemonSet's pods are on the GPU nodes and only there; the
//!    operator's pods are scheduled.
//! 2. `kubectl auth can-i --list` of the operator's ServiceAccount equals
//!    charts/kvfabric/tests/operator-can-i.txt (KVFABRIC_BLESS=1 rewrites
//!    it).
//! 3. The real `kvfabric-operator`, run with the flags of the chart's
//!    Deployment and a kubeconfig holding a token of the chart's
//!    ServiceAccount, takes the leader Lease and reconciles
//!    examples/kvfabric.yaml with the chart's agents and the example engine
//!    pods end to end: status counts and conditions written; a deleted
//!    prefill pod invalidated (status, and the tombstone in etcd); no
//!    request forbidden.
//! 4. `helm uninstall --wait` leaves no object of the release behind
//!    (namespaced or cluster-scoped; the CRD stays, as Helm keeps crds/).
//!
//! SKIP without the tools (e2e/kube/install.sh); fails instead under
//! KVFABRIC_REQUIRE_SERVICES=1.

mod chart_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use chart_common::*;
use serde_json::{json, Value};

const RELEASE: &str = "kvfabric";
const NS: &str = "kvfabric";
const WAIT: Duration = Duration::from_secs(60);

struct Cluster {
    dir: PathBuf,
    env: BTreeMap<String, String>,
    path: String,
}

impl Cluster {
    fn up(path: String) -> Self {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("chart-kube-{}", std::process::id()));
        let mut c = Self {
            dir: dir.clone(),
            env: BTreeMap::new(),
            path,
        };
        let t = Instant::now();
        let out = Command::new(repo().join("e2e/kube/up.sh"))
            .arg(&dir)
            .stdin(Stdio::null())
            .output()
            .expect("run up.sh");
        assert!(
            out.status.success(),
            "up.sh failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        c.env = std::fs::read_to_string(dir.join("env"))
            .expect("DIR/env")
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        println!("cluster up in {:.1} s", t.elapsed().as_secs_f64());
        c
    }

    fn var(&self, k: &str) -> &str {
        self.env
            .get(k)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("{k} missing"))
    }

    fn cmd(&self, prog: &str) -> Command {
        let mut c = Command::new(prog);
        c.env("KUBECONFIG", self.var("KUBECONFIG"))
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    self.path,
                    std::env::var("PATH").unwrap_or_default()
                ),
            )
            .stdin(Stdio::null());
        c
    }

    fn run(&self, prog: &str, args: &[&str]) -> Output {
        self.cmd(prog)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{prog}: {e}"))
    }

    /// kubectl ARGS; panics with stderr on failure; stdout.
    fn kubectl(&self, args: &[&str]) -> String {
        let o = self.run("kubectl", args);
        assert!(
            o.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn kubectl_json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl(&a)).expect("kubectl JSON")
    }

    fn apply(&self, doc: &Value) {
        let mut child = self
            .cmd("kubectl")
            .args(["apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl apply");
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(serde_json::to_string(doc).unwrap().as_bytes())
            .unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(
            o.status.success(),
            "kubectl apply: {}",
            String::from_utf8_lossy(&o.stderr)
        );
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

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `f` every 100 ms until it returns Ok or `within` passes (then
/// panics with the last error).
fn poll<T>(what: &str, within: Duration, mut f: impl FnMut() -> Result<T, String>) -> T {
    let t = Instant::now();
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if t.elapsed() > within => {
                panic!("timed out after {within:?} waiting for {what}: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn yaml_file(p: &Path) -> Value {
    parse_docs(&std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .remove(0)
}

/// `kubectl auth can-i --list` normalized: header dropped, columns joined
/// by one space, lines sorted.
fn normalize_can_i(text: &str) -> String {
    let mut lines: Vec<String> = text
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| !l.is_empty())
        .collect();
    lines.sort();
    lines.dedup();
    lines.join("\n") + "\n"
}

#[test]
fn chart_install_operator_rbac_uninstall() {
    let Some(path) = tools_path() else { return };
    let t_all = Instant::now();
    let cluster = Cluster::up(path);
    let chart = chart();

    // A node without GPUs, managed by kwok like the GPU ones.
    cluster.apply(&json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": "kwok-cpu-0",
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": "kwok-cpu-0",
                       "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
        },
        "spec": {},
        "status": {
            "addresses": [{"type": "InternalIP", "address": "10.0.1.1"}],
            "allocatable": {"cpu": "16", "memory": "64Gi", "pods": "110"},
            "capacity": {"cpu": "16", "memory": "64Gi", "pods": "110"}
        }
    }));
    poll("node kwok-cpu-0 Ready", WAIT, || {
        let n = cluster.kubectl_json(&["get", "node", "kwok-cpu-0"]);
        let ready = n["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
            .map(|c| c["status"] == "True")
            .unwrap_or(false);
        let tainted = n["spec"]["taints"]
            .as_array()
            .is_some_and(|t| !t.is_empty());
        if ready && !tainted {
            Ok(())
        } else {
            Err(format!("{}", n["status"]["conditions"]))
        }
    });
    let gpu_nodes: Vec<String> = cluster
        .var("KVFABRIC_KUBE_NODES")
        .split(',')
        .map(String::from)
        .collect();
    assert_eq!(gpu_nodes.len(), 2);

    // 1. helm install --wait.
    let t = Instant::now();
    let out = cluster.run(
        "helm",
        &[
            "install",
            RELEASE,
            chart.to_str().unwrap(),
            "--namespace",
            NS,
            "--create-namespace",
            "--wait",
            "--timeout",
            "180s",
            // No storage provisioner here: the etcd members on emptyDir.
            "--set",
            "etcd.bundled.persistence.enabled=false",
        ],
    );
    assert!(
        out.status.success(),
        "helm install --wait: {}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        cluster.kubectl(&["get", "pods,events", "-A", "-o", "wide"])
    );
    println!("helm install --wait: {:.1} s", t.elapsed().as_secs_f64());
    let manifest = cluster.run("helm", &["get", "manifest", RELEASE, "-n", NS]);
    assert!(manifest.status.success());
    let manifest_text = String::from_utf8_lossy(&manifest.stdout).into_owned();
    let docs = parse_docs(&manifest_text);
    let mf = cluster.dir.join("manifest.yaml");
    std::fs::write(&mf, &manifest_text).unwrap();
    let listed = cluster.kubectl(&["get", "-f", mf.to_str().unwrap(), "-o", "name"]);
    assert_eq!(
        listed.lines().count(),
        docs.len(),
        "every rendered object exists:\n{listed}"
    );
    let crd = cluster.kubectl(&["get", "crd", "kvfabrics.kvfabric.io", "-o", "name"]);
    assert!(crd.contains("kvfabrics.kvfabric.io"));
    println!(
        "{} objects accepted: {}",
        docs.len(),
        docs.iter()
            .map(|d| format!("{}/{}", kind(d), name(d)))
            .collect::<Vec<_>>()
            .join(", ")
    );

    // The agents: on the GPU nodes, not on the CPU node.
    let ds = cluster.kubectl_json(&["get", "daemonset", "kvfabric-agent", "-n", NS]);
    assert_eq!(
        ds["status"]["desiredNumberScheduled"], 2,
        "{}",
        ds["status"]
    );
    assert_eq!(ds["status"]["numberReady"], 2, "{}", ds["status"]);
    let pods = cluster.kubectl_json(&[
        "get",
        "pods",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/component=agent",
    ]);
    let mut on: Vec<String> = pods["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["spec"]["nodeName"].as_str().unwrap_or("").to_string())
        .collect();
    on.sort();
    assert_eq!(on, gpu_nodes, "agent pods on the GPU nodes only");
    // The operator: both replicas scheduled (kwok runs nothing in them).
    let ops = cluster.kubectl_json(&[
        "get",
        "pods",
        "-n",
        NS,
        "-l",
        "app.kubernetes.io/component=operator",
    ]);
    let ops = ops["items"].as_array().unwrap();
    assert_eq!(ops.len(), 2);
    for p in ops {
        assert!(
            p["spec"]["nodeName"]
                .as_str()
                .is_some_and(|n| !n.is_empty()),
            "unscheduled: {}",
            p["metadata"]["name"]
        );
        assert_eq!(p["status"]["phase"], "Running");
    }

    // 2. What the operator's ServiceAccount may do, against the checked-in list.
    let sa = format!("system:serviceaccount:{NS}:kvfabric-operator");
    let can = cluster.kubectl(&["auth", "can-i", "--list", "--as", &sa, "-n", NS]);
    let got = normalize_can_i(&can);
    let expected_file = chart.join("tests/operator-can-i.txt");
    if std::env::var("KVFABRIC_BLESS").as_deref() == Ok("1") {
        std::fs::write(&expected_file, &got).unwrap();
        println!("wrote {}", expected_file.display());
    }
    let expected = std::fs::read_to_string(&expected_file).unwrap_or_default();
    assert_eq!(
        got, expected,
        "kubectl auth can-i --list --as {sa} differs from {} (KVFABRIC_BLESS=1 rewrites it after review)",
        expected_file.display()
    );
    // The agent's account may do nothing beyond what every account may.
    let agent_can = normalize_can_i(&cluster.kubectl(&[
        "auth",
        "can-i",
        "--list",
        "--as",
        &format!("system:serviceaccount:{NS}:kvfabric-agent"),
        "-n",
        NS,
    ]));
    assert!(
        !agent_can.contains("pods")
            && !agent_can.contains("kvfabric")
            && !agent_can.contains("secrets"),
        "agent account has grants:\n{agent_can}"
    );

    // 3. The operator with the chart's account and flags.
    let token = cluster.kubectl(&[
        "create",
        "token",
        "kvfabric-operator",
        "-n",
        NS,
        "--duration",
        "1h",
    ]);
    let kc = cluster.dir.join("operator.kubeconfig");
    std::fs::write(
        &kc,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: sa\n  user:\n    token: {}\ncontexts:\n- name: sa\n  context: {{cluster: c, user: sa, namespace: {NS}}}\ncurrent-context: sa\n",
            cluster.var("KVFABRIC_KUBE_SERVER"),
            cluster.var("KVFABRIC_KUBE_CA"),
            token.trim()
        ),
    )
    .unwrap();
    let dep = one(&docs, "Deployment", "-operator");
    let mut args: Vec<String> = strings(&container(dep)["args"])
        .into_iter()
        .map(|a| a.replace("$(POD_NAMESPACE)", NS))
        .collect();
    let i = args
        .iter()
        .position(|a| a == "--metrics-listen")
        .expect("--metrics-listen");
    args[i + 1] = "127.0.0.1:0".into();
    assert!(args.contains(&"--leader-elect".to_string()));
    args.extend(["--kubeconfig".into(), kc.to_string_lossy().into_owned()]);
    let log = cluster.dir.join("operator.log");
    let logf = std::fs::File::create(&log).unwrap();
    let operator = Proc(
        Command::new(env!("CARGO_BIN_EXE_kvfabric-operator"))
            .args(&args)
            .env("POD_NAMESPACE", NS)
            .env("POD_NAME", "chart-test-operator")
            .env("KVFABRIC_LOG", "info")
            .stdout(logf.try_clone().unwrap())
            .stderr(logf)
            .spawn()
            .expect("start kvfabric-operator"),
    );
    let t_op = Instant::now();
    let oplog = || std::fs::read_to_string(&log).unwrap_or_default();

    // The example fabric (release "kvfabric" in "kvfabric"), etcd pointed
    // at the control plane's etcd; the example engine pods.
    let mut fabric = yaml_file(&chart.join("examples/kvfabric.yaml"));
    fabric["metadata"]["namespace"] = json!(NS);
    fabric["spec"]["etcd"]["endpoints"] = json!([cluster.var("KVFABRIC_KUBE_ETCD")]);
    cluster.apply(&fabric);
    let mut prefill = yaml_file(&chart.join("examples/engine-pod.yaml"));
    prefill["metadata"]["namespace"] = json!(NS);
    let mut decode = prefill.clone();
    decode["metadata"]["name"] = json!("decode-0");
    decode["metadata"]["labels"]["kvfabric.io/role"] = json!("decode");
    cluster.apply(&prefill);
    cluster.apply(&decode);

    let status = poll("KvFabric status reconciled", WAIT, || {
        let f = cluster.kubectl_json(&["get", "kvfabric", "default", "-n", NS]);
        let s = &f["status"];
        let degraded = s["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Degraded"))
            .map(|c| c["status"].clone());
        if s["observedGeneration"] == f["metadata"]["generation"]
            && s["agentsReady"] == 2
            && s["agentsTotal"] == 2
            && s["prefillReady"] == 1
            && s["decodeReady"] == 1
            && degraded == Some(json!("False"))
        {
            Ok(s.clone())
        } else {
            Err(format!("status {s}\noperator log:\n{}", oplog()))
        }
    });
    println!(
        "reconciled {:.1} s after the operator started: {status}",
        t_op.elapsed().as_secs_f64()
    );
    let lease = cluster.kubectl_json(&["get", "lease", "kvfabric-operator", "-n", NS]);
    assert!(
        lease["spec"]["holderIdentity"]
            .as_str()
            .is_some_and(|h| h.starts_with("chart-test-operator")),
        "leader Lease: {lease}"
    );

    // A deleted prefill pod is invalidated: status and the etcd tombstone.
    let uid = cluster.kubectl_json(&["get", "pod", "prefill-0", "-n", NS])["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string();
    cluster.kubectl(&["delete", "pod", "prefill-0", "-n", NS, "--wait=false"]);
    poll("prefill-0 invalidated", WAIT, || {
        let s = cluster.kubectl_json(&["get", "kvfabric", "default", "-n", NS])["status"].clone();
        if s["peersInvalidated"].as_u64().unwrap_or(0) >= 1
            && s["lastInvalidated"]
                .as_str()
                .is_some_and(|l| l.starts_with("kvfabric/prefill-0"))
        {
            Ok(())
        } else {
            Err(format!("status {s}\noperator log:\n{}", oplog()))
        }
    });
    let etcd = cluster.var("KVFABRIC_KUBE_ETCD").to_string();
    let key = format!("/kvfabric/default/tombstones/{uid}");
    let found = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let mut c = etcd_client::Client::connect([etcd.as_str()], None)
                .await
                .expect("etcd");
            c.get(key.as_str(), None)
                .await
                .expect("etcd get")
                .kvs()
                .len()
        });
    assert_eq!(found, 1, "tombstone {key} in etcd");
    let text = oplog();
    assert!(
        !text.to_lowercase().contains("forbidden"),
        "the operator was refused something:\n{text}"
    );
    // Remove the fabric while the operator runs (it may hold a finalizer).
    cluster.kubectl(&["delete", "kvfabric", "default", "-n", NS, "--timeout=60s"]);
    cluster.kubectl(&["delete", "pod", "decode-0", "-n", NS, "--timeout=60s"]);
    drop(operator);

    // 4. helm uninstall leaves nothing of the release.
    let t = Instant::now();
    let out = cluster.run(
        "helm",
        &[
            "uninstall",
            RELEASE,
            "-n",
            NS,
            "--wait",
            "--timeout",
            "120s",
        ],
    );
    assert!(
        out.status.success(),
        "helm uninstall: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sel = format!("app.kubernetes.io/instance={RELEASE}");
    let kinds = |namespaced: &str| -> String {
        cluster
            .kubectl(&[
                "api-resources",
                "--verbs=list",
                &format!("--namespaced={namespaced}"),
                "-o",
                "name",
            ])
            .lines()
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (ns_kinds, cluster_kinds) = (kinds("true"), kinds("false"));
    poll("nothing of the release left", WAIT, || {
        let left_ns = cluster.kubectl(&["get", &ns_kinds, "-n", NS, "-l", &sel, "-o", "name"]);
        let left_cl = cluster.kubectl(&["get", &cluster_kinds, "-l", &sel, "-o", "name"]);
        if left_ns.trim().is_empty() && left_cl.trim().is_empty() {
            Ok(())
        } else {
            Err(format!("left: {left_ns}{left_cl}"))
        }
    });
    // By name too (objects that might have lost their labels).
    for (k, n, ns) in docs
        .iter()
        .map(|d| (kind(d), name(d), d["metadata"]["namespace"].as_str()))
    {
        let mut a = vec!["get", k, n, "--ignore-not-found", "-o", "name"];
        if let Some(ns) = ns {
            a.extend(["-n", ns]);
        }
        assert_eq!(
            cluster.kubectl(&a).trim(),
            "",
            "{k}/{n} left after uninstall"
        );
    }
    println!(
        "helm uninstall --wait + nothing left: {:.1} s (the CRD stays, as Helm keeps crds/: {})",
        t.elapsed().as_secs_f64(),
        cluster
            .kubectl(&[
                "get",
                "crd",
                "kvfabrics.kvfabric.io",
                "-o",
                "name",
                "--ignore-not-found"
            ])
            .trim()
    );
    println!("chart_kube total {:.1} s", t_all.elapsed().as_secs_f64());
}
