//! IO-thread wake-up (seed §7 "adaptive polling"): an `eventfd` that copy
//! workers and API calls signal after queueing work for the IO thread, and
//! that the control channel's blocking receive also waits on. So an idle
//! or waiting IO thread sleeps in one `poll(2)` and wakes at once on a
//! control message, a copy completion or a command — it never spins or
//! yields a core away from the copy workers while it waits for them.

use std::os::fd::RawFd;
use std::time::Duration;

/// A level-triggered wake-up flag backed by a non-blocking `eventfd`.
///
/// [`Waker::wake`] from any thread; the owning IO thread waits on
/// [`Waker::fd`] (with its other descriptors) and clears it with
/// [`Waker::drain`].
#[derive(Debug)]
pub struct Waker {
    fd: RawFd,
}

impl Waker {
    /// Creates the eventfd.
    ///
    /// # Errors
    /// The OS error from `eventfd(2)`.
    pub fn new() -> std::io::Result<Self> {
        // SAFETY: plain syscall, no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { fd })
    }

    /// Makes the fd readable (wakes a waiter). Never blocks; a saturated
    /// counter (EAGAIN) is already readable, so the error is ignored.
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own fd.
        unsafe {
            libc::write(self.fd, (&one as *const u64).cast(), 8);
        }
    }

    /// Clears the flag; returns whether it was set.
    pub fn drain(&self) -> bool {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our own fd (non-blocking).
        let n = unsafe { libc::read(self.fd, (&mut v as *mut u64).cast(), 8) };
        n == 8
    }

    /// The fd to poll for `POLLIN`.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Waits at most `timeout` (µs resolution) for a wake-up, then clears
    /// it. Returns whether one came.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: one valid pollfd, a valid timespec, no signal mask.
        let n = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        n > 0 && self.drain()
    }
}

impl Drop for Waker {
    fn drop(&mut self) {
        // SAFETY: closes the fd we own, once.
        unsafe {
            libc::close(self.fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn wait_times_out_without_a_wake() {
        let w = Waker::new().unwrap();
        let t0 = Instant::now();
        assert!(!w.wait(Duration::from_millis(20)));
        assert!(t0.elapsed() >= Duration::from_millis(19));
    }

    #[test]
    fn wake_from_another_thread_ends_the_wait() {
        let w = Arc::new(Waker::new().unwrap());
        let w2 = w.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            w2.wake();
        });
        let t0 = Instant::now();
        assert!(w.wait(Duration::from_secs(10)));
        assert!(t0.elapsed() < Duration::from_secs(5));
        t.join().unwrap();
    }

    #[test]
    fn wakes_fold_into_one_and_drain_clears() {
        let w = Waker::new().unwrap();
        w.wake();
        w.wake();
        assert!(w.wait(Duration::ZERO));
        assert!(!w.drain());
        assert!(!w.wait(Duration::ZERO));
    }
}
