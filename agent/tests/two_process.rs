//! Two separate OS processes over real NIXL: the `kvfabric dataplane-bench`
//! parent (sender) spawns a `kvfabric peer` child (receiver); 2 MiB moves as
//! 4 KiB random slots through the standard path, bounce and one descriptor,
//! and the child verifies every byte of every transfer (a mismatch makes
//! the bench exit non-zero).

mod common;

use std::process::Command;

#[test]
fn bounce_between_two_processes_is_byte_exact() {
    let nixl = kvfabric_agent::runtime::nixl_runtime::ensure_loaded();
    if let Err(e) = nixl {
        common::skip(&format!("NIXL runtime not available: {e}"));
        return;
    }
    let json = std::env::temp_dir().join(format!("kvfabric-2p-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args([
            "dataplane-bench",
            "--total",
            "2MiB",
            "--sizes",
            "4KiB,64KiB",
            "--iterations",
            "2",
            "--chunk",
            "256KiB",
            "--inflight",
            "4",
            "--arena",
            "4MiB",
            "--json",
        ])
        .arg(&json)
        .output()
        .expect("run kvfabric dataplane-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "bench failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 6, "3 paths x 2 sizes: {rows:?}");
    for r in rows {
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["gbps"].as_f64().unwrap() > 0.0, "{r}");
    }
    let paths: Vec<&str> = rows.iter().map(|r| r["path"].as_str().unwrap()).collect();
    assert!(paths.contains(&"bounce") && paths.contains(&"standard"));
    let _ = std::fs::remove_file(&json);
}
