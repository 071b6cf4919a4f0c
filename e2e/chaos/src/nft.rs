//! nftables for the network faults (`partition-agent`, `control-loss`,
//! `partition-etcd`).
//!
//! With network namespaces ([`crate::netns`]) a fault's tables live in the
//! namespaces of the agents it acts on and select packets by address
//! (every agent has its own); on the loopback fallback they live in the
//! root namespace and select by the marks below.
//!
//! Every table this process makes is named `kvfchaos_<pid>_<n>` (family
//! `inet`) and is owned by a [`Table`] guard: dropping it — at the end of
//! the fault, or while a panic unwinds — deletes the table. Tables of a
//! suite process that no longer runs (SIGKILLed, so no guard ran) are
//! deleted by [`remove_stale`] at the start of the next run.
//!
//! How an agent is singled out: the suite starts every agent with a group
//! id of its own ([`next_gid`]; the agent stays root, so its access to
//! files, shm and other processes is unchanged), so its sockets carry that
//! gid (`meta skgid`). That is only known where the packet leaves (output
//! hook; on loopback the input hook sees no socket), so the output chain
//! marks the *connection* (`ct mark`) and the input chain drops every
//! packet of a marked connection in both directions (`ct direction
//! original` / `reply`, each with its own counter). The mark survives in
//! conntrack because a packet is only dropped after it left the output
//! path (where conntrack confirms the entry).

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT: AtomicU32 = AtomicU32::new(1);

/// A group id no other process of this host uses: one per agent start.
pub fn next_gid() -> u32 {
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    0x6b00_0000 + ((std::process::id() & 0xffff) << 8) + (n & 0xff)
}

/// A conntrack mark unique to this process and call.
pub fn next_mark() -> u32 {
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    0x4b00_0000 + ((std::process::id() & 0xffff) << 8) + (n & 0xff)
}

fn nft(args: &[&str], stdin: Option<&str>) -> Result<String, String> {
    nft_in(None, args, stdin)
}

/// Runs nft in network namespace `ns` (None: this process's).
fn nft_in(ns: Option<&str>, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
    let mut cmd = Command::new("nft");
    let fd = ns.map(crate::netns::open).transpose()?;
    if let Some(fd) = &fd {
        crate::netns::enter_in_child(&mut cmd, fd);
    }
    crate::topo::run(cmd.args(args), stdin)
}

/// Whether nftables works here: the `nft` binary runs and a table with the
/// expressions the faults use (`meta skgid`, `ct mark`, `numgen`) can be
/// made and deleted. The reason when not.
///
/// # Errors
/// Why nft is unusable (no binary, no permission, no kernel support).
pub fn usable() -> Result<(), String> {
    nft(&["--version"], None).map_err(|e| format!("nftables not installed ({e})"))?;
    let t = Table::create(
        "chain out { type filter hook output priority 0; policy accept;\n\
           meta skgid 1 tcp dport 9 ct mark set 0x1 counter\n\
           tcp dport 9 numgen random mod 100 < 1 counter drop\n\
         }\n\
         chain in { type filter hook input priority 0; policy accept;\n\
           ct mark 0x1 ct direction original counter drop\n\
         }",
    )?;
    t.delete()
}

/// Deletes the `kvfchaos_<pid>_*` tables of suite processes that no
/// longer run; the names deleted.
pub fn remove_stale() -> Vec<String> {
    let Ok(list) = nft(&["list", "tables"], None) else {
        return Vec::new();
    };
    let mut gone = Vec::new();
    for l in list.lines() {
        let Some(name) = l.trim().strip_prefix("table inet ") else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix("kvfchaos_")
            .and_then(|r| r.split('_').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: kill(pid, 0) only checks for existence.
        let alive = unsafe { libc::kill(pid, 0) == 0 }
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !alive && nft(&["delete", "table", "inet", name], None).is_ok() {
            gone.push(name.to_string());
        }
    }
    gone
}

/// The `kvfchaos_<pid>_*` tables of this process still in the kernel.
pub fn own_tables() -> Vec<String> {
    let prefix = format!("kvfchaos_{}_", std::process::id());
    nft(&["list", "tables"], None)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table inet "))
        .filter(|n| n.starts_with(&prefix))
        .map(String::from)
        .collect()
}

/// One `inet` table, deleted on drop.
pub struct Table {
    name: String,
    /// The network namespace it is in (None: this process's).
    ns: Option<String>,
    live: bool,
}

impl Table {
    /// Creates table `kvfchaos_<pid>_<n>` holding `body` (chains) in this
    /// process's network namespace.
    ///
    /// # Errors
    /// nft refusing the rule set (nothing is left behind).
    pub fn create(body: &str) -> Result<Self, String> {
        Self::create_in(None, body)
    }

    /// [`Table::create`] in network namespace `ns` (None: this process's).
    ///
    /// # Errors
    /// No such namespace, or nft refusing the rule set.
    pub fn create_in(ns: Option<&str>, body: &str) -> Result<Self, String> {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let name = format!("kvfchaos_{}_{n}", std::process::id());
        // Owned before nft runs: a table half made is deleted too.
        let t = Self {
            name,
            ns: ns.map(String::from),
            live: true,
        };
        nft_in(
            ns,
            &["-f", "-"],
            Some(&format!("table inet {} {{\n{body}\n}}\n", t.name)),
        )?;
        Ok(t)
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `nft list table` of it.
    ///
    /// # Errors
    /// nft failing.
    pub fn list(&self) -> Result<String, String> {
        nft_in(
            self.ns.as_deref(),
            &["list", "table", "inet", &self.name],
            None,
        )
    }

    /// Packets counted by the rule whose `comment` is `tag`.
    pub fn counter(listing: &str, tag: &str) -> u64 {
        let c = format!("comment \"{tag}\"");
        listing
            .lines()
            .filter(|l| l.contains(&c))
            .filter_map(|l| l.split("counter packets ").nth(1))
            .filter_map(|r| r.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }

    /// Deletes it now (the heal); an error when it is still there.
    ///
    /// # Errors
    /// nft failing to delete it.
    pub fn delete(mut self) -> Result<(), String> {
        self.live = false;
        let r = nft_in(
            self.ns.as_deref(),
            &["delete", "table", "inet", &self.name],
            None,
        )
        .map(|_| ());
        let still = || {
            nft_in(self.ns.as_deref(), &["list", "tables"], None)
                .map(|l| l.contains(&format!("table inet {}", self.name)))
                .unwrap_or(false)
        };
        if r.is_err() && still() {
            self.live = true; // Drop tries once more.
            return r;
        }
        Ok(())
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        if self.live {
            let _ = nft_in(
                self.ns.as_deref(),
                &["delete", "table", "inet", &self.name],
                None,
            );
        }
    }
}

/// The tables of one network fault (one per namespace it acts in), made
/// together and, at the heal, listed then deleted together.
pub struct Tables(Vec<Table>);

impl Tables {
    /// Makes one table per `(namespace, body)`.
    ///
    /// # Errors
    /// The first table nft refuses (those already made are deleted).
    pub fn create(specs: &[(Option<String>, String)]) -> Result<Self, String> {
        let mut made = Vec::with_capacity(specs.len());
        for (ns, body) in specs {
            made.push(Table::create_in(ns.as_deref(), body)?);
        }
        Ok(Self(made))
    }

    /// The heal: lists every table (their counters, concatenated, for
    /// [`Table::counter`]), then deletes them all.
    ///
    /// # Errors
    /// (the listing's error, the deletion's error), each when one failed.
    pub fn heal(self) -> (Result<String, String>, Result<(), String>) {
        let mut listing = String::new();
        let mut list_err = None;
        for t in &self.0 {
            match t.list() {
                Ok(l) => listing.push_str(&l),
                Err(e) => list_err = Some(e),
            }
        }
        let mut del = Ok(());
        for t in self.0 {
            if let Err(e) = t.delete() {
                del = Err(e);
            }
        }
        (list_err.map_or(Ok(listing), Err), del)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_by_comment() {
        let l = "  ct mark 0x00004b56 ct direction original counter packets 12 bytes 712 drop comment \"orig\"\n\
                 ct mark 0x00004b56 ct direction reply counter packets 8 bytes 430 drop comment \"reply\"";
        assert_eq!(Table::counter(l, "orig"), 12);
        assert_eq!(Table::counter(l, "reply"), 8);
        assert_eq!(Table::counter(l, "none"), 0);
    }

    #[test]
    fn a_table_is_removed_when_a_panic_unwinds() {
        if let Err(why) = usable() {
            if std::env::var("KVFABRIC_REQUIRE_SERVICES").as_deref() == Ok("1") {
                panic!("required service missing: {why}");
            }
            println!("SKIP: {why}");
            return;
        }
        let name = std::sync::Mutex::new(String::new());
        let r = std::panic::catch_unwind(|| {
            let t =
                Table::create("chain out { type filter hook output priority 0; policy accept; }")
                    .expect("table");
            *name.lock().unwrap() = t.name().to_string();
            assert!(own_tables().contains(&t.name().to_string()));
            panic!("the suite panics with a partition in place");
        });
        assert!(r.is_err());
        let name = name.into_inner().unwrap();
        assert!(!name.is_empty());
        assert!(!own_tables().contains(&name), "{name} survived the panic");
    }

    #[test]
    fn gids_and_marks_are_distinct() {
        let (a, b) = (next_gid(), next_gid());
        assert_ne!(a, b);
        assert_ne!(next_mark(), next_mark());
    }
}
