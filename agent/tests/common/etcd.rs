//! A single-member etcd for the discovery tests: free loopback ports, its
//! own data dir, stop/restart/wipe, and a plain client for "external actor"
//! steps. Shared by `discovery_etcd` and `distributed_bench`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvfabric_agent::service::discovery::Incarnation;

use super::init_tracing;

/// A single-member etcd on free loopback ports with its own data dir.
pub struct Etcd {
    pub bin: PathBuf,
    pub dir: PathBuf,
    pub client_port: u16,
    pub peer_port: u16,
    pub child: Option<Child>,
}

pub fn etcd_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVFABRIC_ETCD_BIN") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let p = PathBuf::from("/usr/bin/etcd");
        p.is_file().then_some(p)
    })
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    /// Starts etcd, or `None` (after printing SKIP) when it is not installed.
    pub fn start(test: &str) -> Option<Self> {
        init_tracing();
        let Some(bin) = etcd_bin() else {
            super::skip("etcd not installed");
            return None;
        };
        let dir = std::env::temp_dir().join(format!(
            "kvfabric-etcd-{test}-{}-{}",
            std::process::id(),
            Incarnation::generate()
        ));
        let mut e = Self {
            bin,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
            child: None,
        };
        // A free port can be taken by another test's connection before
        // etcd binds it (the tests run in parallel): etcd then exits at
        // once, and a fresh pair of ports is tried (at most three).
        for attempt in 1..=3 {
            match e.try_spawn() {
                Ok(()) => return Some(e),
                Err(why) if attempt < 3 => {
                    eprintln!("etcd did not start ({why}); retrying on other ports");
                    e.client_port = free_port();
                    e.peer_port = free_port();
                }
                Err(why) => panic!("etcd did not start three times; the last: {why}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// (Re)starts the process on the same ports and data dir; waits (≤ 20 s)
    /// until `/health` says true; panics with the reason otherwise.
    pub fn spawn(&mut self) {
        if let Err(why) = self.try_spawn() {
            panic!("{why}");
        }
    }

    /// [`spawn`](Self::spawn), returning why etcd did not become healthy
    /// (it exited, naming its status, or 20 s passed).
    fn try_spawn(&mut self) -> Result<(), String> {
        assert!(self.child.is_none());
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(&self.bin)
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &format!("t={peer}"),
                "--logger",
                "zap",
                "--log-level",
                "error",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning etcd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.healthy() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                return Err(format!(
                    "etcd exited with {status} (ports {} / {})",
                    self.client_port, self.peer_port
                ));
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err("etcd not healthy within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    pub fn healthy(&self) -> bool {
        let Ok(mut s) = TcpStream::connect_timeout(
            &format!("127.0.0.1:{}", self.client_port).parse().unwrap(),
            Duration::from_millis(200),
        ) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        if s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .is_err()
        {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains("\"health\":\"true\"")
    }

    /// SIGKILL (a crash, no graceful anything) and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Deletes all of etcd's data (must be stopped).
    pub fn wipe(&self) {
        assert!(self.child.is_none());
        let _ = std::fs::remove_dir_all(self.dir.join("data"));
    }

    /// Runs `f` with a plain etcd client (the tests' "external actor").
    pub fn with_client<T>(
        &self,
        f: impl for<'a> FnOnce(
            &'a mut etcd_client::Client,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, etcd_client::Error>> + 'a>,
        >,
    ) -> T {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ep = self.endpoint();
        rt.block_on(async move {
            tokio::time::timeout(Duration::from_secs(10), async move {
                let mut c = etcd_client::Client::connect([ep], None).await?;
                f(&mut c).await
            })
            .await
            .expect("etcd client call within 10 s")
            .expect("etcd client call")
        })
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
