//! Peer-controlled strings made safe for logs (issue 11, item 10).
//!
//! A ZMQ identity, an agent name from etcd or a header value is chosen by a
//! peer; written to a log as is, a newline in it forges a log line and a
//! megabyte of it floods the log. [`LogSafe`] escapes control characters,
//! quotes and backslashes (Rust's `escape_debug` rules) and cuts the text
//! at [`LOG_SAFE_MAX_CHARS`] characters, marking the cut.

use std::fmt;

/// The most characters of a peer-controlled string a log line shows.
pub const LOG_SAFE_MAX_CHARS: usize = 128;

/// Displays a peer-controlled string escaped and bounded: control
/// characters as `\n`, `\u{1b}`…, at most [`LOG_SAFE_MAX_CHARS`] characters
/// followed by `…(+N chars)` when longer.
#[derive(Clone, Copy, Debug)]
pub struct LogSafe<'a>(pub &'a str);

impl fmt::Display for LogSafe<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, c) in self.0.chars().enumerate() {
            if n == LOG_SAFE_MAX_CHARS {
                let rest = self.0.chars().count() - n;
                return write!(f, "…(+{rest} chars)");
            }
            for e in c.escape_debug() {
                fmt::Write::write_char(f, e)?;
            }
        }
        Ok(())
    }
}

/// Same as [`LogSafe`] for bytes: valid UTF-8 is shown escaped, anything
/// else as lossy UTF-8, escaped.
pub fn log_safe_bytes(b: &[u8]) -> String {
    LogSafe(&String::from_utf8_lossy(b)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newlines_and_escapes_cannot_forge_lines() {
        let s = LogSafe("peer\nINFO forged line\r\x1b[31m\"").to_string();
        assert!(!s.contains('\n') && !s.contains('\r') && !s.contains('\x1b'));
        assert_eq!(s, "peer\\nINFO forged line\\r\\u{1b}[31m\\\"");
    }

    #[test]
    fn long_strings_are_cut() {
        let long = "a".repeat(1000);
        let s = LogSafe(&long).to_string();
        assert!(s.starts_with(&"a".repeat(LOG_SAFE_MAX_CHARS)));
        assert!(s.ends_with("…(+872 chars)"), "{s}");
        assert_eq!(LogSafe("short").to_string(), "short");
        assert_eq!(log_safe_bytes(b"x\xff\n"), "x\u{fffd}\\n");
    }
}
