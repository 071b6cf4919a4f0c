//! Survives engines that truncate their registered shm pools.
//!
//! An engine's host KV pool is a POSIX shm object the agent maps (issue 12).
//! If the engine truncates the object after registering it, every page of
//! the agent's mapping past the new end raises SIGBUS on access — in a
//! copy worker's gather or scatter, or the direct path's memcpy — and the
//! default action kills the agent and every engine on the node with it.
//! POSIX shm objects cannot be sealed against shrinking (only memfd objects
//! take `F_SEAL_SHRINK`), so the agent cannot prevent the truncation; it
//! survives it instead:
//!
//! * every mapped pool is [`guard`]ed: its address range goes into a fixed
//!   table that a SIGBUS handler reads without locks;
//! * the handler, for a fault inside a guarded range (`si_code`
//!   `BUS_ADRERR`: an access past the object's end), maps private zero
//!   pages over the rest of the range, from the faulting page to its end,
//!   in one `MAP_FIXED` mapping (the object now ends at or before that
//!   page, so every later page would fault too; one mapping per pool
//!   keeps the process far from `vm.max_map_count`), and returns: the
//!   faulting copy resumes (reads zeros, writes go nowhere shared), and
//!   the range's [`Guard::truncated`] flag is set;
//! * the engine layer sees the flag, fails the hand-offs that touched the
//!   pool ("truncated") and detaches the engine. Nothing it copied from or
//!   into the truncated part is reported as a success.
//!
//! A SIGBUS outside every guarded range, or of another kind (a hardware
//! memory error, a `kill`), goes to the previous disposition (by default:
//! the process dies with SIGBUS, as before). A library that installs its
//! own SIGBUS handler later (UCX does, at start-up) is found by the next
//! [`guard`] call, which puts ours back in front of it and chains to it.
//!
//! The handler only does atomic loads/stores and one `mmap` system call
//! (issued with `syscall(2)`, async-signal-safe on Linux). At most
//! [`MAX_GUARDED`] pools are guarded at once; more are mapped unguarded
//! (logged).

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Most pools guarded at once (one per attached host-memory engine).
pub const MAX_GUARDED: usize = 256;

struct Slot {
    /// Start of the range; 0 = free slot.
    start: AtomicU64,
    /// End (exclusive).
    end: AtomicU64,
    /// Set by the handler when a fault hit the range.
    hit: AtomicBool,
    /// Faulting pages patched (for logs and tests).
    pages: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicU64::new(0),
    end: AtomicU64::new(0),
    hit: AtomicBool::new(false),
    pages: AtomicU64::new(0),
};

static SLOTS: [Slot; MAX_GUARDED] = [FREE; MAX_GUARDED];
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// Serialises (re)installation.
static INSTALL: Mutex<()> = Mutex::new(());
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The disposition ours chains to: a leaked `Previous`, replaced (and the
/// old one leaked on purpose: the handler may be reading it) each time
/// ours is put back in front of a newer one. An atomic load in the handler.
static PREVIOUS: AtomicPtr<Previous> = AtomicPtr::new(std::ptr::null_mut());

/// A saved `sigaction` (plain data: a handler address, a mask, flags).
struct Previous(libc::sigaction);
// SAFETY: `libc::sigaction` is plain data (no pointers it owns).
unsafe impl Sync for Previous {}
// SAFETY: as above.
unsafe impl Send for Previous {}

/// A guarded range; unguarded on drop (drop it only after the range is
/// unmapped or no longer accessed).
pub struct Guard {
    slot: usize,
}

impl Guard {
    /// Whether a SIGBUS hit the range (the shm object was truncated under
    /// the mapping): data copied from or into it since is not the
    /// engine's.
    pub fn truncated(&self) -> bool {
        SLOTS[self.slot].hit.load(Ordering::Acquire)
    }

    /// Pages the handler replaced with zero pages so far (from the first
    /// faulting page to the end of the range, in one go).
    pub fn patched_pages(&self) -> u64 {
        SLOTS[self.slot].pages.load(Ordering::Acquire)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let s = &SLOTS[self.slot];
        // Reserved first (matches no address), then cleared and freed.
        s.start.store(u64::MAX, Ordering::Release);
        s.end.store(0, Ordering::Release);
        s.hit.store(false, Ordering::Release);
        s.pages.store(0, Ordering::Release);
        s.start.store(0, Ordering::Release);
    }
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("slot", &self.slot)
            .field("truncated", &self.truncated())
            .finish()
    }
}

/// Guards `[addr, addr + len)` (a shared mapping of a shm object). `None`
/// when the table is full, the range is empty, or the handler could not
/// be installed (the pool then works unguarded, as before).
pub fn guard(addr: u64, len: u64) -> Option<Arc<Guard>> {
    if addr == 0 || len == 0 {
        return None;
    }
    install();
    if !INSTALLED.load(Ordering::Acquire) {
        return None;
    }
    let end = addr.checked_add(len)?;
    for (i, s) in SLOTS.iter().enumerate() {
        if s.start
            .compare_exchange(0, u64::MAX, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // Reserved (start = MAX matches no address): fill, then publish.
            s.hit.store(false, Ordering::Release);
            s.pages.store(0, Ordering::Release);
            s.end.store(end, Ordering::Release);
            s.start.store(addr, Ordering::Release);
            return Some(Arc::new(Guard { slot: i }));
        }
    }
    tracing::warn!(
        addr,
        len,
        "shm guard table full ({MAX_GUARDED}); pool mapped unguarded"
    );
    None
}

fn install() {
    let _g = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE.store(page as usize, Ordering::Release);
    }
    // SAFETY: zeroed sigactions are valid starting values; we read the
    // current disposition, and only if it is not ours store it (leaked,
    // never freed: the handler may read it at any time) before putting
    // ours in front, so the handler always finds what to chain to.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut cur) != 0 {
            return;
        }
        if cur.sa_sigaction == on_sigbus as *const () as usize {
            return;
        }
        if INSTALLED.load(Ordering::Acquire) {
            tracing::warn!("another SIGBUS handler replaced the shm guard's; putting it back in front (chained)");
        }
        let prev = Box::into_raw(Box::new(Previous(cur)));
        PREVIOUS.store(prev, Ordering::Release);
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) == 0 {
            INSTALLED.store(true, Ordering::Release);
        } else {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "installing the SIGBUS handler failed; shm pools unguarded"
            );
        }
    }
}

/// The SIGBUS handler (see the module docs).
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as u64) };
    // Only an access past the end of a mapped object is ours (BUS_ADRERR);
    // a kill(2) or a hardware memory error is not.
    let slots = if code == libc::BUS_ADRERR {
        &SLOTS[..]
    } else {
        &[]
    };
    for s in slots {
        let start = s.start.load(Ordering::Acquire);
        if start == 0 || start == u64::MAX || addr < start {
            continue;
        }
        if addr >= s.end.load(Ordering::Acquire) {
            continue;
        }
        let end = s.end.load(Ordering::Acquire);
        let page = PAGE.load(Ordering::Acquire) as u64;
        let base = addr & !(page - 1);
        let len = end.saturating_sub(base).div_ceil(page) * page;
        // SAFETY: replaces the rest of a mapping this process made (inside
        // a guarded range, which is page aligned) with private zero pages;
        // a raw system call, async-signal-safe.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mmap,
                base as usize,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1i64,
                0i64,
            )
        };
        if r as u64 == base {
            s.hit.store(true, Ordering::Release);
            s.pages.fetch_add(len / page, Ordering::AcqRel);
            return;
        }
        break;
    }
    // Not ours (or the patch failed): the previous disposition.
    let prev = PREVIOUS.load(Ordering::Acquire);
    if prev.is_null() {
        return;
    }
    // SAFETY: set before our handler was installed, never freed.
    let Previous(prev) = unsafe { &*prev };
    // SAFETY: `prev` is the disposition saved before ours; calling its
    // handler (or restoring it) is what the process would have done.
    unsafe {
        let h = prev.sa_sigaction;
        if h == libc::SIG_DFL || h == libc::SIG_IGN {
            // Restore and return: the faulting instruction runs again and
            // the default action (death by SIGBUS) follows.
            libc::sigaction(libc::SIGBUS, prev, std::ptr::null_mut());
        } else if prev.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
            f(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shm object truncated under a guarded mapping: reads past the new
    /// end no longer kill the process; the guard reports it.
    #[test]
    fn a_truncated_mapping_reads_zeros_and_is_reported() {
        let name = std::ffi::CString::new(format!("/kvf-guard-{}", std::process::id())).unwrap();
        let len = 4 * 65536usize;
        // SAFETY: plain shm/mmap FFI on an object this test owns.
        unsafe {
            let fd = libc::shm_open(name.as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o600);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let bytes = std::slice::from_raw_parts_mut(p as *mut u8, len);
            bytes.fill(0xab);
            let g = guard(p as u64, len as u64).expect("guarded");
            assert!(!g.truncated());
            // The engine shrinks its object to one page.
            assert_eq!(libc::ftruncate(fd, 4096), 0);
            let base = p as *const u8;
            let sum: u64 = (0..len)
                .map(|i| u64::from(std::ptr::read_volatile(base.add(i))))
                .sum();
            // The first page still holds the data; the rest reads zeros.
            assert_eq!(sum, 4096 * 0xab);
            assert!(g.truncated());
            let page = PAGE.load(Ordering::Acquire);
            assert_eq!(g.patched_pages() as usize, (len - 4096) / page);
            // One mapping for the whole patched rest, not one per page.
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            let start = format!("{:x}-", p as usize + 4096);
            let line = maps
                .lines()
                .find(|l| l.starts_with(&start))
                .expect("the patch mapping");
            let end = format!("-{:x} ", p as usize + len);
            assert!(line.contains(&end), "{line}");
            // Writes into the patched part land nowhere shared, no fault.
            bytes[len - 1] = 7;
            drop(g);
            libc::munmap(p, len);
            libc::close(fd);
            libc::shm_unlink(name.as_ptr());
        }
    }
}
