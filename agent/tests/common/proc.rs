//! Child processes for the multi-process tests: a [`Proc`] killed and
//! reaped on drop, and an [`Agent`] — a real `kvfabric agent` daemon with
//! its announced HTTP address and its stderr.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A child process killed (and reaped) on drop unless already waited for.
pub struct Proc {
    pub child: Option<Child>,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Waits at most `bound` for the exit; kills it and returns `None` past
    /// the bound.
    pub fn wait_for(&mut self, bound: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + bound;
        let child = self.child.as_mut()?;
        loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                self.child = None;
                return Some(s);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                self.child = None;
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A running `kvfabric agent` with its announced address and stderr.
pub struct Agent {
    pub proc: Proc,
    pub addr: Receiver<SocketAddr>,
    pub stderr: Option<JoinHandle<String>>,
}

impl Agent {
    /// `kvfabric agent` for `logical` (role `role`) in `fabric` at `etcd`:
    /// 64 MiB pool, 16 MiB arena, loopback, lease TTL 5 s, debug API on.
    pub fn spawn(etcd: &str, fabric: &str, logical: &str, role: &str) -> Self {
        Self::spawn_with(etcd, fabric, logical, role, &[], &[])
    }

    /// [`Agent::spawn`] with extra flags and environment variables (later
    /// ones win).
    pub fn spawn_with(
        etcd: &str,
        fabric: &str,
        logical: &str,
        role: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn_opts(etcd, fabric, logical, role, args, env, true)
    }

    /// [`Agent::spawn_with`], with `--debug-api` only when `debug_api`
    /// (without it the `/v1/debug/*` endpoints do not exist).
    pub fn spawn_opts(
        etcd: &str,
        fabric: &str,
        logical: &str,
        role: &str,
        args: &[&str],
        env: &[(&str, &str)],
        debug_api: bool,
    ) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfabric"))
            .args([
                "agent",
                "--etcd",
                etcd,
                "--fabric",
                fabric,
                "--logical-id",
                logical,
                "--role",
                role,
                "--listen",
                "127.0.0.1:0",
                "--pool-size",
                "64MiB",
                "--control-bind",
                "loopback",
                "--lease-ttl",
                "5",
            ])
            .args(debug_api.then_some("--debug-api"))
            .args(args)
            .env("KVFABRIC_BOUNCE_ENABLE", "1")
            .env("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "16MiB")
            .env(
                "KVFABRIC_BOUNCE_ARENA_ALLOCATION_GRANULARITY_BYTES",
                "64KiB",
            )
            .env("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", "2MiB")
            .env("KVFABRIC_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvfabric agent");
        let stdout = child.stdout.take().unwrap();
        let (tx, addr) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(a) = line.split("listening on http://").nth(1) {
                    if let Ok(a) = a.trim().parse() {
                        let _ = tx.send(a);
                    }
                }
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Self {
            proc: Proc { child: Some(child) },
            addr,
            stderr: Some(stderr),
        }
    }

    /// Kills the agent (if running) and returns its stderr.
    pub fn kill_and_log(&mut self) -> String {
        self.proc.wait_for(Duration::ZERO);
        self.stderr
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default()
    }

    /// SIGTERM, then the exit status (≤ 20 s) and stderr.
    pub fn terminate(&mut self) -> (Option<ExitStatus>, String) {
        // SAFETY: plain kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.proc.pid() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill(SIGTERM)");
        let status = self.proc.wait_for(Duration::from_secs(20));
        let log = self
            .stderr
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        (status, log)
    }
}
