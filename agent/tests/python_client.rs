//! The Python client's test suite (agent/python, pytest) run as part of
//! `cargo test`, against the real `kvfabric` binary this build produced and
//! a real etcd: attach, transfer byte-exact, await, cancel, engine death in
//! a subprocess, agent restart with re-attach, TP 1 → TP 4, mismatched
//! layouts, bad requests. `agent/python/run-tests.sh` creates the venv
//! (`.venv`, pip from PyPI) and checks the generated stubs are current.
//!
//! Without python3 / venv the test prints SKIP (fails under `.ci/run`,
//! which installs them: `KVFABRIC_REQUIRE_SERVICES`).

mod common;

use std::process::Command;

#[test]
fn python_client_suite_passes_against_real_agents() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let venv_ok = Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .status()
        .is_ok_and(|s| s.success());
    if !venv_ok {
        common::skip("python3 with venv/ensurepip not installed (Debian python3-venv)");
        return;
    }
    let out = Command::new(repo.join("agent/python/run-tests.sh"))
        .current_dir(&repo)
        .env("KVFABRIC_BIN", env!("CARGO_BIN_EXE_kvfabric"))
        .output()
        .expect("run agent/python/run-tests.sh");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let tail: String = text
        .lines()
        .rev()
        .take(80)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    // The failing tests' names (pytest's summary lines), whatever scrolled.
    let failed: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.starts_with("FAILED")
                || l.starts_with("ERROR")
                || l.contains("::") && l.contains(" FAILED")
        })
        .collect();
    assert!(out.status.success(), "pytest failed: {failed:#?}\n{tail}");
    assert!(text.contains(" passed"), "no tests ran:\n{tail}");
    assert!(!text.contains(" failed"), "{tail}");
    eprintln!("{}", text.lines().last().unwrap_or(""));
}
