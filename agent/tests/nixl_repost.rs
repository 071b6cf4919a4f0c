//! `NixlTransferEngine` reposts a landed single-descriptor write for the
//! next write of the same bytes to the same place (issue 18: saves NIXL's
//! `create_xfer_req`), and never reposts one its peer's metadata no longer
//! backs. Real NIXL (UCX over host memory), two agents in one process.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvfabric_agent::runtime::engine::{
    EngineError, MemDesc, MemKind, NixlTransferEngine, RepostStats, TransferEngine, XferState,
};

const WAIT: Duration = Duration::from_secs(20);
const LEN: usize = 1 << 16;

fn engine(tag: &str) -> Option<NixlTransferEngine> {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "repost-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    match NixlTransferEngine::new(&name) {
        Ok(e) => Some(e),
        Err(EngineError::Runtime(e)) => {
            common::skip(&format!("NIXL repost test: {e}"));
            None
        }
        Err(e) => panic!("NIXL engine: {e}"),
    }
}

/// Writes `src[range]` → `dst[range]` (a on b) and waits for it to land,
/// progressing both agents; returns the stats after the release.
fn write(
    a: &NixlTransferEngine,
    b: &NixlTransferEngine,
    peer: &str,
    src: &[u8],
    dst: &[u8],
    off: usize,
    len: usize,
) -> RepostStats {
    let local = MemDesc::host(src.as_ptr() as u64 + off as u64, len as u64);
    let remote = MemDesc::host(dst.as_ptr() as u64 + off as u64, len as u64);
    let h = a
        .post_write(peer, MemKind::Dram, &[local], MemKind::Dram, &[remote])
        .expect("post write");
    let t = Instant::now();
    loop {
        a.progress().unwrap();
        b.progress().unwrap();
        match a.poll(h).expect("write failed") {
            XferState::Success => break,
            XferState::InProgress => {
                assert!(t.elapsed() < WAIT, "write did not land within {WAIT:?}");
                std::thread::yield_now();
            }
        }
    }
    a.release(h);
    a.repost_stats()
}

#[test]
fn landed_writes_are_reposted_and_forgotten_with_their_peer() {
    let (a, b) = {
        let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
        (engine("a"), engine("b"))
    };
    let (Some(a), Some(b)) = (a, b) else {
        return;
    };
    let mut src = vec![0u8; LEN];
    let dst = vec![0u8; LEN];
    let peer = pair_up(&a, &b, &src, &dst);
    assert_eq!(peer, b.agent_name());
    b.load_peer(&a.local_metadata().unwrap()).unwrap();
    let landed = |dst: &[u8], src: &[u8], off: usize, len: usize| {
        assert_eq!(
            read(dst, off, len),
            &src[off..off + len],
            "bytes at {off}..{}",
            off + len
        );
    };

    // Same place, new bytes each time: the first creates, the rest repost.
    for round in 0..4u8 {
        src[..4096].fill(round + 1);
        let s = write(&a, &b, &peer, &src, &dst, 0, 4096);
        landed(&dst, &src, 0, 4096);
        assert_eq!(
            (s.created, s.reposted, s.idle),
            (1, round as u64, 1),
            "round {round}"
        );
    }
    // Another place (or length) is another request; both are kept.
    src[4096..12288].fill(0xAB);
    let s = write(&a, &b, &peer, &src, &dst, 4096, 8192);
    landed(&dst, &src, 4096, 8192);
    assert_eq!((s.created, s.reposted, s.idle), (2, 3, 2));
    src[4096..8192].fill(0xCD);
    let s = write(&a, &b, &peer, &src, &dst, 4096, 4096);
    landed(&dst, &src, 4096, 4096);
    assert_eq!((s.created, s.reposted, s.idle), (3, 3, 3));

    // Reloading the peer's metadata drops what was made against the old.
    assert_eq!(a.load_peer(&b.local_metadata().unwrap()).unwrap(), peer);
    assert_eq!(a.repost_stats().idle, 0, "idle requests outlived a reload");
    src[..4096].fill(0x11);
    let s = write(&a, &b, &peer, &src, &dst, 0, 4096);
    landed(&dst, &src, 0, 4096);
    assert_eq!((s.created, s.reposted, s.idle), (4, 3, 1));

    // Forgetting the peer drops its requests; loaded again, writes work.
    a.forget_peer(&peer).unwrap();
    assert_eq!(
        a.repost_stats().idle,
        0,
        "idle requests outlived forgetPeer"
    );
    a.load_peer(&b.local_metadata().unwrap()).unwrap();
    src[..4096].fill(0x22);
    let s = write(&a, &b, &peer, &src, &dst, 0, 4096);
    landed(&dst, &src, 0, 4096);
    assert_eq!((s.created, s.reposted, s.idle), (5, 3, 1));

    // A write still in flight when its peer is forgotten is not kept.
    let h = a
        .post_write(
            &peer,
            MemKind::Dram,
            &[MemDesc::host(src.as_ptr() as u64 + 32768, 4096)],
            MemKind::Dram,
            &[MemDesc::host(dst.as_ptr() as u64 + 32768, 4096)],
        )
        .unwrap();
    a.forget_peer(&peer).unwrap();
    let _ = a.poll(h);
    a.release(h);
    assert_eq!(
        a.repost_stats().idle,
        0,
        "a forgotten peer's write was kept"
    );

    // Released without a poll that saw it land: not kept (it may still
    // be moving), so the same write again makes a new request.
    a.load_peer(&b.local_metadata().unwrap()).unwrap();
    let before = a.repost_stats();
    let h = a
        .post_write(
            &peer,
            MemKind::Dram,
            &[MemDesc::host(src.as_ptr() as u64 + 16384, 4096)],
            MemKind::Dram,
            &[MemDesc::host(dst.as_ptr() as u64 + 16384, 4096)],
        )
        .unwrap();
    a.release(h);
    assert_eq!(
        a.repost_stats().idle,
        before.idle,
        "an unpolled write was kept"
    );
    let s = write(&a, &b, &peer, &src, &dst, 16384, 4096);
    assert_eq!(
        s.created,
        before.created + 2,
        "the unpolled request was reposted"
    );

    // Deregistering a region drops every idle request.
    a.load_peer(&b.local_metadata().unwrap()).unwrap();
    let s = write(&a, &b, &peer, &src, &dst, 0, 4096);
    assert_eq!(s.idle, 1);
    assert!(a.deregister_region(src.as_ptr() as u64));
    assert_eq!(a.repost_stats().idle, 0, "idle requests outlived a region");
}

#[test]
fn repost_switch_off_creates_every_write() {
    let (a, b) = {
        let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
        std::env::set_var("KVFABRIC_NIXL_REPOST", "off");
        let a = engine("off-a");
        std::env::remove_var("KVFABRIC_NIXL_REPOST");
        (a, engine("off-b"))
    };
    let (Some(a), Some(b)) = (a, b) else {
        return;
    };
    let src = vec![7u8; LEN];
    let dst = vec![0u8; LEN];
    let peer = pair_up(&a, &b, &src, &dst);
    for _ in 0..3 {
        write(&a, &b, &peer, &src, &dst, 0, 4096);
    }
    assert_eq!(
        a.repost_stats(),
        RepostStats {
            reposted: 0,
            created: 3,
            idle: 0
        }
    );
    assert!(read(&dst, 0, 4096).iter().all(|&x| x == 7));
}

/// Registers `src` with `a` and `dst` with `b` and loads `b` into `a`;
/// returns `b`'s name as `a` knows it.
fn pair_up(a: &NixlTransferEngine, b: &NixlTransferEngine, src: &[u8], dst: &[u8]) -> String {
    a.register_region(
        MemKind::Dram,
        MemDesc::host(src.as_ptr() as u64, LEN as u64),
    )
    .unwrap();
    b.register_region(
        MemKind::Dram,
        MemDesc::host(dst.as_ptr() as u64, LEN as u64),
    )
    .unwrap();
    a.load_peer(&b.local_metadata().unwrap()).unwrap()
}

/// Serializes engine creation against the test that sets
/// `KVFABRIC_NIXL_REPOST` (read once, when an engine is made).
static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Reads bytes NIXL wrote behind the compiler's back (after a SUCCESS poll).
fn read(buf: &[u8], off: usize, len: usize) -> Vec<u8> {
    buf[off..off + len]
        .iter()
        .map(|b| unsafe { std::ptr::read_volatile(b) })
        .collect()
}
