//! Authenticated hellos of the TCP control channel: a cluster-wide
//! pre-shared key proves that a connection's claimed agent name belongs to
//! an agent of the fabric. Without it, control names are whatever a
//! connection's hello says (any process that reaches an agent's control
//! port could speak as any agent: GRANT into its flows, NOTICE arrivals
//! to its engines).
//!
//! Authenticated hello payload (inside the channel's usual length-prefixed
//! frame):
//!
//! ```text
//! "KVFA" | sent_at_ms: u64 LE (Unix ms) | nonce: [u8; 16] | mac: [u8; 32] | name
//! mac = HMAC-SHA256(key, "kvfabric control hello v1" 0x00 sent_at_ms nonce
//!                        name 0x00 destination name)
//! ```
//!
//! The MAC binds the sender's name, the agent it dialed, the time and a
//! nonce; the acceptor checks it in constant time, refuses a hello more than
//! [`MAX_CLOCK_SKEW`] from its own clock and one whose nonce it saw within
//! that window (a replay). It authenticates the name of a connection, not
//! each frame: an attacker on the path could still inject into a live TCP
//! stream (that needs TLS); one that only reaches the port cannot.
//!
//! Pure: time and nonces come in as arguments.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use ring::hmac;

/// First bytes of an authenticated hello (the plain one is
/// [`super::tcp::HELLO_MAGIC`]).
pub const AUTH_HELLO_MAGIC: &[u8; 4] = b"KVFA";
/// Bytes of an authenticated hello before the name.
pub const AUTH_HELLO_HEADER: usize = 4 + 8 + 16 + 32;
/// Shortest accepted key (bytes): 256 bits.
pub const MIN_KEY_BYTES: usize = 32;
/// Largest accepted key file (bytes).
pub const MAX_KEY_BYTES: usize = 4096;
/// Largest difference between a hello's time and the acceptor's clock.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);
/// Nonces remembered at most (each for 2 × [`MAX_CLOCK_SKEW`]); past it a
/// hello is refused until old ones expire (only holders of the key can add
/// nonces, one per connect).
pub const MAX_SEEN_NONCES: usize = 1 << 16;

const CONTEXT: &[u8] = b"kvfabric control hello v1\0";

/// How the TCP control channel treats hellos (`controlAuth`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    /// No key: send plain hellos; accept plain ones and authenticated ones
    /// without checking them (so an agent rolled out with a key in
    /// `optional` mode still reaches this one).
    #[default]
    Off,
    /// With a key: send authenticated hellos, check the authenticated ones
    /// received and still accept plain ones (the rollout step between
    /// `off` and `required`).
    Optional,
    /// With a key: send authenticated hellos and accept only those that
    /// check.
    Required,
}

impl AuthMode {
    /// Parses `off`, `optional` or `required` (any case).
    ///
    /// # Errors
    /// A message naming the value and the accepted ones.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" => Ok(Self::Off),
            "optional" => Ok(Self::Optional),
            "required" => Ok(Self::Required),
            _ => Err(format!(
                "control authentication mode {s:?}: want off, optional or required"
            )),
        }
    }
}

/// The fabric's control key and what to do with it.
#[derive(Clone)]
pub struct ControlAuth {
    mode: AuthMode,
    key: Option<hmac::Key>,
}

impl std::fmt::Debug for ControlAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlAuth")
            .field("mode", &self.mode)
            .field("key", &self.key.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl Default for ControlAuth {
    fn default() -> Self {
        Self::off()
    }
}

impl ControlAuth {
    /// No key ([`AuthMode::Off`]).
    pub fn off() -> Self {
        Self {
            mode: AuthMode::Off,
            key: None,
        }
    }

    /// `mode` with `key` (the key file's bytes, trailing whitespace
    /// removed).
    ///
    /// # Errors
    /// A key shorter than [`MIN_KEY_BYTES`]; a key with [`AuthMode::Off`];
    /// `optional` / `required` without a key.
    pub fn new(mode: AuthMode, key: Option<&[u8]>) -> Result<Self, String> {
        match (mode, key) {
            (AuthMode::Off, None) => Ok(Self::off()),
            (AuthMode::Off, Some(_)) => {
                Err("a control key was given with controlAuth off: set optional or required, or drop the key".into())
            }
            (_, None) => Err(format!(
                "controlAuth {mode:?} needs a control key (controlKeyFile)"
            )),
            (_, Some(k)) if k.len() < MIN_KEY_BYTES => Err(format!(
                "control key of {} bytes: want at least {MIN_KEY_BYTES} (e.g. 64 random characters)",
                k.len()
            )),
            (_, Some(k)) => Ok(Self {
                mode,
                key: Some(hmac::Key::new(hmac::HMAC_SHA256, k)),
            }),
        }
    }

    /// Reads the key from `path` (trailing whitespace and newlines are not
    /// part of it) for `mode`.
    ///
    /// # Errors
    /// The file cannot be read, is larger than [`MAX_KEY_BYTES`], or
    /// [`Self::new`] refuses it; each message names the file.
    pub fn from_file(mode: AuthMode, path: &std::path::Path) -> Result<Self, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("control key file {}: {e}", path.display()))?;
        if bytes.len() > MAX_KEY_BYTES {
            return Err(format!(
                "control key file {}: {} bytes, want at most {MAX_KEY_BYTES}",
                path.display(),
                bytes.len()
            ));
        }
        let end = bytes
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        Self::new(mode, Some(&bytes[..end]))
            .map_err(|e| format!("control key file {}: {e}", path.display()))
    }

    /// The mode.
    pub fn mode(&self) -> AuthMode {
        self.mode
    }

    /// The hello payload `own` sends on a connection to `peer`: an
    /// authenticated one (sent at `now_ms`, Unix ms, with `nonce`) when a
    /// key is set, else `None` (the caller sends the plain hello).
    pub fn hello(&self, own: &str, peer: &str, now_ms: u64, nonce: [u8; 16]) -> Option<Vec<u8>> {
        let key = self.key.as_ref()?;
        let tag = mac(key, own, peer, now_ms, &nonce);
        let mut p = Vec::with_capacity(AUTH_HELLO_HEADER + own.len());
        p.extend_from_slice(AUTH_HELLO_MAGIC);
        p.extend_from_slice(&now_ms.to_le_bytes());
        p.extend_from_slice(&nonce);
        p.extend_from_slice(tag.as_ref());
        p.extend_from_slice(own.as_bytes());
        Some(p)
    }
}

/// What the MAC covers: the context, the hello's time and nonce
/// (`at_nonce`: 24 bytes), the sender's name, a 0 byte and the destination.
fn signed_bytes(at_nonce: &[u8], from: &str, to: &str) -> Vec<u8> {
    [CONTEXT, at_nonce, from.as_bytes(), &[0], to.as_bytes()].concat()
}

fn mac(key: &hmac::Key, from: &str, to: &str, at_ms: u64, nonce: &[u8; 16]) -> hmac::Tag {
    let at_nonce = [&at_ms.to_le_bytes()[..], nonce].concat();
    hmac::sign(key, &signed_bytes(&at_nonce, from, to))
}

/// Why a hello was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The control key refused it (a plain hello where one is required,
    /// a MAC that does not check, a clock too far off, a replay, a full
    /// nonce memory); `false`: the hello is malformed.
    pub by_key: bool,
    /// What is wrong.
    pub why: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

fn malformed(why: impl Into<String>) -> Refusal {
    Refusal {
        by_key: false,
        why: why.into(),
    }
}

fn by_key(why: impl Into<String>) -> Refusal {
    Refusal {
        by_key: true,
        why: why.into(),
    }
}

/// The acceptor's side: checks hellos against the key and remembers the
/// nonces it accepted.
#[derive(Debug, Default)]
pub struct HelloVerifier {
    auth: ControlAuth,
    /// Nonce → the hello's time (ms), and the nonces in arrival order.
    seen: HashMap<[u8; 16], u64>,
    order: VecDeque<([u8; 16], u64)>,
}

impl HelloVerifier {
    /// A verifier for `auth`.
    pub fn new(auth: ControlAuth) -> Self {
        Self {
            auth,
            seen: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// The mode.
    pub fn mode(&self) -> AuthMode {
        self.auth.mode
    }

    /// The claimed name of a hello payload (after the frame's length)
    /// received by agent `own` at `now_ms` (Unix ms), if the mode accepts
    /// it. `plain` is the plain hello's magic.
    ///
    /// # Errors
    /// Why the hello is refused: no known magic, a plain hello where one
    /// is required, a MAC that does not check (wrong key, another
    /// destination, altered), a time past [`MAX_CLOCK_SKEW`], a replayed
    /// nonce, a full nonce memory, an invalid name.
    pub fn check<'a>(
        &mut self,
        payload: &'a [u8],
        own: &str,
        now_ms: u64,
        plain: &[u8],
    ) -> Result<&'a str, Refusal> {
        if let Some(name) = payload.strip_prefix(plain) {
            return match self.auth.mode {
                AuthMode::Required => Err(by_key(
                    "plain hello refused: control authentication is required",
                )),
                _ => super::valid_peer_identity(name).map_err(malformed),
            };
        }
        if payload.len() < AUTH_HELLO_HEADER || !payload.starts_with(AUTH_HELLO_MAGIC) {
            return Err(malformed("no hello magic"));
        }
        let at_ms = u64::from_le_bytes(payload[4..12].try_into().expect("8 bytes"));
        let nonce: [u8; 16] = payload[12..28].try_into().expect("16 bytes");
        let tag = &payload[28..60];
        let name = super::valid_peer_identity(&payload[AUTH_HELLO_HEADER..]).map_err(malformed)?;
        let Some(key) = self.auth.key.as_ref() else {
            // `off`: no key to check it with; taken as a plain hello.
            return Ok(name);
        };
        // ring compares the tags in constant time.
        if hmac::verify(key, &signed_bytes(&payload[4..28], name, own), tag).is_err() {
            return Err(by_key(format!(
                "hello from {} does not check against the control key (another key, or made for another agent)",
                kvfabric_core::text::log_safe_bytes(name.as_bytes())
            )));
        }
        let skew = MAX_CLOCK_SKEW.as_millis() as u64;
        if at_ms.abs_diff(now_ms) > skew {
            return Err(by_key(format!(
                "hello from {} sent at {at_ms} ms, {} ms from this agent's clock (at most {skew})",
                kvfabric_core::text::log_safe_bytes(name.as_bytes()),
                at_ms.abs_diff(now_ms)
            )));
        }
        self.expire(now_ms);
        if self.seen.contains_key(&nonce) {
            return Err(by_key(format!(
                "hello from {} replays a nonce seen within {} s",
                kvfabric_core::text::log_safe_bytes(name.as_bytes()),
                2 * MAX_CLOCK_SKEW.as_secs()
            )));
        }
        if self.seen.len() >= MAX_SEEN_NONCES {
            return Err(by_key("too many recent hellos to remember; retry later"));
        }
        self.seen.insert(nonce, at_ms);
        self.order.push_back((nonce, now_ms));
        Ok(name)
    }

    /// Forgets nonces received more than 2 × [`MAX_CLOCK_SKEW`] before
    /// `now_ms` (their hellos' times are out of the window by then).
    fn expire(&mut self, now_ms: u64) {
        let keep = 2 * MAX_CLOCK_SKEW.as_millis() as u64;
        while let Some((n, at)) = self.order.front() {
            if now_ms.saturating_sub(*at) <= keep {
                break;
            }
            self.seen.remove(n);
            self.order.pop_front();
        }
    }

    /// Nonces remembered now.
    pub fn remembered(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef-fabric";
    const PLAIN: &[u8] = b"KVFT";
    const NOW: u64 = 1_800_000_000_000;

    fn auth(mode: AuthMode, key: &[u8]) -> ControlAuth {
        ControlAuth::new(mode, Some(key)).unwrap()
    }

    #[test]
    fn a_signed_hello_checks_once_at_its_destination_only() {
        let a = auth(AuthMode::Required, KEY);
        let mut b = HelloVerifier::new(auth(AuthMode::Required, KEY));
        let h = a.hello("agent-a", "agent-b", NOW, [7; 16]).unwrap();
        assert_eq!(b.check(&h, "agent-b", NOW + 5, PLAIN), Ok("agent-a"));
        // The same bytes again: a replay.
        assert!(b
            .check(&h, "agent-b", NOW + 6, PLAIN)
            .unwrap_err()
            .why
            .contains("replays"));
        // Made for b, shown to c: refused (c has its own memory).
        let mut c = HelloVerifier::new(auth(AuthMode::Required, KEY));
        let h2 = a.hello("agent-a", "agent-b", NOW, [8; 16]).unwrap();
        assert!(c
            .check(&h2, "agent-c", NOW, PLAIN)
            .unwrap_err()
            .why
            .contains("does not check"));
        // Another key.
        let other = auth(AuthMode::Required, b"another-key-of-at-least-32-bytes!!");
        let h3 = other.hello("agent-a", "agent-b", NOW, [9; 16]).unwrap();
        assert!(b.check(&h3, "agent-b", NOW, PLAIN).is_err());
        // Any byte changed (time, nonce, tag, name): refused.
        for at in [4, 12, 28, 59, h2.len() - 1] {
            let mut bad = a.hello("agent-a", "agent-b", NOW, [10; 16]).unwrap();
            bad[at] ^= 1;
            assert!(b.check(&bad, "agent-b", NOW, PLAIN).is_err(), "byte {at}");
        }
        // Truncated: no panic, refused.
        for n in 0..AUTH_HELLO_HEADER + 1 {
            assert!(
                b.check(&h2[..n], "agent-b", NOW, PLAIN).is_err(),
                "{n} bytes"
            );
        }
    }

    #[test]
    fn hellos_outside_the_clock_window_are_refused_and_old_nonces_forgotten() {
        let a = auth(AuthMode::Required, KEY);
        let mut b = HelloVerifier::new(auth(AuthMode::Required, KEY));
        let skew = MAX_CLOCK_SKEW.as_millis() as u64;
        let late = a.hello("a", "b", NOW - skew - 1, [1; 16]).unwrap();
        assert!(b
            .check(&late, "b", NOW, PLAIN)
            .unwrap_err()
            .why
            .contains("clock"));
        let early = a.hello("a", "b", NOW + skew + 1, [2; 16]).unwrap();
        assert!(b.check(&early, "b", NOW, PLAIN).is_err());
        let edge = a.hello("a", "b", NOW - skew, [3; 16]).unwrap();
        assert_eq!(b.check(&edge, "b", NOW, PLAIN), Ok("a"));
        assert_eq!(b.remembered(), 1);
        // Two windows later the nonce is forgotten (its hello is stale).
        let fresh = a.hello("a", "b", NOW + 3 * skew, [4; 16]).unwrap();
        assert_eq!(b.check(&fresh, "b", NOW + 3 * skew, PLAIN), Ok("a"));
        assert_eq!(b.remembered(), 1);
    }

    #[test]
    fn modes_decide_what_plain_and_signed_hellos_get() {
        let signed = auth(AuthMode::Optional, KEY)
            .hello("a", "b", NOW, [5; 16])
            .unwrap();
        let plain = b"KVFTa".to_vec();
        let mut req = HelloVerifier::new(auth(AuthMode::Required, KEY));
        assert!(req
            .check(&plain, "b", NOW, PLAIN)
            .unwrap_err()
            .why
            .contains("required"));
        let mut opt = HelloVerifier::new(auth(AuthMode::Optional, KEY));
        assert_eq!(opt.check(&plain, "b", NOW, PLAIN), Ok("a"));
        assert_eq!(opt.check(&signed, "b", NOW, PLAIN), Ok("a"));
        let wrong = auth(AuthMode::Optional, b"another-key-of-at-least-32-bytes!!")
            .hello("a", "b", NOW, [6; 16])
            .unwrap();
        assert!(
            opt.check(&wrong, "b", NOW, PLAIN).is_err(),
            "optional still checks signed ones"
        );
        let mut off = HelloVerifier::new(ControlAuth::off());
        assert_eq!(off.check(&plain, "b", NOW, PLAIN), Ok("a"));
        assert_eq!(off.check(&signed, "b", NOW, PLAIN), Ok("a"));
        assert!(off.check(b"XXXXa", "b", NOW, PLAIN).is_err());
        assert!(ControlAuth::off().hello("a", "b", NOW, [0; 16]).is_none());
    }

    #[test]
    fn keys_and_modes_are_validated_with_the_file_named() {
        assert!(ControlAuth::new(AuthMode::Required, None).is_err());
        assert!(ControlAuth::new(AuthMode::Off, Some(KEY)).is_err());
        let short = ControlAuth::new(AuthMode::Required, Some(b"short")).unwrap_err();
        assert!(short.contains("at least 32"), "{short}");
        let dir = std::env::temp_dir().join(format!("kvf-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        std::fs::write(&f, [KEY, b"\n"].concat()).unwrap();
        let from_file = ControlAuth::from_file(AuthMode::Required, &f).unwrap();
        // The trailing newline is not part of the key.
        let h = from_file.hello("a", "b", NOW, [1; 16]).unwrap();
        let mut v = HelloVerifier::new(auth(AuthMode::Required, KEY));
        assert_eq!(v.check(&h, "b", NOW, PLAIN), Ok("a"));
        let missing = ControlAuth::from_file(AuthMode::Required, &dir.join("nope")).unwrap_err();
        assert!(missing.contains("nope"), "{missing}");
        std::fs::write(&f, b"tiny\n").unwrap();
        let tiny = ControlAuth::from_file(AuthMode::Required, &f).unwrap_err();
        assert!(tiny.contains("key") && tiny.contains("at least"), "{tiny}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(AuthMode::parse(" Required "), Ok(AuthMode::Required));
        assert!(AuthMode::parse("yes")
            .unwrap_err()
            .contains("off, optional or required"));
    }
}
