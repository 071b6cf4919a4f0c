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
//!                        name 0x00 destination name 0x00 destination endpoint)
//! ```
//!
//! The MAC binds the sender's name, the agent it dialed and the endpoint it
//! dialed (`tcp://IP:PORT`, as that agent advertises it), the time and a
//! nonce (names and endpoints hold no 0 byte). The acceptor checks it in
//! constant time against its own name and endpoint — so a hello captured
//! on its way to one agent, or to a port the agent no longer listens on
//! (a stale or poisoned discovery entry), is refused by every other — and
//! refuses a hello more than [`MAX_CLOCK_SKEW`] from its own clock and one
//! whose nonce it took within twice that (a replay). It authenticates the
//! name of a connection, not each frame or the acceptor: an attacker on
//! the path can still race a captured hello to its destination or inject
//! into a live TCP stream (that needs TLS); one that only reaches the port
//! cannot speak as an agent, in mode `required`.
//!
//! A key file holds one key per line (each at least [`MIN_KEY_BYTES`]
//! bytes of text): the first signs, every one checks — so a key is
//! rotated in three rolling updates (add the new one second, move it
//! first, drop the old one) without a window.
//!
//! Pure: time and nonces come in as arguments.

use std::collections::{HashSet, VecDeque};
use std::io::Read;
use std::time::{Duration, Instant};

use ring::hmac;

/// First bytes of an authenticated hello (the plain one is
/// [`super::tcp::HELLO_MAGIC`]).
pub const AUTH_HELLO_MAGIC: &[u8; 4] = b"KVFA";
/// Bytes of an authenticated hello before the name.
pub const AUTH_HELLO_HEADER: usize = 4 + 8 + 16 + 32;
/// Shortest accepted key (bytes): 256 bits.
pub const MIN_KEY_BYTES: usize = 32;
/// Largest accepted key file (bytes).
pub const MAX_KEY_FILE_BYTES: usize = 4096;
/// Most keys one file may hold (the first signs; all check).
pub const MAX_KEYS: usize = 4;
/// Largest difference between a hello's time and the acceptor's clock.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);
/// Nonces remembered at most (each for 2 × [`MAX_CLOCK_SKEW`] of the
/// acceptor's monotonic clock); past it a hello is refused until old ones
/// expire (only holders of the key can add nonces, one per connect).
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
    /// `off` and `required`; names are not protected yet).
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

/// The fabric's control keys and what to do with them.
#[derive(Clone)]
pub struct ControlAuth {
    mode: AuthMode,
    /// The first signs; every one checks. Empty with [`AuthMode::Off`].
    keys: Vec<hmac::Key>,
}

impl std::fmt::Debug for ControlAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlAuth")
            .field("mode", &self.mode)
            .field("keys", &self.keys.len())
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
            keys: Vec::new(),
        }
    }

    /// `mode` with `keys` (the first signs, every one checks).
    ///
    /// # Errors
    /// A key shorter than [`MIN_KEY_BYTES`], more than [`MAX_KEYS`]; keys
    /// with [`AuthMode::Off`]; `optional` / `required` without a key.
    pub fn new(mode: AuthMode, keys: &[&[u8]]) -> Result<Self, String> {
        match (mode, keys.is_empty()) {
            (AuthMode::Off, true) => return Ok(Self::off()),
            (AuthMode::Off, false) => {
                return Err("a control key was given with controlAuth off: set optional or required, or drop the key".into())
            }
            (_, true) => {
                return Err(format!(
                    "controlAuth {mode:?} needs a control key (controlKeyFile)"
                ))
            }
            _ => {}
        }
        if keys.len() > MAX_KEYS {
            return Err(format!(
                "{} control keys: want at most {MAX_KEYS} (the first signs, the others are being rotated in or out)",
                keys.len()
            ));
        }
        if let Some((k, key)) = keys
            .iter()
            .enumerate()
            .find(|(_, k)| k.len() < MIN_KEY_BYTES)
        {
            return Err(format!(
                "control key {} of {} bytes: want at least {MIN_KEY_BYTES} (e.g. 64 random characters)",
                k + 1,
                key.len()
            ));
        }
        Ok(Self {
            mode,
            keys: keys
                .iter()
                .map(|k| hmac::Key::new(hmac::HMAC_SHA256, k))
                .collect(),
        })
    }

    /// Reads the keys from `path`: text, one key a line (blanks around a
    /// key and empty lines are not part of it), the first signing.
    ///
    /// # Errors
    /// The file cannot be read, is larger than [`MAX_KEY_FILE_BYTES`] or not
    /// UTF-8, or [`Self::new`] refuses its keys; each message names the
    /// file.
    pub fn from_file(mode: AuthMode, path: &std::path::Path) -> Result<Self, String> {
        let named = |e: String| format!("control key file {}: {e}", path.display());
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| {
                f.take(MAX_KEY_FILE_BYTES as u64 + 1)
                    .read_to_end(&mut bytes)
            })
            .map_err(|e| named(e.to_string()))?;
        if bytes.len() > MAX_KEY_FILE_BYTES {
            return Err(named(format!("more than {MAX_KEY_FILE_BYTES} bytes")));
        }
        let text = std::str::from_utf8(&bytes).map_err(|_| {
            named("not text: want one key a line (e.g. 64 random characters)".into())
        })?;
        let keys: Vec<&[u8]> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::as_bytes)
            .collect();
        Self::new(mode, &keys).map_err(named)
    }

    /// The mode.
    pub fn mode(&self) -> AuthMode {
        self.mode
    }

    /// The hello payload `own` sends on a connection to `peer` at
    /// `peer_endpoint` (as `peer` advertises it): an authenticated one
    /// (sent at `now_ms`, Unix ms, with `nonce`) when a key is set, else
    /// `None` (the caller sends the plain hello).
    pub fn hello(
        &self,
        own: &str,
        peer: &str,
        peer_endpoint: &str,
        now_ms: u64,
        nonce: [u8; 16],
    ) -> Option<Vec<u8>> {
        let key = self.keys.first()?;
        let mut at_nonce = now_ms.to_le_bytes().to_vec();
        at_nonce.extend_from_slice(&nonce);
        let tag = hmac::sign(key, &signed_bytes(&at_nonce, own, peer, peer_endpoint));
        let mut p = Vec::with_capacity(AUTH_HELLO_HEADER + own.len());
        p.extend_from_slice(AUTH_HELLO_MAGIC);
        p.extend_from_slice(&at_nonce);
        p.extend_from_slice(tag.as_ref());
        p.extend_from_slice(own.as_bytes());
        Some(p)
    }
}

/// What the MAC covers: the context, the hello's time and nonce
/// (`at_nonce`: 24 bytes), the sender's name, and the destination's name
/// and endpoint, 0-separated (none of them holds a 0 byte).
fn signed_bytes(at_nonce: &[u8], from: &str, to: &str, to_endpoint: &str) -> Vec<u8> {
    [
        CONTEXT,
        at_nonce,
        from.as_bytes(),
        &[0],
        to.as_bytes(),
        &[0],
        to_endpoint.as_bytes(),
    ]
    .concat()
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

/// The acceptor's side: checks hellos against the keys and remembers the
/// nonces it accepted.
#[derive(Debug)]
pub struct HelloVerifier {
    auth: ControlAuth,
    /// Nonces taken within 2 × [`MAX_CLOCK_SKEW`], and in arrival order
    /// with when (monotonic: a wall-clock jump does not expire them).
    seen: HashSet<[u8; 16]>,
    order: VecDeque<([u8; 16], Instant)>,
    max_nonces: usize,
    unsigned: u64,
}

impl Default for HelloVerifier {
    fn default() -> Self {
        Self::new(ControlAuth::off())
    }
}

impl HelloVerifier {
    /// A verifier for `auth`, remembering at most [`MAX_SEEN_NONCES`].
    pub fn new(auth: ControlAuth) -> Self {
        Self::with_nonce_cap(auth, MAX_SEEN_NONCES)
    }

    /// [`Self::new`] remembering at most `max_nonces` (tests).
    pub fn with_nonce_cap(auth: ControlAuth, max_nonces: usize) -> Self {
        Self {
            auth,
            seen: HashSet::new(),
            order: VecDeque::new(),
            max_nonces,
            unsigned: 0,
        }
    }

    /// The mode.
    pub fn mode(&self) -> AuthMode {
        self.auth.mode
    }

    /// Plain hellos accepted in mode `optional` so far (0 means every peer
    /// signs: `required` will not lock one out).
    pub fn unsigned_accepted(&self) -> u64 {
        self.unsigned
    }

    /// The claimed name of a hello payload (after the frame's length)
    /// received by agent `own` listening at `own_endpoint` (as advertised)
    /// at `now_ms` (Unix ms) and `now` (monotonic), if the mode accepts it.
    /// `plain` is the plain hello's magic.
    ///
    /// # Errors
    /// Why the hello is refused: no known magic, a plain hello where one
    /// is required, a MAC that does not check (another key, made for
    /// another agent or endpoint, altered), a time past
    /// [`MAX_CLOCK_SKEW`], a replayed nonce, a full nonce memory, an
    /// invalid name.
    #[allow(clippy::too_many_arguments)]
    pub fn check<'a>(
        &mut self,
        payload: &'a [u8],
        own: &str,
        own_endpoint: &str,
        now_ms: u64,
        now: Instant,
        plain: &[u8],
    ) -> Result<&'a str, Refusal> {
        if let Some(name) = payload.strip_prefix(plain) {
            return match self.auth.mode {
                AuthMode::Required => Err(by_key(
                    "plain hello refused: control authentication is required",
                )),
                mode => {
                    let name = super::valid_peer_identity(name).map_err(malformed)?;
                    if mode == AuthMode::Optional {
                        self.unsigned += 1;
                    }
                    Ok(name)
                }
            };
        }
        if payload.len() < AUTH_HELLO_HEADER || !payload.starts_with(AUTH_HELLO_MAGIC) {
            return Err(malformed("no hello magic"));
        }
        let at_ms = u64::from_le_bytes(payload[4..12].try_into().expect("8 bytes"));
        let nonce: [u8; 16] = payload[12..28].try_into().expect("16 bytes");
        let tag = &payload[28..60];
        let name = super::valid_peer_identity(&payload[AUTH_HELLO_HEADER..]).map_err(malformed)?;
        if self.auth.keys.is_empty() {
            // `off`: no key to check it with; taken as a plain hello.
            return Ok(name);
        }
        let signed = signed_bytes(&payload[4..28], name, own, own_endpoint);
        // ring compares the tags in constant time.
        if !self
            .auth
            .keys
            .iter()
            .any(|k| hmac::verify(k, &signed, tag).is_ok())
        {
            return Err(by_key(format!(
                "hello from {} does not check against the control key (another key, or made for another agent or endpoint)",
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
        self.expire(now);
        if self.seen.contains(&nonce) {
            return Err(by_key(format!(
                "hello from {} replays a nonce seen within {} s",
                kvfabric_core::text::log_safe_bytes(name.as_bytes()),
                2 * MAX_CLOCK_SKEW.as_secs()
            )));
        }
        if self.seen.len() >= self.max_nonces {
            return Err(by_key("too many recent hellos to remember; retry later"));
        }
        self.seen.insert(nonce);
        self.order.push_back((nonce, now));
        Ok(name)
    }

    /// Forgets nonces taken more than 2 × [`MAX_CLOCK_SKEW`] before `now`
    /// (their hellos' times are out of the window by then).
    fn expire(&mut self, now: Instant) {
        while let Some((n, at)) = self.order.front() {
            if now.saturating_duration_since(*at) <= 2 * MAX_CLOCK_SKEW {
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
    const OTHER: &[u8] = b"another-key-of-at-least-32-bytes!!";
    const PLAIN: &[u8] = b"KVFT";
    const NOW: u64 = 1_800_000_000_000;
    const EP_B: &str = "tcp://10.0.0.2:40001";

    fn auth(mode: AuthMode, key: &[u8]) -> ControlAuth {
        ControlAuth::new(mode, &[key]).unwrap()
    }

    /// Checks at b (listening at EP_B) at `ms`, monotonic `mono`.
    fn at_b(v: &mut HelloVerifier, h: &[u8], ms: u64, mono: Instant) -> Result<String, Refusal> {
        v.check(h, "b", EP_B, ms, mono, PLAIN).map(str::to_string)
    }

    #[test]
    fn a_signed_hello_checks_once_at_its_destination_only() {
        let t = Instant::now();
        let a = auth(AuthMode::Required, KEY);
        let mut b = HelloVerifier::new(auth(AuthMode::Required, KEY));
        let h = a.hello("a", "b", EP_B, NOW, [7; 16]).unwrap();
        assert_eq!(at_b(&mut b, &h, NOW + 5, t), Ok("a".into()));
        // The same bytes again: a replay.
        assert!(at_b(&mut b, &h, NOW + 6, t)
            .unwrap_err()
            .why
            .contains("replays"));
        // Made for b, shown to c (its own memory): refused.
        let mut c = HelloVerifier::new(auth(AuthMode::Required, KEY));
        let h2 = a.hello("a", "b", EP_B, NOW, [8; 16]).unwrap();
        let e = c.check(&h2, "c", EP_B, NOW, t, PLAIN).unwrap_err();
        assert!(e.by_key && e.why.contains("does not check"), "{e}");
        // Made for b at an endpoint b no longer (or never) listens on: a
        // stale or poisoned discovery entry cannot relay it to b.
        let stale = a
            .hello("a", "b", "tcp://10.0.0.2:39999", NOW, [11; 16])
            .unwrap();
        assert!(at_b(&mut b, &stale, NOW, t).is_err());
        // Another key.
        let h3 = auth(AuthMode::Required, OTHER)
            .hello("a", "b", EP_B, NOW, [9; 16])
            .unwrap();
        assert!(at_b(&mut b, &h3, NOW, t).is_err());
        // Any byte changed (time, nonce, tag, name): refused.
        for at in [4, 12, 28, 59, h2.len() - 1] {
            let mut bad = a.hello("a", "b", EP_B, NOW, [10; 16]).unwrap();
            bad[at] ^= 1;
            assert!(at_b(&mut b, &bad, NOW, t).is_err(), "byte {at}");
        }
        // Truncated: no panic, refused.
        for n in 0..AUTH_HELLO_HEADER + 1 {
            assert!(at_b(&mut b, &h2[..n], NOW, t).is_err(), "{n} bytes");
        }
    }

    #[test]
    fn hellos_outside_the_clock_window_are_refused_and_nonces_kept_two_windows() {
        let t = Instant::now();
        let a = auth(AuthMode::Required, KEY);
        let mut b = HelloVerifier::new(auth(AuthMode::Required, KEY));
        let skew = MAX_CLOCK_SKEW.as_millis() as u64;
        let late = a.hello("a", "b", EP_B, NOW - skew - 1, [1; 16]).unwrap();
        assert!(at_b(&mut b, &late, NOW, t)
            .unwrap_err()
            .why
            .contains("clock"));
        let early = a.hello("a", "b", EP_B, NOW + skew + 1, [2; 16]).unwrap();
        assert!(at_b(&mut b, &early, NOW, t).is_err());
        // Stamped at the far edge of the window: accepted, then remembered
        // for as long as its stamp stays in the window (two windows of
        // the acceptor's monotonic clock), whatever the wall clock does.
        let edge = a.hello("a", "b", EP_B, NOW + skew, [3; 16]).unwrap();
        assert_eq!(at_b(&mut b, &edge, NOW, t), Ok("a".into()));
        let almost = t + 2 * MAX_CLOCK_SKEW - Duration::from_millis(1);
        let e = at_b(&mut b, &edge, NOW + 2 * skew - 1, almost).unwrap_err();
        assert!(e.why.contains("replays"), "{e}");
        assert_eq!(b.remembered(), 1);
        // The wall clock jumps ten windows ahead one second later (a hello
        // stamped then is taken) and comes back: the first nonce is still
        // remembered — its expiry runs on the monotonic clock, which a
        // wall-clock expiry would have passed.
        let jumped = a.hello("a", "b", EP_B, NOW + 10 * skew, [12; 16]).unwrap();
        assert!(at_b(&mut b, &jumped, NOW + 10 * skew, t + Duration::from_secs(1)).is_ok());
        let e = at_b(&mut b, &edge, NOW, t + Duration::from_secs(2)).unwrap_err();
        assert!(e.why.contains("replays"), "{e}");
        assert_eq!(b.remembered(), 2);
        // Two windows later both are forgotten (their stamps are stale).
        let fresh = a.hello("a", "b", EP_B, NOW + 3 * skew, [4; 16]).unwrap();
        let later = t + 3 * MAX_CLOCK_SKEW;
        assert_eq!(at_b(&mut b, &fresh, NOW + 3 * skew, later), Ok("a".into()));
        assert_eq!(b.remembered(), 1);
    }

    #[test]
    fn a_full_nonce_memory_refuses_until_old_nonces_expire() {
        let t = Instant::now();
        let a = auth(AuthMode::Required, KEY);
        let mut b = HelloVerifier::with_nonce_cap(auth(AuthMode::Required, KEY), 2);
        for n in 0..2u8 {
            let h = a.hello("a", "b", EP_B, NOW, [n; 16]).unwrap();
            assert!(at_b(&mut b, &h, NOW, t).is_ok());
        }
        let h = a.hello("a", "b", EP_B, NOW, [9; 16]).unwrap();
        let e = at_b(&mut b, &h, NOW, t).unwrap_err();
        assert!(e.by_key && e.why.contains("too many"), "{e}");
        let later = t + 2 * MAX_CLOCK_SKEW + Duration::from_millis(1);
        let h = a.hello("a", "b", EP_B, NOW + 1000, [10; 16]).unwrap();
        assert!(at_b(&mut b, &h, NOW + 1000, later).is_ok());
    }

    #[test]
    fn modes_decide_what_plain_and_signed_hellos_get() {
        let t = Instant::now();
        let signed = auth(AuthMode::Optional, KEY)
            .hello("a", "b", EP_B, NOW, [5; 16])
            .unwrap();
        let plain = b"KVFTa".to_vec();
        let mut req = HelloVerifier::new(auth(AuthMode::Required, KEY));
        assert!(at_b(&mut req, &plain, NOW, t)
            .unwrap_err()
            .why
            .contains("required"));
        let mut opt = HelloVerifier::new(auth(AuthMode::Optional, KEY));
        assert_eq!(at_b(&mut opt, &plain, NOW, t), Ok("a".into()));
        assert_eq!(at_b(&mut opt, &signed, NOW, t), Ok("a".into()));
        assert_eq!(opt.unsigned_accepted(), 1);
        let wrong = auth(AuthMode::Optional, OTHER)
            .hello("a", "b", EP_B, NOW, [6; 16])
            .unwrap();
        assert!(
            at_b(&mut opt, &wrong, NOW, t).is_err(),
            "optional still checks signed ones"
        );
        let mut off = HelloVerifier::new(ControlAuth::off());
        assert_eq!(at_b(&mut off, &plain, NOW, t), Ok("a".into()));
        assert_eq!(at_b(&mut off, &signed, NOW, t), Ok("a".into()));
        assert_eq!(off.unsigned_accepted(), 0);
        let e = at_b(&mut off, b"XXXXa", NOW, t).unwrap_err();
        assert!(!e.by_key, "a malformed hello is not the key's refusal");
        assert!(ControlAuth::off()
            .hello("a", "b", EP_B, NOW, [0; 16])
            .is_none());
    }

    #[test]
    fn a_second_key_checks_so_keys_rotate_without_a_window() {
        let t = Instant::now();
        // Step 1: old signs, both check. Step 2: new signs, both check.
        let step1 = ControlAuth::new(AuthMode::Required, &[KEY, OTHER]).unwrap();
        let step2 = ControlAuth::new(AuthMode::Required, &[OTHER, KEY]).unwrap();
        let old_only = auth(AuthMode::Required, KEY);
        let new_only = auth(AuthMode::Required, OTHER);
        let mut n = 0u8;
        let mut hello = |from: &ControlAuth| {
            n += 1;
            from.hello("a", "b", EP_B, NOW, [n; 16]).unwrap()
        };
        // Neighbouring steps accept each other both ways.
        for (x, y) in [(&old_only, &step1), (&step1, &step2), (&step2, &new_only)] {
            let (hx, hy) = (hello(x), hello(y));
            let mut vx = HelloVerifier::new(x.clone());
            let mut vy = HelloVerifier::new(y.clone());
            assert!(at_b(&mut vy, &hx, NOW, t).is_ok());
            assert!(at_b(&mut vx, &hy, NOW, t).is_ok());
        }
        // Skipping a step does not.
        let h = hello(&new_only);
        assert!(at_b(&mut HelloVerifier::new(old_only.clone()), &h, NOW, t).is_err());
    }

    #[test]
    fn keys_and_modes_are_validated_with_the_file_named() {
        assert!(ControlAuth::new(AuthMode::Required, &[]).is_err());
        assert!(ControlAuth::new(AuthMode::Off, &[KEY]).is_err());
        let short = ControlAuth::new(AuthMode::Required, &[KEY, b"short"]).unwrap_err();
        assert!(
            short.contains("key 2") && short.contains("at least 32"),
            "{short}"
        );
        assert!(ControlAuth::new(AuthMode::Required, &[KEY; 5]).is_err());
        let dir = std::env::temp_dir().join(format!("kvf-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        // One key a line; blanks and empty lines are not part of a key.
        std::fs::write(&f, [b"  ", KEY, b"\r\n\n", OTHER, b"\n"].concat()).unwrap();
        let from_file = ControlAuth::from_file(AuthMode::Required, &f).unwrap();
        let h = from_file.hello("a", "b", EP_B, NOW, [1; 16]).unwrap();
        let mut v = HelloVerifier::new(auth(AuthMode::Required, KEY));
        assert_eq!(at_b(&mut v, &h, NOW, Instant::now()), Ok("a".into()));
        let missing = ControlAuth::from_file(AuthMode::Required, &dir.join("nope")).unwrap_err();
        assert!(missing.contains("nope"), "{missing}");
        std::fs::write(&f, b"tiny\n").unwrap();
        let tiny = ControlAuth::from_file(AuthMode::Required, &f).unwrap_err();
        assert!(
            tiny.contains("key file") && tiny.contains("at least"),
            "{tiny}"
        );
        std::fs::write(&f, vec![b'k'; MAX_KEY_FILE_BYTES + 1]).unwrap();
        assert!(ControlAuth::from_file(AuthMode::Required, &f)
            .unwrap_err()
            .contains("more than"));
        std::fs::write(&f, [0xff_u8; 40]).unwrap();
        assert!(ControlAuth::from_file(AuthMode::Required, &f)
            .unwrap_err()
            .contains("not text"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(AuthMode::parse(" Required "), Ok(AuthMode::Required));
        assert!(AuthMode::parse("yes")
            .unwrap_err()
            .contains("off, optional or required"));
    }
}
