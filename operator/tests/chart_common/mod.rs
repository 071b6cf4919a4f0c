//! Shared by the chart suites (chart_template.rs, chart_kube.rs): the
//! cached helm/kubectl of e2e/kube/install.sh, `helm template` into parsed
//! documents, small accessors over them, and the SKIP rule (SKIP without
//! the tools; fail instead under `KVFABRIC_REQUIRE_SERVICES=1`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde::Deserialize;
use serde_json::Value;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repo root")
}

pub fn chart() -> PathBuf {
    repo().join("charts/kvfabric")
}

/// The values files the suites render besides the defaults.
pub const CI_VALUES: [&str; 5] = [
    "ci/external-etcd-tls-values.yaml",
    "ci/control-auth-values.yaml",
    "ci/hostnetwork-rdma-values.yaml",
    "ci/cpu-only-values.yaml",
    "ci/multi-gpu-values.yaml",
];

pub fn required() -> bool {
    std::env::var("KVFABRIC_REQUIRE_SERVICES").as_deref() == Ok("1")
}

/// SKIP (or, under KVFABRIC_REQUIRE_SERVICES=1, fail) with `why`.
pub fn skip(why: &str) {
    if required() {
        panic!("required service missing: {why}");
    }
    println!("SKIP: {why}");
}

/// PATH entries of the cached tools (kubectl, etcd, kwok, helm), or None
/// (after skip()) when e2e/kube/install.sh has not built them.
pub fn tools_path() -> Option<String> {
    let out = Command::new(repo().join("e2e/kube/install.sh"))
        .arg("--path")
        .stderr(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let p = String::from_utf8_lossy(&o.stdout).trim().to_string();
            let helm = p
                .split(':')
                .map(|d| Path::new(d).join("helm"))
                .find(|h| h.is_file());
            if helm.is_none() {
                skip("helm not in the tools cache (run e2e/kube/install.sh)");
                return None;
            }
            Some(p)
        }
        _ => {
            skip("helm/kubectl not installed (run e2e/kube/install.sh)");
            None
        }
    }
}

/// Runs helm (from `path`) with `args`; the output, whatever the status.
pub fn helm(path: &str, args: &[&str]) -> Output {
    Command::new("helm")
        .args(args)
        .env(
            "PATH",
            format!("{path}:{}", std::env::var("PATH").unwrap_or_default()),
        )
        .stdin(Stdio::null())
        .output()
        .expect("run helm")
}

/// `helm template t <chart> -n kvf <args>`: the documents as JSON values,
/// or the error text.
pub fn template_in(path: &str, chart: &Path, args: &[&str]) -> Result<Vec<Value>, String> {
    let chart = chart.to_str().expect("utf-8 path");
    let mut a = vec!["template", "t", chart, "--namespace", "kvf"];
    a.extend_from_slice(args);
    let out = helm(path, &a);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(parse_docs(&String::from_utf8_lossy(&out.stdout)))
}

pub fn template(path: &str, args: &[&str]) -> Vec<Value> {
    template_in(path, &chart(), args).unwrap_or_else(|e| panic!("helm template {args:?}: {e}"))
}

/// Multi-document YAML → JSON values (empty documents dropped).
pub fn parse_docs(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| {
            let y = serde_yaml::Value::deserialize(d).expect("rendered YAML parses");
            serde_json::to_value(y).expect("YAML → JSON")
        })
        .filter(|v| !v.is_null())
        .collect()
}

pub fn kind(d: &Value) -> &str {
    d["kind"].as_str().unwrap_or("")
}

pub fn name(d: &Value) -> &str {
    d["metadata"]["name"].as_str().unwrap_or("")
}

/// Documents of kind `k`.
pub fn of_kind<'a>(docs: &'a [Value], k: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| kind(d) == k).collect()
}

/// The single document of kind `k` whose name ends with `suffix`.
pub fn one<'a>(docs: &'a [Value], k: &str, suffix: &str) -> &'a Value {
    let v: Vec<_> = docs
        .iter()
        .filter(|d| kind(d) == k && name(d).ends_with(suffix))
        .collect();
    assert_eq!(
        v.len(),
        1,
        "expected one {k} named *{suffix}, found {:?}",
        v.iter().map(|d| name(d)).collect::<Vec<_>>()
    );
    v[0]
}

pub fn has(docs: &[Value], k: &str) -> bool {
    docs.iter().any(|d| kind(d) == k)
}

/// The first container of a workload's pod template.
pub fn container(d: &Value) -> &Value {
    &d["spec"]["template"]["spec"]["containers"][0]
}

pub fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|x| match x {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The `kvfabric` binary of this build profile (target/<profile>/kvfabric).
pub fn kvfabric_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?;
    let p = dir.join("kvfabric");
    p.is_file().then_some(p)
}
