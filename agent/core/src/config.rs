//! Bounce-buffer engine configuration (seed §10 "Configuration (env)").
//!
//! One schema, [`BounceConfig`], with three sources:
//!
//! 1. **Environment** — `KVFABRIC_BOUNCE_<SUFFIX>`, where `<SUFFIX>` is the
//!    seed's variable name after its `TRTLLM_NIXL_BOUNCE_` prefix (e.g.
//!    `KVFABRIC_BOUNCE_ENABLE`, `KVFABRIC_BOUNCE_ARENA_SIZE_BYTES`). See
//!    [`BounceConfig::apply_env_vars`] (pure, takes the variables as an
//!    iterator) and [`BounceConfig::from_env`] (reads the process
//!    environment). An unparsable value keeps the previous value and yields a
//!    [`ConfigWarning`]; it never becomes 0.
//! 2. **YAML** — [`BounceConfig::from_yaml_str`]: camelCase keys, unknown keys
//!    rejected, missing keys take their defaults. An invalid value is a
//!    [`ConfigError`] naming the field and the expected form.
//! 3. **The serde struct itself** — `BounceConfig` is `Serialize +
//!    Deserialize` (camelCase) so a Kubernetes CRD can embed it; the same
//!    field-naming errors apply there.
//!
//! Byte-valued fields accept plain integers or strings with case-insensitive
//! binary suffixes (see [`parse_byte_size`]); they always serialize as
//! integers.
//!
//! Loading is split in two steps so that sources can be layered: parse
//! (YAML and/or env, each on top of the previous result) and then
//! [`BounceConfig::validate`], which checks every rule at once and returns an
//! [`EffectiveBounceConfig`] with the derived sizes (clamped max chunk,
//! usable arena capacity, eager budget, control kind). The intended pipeline
//! is `defaults → YAML/CRD → env → validate`;
//! [`BounceConfig::from_yaml_str_validated`] is a shortcut for YAML alone.

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::buddy;
pub use crate::scheduler::{GrantPolicy, DEFAULT_SIZE_WEIGHT};
use crate::ControlKind;

/// Prefix of every environment variable of the bounce config (seed §10 uses
/// `TRTLLM_NIXL_BOUNCE_`; the suffixes are identical).
pub const ENV_PREFIX: &str = "KVFABRIC_BOUNCE_";

/// Earlier names of two fields' variables, still honoured with a
/// [`ConfigWarning::Deprecated`]: (old variable, field env suffix).
pub const LEGACY_ENV_ALIASES: [(&str, &str); 2] = [
    ("KVFABRIC_CONTROL_TRANSPORT", "CONTROL_TRANSPORT"),
    ("KVFABRIC_IO_BUSY_POLL_US", "IO_BUSY_POLL_US"),
];

/// Whether `key` is read by [`BounceConfig::apply_env_vars`]: a
/// [`ENV_PREFIX`] variable or a [`LEGACY_ENV_ALIASES`] name.
pub fn is_config_env(key: &str) -> bool {
    key.starts_with(ENV_PREFIX) || LEGACY_ENV_ALIASES.iter().any(|(old, _)| *old == key)
}

/// Minimum (and required) alignment of arena regions in bytes: the transfer
/// plan places in-region offsets on 32-byte boundaries, so the allocation
/// granularity must be at least this large.
pub const REGION_ALIGNMENT_BYTES: u64 = 32;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Expected form of a byte-size value, used in warnings and errors.
pub const EXPECTED_BYTE_SIZE: &str = "a byte size like 268435456, \"256MiB\" or \"1G\"";
/// Expected form of an environment boolean, used in warnings.
pub const EXPECTED_ENV_BOOL: &str = "one of 1/0/true/false/on/off/yes/no";
/// Expected form of a YAML/CRD boolean, used in errors.
pub const EXPECTED_YAML_BOOL: &str = "a boolean (true/false)";
/// Expected form of a 32-bit count, used in warnings and errors.
pub const EXPECTED_U32: &str = "a non-negative integer (at most 4294967295)";
/// Expected form of a 64-bit count, used in warnings and errors.
pub const EXPECTED_U64: &str = "a non-negative integer";

// ---------------------------------------------------------------------------
// Byte sizes
// ---------------------------------------------------------------------------

/// Why a string is not a byte size (see [`parse_byte_size`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ByteSizeError {
    /// The string is empty (or only whitespace).
    #[error("empty value")]
    Empty,
    /// The string does not start with a decimal integer (negative numbers
    /// and fractions are not byte sizes).
    #[error("not a non-negative decimal integer")]
    InvalidNumber,
    /// The number is followed by something other than a known suffix.
    #[error("unknown suffix {0:?} (use K/KB/KiB, M/MB/MiB, G/GB/GiB or B)")]
    UnknownSuffix(String),
    /// The value does not fit in 64 bits.
    #[error("value overflows 64 bits")]
    Overflow,
}

/// Parses a byte size: a decimal integer, optionally followed by a unit
/// suffix, surrounding and inner whitespace tolerated (`"512 MiB"`).
///
/// Suffixes are case-insensitive and **all powers of two** (seed §10):
/// `B` (×1), `K`/`KB`/`KiB`/`Ki` (×2¹⁰), `M`/`MB`/`MiB`/`Mi` (×2²⁰),
/// `G`/`GB`/`GiB`/`Gi` (×2³⁰). The Kubernetes-style `Ki`/`Mi`/`Gi` are an
/// extension over the seed. Overflow of `u64` is an error, never a wrap.
///
/// ```
/// use kvfabric_core::config::parse_byte_size;
/// assert_eq!(parse_byte_size("512MB"), Ok(512 << 20));
/// assert_eq!(parse_byte_size(" 1 gib "), Ok(1 << 30));
/// assert_eq!(parse_byte_size("4096"), Ok(4096));
/// assert!(parse_byte_size("lots").is_err());
/// ```
pub fn parse_byte_size(s: &str) -> Result<u64, ByteSizeError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(ByteSizeError::Empty);
    }
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(digits_end);
    if digits.is_empty() {
        return Err(ByteSizeError::InvalidNumber);
    }
    let suffix = suffix.trim_start();
    let multiplier = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" | "ki" => KIB,
        "m" | "mb" | "mib" | "mi" => MIB,
        "g" | "gb" | "gib" | "gi" => GIB,
        _ => {
            // "1.5G" or "-3": the number part is the problem, not the unit.
            if suffix.starts_with(['.', ',', 'e', 'E']) {
                return Err(ByteSizeError::InvalidNumber);
            }
            return Err(ByteSizeError::UnknownSuffix(suffix.to_string()));
        }
    };
    // Digits only, so the only possible parse failure is overflow.
    let n: u64 = digits.parse().map_err(|_| ByteSizeError::Overflow)?;
    n.checked_mul(multiplier).ok_or(ByteSizeError::Overflow)
}

/// A size in bytes that deserializes from either an integer (`268435456`)
/// or a suffixed string (`"256MiB"`, see [`parse_byte_size`]) and always
/// serializes as a plain integer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The size in bytes.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<u64> for ByteSize {
    fn from(bytes: u64) -> Self {
        ByteSize(bytes)
    }
}

impl From<ByteSize> for u64 {
    fn from(b: ByteSize) -> Self {
        b.0
    }
}

impl std::str::FromStr for ByteSize {
    type Err = ByteSizeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_byte_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    /// Plain byte count (the form it serializes to).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize_field(d, None)
    }
}

/// The socket control transport when `useNixlNotifications` is off
/// (`controlTransport`; a kvfabric field, not in seed §10). Every agent of
/// a fleet must use the same one: the handshake carries the resulting
/// [`ControlKind`] and bounce is only used between agents of one kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ControlTransport {
    /// ZMQ ROUTER/DEALER sockets (the seed's transport; default).
    #[default]
    Zmq,
    /// Length-prefixed frames on plain TCP sockets written and read by the
    /// IO threads themselves; lower latency per control hop
    /// (docs/benchmarks.md, "Direct TCP control channel").
    Tcp,
}

/// Expected form of [`ControlTransport`].
pub const EXPECTED_CONTROL_TRANSPORT: &str = "one of zmq/tcp";

impl fmt::Display for ControlTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ControlTransport::Zmq => "zmq",
            ControlTransport::Tcp => "tcp",
        })
    }
}

impl Serialize for ControlTransport {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ControlTransport {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize_field(d, None)
    }
}

/// The busy-poll window (`ioBusyPollUs`; a kvfabric field, not in seed
/// §10): while an agent has transfers in flight, its IO thread, its copy
/// workers and up to a few waiting callers poll instead of sleeping for up
/// to this long after their last event, and a submit or WANT wakes as many
/// idle workers as the request has chunks (at most the in-flight cap).
/// Each wake-up it saves costs 50–250 µs on a virtualised GPU host
/// (docs/benchmarks.md); it takes a core per spinning thread while it
/// lasts: up to 1 + `scatterWorkerCount` per agent, plus the callers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BusyPoll {
    /// 2 ms on hosts with at least [`BUSY_POLL_AUTO_MIN_CPUS`] CPUs, off
    /// below (on a 2-core host spinning threads take the copies' CPU —
    /// measured slower). Default.
    #[default]
    Auto,
    /// This many microseconds (0 turns busy polling off).
    Micros(u64),
}

/// Expected form of [`GrantPolicy`] (`grantPolicy`).
pub const EXPECTED_GRANT_POLICY: &str = "one of roundRobin/oldestFirst/shortestFirst";

impl fmt::Display for GrantPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GrantPolicy::RoundRobin => "roundRobin",
            GrantPolicy::OldestFirst => "oldestFirst",
            GrantPolicy::ShortestFirst => "shortestFirst",
        })
    }
}

impl Serialize for GrantPolicy {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GrantPolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize_field(d, None)
    }
}

/// Largest `ioBusyPollUs` validation accepts, µs (100 ms): a window is a
/// few control round trips, and a larger one (a value meant in ns) would
/// keep threads spinning for seconds after each event.
pub const MAX_BUSY_POLL_US: u64 = 100_000;

/// CPUs from which [`BusyPoll::Auto`] polls.
pub const BUSY_POLL_AUTO_MIN_CPUS: usize = 8;

/// Expected form of [`BusyPoll`].
pub const EXPECTED_BUSY_POLL: &str = "\"auto\" or a whole number of microseconds";

impl BusyPoll {
    /// The window for a host with `cpus` CPUs (pure: the caller reads the
    /// CPU count).
    pub fn window(self, cpus: usize) -> std::time::Duration {
        match self {
            BusyPoll::Auto if cpus >= BUSY_POLL_AUTO_MIN_CPUS => {
                std::time::Duration::from_millis(2)
            }
            BusyPoll::Auto => std::time::Duration::ZERO,
            BusyPoll::Micros(us) => std::time::Duration::from_micros(us),
        }
    }
}

impl fmt::Display for BusyPoll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BusyPoll::Auto => f.write_str("auto"),
            BusyPoll::Micros(us) => write!(f, "{us}"),
        }
    }
}

impl Serialize for BusyPoll {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            BusyPoll::Auto => s.serialize_str("auto"),
            BusyPoll::Micros(us) => s.serialize_u64(*us),
        }
    }
}

impl<'de> Deserialize<'de> for BusyPoll {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize_field(d, None)
    }
}

// ---------------------------------------------------------------------------
// Field values: one parser per kind, shared by env and serde
// ---------------------------------------------------------------------------

/// Any scalar (or a description of a non-scalar) as found in YAML/JSON.
enum Raw {
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Null,
    Other(&'static str),
}

impl fmt::Display for Raw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Raw::Bool(b) => write!(f, "{b}"),
            Raw::Int(n) => write!(f, "{n}"),
            Raw::Float(x) => write!(f, "{x}"),
            Raw::Str(s) => write!(f, "{s:?}"),
            Raw::Null => f.write_str("null"),
            Raw::Other(what) => f.write_str(what),
        }
    }
}

/// One kind of config value: how it parses from env text and from a
/// serde scalar, and what the user should have written instead.
trait FieldValue: Sized + Copy + fmt::Display {
    /// Expected form, for env warnings.
    const EXPECTED_ENV: &'static str;
    /// Expected form, for YAML/CRD errors.
    const EXPECTED_SERDE: &'static str;
    /// Parses an environment value; `Err` carries an optional reason.
    fn parse_env(s: &str) -> Result<Self, Option<String>>;
    /// Converts a deserialized scalar; `Err` carries an optional reason.
    fn from_raw(raw: &Raw) -> Result<Self, Option<String>>;
}

/// An integer-valued scalar (accepting integral floats and digit strings,
/// which some YAML/JSON tooling produces).
fn raw_integer(raw: &Raw) -> Option<i128> {
    match raw {
        Raw::Int(n) => Some(*n),
        Raw::Float(x) if x.fract() == 0.0 && x.abs() <= 9_007_199_254_740_992.0 => Some(*x as i128),
        Raw::Str(s) => {
            let t = s.trim();
            if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
                t.parse().ok()
            } else {
                None
            }
        }
        _ => None,
    }
}

fn parse_env_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

impl FieldValue for ByteSize {
    const EXPECTED_ENV: &'static str = EXPECTED_BYTE_SIZE;
    const EXPECTED_SERDE: &'static str = EXPECTED_BYTE_SIZE;
    fn parse_env(s: &str) -> Result<Self, Option<String>> {
        parse_byte_size(s)
            .map(ByteSize)
            .map_err(|e| Some(e.to_string()))
    }
    fn from_raw(raw: &Raw) -> Result<Self, Option<String>> {
        match raw {
            Raw::Str(s) => <Self as FieldValue>::parse_env(s),
            Raw::Int(n) if *n < 0 => Err(Some("negative".into())),
            Raw::Int(n) => u64::try_from(*n)
                .map(ByteSize)
                .map_err(|_| Some(ByteSizeError::Overflow.to_string())),
            Raw::Float(_) => match raw_integer(raw) {
                Some(n) if n >= 0 => Ok(ByteSize(n as u64)),
                _ => Err(None),
            },
            _ => Err(None),
        }
    }
}

impl FieldValue for u32 {
    const EXPECTED_ENV: &'static str = EXPECTED_U32;
    const EXPECTED_SERDE: &'static str = EXPECTED_U32;
    fn parse_env(s: &str) -> Result<Self, Option<String>> {
        s.trim().parse().map_err(|_| None)
    }
    fn from_raw(raw: &Raw) -> Result<Self, Option<String>> {
        raw_integer(raw)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or(None)
    }
}

impl FieldValue for u64 {
    const EXPECTED_ENV: &'static str = EXPECTED_U64;
    const EXPECTED_SERDE: &'static str = EXPECTED_U64;
    fn parse_env(s: &str) -> Result<Self, Option<String>> {
        s.trim().parse().map_err(|_| None)
    }
    fn from_raw(raw: &Raw) -> Result<Self, Option<String>> {
        raw_integer(raw)
            .and_then(|n| u64::try_from(n).ok())
            .ok_or(None)
    }
}

impl FieldValue for bool {
    const EXPECTED_ENV: &'static str = EXPECTED_ENV_BOOL;
    const EXPECTED_SERDE: &'static str = EXPECTED_YAML_BOOL;
    fn parse_env(s: &str) -> Result<Self, Option<String>> {
        parse_env_bool(s).ok_or(None)
    }
    /// YAML booleans; the env spellings (`"yes"`, `"on"`, ...) are accepted
    /// as strings too, since serde_yaml follows YAML 1.2 where `yes` is a
    /// string.
    fn from_raw(raw: &Raw) -> Result<Self, Option<String>> {
        match raw {
            Raw::Bool(b) => Ok(*b),
            Raw::Str(s) => parse_env_bool(s).ok_or(None),
            _ => Err(None),
        }
    }
}

impl FieldValue for ControlTransport {
    const EXPECTED_ENV: &'static str = EXPECTED_CONTROL_TRANSPORT;
    const EXPECTED_SERDE: &'static str = EXPECTED_CONTROL_TRANSPORT;
    /// Case-insensitive, trimmed.
    fn parse_env(s: &str) -> Result<Self, Option<String>> {
        match s.trim().to_ascii_lowercase().as_str() {
            "zmq" => Ok(ControlTransport::Zmq),
            "tcp" => Ok(ControlTransport::Tcp),
            _ => Err(None),
        }
    }
    fn from_raw(raw: &Raw) -> Result<Self, Option<String>> {
        match raw {
            Raw::Str(s) => <Self as FieldValue>::parse_env(s),
            _ => Err(None),
        }
    }
}

impl FieldValue for GrantPolicy {
    const EXPECTED_ENV: &'static str = EXPECTED_GRANT_POLICY;
    const EXPECTED_SERDE: &'static str = EXPECTED_GRANT_POLICY;
    /// Case-insensitive, trimmed; `round-robin` / `oldest-first` /
    /// `shortest-first` (and with `_`) are accepted too.
    fn parse_env(s: &str) -> Result<Self, Option<String>> {
        match s
            .trim()
            .to_ascii_lowercase()
            .replace(['-', '_'], "")
            .as_str()
        {
            "roundrobin" => Ok(GrantPolicy::RoundRobin),
            "oldestfirst" => Ok(GrantPolicy::OldestFirst),
            "shortestfirst" => Ok(GrantPolicy::ShortestFirst),
            _ => Err(None),
        }
    }
    fn from_raw(raw: &Raw) -> Result<Self, Option<String>> {
        match raw {
            Raw::Str(s) => <Self as FieldValue>::parse_env(s),
            _ => Err(None),
        }
    }
}

impl FieldValue for BusyPoll {
    const EXPECTED_ENV: &'static str = EXPECTED_BUSY_POLL;
    const EXPECTED_SERDE: &'static str = EXPECTED_BUSY_POLL;
    fn parse_env(s: &str) -> Result<Self, Option<String>> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("auto") {
            return Ok(BusyPoll::Auto);
        }
        t.parse().map(BusyPoll::Micros).map_err(|_| None)
    }
    fn from_raw(raw: &Raw) -> Result<Self, Option<String>> {
        match raw {
            Raw::Str(s) => <Self as FieldValue>::parse_env(s),
            _ => raw_integer(raw)
                .and_then(|n| u64::try_from(n).ok())
                .map(BusyPoll::Micros)
                .ok_or(None),
        }
    }
}

/// Captures whatever scalar the deserializer holds into a [`Raw`].
struct RawVisitor;

impl<'de> Visitor<'de> for RawVisitor {
    type Value = Raw;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a scalar value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Raw, E> {
        Ok(Raw::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Raw, E> {
        Ok(Raw::Int(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Raw, E> {
        Ok(Raw::Int(v.into()))
    }
    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Raw, E> {
        Ok(Raw::Int(v))
    }
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Raw, E> {
        Ok(Raw::Int(i128::try_from(v).unwrap_or(i128::MAX)))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Raw, E> {
        Ok(Raw::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Raw, E> {
        Ok(Raw::Str(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Raw, E> {
        Ok(Raw::Str(v))
    }
    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Raw, E> {
        Ok(Raw::Other("bytes"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Raw, E> {
        Ok(Raw::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Raw, E> {
        Ok(Raw::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Raw, D::Error> {
        d.deserialize_any(RawVisitor)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Raw, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Raw::Other("a sequence"))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Raw, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Raw::Other("a mapping"))
    }
}

/// Deserializes one field value of kind `T`; errors read
/// `"<field>: expected <form>, got <value>"` (or without the field prefix
/// when `field` is `None`).
fn deserialize_field<'de, D, T>(d: D, field: Option<&'static str>) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FieldValue,
{
    let raw = d.deserialize_any(RawVisitor)?;
    T::from_raw(&raw).map_err(|reason| {
        let prefix = field.map(|f| format!("{f}: ")).unwrap_or_default();
        let reason = reason.map(|r| format!(" ({r})")).unwrap_or_default();
        de::Error::custom(format!(
            "{prefix}expected {}, got {raw}{reason}",
            T::EXPECTED_SERDE
        ))
    })
}

/// Generates one `deserialize_with` function per field so that serde errors
/// name the (camelCase) field in every serde source (YAML, CRD JSON).
macro_rules! field_deserializers {
    ($($fn_name:ident: $ty:ty = $field:literal;)*) => {
        $(
            fn $fn_name<'de, D: Deserializer<'de>>(d: D) -> Result<$ty, D::Error> {
                deserialize_field(d, Some($field))
            }
        )*
    };
}

field_deserializers! {
    de_enabled: bool = "enabled";
    de_arena_size_bytes: ByteSize = "arenaSizeBytes";
    de_arena_allocation_granularity_bytes: ByteSize = "arenaAllocationGranularityBytes";
    de_max_chunk_size_bytes: ByteSize = "maxChunkSizeBytes";
    de_max_inflight_chunks_per_request: u32 = "maxInflightChunksPerRequest";
    de_copy_stream_count: u32 = "copyStreamCount";
    de_scatter_worker_count: u32 = "scatterWorkerCount";
    de_min_descriptor_count: u64 = "minDescriptorCount";
    de_max_average_descriptor_size_bytes: ByteSize = "maxAverageDescriptorSizeBytes";
    de_request_timeout_ms: u64 = "requestTimeoutMs";
    de_disable_fabric_memory: bool = "disableFabricMemory";
    de_enable_eager_gather: bool = "enableEagerGather";
    de_use_nixl_notifications: bool = "useNixlNotifications";
    de_use_zero_copy_arguments: bool = "useZeroCopyArguments";
    de_use_cub_copy: bool = "useCubCopy";
    de_disable_scatter_run_merging: bool = "disableScatterRunMerging";
    de_control_transport: ControlTransport = "controlTransport";
    de_io_busy_poll_us: BusyPoll = "ioBusyPollUs";
    de_grant_policy: GrantPolicy = "grantPolicy";
    de_uniform_data: bool = "uniformData";
    de_batch_gathers: bool = "batchGathers";
    de_eager_grant_order: bool = "eagerGrantOrder";
    de_release_staging_on_write: bool = "releaseStagingOnWrite";
    de_grant_size_weight: u32 = "grantSizeWeight";
    de_block_data: bool = "blockData";
}

// ---------------------------------------------------------------------------
// The schema
// ---------------------------------------------------------------------------

/// The bounce-buffer engine configuration: every field of seed §10 with the
/// same defaults and meaning.
///
/// Serde form: camelCase keys, unknown keys rejected, missing keys default,
/// byte sizes as integers or suffixed strings (see the module docs). Each
/// field's doc gives its unit, default, and environment variable
/// (`KVFABRIC_BOUNCE_` + the seed's suffix).
///
/// This struct is the *requested* configuration; call
/// [`BounceConfig::validate`] to check it and get the
/// [`EffectiveBounceConfig`] the engine runs with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct BounceConfig {
    /// Master switch (seed §10 `enabled`). Default `false`.
    /// Env `KVFABRIC_BOUNCE_ENABLE`.
    #[serde(deserialize_with = "de_enabled")]
    pub enabled: bool,

    /// Size of the shared region arena, bytes (seed §10 `arenaSizeBytes`).
    /// Default 512 MiB (the seed's is 256 MiB): with the 64 MiB chunks
    /// below, the same eight largest regions. Env
    /// `KVFABRIC_BOUNCE_ARENA_SIZE_BYTES`.
    #[serde(deserialize_with = "de_arena_size_bytes")]
    pub arena_size_bytes: ByteSize,

    /// Buddy allocator minimum block (allocation granularity), bytes (seed
    /// §10 `arenaAllocationGranularityBytes`). Must be a power of two
    /// ≥ [`REGION_ALIGNMENT_BYTES`]. Default 1 MiB.
    /// Env `KVFABRIC_BOUNCE_ARENA_ALLOCATION_GRANULARITY_BYTES`.
    #[serde(deserialize_with = "de_arena_allocation_granularity_bytes")]
    pub arena_allocation_granularity_bytes: ByteSize,

    /// Per-chunk byte cap, the transfer plan's bin-pack cap, bytes (seed §10
    /// `maxChunkSizeBytes`). Clamped by validation to the arena's largest
    /// single allocation; the effective value must match the peer's
    /// (handshake-checked). Default 64 MiB (the seed's is 32 MiB, sized
    /// for a ~25 GB/s NIC): every chunk costs the IO thread a write post,
    /// a DATA and an ACK and the copy workers a gather and a scatter
    /// launch, and at GPU speeds that host cost, not bandwidth, bounds
    /// throughput. On the H200 (issue 18, fourteenth session; 151 MB
    /// requests, MPS) 64 MiB chunks in a 512 MiB arena moved 12–32 % more
    /// requests a second at 8 and 128 in flight on two slower instances
    /// (once equal) and kept Poisson loads of 2,600–3,000 req/s at p99
    /// 4.7–16.8 ms where the seed's sizes reached 10–228 ms; one request
    /// at a time moved 11–16 % fewer a second (fewer chunks to pipeline;
    /// see the sender-local experiment switch `KVFABRIC_SOLO_CHUNK_BYTES`).
    /// Env `KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES`.
    #[serde(deserialize_with = "de_max_chunk_size_bytes")]
    pub max_chunk_size_bytes: ByteSize,

    /// Per-flow in-flight region cap `W`, i.e. pipeline depth, in chunks
    /// (seed §10 `maxInflightChunksPerRequest`, §5). Default 8.
    /// Env `KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST`.
    #[serde(deserialize_with = "de_max_inflight_chunks_per_request")]
    pub max_inflight_chunks_per_request: u32,

    /// Number of ExecPool contexts (stream + event + scratch), i.e. the GPU
    /// copy-kernel concurrency cap (seed §10 `copyStreamCount`, §2).
    /// Default 8. Env `KVFABRIC_BOUNCE_COPY_STREAM_COUNT`.
    #[serde(deserialize_with = "de_copy_stream_count")]
    pub copy_stream_count: u32,

    /// Number of scatter worker threads (seed §10 `scatterWorkerCount`, §7).
    /// Default 4. Env `KVFABRIC_BOUNCE_SCATTER_WORKER_COUNT`.
    #[serde(deserialize_with = "de_scatter_worker_count")]
    pub scatter_worker_count: u32,

    /// Routing gate: a transfer uses the bounce path only with at least this
    /// many descriptors (seed §10 `minDescriptorCount`). Default 1024.
    /// Env `KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT`.
    #[serde(deserialize_with = "de_min_descriptor_count")]
    pub min_descriptor_count: u64,

    /// Routing gate: a transfer uses the bounce path only if its average
    /// descriptor length is at most this many bytes (seed §10
    /// `maxAverageDescriptorSizeBytes`). Default 16 KiB.
    /// Env `KVFABRIC_BOUNCE_MAX_AVERAGE_DESCRIPTOR_SIZE_BYTES`.
    #[serde(deserialize_with = "de_max_average_descriptor_size_bytes")]
    pub max_average_descriptor_size_bytes: ByteSize,

    /// No-progress timeout of a request, milliseconds (seed §10
    /// `requestTimeoutMs`, §9). Default 30000.
    /// Env `KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS`.
    #[serde(deserialize_with = "de_request_timeout_ms")]
    pub request_timeout_ms: u64,

    /// Allocate the arena with plain `cudaMalloc` instead of MNNVL fabric
    /// memory, for CI / x86 hosts (seed §10 `disableFabricMemory`).
    /// Default `false`. Env `KVFABRIC_BOUNCE_DISABLE_FABRIC_MEMORY`.
    #[serde(deserialize_with = "de_disable_fabric_memory")]
    pub disable_fabric_memory: bool,

    /// Launch a chunk's gather at `submit()`, before its GRANT arrives, to
    /// overlap the control round-trip; eager staging is capped at half the
    /// arena (seed §10 `enableEagerGather`, §2). Default `true`.
    /// Env `KVFABRIC_BOUNCE_ENABLE_EAGER_GATHER`.
    #[serde(deserialize_with = "de_enable_eager_gather")]
    pub enable_eager_gather: bool,

    /// Carry the control plane over NIXL notifications (UCX active messages)
    /// instead of ZMQ/TCP; must match the peer, handshake-checked (seed §10
    /// `useNixlNotifications`, §5). Default `false`.
    /// Env `KVFABRIC_BOUNCE_USE_NIXL_NOTIFICATIONS`.
    #[serde(deserialize_with = "de_use_nixl_notifications")]
    pub use_nixl_notifications: bool,

    /// The copy kernel reads its plan directly from pinned host memory (no
    /// host-to-device staging copy) (seed §10 `useZeroCopyArguments`).
    /// Default `true`. Env `KVFABRIC_BOUNCE_USE_ZERO_COPY_ARGUMENTS`.
    #[serde(deserialize_with = "de_use_zero_copy_arguments")]
    pub use_zero_copy_arguments: bool,

    /// Experimental in the seed: use `cub::DeviceMemcpy::Batched` instead of
    /// the custom copy kernel (seed §10 `useCubCopy`). Default `false`.
    /// Env `KVFABRIC_BOUNCE_USE_CUB_COPY`.
    ///
    /// kvfabric has no CUB copy path: the field is accepted for schema
    /// compatibility, but [`EffectiveBounceConfig::use_cub_copy`] is always
    /// `false` and validation adds [`ConfigNote::CubCopyIgnored`] when it is
    /// set.
    #[serde(deserialize_with = "de_use_cub_copy")]
    pub use_cub_copy: bool,

    /// DEBUG ONLY: send a per-descriptor DATA plan instead of coalesced
    /// scatter runs (seed §10 `disableScatterRunMerging`). Default `false`.
    /// Env `KVFABRIC_BOUNCE_DISABLE_SCATTER_RUN_MERGING`.
    #[serde(deserialize_with = "de_disable_scatter_run_merging")]
    pub disable_scatter_run_merging: bool,

    /// kvfabric: the socket control transport, `zmq` (default) or `tcp`;
    /// ignored when `useNixlNotifications` is on. Must match the peers'
    /// (handshake-checked). Env `KVFABRIC_BOUNCE_CONTROL_TRANSPORT`.
    #[serde(deserialize_with = "de_control_transport")]
    pub control_transport: ControlTransport,

    /// kvfabric: the busy-poll window, µs or `auto` (default; see
    /// [`BusyPoll`]). Env `KVFABRIC_BOUNCE_IO_BUSY_POLL_US`.
    #[serde(deserialize_with = "de_io_busy_poll_us")]
    pub io_busy_poll_us: BusyPoll,

    /// kvfabric: which flow the receiver's credit scheduler grants a free
    /// region to next: `shortestFirst` (default; smaller requests first,
    /// aged by `grantSizeWeight` so none starves; arrival order for equal
    /// sizes), `roundRobin` (the
    /// seed's, §5: every request progresses at once) or `oldestFirst`
    /// (arrival order, W each: small requests wait behind large ones); see
    /// [`GrantPolicy`]. Receiver-local: peers need not agree.
    /// Env `KVFABRIC_BOUNCE_GRANT_POLICY`.
    #[serde(deserialize_with = "de_grant_policy")]
    pub grant_policy: GrantPolicy,

    /// kvfabric (issue 18 step 3): describe a chunk of whole equal-length
    /// descriptors by its pieces' destinations (DATA_UNIFORM: 8 bytes a
    /// piece, nothing planned on the sender) instead of scatter runs;
    /// advertised in the handshake's capabilities, used only between two
    /// agents that both advertise it, so `false` on either end keeps the
    /// seed's DATA. Default `true`. Env `KVFABRIC_BOUNCE_UNIFORM_DATA`.
    #[serde(deserialize_with = "de_uniform_data")]
    pub uniform_data: bool,

    /// kvfabric (issue 18 step 3): the gathers started together — a new
    /// request's first chunks — go to one copy worker as one job, on the
    /// GPU one launch a chunk on one stream (a driver submission per
    /// request instead of concurrent ones per chunk, which contend in the
    /// driver under MPS); the first chunk reports as soon as it is
    /// gathered, the rest together. Only the CUDA kernel path batches.
    /// Sender-local: peers need not agree. Default `true`: on the H200
    /// (MPS) an isolated 64 MiB request is no faster, but the open-loop
    /// tail is shorter (p99 from arrival lower in 6 of 7 alternated
    /// pairs; docs/benchmarks.md, "Issue 18 step 3, fourth session").
    /// Env `KVFABRIC_BOUNCE_BATCH_GATHERS`.
    #[serde(deserialize_with = "de_batch_gathers")]
    pub batch_gathers: bool,

    /// kvfabric (issue 18): stage eager gathers in the order the receiver
    /// is expected to grant them — the sender mirrors the receiver's
    /// `grantPolicy` (its own: the operator rolls one config out) over its
    /// own requests — and none while a credited chunk waits for staging.
    /// `false`: the seed's order (each request stages up to its window when
    /// submitted), under which, with many requests in flight, the eager
    /// budget holds chunks the receiver grants a whole round later while
    /// granted chunks wait for staging. Sender-local: peers need not
    /// agree; no effect without `enableEagerGather`. Default `true`.
    /// Env `KVFABRIC_BOUNCE_EAGER_GRANT_ORDER`.
    #[serde(deserialize_with = "de_eager_grant_order")]
    pub eager_grant_order: bool,

    /// kvfabric (issue 18): free a chunk's staging region as soon as its
    /// write completed (landed at the target, seed §6) instead of at its
    /// ACK (the seed's rule, `false`), so staging is not held over the DATA
    /// hop, the receiver's scatter and the ACK hop. Sender-local: peers
    /// need not agree. Default `true`.
    /// Env `KVFABRIC_BOUNCE_RELEASE_STAGING_ON_WRITE`.
    #[serde(deserialize_with = "de_release_staging_on_write")]
    pub release_staging_on_write: bool,

    /// kvfabric (issue 18, tenth session): under `grantPolicy:
    /// shortestFirst`, how many times its own bytes a request ranks behind
    /// the receiver's byte clock (rank = clock + weight × bytes, the clock
    /// counting bytes granted to anyone): a larger request is passed only
    /// by requests arriving before the clock has moved weight × its size
    /// past its arrival. Higher favours small requests longer; 1 ages
    /// fastest.
    /// 1..=[`MAX_GRANT_SIZE_WEIGHT`]; ignored by the other policies.
    /// Receiver-local (a sender estimates the order with its own value).
    /// Default [`DEFAULT_SIZE_WEIGHT`] (16).
    /// Env `KVFABRIC_BOUNCE_GRANT_SIZE_WEIGHT`.
    #[serde(deserialize_with = "de_grant_size_weight")]
    pub grant_size_weight: u32,

    /// kvfabric (issue 18 step 3): describe a uniform chunk of a request
    /// whose destinations repeat plane after plane (a block hand-off into
    /// a layer-major pool) by its blocks — the first plane's destinations
    /// and the stride between planes (DATA_BLOCKS: 8 bytes a block, not a
    /// piece) — and scatter such chunks from that form (the receiver
    /// derives every destination on the GPU). Advertised in the
    /// handshake's capabilities, used only between two agents that both
    /// advertise it (else DATA_UNIFORM or the seed's DATA). Default
    /// `true`. Env `KVFABRIC_BOUNCE_BLOCK_DATA`.
    #[serde(deserialize_with = "de_block_data")]
    pub block_data: bool,
}

/// Largest `grantSizeWeight` validation accepts: ranks (clock + weight ×
/// bytes of a WANT) stay far from overflow and a large request ages
/// within at most this many times its size of granted bytes.
pub const MAX_GRANT_SIZE_WEIGHT: u32 = 1024;

/// The seed's `arenaSizeBytes` (§10), bytes: kvfabric's default until issue
/// 18's fourteenth session (now [`BounceConfig::default`]'s 512 MiB). Kept
/// so that what an earlier CRD stored as its default can be recognised.
pub const SEED_ARENA_SIZE_BYTES: u64 = 256 * MIB;
/// The seed's `maxChunkSizeBytes` (§10), bytes: kvfabric's default until
/// issue 18's fourteenth session (now 64 MiB).
pub const SEED_MAX_CHUNK_SIZE_BYTES: u64 = 32 * MIB;

impl Default for BounceConfig {
    /// The seed §10 defaults, except where a field's docs say otherwise
    /// (arena and chunk size, grant policy, …).
    fn default() -> Self {
        Self {
            enabled: false,
            arena_size_bytes: ByteSize(512 * MIB),
            arena_allocation_granularity_bytes: ByteSize(MIB),
            max_chunk_size_bytes: ByteSize(64 * MIB),
            max_inflight_chunks_per_request: 8,
            copy_stream_count: 8,
            scatter_worker_count: 4,
            min_descriptor_count: 1024,
            max_average_descriptor_size_bytes: ByteSize(16 * KIB),
            request_timeout_ms: 30_000,
            disable_fabric_memory: false,
            enable_eager_gather: true,
            use_nixl_notifications: false,
            use_zero_copy_arguments: true,
            use_cub_copy: false,
            disable_scatter_run_merging: false,
            control_transport: ControlTransport::Zmq,
            io_busy_poll_us: BusyPoll::Auto,
            grant_policy: GrantPolicy::ShortestFirst,
            uniform_data: true,
            batch_gathers: true,
            eager_grant_order: true,
            release_staging_on_write: true,
            grant_size_weight: DEFAULT_SIZE_WEIGHT as u32,
            block_data: true,
        }
    }
}

/// Name of one config field in both of its spellings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldName {
    /// camelCase key in YAML / the CRD (seed §10 "Field" column).
    pub yaml: &'static str,
    /// Environment suffix after [`ENV_PREFIX`] (seed §10 "env" column).
    pub env: &'static str,
}

/// Every field of [`BounceConfig`], in declaration order.
pub const FIELDS: [FieldName; 25] = [
    FieldName {
        yaml: "enabled",
        env: "ENABLE",
    },
    FieldName {
        yaml: "arenaSizeBytes",
        env: "ARENA_SIZE_BYTES",
    },
    FieldName {
        yaml: "arenaAllocationGranularityBytes",
        env: "ARENA_ALLOCATION_GRANULARITY_BYTES",
    },
    FieldName {
        yaml: "maxChunkSizeBytes",
        env: "MAX_CHUNK_SIZE_BYTES",
    },
    FieldName {
        yaml: "maxInflightChunksPerRequest",
        env: "MAX_INFLIGHT_CHUNKS_PER_REQUEST",
    },
    FieldName {
        yaml: "copyStreamCount",
        env: "COPY_STREAM_COUNT",
    },
    FieldName {
        yaml: "scatterWorkerCount",
        env: "SCATTER_WORKER_COUNT",
    },
    FieldName {
        yaml: "minDescriptorCount",
        env: "MIN_DESCRIPTOR_COUNT",
    },
    FieldName {
        yaml: "maxAverageDescriptorSizeBytes",
        env: "MAX_AVERAGE_DESCRIPTOR_SIZE_BYTES",
    },
    FieldName {
        yaml: "requestTimeoutMs",
        env: "REQUEST_TIMEOUT_MS",
    },
    FieldName {
        yaml: "disableFabricMemory",
        env: "DISABLE_FABRIC_MEMORY",
    },
    FieldName {
        yaml: "enableEagerGather",
        env: "ENABLE_EAGER_GATHER",
    },
    FieldName {
        yaml: "useNixlNotifications",
        env: "USE_NIXL_NOTIFICATIONS",
    },
    FieldName {
        yaml: "useZeroCopyArguments",
        env: "USE_ZERO_COPY_ARGUMENTS",
    },
    FieldName {
        yaml: "useCubCopy",
        env: "USE_CUB_COPY",
    },
    FieldName {
        yaml: "disableScatterRunMerging",
        env: "DISABLE_SCATTER_RUN_MERGING",
    },
    FieldName {
        yaml: "controlTransport",
        env: "CONTROL_TRANSPORT",
    },
    FieldName {
        yaml: "ioBusyPollUs",
        env: "IO_BUSY_POLL_US",
    },
    FieldName {
        yaml: "grantPolicy",
        env: "GRANT_POLICY",
    },
    FieldName {
        yaml: "uniformData",
        env: "UNIFORM_DATA",
    },
    FieldName {
        yaml: "batchGathers",
        env: "BATCH_GATHERS",
    },
    FieldName {
        yaml: "eagerGrantOrder",
        env: "EAGER_GRANT_ORDER",
    },
    FieldName {
        yaml: "releaseStagingOnWrite",
        env: "RELEASE_STAGING_ON_WRITE",
    },
    FieldName {
        yaml: "grantSizeWeight",
        env: "GRANT_SIZE_WEIGHT",
    },
    FieldName {
        yaml: "blockData",
        env: "BLOCK_DATA",
    },
];

/// Object-safe view of one field, for the env path.
trait DynField {
    fn set_from_env(&mut self, s: &str) -> Result<(), (&'static str, Option<String>)>;
    fn render(&self) -> String;
}

impl<T: FieldValue> DynField for T {
    fn set_from_env(&mut self, s: &str) -> Result<(), (&'static str, Option<String>)> {
        *self = T::parse_env(s).map_err(|r| (T::EXPECTED_ENV, r))?;
        Ok(())
    }
    fn render(&self) -> String {
        self.to_string()
    }
}

impl BounceConfig {
    /// The fields, paired with [`FIELDS`] (same order).
    fn fields_mut(&mut self) -> [(FieldName, &mut dyn DynField); 25] {
        let f = FIELDS;
        [
            (f[0], &mut self.enabled),
            (f[1], &mut self.arena_size_bytes),
            (f[2], &mut self.arena_allocation_granularity_bytes),
            (f[3], &mut self.max_chunk_size_bytes),
            (f[4], &mut self.max_inflight_chunks_per_request),
            (f[5], &mut self.copy_stream_count),
            (f[6], &mut self.scatter_worker_count),
            (f[7], &mut self.min_descriptor_count),
            (f[8], &mut self.max_average_descriptor_size_bytes),
            (f[9], &mut self.request_timeout_ms),
            (f[10], &mut self.disable_fabric_memory),
            (f[11], &mut self.enable_eager_gather),
            (f[12], &mut self.use_nixl_notifications),
            (f[13], &mut self.use_zero_copy_arguments),
            (f[14], &mut self.use_cub_copy),
            (f[15], &mut self.disable_scatter_run_merging),
            (f[16], &mut self.control_transport),
            (f[17], &mut self.io_busy_poll_us),
            (f[18], &mut self.grant_policy),
            (f[19], &mut self.uniform_data),
            (f[20], &mut self.batch_gathers),
            (f[21], &mut self.eager_grant_order),
            (f[22], &mut self.release_staging_on_write),
            (f[23], &mut self.grant_size_weight),
            (f[24], &mut self.block_data),
        ]
    }

    /// Applies `KVFABRIC_BOUNCE_*` variables from `vars` on top of `self`
    /// (defaults, or a config loaded from YAML): pure, no process state.
    ///
    /// Variables without the [`ENV_PREFIX`] are ignored. Values are trimmed;
    /// byte sizes take suffixes ([`parse_byte_size`]); booleans accept
    /// `1/0/true/false/on/off/yes/no` (case-insensitive). When a variable
    /// appears twice the last one wins.
    ///
    /// A value that does not parse (including an empty one) leaves the field
    /// unchanged — it never becomes 0 — and produces a
    /// [`ConfigWarning::InvalidValue`]; an unknown `KVFABRIC_BOUNCE_*` name
    /// (likely a typo) produces [`ConfigWarning::UnknownVariable`]. Every
    /// warning is also logged with `tracing::warn!`. Values that parse but
    /// are out of range (e.g. `ARENA_SIZE_BYTES=0`) are applied and left to
    /// [`BounceConfig::validate`].
    pub fn apply_env_vars<I, K, V>(&mut self, vars: I) -> Vec<ConfigWarning>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let vars: Vec<(K, V)> = vars.into_iter().collect();
        let mut warnings = Vec::new();
        for (key, value) in &vars {
            let (key, value) = (key.as_ref(), value.as_ref());
            let suffix = if let Some(s) = key.strip_prefix(ENV_PREFIX) {
                s
            } else if let Some(&(_, s)) = LEGACY_ENV_ALIASES.iter().find(|(old, _)| *old == key) {
                // Honoured (a fleet mid-upgrade keeps its transport), with a
                // warning; the new name wins when both are set.
                let replacement = format!("{ENV_PREFIX}{s}");
                let shadowed = vars.iter().any(|(k, _)| k.as_ref() == replacement);
                let w = ConfigWarning::Deprecated {
                    variable: key.to_string(),
                    replacement,
                    ignored: shadowed,
                };
                tracing::warn!("{w}");
                warnings.push(w);
                if shadowed {
                    continue;
                }
                s
            } else {
                continue;
            };
            let warning = match self
                .fields_mut()
                .into_iter()
                .find(|(name, _)| name.env == suffix)
            {
                None => Some(ConfigWarning::UnknownVariable {
                    variable: key.to_string(),
                }),
                Some((_, field)) => match field.set_from_env(value) {
                    Ok(()) => None,
                    Err((expected, reason)) => Some(ConfigWarning::InvalidValue {
                        variable: key.to_string(),
                        value: value.to_string(),
                        expected,
                        reason,
                        kept: field.render(),
                    }),
                },
            };
            if let Some(w) = warning {
                tracing::warn!("{w}");
                warnings.push(w);
            }
        }
        warnings
    }

    /// Defaults overlaid with the process environment
    /// ([`BounceConfig::apply_env_vars`] over `std::env::vars_os()`), plus
    /// the warnings. Non-UTF-8 values are converted lossily (and so produce a
    /// warning); non-UTF-8 names are skipped. Not validated.
    pub fn from_env() -> (BounceConfig, Vec<ConfigWarning>) {
        let mut cfg = BounceConfig::default();
        let warnings = cfg.apply_env_vars(std::env::vars_os().filter_map(|(k, v)| {
            let k = k.into_string().ok()?;
            is_config_env(&k).then(|| (k, v.to_string_lossy().into_owned()))
        }));
        (cfg, warnings)
    }

    /// The configuration as `KVFABRIC_BOUNCE_*` variables (every field, byte
    /// sizes as plain integers, booleans as `true`/`false`), e.g. for an
    /// operator rendering a pod's environment from the CRD. Applying them to
    /// any base reproduces `self`.
    pub fn to_env_vars(&self) -> Vec<(String, String)> {
        let mut copy = self.clone();
        copy.fields_mut()
            .into_iter()
            .map(|(name, field)| (format!("{ENV_PREFIX}{}", name.env), field.render()))
            .collect()
    }

    /// Parses a YAML document (camelCase keys; unknown keys are an error;
    /// missing keys default; an empty document or `null` is all defaults).
    /// Not validated — layer env on top, then call
    /// [`BounceConfig::validate`]; or use
    /// [`BounceConfig::from_yaml_str_validated`].
    ///
    /// An invalid value is a [`ConfigError::Yaml`] whose message starts with
    /// the field name and the expected form, e.g. `arenaSizeBytes: expected a
    /// byte size like 268435456, "256MiB" or "1G", got "lots"`.
    pub fn from_yaml_str(yaml: &str) -> Result<BounceConfig, ConfigError> {
        let yaml_err = |e: serde_yaml::Error| ConfigError::Yaml {
            message: e.to_string(),
        };
        let value: serde_yaml::Value = serde_yaml::from_str(yaml).map_err(yaml_err)?;
        if value.is_null() {
            return Ok(BounceConfig::default());
        }
        // Deserialize from the text rather than the Value so that errors
        // serde_yaml can place (unknown keys, wrong shapes) keep their
        // line/column.
        serde_yaml::from_str(yaml).map_err(yaml_err)
    }

    /// [`BounceConfig::from_yaml_str`] followed by
    /// [`BounceConfig::validate`].
    pub fn from_yaml_str_validated(yaml: &str) -> Result<EffectiveBounceConfig, ConfigError> {
        Self::from_yaml_str(yaml)?.validate()
    }

    /// Checks every rule and derives the sizes the engine runs with. All
    /// violations are reported at once in [`ConfigError::Invalid`], each
    /// naming its (camelCase) field and the expected form.
    ///
    /// Rules:
    /// - `arenaAllocationGranularityBytes` is a power of two ≥ 32 (regions
    ///   are 32-byte aligned);
    /// - `arenaSizeBytes` holds at least one granularity block;
    /// - `maxChunkSizeBytes` > 0; if larger than the arena's largest single
    ///   allocation ([`buddy::max_allocation`]) it is clamped to it — not an
    ///   error, recorded as [`ConfigNote::MaxChunkClamped`];
    /// - `maxInflightChunksPerRequest`, `copyStreamCount`,
    ///   `scatterWorkerCount`, `requestTimeoutMs` ≥ 1;
    /// - `maxAverageDescriptorSizeBytes` > 0;
    /// - `ioBusyPollUs` `auto` or ≤ [`MAX_BUSY_POLL_US`];
    /// - `grantSizeWeight` in 1..=[`MAX_GRANT_SIZE_WEIGHT`].
    ///
    /// `minDescriptorCount` may be anything (0 = no descriptor-count gate).
    /// Validation does not depend on `enabled`: callers that ignore the
    /// config when disabled can skip it.
    pub fn validate(&self) -> Result<EffectiveBounceConfig, ConfigError> {
        let mut errors = Vec::new();
        let mut err = |field: &'static str, expected: String, got: String| {
            errors.push(FieldError {
                field,
                expected,
                got,
            })
        };

        let arena = self.arena_size_bytes.get();
        let granularity = self.arena_allocation_granularity_bytes.get();
        let granularity_ok = granularity.is_power_of_two() && granularity >= REGION_ALIGNMENT_BYTES;
        if !granularity_ok {
            err(
                "arenaAllocationGranularityBytes",
                format!(
                    "a power of two ≥ {REGION_ALIGNMENT_BYTES} bytes, like 1048576 or \"1MiB\""
                ),
                granularity.to_string(),
            );
        }
        if arena == 0 {
            err(
                "arenaSizeBytes",
                format!("{EXPECTED_BYTE_SIZE}, greater than 0"),
                "0".into(),
            );
        } else if granularity_ok && arena < granularity {
            err(
                "arenaSizeBytes",
                format!(
                    "at least one arenaAllocationGranularityBytes block \
                     (≥ {granularity} bytes)"
                ),
                arena.to_string(),
            );
        }
        if self.max_chunk_size_bytes.get() == 0 {
            err(
                "maxChunkSizeBytes",
                "a byte size greater than 0, like 33554432 or \"32MiB\"".into(),
                "0".into(),
            );
        }
        let counts: [(&'static str, u64); 4] = [
            (
                "maxInflightChunksPerRequest",
                self.max_inflight_chunks_per_request.into(),
            ),
            ("copyStreamCount", self.copy_stream_count.into()),
            ("scatterWorkerCount", self.scatter_worker_count.into()),
            ("requestTimeoutMs", self.request_timeout_ms),
        ];
        for (field, value) in counts {
            if value == 0 {
                err(field, "an integer ≥ 1".into(), "0".into());
            }
        }
        if self.max_average_descriptor_size_bytes.get() == 0 {
            err(
                "maxAverageDescriptorSizeBytes",
                "a byte size greater than 0, like 16384 or \"16KiB\"".into(),
                "0".into(),
            );
        }
        if let BusyPoll::Micros(us) = self.io_busy_poll_us {
            if us > MAX_BUSY_POLL_US {
                err(
                    "ioBusyPollUs",
                    format!("\"auto\" or at most {MAX_BUSY_POLL_US} microseconds"),
                    us.to_string(),
                );
            }
        }
        if !(1..=MAX_GRANT_SIZE_WEIGHT).contains(&self.grant_size_weight) {
            err(
                "grantSizeWeight",
                format!("an integer from 1 to {MAX_GRANT_SIZE_WEIGHT}"),
                self.grant_size_weight.to_string(),
            );
        }
        if !errors.is_empty() {
            return Err(ConfigError::Invalid { errors });
        }

        let usable = buddy::usable_capacity(arena, granularity);
        let max_allocation = buddy::max_allocation(arena, granularity);
        let requested = self.max_chunk_size_bytes.get();
        let max_chunk = requested.min(max_allocation);
        let mut notes = Vec::new();
        if max_chunk < requested {
            notes.push(ConfigNote::MaxChunkClamped {
                requested,
                clamped_to: max_chunk,
            });
        }
        if usable < arena {
            notes.push(ConfigNote::ArenaNotGranularityMultiple {
                arena_size_bytes: arena,
                usable_capacity_bytes: usable,
            });
        }
        if self.use_cub_copy {
            notes.push(ConfigNote::CubCopyIgnored);
        }
        Ok(EffectiveBounceConfig {
            config: self.clone(),
            max_chunk_size_bytes: max_chunk,
            arena_usable_capacity_bytes: usable,
            max_allocation_bytes: max_allocation,
            notes,
        })
    }
}

// ---------------------------------------------------------------------------
// Validated config, warnings, errors
// ---------------------------------------------------------------------------

/// A validated [`BounceConfig`] plus the sizes derived from it. Only
/// [`BounceConfig::validate`] builds one, so its invariants hold: the
/// granularity is a power of two ≥ 32, the arena holds at least one block,
/// `0 < max_chunk_size_bytes() ≤ max_allocation_bytes() ≤
/// arena_usable_capacity_bytes()`, and all counts are ≥ 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EffectiveBounceConfig {
    config: BounceConfig,
    max_chunk_size_bytes: u64,
    arena_usable_capacity_bytes: u64,
    max_allocation_bytes: u64,
    notes: Vec<ConfigNote>,
}

impl EffectiveBounceConfig {
    /// The configuration as requested (its `max_chunk_size_bytes` is the
    /// unclamped value; use [`Self::max_chunk_size_bytes`]).
    pub fn config(&self) -> &BounceConfig {
        &self.config
    }

    /// Master switch (seed §10 `enabled`).
    pub fn enabled(&self) -> bool {
        self.config.enabled
    }

    /// Arena size as configured, bytes (seed §10 `arenaSizeBytes`).
    pub fn arena_size_bytes(&self) -> u64 {
        self.config.arena_size_bytes.get()
    }

    /// Buddy minimum block, bytes; a power of two ≥ 32.
    pub fn granularity_bytes(&self) -> u64 {
        self.config.arena_allocation_granularity_bytes.get()
    }

    /// Effective per-chunk cap, bytes: `maxChunkSizeBytes` clamped to
    /// [`Self::max_allocation_bytes`]. This is the value the plan uses and
    /// the handshake advertises (seed §5: must match the peer's).
    pub fn max_chunk_size_bytes(&self) -> u64 {
        self.max_chunk_size_bytes
    }

    /// Whether `maxChunkSizeBytes` was clamped (see
    /// [`ConfigNote::MaxChunkClamped`]).
    pub fn max_chunk_clamped(&self) -> bool {
        self.max_chunk_size_bytes < self.config.max_chunk_size_bytes.get()
    }

    /// Bytes of the arena the buddy allocator manages
    /// ([`buddy::usable_capacity`]: the arena rounded down to a multiple of
    /// the granularity). Advertised in the handshake (seed §5).
    pub fn arena_usable_capacity_bytes(&self) -> u64 {
        self.arena_usable_capacity_bytes
    }

    /// Largest single region the arena can ever allocate, bytes
    /// ([`buddy::max_allocation`]).
    pub fn max_allocation_bytes(&self) -> u64 {
        self.max_allocation_bytes
    }

    /// Cap on eager (credit-less) local staging, bytes: half the usable
    /// capacity (seed §2), so a bidirectional agent can always still grant
    /// incoming regions. Credit-backed allocations are not capped.
    pub fn eager_budget_bytes(&self) -> u64 {
        self.arena_usable_capacity_bytes / 2
    }

    /// Control channel kind: [`ControlKind::NixlNotif`] when
    /// `useNixlNotifications` (seed §5), else the `controlTransport`
    /// socket kind ([`ControlKind::Zmq`] by default, [`ControlKind::Tcp`]).
    pub fn control_kind(&self) -> ControlKind {
        if self.config.use_nixl_notifications {
            return ControlKind::NixlNotif;
        }
        match self.config.control_transport {
            ControlTransport::Zmq => ControlKind::Zmq,
            ControlTransport::Tcp => ControlKind::Tcp,
        }
    }

    /// The busy-poll window on a host with `cpus` CPUs ([`BusyPoll::window`]).
    pub fn busy_poll(&self, cpus: usize) -> std::time::Duration {
        self.config.io_busy_poll_us.window(cpus)
    }

    /// The receiver's [`GrantPolicy`].
    pub fn grant_policy(&self) -> GrantPolicy {
        self.config.grant_policy
    }

    /// `grantSizeWeight`: the weight of a request's bytes in its rank
    /// under [`GrantPolicy::ShortestFirst`] (1..=[`MAX_GRANT_SIZE_WEIGHT`]).
    pub fn grant_size_weight(&self) -> u64 {
        self.config.grant_size_weight.into()
    }

    /// Whether the agent takes DATA_UNIFORM (`uniformData`; advertised as
    /// [`crate::wire::CAP_UNIFORM_DATA`]).
    pub fn uniform_data(&self) -> bool {
        self.config.uniform_data
    }

    /// Whether the agent takes DATA_BLOCKS (`blockData`; advertised as
    /// [`crate::wire::CAP_BLOCK_DATA`]).
    pub fn block_data(&self) -> bool {
        self.config.block_data
    }

    /// Whether the gathers one input starts go to the copy engine as one
    /// job (`batchGathers`; GPU kernel path only).
    pub fn batch_gathers(&self) -> bool {
        self.config.batch_gathers
    }

    /// Whether eager gathers are staged in the receiver's expected grant
    /// order (`eagerGrantOrder`).
    pub fn eager_grant_order(&self) -> bool {
        self.config.eager_grant_order
    }

    /// Whether a chunk's staging is freed when its write completed rather
    /// than at its ACK (`releaseStagingOnWrite`).
    pub fn release_staging_on_write(&self) -> bool {
        self.config.release_staging_on_write
    }

    /// Per-flow in-flight cap `W` (≥ 1), chunks.
    pub fn max_inflight_chunks_per_request(&self) -> u32 {
        self.config.max_inflight_chunks_per_request
    }

    /// ExecPool context count (≥ 1).
    pub fn copy_stream_count(&self) -> u32 {
        self.config.copy_stream_count
    }

    /// Scatter worker thread count (≥ 1).
    pub fn scatter_worker_count(&self) -> u32 {
        self.config.scatter_worker_count
    }

    /// Routing gate: minimum descriptor count.
    pub fn min_descriptor_count(&self) -> u64 {
        self.config.min_descriptor_count
    }

    /// Routing gate: maximum average descriptor length, bytes (> 0).
    pub fn max_average_descriptor_size_bytes(&self) -> u64 {
        self.config.max_average_descriptor_size_bytes.get()
    }

    /// No-progress timeout, milliseconds (≥ 1).
    pub fn request_timeout_ms(&self) -> u64 {
        self.config.request_timeout_ms
    }

    /// Always `false`: kvfabric has no CUB copy path (see
    /// [`BounceConfig::use_cub_copy`] and [`ConfigNote::CubCopyIgnored`]).
    pub fn use_cub_copy(&self) -> bool {
        false
    }

    /// Things validation adjusted or ignored (not errors); callers should
    /// log them once at start-up.
    pub fn notes(&self) -> &[ConfigNote] {
        &self.notes
    }
}

/// Something validation adjusted or ignored without failing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigNote {
    /// `maxChunkSizeBytes` exceeded the arena's largest single allocation
    /// and was lowered to it (seed §10: "clamped ... if larger").
    MaxChunkClamped {
        /// The configured value, bytes.
        requested: u64,
        /// The effective value, bytes.
        clamped_to: u64,
    },
    /// The arena is not a multiple of the granularity; the tail is unused.
    ArenaNotGranularityMultiple {
        /// The configured arena size, bytes.
        arena_size_bytes: u64,
        /// The bytes the allocator manages, bytes.
        usable_capacity_bytes: u64,
    },
    /// `useCubCopy` is set but kvfabric has no CUB copy path; the custom
    /// copy kernel is used.
    CubCopyIgnored,
}

impl fmt::Display for ConfigNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigNote::MaxChunkClamped {
                requested,
                clamped_to,
            } => write!(
                f,
                "maxChunkSizeBytes {requested} exceeds the arena's largest single \
                 allocation; clamped to {clamped_to}"
            ),
            ConfigNote::ArenaNotGranularityMultiple {
                arena_size_bytes,
                usable_capacity_bytes,
            } => write!(
                f,
                "arenaSizeBytes {arena_size_bytes} is not a multiple of \
                 arenaAllocationGranularityBytes; only {usable_capacity_bytes} bytes are usable"
            ),
            ConfigNote::CubCopyIgnored => f.write_str(
                "useCubCopy is not supported by kvfabric and is ignored; \
                 the custom copy kernel is used",
            ),
        }
    }
}

/// A problem with one environment variable; the config keeps its previous
/// value for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigWarning {
    /// The value did not parse; the field kept `kept`.
    InvalidValue {
        /// Full variable name, e.g. `KVFABRIC_BOUNCE_ARENA_SIZE_BYTES`.
        variable: String,
        /// The value as given.
        value: String,
        /// The expected form.
        expected: &'static str,
        /// Extra detail, e.g. "value overflows 64 bits".
        reason: Option<String>,
        /// The value the field kept (previous or default), rendered.
        kept: String,
    },
    /// A `KVFABRIC_BOUNCE_*` variable that is not a config field (typo?).
    UnknownVariable {
        /// Full variable name.
        variable: String,
    },
    /// A [`LEGACY_ENV_ALIASES`] name: applied unless `replacement` is set
    /// too (`ignored`).
    Deprecated {
        /// The old variable name.
        variable: String,
        /// The variable to use instead.
        replacement: String,
        /// Whether it was ignored because `replacement` is also set.
        ignored: bool,
    },
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigWarning::InvalidValue {
                variable,
                value,
                expected,
                reason,
                kept,
            } => {
                write!(f, "{variable}={value:?} is invalid: expected {expected}")?;
                if let Some(r) = reason {
                    write!(f, " ({r})")?;
                }
                write!(f, "; keeping {kept}")
            }
            ConfigWarning::UnknownVariable { variable } => {
                write!(f, "{variable} is not a bounce config variable; ignored")
            }
            ConfigWarning::Deprecated {
                variable,
                replacement,
                ignored,
            } => {
                write!(f, "{variable} is deprecated; use {replacement}")?;
                if *ignored {
                    write!(f, " (set too, so {variable} is ignored)")?;
                }
                Ok(())
            }
        }
    }
}

/// One invalid field found by [`BounceConfig::validate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// camelCase field name.
    pub field: &'static str,
    /// The expected form.
    pub expected: String,
    /// The offending value.
    pub got: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: expected {}, got {}",
            self.field, self.expected, self.got
        )
    }
}

/// A configuration that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The YAML (or CRD) document does not parse or has an invalid value /
    /// unknown key; the message names the field and the expected form.
    #[error("bounce config: {message}")]
    Yaml {
        /// serde_yaml's message: our `"<field>: expected <form>, got
        /// <value>"` text for invalid values, serde's for unknown keys and
        /// wrong shapes, with the line/column when serde_yaml knows it.
        message: String,
    },
    /// [`BounceConfig::validate`] found one or more invalid fields.
    #[error("invalid bounce config: {}", join_errors(errors))]
    Invalid {
        /// Every violation, in field order.
        errors: Vec<FieldError>,
    },
}

fn join_errors(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl ConfigError {
    /// Names of the fields a validation error is about (empty for YAML
    /// errors, whose message carries the name).
    pub fn fields(&self) -> Vec<&'static str> {
        match self {
            ConfigError::Yaml { .. } => Vec::new(),
            ConfigError::Invalid { errors } => errors.iter().map(|e| e.field).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> (BounceConfig, Vec<ConfigWarning>) {
        let mut cfg = BounceConfig::default();
        let w = cfg.apply_env_vars(pairs.iter().copied());
        (cfg, w)
    }

    #[test]
    fn config_defaults_equal_seed_but_arena_and_chunk() {
        let c = BounceConfig::default();
        assert!(!c.enabled);
        // kvfabric's (issue 18, fourteenth session); the seed's 256 / 32 MiB.
        assert_eq!(c.arena_size_bytes.get(), 536_870_912);
        assert_eq!(c.arena_allocation_granularity_bytes.get(), 1_048_576);
        assert_eq!(c.max_chunk_size_bytes.get(), 67_108_864);
        assert_eq!(c.max_inflight_chunks_per_request, 8);
        assert_eq!(c.copy_stream_count, 8);
        assert_eq!(c.scatter_worker_count, 4);
        assert_eq!(c.min_descriptor_count, 1024);
        assert_eq!(c.max_average_descriptor_size_bytes.get(), 16_384);
        assert_eq!(c.request_timeout_ms, 30_000);
        assert!(!c.disable_fabric_memory);
        assert!(c.enable_eager_gather);
        assert!(!c.use_nixl_notifications);
        assert!(c.use_zero_copy_arguments);
        assert!(!c.use_cub_copy);
        assert!(!c.disable_scatter_run_merging);

        let e = c.validate().expect("defaults are valid");
        assert_eq!(e.max_chunk_size_bytes(), 64 * MIB);
        assert!(!e.max_chunk_clamped());
        assert_eq!(e.arena_usable_capacity_bytes(), 512 * MIB);
        assert_eq!(e.max_allocation_bytes(), 512 * MIB);
        assert_eq!(e.eager_budget_bytes(), 256 * MIB);
        assert_eq!(e.control_kind(), ControlKind::Zmq);
        assert!(e.notes().is_empty());
    }

    #[test]
    fn config_byte_size_every_suffix_form() {
        let cases: &[(&str, u64)] = &[
            ("0", 0),
            ("4096", 4096),
            ("4096B", 4096),
            ("4096 b", 4096),
            ("1K", KIB),
            ("1k", KIB),
            ("1KB", KIB),
            ("1kb", KIB),
            ("1kB", KIB),
            ("1KiB", KIB),
            ("1kib", KIB),
            ("1Ki", KIB),
            ("16KiB", 16 * KIB),
            ("512M", 512 * MIB),
            ("512MB", 512 * MIB),
            ("512mb", 512 * MIB),
            ("512MiB", 512 * MIB),
            ("512mib", 512 * MIB),
            ("512Mi", 512 * MIB),
            ("2G", 2 * GIB),
            ("2GB", 2 * GIB),
            ("2gb", 2 * GIB),
            ("2GiB", 2 * GIB),
            ("2gIb", 2 * GIB),
            ("2Gi", 2 * GIB),
            ("  256 MiB  ", 256 * MIB),
            ("\t1G\n", GIB),
            ("18446744073709551615", u64::MAX),
            ("17179869183G", 17_179_869_183 * GIB),
        ];
        for (s, want) in cases {
            assert_eq!(parse_byte_size(s), Ok(*want), "{s:?}");
            assert_eq!(s.parse::<ByteSize>(), Ok(ByteSize(*want)), "{s:?}");
        }
    }

    #[test]
    fn config_byte_size_rejects_garbage_and_overflow() {
        use ByteSizeError::*;
        assert_eq!(parse_byte_size(""), Err(Empty));
        assert_eq!(parse_byte_size("   "), Err(Empty));
        assert_eq!(parse_byte_size("lots"), Err(InvalidNumber));
        assert_eq!(parse_byte_size("-1"), Err(InvalidNumber));
        assert_eq!(parse_byte_size("+1"), Err(InvalidNumber));
        assert_eq!(parse_byte_size("MiB"), Err(InvalidNumber));
        assert_eq!(parse_byte_size("1.5G"), Err(InvalidNumber));
        assert_eq!(parse_byte_size("1e9"), Err(InvalidNumber));
        assert_eq!(parse_byte_size("1T"), Err(UnknownSuffix("T".into())));
        assert_eq!(parse_byte_size("1 MiBs"), Err(UnknownSuffix("MiBs".into())));
        assert_eq!(parse_byte_size("1 2"), Err(UnknownSuffix("2".into())));
        assert_eq!(parse_byte_size("18446744073709551616"), Err(Overflow));
        assert_eq!(parse_byte_size("17179869184G"), Err(Overflow));
        assert_eq!(parse_byte_size("99999999999999999999999K"), Err(Overflow));
    }

    #[test]
    fn config_env_sets_every_field() {
        let (c, w) = env(&[
            ("KVFABRIC_BOUNCE_ENABLE", "1"),
            ("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "512MB"),
            (
                "KVFABRIC_BOUNCE_ARENA_ALLOCATION_GRANULARITY_BYTES",
                "64KiB",
            ),
            ("KVFABRIC_BOUNCE_MAX_CHUNK_SIZE_BYTES", "4M"),
            ("KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST", " 3 "),
            ("KVFABRIC_BOUNCE_COPY_STREAM_COUNT", "2"),
            ("KVFABRIC_BOUNCE_SCATTER_WORKER_COUNT", "6"),
            ("KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT", "0"),
            ("KVFABRIC_BOUNCE_MAX_AVERAGE_DESCRIPTOR_SIZE_BYTES", "1k"),
            ("KVFABRIC_BOUNCE_REQUEST_TIMEOUT_MS", "1500"),
            ("KVFABRIC_BOUNCE_DISABLE_FABRIC_MEMORY", "ON"),
            ("KVFABRIC_BOUNCE_ENABLE_EAGER_GATHER", "off"),
            ("KVFABRIC_BOUNCE_USE_NIXL_NOTIFICATIONS", "Yes"),
            ("KVFABRIC_BOUNCE_USE_ZERO_COPY_ARGUMENTS", "FALSE"),
            ("KVFABRIC_BOUNCE_USE_CUB_COPY", "true"),
            ("KVFABRIC_BOUNCE_DISABLE_SCATTER_RUN_MERGING", "yes"),
            ("KVFABRIC_BOUNCE_CONTROL_TRANSPORT", " TCP "),
            ("KVFABRIC_BOUNCE_IO_BUSY_POLL_US", "500"),
            ("KVFABRIC_BOUNCE_GRANT_POLICY", "oldest-first"),
            ("KVFABRIC_BOUNCE_UNIFORM_DATA", "no"),
            ("KVFABRIC_BOUNCE_BATCH_GATHERS", "0"),
            ("KVFABRIC_BOUNCE_EAGER_GRANT_ORDER", "false"),
            ("KVFABRIC_BOUNCE_RELEASE_STAGING_ON_WRITE", "off"),
            ("KVFABRIC_BOUNCE_GRANT_SIZE_WEIGHT", "4"),
            ("KVFABRIC_BOUNCE_BLOCK_DATA", "no"),
            ("UNRELATED", "whatever"),
            ("TRTLLM_NIXL_BOUNCE_ENABLE", "0"),
        ]);
        assert!(w.is_empty(), "{w:?}");
        let want = BounceConfig {
            enabled: true,
            arena_size_bytes: ByteSize(512 * MIB),
            arena_allocation_granularity_bytes: ByteSize(64 * KIB),
            max_chunk_size_bytes: ByteSize(4 * MIB),
            max_inflight_chunks_per_request: 3,
            copy_stream_count: 2,
            scatter_worker_count: 6,
            min_descriptor_count: 0,
            max_average_descriptor_size_bytes: ByteSize(KIB),
            request_timeout_ms: 1500,
            disable_fabric_memory: true,
            enable_eager_gather: false,
            use_nixl_notifications: true,
            use_zero_copy_arguments: false,
            use_cub_copy: true,
            disable_scatter_run_merging: true,
            control_transport: ControlTransport::Tcp,
            io_busy_poll_us: BusyPoll::Micros(500),
            grant_policy: GrantPolicy::OldestFirst,
            uniform_data: false,
            batch_gathers: false,
            eager_grant_order: false,
            release_staging_on_write: false,
            grant_size_weight: 4,
            block_data: false,
        };
        assert_eq!(c, want);
    }

    #[test]
    fn uniform_data_defaults_on_and_parses_from_yaml_and_env() {
        assert!(BounceConfig::default().uniform_data);
        let c = BounceConfig::from_yaml_str("uniformData: false").unwrap();
        assert!(!c.uniform_data);
        let mut c = BounceConfig::default();
        let w = c.apply_env_vars([("KVFABRIC_BOUNCE_UNIFORM_DATA", "off")]);
        assert!(w.is_empty() && !c.uniform_data, "{w:?}");
        let e = BounceConfig::from_yaml_str("uniformData: maybe").unwrap_err();
        assert!(e.to_string().contains("uniformData"), "{e}");
    }

    #[test]
    fn block_data_defaults_on_and_parses_from_yaml_and_env() {
        assert!(BounceConfig::default().block_data);
        let c = BounceConfig::from_yaml_str("blockData: false").unwrap();
        assert!(!c.block_data && c.uniform_data);
        let mut c = BounceConfig::default();
        let w = c.apply_env_vars([("KVFABRIC_BOUNCE_BLOCK_DATA", "off")]);
        assert!(w.is_empty() && !c.block_data, "{w:?}");
        let e = BounceConfig::from_yaml_str("blockData: sometimes").unwrap_err();
        assert!(e.to_string().contains("blockData"), "{e}");
    }

    #[test]
    fn batch_gathers_defaults_on_and_parses_from_yaml_and_env() {
        assert!(BounceConfig::default().batch_gathers);
        let c = BounceConfig::from_yaml_str("batchGathers: false").unwrap();
        assert!(!c.batch_gathers);
        let mut c = BounceConfig::default();
        let w = c.apply_env_vars([("KVFABRIC_BOUNCE_BATCH_GATHERS", "off")]);
        assert!(w.is_empty() && !c.batch_gathers, "{w:?}");
        let e = BounceConfig::from_yaml_str("batchGathers: 2").unwrap_err();
        assert!(e.to_string().contains("batchGathers"), "{e}");
    }

    #[test]
    fn grant_policy_parses_from_yaml_and_env_and_rejects_bad_values() {
        assert_eq!(
            BounceConfig::default().grant_policy,
            GrantPolicy::ShortestFirst
        );
        // The non-default value, so the field is really read.
        let c = BounceConfig::from_yaml_str("grantPolicy: oldestFirst").unwrap();
        assert_eq!(c.grant_policy, GrantPolicy::OldestFirst);
        let y = serde_yaml::to_string(&c).unwrap();
        assert!(y.contains("grantPolicy: oldestFirst"), "{y}");
        let e = BounceConfig::from_yaml_str("grantPolicy: fifo")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("grantPolicy") && e.contains("roundRobin/oldestFirst"),
            "{e}"
        );
        let mut c = BounceConfig::default();
        let w = c.apply_env_vars([("KVFABRIC_BOUNCE_GRANT_POLICY", "newest")]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(c, BounceConfig::default());
        for (raw, want) in [
            ("RoundRobin", GrantPolicy::RoundRobin),
            (" round_robin ", GrantPolicy::RoundRobin),
            ("OLDESTFIRST", GrantPolicy::OldestFirst),
            ("shortest-first", GrantPolicy::ShortestFirst),
            ("shortestFirst", GrantPolicy::ShortestFirst),
        ] {
            let mut c = BounceConfig::default();
            assert!(c
                .apply_env_vars([("KVFABRIC_BOUNCE_GRANT_POLICY", raw)])
                .is_empty());
            assert_eq!(c.grant_policy, want, "{raw}");
        }
        let v = BounceConfig {
            grant_policy: GrantPolicy::OldestFirst,
            ..BounceConfig::default()
        }
        .validate()
        .unwrap();
        assert_eq!(v.grant_policy(), GrantPolicy::OldestFirst);
    }

    #[test]
    fn grant_size_weight_parses_and_is_range_checked() {
        assert_eq!(
            BounceConfig::default()
                .validate()
                .unwrap()
                .grant_size_weight(),
            DEFAULT_SIZE_WEIGHT
        );
        let c = BounceConfig::from_yaml_str("grantSizeWeight: 2").unwrap();
        assert_eq!(c.validate().unwrap().grant_size_weight(), 2);
        for bad in [0, MAX_GRANT_SIZE_WEIGHT + 1] {
            let e = BounceConfig {
                grant_size_weight: bad,
                ..BounceConfig::default()
            }
            .validate()
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("grantSizeWeight") && e.contains("from 1 to 1024"),
                "{e}"
            );
        }
        let e = BounceConfig::from_yaml_str("grantSizeWeight: heavy")
            .unwrap_err()
            .to_string();
        assert!(e.contains("grantSizeWeight"), "{e}");
    }

    #[test]
    fn control_transport_and_busy_poll_parse_from_yaml_env_and_reject_bad_values() {
        let c = BounceConfig::from_yaml_str("controlTransport: tcp\nioBusyPollUs: 250").unwrap();
        assert_eq!(c.control_transport, ControlTransport::Tcp);
        assert_eq!(c.io_busy_poll_us, BusyPoll::Micros(250));
        let c = BounceConfig::from_yaml_str("ioBusyPollUs: auto").unwrap();
        assert_eq!(c.io_busy_poll_us, BusyPoll::Auto);
        // Defaults, and how they render (YAML and env).
        let d = BounceConfig::default();
        assert_eq!(
            (d.control_transport, d.io_busy_poll_us),
            (ControlTransport::Zmq, BusyPoll::Auto)
        );
        let y = serde_yaml::to_string(&d).unwrap();
        assert!(
            y.contains("controlTransport: zmq") && y.contains("ioBusyPollUs: auto"),
            "{y}"
        );
        // Bad YAML values name the field and the accepted forms.
        let e = BounceConfig::from_yaml_str("controlTransport: udp")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("controlTransport") && e.contains("zmq/tcp"),
            "{e}"
        );
        let e = BounceConfig::from_yaml_str("ioBusyPollUs: 2ms")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ioBusyPollUs") && e.contains("microseconds"),
            "{e}"
        );
        let e = BounceConfig::from_yaml_str("ioBusyPollUs: -5")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ioBusyPollUs"), "{e}");
        // A bad env value warns and leaves the field as it was.
        let mut c = BounceConfig::default();
        let w = c.apply_env_vars([
            ("KVFABRIC_BOUNCE_CONTROL_TRANSPORT", "udp"),
            ("KVFABRIC_BOUNCE_IO_BUSY_POLL_US", "2ms"),
        ]);
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(c, BounceConfig::default());
        // The effective control kind: notifications win over the transport.
        let mut c = BounceConfig {
            control_transport: ControlTransport::Tcp,
            ..BounceConfig::default()
        };
        assert_eq!(c.validate().unwrap().control_kind(), ControlKind::Tcp);
        c.use_nixl_notifications = true;
        assert_eq!(c.validate().unwrap().control_kind(), ControlKind::NixlNotif);
        assert_eq!(
            BounceConfig::default().validate().unwrap().control_kind(),
            ControlKind::Zmq
        );
    }

    #[test]
    fn legacy_variable_names_apply_with_a_warning_unless_the_new_one_is_set() {
        let mut c = BounceConfig::default();
        let w = c.apply_env_vars([
            ("KVFABRIC_CONTROL_TRANSPORT", "tcp"),
            ("KVFABRIC_IO_BUSY_POLL_US", "0"),
        ]);
        assert_eq!(c.control_transport, ControlTransport::Tcp);
        assert_eq!(c.io_busy_poll_us, BusyPoll::Micros(0));
        assert_eq!(w.len(), 2, "{w:?}");
        let text = w[0].to_string();
        assert!(
            text.contains("KVFABRIC_CONTROL_TRANSPORT is deprecated")
                && text.contains("KVFABRIC_BOUNCE_CONTROL_TRANSPORT"),
            "{text}"
        );
        // Both names: the new one wins, whatever the order.
        let mut c = BounceConfig::default();
        let w = c.apply_env_vars([
            ("KVFABRIC_BOUNCE_IO_BUSY_POLL_US", "300"),
            ("KVFABRIC_IO_BUSY_POLL_US", "0"),
        ]);
        assert_eq!(c.io_busy_poll_us, BusyPoll::Micros(300));
        assert!(w[0].to_string().contains("ignored"), "{w:?}");
        assert!(is_config_env("KVFABRIC_IO_BUSY_POLL_US"));
        assert!(is_config_env("KVFABRIC_BOUNCE_ENABLE"));
        assert!(!is_config_env("KVFABRIC_LOG"));
    }

    #[test]
    fn busy_poll_above_the_cap_is_a_validation_error() {
        let c = BounceConfig {
            io_busy_poll_us: BusyPoll::Micros(MAX_BUSY_POLL_US + 1),
            ..BounceConfig::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("ioBusyPollUs") && e.contains("100000"), "{e}");
        let ok = BounceConfig {
            io_busy_poll_us: BusyPoll::Micros(MAX_BUSY_POLL_US),
            ..BounceConfig::default()
        };
        assert!(ok.validate().is_ok());
    }

    #[test]
    fn busy_poll_window_by_cpu_count() {
        use std::time::Duration;
        assert_eq!(BusyPoll::Auto.window(2), Duration::ZERO);
        assert_eq!(
            BusyPoll::Auto.window(BUSY_POLL_AUTO_MIN_CPUS - 1),
            Duration::ZERO
        );
        assert_eq!(
            BusyPoll::Auto.window(BUSY_POLL_AUTO_MIN_CPUS),
            Duration::from_millis(2)
        );
        assert_eq!(BusyPoll::Micros(500).window(2), Duration::from_micros(500));
        assert_eq!(BusyPoll::Micros(0).window(64), Duration::ZERO);
    }

    #[test]
    fn config_env_bool_spellings() {
        for (s, want) in [
            ("1", true),
            ("0", false),
            ("true", true),
            ("FALSE", false),
            ("On", true),
            ("oFF", false),
            ("YES", true),
            ("no", false),
            (" true ", true),
        ] {
            let (c, w) = env(&[("KVFABRIC_BOUNCE_ENABLE", s)]);
            assert!(w.is_empty(), "{s:?}");
            assert_eq!(c.enabled, want, "{s:?}");
        }
    }

    #[test]
    fn config_env_garbage_keeps_default_with_warning_never_zero() {
        let garbage = [
            "lots",
            "",
            "  ",
            "-5",
            "1.5G",
            "0x10",
            "12 parsecs",
            "99999999999G",
        ];
        for bad in garbage {
            for name in [
                "ARENA_SIZE_BYTES",
                "ARENA_ALLOCATION_GRANULARITY_BYTES",
                "MAX_CHUNK_SIZE_BYTES",
                "MAX_AVERAGE_DESCRIPTOR_SIZE_BYTES",
                "MAX_INFLIGHT_CHUNKS_PER_REQUEST",
                "COPY_STREAM_COUNT",
                "SCATTER_WORKER_COUNT",
                "MIN_DESCRIPTOR_COUNT",
                "REQUEST_TIMEOUT_MS",
                "ENABLE_EAGER_GATHER",
                "USE_ZERO_COPY_ARGUMENTS",
            ] {
                let var = format!("{ENV_PREFIX}{name}");
                let (c, w) = env(&[(var.as_str(), bad)]);
                assert_eq!(c, BounceConfig::default(), "{var}={bad:?}");
                assert_eq!(w.len(), 1, "{var}={bad:?}");
                match &w[0] {
                    ConfigWarning::InvalidValue {
                        variable,
                        value,
                        kept,
                        ..
                    } => {
                        assert_eq!(variable, &var);
                        assert_eq!(value, bad);
                        assert_ne!(kept, "0");
                    }
                    other => panic!("unexpected {other:?}"),
                }
                let text = w[0].to_string();
                assert!(text.contains(&var), "{text}");
                assert!(text.contains("expected"), "{text}");
            }
        }
        // The message carries the expected form and the kept value.
        let (_, w) = env(&[("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "lots")]);
        let text = w[0].to_string();
        assert!(text.contains("\"lots\""), "{text}");
        assert!(text.contains("\"256MiB\""), "{text}");
        assert!(text.contains("keeping 536870912"), "{text}");
        // 2^32 does not fit W's u32: warning, not truncation.
        let (c, w) = env(&[("KVFABRIC_BOUNCE_COPY_STREAM_COUNT", "4294967296")]);
        assert_eq!(c.copy_stream_count, 8);
        assert_eq!(w.len(), 1);
        // "maybe" is not a bool.
        let (c, w) = env(&[("KVFABRIC_BOUNCE_ENABLE_EAGER_GATHER", "maybe")]);
        assert!(c.enable_eager_gather);
        assert!(w[0].to_string().contains("1/0/true/false/on/off/yes/no"));
    }

    #[test]
    fn config_env_bad_value_keeps_previous_layer() {
        let mut c = BounceConfig::from_yaml_str("arenaSizeBytes: 1GiB").unwrap();
        let w = c.apply_env_vars([("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "huge")]);
        assert_eq!(c.arena_size_bytes.get(), GIB);
        assert!(w[0].to_string().contains("keeping 1073741824"));
    }

    #[test]
    fn config_env_unknown_variable_warns_and_last_wins() {
        let (c, w) = env(&[
            ("KVFABRIC_BOUNCE_ARENA_SIZE", "1G"),
            ("KVFABRIC_BOUNCE_COPY_STREAM_COUNT", "2"),
            ("KVFABRIC_BOUNCE_COPY_STREAM_COUNT", "3"),
        ]);
        assert_eq!(c.copy_stream_count, 3);
        assert_eq!(c.arena_size_bytes, BounceConfig::default().arena_size_bytes);
        assert_eq!(
            w,
            vec![ConfigWarning::UnknownVariable {
                variable: "KVFABRIC_BOUNCE_ARENA_SIZE".into()
            }]
        );
    }

    #[test]
    fn config_env_parsed_zero_is_applied_then_rejected() {
        let (c, w) = env(&[("KVFABRIC_BOUNCE_SCATTER_WORKER_COUNT", "0")]);
        assert!(w.is_empty());
        assert_eq!(
            c.validate().unwrap_err().fields(),
            vec!["scatterWorkerCount"]
        );
    }

    #[test]
    fn config_to_env_vars_round_trips() {
        let mut c = BounceConfig::from_yaml_str(
            "enabled: true\narenaSizeBytes: 3GiB\nuseCubCopy: true\nrequestTimeoutMs: 7",
        )
        .unwrap();
        c.max_inflight_chunks_per_request = 1;
        c.control_transport = ControlTransport::Tcp;
        c.io_busy_poll_us = BusyPoll::Micros(750);
        let vars = c.to_env_vars();
        assert_eq!(vars.len(), FIELDS.len());
        assert!(vars.contains(&(
            "KVFABRIC_BOUNCE_ARENA_SIZE_BYTES".into(),
            (3 * GIB).to_string()
        )));
        let (back, w) = {
            let mut b = BounceConfig::default();
            let w = b.apply_env_vars(vars);
            (b, w)
        };
        assert!(w.is_empty());
        assert_eq!(back, c);
    }

    #[test]
    fn config_field_table_matches_serde_and_seed_names() {
        let v = serde_yaml::to_value(BounceConfig::default()).unwrap();
        let keys: Vec<&str> = v
            .as_mapping()
            .unwrap()
            .keys()
            .map(|k| k.as_str().unwrap())
            .collect();
        let table: Vec<&str> = FIELDS.iter().map(|f| f.yaml).collect();
        assert_eq!(keys, table);
        // env suffix = SCREAMING_SNAKE of the camelCase name, except the
        // seed's "enabled" -> ENABLE.
        for f in FIELDS {
            let mut snake = String::new();
            for ch in f.yaml.chars() {
                if ch.is_ascii_uppercase() {
                    snake.push('_');
                }
                snake.push(ch.to_ascii_uppercase());
            }
            if f.yaml == "enabled" {
                snake = "ENABLE".into();
            }
            assert_eq!(f.env, snake);
        }
    }

    #[test]
    fn config_serializes_bytes_as_integers() {
        let y = serde_yaml::to_string(&BounceConfig::default()).unwrap();
        assert!(y.contains("arenaSizeBytes: 536870912\n"), "{y}");
        assert!(y.contains("maxAverageDescriptorSizeBytes: 16384\n"), "{y}");
        assert_eq!(
            BounceConfig::from_yaml_str(&y).unwrap(),
            BounceConfig::default()
        );
    }

    #[test]
    fn config_yaml_accepts_integers_strings_and_defaults_missing() {
        let c = BounceConfig::from_yaml_str(
            "arenaSizeBytes: \"512 MiB\"\n\
             arenaAllocationGranularityBytes: 65536\n\
             maxChunkSizeBytes: 8M\n\
             maxAverageDescriptorSizeBytes: 4KiB\n\
             copyStreamCount: \"3\"\n\
             enabled: yes\n",
        )
        .unwrap();
        assert_eq!(c.arena_size_bytes.get(), 512 * MIB);
        assert_eq!(c.arena_allocation_granularity_bytes.get(), 64 * KIB);
        assert_eq!(c.max_chunk_size_bytes.get(), 8 * MIB);
        assert_eq!(c.max_average_descriptor_size_bytes.get(), 4 * KIB);
        assert_eq!(c.copy_stream_count, 3);
        assert!(c.enabled);
        assert_eq!(c.scatter_worker_count, 4);
        assert_eq!(c.request_timeout_ms, 30_000);
        for empty in ["", "   \n", "# only a comment\n", "---\n", "null"] {
            assert_eq!(
                BounceConfig::from_yaml_str(empty).unwrap(),
                BounceConfig::default(),
                "{empty:?}"
            );
        }
    }

    fn yaml_err(y: &str) -> String {
        match BounceConfig::from_yaml_str(y) {
            Err(ConfigError::Yaml { message }) => message,
            other => panic!("{y:?}: expected a YAML error, got {other:?}"),
        }
    }

    #[test]
    fn config_yaml_errors_name_field_and_form() {
        let m = yaml_err("arenaSizeBytes: lots");
        assert!(
            m.starts_with(
                "arenaSizeBytes: expected a byte size like 268435456, \"256MiB\" or \"1G\", got \"lots\""
            ),
            "{m}"
        );
        let m = yaml_err("maxChunkSizeBytes: -1");
        assert!(
            m.starts_with("maxChunkSizeBytes: expected a byte size"),
            "{m}"
        );
        assert!(m.contains("got -1"), "{m}");
        let m = yaml_err("maxChunkSizeBytes: 99999999999G");
        assert!(m.contains("overflows"), "{m}");
        let m = yaml_err("maxChunkSizeBytes: 1.5");
        assert!(m.starts_with("maxChunkSizeBytes: expected"), "{m}");
        let m = yaml_err("maxInflightChunksPerRequest: eight");
        assert!(
            m.starts_with("maxInflightChunksPerRequest: expected a non-negative integer"),
            "{m}"
        );
        let m = yaml_err("copyStreamCount: 4294967296");
        assert!(m.starts_with("copyStreamCount: expected"), "{m}");
        let m = yaml_err("requestTimeoutMs: -3");
        assert!(m.starts_with("requestTimeoutMs: expected"), "{m}");
        let m = yaml_err("enabled: maybe");
        assert!(
            m.starts_with("enabled: expected a boolean (true/false), got \"maybe\""),
            "{m}"
        );
        let m = yaml_err("useCubCopy: 1");
        assert!(m.starts_with("useCubCopy: expected a boolean"), "{m}");
        let m = yaml_err("arenaSizeBytes: [1, 2]");
        assert!(m.starts_with("arenaSizeBytes: expected"), "{m}");
        assert!(m.contains("got a sequence"), "{m}");
        let m = yaml_err("arenaSizeBytes:");
        assert!(
            m.contains("arenaSizeBytes: expected") && m.contains("got null"),
            "{m}"
        );
        let m = yaml_err("arenaSizeByte: 1G");
        assert!(m.contains("unknown field `arenaSizeByte`"), "{m}");
        let m = yaml_err("arena_size_bytes: 1G");
        assert!(m.contains("unknown field `arena_size_bytes`"), "{m}");
        let m = yaml_err("- 1\n- 2");
        assert!(m.contains("BounceConfig"), "{m}");
        let m = yaml_err("enabled: [unclosed");
        assert!(!m.is_empty());
    }

    #[test]
    fn config_json_crd_path_names_field() {
        // The CRD embeds the struct; any serde source gets the same errors.
        let value = serde_yaml::Value::String("1 parsec".into());
        let mut map = serde_yaml::Mapping::new();
        map.insert("maxAverageDescriptorSizeBytes".into(), value);
        let err = serde_yaml::from_value::<BounceConfig>(map.into()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("maxAverageDescriptorSizeBytes: expected a byte size"),
            "{err}"
        );
    }

    #[test]
    fn config_max_chunk_clamped_to_max_allocation() {
        let c = BounceConfig {
            arena_size_bytes: ByteSize(16 * MIB),
            max_chunk_size_bytes: ByteSize(64 * MIB),
            ..Default::default()
        };
        let e = c.validate().unwrap();
        assert_eq!(e.max_chunk_size_bytes(), 16 * MIB);
        assert!(e.max_chunk_clamped());
        assert_eq!(
            e.notes(),
            &[ConfigNote::MaxChunkClamped {
                requested: 64 * MIB,
                clamped_to: 16 * MIB
            }]
        );
        assert_eq!(e.config().max_chunk_size_bytes.get(), 64 * MIB);

        // 3 GiB arena: usable 3 GiB, but the largest block is 2 GiB.
        let c = BounceConfig {
            arena_size_bytes: ByteSize(3 * GIB),
            max_chunk_size_bytes: ByteSize(3 * GIB),
            ..Default::default()
        };
        let e = c.validate().unwrap();
        assert_eq!(e.arena_usable_capacity_bytes(), 3 * GIB);
        assert_eq!(e.max_allocation_bytes(), 2 * GIB);
        assert_eq!(e.max_chunk_size_bytes(), 2 * GIB);
        assert_eq!(e.eager_budget_bytes(), 3 * GIB / 2);

        // Exactly at the limit: no clamp.
        let c = BounceConfig {
            arena_size_bytes: ByteSize(32 * MIB),
            max_chunk_size_bytes: ByteSize(32 * MIB),
            ..Default::default()
        };
        let e = c.validate().unwrap();
        assert_eq!(e.max_chunk_size_bytes(), 32 * MIB);
        assert!(!e.max_chunk_clamped());
        assert!(e.notes().is_empty());
    }

    #[test]
    fn config_arena_not_multiple_of_granularity_is_noted() {
        let c = BounceConfig {
            arena_size_bytes: ByteSize(10 * MIB + 123),
            max_chunk_size_bytes: ByteSize(MIB),
            ..Default::default()
        };
        let e = c.validate().unwrap();
        assert_eq!(e.arena_usable_capacity_bytes(), 10 * MIB);
        assert_eq!(e.max_allocation_bytes(), 8 * MIB);
        assert_eq!(e.eager_budget_bytes(), 5 * MIB);
        assert_eq!(
            e.notes(),
            &[ConfigNote::ArenaNotGranularityMultiple {
                arena_size_bytes: 10 * MIB + 123,
                usable_capacity_bytes: 10 * MIB
            }]
        );
    }

    fn rejected(c: BounceConfig) -> Vec<FieldError> {
        match c.validate() {
            Err(ConfigError::Invalid { errors }) => errors,
            other => panic!("expected rejection, got {other:?}"),
        }
    }

    #[test]
    fn config_rejects_each_impossible_value() {
        let d = BounceConfig::default;
        let cases: Vec<(BounceConfig, &str, &str)> = vec![
            (
                BounceConfig {
                    arena_allocation_granularity_bytes: ByteSize(1000),
                    ..d()
                },
                "arenaAllocationGranularityBytes",
                "power of two",
            ),
            (
                BounceConfig {
                    arena_allocation_granularity_bytes: ByteSize(16),
                    ..d()
                },
                "arenaAllocationGranularityBytes",
                "≥ 32",
            ),
            (
                BounceConfig {
                    arena_allocation_granularity_bytes: ByteSize(0),
                    ..d()
                },
                "arenaAllocationGranularityBytes",
                "power of two",
            ),
            (
                BounceConfig {
                    arena_size_bytes: ByteSize(0),
                    ..d()
                },
                "arenaSizeBytes",
                "greater than 0",
            ),
            (
                BounceConfig {
                    arena_size_bytes: ByteSize(512 * KIB),
                    ..d()
                },
                "arenaSizeBytes",
                "at least one arenaAllocationGranularityBytes block",
            ),
            (
                BounceConfig {
                    max_chunk_size_bytes: ByteSize(0),
                    ..d()
                },
                "maxChunkSizeBytes",
                "greater than 0",
            ),
            (
                BounceConfig {
                    max_inflight_chunks_per_request: 0,
                    ..d()
                },
                "maxInflightChunksPerRequest",
                "≥ 1",
            ),
            (
                BounceConfig {
                    copy_stream_count: 0,
                    ..d()
                },
                "copyStreamCount",
                "≥ 1",
            ),
            (
                BounceConfig {
                    scatter_worker_count: 0,
                    ..d()
                },
                "scatterWorkerCount",
                "≥ 1",
            ),
            (
                BounceConfig {
                    request_timeout_ms: 0,
                    ..d()
                },
                "requestTimeoutMs",
                "≥ 1",
            ),
            (
                BounceConfig {
                    max_average_descriptor_size_bytes: ByteSize(0),
                    ..d()
                },
                "maxAverageDescriptorSizeBytes",
                "greater than 0",
            ),
        ];
        for (c, field, expected) in cases {
            let errors = rejected(c);
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert_eq!(errors[0].field, field);
            assert!(errors[0].expected.contains(expected), "{}", errors[0]);
            let text = ConfigError::Invalid { errors }.to_string();
            assert!(text.contains(field), "{text}");
        }
    }

    #[test]
    fn config_reports_all_violations_at_once() {
        let c = BounceConfig {
            arena_allocation_granularity_bytes: ByteSize(3 * MIB),
            max_chunk_size_bytes: ByteSize(0),
            copy_stream_count: 0,
            ..Default::default()
        };
        let err = c.validate().unwrap_err();
        assert_eq!(
            err.fields(),
            vec![
                "arenaAllocationGranularityBytes",
                "maxChunkSizeBytes",
                "copyStreamCount"
            ]
        );
        let text = err.to_string();
        assert!(text.contains("arenaAllocationGranularityBytes: expected a power of two"));
        assert!(text.contains("got 3145728"), "{text}");
    }

    #[test]
    fn config_minimal_valid_arena() {
        let c = BounceConfig {
            arena_size_bytes: ByteSize(32),
            arena_allocation_granularity_bytes: ByteSize(32),
            ..Default::default()
        };
        let e = c.validate().unwrap();
        assert_eq!(e.max_chunk_size_bytes(), 32);
        assert_eq!(e.arena_usable_capacity_bytes(), 32);
        assert_eq!(e.eager_budget_bytes(), 16);
    }

    #[test]
    fn config_control_kind_and_cub_copy() {
        let c = BounceConfig {
            use_nixl_notifications: true,
            use_cub_copy: true,
            ..Default::default()
        };
        let e = c.validate().unwrap();
        assert_eq!(e.control_kind(), ControlKind::NixlNotif);
        assert!(!e.use_cub_copy());
        assert!(e.config().use_cub_copy);
        assert_eq!(e.notes(), &[ConfigNote::CubCopyIgnored]);
    }

    #[test]
    fn config_env_overrides_yaml() {
        let mut c = BounceConfig::from_yaml_str(
            "enabled: true\narenaSizeBytes: 1G\nmaxChunkSizeBytes: 64MiB\ncopyStreamCount: 2",
        )
        .unwrap();
        let w = c.apply_env_vars([
            ("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "2G"),
            ("KVFABRIC_BOUNCE_COPY_STREAM_COUNT", "junk"),
            ("KVFABRIC_BOUNCE_ENABLE", "no"),
        ]);
        assert_eq!(w.len(), 1);
        assert!(!c.enabled); // env wins
        assert_eq!(c.arena_size_bytes.get(), 2 * GIB); // env wins
        assert_eq!(c.copy_stream_count, 2); // bad env keeps the YAML value
        assert_eq!(c.max_chunk_size_bytes.get(), 64 * MIB); // YAML kept
        assert_eq!(c.scatter_worker_count, 4); // default kept
        assert_eq!(c.validate().unwrap().max_chunk_size_bytes(), 64 * MIB);
    }

    #[test]
    fn config_from_yaml_str_validated() {
        let e = BounceConfig::from_yaml_str_validated("maxChunkSizeBytes: 1GiB").unwrap();
        assert_eq!(e.max_chunk_size_bytes(), 512 * MIB);
        let err = BounceConfig::from_yaml_str_validated("scatterWorkerCount: 0").unwrap_err();
        assert_eq!(err.fields(), vec!["scatterWorkerCount"]);
        assert!(matches!(
            BounceConfig::from_yaml_str_validated("copyStreamCount: x"),
            Err(ConfigError::Yaml { .. })
        ));
    }
}
