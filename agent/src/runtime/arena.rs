//! Host-memory bounce arena (seed §4 `BounceArena`): one buffer, allocated
//! and registered with the transfer engine once at start-up (never on the
//! request path), sliced into variable-size regions by the credit
//! scheduler. A region's handle is its byte offset; `addr = base + offset`.
//! The GPU arena (device memory) plugs into the same shape behind `cuda`.

use std::alloc::{alloc_zeroed, dealloc, Layout};

/// Alignment of the arena base (bytes): a page, so regions can be 32-byte
/// aligned offsets from it and registration covers whole pages.
pub const ARENA_ALIGN: usize = 4096;

/// A page-aligned, zero-initialised host buffer of `len` bytes.
///
/// Memory in it is written concurrently by the NIC (remote writes into
/// granted regions) and by copy workers (gather into / scatter from distinct
/// regions); the credit scheduler guarantees regions in use never overlap,
/// so the arena hands out raw addresses, not references.
#[derive(Debug)]
pub struct HostArena {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the arena is a plain heap allocation; access discipline (disjoint
// regions) is enforced by the scheduler that owns the offsets.
unsafe impl Send for HostArena {}
unsafe impl Sync for HostArena {}

/// Error allocating an arena.
#[derive(Debug, thiserror::Error)]
#[error("cannot allocate a host arena of {len} bytes: {reason}")]
pub struct ArenaError {
    /// Requested size in bytes.
    pub len: usize,
    /// What went wrong.
    pub reason: &'static str,
}

impl HostArena {
    /// Allocates `len` zeroed bytes aligned to [`ARENA_ALIGN`].
    ///
    /// # Errors
    /// [`ArenaError`] when `len` is 0 or the allocation fails.
    pub fn new(len: usize) -> Result<Self, ArenaError> {
        if len == 0 {
            return Err(ArenaError {
                len,
                reason: "size must be > 0",
            });
        }
        let layout = Layout::from_size_align(len, ARENA_ALIGN).map_err(|_| ArenaError {
            len,
            reason: "size overflows a layout",
        })?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(ArenaError {
                len,
                reason: "out of memory",
            });
        }
        Ok(Self { ptr, len })
    }

    /// Base address (bytes).
    pub fn base_addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an arena has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Address of `offset` (`base + offset`), or `None` when out of range.
    pub fn at(&self, offset: u64) -> Option<u64> {
        (offset <= self.len as u64).then(|| self.base_addr() + offset)
    }
}

impl Drop for HostArena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this exact layout.
        unsafe {
            dealloc(
                self.ptr,
                Layout::from_size_align_unchecked(self.len, ARENA_ALIGN),
            )
        }
    }
}
