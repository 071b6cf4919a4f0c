//! Network namespaces joined by veth: one namespace per agent, every
//! agent's veth plugged into one bridge in the root namespace, which holds
//! the bridge's address (the fabric etcd listens there; the suite, the
//! operator and the engines stay in the root namespace).
//!
//! ```text
//!  root namespace: bridge kvfb<pid> 10.213.N.1/24, etcd, apiserver, operator, suite, engines
//!    ├── veth kvf<pid>h0 ── eth0 10.213.N.10/24 in netns kvfchaos-<pid>-0 (agent 0)
//!    ├── veth kvf<pid>h1 ── eth0 10.213.N.11/24 in netns kvfchaos-<pid>-1 (agent 1)
//!    └── …
//! ```
//!
//! Engines reach their agent through its Unix socket (a file, not the
//! network), and UCX may still move data between agents over shared memory
//! or cma (process_vm_writev), which no namespace cuts: the namespaces cut
//! the *control* path and etcd, which is what the network faults act on.
//!
//! Everything made here is named after this process's pid and removed on
//! drop; [`remove_stale`] removes what a SIGKILLed suite left.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Command;

fn ip(args: &[&str]) -> Result<String, String> {
    crate::topo::run(Command::new("ip").args(args), None)
}

/// Whether process `pid` exists.
fn alive(pid: i32) -> bool {
    // SAFETY: kill(pid, 0) only checks for existence.
    let ok = unsafe { libc::kill(pid, 0) == 0 };
    ok || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// One agent's place: its namespace and address.
#[derive(Clone, Debug)]
pub struct Slot {
    /// The namespace's name (`ip netns`), `kvfchaos-<pid>-<i>`.
    pub ns: String,
    /// Its address on the bridge.
    pub ip: Ipv4Addr,
}

/// The bridge and the namespaces; all deleted on drop.
pub struct Net {
    bridge: String,
    host: Ipv4Addr,
    slots: Vec<Slot>,
    /// The root namespace's ends of the veths, by slot.
    veths: Vec<String>,
}

impl Net {
    /// Makes the bridge and `n` namespaces (each with `lo` up and `eth0`, a
    /// veth to the bridge, addressed `10.213.N.(10+i)/24`; `N` is the first
    /// of 256 subnets no interface of this host uses).
    ///
    /// # Errors
    /// Why it cannot be done here (no `ip`, no CAP_NET_ADMIN, no veth or
    /// bridge support, no free subnet); whatever was made is removed.
    pub fn create(n: usize) -> Result<Self, String> {
        let pid = std::process::id();
        let used = ip(&["-4", "-o", "addr", "show"])?;
        let third = (0..=255u16)
            .map(|k| ((pid as u16).wrapping_add(k) % 256) as u8)
            .find(|t| !used.contains(&format!("10.213.{t}.")))
            .ok_or("no free 10.213.N.0/24 subnet")?;
        let host = Ipv4Addr::new(10, 213, third, 1);
        // Owned before anything is made: a half-made net is removed too.
        let mut net = Self {
            bridge: format!("kvfb{pid:x}"),
            host,
            slots: Vec::new(),
            veths: Vec::new(),
        };
        ip(&["link", "add", &net.bridge, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{host}/24"), "dev", &net.bridge])?;
        ip(&["link", "set", &net.bridge, "up"])?;
        for i in 0..n {
            let slot = Slot {
                ns: format!("kvfchaos-{pid}-{i}"),
                ip: Ipv4Addr::new(10, 213, third, 10 + i as u8),
            };
            ip(&["netns", "add", &slot.ns])?;
            net.slots.push(slot.clone());
            let host_if = format!("kvf{pid:x}h{i}");
            ip(&[
                "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &slot.ns,
            ])?;
            net.veths.push(host_if.clone());
            ip(&["link", "set", &host_if, "master", &net.bridge])?;
            ip(&["link", "set", &host_if, "up"])?;
            let inside = |args: &[&str]| {
                let mut a = vec!["-n", slot.ns.as_str()];
                a.extend_from_slice(args);
                ip(&a)
            };
            inside(&["link", "set", "lo", "up"])?;
            inside(&["addr", "add", &format!("{}/24", slot.ip), "dev", "eth0"])?;
            inside(&["link", "set", "eth0", "up"])?;
        }
        Ok(net)
    }

    /// The bridge's address (the root namespace's side: etcd listens here).
    pub fn host_ip(&self) -> Ipv4Addr {
        self.host
    }

    /// Agent slot `i`.
    pub fn slot(&self, i: usize) -> Option<&Slot> {
        self.slots.get(i)
    }

    /// Bytes the agents' namespaces sent and received over their veths so
    /// far (the root ends' counters, `/sys/class/net/*/statistics`):
    /// (sent by the agents, received by them).
    pub fn veth_bytes(&self) -> (u64, u64) {
        let read = |dev: &str, what: &str| {
            std::fs::read_to_string(format!("/sys/class/net/{dev}/statistics/{what}"))
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        // The root end receives what the namespace's end sends.
        self.veths.iter().fold((0, 0), |(s, r), d| {
            (s + read(d, "rx_bytes"), r + read(d, "tx_bytes"))
        })
    }

    /// The bridge's name.
    pub fn bridge(&self) -> &str {
        &self.bridge
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes its eth0 and with it the veth pair.
        for s in &self.slots {
            let _ = ip(&["netns", "delete", &s.ns]);
        }
        let _ = ip(&["link", "delete", &self.bridge]);
    }
}

/// An open handle on namespace `ns` (`/run/netns/<ns>`), for
/// [`enter_in_child`].
///
/// # Errors
/// The namespace not existing.
pub fn open(ns: &str) -> Result<OwnedFd, String> {
    let path = format!("/run/netns/{ns}");
    std::fs::File::open(&path)
        .map(OwnedFd::from)
        .map_err(|e| format!("{path}: {e}"))
}

/// Makes `cmd` start in the namespace `fd` refers to (setns(2) between
/// fork and exec; the child keeps every other namespace: same mounts,
/// /dev/shm, pids). `fd` must stay open until the child is spawned.
pub fn enter_in_child(cmd: &mut Command, fd: &OwnedFd) {
    use std::os::unix::process::CommandExt;
    let raw = fd.as_raw_fd();
    // SAFETY: setns(2) is async-signal-safe; `raw` is open in the parent
    // (the caller keeps it open until spawn returns) and so in the child.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(raw, libc::CLONE_NEWNET) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// Removes the namespaces and bridges of suite processes that no longer
/// run; what it removed.
pub fn remove_stale() -> Vec<String> {
    let mut gone = Vec::new();
    for l in ip(&["netns", "list"]).unwrap_or_default().lines() {
        let name = l.split_whitespace().next().unwrap_or("");
        let Some(pid) = name
            .strip_prefix("kvfchaos-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if !alive(pid) && ip(&["netns", "delete", name]).is_ok() {
            gone.push(format!("netns {name}"));
        }
    }
    for l in ip(&["-o", "link", "show", "type", "bridge"])
        .unwrap_or_default()
        .lines()
    {
        // "12: kvfb1a2b: <BROADCAST,…"
        let Some(name) = l.split(": ").nth(1) else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix("kvfb")
            .and_then(|h| i32::from_str_radix(h, 16).ok())
        else {
            continue;
        };
        if !alive(pid) && ip(&["link", "delete", name]).is_ok() {
            gone.push(format!("bridge {name}"));
        }
    }
    gone
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a thread moved into namespace `ns`.
    fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let fd = open(ns).expect("open ns");
        std::thread::spawn(move || {
            // SAFETY: setns(2) on this thread only, with an open ns fd.
            assert_eq!(
                unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) },
                0
            );
            f()
        })
        .join()
        .expect("thread in ns")
    }

    #[test]
    fn namespaces_reach_each_other_and_the_host_and_are_removed() {
        use std::io::{Read, Write};
        use std::net::{TcpListener, TcpStream};
        use std::time::Duration;
        if let Err(why) = Net::create(0).map(drop) {
            if std::env::var("KVFABRIC_REQUIRE_SERVICES").as_deref() == Ok("1") {
                panic!("network namespaces required: {why}");
            }
            println!("SKIP: network namespaces + veth unavailable here: {why}");
            return;
        }
        let net = Net::create(2).expect("net");
        let (a, b) = (net.slot(0).unwrap().clone(), net.slot(1).unwrap().clone());
        let host = net.host_ip();
        // A listener on b's address inside b; it answers two connections.
        let bip = b.ip;
        let listener = in_ns(&b.ns, move || {
            TcpListener::bind((bip, 0)).expect("bind in b")
        });
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            for _ in 0..2 {
                let (mut s, peer) = listener.accept().expect("accept");
                s.write_all(peer.ip().to_string().as_bytes()).unwrap();
            }
        });
        let fetch = move || {
            let mut s = TcpStream::connect_timeout(&(bip, port).into(), Duration::from_secs(3))
                .expect("connect to b");
            let mut t = String::new();
            s.read_to_string(&mut t).unwrap();
            t
        };
        // From a (namespace to namespace over the bridge) ...
        assert_eq!(in_ns(&a.ns, fetch), a.ip.to_string());
        // ... and from the root namespace (the host's bridge address).
        assert_eq!(fetch(), host.to_string());
        server.join().unwrap();
        // A child started into a namespace sees its address there only.
        let fd = open(&b.ns).expect("open ns");
        let mut cmd = Command::new("ip");
        cmd.args(["-o", "-4", "addr", "show", "dev", "eth0"]);
        enter_in_child(&mut cmd, &fd);
        let text = String::from_utf8_lossy(&cmd.output().expect("ip in b").stdout).into_owned();
        assert!(text.contains(&format!("{}/24", b.ip)), "{text}");
        drop(fd);
        let (ns, br) = (a.ns.clone(), net.bridge().to_string());
        drop(net);
        let list = ip(&["netns", "list"]).unwrap();
        assert!(!list.contains(&ns), "{ns} left: {list}");
        assert!(ip(&["link", "show", &br]).is_err(), "bridge {br} left");
    }
}
