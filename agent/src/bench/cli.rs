//! Command-line helpers of the bench binaries (`kvfabric bench`,
//! `kvfabric dataplane-bench`, `kvfabric-gpu`): clap value parsers that
//! reject a bad value before anything runs, and [`ReportFile`], the report
//! path opened before a run so that an unwritable path is found at once.
//!
//! Each parser takes the argument's text and returns the value or an error
//! saying what was expected; clap prints it after the flag's name
//! (`error: invalid value '0' for '--speed <SPEED>': expected ...`) and
//! exits with status 2. None of them panics, whatever the text.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use kvfabric_core::config::parse_byte_size;
use kvfabric_core::model::{preset, ModelGeometry};

use super::trace::BenchPath;

/// Most requests in flight a replay accepts (`--concurrency`): one worker
/// thread each.
pub const MAX_CONCURRENCY: usize = 4096;

/// Longest wait for the agents in distributed mode (`--wait`), seconds:
/// one day.
pub const MAX_WAIT_S: u64 = 86_400;

/// A byte size with an optional suffix (`4096`, `64KiB`, `4M`, `1GiB`).
///
/// # Errors
/// Text that is not a byte size.
pub fn byte_size(s: &str) -> Result<u64, String> {
    parse_byte_size(s.trim()).map_err(|e| format!("{s:?}: {e}"))
}

/// A byte size of at least one byte.
///
/// # Errors
/// Text that is not a byte size, or 0.
pub fn nonzero_byte_size(s: &str) -> Result<u64, String> {
    match byte_size(s)? {
        0 => Err(format!("expected at least 1 byte, got {s:?}")),
        n => Ok(n),
    }
}

/// A finite number > 0 (a speed factor).
///
/// # Errors
/// Text that is not a number, or 0, negative, NaN or infinite.
pub fn positive_finite(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a number > 0, got {s:?}"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("expected a finite number > 0, got {s:?}"))
    }
}

/// Requests in flight: 1 to [`MAX_CONCURRENCY`].
///
/// # Errors
/// Text that is not an integer in that range.
pub fn concurrency(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_CONCURRENCY).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected an integer from 1 to {MAX_CONCURRENCY}, got {s:?}"
        )),
    }
}

/// A model preset by name (case-insensitive): Llama-3.1-8B,
/// Llama-3.1-70B, Qwen2.5-7B, gpt-oss-120b.
///
/// # Errors
/// An unknown name, with the known ones.
pub fn model_preset(s: &str) -> Result<ModelGeometry, String> {
    preset(s.trim())
}

/// A custom KV geometry `layers,kv_heads,head_dim,dtype_bytes`: four
/// integers, each at least 1.
///
/// # Errors
/// Another number of fields, a field that is not an integer in
/// `1..=u32::MAX` (named).
pub fn geometry(s: &str) -> Result<ModelGeometry, String> {
    const FIELDS: [&str; 4] = ["layers", "kv_heads", "head_dim", "dtype_bytes"];
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.len() != FIELDS.len() {
        return Err(format!(
            "expected 4 integers layers,kv_heads,head_dim,dtype_bytes, got {} field(s) in {s:?}",
            parts.len()
        ));
    }
    let mut v = [0u32; 4];
    for ((field, part), out) in FIELDS.iter().zip(&parts).zip(&mut v) {
        *out = match part.parse::<u32>() {
            Ok(n) if n > 0 => n,
            _ => {
                return Err(format!(
                    "{field}: expected an integer from 1 to {}, got {part:?}",
                    u32::MAX
                ))
            }
        };
    }
    let [layers, kv_heads, head_dim, dtype_bytes] = v;
    Ok(ModelGeometry {
        name: format!("custom({layers},{kv_heads},{head_dim},{dtype_bytes})"),
        layers,
        kv_heads,
        head_dim,
        dtype_bytes,
    })
}

/// A replay path: `bounce` or `standard`.
///
/// # Errors
/// Any other text.
pub fn bench_path(s: &str) -> Result<BenchPath, String> {
    s.parse()
}

/// Text that is not empty (or only spaces); returned trimmed.
///
/// # Errors
/// Empty text.
pub fn non_empty(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.is_empty() {
        Err("expected a non-empty value".into())
    } else {
        Ok(t.to_string())
    }
}

/// A report file opened (created if missing) before the run, written at
/// its end: an unwritable path is an error before any work. An existing
/// file is replaced only by [`ReportFile::write`]; a file this created is
/// removed again when it is dropped unwritten (the run failed).
#[derive(Debug)]
pub struct ReportFile {
    path: PathBuf,
    file: Option<File>,
    created: bool,
}

impl ReportFile {
    /// Opens `path` for writing, creating it when missing; `flag` names
    /// the option that gave the path, for the error.
    ///
    /// # Errors
    /// `flag`, the path and the OS error when it cannot be opened for
    /// writing (a missing directory, no permission, a directory).
    pub fn open(flag: &str, path: &Path) -> Result<Self, String> {
        let existed = path.symlink_metadata().is_ok();
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| format!("{flag} {}: {e}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            file: Some(file),
            created: !existed,
        })
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces the file's contents with `text`.
    ///
    /// # Errors
    /// The path and the OS error of a failed write.
    pub fn write(mut self, text: &str) -> Result<(), String> {
        let mut file = self.file.take().ok_or("report file already written")?;
        let err = |e: std::io::Error| format!("{}: {e}", self.path.display());
        file.set_len(0).map_err(err)?;
        file.write_all(text.as_bytes()).map_err(err)?;
        file.flush().map_err(err)
    }
}

impl Drop for ReportFile {
    fn drop(&mut self) {
        if self.file.take().is_some() && self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parsers_reject_what_used_to_panic() {
        for bad in ["0", "-1", "nan", "NaN", "inf", "-inf", "", "x", "1e999"] {
            assert!(positive_finite(bad).is_err(), "{bad}");
        }
        assert_eq!(positive_finite(" 2.5 "), Ok(2.5));
        assert!(geometry("0,0,0,0").unwrap_err().starts_with("layers:"));
        assert!(geometry("32,8,0,2").unwrap_err().starts_with("head_dim:"));
        assert!(geometry("32,8,128").unwrap_err().contains("3 field"));
        assert!(geometry("32,8,128,2,1").is_err());
        assert!(geometry("32,8,128,-2")
            .unwrap_err()
            .starts_with("dtype_bytes:"));
        let g = geometry("32, 8, 128, 2").unwrap();
        assert_eq!(
            (g.layers, g.kv_heads, g.head_dim, g.dtype_bytes),
            (32, 8, 128, 2)
        );
        assert!(concurrency("0").is_err());
        assert!(concurrency("4097").is_err());
        assert_eq!(concurrency("32"), Ok(32));
        assert!(nonzero_byte_size("0").is_err());
        assert!(nonzero_byte_size("0GiB").is_err());
        assert_eq!(nonzero_byte_size("1GiB"), Ok(1 << 30));
        assert!(non_empty("  ").is_err());
        assert!(model_preset("gpt-5").unwrap_err().contains("Llama-3.1-8B"));
        assert_eq!(bench_path("bounce"), Ok(BenchPath::Bounce));
    }

    #[test]
    fn report_file_is_checked_up_front_and_cleaned_up_unwritten() {
        let dir = std::env::temp_dir().join(format!("kvfabric-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = ReportFile::open("--json", &dir.join("missing/r.json")).unwrap_err();
        assert!(e.starts_with("--json "), "{e}");
        assert!(ReportFile::open("--json", &dir).is_err(), "a directory");
        let p = dir.join("r.json");
        drop(ReportFile::open("--json", &p).unwrap());
        assert!(!p.exists(), "created, unwritten: removed");
        std::fs::write(&p, "old report, longer than the new one").unwrap();
        drop(ReportFile::open("--json", &p).unwrap());
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "old report, longer than the new one",
            "an existing report survives a failed run"
        );
        ReportFile::open("--json", &p).unwrap().write("{}").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    proptest! {
        /// No text makes a parser panic, and what they accept holds their
        /// promise.
        #[test]
        fn parsers_never_panic(s in ".{0,40}", n in any::<f64>(), g in proptest::collection::vec(any::<i64>(), 0..6)) {
            if let Ok(v) = positive_finite(&s) {
                prop_assert!(v.is_finite() && v > 0.0);
            }
            if let Ok(v) = positive_finite(&n.to_string()) {
                prop_assert!(v.is_finite() && v > 0.0);
            }
            let text = g.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
            for t in [&s, &text] {
                if let Ok(m) = geometry(t) {
                    prop_assert!(m.layers > 0 && m.kv_heads > 0 && m.head_dim > 0 && m.dtype_bytes > 0);
                }
                if let Ok(c) = concurrency(t) {
                    prop_assert!((1..=MAX_CONCURRENCY).contains(&c));
                }
                if let Ok(b) = nonzero_byte_size(t) {
                    prop_assert!(b > 0);
                }
                let _ = byte_size(t);
                let _ = model_preset(t);
                let _ = bench_path(t);
                let _ = non_empty(t);
            }
        }
    }
}
