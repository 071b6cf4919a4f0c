//! Host-memory bounce arena (seed §4 `BounceArena`): one buffer, allocated
//! and registered with the transfer engine once at start-up (never on the
//! request path), sliced into variable-size regions by the credit
//! scheduler. A region's handle is its byte offset; `addr = base + offset`.
//! The GPU arena (device memory) plugs into the same shape behind `cuda`.

/// Alignment of the arena base (bytes): a page, so regions can be 32-byte
/// aligned offsets from it and registration covers whole pages.
pub const ARENA_ALIGN: usize = 4096;

/// Alignment used for arenas of at least this size (bytes): a 2 MiB huge
/// page, so the kernel can back the arena with transparent huge pages.
/// Fewer pages make every page pin/walk of a copy (UCX `cma`'s
/// `process_vm_writev`, NIC registration) cheaper.
pub const HUGE_PAGE: usize = 2 << 20;

/// A page-aligned, zero-initialised host buffer of `len` bytes, mapped
/// anonymously, advised for transparent huge pages
/// (`madvise(MADV_HUGEPAGE)`, best effort) and pre-faulted, so no page
/// fault lands on the request path.
///
/// Memory in it is written concurrently by the NIC (remote writes into
/// granted regions) and by copy workers (gather into / scatter from distinct
/// regions); the credit scheduler guarantees regions in use never overlap,
/// so the arena hands out raw addresses, not references.
#[derive(Debug)]
pub struct HostArena {
    ptr: *mut u8,
    len: usize,
    /// The whole mapping (may start before `ptr` and be longer than `len`).
    map: *mut libc::c_void,
    map_len: usize,
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
    /// Maps `len` zeroed bytes aligned to [`ARENA_ALIGN`] (to [`HUGE_PAGE`]
    /// and advised for transparent huge pages when `len >= HUGE_PAGE`) and
    /// touches every page once. Used for the bounce arena.
    ///
    /// # Errors
    /// [`ArenaError`] when `len` is 0, overflows, or the mapping fails.
    pub fn new(len: usize) -> Result<Self, ArenaError> {
        Self::map(len, true)
    }

    /// Like [`HostArena::new`] but with base (4 KiB) pages only and no
    /// pre-faulting, as a serving engine's pageable KV pool usually is; the
    /// agent and the benches use it for KV pools, so the fabric's own arena
    /// is the only huge-page memory.
    ///
    /// # Errors
    /// As [`HostArena::new`].
    pub fn new_base_pages(len: usize) -> Result<Self, ArenaError> {
        Self::map(len, false)
    }

    fn map(len: usize, huge: bool) -> Result<Self, ArenaError> {
        if len == 0 {
            return Err(ArenaError {
                len,
                reason: "size must be > 0",
            });
        }
        let align = if huge && len >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            ARENA_ALIGN
        };
        let map_len = len
            .checked_add(align)
            .and_then(|n| n.checked_next_multiple_of(ARENA_ALIGN))
            .ok_or(ArenaError {
                len,
                reason: "size overflows a mapping",
            })?;
        // SAFETY: anonymous private mapping; no file, no fixed address.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(ArenaError {
                len,
                reason: "out of memory (mmap failed)",
            });
        }
        let start = (map as usize).next_multiple_of(align);
        let ptr = start as *mut u8;
        if align == HUGE_PAGE {
            // Best effort: THP may be disabled (`never`); the arena works
            // either way.
            // SAFETY: [start, start + len) lies inside the mapping.
            unsafe {
                libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE);
            }
        }
        if !huge {
            // Base pages even where THP is `always` (best effort).
            // SAFETY: [start, start + len) lies inside the mapping.
            unsafe {
                libc::madvise(ptr.cast(), len, libc::MADV_NOHUGEPAGE);
            }
        }
        if huge {
            // Pre-fault the arena: one write per page, so the request path
            // never takes its page faults. (KV pools fault lazily: they
            // can be most of the host's memory.)
            for off in (0..len).step_by(ARENA_ALIGN) {
                // SAFETY: off < len, inside the mapping; anonymous memory is
                // already zero, writing zero keeps it so.
                unsafe { std::ptr::write_volatile(ptr.add(off), 0) };
            }
        }
        Ok(Self {
            ptr,
            len,
            map,
            map_len,
        })
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
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe {
            libc::munmap(self.map, self.map_len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_zero(a: &HostArena) -> bool {
        // SAFETY: [base, base + len) is the live mapping.
        let s = unsafe { std::slice::from_raw_parts(a.base_addr() as *const u8, a.len()) };
        s.iter().all(|&b| b == 0)
    }

    #[test]
    fn arena_is_huge_page_aligned_zeroed_and_writable() {
        let a = HostArena::new(4 << 20).unwrap();
        assert_eq!(a.base_addr() % HUGE_PAGE as u64, 0);
        assert!(all_zero(&a));
        // Last byte is inside and writable.
        // SAFETY: offset len-1 is inside the mapping.
        unsafe { *((a.base_addr() + a.len() as u64 - 1) as *mut u8) = 7 };
        assert_eq!(a.at(a.len() as u64), Some(a.base_addr() + a.len() as u64));
        assert_eq!(a.at(a.len() as u64 + 1), None);
    }

    #[test]
    fn small_and_base_page_pools_are_page_aligned_and_zeroed() {
        for a in [
            HostArena::new(3 * 4096 + 5).unwrap(),
            HostArena::new_base_pages(4 << 20).unwrap(),
        ] {
            assert_eq!(a.base_addr() % ARENA_ALIGN as u64, 0);
            assert!(all_zero(&a));
        }
    }

    #[test]
    fn zero_size_is_rejected_with_the_size() {
        let e = HostArena::new(0).unwrap_err();
        assert_eq!(e.len, 0);
        assert!(e.to_string().contains("size must be > 0"));
    }
}
