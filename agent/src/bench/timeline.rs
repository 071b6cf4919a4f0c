//! Where a bounce request's time went, from its stage events
//! ([`crate::runtime::transport::TransferHandle::take_timeline`]): one
//! request's timeline ([`BounceTimeline`]) and, for `kvfabric-gpu bench
//! --timeline`, the summary of many ([`TimelineSummary`]). Pure: events
//! and instants in, numbers out.

use std::time::Instant;

use serde::Serialize;

use crate::runtime::transport::{Stage, StageEvent};

/// The sender's view of one bounce request, µs after submit (medians over
/// the timed iterations, each a traced request): sizing and WANT, the
/// gathers, the writes (posted after their GRANT and gather), the DATA
/// (write landed), the ACKs (receiver scattered) and the caller's wake-up.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BounceTimeline {
    /// The transport's submit began (after the fabric's routing gate), µs.
    pub entered_us: f64,
    /// The caller's sizing pass ended, µs.
    pub sized_us: f64,
    /// The request was on the IO thread's queue (and the IO thread woken), µs.
    pub queued_us: f64,
    /// The IO thread took the request off its queue (the caller's sizing
    /// and the IO thread's wake-up before it), µs.
    pub received_us: f64,
    /// WANT sent (the request sized and planned), µs.
    pub want_us: f64,
    /// First chunk gathered into staging, µs.
    pub first_gathered_us: f64,
    /// Last chunk gathered, µs.
    pub last_gathered_us: f64,
    /// First chunk's write posted (its GRANT had arrived), µs.
    pub first_write_posted_us: f64,
    /// Last chunk's write posted, µs.
    pub last_write_posted_us: f64,
    /// First chunk's write landed and its DATA sent, µs.
    pub first_data_sent_us: f64,
    /// Last chunk's DATA sent, µs.
    pub last_data_sent_us: f64,
    /// First chunk ACKed (scattered on the receiver), µs.
    pub first_acked_us: f64,
    /// Last chunk ACKed: the request resolves, µs.
    pub last_acked_us: f64,
    /// The caller saw SUCCESS, µs.
    pub resolved_us: f64,
}

impl BounceTimeline {
    /// Medians, field by field, of per-request timelines.
    pub fn median_of(all: &[BounceTimeline]) -> Option<BounceTimeline> {
        if all.is_empty() {
            return None;
        }
        // A stage missing from a request (NaN) is left out of its median.
        let m = |f: fn(&BounceTimeline) -> f64| {
            let mut v: Vec<f64> = all.iter().map(f).filter(|x| !x.is_nan()).collect();
            if v.is_empty() {
                f64::NAN
            } else {
                median(&mut v)
            }
        };
        Some(BounceTimeline {
            entered_us: m(|t| t.entered_us),
            sized_us: m(|t| t.sized_us),
            queued_us: m(|t| t.queued_us),
            received_us: m(|t| t.received_us),
            want_us: m(|t| t.want_us),
            first_gathered_us: m(|t| t.first_gathered_us),
            last_gathered_us: m(|t| t.last_gathered_us),
            first_write_posted_us: m(|t| t.first_write_posted_us),
            last_write_posted_us: m(|t| t.last_write_posted_us),
            first_data_sent_us: m(|t| t.first_data_sent_us),
            last_data_sent_us: m(|t| t.last_data_sent_us),
            first_acked_us: m(|t| t.first_acked_us),
            last_acked_us: m(|t| t.last_acked_us),
            resolved_us: m(|t| t.resolved_us),
        })
    }

    /// One request's timeline from its stage events (`t0` = submit).
    pub fn of(events: &[StageEvent], t0: Instant, resolved_us: f64) -> BounceTimeline {
        let at = |stage: Stage, last: bool| {
            let it = events
                .iter()
                .filter(|e| e.stage == stage)
                .map(|e| e.at.saturating_duration_since(t0).as_secs_f64() * 1e6);
            if last {
                it.fold(f64::NAN, f64::max)
            } else {
                it.fold(f64::NAN, f64::min)
            }
        };
        BounceTimeline {
            entered_us: at(Stage::Entered, false),
            sized_us: at(Stage::Sized, false),
            queued_us: at(Stage::Queued, false),
            received_us: at(Stage::Received, false),
            want_us: at(Stage::Want, false),
            first_gathered_us: at(Stage::Gathered, false),
            last_gathered_us: at(Stage::Gathered, true),
            first_write_posted_us: at(Stage::WritePosted, false),
            last_write_posted_us: at(Stage::WritePosted, true),
            first_data_sent_us: at(Stage::DataSent, false),
            last_data_sent_us: at(Stage::DataSent, true),
            first_acked_us: at(Stage::Acked, false),
            last_acked_us: at(Stage::Acked, true),
            resolved_us,
        }
    }

    /// One line: each stage's first/last offset, µs (medians).
    pub fn line(&self) -> String {
        self.line_of("medians")
    }

    /// [`line`](Self::line) saying what the numbers are (`what`: e.g.
    /// "medians", "one request").
    pub fn line_of(&self, what: &str) -> String {
        format!(
            "timeline (µs after submit, {what}): submit entered {:.0} | sized {:.0} | queued {:.0} | IO thread took it {:.0} | WANT {:.0} | gathered {:.0}-{:.0} | write posted {:.0}-{:.0} | DATA sent {:.0}-{:.0} | ACKed {:.0}-{:.0} | caller woke {:.0}",
            self.entered_us,
            self.sized_us,
            self.queued_us,
            self.received_us,
            self.want_us,
            self.first_gathered_us,
            self.last_gathered_us,
            self.first_write_posted_us,
            self.last_write_posted_us,
            self.first_data_sent_us,
            self.last_data_sent_us,
            self.first_acked_us,
            self.last_acked_us,
            self.resolved_us
        )
    }
}

/// One traced bounce request of `--timeline`.
#[derive(Clone, Debug, Serialize)]
pub struct TracedRequest {
    /// Order in which the traced requests entered the bench's hand-off
    /// (0: the first measured bounce request — a cold fabric's first use
    /// unless `--warmup` ran before; warm-up requests are not traced).
    /// Only successes are kept, so a failed request leaves a gap.
    pub seq: usize,
    /// Submit → SUCCESS seen by the caller, ms.
    pub ms: f64,
    /// Bounce requests of this process in flight when it was submitted
    /// (itself included).
    pub in_flight: usize,
    /// Its stages, µs after submit.
    pub stages: BounceTimeline,
    /// Stage events the transport dropped past its per-request cap
    /// ([`crate::runtime::transport::MAX_STAGE_EVENTS`]): the last chunks' stages are then missing and
    /// the "last" offsets too early.
    pub dropped_events: u32,
}

/// Where the time of traced bounce requests went (`kvfabric-gpu bench
/// --timeline`): stage medians over all of them and over the slowest 1 %
/// (by service time, submit → SUCCESS, not by latency from an open-loop
/// arrival; at least one request), and the slowest few requests one by
/// one. Only requests that succeeded are traced.
#[derive(Clone, Debug, Serialize)]
pub struct TimelineSummary {
    /// Traced requests.
    pub requests: usize,
    /// Stage medians over all of them, µs after submit.
    pub all: Option<BounceTimeline>,
    /// Median requests in flight at submit, over all.
    pub all_in_flight: f64,
    /// Requests in the slowest 1 %.
    pub slowest_requests: usize,
    /// Stage medians over the slowest 1 %, µs after submit.
    pub slowest: Option<BounceTimeline>,
    /// Median requests in flight at submit, over the slowest 1 %.
    pub slowest_in_flight: f64,
    /// The [`TimelineSummary::WORST`] slowest requests, slowest first.
    pub worst: Vec<TracedRequest>,
    /// The [`TimelineSummary::FIRST`] traced requests that entered first
    /// ([`TracedRequest::seq`]), in that order (what a cold fabric's first
    /// hand-offs pay).
    pub first: Vec<TracedRequest>,
    /// Requests whose stage events were cut short
    /// ([`TracedRequest::dropped_events`] > 0).
    pub truncated_requests: usize,
}

impl TimelineSummary {
    /// Requests listed one by one.
    pub const WORST: usize = 5;
    /// First submitted requests listed one by one.
    pub const FIRST: usize = 5;

    /// The summary of `all` (any order).
    pub fn of(mut all: Vec<TracedRequest>) -> Self {
        all.sort_by_key(|t| t.seq);
        let first = all.iter().take(Self::FIRST).cloned().collect();
        all.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        let slow = all.len().div_ceil(100).min(all.len());
        let med_in_flight = |r: &[TracedRequest]| {
            let mut v: Vec<usize> = r.iter().map(|t| t.in_flight).collect();
            v.sort_unstable();
            v.get(v.len() / 2).map_or(f64::NAN, |&x| x as f64)
        };
        let stages = |r: &[TracedRequest]| {
            BounceTimeline::median_of(&r.iter().map(|t| t.stages.clone()).collect::<Vec<_>>())
        };
        Self {
            requests: all.len(),
            all: stages(&all),
            all_in_flight: med_in_flight(&all),
            slowest_requests: slow,
            slowest: stages(&all[..slow]),
            slowest_in_flight: med_in_flight(&all[..slow]),
            worst: all.iter().take(Self::WORST).cloned().collect(),
            first,
            truncated_requests: all.iter().filter(|t| t.dropped_events > 0).count(),
        }
    }

    /// Text lines for the console.
    pub fn lines(&self) -> String {
        let mut s = format!(
            "traced bounce requests: {} (successes; slowest = by service time, submit -> SUCCESS)\n",
            self.requests
        );
        if self.truncated_requests > 0 {
            s += &format!(
                "warning: {} requests had more stage events than the transport keeps: their last stages are missing\n",
                self.truncated_requests
            );
        }
        if let Some(t) = &self.all {
            s += &format!(
                "all ({:.0} in flight at submit, median): {}\n",
                self.all_in_flight,
                t.line()
            );
        }
        if let Some(t) = &self.slowest {
            s += &format!(
                "slowest {} ({:.0} in flight at submit, median): {}\n",
                self.slowest_requests,
                self.slowest_in_flight,
                t.line()
            );
        }
        for (k, r) in self.worst.iter().enumerate() {
            s += &format!(
                "slowest #{} {:.2} ms ({} in flight at submit): {}\n",
                k + 1,
                r.ms,
                r.in_flight,
                r.stages.line_of("one request")
            );
        }
        for r in &self.first {
            s += &format!(
                "submitted #{} {:.2} ms ({} in flight at submit): {}\n",
                r.seq + 1,
                r.ms,
                r.in_flight,
                r.stages.line_of("one request")
            );
        }
        s
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn traced(ms: f64, in_flight: usize) -> TracedRequest {
        TracedRequest {
            // Entry order unrelated to latency (a permutation of 0..250
            // for the 250 requests of the first test).
            seq: (ms as usize * 7) % 250,
            ms,
            in_flight,
            dropped_events: u32::from(ms > 249.0),
            stages: BounceTimeline {
                want_us: ms * 10.0,
                resolved_us: ms * 1e3,
                ..BounceTimeline::default()
            },
        }
    }

    #[test]
    fn summary_takes_the_slowest_percent_and_lists_the_worst_first() {
        // 250 requests: 1 ms .. 250 ms; the slowest 1 % is 3 requests.
        let all: Vec<TracedRequest> = (1..=250)
            .rev()
            .map(|k| traced(k as f64, if k > 247 { 100 } else { 2 }))
            .collect();
        let s = TimelineSummary::of(all);
        assert_eq!(s.requests, 250);
        assert_eq!(s.slowest_requests, 3);
        assert_eq!(s.slowest_in_flight, 100.0);
        assert_eq!(s.all_in_flight, 2.0);
        let slow = s.slowest.as_ref().expect("slowest medians");
        assert_eq!(slow.resolved_us, 249_000.0);
        assert_eq!(slow.want_us, 2_490.0);
        let worst: Vec<f64> = s.worst.iter().map(|r| r.ms).collect();
        assert_eq!(worst, vec![250.0, 249.0, 248.0, 247.0, 246.0]);
        assert!(s.lines().contains("slowest #1 250.00 ms (100 in flight"));
        assert_eq!(s.truncated_requests, 1);
        assert!(s.lines().contains("warning: 1 requests"));
        // The first to enter, in entry order, neither the fastest nor
        // the slowest (7 k mod 250 = 0, 1, 2, 3, 4).
        let first: Vec<f64> = s.first.iter().map(|r| r.ms).collect();
        assert_eq!(first, vec![250.0, 143.0, 36.0, 179.0, 72.0]);
        assert!(s.lines().contains("submitted #1 250.00 ms (100 in flight"));
        assert!(s.lines().contains("submitted #2 143.00 ms (2 in flight"));
    }

    #[test]
    fn summary_of_nothing_and_of_one_request() {
        let s = TimelineSummary::of(Vec::new());
        assert_eq!((s.requests, s.slowest_requests), (0, 0));
        assert!(s.all.is_none() && s.slowest.is_none() && s.worst.is_empty());
        assert!(s.first.is_empty());
        let s = TimelineSummary::of(vec![traced(3.0, 1)]);
        assert_eq!(s.slowest_requests, 1);
        assert_eq!(s.worst.len(), 1);
    }

    #[test]
    fn timeline_takes_first_and_last_of_each_stage_and_medians() {
        let t0 = Instant::now();
        let ev = |stage, chunk, us| StageEvent {
            stage,
            chunk,
            at: t0 + Duration::from_micros(us),
        };
        let events = [
            ev(Stage::Entered, 0, 1),
            ev(Stage::Sized, 0, 2),
            ev(Stage::Queued, 0, 3),
            ev(Stage::Received, 0, 4),
            ev(Stage::Want, 0, 10),
            ev(Stage::Gathered, 0, 50),
            ev(Stage::Gathered, 1, 70),
            ev(Stage::WritePosted, 0, 80),
            ev(Stage::WritePosted, 1, 90),
            ev(Stage::DataSent, 1, 200),
            ev(Stage::DataSent, 0, 150),
            ev(Stage::Acked, 0, 300),
            ev(Stage::Acked, 1, 400),
        ];
        let t = BounceTimeline::of(&events, t0, 420.0);
        assert_eq!(
            (t.entered_us, t.sized_us, t.queued_us, t.received_us),
            (1.0, 2.0, 3.0, 4.0)
        );
        assert_eq!(
            (t.want_us, t.first_gathered_us, t.last_gathered_us),
            (10.0, 50.0, 70.0)
        );
        assert_eq!((t.first_data_sent_us, t.last_data_sent_us), (150.0, 200.0));
        assert_eq!(
            (t.first_acked_us, t.last_acked_us, t.resolved_us),
            (300.0, 400.0, 420.0)
        );
        let mut slow = t.clone();
        slow.last_acked_us = 900.0;
        let m = BounceTimeline::median_of(&[t.clone(), slow, t]).unwrap();
        assert_eq!(m.last_acked_us, 400.0);
        assert!(BounceTimeline::median_of(&[]).is_none());
        assert!(m.line().contains("ACKed 300-400"), "{}", m.line());
    }
}
