//! Integration tests of the bounce config through the public API only:
//! the layered pipeline `defaults → YAML → env → validate`, and
//! `from_env` reading the real process environment.

use kvfabric_core::config::{BounceConfig, ConfigError, ConfigWarning, ENV_PREFIX};
use kvfabric_core::ControlKind;

#[test]
fn config_layered_pipeline_yaml_then_env_then_validate() {
    let yaml = "\
enabled: true
arenaSizeBytes: 64MiB
arenaAllocationGranularityBytes: 64KiB
maxChunkSizeBytes: 128M
useNixlNotifications: true
";
    let mut cfg = BounceConfig::from_yaml_str(yaml).expect("valid YAML");
    let warnings = cfg.apply_env_vars([
        ("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES", "96 MiB"),
        (
            "KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST",
            "not-a-number",
        ),
        ("PATH", "/usr/bin"),
    ]);
    assert_eq!(warnings.len(), 1);
    assert!(matches!(
        &warnings[0],
        ConfigWarning::InvalidValue { variable, kept, .. }
            if variable == "KVFABRIC_BOUNCE_MAX_INFLIGHT_CHUNKS_PER_REQUEST" && kept == "8"
    ));

    let eff = cfg.validate().expect("valid");
    assert!(eff.enabled());
    assert_eq!(eff.arena_size_bytes(), 96 << 20);
    assert_eq!(eff.granularity_bytes(), 64 << 10);
    assert_eq!(eff.arena_usable_capacity_bytes(), 96 << 20);
    // 96 MiB = 64 MiB + 32 MiB top-level blocks: the largest is 64 MiB.
    assert_eq!(eff.max_allocation_bytes(), 64 << 20);
    assert_eq!(eff.max_chunk_size_bytes(), 64 << 20);
    assert!(eff.max_chunk_clamped());
    assert_eq!(eff.eager_budget_bytes(), 48 << 20);
    assert_eq!(eff.control_kind(), ControlKind::NixlNotif);
    assert_eq!(eff.max_inflight_chunks_per_request(), 8);
    assert_eq!(eff.notes().len(), 1);
    assert!(eff.notes()[0].to_string().contains("clamped to 67108864"));
}

#[test]
fn config_yaml_error_message_is_actionable() {
    let err = BounceConfig::from_yaml_str("enabled: true\narenaSizeBytes: lots\n").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ConfigError::Yaml { .. }));
    assert!(
        text.contains(
            "arenaSizeBytes: expected a byte size like 268435456, \"256MiB\" or \"1G\", got \"lots\""
        ),
        "{text}"
    );
    // Syntax errors carry the location.
    let text = BounceConfig::from_yaml_str("enabled: true\narenaSizeBytes: [1\n")
        .unwrap_err()
        .to_string();
    assert!(text.contains("line"), "{text}");
}

#[test]
fn config_from_env_reads_process_environment() {
    // The only test in this binary that touches the process environment.
    std::env::set_var(format!("{ENV_PREFIX}ENABLE"), "on");
    std::env::set_var(format!("{ENV_PREFIX}ARENA_SIZE_BYTES"), "garbage");
    std::env::set_var(format!("{ENV_PREFIX}REQUEST_TIMEOUT_MS"), "1234");
    let (cfg, warnings) = BounceConfig::from_env();
    assert!(cfg.enabled);
    assert_eq!(
        cfg.arena_size_bytes.get(),
        512 << 20,
        "garbage never becomes 0 (the default is kept)"
    );
    assert_eq!(cfg.request_timeout_ms, 1234);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0]
        .to_string()
        .contains("KVFABRIC_BOUNCE_ARENA_SIZE_BYTES=\"garbage\""));
}
