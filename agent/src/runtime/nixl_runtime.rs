//! Locating and loading the NIXL runtime libraries.
//!
//! `nixl-sys` is built with its `stub-api` feature: the binary carries stubs
//! that `dlopen("libnixl_capi.so")` on first use and `abort()` the process
//! when the library is missing. [`ensure_loaded`] runs first and turns a
//! missing install into a clear error naming `e2e/install-nixl.sh`.
//!
//! The directory is, in order: `$KVFABRIC_NIXL_DIR`, `<exe dir>/nixl`,
//! `<exe dir>/../nixl`, then `<repo>/.nixl/lib` (where the install script
//! puts it in a checkout). The library set keeps the wheel's relative
//! RPATHs (`$ORIGIN/.`), so no `LD_LIBRARY_PATH` is needed.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Why the NIXL runtime could not be loaded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NixlRuntimeError {
    /// No candidate directory holds `libnixl_capi.so`.
    #[error("NIXL runtime not found (looked in: {searched}); run e2e/install-nixl.sh (or set KVFABRIC_NIXL_DIR to a directory holding libnixl_capi.so)")]
    NotFound {
        /// The directories searched, comma-separated.
        searched: String,
    },
    /// The library exists but `dlopen` failed (a dependency is missing or
    /// the set is incomplete).
    #[error("NIXL runtime at {path} failed to load: {reason}; re-run e2e/install-nixl.sh")]
    LoadFailed {
        /// The library path tried.
        path: String,
        /// `dlerror()` text.
        reason: String,
    },
}

static LOADED: OnceLock<Result<PathBuf, NixlRuntimeError>> = OnceLock::new();

/// Candidate directories, most specific first.
pub fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("KVFABRIC_NIXL_DIR") {
        dirs.push(PathBuf::from(d));
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            dirs.push(dir.join("nixl"));
            dirs.push(dir.join("../nixl"));
        }
    }
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.nixl/lib"));
    dirs
}

/// Loads `libnixl_capi.so` (once per process) with `RTLD_GLOBAL`, so the
/// `nixl-sys` stubs find it by soname, and points `NIXL_PLUGIN_DIR` at its
/// `plugins/` folder unless already set. Returns the directory used.
///
/// # Errors
/// [`NixlRuntimeError::NotFound`] when no candidate directory has the
/// library, [`NixlRuntimeError::LoadFailed`] when `dlopen` fails.
pub fn ensure_loaded() -> Result<PathBuf, NixlRuntimeError> {
    LOADED.get_or_init(load).clone()
}

fn load() -> Result<PathBuf, NixlRuntimeError> {
    let dirs = candidate_dirs();
    let Some(dir) = dirs
        .iter()
        .find(|d| d.join("libnixl_capi.so").is_file())
        .cloned()
    else {
        return Err(NixlRuntimeError::NotFound {
            searched: dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        });
    };
    let dir = dir.canonicalize().unwrap_or(dir);
    if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
        // Set before any NIXL agent exists; nothing else reads it concurrently
        // at this point (ensure_loaded runs before the first agent).
        std::env::set_var("NIXL_PLUGIN_DIR", dir.join("plugins"));
    }
    let lib = dir.join("libnixl_capi.so");
    let c_path = CString::new(lib.to_string_lossy().as_bytes()).map_err(|_| {
        NixlRuntimeError::LoadFailed {
            path: lib.display().to_string(),
            reason: "path contains a NUL byte".into(),
        }
    })?;
    // SAFETY: c_path is a valid NUL-terminated string; the handle is kept
    // for the life of the process (never dlclose'd).
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or NULL.
        let reason = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown dlopen error".to_string()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(NixlRuntimeError::LoadFailed {
            path: lib.display().to_string(),
            reason,
        });
    }
    Ok(dir)
}
