//! Issue 13's CPU variant, under `cargo test`: a Llama-architecture model
//! (built from a config with a fixed seed; nothing downloaded) runs a
//! prompt on a prefill engine, its paged KV cache goes through two real
//! agents (host shm pools, bounce), and the decode engine continues greedy
//! decoding: every step's logits must be bit-identical to the same model
//! decoding in one process (64 steps, a single prompt and a batch), and
//! the negative control (one byte flipped) must differ.
//!
//! Runs `e2e/model/handoff.py --host-pools --device cpu` with the venv of
//! `e2e/model/install-venv.sh` (torch + transformers, cached outside the
//! repository; `e2e/setup.sh --tests` builds it). Without that venv the
//! test prints SKIP (fails under `.ci/run`: `KVFABRIC_REQUIRE_SERVICES`).

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Bound on the whole run (model builds, references, the hand-offs).
const RUN_BOUND: Duration = Duration::from_secs(900);

#[test]
fn a_real_models_kv_hands_off_bit_identically_on_cpu() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // KVFABRIC_MODEL_PYTHON, or a venv install-venv.sh finished building
    // (never built here: that takes minutes).
    let python = std::env::var("KVFABRIC_MODEL_PYTHON").ok().or_else(|| {
        let cache = std::env::var("XDG_CACHE_HOME")
            .map(std::path::PathBuf::from)
            .or_else(|_| std::env::var("HOME").map(|h| std::path::Path::new(&h).join(".cache")))
            .ok()?;
        std::fs::read_dir(cache.join("kvfabric"))
            .ok()?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("model-venv-"))
                    && p.join(".complete").exists()
            })
            .map(|p| p.join("bin/python").to_string_lossy().into_owned())
            .next()
    });
    let Some(python) = python else {
        common::skip("the model venv (torch + transformers) is not built: run e2e/model/install-venv.sh (e2e/setup.sh --tests does)");
        return;
    };
    let Some(etcd) = common::etcd::etcd_bin() else {
        common::skip("etcd not installed");
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvf-model-cpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("report.json");
    let t0 = Instant::now();
    let mut child = Command::new(&python)
        .current_dir(&repo)
        .args([
            "e2e/model/handoff.py",
            "--bin",
            env!("CARGO_BIN_EXE_kvfabric"),
            "--etcd",
        ])
        .arg(&etcd)
        .arg("--out")
        .arg(&out)
        .args([
            "--host-pools",
            "--device",
            "cpu",
            "--attn",
            "eager",
            "--cases",
            "517;300,517",
            "--steps",
            "64",
            "--layers",
            "2",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--intermediate",
            "512",
            "--vocab",
            "1024",
            "--max-positions",
            "2048",
            "--ref-procs",
            "1",
            "--repeats",
            "1",
        ])
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::from(
            std::fs::File::create(dir.join("run.log")).unwrap(),
        ))
        .stderr(Stdio::from(
            std::fs::File::create(dir.join("run.err")).unwrap(),
        ))
        .spawn()
        .expect("start e2e/model/handoff.py");
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > RUN_BOUND {
            let _ = child.kill();
            let _ = child.wait();
            panic!("handoff.py did not finish within {RUN_BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let log = std::fs::read_to_string(dir.join("run.log")).unwrap_or_default()
        + &std::fs::read_to_string(dir.join("run.err")).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(40).collect();
    let tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
    println!("handoff.py: {status} after {:?}\n{tail}", t0.elapsed());
    assert!(status.success(), "handoff.py failed:\n{tail}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("report")).expect("JSON");
    assert_eq!(report["ok"], true, "{tail}");
    // A run whose every case passed leaves no work dir behind (it was
    // ~60 MB in the temp dir per run).
    if report["ok_all"] == true {
        let wd = report["workdir"].as_str().expect("workdir");
        assert!(
            !std::path::Path::new(wd).exists(),
            "work dir {wd} left behind"
        );
    }
    let cases = report["cases"].as_array().expect("cases");
    let (mut identical, mut negatives) = (0, 0);
    for c in cases {
        let negative = c["negative_control"].as_bool().unwrap();
        for r in c["requests"].as_array().unwrap() {
            assert!(r["steps"].as_u64().unwrap() >= 64, "{r}");
            assert_eq!(r["path"], "bounce", "{r}");
            if negative {
                assert_eq!(
                    r["bit_identical"], false,
                    "the negative control matched: {r}"
                );
                negatives += 1;
            } else {
                assert_eq!(r["bit_identical"], true, "logits differ: {}", c["case"]);
                assert_eq!(r["kv_identical"], true, "{}", c["case"]);
                identical += 1;
            }
        }
    }
    // One single prompt and a batch of two, then the negative control.
    assert_eq!((identical, negatives), (3, 1), "cases: {cases:#?}");
    let _ = std::fs::remove_dir_all(&dir);
}
