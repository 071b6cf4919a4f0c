//! charts/kvfabric without a cluster: `helm lint --strict`, `helm template`
//! validated by `kubernetes-validate --strict` for k8s 1.30 and 1.37 (the
//! defaults and each of charts/kvfabric/ci/*-values.yaml), assertions over
//! the rendered objects for the values that switch resources on and off,
//! the agent's acceptance of the rendered config, and the chart's CRD copy
//! against crds/.
//!
//! Tools: helm from e2e/kube/install.sh's cache, kubernetes-validate from
//! charts/kvfabric/tests/kubernetes-validate.sh (a venv in the same cache).
//! SKIP without them; fail instead under KVFABRIC_REQUIRE_SERVICES=1.

mod chart_common;

use std::path::{Path, PathBuf};
use std::process::Command;

use chart_common::*;
use serde_json::Value;

/// Kubernetes versions the rendered objects are validated against.
const K8S_VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];

/// Kinds kubernetes-validate has no schema for (CRD instances); skipped
/// explicitly, each with the reason printed.
const CUSTOM_KINDS: [(&str, &str); 3] = [
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
];

#[test]
fn chart_crd_is_the_generated_one() {
    let src = repo().join("crds/kvfabric.io_kvfabrics.yaml");
    let copy = chart().join("crds/kvfabric.io_kvfabrics.yaml");
    let a = std::fs::read(&src).expect("crds/kvfabric.io_kvfabrics.yaml");
    let b = std::fs::read(&copy).expect("charts/kvfabric/crds/kvfabric.io_kvfabrics.yaml");
    assert!(
        a == b,
        "the chart's CRD is stale: cp crds/kvfabric.io_kvfabrics.yaml charts/kvfabric/crds/"
    );
    let listed: Vec<_> = std::fs::read_dir(chart().join("crds"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let mut src_listed: Vec<_> = std::fs::read_dir(repo().join("crds"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    src_listed.sort();
    let mut listed = listed;
    listed.sort();
    assert_eq!(
        listed, src_listed,
        "charts/kvfabric/crds/ must hold exactly crds/*.yaml"
    );
}

#[test]
fn chart_lint_strict() {
    let Some(path) = tools_path() else { return };
    let chart = chart();
    let c = chart.to_str().unwrap();
    let mut variants: Vec<Vec<&str>> = vec![vec![]];
    let files: Vec<String> = CI_VALUES
        .iter()
        .map(|f| chart.join(f).to_string_lossy().into_owned())
        .collect();
    for f in &files {
        variants.push(vec!["-f", f.as_str()]);
    }
    for v in variants {
        let mut args = vec!["lint", "--strict", c];
        args.extend_from_slice(&v);
        let out = helm(&path, &args);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "helm lint --strict {v:?}:\n{text}");
        assert!(
            text.contains("1 chart(s) linted, 0 chart(s) failed"),
            "{v:?}: {text}"
        );
        assert!(
            !text.contains("[WARNING]") && !text.contains("[ERROR]"),
            "{v:?}: {text}"
        );
        println!("ok helm lint --strict {v:?}");
    }
}

fn kubernetes_validate() -> Option<PathBuf> {
    let out = Command::new(chart().join("tests/kubernetes-validate.sh")).output();
    match out {
        Ok(o) if o.status.success() => Some(PathBuf::from(
            String::from_utf8_lossy(&o.stdout).trim().to_string(),
        )),
        Ok(o) => {
            skip(&format!(
                "kubernetes-validate could not be installed: {}",
                String::from_utf8_lossy(&o.stderr)
            ));
            None
        }
        Err(e) => {
            skip(&format!("kubernetes-validate.sh: {e}"));
            None
        }
    }
}

#[test]
fn chart_renders_valid_kubernetes_1_30_and_1_37() {
    let Some(path) = tools_path() else { return };
    let Some(validator) = kubernetes_validate() else {
        return;
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("chart-validate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut variants: Vec<(String, Vec<String>)> = vec![("defaults".into(), vec![])];
    for f in CI_VALUES {
        variants.push((
            f.into(),
            vec!["-f".into(), chart().join(f).to_string_lossy().into_owned()],
        ));
    }
    for (label, extra) in &variants {
        // CRDs included; the monitoring API advertised so the monitors are
        // rendered (and then skipped below, by name).
        let mut args: Vec<&str> = vec![
            "--include-crds",
            "--api-versions",
            "monitoring.coreos.com/v1",
        ];
        args.extend(extra.iter().map(String::as_str));
        let rendered = render_raw(&path, &args);
        // Validate helm's own text (a YAML round trip could change it, e.g.
        // YAML 1.1 octal), split into its documents.
        let mut keep: Vec<String> = Vec::new();
        for raw in split_docs(&rendered) {
            let Some(d) = parse_docs(&raw).pop() else {
                continue;
            };
            let api = d["apiVersion"].as_str().unwrap_or("");
            if CUSTOM_KINDS
                .iter()
                .any(|(a, k)| *a == api && *k == kind(&d))
            {
                println!(
                    "{label}: not validated: {}/{} ({api} is a custom resource kubernetes-validate has no schema for)",
                    kind(&d),
                    name(&d)
                );
            } else {
                keep.push(raw);
            }
        }
        assert!(
            keep.len() >= 8,
            "{label}: only {} objects rendered",
            keep.len()
        );
        let file = dir.join(format!("{}.yaml", label.replace('/', "_")));
        let text: String = keep.iter().map(|d| format!("---\n{d}\n")).collect();
        std::fs::write(&file, text).unwrap();
        for v in K8S_VERSIONS {
            let out = Command::new(&validator)
                .args(["--strict", "-k", v])
                .arg(&file)
                .output()
                .expect("run kubernetes-validate");
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "{label}: kubernetes-validate --strict -k {v} failed:\n{stdout}{stderr}"
            );
            let passed = stdout
                .lines()
                .filter(|l| l.contains(" passed for resource "))
                .count();
            assert_eq!(
                passed,
                keep.len(),
                "{label} k8s {v}: every object must be validated (no schema-less skips):\n{stdout}{stderr}"
            );
            println!("ok {label}: {passed} objects valid for k8s {v} (--strict)");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `helm template` output as text.
fn render_raw(path: &str, args: &[&str]) -> String {
    let c = chart();
    let mut a = vec!["template", "t", c.to_str().unwrap(), "--namespace", "kvf"];
    a.extend_from_slice(args);
    let out = helm(path, &a);
    assert!(
        out.status.success(),
        "helm template {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A multi-document YAML text split at its `---` lines.
fn split_docs(text: &str) -> Vec<String> {
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line == "---" {
            docs.push(String::new());
        } else {
            let d = docs.last_mut().unwrap();
            d.push_str(line);
            d.push('\n');
        }
    }
    docs.into_iter()
        .filter(|d| d.lines().any(|l| l.starts_with("kind:")))
        .collect()
}

fn env_of<'a>(c: &'a Value, var: &str) -> Option<&'a Value> {
    c["env"].as_array()?.iter().find(|e| e["name"] == var)
}

fn caps_added(c: &Value) -> Vec<String> {
    strings(&c["securityContext"]["capabilities"]["add"])
}

fn volume<'a>(d: &'a Value, name: &str) -> Option<&'a Value> {
    d["spec"]["template"]["spec"]["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == name)
}

fn agent_config(docs: &[Value]) -> Value {
    let cm = one(docs, "ConfigMap", "-agent-config");
    let text = cm["data"]["config.yaml"].as_str().expect("config.yaml");
    parse_docs(text).remove(0)
}

fn values(f: &str) -> String {
    chart().join(f).to_string_lossy().into_owned()
}

#[test]
fn chart_defaults() {
    let Some(path) = tools_path() else { return };
    let docs = template(&path, &[]);

    // Operator: 2 replicas, leader election, probes on the metrics port, PDB.
    let dep = one(&docs, "Deployment", "-operator");
    assert_eq!(dep["spec"]["replicas"], 2);
    let c = container(dep);
    assert_eq!(
        strings(&c["args"]),
        [
            "--metrics-listen",
            "0.0.0.0:9090",
            "--leader-elect",
            "--leader-election-namespace",
            "$(POD_NAMESPACE)",
            "--leader-election-lease-name",
            "kvfabric-operator"
        ]
    );
    assert_eq!(
        env_of(c, "POD_NAMESPACE").unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "metrics");
    assert_eq!(c["ports"][0]["containerPort"], 9090);
    assert!(c["resources"]["requests"]["cpu"].is_string());
    let pdb = one(&docs, "PodDisruptionBudget", "-operator");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        dep["spec"]["selector"]["matchLabels"]
    );

    // Agent DaemonSet.
    let ds = one(&docs, "DaemonSet", "-agent");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["nodeSelector"]["nvidia.com/gpu.present"], "true");
    assert_eq!(pod["tolerations"][0]["key"], "nvidia.com/gpu");
    assert_eq!(pod["hostNetwork"], false);
    assert_eq!(pod["hostPID"], false);
    assert_eq!(pod["hostIPC"], false);
    assert_eq!(pod["automountServiceAccountToken"], false);
    let a = container(ds);
    let args = strings(&a["args"]);
    assert_eq!(args[0], "agent");
    for (flag, val) in [
        ("--config", "/etc/kvfabric/config.yaml"),
        ("--logical-id", "$(POD_NAME)"),
        ("--pod-uid", "$(POD_UID)"),
    ] {
        let i = args
            .iter()
            .position(|x| x == flag)
            .unwrap_or_else(|| panic!("{flag} missing: {args:?}"));
        assert_eq!(args[i + 1], val);
    }
    assert_eq!(
        env_of(a, "POD_UID").unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.uid"
    );
    assert_eq!(
        env_of(a, "POD_NAME").unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(env_of(a, "NVIDIA_VISIBLE_DEVICES").unwrap()["value"], "all");
    assert_eq!(a["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(a["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(a["readinessProbe"]["httpGet"]["port"], "http");
    assert_eq!(caps_added(a), ["IPC_LOCK", "SYS_PTRACE"]);
    assert_eq!(
        strings(&a["securityContext"]["capabilities"]["drop"]),
        ["ALL"]
    );
    let sock = volume(ds, "engine-socket").expect("socket hostPath");
    assert_eq!(sock["hostPath"]["path"], "/run/kvfabric");
    assert!(volume(ds, "dev-infiniband").is_none());
    assert!(volume(ds, "etcd-tls").is_none());
    assert!(a["resources"]["limits"]
        .get("rdma/rdma_shared_device_a")
        .is_none());
    assert!(ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"].is_string());
    let sa = one(&docs, "ServiceAccount", "-agent");
    assert_eq!(sa["automountServiceAccountToken"], false);

    // Config: the chart's keys; bundled etcd's three members.
    let cfg = agent_config(&docs);
    assert_eq!(cfg["fabric"], "default");
    assert_eq!(cfg["listen"], "0.0.0.0:9400");
    assert_eq!(cfg["engineSocket"], "/run/kvfabric/engine.sock");
    assert_eq!(cfg["gpu"], 0);
    let eps = strings(&cfg["etcdEndpoints"]);
    assert_eq!(
        eps,
        (0..3)
            .map(|i| format!("http://t-kvfabric-etcd-{i}.t-kvfabric-etcd-headless.kvf.svc:2379"))
            .collect::<Vec<_>>()
    );

    // Bundled etcd: 3 members, headless Service, PDB, persistent volumes.
    let sts = one(&docs, "StatefulSet", "-etcd");
    assert_eq!(sts["spec"]["replicas"], 3);
    assert_eq!(sts["spec"]["podManagementPolicy"], "Parallel");
    assert_eq!(container(sts)["image"], "registry.k8s.io/etcd:3.6.4-0");
    let init = strings(&container(sts)["args"])
        .into_iter()
        .find(|a| a.starts_with("--initial-cluster="))
        .unwrap();
    assert_eq!(init.matches("=http://").count(), 3, "{init}");
    assert!(sts["spec"]["volumeClaimTemplates"].is_array());
    let hl = one(&docs, "Service", "-etcd-headless");
    assert_eq!(hl["spec"]["clusterIP"], "None");
    assert_eq!(sts["spec"]["serviceName"], name(hl));
    assert_eq!(
        one(&docs, "PodDisruptionBudget", "-etcd")["spec"]["maxUnavailable"],
        1
    );

    // NetworkPolicies: agents (HTTP from anyone, all ports from agents), etcd.
    let np = one(&docs, "NetworkPolicy", "-agent");
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], 9400);
    assert!(np["spec"]["ingress"][0].get("from").is_none());
    assert_eq!(
        np["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"],
        ds["spec"]["selector"]["matchLabels"]
    );
    assert!(np["spec"]["ingress"][1].get("ports").is_none());
    // The operator polls the agents' GET /v1/report on the HTTP port.
    let op = one(&docs, "Deployment", "-operator");
    assert_eq!(
        np["spec"]["ingress"][2]["from"][0]["podSelector"]["matchLabels"],
        op["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(np["spec"]["ingress"][2]["ports"][0]["port"], 9400);
    one(&docs, "NetworkPolicy", "-etcd");

    // RBAC: exactly the rules the operator needs.
    let cr = one(&docs, "ClusterRole", "-operator");
    let rules: Vec<(Vec<String>, Vec<String>, Vec<String>)> = cr["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                strings(&r["apiGroups"]),
                strings(&r["resources"]),
                strings(&r["verbs"]),
            )
        })
        .collect();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        rules,
        vec![
            (
                s(&[""]),
                s(&["pods", "nodes"]),
                s(&["get", "list", "watch"])
            ),
            (
                s(&["kvfabric.io"]),
                s(&["kvfabrics"]),
                s(&["get", "list", "watch", "patch", "update"])
            ),
            (
                s(&["kvfabric.io"]),
                s(&["kvfabrics/status"]),
                s(&["get", "patch", "update"])
            ),
            (
                s(&["kvfabric.io"]),
                s(&["kvfabrics/finalizers"]),
                s(&["update"])
            ),
            (
                s(&["", "events.k8s.io"]),
                s(&["events"]),
                s(&["create", "patch"])
            ),
        ]
    );
    let role = one(&docs, "Role", "-operator");
    let rr = role["rules"].as_array().unwrap();
    assert_eq!(rr.len(), 2, "{rr:?}");
    assert_eq!(strings(&rr[1]["resourceNames"]), ["kvfabric-operator"]);
    assert!(rr.iter().all(|r| r["resources"][0] == "leases"));
    // No cluster role, role or token for the agents.
    assert!(!of_kind(&docs, "ClusterRole")
        .iter()
        .any(|d| name(d).contains("agent")));

    // No monitoring.coreos.com objects unless the API is served.
    for k in ["ServiceMonitor", "PodMonitor", "PrometheusRule"] {
        assert!(
            !has(&docs, k),
            "{k} rendered without monitoring.coreos.com/v1"
        );
    }
}

#[test]
fn chart_switches() {
    let Some(path) = tools_path() else { return };

    // Monitors: with the API (or forced), not without.
    let with_api = template(&path, &["--api-versions", "monitoring.coreos.com/v1"]);
    let sm = one(&with_api, "ServiceMonitor", "-operator");
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    let pm = one(&with_api, "PodMonitor", "-agent");
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], "http");
    let forced = template(&path, &["--set", "monitoring.force=true"]);
    assert!(has(&forced, "ServiceMonitor") && has(&forced, "PodMonitor"));
    let off = template(
        &path,
        &[
            "--api-versions",
            "monitoring.coreos.com/v1",
            "--set",
            "monitoring.serviceMonitor.enabled=false,monitoring.podMonitor.enabled=false,monitoring.prometheusRule.enabled=false",
        ],
    );
    for k in ["ServiceMonitor", "PodMonitor", "PrometheusRule"] {
        assert!(!has(&off, k), "{k} rendered though disabled");
    }

    // Bundled etcd off → external endpoints in the config, no StatefulSet.
    let ext = template(&path, &["-f", &values("ci/external-etcd-tls-values.yaml")]);
    assert!(!has(&ext, "StatefulSet"));
    assert!(!of_kind(&ext, "NetworkPolicy")
        .iter()
        .any(|d| name(d).ends_with("-etcd")));
    assert!(!of_kind(&ext, "PodDisruptionBudget")
        .iter()
        .any(|d| name(d).ends_with("-etcd")));
    let cfg = agent_config(&ext);
    assert_eq!(cfg["fabric"], "prod-a");
    assert_eq!(strings(&cfg["etcdEndpoints"]).len(), 3);
    assert!(strings(&cfg["etcdEndpoints"])
        .iter()
        .all(|e| e.starts_with("https://")));
    // TLS Secret mounted in agents and operator; the operator may read it.
    for (k, suffix) in [("DaemonSet", "-agent"), ("Deployment", "-operator")] {
        let d = one(&ext, k, suffix);
        let v = volume(d, "etcd-tls").unwrap_or_else(|| panic!("{k}: no etcd-tls volume"));
        assert_eq!(v["secret"]["secretName"], "kvfabric-etcd-client");
        let m = container(d)["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == "etcd-tls")
            .unwrap_or_else(|| panic!("{k}: no etcd-tls mount"));
        assert_eq!(m["mountPath"], "/etc/kvfabric/etcd-tls");
        assert_eq!(m["readOnly"], true);
    }
    // The agents are given the Secret's files as their etcd TLS flags.
    let args = strings(&container(one(&ext, "DaemonSet", "-agent"))["args"]);
    for (flag, file) in [
        ("--etcd-ca-file", "ca.crt"),
        ("--etcd-cert-file", "tls.crt"),
        ("--etcd-key-file", "tls.key"),
    ] {
        let i = args
            .iter()
            .position(|a| a == flag)
            .unwrap_or_else(|| panic!("agent args lack {flag}: {args:?}"));
        assert_eq!(args[i + 1], format!("/etc/kvfabric/etcd-tls/{file}"));
    }
    let role = one(&ext, "Role", "-operator");
    let secret_rule = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["resources"][0] == "secrets")
        .expect("secrets rule with TLS");
    assert_eq!(strings(&secret_rule["verbs"]), ["get"]);
    assert_eq!(
        strings(&secret_rule["resourceNames"]),
        ["kvfabric-etcd-client"]
    );
    // ... and no Secret access without TLS.
    let plain = template(&path, &[]);
    assert!(!one(&plain, "Role", "-operator")["rules"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["resources"][0] == "secrets"));

    // Control key: a Secret of 64 random characters, mounted read-only
    // into the agents, named by their flags; none without a mode; an
    // existing Secret is used as is; a transport other than tcp is refused.
    let auth = template(&path, &["-f", &values("ci/control-auth-values.yaml")]);
    let secret = one(&auth, "Secret", "-control-key");
    let key = secret["data"]["key"].as_str().expect("key in the Secret");
    assert_eq!(key.len(), 88, "base64 of 64 characters: {key}");
    let ds = one(&auth, "DaemonSet", "-agent");
    assert_eq!(
        volume(ds, "control-key").unwrap()["secret"]["secretName"],
        name(secret)
    );
    let m = container(ds)["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "control-key")
        .expect("control-key mount");
    assert_eq!(m["mountPath"], "/etc/kvfabric/control-key");
    assert_eq!(m["readOnly"], true);
    let args = strings(&container(ds)["args"]);
    let at = |flag: &str| args[args.iter().position(|a| a == flag).unwrap() + 1].clone();
    assert_eq!(at("--control-key-file"), "/etc/kvfabric/control-key/key");
    assert_eq!(at("--control-auth"), "required");
    assert!(!has(&template(&path, &[]), "Secret"));
    let theirs = template(
        &path,
        &[
            "-f",
            &values("ci/control-auth-values.yaml"),
            "--set",
            "agent.controlAuth.existingSecret=fabric-key",
        ],
    );
    assert!(!has(&theirs, "Secret"));
    assert_eq!(
        volume(one(&theirs, "DaemonSet", "-agent"), "control-key").unwrap()["secret"]["secretName"],
        "fabric-key"
    );
    let c = chart();
    let zmq = helm(
        &path,
        &[
            "template",
            "t",
            c.to_str().unwrap(),
            "--set",
            "agent.controlAuth.mode=required",
        ],
    );
    let err = String::from_utf8_lossy(&zmq.stderr);
    assert!(
        !zmq.status.success() && err.contains("needs agent.config.bounce.controlTransport: tcp"),
        "{err}"
    );
    let notif = helm(
        &path,
        &[
            "template",
            "t",
            c.to_str().unwrap(),
            "-f",
            &values("ci/control-auth-values.yaml"),
            "--set",
            "agent.config.bounce.useNixlNotifications=true",
        ],
    );
    let err = String::from_utf8_lossy(&notif.stderr);
    assert!(
        !notif.status.success() && err.contains("without useNixlNotifications"),
        "{err}"
    );

    // Host network + RDMA.
    let rdma = template(&path, &["-f", &values("ci/hostnetwork-rdma-values.yaml")]);
    let ds = one(&rdma, "DaemonSet", "-agent");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
    assert_eq!(pod["hostPID"], true);
    assert_eq!(pod["hostIPC"], true);
    assert_eq!(
        volume(ds, "dev-infiniband").unwrap()["hostPath"]["path"],
        "/dev/infiniband"
    );
    let a = container(ds);
    assert_eq!(a["resources"]["limits"]["rdma/rdma_shared_device_a"], 1);
    assert_eq!(a["resources"]["requests"]["rdma/rdma_shared_device_a"], 1);
    assert_eq!(
        a["resources"]["requests"]["memory"], "2Gi",
        "defaults kept beside the RDMA resource"
    );
    assert_eq!(
        env_of(a, "UCX_TLS").unwrap()["value"],
        "rc,cuda_copy,cuda_ipc,sm,self"
    );
    let np = one(&rdma, "NetworkPolicy", "-agent");
    assert_eq!(np["spec"]["ingress"][1]["ports"][0]["port"], 40000);
    assert_eq!(np["spec"]["ingress"][1]["ports"][0]["endPort"], 40999);
    // RDMA resource without the /dev/infiniband mount.
    let dp = template(
        &path,
        &["--set", "agent.rdma.enabled=true,agent.rdma.hostDevInfiniband=false,agent.rdma.resourceName=nvidia.com/hostdev"],
    );
    let ds = one(&dp, "DaemonSet", "-agent");
    assert!(volume(ds, "dev-infiniband").is_none());
    assert_eq!(
        container(ds)["resources"]["limits"]["nvidia.com/hostdev"],
        1
    );

    // CPU-only: every Linux node, no NVIDIA env, host memory, no ptrace,
    // one operator without leader election and hence no PDB and no Role,
    // one etcd member on emptyDir, no NetworkPolicy, no dashboards.
    let cpu = template(
        &path,
        &[
            "-f",
            &values("ci/cpu-only-values.yaml"),
            "--set",
            "monitoring.force=true",
        ],
    );
    let ds = one(&cpu, "DaemonSet", "-agent");
    let pod = &ds["spec"]["template"]["spec"];
    assert!(pod["nodeSelector"].get("nvidia.com/gpu.present").is_none());
    assert!(pod.get("tolerations").is_none());
    let a = container(ds);
    assert!(env_of(a, "NVIDIA_VISIBLE_DEVICES").is_none());
    assert_eq!(caps_added(a), ["IPC_LOCK"]);
    assert!(agent_config(&cpu)["gpu"].is_null());
    assert!(
        !has(&cpu, "PodDisruptionBudget"),
        "PDBs: operator has 1 replica, etcd PDB kept? {:?}",
        of_kind(&cpu, "PodDisruptionBudget")
            .iter()
            .map(|d| name(d))
            .collect::<Vec<_>>()
    );
    let dep = one(&cpu, "Deployment", "-operator");
    assert_eq!(dep["spec"]["replicas"], 1);
    assert!(!strings(&container(dep)["args"]).contains(&"--leader-elect".to_string()));
    assert!(!has(&cpu, "Role") && !has(&cpu, "RoleBinding"));
    let sts = one(&cpu, "StatefulSet", "-etcd");
    assert_eq!(sts["spec"]["replicas"], 1);
    assert!(sts["spec"].get("volumeClaimTemplates").is_none());
    assert!(volume(sts, "data").unwrap()["emptyDir"].is_object());
    assert!(!has(&cpu, "NetworkPolicy"));
    assert!(!of_kind(&cpu, "ConfigMap")
        .iter()
        .any(|d| name(d).contains("dashboard")));

    // PDB switch; replicas > 1 without leader election is refused.
    let nopdb = template(&path, &["--set", "operator.podDisruptionBudget.enabled=false,etcd.bundled.podDisruptionBudget.enabled=false"]);
    assert!(!has(&nopdb, "PodDisruptionBudget"));
    let err = template_in(
        &path,
        &chart(),
        &["--set", "operator.leaderElection.enabled=false"],
    )
    .expect_err("2 replicas without leader election must be refused");
    assert!(
        err.contains("needs operator.leaderElection.enabled=true"),
        "{err}"
    );
    let err = template_in(&path, &chart(), &["--set", "etcd.bundled.enabled=false"])
        .expect_err("no etcd at all must be refused");
    assert!(err.contains("needs etcd.external.endpoints"), "{err}");
    let err = template_in(&path, &chart(), &["--set", "etcd.bundled.replicas=2"])
        .expect_err("an even etcd member count must be refused");
    assert!(err.contains("must be odd"), "{err}");
    let err = template_in(&path, &chart(), &["--set", "agent.config.fabric=x"])
        .expect_err("chart-owned config keys are refused by the schema");
    assert!(err.contains("fabric"), "{err}");

    // NetworkPolicy off; agents or operator off.
    assert!(!has(
        &template(&path, &["--set", "networkPolicy.enabled=false"]),
        "NetworkPolicy"
    ));
    let noop = template(&path, &["--set", "operator.enabled=false"]);
    assert!(!has(&noop, "Deployment") && !has(&noop, "ClusterRole"));
    assert!(!has(
        &template(&path, &["--set", "agent.enabled=false"]),
        "DaemonSet"
    ));
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), &t).unwrap();
        }
    }
}

/// The dashboards and the alerts are read from files another part of the
/// repository owns: the chart renders with them absent and turns each file
/// into its object when present.
#[test]
fn chart_dashboards_and_alerts_from_files() {
    let Some(path) = tools_path() else { return };
    let tmp =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("chart-files-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let c = tmp.join("kvfabric");
    copy_dir(&chart(), &c);
    let _ = std::fs::remove_dir_all(c.join("dashboards"));
    let _ = std::fs::remove_dir_all(c.join("alerts"));
    let api = ["--api-versions", "monitoring.coreos.com/v1"];

    let bare = template_in(&path, &c, &api).expect("renders without dashboards/ and alerts/");
    assert!(!has(&bare, "PrometheusRule"));
    assert!(!of_kind(&bare, "ConfigMap")
        .iter()
        .any(|d| name(d).contains("dashboard")));

    std::fs::create_dir_all(c.join("dashboards")).unwrap();
    std::fs::create_dir_all(c.join("alerts")).unwrap();
    let overview = r#"{"title": "kvfabric overview", "panels": [{"targets": [{"expr": "sum(rate(kvfabric_x_total[5m]))"}]}]}"#;
    std::fs::write(c.join("dashboards/kvfabric-overview.json"), overview).unwrap();
    std::fs::write(
        c.join("dashboards/kvfabric_per_peer.json"),
        r#"{"title": "per peer"}"#,
    )
    .unwrap();
    std::fs::write(c.join("dashboards/notes.txt"), "not a dashboard").unwrap();
    let rules = "groups:\n- name: kvfabric\n  rules:\n  - alert: KvfabricLeaseLost\n    expr: max by (pod) (kvfabric_lease_state) == 0\n    for: 1m\n    labels: {severity: critical}\n    annotations: {summary: \"lease lost on {{ $labels.pod }}\"}\n";
    std::fs::write(c.join("alerts/kvfabric.rules.yaml"), rules).unwrap();

    let full = template_in(&path, &c, &api).expect("renders with the files");
    let cms: Vec<_> = of_kind(&full, "ConfigMap")
        .into_iter()
        .filter(|d| name(d).contains("dashboard"))
        .collect();
    assert_eq!(cms.len(), 2, "one ConfigMap per dashboards/*.json");
    let ov = cms
        .iter()
        .find(|d| name(d) == "t-kvfabric-dashboard-kvfabric-overview")
        .expect("overview");
    assert_eq!(ov["metadata"]["labels"]["grafana_dashboard"], "1");
    let body = ov["data"]["kvfabric-overview.json"].as_str().unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(body).unwrap(),
        serde_json::from_str::<Value>(overview).unwrap()
    );
    assert!(cms
        .iter()
        .any(|d| name(d) == "t-kvfabric-dashboard-kvfabric-per-peer"));
    let pr = one(&full, "PrometheusRule", "t-kvfabric");
    assert_eq!(pr["spec"]["groups"][0]["name"], "kvfabric");
    let r = &pr["spec"]["groups"][0]["rules"][0];
    assert_eq!(r["alert"], "KvfabricLeaseLost");
    assert_eq!(
        r["annotations"]["summary"], "lease lost on {{ $labels.pod }}",
        "Prometheus templates pass through"
    );
    // Without the API (not forced): no PrometheusRule; the label is configurable.
    let other = template_in(
        &path,
        &c,
        &["--set", "monitoring.dashboards.label=my_dash,monitoring.dashboards.labelValue=yes,monitoring.dashboards.namespace=grafana"],
    )
    .unwrap();
    assert!(!has(&other, "PrometheusRule"));
    let d = of_kind(&other, "ConfigMap")
        .into_iter()
        .find(|d| name(d).contains("overview"))
        .unwrap();
    assert_eq!(d["metadata"]["labels"]["my_dash"], "yes");
    assert_eq!(d["metadata"]["namespace"], "grafana");
    assert!(d["metadata"]["labels"].get("grafana_dashboard").is_none());
    // A rules file that does not parse fails the render, naming it.
    std::fs::write(c.join("alerts/kvfabric.rules.yaml"), "groups: [\n").unwrap();
    let err = template_in(&path, &c, &api).expect_err("broken rules file");
    assert!(err.contains("alerts/kvfabric.rules.yaml"), "{err}");

    // And the repository's own files, whatever is there now, render.
    let real = template(&path, &api);
    let n_json = std::fs::read_dir(chart().join("dashboards"))
        .map(|r| {
            r.filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "json")
            })
            .count()
        })
        .unwrap_or(0);
    let n_cm = of_kind(&real, "ConfigMap")
        .iter()
        .filter(|d| name(d).contains("-dashboard-"))
        .count();
    assert_eq!(n_cm, n_json);
    assert_eq!(
        has(&real, "PrometheusRule"),
        chart().join("alerts/kvfabric.rules.yaml").is_file()
    );
    println!(
        "repository: {n_json} dashboard(s), PrometheusRule: {}",
        has(&real, "PrometheusRule")
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The rendered config and flags are accepted by the real agent
/// (`kvfabric agent ... --print-config`), for every values variant.
#[test]
fn chart_agent_config_accepted_by_agent() {
    let Some(path) = tools_path() else { return };
    let Some(bin) = kvfabric_bin() else {
        skip("target/<profile>/kvfabric not built (cargo build -p kvfabric-agent --bin kvfabric)");
        return;
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("chart-agent-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut variants: Vec<(String, Vec<String>)> = vec![("defaults".into(), vec![])];
    for f in CI_VALUES {
        variants.push((f.into(), vec!["-f".into(), values(f)]));
    }
    for (label, extra) in &variants {
        let args: Vec<&str> = extra.iter().map(String::as_str).collect();
        let docs = template(&path, &args);
        let cfg0 = agent_config(&docs);
        // Every agent DaemonSet (one per GPU with agent.gpu.count > 1).
        for ds in of_kind(&docs, "DaemonSet") {
            let c = container(ds);
            let mut cfg = cfg0.clone();
            // The container's args with the downward-API variables the
            // kubelet substitutes, and the config at a local path.
            let file = dir.join("config.yaml");
            // The control key Secret's file, as mounted.
            let key = dir.join("control.key");
            std::fs::write(&key, "k".repeat(64)).unwrap();
            let mut argv: Vec<String> = strings(&c["args"])
                .into_iter()
                .map(|a| match a.as_str() {
                    "/etc/kvfabric/config.yaml" => file.to_string_lossy().into_owned(),
                    "/etc/kvfabric/control-key/key" => key.to_string_lossy().into_owned(),
                    _ => a
                        .replace("$(POD_NAME)", "kvfabric-agent-x1")
                        .replace("$(POD_UID)", "0f4c5e7a-1111-2222-3333-444455556666"),
                })
                .collect();
            let run = |cfg: &Value, argv: &[String]| {
                std::fs::write(&file, serde_yaml::to_string(cfg).unwrap()).unwrap();
                Command::new(&bin)
                    .args(argv)
                    .arg("--print-config")
                    .output()
                    .expect("run kvfabric")
            };
            let mut out = run(&cfg, &argv);
            if !out.status.success() && !cfg["gpu"].is_null() {
                // This build has no `cuda` feature (the image's has): only the
                // GPU ordinal may be refused, for that reason.
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(
                    err.contains("this build has no GPU support")
                        && !err.contains("engineSocket")
                        && !err.contains("requireDeviceUuid"),
                    "{label}: only the GPU may be refused: {err}"
                );
                println!(
                    "{label}: gpu {} needs a cuda build; checking the rest without it",
                    cfg["gpu"]
                );
                cfg["gpu"] = Value::Null;
                // Without a GPU the socket cannot name one: a stand-in UUID.
                if let Some(i) = argv.iter().position(|a| a == "--gpu") {
                    argv.drain(i..i + 2);
                }
                // ... and no GPU UUID to require.
                argv.retain(|a| a != "--require-device-uuid");
                for a in argv.iter_mut() {
                    *a = a.replace("{gpu_uuid}", "5a2b1c3d-0e4f-4a1b-9c8d-7e6f5a4b3c2d");
                }
                out = run(&cfg, &argv);
            }
            assert!(
                out.status.success(),
                "{label}: kvfabric agent refused the chart's config:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let eff = parse_docs(&String::from_utf8_lossy(&out.stdout)).remove(0);
            // Flags override the file (one agent per GPU: port and socket).
            let mut want = cfg.clone();
            for (flag, key) in [("--listen", "listen"), ("--engine-socket", "engineSocket")] {
                if let Some(i) = argv.iter().position(|a| a == flag) {
                    want[key] = Value::String(argv[i + 1].clone());
                }
            }
            for k in [
                "fabric",
                "listen",
                "engineSocket",
                "etcdEndpoints",
                "role",
                "leaseTtlSeconds",
            ] {
                assert_eq!(eff[k], want[k], "{label}: {k}");
            }
            assert_eq!(eff["logicalId"], "kvfabric-agent-x1");
            let required = argv.iter().any(|a| a == "--require-device-uuid");
            assert_eq!(eff["requireDeviceUuid"], required, "{label}");
            assert_eq!(eff["podUid"], "0f4c5e7a-1111-2222-3333-444455556666");
            for (k, v) in cfg["bounce"].as_object().unwrap() {
                assert_eq!(&eff["bounce"][k], v, "{label}: bounce.{k}");
            }
        }
        println!("ok {label}: agent accepts the chart's config and flags");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `agent.gpu.count: 8` (ci/multi-gpu-values.yaml): one agent DaemonSet
/// per GPU (own pods, so the operator judges each GPU's agent on its own)
/// — its own ordinal, selector label, HTTP port (probes on it by name), the
/// socket named after its GPU's UUID and `--require-device-uuid`; the
/// NetworkPolicy admits the port range. With count 1 (the default): one
/// DaemonSet `-agent` as before.
#[test]
fn chart_one_agent_per_gpu() {
    let Some(path) = tools_path() else { return };
    let docs = template(
        &path,
        &[
            "-f",
            &values("ci/multi-gpu-values.yaml"),
            "--api-versions",
            "monitoring.coreos.com/v1",
        ],
    );
    let sets = of_kind(&docs, "DaemonSet");
    assert_eq!(sets.len(), 8);
    for (k, ds) in sets.iter().enumerate() {
        let ds = *ds;
        assert!(
            name(ds).ends_with(&format!("-agent-gpu{k}")),
            "{}",
            name(ds)
        );
        let sel = &ds["spec"]["selector"]["matchLabels"];
        assert_eq!(sel["kvfabric.io/gpu-index"], k.to_string());
        assert_eq!(
            ds["spec"]["template"]["metadata"]["labels"]["kvfabric.io/gpu-index"],
            k.to_string()
        );
        assert_eq!(sel["app.kubernetes.io/component"], "agent");
        let cs = ds["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap();
        assert_eq!(cs.len(), 1);
        let c = &cs[0];
        let args = strings(&c["args"]);
        let flag = |f: &str| {
            let i = args
                .iter()
                .position(|a| a == f)
                .unwrap_or_else(|| panic!("{f} in {args:?}"));
            args[i + 1].clone()
        };
        assert_eq!(flag("--gpu"), k.to_string());
        assert_eq!(flag("--logical-id"), "$(POD_NAME)");
        assert_eq!(flag("--listen"), format!("0.0.0.0:{}", 9400 + k));
        assert_eq!(flag("--engine-socket"), "/run/kvfabric/{gpu_uuid}.sock");
        assert!(args.iter().any(|a| a == "--require-device-uuid"));
        let port = &c["ports"][0];
        assert_eq!(port["name"], "http");
        assert_eq!(port["containerPort"], 9400 + k as u64);
        for p in ["livenessProbe", "readinessProbe", "startupProbe"] {
            assert_eq!(c[p]["httpGet"]["port"], "http", "{p}");
        }
        assert_eq!(env_of(c, "NVIDIA_VISIBLE_DEVICES").unwrap()["value"], "all");
    }
    // GPU k's agent only where the node has more than k GPUs.
    for (k, ds) in sets.iter().enumerate() {
        let aff = &ds["spec"]["template"]["spec"]["affinity"];
        if k == 0 {
            assert!(aff.is_null(), "gpu0: {aff}");
            continue;
        }
        let terms = &aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        assert_eq!(
            terms,
            &serde_json::json!([{"matchExpressions": [
                {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": [k.to_string()]}
            ]}]),
            "gpu{k}"
        );
        let env = env_of(container(ds), "CUDA_DEVICE_ORDER").unwrap();
        assert_eq!(env["value"], "PCI_BUS_ID");
    }
    // ... added to a user's own node terms (AND), not replacing them.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("chart-gpu-aff-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let user = dir.join("values.yaml");
    std::fs::write(
        &user,
        "agent:\n  gpu: {count: 2}\n  affinity:\n    nodeAffinity:\n      requiredDuringSchedulingIgnoredDuringExecution:\n        nodeSelectorTerms:\n          - matchExpressions: [{key: zone, operator: In, values: [a]}]\n          - matchExpressions: [{key: zone, operator: In, values: [b]}]\n",
    )
    .unwrap();
    let merged = template(&path, &["-f", user.to_str().unwrap()]);
    let ds1 = one(&merged, "DaemonSet", "-agent-gpu1");
    let terms = &ds1["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
    for (i, zone) in ["a", "b"].iter().enumerate() {
        assert_eq!(
            terms[i]["matchExpressions"],
            serde_json::json!([
                {"key": "zone", "operator": "In", "values": [zone]},
                {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["1"]}
            ])
        );
    }
    let ds0 = one(&merged, "DaemonSet", "-agent-gpu0");
    assert_eq!(
        ds0["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
            ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
            ["matchExpressions"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let _ = std::fs::remove_dir_all(&dir);
    // Refused: one agent per GPU without GPUs, ports past 65535.
    for (set, says) in [
        (
            "agent.gpu.count=2,agent.gpu.enabled=false",
            "needs agent.gpu.enabled=true",
        ),
        ("agent.gpu.count=2,agent.httpPort=65535", "above 65535"),
    ] {
        let e = template_in(&path, &chart(), &["--set", set]).unwrap_err();
        assert!(e.contains(says), "{set}: {e}");
    }
    // Each DaemonSet's selector picks only its own pods.
    let selectors: std::collections::BTreeSet<String> = sets
        .iter()
        .map(|d| d["spec"]["selector"]["matchLabels"].to_string())
        .collect();
    assert_eq!(selectors.len(), 8);
    let pm = one(&docs, "PodMonitor", "-agent");
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], "http");
    let np = one(&docs, "NetworkPolicy", "-agent");
    let http = &np["spec"]["ingress"][0]["ports"][0];
    assert_eq!(
        (http["port"].as_u64(), http["endPort"].as_u64()),
        (Some(9400), Some(9407))
    );

    // Count 1: unchanged.
    let docs = template(&path, &[]);
    let ds = one(&docs, "DaemonSet", "-agent");
    assert_eq!(of_kind(&docs, "DaemonSet").len(), 1);
    assert!(ds["spec"]["selector"]["matchLabels"]
        .get("kvfabric.io/gpu-index")
        .is_none());
    let c = container(ds);
    let args = strings(&c["args"]);
    assert!(!args
        .iter()
        .any(|a| a == "--gpu" || a == "--engine-socket" || a == "--require-device-uuid"));
    assert_eq!(c["ports"][0]["containerPort"], 9400);
    let np = one(&docs, "NetworkPolicy", "-agent");
    assert!(np["spec"]["ingress"][0]["ports"][0]
        .get("endPort")
        .is_none());
    // A bad count is refused by the schema.
    let bad = template_in(&path, &chart(), &["--set", "agent.gpu.count=0"]).unwrap_err();
    assert!(bad.contains("count"), "{bad}");
}
