//! The `kvfabric` binary on bad arguments: every input that used to panic
//! (exit 101) is now a usage error (exit 2, clap) or a checked error
//! (exit 1) whose message names the argument, found before any work
//! starts; and output to a pipe carries no colour codes.
//!
//! Nothing here starts an agent: each case fails before memory is
//! allocated or NIXL is loaded, so these run anywhere.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// A scratch directory for one test, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvfabric-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// A trace of one request per entry of `tokens` (prompt tokens).
    fn trace(&self, tokens: &[u64]) -> PathBuf {
        let p = self.0.join("trace.jsonl");
        let text: String = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                format!(
                    "{{\"timestamp\": {}, \"input_length\": {t}, \"output_length\": 1, \"hash_ids\": []}}\n",
                    i * 10
                )
            })
            .collect();
        std::fs::write(&p, text).unwrap();
        p
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn kvfabric(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvfabric"))
        .args(args)
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .output()
        .expect("run kvfabric")
}

/// Runs `kvfabric ARGS` and checks it exits with `code` (never 101, a
/// panic) and that stderr names `flag`.
fn fails_naming(args: &[&str], code: i32, flag: &str) -> String {
    let out = kvfabric(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_ne!(out.status.code(), Some(101), "{args:?} panicked:\n{err}");
    assert_eq!(out.status.code(), Some(code), "{args:?}:\n{err}");
    assert!(
        err.contains(flag),
        "{args:?}: stderr does not name {flag}:\n{err}"
    );
    assert!(!err.contains("panicked"), "{args:?}:\n{err}");
    assert!(
        !err.contains('\u{1b}'),
        "{args:?}: colour codes on a pipe:\n{err:?}"
    );
    err
}

fn json_arg(s: &Scratch) -> String {
    s.path("report.json").display().to_string()
}

#[test]
fn bench_inputs_that_used_to_panic_are_usage_errors_naming_the_flag() {
    for (args, flag) in [
        (&["--speed", "0"][..], "--speed"),
        (&["--speed", "nan"], "--speed"),
        (&["--speed=-1"], "--speed"),
        (&["--speed", "inf"], "--speed"),
        (&["--rate", "0"], "--rate"),
        (&["--rate", "nan"], "--rate"),
        (&["--rate=-1"], "--rate"),
        (&["--rate", "13", "--speed", "2"], "--speed"),
        (&["--fixed-prompt", "0"], "--fixed-prompt"),
        (&["--fixed-prompt", "8192", "--speed", "2"], "--speed"),
        (&["--geometry", "0,0,0,0"], "--geometry"),
        (&["--geometry", "32,8,128"], "--geometry"),
        (&["--concurrency", "0"], "--concurrency"),
        (&["--concurrency", "999999999"], "--concurrency"),
        (&["--requests", "0"], "--requests"),
        (&["--tp", "0"], "--tp"),
        (&["--block", "0"], "--block"),
        (&["--pool", "0"], "--pool"),
        (&["--paths", "both"], "--paths"),
        (&["--wait", "99999999999999999999"], "--wait"),
    ] {
        let mut v = vec!["bench"];
        v.extend_from_slice(args);
        fails_naming(&v, 2, flag);
    }
}

#[test]
fn bench_checks_name_the_argument_before_the_run() {
    let s = Scratch::new("bench");
    let trace = s.trace(&[100, 2000, 0, 50]);
    let trace = trace.to_str().unwrap();
    let json = json_arg(&s);
    // An unwritable report path is found first, not after the run.
    let missing = s.path("no/such/dir/report.json");
    let e = fails_naming(
        &[
            "bench",
            "--trace",
            trace,
            "--json",
            missing.to_str().unwrap(),
        ],
        1,
        "--json",
    );
    assert!(e.contains("no/such/dir"), "{e}");
    fails_naming(
        &["bench", "--trace", trace, "--json", s.0.to_str().unwrap()],
        1,
        "--json",
    );
    // A pool too small for the slice names --pool (there is no
    // --pool-blocks flag).
    let e = fails_naming(
        &["bench", "--trace", trace, "--json", &json, "--pool", "1MiB"],
        1,
        "--pool",
    );
    assert!(!e.contains("--pool-blocks"), "{e}");
    assert!(e.contains("request 1 "), "the 2000-token request: {e}");
    let e = fails_naming(
        &["bench", "--trace", trace, "--json", &json, "--pool", "1KiB"],
        1,
        "--pool",
    );
    assert!(e.contains("less than one KV block"), "{e}");
    // A slice past the end of the trace names --start.
    fails_naming(
        &["bench", "--trace", trace, "--json", &json, "--start", "99"],
        1,
        "--start",
    );
    // Only 0-token requests: nothing to move, said so.
    let empty = s.trace(&[0, 0]);
    let e = fails_naming(
        &["bench", "--trace", empty.to_str().unwrap(), "--json", &json],
        1,
        "--requests",
    );
    assert!(e.contains("prompt tokens"), "{e}");
    // A tensor parallelism that does not divide the KV heads.
    fails_naming(
        &["bench", "--trace", trace, "--json", &json, "--tp", "3"],
        1,
        "--tp",
    );
    // A missing trace names --trace.
    fails_naming(
        &[
            "bench",
            "--trace",
            s.path("nope.jsonl").to_str().unwrap(),
            "--json",
            &json,
        ],
        1,
        "--trace",
    );
    assert!(
        !s.path("report.json").exists(),
        "no report left by a failed start"
    );
}

#[test]
fn dataplane_bench_and_agent_flags_are_checked() {
    let s = Scratch::new("dp");
    for (args, code, flag) in [
        (&["dataplane-bench", "--sizes", "0"][..], 2, "--sizes"),
        (&["dataplane-bench", "--total", "0"], 2, "--total"),
        (&["dataplane-bench", "--iterations", "0"], 2, "--iterations"),
        (&["dataplane-bench", "--inflight", "0"], 2, "--inflight"),
        (&["dataplane-bench", "--chunk", "0"], 2, "--chunk"),
        (
            &["dataplane-bench", "--sizes", "1MiB", "--total", "64KiB"],
            1,
            "--sizes",
        ),
        (
            &["dataplane-bench", "--sizes", "1", "--total", "1GiB"],
            1,
            "--sizes",
        ),
        (&["agent", "--lease-ttl", "0"], 2, "--lease-ttl"),
        (
            &["agent", "--lease-ttl", "18446744073709551615"],
            2,
            "--lease-ttl",
        ),
        (&["agent", "--pool-size", "0"], 2, "--pool-size"),
    ] {
        fails_naming(args, code, flag);
    }
    let missing = s.path("no/such/dir/dp.json");
    fails_naming(
        &["dataplane-bench", "--json", missing.to_str().unwrap()],
        1,
        "--json",
    );
}

/// `kvfabric agent --print-config` with a byte size it cannot read logs a
/// config error line: `(stderr of a pipe, output through a terminal)`.
fn config_error_output(no_color: Option<&str>) -> (String, Option<String>) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfabric"));
    cmd.args(["agent", "--print-config", "--log-format", "text"])
        .env("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "lots")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null());
    if let Some(v) = no_color {
        cmd.env("NO_COLOR", v);
    }
    let piped = String::from_utf8_lossy(&cmd.output().expect("run kvfabric").stderr).into_owned();
    // `script` runs the command on a pseudo-terminal (util-linux).
    let exe = Path::new(env!("CARGO_BIN_EXE_kvfabric"));
    let mut tty = Command::new("script");
    tty.args(["-qec"])
        .arg(format!(
            "'{}' agent --print-config --log-format text",
            exe.display()
        ))
        .arg("/dev/null")
        .env("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "lots")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null());
    if let Some(v) = no_color {
        tty.env("NO_COLOR", v);
    }
    let on_tty = tty
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    (piped, on_tty)
}

#[test]
fn logs_are_coloured_only_on_a_terminal_without_no_color() {
    let (piped, tty) = config_error_output(None);
    assert!(
        piped.contains("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES"),
        "the config error is logged: {piped}"
    );
    assert!(
        !piped.contains('\u{1b}'),
        "colour codes on a pipe: {piped:?}"
    );
    let Some(tty) = tty else {
        eprintln!("SKIP: no `script` to run the agent on a pseudo-terminal");
        return;
    };
    assert!(tty.contains('\u{1b}'), "a terminal gets colour: {tty:?}");
    let (_, tty) = config_error_output(Some("1"));
    let tty = tty.expect("script ran before");
    assert!(tty.contains("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES"), "{tty}");
    assert!(!tty.contains('\u{1b}'), "NO_COLOR=1 on a terminal: {tty:?}");
}
