//! Reads the process's own stdout/stderr back (and forwards it), to find
//! which UCX transports carried the transfers: the silent-fallback guard
//! of `kvfabric-gpu vram-bench` ([`OutputTap`] while the bench runs, its
//! [`TransportReport`] after). Parsing needs no GPU: UCX's info log
//! (`UCX_LOG_LEVEL=info`) and protocol tables (`UCX_PROTO_INFO=y`).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::FromRawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// What the tap saw: UCX's endpoint configurations (info log) and its
/// protocol selections (`UCX_PROTO_INFO`), split into the data path
/// (operations from GPU memory, what the transfers use) and the rest.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TransportReport {
    /// Protocol selections for operations from GPU memory:
    /// "operation: range description config" (deduplicated).
    pub data_path: Vec<String>,
    /// UCX endpoint configuration lines (`… cfg#N rma(…) am(…)`), first 20.
    pub endpoint_configs: Vec<String>,
    /// A GPU-sourced operation used `cuda_ipc`.
    pub cuda_ipc: bool,
    /// A GPU-sourced operation used software emulation (silent fallback).
    pub software_emulation: bool,
    /// A GPU-sourced operation used TCP.
    pub tcp: bool,
    /// Selections with software emulation for other operations (host
    /// memory sources, e.g. put from host to GPU: not used here).
    pub other_emulation: usize,
    /// Lines read in all.
    pub lines_seen: usize,
    /// The table header being read, per UCX line tag (`[host:pid:thread]`):
    /// tables of several processes and threads interleave in the pipe.
    #[serde(skip)]
    current: std::collections::HashMap<String, String>,
}

impl TransportReport {
    /// A short human summary with warnings.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "transport report (GPU-sourced data path): cuda_ipc={} software_emulation={} tcp={}; other ops with software emulation: {}",
            self.cuda_ipc, self.software_emulation, self.tcp, self.other_emulation
        );
        for d in &self.data_path {
            s += &format!("\n  {d}");
        }
        if self.data_path.is_empty() {
            s += "\nWARNING: UCX reported no protocol for writes from GPU memory (set UCX_PROTO_INFO=y)";
        }
        if self.software_emulation {
            s += "\nWARNING: GPU writes used UCX software emulation (silent fallback)";
        }
        if self.tcp {
            s += "\nWARNING: GPU writes used TCP";
        }
        if !self.data_path.is_empty() && !self.cuda_ipc {
            s += "\nWARNING: GPU writes did not use cuda_ipc";
        }
        s
    }

    fn scan(&mut self, line: &str) {
        self.lines_seen += 1;
        let l = line.to_ascii_lowercase();
        if l.contains("ucx  info") && l.contains("cfg#") {
            if self.endpoint_configs.len() < 20 {
                let at = line.find("UCX").unwrap_or(0);
                self.endpoint_configs
                    .push(line[at..].trim_end().to_string());
            }
            return;
        }
        let Some(bar) = line.find('|') else {
            return;
        };
        let cells: Vec<&str> = line[bar..]
            .split('|')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect();
        // `[timestamp] [host:pid :thread]   | … |`: the second bracket.
        let tag = line[..bar]
            .split(']')
            .nth(1)
            .map(|t| t.trim().to_string())
            .unwrap_or_default();
        if cells.len() == 1 && cells[0].contains(" by ucp_") {
            self.current.insert(tag, cells[0].to_string());
            return;
        }
        let Some(op) = self.current.get(&tag) else {
            return;
        };
        if cells.len() != 3 || !cells[0].contains("..") && cells[0].parse::<u64>().is_err() {
            return;
        }
        let (desc, cfg) = (cells[1].to_ascii_lowercase(), cells[2].to_ascii_lowercase());
        let emulation = desc.contains("emulation");
        if !op.contains("from cuda") {
            self.other_emulation += usize::from(emulation);
            return;
        }
        self.cuda_ipc |= cfg.contains("cuda_ipc");
        self.software_emulation |= emulation;
        self.tcp |= cfg.contains("tcp");
        let entry = format!("{op}: {} {} {}", cells[0], cells[1], cells[2]);
        if !self.data_path.contains(&entry) {
            self.data_path.push(entry);
        }
    }
}

/// fds 1 and 2 redirected into a pipe; a thread forwards every line to
/// the original stdout and scans it.
pub struct OutputTap {
    /// The original fd 1 (a dup), -1 once restored.
    orig: i32,
    /// The original fd 2 (a dup).
    orig_err: i32,
    report: Arc<Mutex<TransportReport>>,
    thread: Option<JoinHandle<()>>,
}

impl OutputTap {
    /// Starts the tap (children spawned later inherit the pipe as
    /// their stderr).
    ///
    /// # Errors
    /// When the pipe, the redirection of fds 1 and 2 or the reader thread
    /// cannot be set up.
    pub fn start() -> Result<Self, String> {
        let mut fds = [0i32; 2];
        // SAFETY: plain fd calls on fds this process owns; on an error
        // every fd opened here is closed and fds 1 and 2 are put back.
        let (orig, orig_err) = unsafe {
            if libc::pipe(fds.as_mut_ptr()) != 0 {
                return Err(format!("pipe: {}", std::io::Error::last_os_error()));
            }
            let (orig, orig_err) = (libc::dup(1), libc::dup(2));
            if orig < 0 || orig_err < 0 || libc::dup2(fds[1], 1) < 0 || libc::dup2(fds[1], 2) < 0 {
                let e = std::io::Error::last_os_error();
                if orig >= 0 {
                    libc::dup2(orig, 1);
                    libc::close(orig);
                }
                if orig_err >= 0 {
                    libc::dup2(orig_err, 2);
                    libc::close(orig_err);
                }
                libc::close(fds[0]);
                libc::close(fds[1]);
                return Err(format!("redirecting fds 1 and 2: {e}"));
            }
            libc::close(fds[1]);
            (orig, orig_err)
        };
        // SAFETY: fds[0] is ours and moved into the File; orig stays
        // open until `finish` (this dup is closed by the File below).
        let (read, mut out) = unsafe {
            (
                File::from_raw_fd(fds[0]),
                File::from_raw_fd(libc::dup(orig)),
            )
        };
        let report = Arc::new(Mutex::new(TransportReport::default()));
        let r = report.clone();
        let thread = std::thread::Builder::new()
            .name("output-tap".into())
            .spawn(move || {
                let mut reader = BufReader::new(read);
                let mut buf = Vec::new();
                while reader.read_until(b'\n', &mut buf).unwrap_or(0) > 0 {
                    let _ = out.write_all(&buf);
                    let line = String::from_utf8_lossy(&buf);
                    r.lock().unwrap_or_else(|p| p.into_inner()).scan(&line);
                    buf.clear();
                }
                let _ = out.flush();
            })
            .map_err(|e| e.to_string())?;
        Ok(Self {
            orig,
            orig_err,
            report,
            thread: Some(thread),
        })
    }

    /// Flushes C stdio (UCX prints its tables with `fprintf` to stdout,
    /// which is fully buffered on a pipe), restores stdout/stderr, drains
    /// the pipe (≤ 2 s) and returns what was seen.
    pub fn finish(mut self) -> TransportReport {
        let _ = std::io::stdout().flush();
        let _ = std::io::stderr().flush();
        // SAFETY: fflush(NULL) flushes every open C output stream. Without
        // it the last buffered block of UCX's protocol tables — on the
        // H200 the row naming cuda_ipc for writes from GPU memory — reached
        // the pipe only at exit, after this report was made, and the
        // report said cuda_ipc=false while the write ran at 250-400 GB/s.
        unsafe {
            libc::fflush(std::ptr::null_mut());
        }
        self.restore();
        if let Some(t) = self.thread.take() {
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
        let r = self
            .report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        r
    }

    /// Puts the original stdout and stderr back on fds 1 and 2 (once),
    /// which closes this process's write ends of the pipe.
    fn restore(&mut self) {
        if self.orig < 0 {
            return;
        }
        // SAFETY: `orig` / `orig_err` are the dups of the original fds 1
        // and 2 this tap owns; closed here and never used again.
        unsafe {
            libc::dup2(self.orig, 1);
            libc::dup2(self.orig_err, 2);
            libc::close(self.orig);
            libc::close(self.orig_err);
        }
        self.orig = -1;
    }
}

impl Drop for OutputTap {
    /// A tap dropped without [`OutputTap::finish`] (an error or a panic
    /// while the bench ran) still gives the process its stdout back.
    fn drop(&mut self) {
        self.restore();
    }
}

#[cfg(test)]
mod tests {
    use super::{OutputTap, TransportReport};

    /// Taps redirect the whole process's fds 1 and 2: one test at a time.
    static TAP: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Lines a C library printed through the C `stdout` stream, fully
    /// buffered (as UCX's tables are when stdout is a pipe), are in the
    /// report: finish flushes C stdio before it reads the pipe to its end.
    #[test]
    fn finish_sees_lines_still_in_a_c_stdio_buffer() {
        extern "C" {
            /// glibc's `FILE *stdout`, the stream UCX prints its tables to.
            static mut stdout: *mut libc::FILE;
        }
        let _one = TAP.lock().unwrap_or_else(|p| p.into_inner());
        let tap = OutputTap::start().expect("tap");
        let table = "[1.3] [vm:9  :1]   | remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[1] |\n\
                     [1.3] [vm:9  :1]   | 0..inf | zero-copy   | cuda_ipc/cuda |\n\0";
        // SAFETY: glibc's stdout stream, made fully buffered (glibc allows
        // setvbuf on a stream that has buffered no output) and written
        // once; only fflush(NULL) in finish pushes it into the pipe.
        unsafe {
            let out = stdout;
            assert_eq!(libc::fflush(out), 0);
            assert_eq!(
                libc::setvbuf(out, std::ptr::null_mut(), libc::_IOFBF, 1 << 16),
                0
            );
            assert!(libc::fputs(table.as_ptr().cast(), out) >= 0);
        }
        let report = tap.finish();
        assert!(report.cuda_ipc, "{report:?}");
        assert_eq!(report.data_path.len(), 1, "{report:?}");
    }

    /// A tap dropped without finish (an error mid-bench) gives fds 1 and 2
    /// back: they name the same file as before it started.
    #[test]
    fn drop_without_finish_restores_stdout() {
        let id = |fd| {
            // SAFETY: fstat into a zeroed stat of fds this process has open.
            unsafe {
                let mut st: libc::stat = std::mem::zeroed();
                assert_eq!(libc::fstat(fd, &mut st), 0);
                (st.st_dev, st.st_ino)
            }
        };
        let _one = TAP.lock().unwrap_or_else(|p| p.into_inner());
        let (out, err) = (id(1), id(2));
        let tap = OutputTap::start().expect("tap");
        assert_ne!(id(1), out, "fd 1 is the tap's pipe while it runs");
        drop(tap);
        assert_eq!((id(1), id(2)), (out, err));
    }

    #[test]
    fn scan_splits_gpu_data_path_from_other_ops() {
        // Lines as UCX 1.x printed them on the H200 (vram-bench run).
        let log = "\
[1.1] [vm:573  :0]      ucp_worker.c:1997 UCX  INFO    vram-bench-573-0 intra-node cfg#2 rma_am(tcp/lo)  device(cuda_ipc/cuda)  am(tcp/lo cma/memory cuda_ipc/cuda)  ka(tcp/lo)
[1.2] [vm:573  :0]   +--------+--------------------+-----------------------------------+
[1.2] [vm:573  :0]   | vram-bench-573-0 intra-node cfg#2                               |
[1.2] [vm:573  :0]   | remote memory write by ucp_put* from host memory to cuda/dev[2] |
[1.2] [vm:573  :0]   +--------+--------------------+-----------------------------------+
[1.2] [vm:573  :0]   | Range  |    Description     |              Config               |
[1.2] [vm:573  :0]   | 0..inf | software emulation | tcp/lo                            |
[1.3] [vm:573  :1]   | remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[2] |
[1.3] [vm:573  :1]   | Range  | Description |                    Config                     |
[1.3] [vm:584  :0]   | 0..8184 | short       | tcp/lo                                 |
[1.3] [vm:573  :1]   | 0..inf | zero-copy   | cuda_ipc/cuda                                 |
";
        let mut r = TransportReport::default();
        for l in log.lines() {
            r.scan(l);
        }
        assert_eq!(r.endpoint_configs.len(), 1);
        assert_eq!(r.other_emulation, 1);
        assert!(r.cuda_ipc && !r.software_emulation && !r.tcp);
        assert_eq!(
            r.data_path,
            vec!["remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[2]: 0..inf zero-copy cuda_ipc/cuda"]
        );
        let mut bad = TransportReport::default();
        for l in log
            .replace("zero-copy   | cuda_ipc/cuda", "software emulation | tcp/lo")
            .lines()
        {
            bad.scan(l);
        }
        assert!(bad.software_emulation && bad.tcp && !bad.cuda_ipc);
        assert!(bad
            .summary()
            .contains("WARNING: GPU writes used UCX software emulation"));
    }
}
