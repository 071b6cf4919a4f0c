//! The engines' local API end to end (issue 12): a real etcd, two real
//! `kvfabric agent` processes serving `--engine-socket`, and engines (this
//! test process, through `kvfabric-client`) attaching shm pools and handing
//! blocks off by id — byte-exact on the decode side, `AwaitArrival`
//! resolving after the last byte, TP 1 → TP 2 head slices, bad requests
//! answered with errors while the agents keep running, and an engine that
//! goes away detached at once (its session gone, its record withdrawn)
//! while another engine keeps transferring.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::proc::Agent;
use kvfabric_client::{pb, Client, ClientError, Session, ShmPool};

/// Distinguishes the shm pool names of one test process (see `attach`).
static SHM_SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn layout(tp_rank: u32, tp_size: u32, blocks: u32) -> pb::KvLayout {
    let kv_heads = 4 / tp_size;
    pb::KvLayout {
        layers: 3,
        num_blocks: blocks,
        block_bytes: 16 * u64::from(kv_heads) * 32 * 2,
        kv_split: true,
        dtype: "bf16".into(),
        tp_rank,
        tp_size,
        block_tokens: 16,
        kv_heads,
        head_dim: 32,
        device: -1,
        device_uuid: String::new(),
    }
}

/// Offset of (layer, plane, block) — the proto's layer-major formula.
fn block_offset(l: &pb::KvLayout, layer: u32, plane: u64, block: u32) -> usize {
    let planes = if l.kv_split { 2 } else { 1 };
    (((u64::from(layer) * planes + plane) * u64::from(l.num_blocks) + u64::from(block))
        * l.block_bytes) as usize
}

/// Asserts that, in every layer and plane of layout `l`, destination
/// block `dst[k]` of `dpool` holds source block `src[k]` of `spool`
/// byte for byte.
fn assert_blocks_landed(l: &pb::KvLayout, spool: &[u8], src: &[u32], dpool: &[u8], dst: &[u32]) {
    let bb = l.block_bytes as usize;
    for layer in 0..l.layers {
        for plane in 0..if l.kv_split { 2 } else { 1 } {
            for (&s, &d) in src.iter().zip(dst) {
                let so = block_offset(l, layer, plane, s);
                let doff = block_offset(l, layer, plane, d);
                assert!(
                    dpool[doff..doff + bb] == spool[so..so + bb],
                    "layer {layer} plane {plane}: block {d} does not hold source block {s}"
                );
            }
        }
    }
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8 | 1
}

struct Node {
    agent: Agent,
    socket: PathBuf,
    http: std::net::SocketAddr,
}

/// `GET /metrics` of `n`, as text.
fn scrape(n: &Node) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&n.http, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut t = String::new();
    s.read_to_string(&mut t).unwrap();
    t
}

/// `POST /v1/debug/faults` of `n` with JSON `body`: (status, body).
fn arm_faults(n: &Node, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&n.http, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/debug/faults HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut t = String::new();
    s.read_to_string(&mut t).unwrap();
    let code = t
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, t)
}

/// Sum of the samples of `name` in `text` (every label set).
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

fn spawn_agent(
    etcd: &Etcd,
    fabric: &str,
    logical: &str,
    role: &str,
    dir: &std::path::Path,
) -> Option<Node> {
    spawn_agent_env(etcd, fabric, logical, role, dir, &[])
}

/// [`spawn_agent`] with more environment (`env`).
fn spawn_agent_env(
    etcd: &Etcd,
    fabric: &str,
    logical: &str,
    role: &str,
    dir: &std::path::Path,
    env: &[(&str, &str)],
) -> Option<Node> {
    let socket = dir.join(format!("{logical}.sock"));
    let sock = socket.to_string_lossy().into_owned();
    let mut all = vec![("KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT", "1")];
    all.extend_from_slice(env);
    let mut agent = Agent::spawn_with(
        &etcd.endpoint(),
        fabric,
        logical,
        role,
        &["--engine-socket", &sock],
        &all,
    );
    let http = match agent.addr.recv_timeout(Duration::from_secs(30)) {
        Ok(a) => a,
        Err(_) => {
            let err = agent.kill_and_log();
            if err.contains("NIXL runtime") {
                common::skip(&format!("NIXL runtime not available: {err}"));
                return None;
            }
            panic!("agent never announced its address; stderr:\n{err}");
        }
    };
    Some(Node {
        agent,
        socket,
        http,
    })
}

fn signal_agent(n: &Node, sig: libc::c_int) {
    // SAFETY: plain kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(n.agent.proc.pid() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({sig})");
}

/// Retries `f` while it fails with NotFound (the destination's record is
/// still propagating through etcd), at most 10 s.
async fn until_found<T, F, Fut>(mut f: F) -> Result<T, ClientError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match f().await {
            Err(e) if e.code() == Some(tonic::Code::NotFound) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => return other,
        }
    }
}

async fn attach(node: &Node, id: &str, role: pb::Role, l: pb::KvLayout) -> (Session, ShmPool) {
    let client = Client::connect(&node.socket).await.expect("connect");
    let pool = ShmPool::create(
        &format!(
            "/kvf-test-{}-{id}-{}",
            std::process::id(),
            // Tests of one binary run in parallel in one process and reuse
            // engine ids: the sequence keeps their shm names apart.
            SHM_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ),
        kvfabric_client::pool_bytes(&l),
    )
    .expect("shm pool");
    let s = client
        .attach(id, &format!("uid-{id}"), role, l)
        .await
        .expect("attach");
    s.register_shm(&pool).await.expect("register");
    (s, pool)
}

#[tokio::test(flavor = "current_thread")]
async fn engines_attach_and_hand_off_blocks_byte_exact() {
    let Some(etcd) = Etcd::start("engines") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvf-engines-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = format!("eng-{}", std::process::id());
    let Some(mut a) = spawn_agent(&etcd, &fabric, "node-a", "prefill", &dir) else {
        return;
    };
    let mut b = spawn_agent(&etcd, &fabric, "node-b", "decode", &dir).expect("agent b");

    let la = layout(0, 1, 32);
    let (prefill, mut ppool) = attach(&a, "prefill-0", pb::Role::Prefill, la.clone()).await;
    let (decode, dpool) = attach(&b, "decode-0", pb::Role::Decode, layout(0, 1, 48)).await;
    for (i, x) in ppool.as_mut_slice().iter_mut().enumerate() {
        *x = pattern(i);
    }
    let (src, dst) = ([3u32, 17, 4, 30], [40u32, 2, 9, 11]);
    let r = until_found(|| prefill.transfer_blocks(7, "decode-0", &src, &dst))
        .await
        .expect("transfer");
    assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
    assert_eq!(r.bytes, 3 * 2 * 4 * la.block_bytes);
    let arr = decode
        .await_arrival(7, "prefill-0", Duration::from_secs(10))
        .await
        .expect("await");
    assert_eq!(arr.outcome(), pb::Outcome::Success, "{arr:?}");
    assert_eq!(arr.bytes, r.bytes);
    // Every destination block holds its source block, every layer and
    // plane; every other block is untouched (zero).
    let ld = layout(0, 1, 48);
    let bb = la.block_bytes as usize;
    let d = dpool.as_slice();
    let p = ppool.as_slice();
    for layer in 0..3 {
        for plane in 0..2 {
            for blk in 0..48u32 {
                let doff = block_offset(&ld, layer, plane, blk);
                match dst.iter().position(|&x| x == blk) {
                    Some(k) => {
                        let soff = block_offset(&la, layer, plane, src[k]);
                        assert!(
                            d[doff..doff + bb] == p[soff..soff + bb],
                            "layer {layer} plane {plane} block {blk}"
                        );
                    }
                    None => assert!(
                        d[doff..doff + bb].iter().all(|&x| x == 0),
                        "block {blk} was written"
                    ),
                }
            }
        }
    }
    // Both paths, forced.
    for (rid, path) in [(8u64, pb::Path::Standard), (9, pb::Path::Bounce)] {
        let r = prefill
            .transfer(pb::TransferRequest {
                request_id: rid,
                dst_engine: "decode-0".into(),
                src_blocks: vec![5, 6],
                dst_blocks: vec![20, 21],
                path: path as i32,
                ..Default::default()
            })
            .await
            .expect("transfer");
        assert_eq!(r.outcome(), pb::Outcome::Success, "{path:?}: {r:?}");
        let arr = decode
            .await_arrival(rid, "", Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(arr.outcome(), pb::Outcome::Success);
        let soff = block_offset(&la, 2, 1, 6);
        let doff = block_offset(&ld, 2, 1, 21);
        assert!(
            dpool.as_slice()[doff..doff + bb] == ppool.as_slice()[soff..soff + bb],
            "{path:?}"
        );
    }
    // An arrival that never comes times out (bounded).
    let t0 = Instant::now();
    let arr = decode
        .await_arrival(999, "", Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(arr.outcome(), pb::Outcome::Timeout);
    assert!(t0.elapsed() < Duration::from_secs(3));

    // TP 1 → TP 2: two decode ranks on agent b, each gets its two heads.
    let (r0, p0) = attach(&b, "decode-r0", pb::Role::Decode, layout(0, 2, 8)).await;
    let (r1, p1) = attach(&b, "decode-r1", pb::Role::Decode, layout(1, 2, 8)).await;
    for (rank, eng, rs, pool) in [(0u32, "decode-r0", &r0, &p0), (1, "decode-r1", &r1, &p1)] {
        let r = until_found(|| prefill.transfer_blocks(100 + u64::from(rank), eng, &[1], &[6]))
            .await
            .expect("tp transfer");
        assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
        assert_eq!(
            rs.await_arrival(100 + u64::from(rank), "prefill-0", Duration::from_secs(10))
                .await
                .unwrap()
                .outcome(),
            pb::Outcome::Success
        );
        let lr = layout(rank, 2, 8);
        let head = 32 * 2;
        for layer in 0..3 {
            for plane in 0..2 {
                for t in 0..16usize {
                    for h in 0..2usize {
                        let so = block_offset(&la, layer, plane, 1)
                            + t * 4 * head
                            + (rank as usize * 2 + h) * head;
                        let dof = block_offset(&lr, layer, plane, 6) + t * 2 * head + h * head;
                        assert!(
                            pool.as_slice()[dof..dof + head] == ppool.as_slice()[so..so + head],
                            "rank {rank} layer {layer} plane {plane} token {t} head {h}"
                        );
                    }
                }
            }
        }
    }

    // Bad requests: errors, and the agents keep serving.
    let code = |e: ClientError| e.code();
    let e = prefill
        .transfer_blocks(20, "decode-0", &[32], &[0])
        .await
        .unwrap_err();
    assert_eq!(code(e), Some(tonic::Code::InvalidArgument));
    let e = prefill
        .transfer_blocks(21, "decode-0", &[0], &[48])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("dst_blocks[0] = 48"), "{e}");
    let e = prefill
        .transfer_blocks(22, "nobody", &[0], &[0])
        .await
        .unwrap_err();
    assert_eq!(code(e), Some(tonic::Code::NotFound));
    let mut bad = layout(0, 1, 8);
    bad.block_tokens = 32;
    bad.block_bytes *= 2;
    let (odd, _op) = attach(&b, "decode-odd", pb::Role::Decode, bad).await;
    let e = until_found(|| prefill.transfer_blocks(23, "decode-odd", &[0], &[0]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::FailedPrecondition), "{e}");
    assert!(
        e.to_string().contains("block_tokens differs")
            && e.to_string().contains("source")
            && e.to_string().contains("destination"),
        "{e}"
    );
    drop(odd);
    let client = Client::connect(&a.socket).await.unwrap();
    let e = client
        .attach("prefill-0", "", pb::Role::Prefill, la.clone())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::AlreadyExists));
    let mut zero = la.clone();
    zero.layers = 0;
    let e = client
        .attach("x", "", pb::Role::Prefill, zero)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::InvalidArgument));
    // Socket garbage: the agent survives it.
    {
        use std::io::Write;
        let mut s = std::os::unix::net::UnixStream::connect(&a.socket).unwrap();
        let _ = s.write_all(b"GET / HTTP/1.1\r\n\r\n\x00\xff garbage");
    }

    // An engine that goes away (its Attach stream ends) is detached at once:
    // its session is gone, its record withdrawn; the other engines keep
    // transferring.
    let (gone, _gp) = attach(&a, "prefill-gone", pb::Role::Prefill, la.clone()).await;
    let gone_id = gone.id().to_string();
    let other = client.clone();
    drop(gone);
    let t0 = Instant::now();
    loop {
        match other.status_of(&gone_id).await {
            Err(e) if e.code() == Some(tonic::Code::NotFound) => break,
            _ => {}
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "session still alive after {:?}",
            t0.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = prefill
        .transfer_blocks(30, "decode-0", &[1], &[1])
        .await
        .unwrap();
    assert_eq!(r.outcome(), pb::Outcome::Success);
    assert_eq!(
        decode
            .await_arrival(30, "", Duration::from_secs(10))
            .await
            .unwrap()
            .outcome(),
        pb::Outcome::Success
    );
    let st = prefill.status().await.unwrap();
    assert!(st.in_flight.is_empty(), "{st:?}");
    assert!(st.transfers_succeeded >= 6, "{st:?}");

    // Issue 13's failure rule: a prefill engine that dies halfway through a
    // hand-off. The decode agent is stopped so the hand-off stays in
    // flight; the engine goes away (its Attach stream ends, as when its
    // process is killed); its agent cancels the request and tells the
    // decode agent, whose AwaitArrival then answers FAILURE — never SUCCESS
    // for blocks that did not all land.
    let (doomed, mut dpool) = attach(&a, "prefill-doomed", pb::Role::Prefill, la.clone()).await;
    for x in dpool.as_mut_slice().iter_mut() {
        *x = 0xAB;
    }
    let _ = until_found(|| doomed.transfer_blocks(499, "decode-0", &[0], &[44])).await;
    assert_eq!(
        decode
            .await_arrival(499, "prefill-doomed", Duration::from_secs(10))
            .await
            .unwrap()
            .outcome(),
        pb::Outcome::Success
    );
    signal_agent(&b, libc::SIGSTOP);
    let inflight = tokio::spawn(async move {
        let r = doomed
            .transfer_blocks(500, "decode-0", &[1, 2, 3], &[45, 46, 47])
            .await;
        (r, doomed)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    inflight.abort();
    let _ = inflight.await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal_agent(&b, libc::SIGCONT);
    let t0 = Instant::now();
    let arr = decode
        .await_arrival(500, "prefill-doomed", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(arr.outcome(), pb::Outcome::Failure, "{arr:?}");
    assert!(t0.elapsed() < Duration::from_secs(10));
    drop(dpool);

    prefill.detach().await.unwrap();
    decode.detach().await.unwrap();
    drop((r0, r1, client, other));
    // Quiesce: every engine detached on both agents, every pool released
    // (NIXL registration dropped, unmapped), no flow left.
    for (who, n) in [("a", &a), ("b", &b)] {
        let t0 = Instant::now();
        loop {
            let m = scrape(n);
            let (engines, pools, flows) = (
                sample(&m, "kvfabric_engines"),
                sample(&m, "kvfabric_engine_pool_bytes"),
                sample(&m, "kvfabric_flows"),
            );
            if engines == 0.0 && pools == 0.0 && flows == 0.0 {
                let counter = if who == "a" {
                    "kvfabric_engine_transfers_total"
                } else {
                    "kvfabric_engine_arrivals_total"
                };
                assert!(sample(&m, counter) >= 6.0, "{who}: {counter}\n{m}");
                if who == "a" {
                    // Paged blocks are equal-length descriptors in every
                    // layer plane: between two agents that both take it,
                    // their chunks go as DATA_BLOCKS (issue 18 step 3).
                    let blocks = sample(&m, "kvfabric_data_blocks_total");
                    assert!(blocks >= 1.0, "no DATA_BLOCKS sent\n{m}");
                }
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "agent {who} not quiet: engines {engines}, pool bytes {pools}, flows {flows}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for (who, n) in [("a", &mut a), ("b", &mut b)] {
        let (status, log) = n.agent.terminate();
        assert!(status.is_some_and(|s| s.success()), "agent {who}: {log}");
        assert!(!n.socket.exists(), "socket removed at exit");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 14, engine pods: when the operator tombstones an engine's pod UID,
/// the agent detaches the engine's session within 1 s (its requests fail,
/// its pool is released) and refuses a later Attach with that UID.
#[tokio::test(flavor = "current_thread")]
async fn tombstoned_engine_pod_is_detached_and_refused() {
    let Some(etcd) = Etcd::start("engines-tomb") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvf-engines-tomb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = format!("engt-{}", std::process::id());
    let Some(a) = spawn_agent(&etcd, &fabric, "node-a", "prefill", &dir) else {
        return;
    };
    let la = layout(0, 1, 8);
    let (keep, _kpool) = attach(&a, "keep-0", pb::Role::Prefill, la.clone()).await;
    let (doomed, _dpool) = attach(&a, "doomed-0", pb::Role::Prefill, la.clone()).await;
    assert_eq!(sample(&scrape(&a), "kvfabric_engines"), 2.0);

    let mut kv = etcd_client::Client::connect([etcd.endpoint().as_str()], None)
        .await
        .expect("etcd");
    let t0 = Instant::now();
    kv.put(
        format!("/kvfabric/{fabric}/tombstones/uid-doomed-0"),
        r#"{"uid":"uid-doomed-0","namespace":"default","pod":"doomed","reason":"PodDeleting","observedAtMs":0}"#,
        None,
    )
    .await
    .expect("put tombstone");
    while doomed.is_open() && t0.elapsed() < Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let closed_after = t0.elapsed();
    assert!(
        !doomed.is_open(),
        "session of the tombstoned pod still open after 1 s"
    );
    assert!(keep.is_open(), "the other engine's session was closed");
    println!("tombstone → engine session closed after {closed_after:?}");
    // Its pool is released and it is no longer counted.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = scrape(&a);
        if sample(&m, "kvfabric_engines") == 1.0
            && sample(&m, "kvfabric_engine_pool_bytes") == kvfabric_client::pool_bytes(&la) as f64
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "detached engine still counted:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A late Attach from the dead pod is refused.
    let client = Client::connect(&a.socket).await.expect("connect");
    match client
        .attach("doomed-1", "uid-doomed-0", pb::Role::Prefill, la.clone())
        .await
    {
        Err(e) => assert_eq!(e.code(), Some(tonic::Code::FailedPrecondition), "{e}"),
        Ok(_) => panic!("Attach of a tombstoned pod accepted"),
    }
    drop(keep);
    drop(a);
}

/// Environment of the re-executed "foreign engine" (see
/// `engines_are_bound_to_their_uid`): the socket, a session and an shm
/// object of another uid.
const FOREIGN_ENV: &str = "KVF_TEST_FOREIGN_ENGINE";
/// The uid the foreign engine runs as (`nobody`).
const FOREIGN_UID: u32 = 65534;

/// Not a test on its own: the body of a process that
/// `engines_are_bound_to_their_uid` starts as uid 65534 (gid 0, the
/// socket's group). Does nothing unless [`FOREIGN_ENV`] is set.
#[tokio::test(flavor = "current_thread")]
#[ignore = "run by engines_are_bound_to_their_uid as another uid"]
async fn foreign_engine_process() {
    let Ok(v) = std::env::var(FOREIGN_ENV) else {
        return;
    };
    let [socket, session, shm, len]: [&str; 4] = v
        .split('|')
        .collect::<Vec<_>>()
        .try_into()
        .expect("socket|session|shm|len");
    let len: u64 = len.parse().unwrap();
    // SAFETY: getuid has no preconditions.
    assert_eq!(unsafe { libc::getuid() }, FOREIGN_UID);
    let client = Client::connect(socket).await.expect("connect as uid 65534");
    // Another uid's session is not ours to use, even by its id.
    let e = client
        .status_of(session)
        .await
        .expect_err("foreign session");
    assert_eq!(e.code(), Some(tonic::Code::PermissionDenied), "{e}");
    println!("FOREIGN: session of uid 0 refused: {e}");
    let l = layout(0, 1, 8);
    let s = client
        .attach("foreign-0", "uid-foreign", pb::Role::Prefill, l.clone())
        .await
        .expect("attach");
    // Another uid's shm object (the root engine's pool) is refused ...
    let e = s
        .register_shm_name(shm, len)
        .await
        .expect_err("foreign shm");
    assert_eq!(e.code(), Some(tonic::Code::PermissionDenied), "{e}");
    println!("FOREIGN: shm object of uid 0 refused: {e}");
    // ... its own is taken.
    let own = ShmPool::create(
        &format!("/kvf-test-foreign-{}", std::process::id()),
        kvfabric_client::pool_bytes(&l),
    )
    .expect("own shm pool");
    s.register_shm(&own).await.expect("own pool registered");
    println!("FOREIGN: own pool registered");
    s.detach().await.expect("detach");
}

#[tokio::test(flavor = "current_thread")]
async fn engines_are_bound_to_their_uid() {
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        common::skip("needs root to start an engine process as another uid");
        return;
    }
    let Some(etcd) = Etcd::start("engines-uid") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvf-engines-uid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = format!("enguid-{}", std::process::id());
    let Some(mut a) = spawn_agent(&etcd, &fabric, "node-a", "prefill", &dir) else {
        return;
    };
    // The socket's directory must be traversable by the other uid.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (owner, pool) = attach(&a, "owner-0", pb::Role::Prefill, layout(0, 1, 8)).await;
    let spec = format!(
        "{}|{}|{}|{}",
        a.socket.display(),
        owner.id(),
        pool.name(),
        pool.len()
    );
    use std::os::unix::process::CommandExt;
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "foreign_engine_process",
            "--ignored",
            "--nocapture",
        ])
        .env(FOREIGN_ENV, &spec)
        .current_dir("/")
        .uid(FOREIGN_UID)
        .gid(0)
        .output()
        .expect("start the foreign engine");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "foreign engine failed:\n{text}");
    for line in [
        "FOREIGN: session of uid 0 refused",
        "FOREIGN: shm object of uid 0 refused",
        "FOREIGN: own pool registered",
    ] {
        assert!(text.contains(line), "missing {line:?}:\n{text}");
    }
    // The owner's session is untouched and the agent serves on.
    let st = owner.status().await.expect("owner's session");
    assert_eq!(st.engine_id, "owner-0");
    owner.detach().await.unwrap();
    a.agent.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Shrinks shm object `name` to `len` bytes, as a misbehaving engine
/// would after registering it.
fn truncate_shm(name: &str, len: i64) {
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: plain FFI on an object this test created.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR, 0);
        assert!(fd >= 0, "shm_open {name}");
        assert_eq!(libc::ftruncate(fd, len), 0, "ftruncate {name}");
        libc::close(fd);
    }
}

#[tokio::test(flavor = "current_thread")]
async fn an_engine_truncating_its_pool_is_detached_and_the_agent_lives() {
    let Some(etcd) = Etcd::start("engines-trunc") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvf-engines-trunc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = format!("engtrunc-{}", std::process::id());
    let Some(mut a) = spawn_agent(&etcd, &fabric, "node-a", "prefill", &dir) else {
        return;
    };
    let mut b = spawn_agent(&etcd, &fabric, "node-b", "decode", &dir).expect("agent b");
    let l = layout(0, 1, 32);
    let (bad, mut bad_pool) = attach(&a, "prefill-bad", pb::Role::Prefill, l.clone()).await;
    let (good, mut good_pool) = attach(&a, "prefill-good", pb::Role::Prefill, l.clone()).await;
    let (decode, dpool) = attach(&b, "decode-0", pb::Role::Decode, l.clone()).await;
    for p in [&mut bad_pool, &mut good_pool] {
        for (i, x) in p.as_mut_slice().iter_mut().enumerate() {
            *x = pattern(i);
        }
    }
    // The bad engine shrinks its registered pool to one page; it must not
    // touch the pool any more (nor may this test).
    truncate_shm(bad_pool.name(), 4096);
    let (src, dst) = ([3u32, 17], [5u32, 6]);
    let r = until_found(|| bad.transfer_blocks(1, "decode-0", &src, &dst))
        .await
        .expect("transfer answered");
    println!("truncated source: {r:?}");
    assert_eq!(r.outcome(), pb::Outcome::Failure, "{r:?}");
    assert!(r.reason.contains("truncated"), "{}", r.reason);
    // The decode side is told it failed, never handed zeros as its KV.
    let arr = decode
        .await_arrival(1, "prefill-bad", Duration::from_secs(10))
        .await
        .expect("await");
    assert_ne!(arr.outcome(), pb::Outcome::Success, "{arr:?}");
    // The bad engine is detached within a second; the agent serves on.
    let client = Client::connect(&a.socket).await.unwrap();
    let t0 = Instant::now();
    loop {
        match client.status_of(bad.id()).await {
            Err(e) if e.code() == Some(tonic::Code::NotFound) => break,
            _ if t0.elapsed() > Duration::from_secs(1) => panic!("bad engine still attached"),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert!(scrape(&a).contains("kvfabric_engines"), "agent a answers");
    let r = good
        .transfer_blocks(2, "decode-0", &src, &dst)
        .await
        .expect("good transfer");
    assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
    let arr = decode
        .await_arrival(2, "prefill-good", Duration::from_secs(10))
        .await
        .expect("await");
    assert_eq!(arr.outcome(), pb::Outcome::Success, "{arr:?}");
    assert_blocks_landed(&l, good_pool.as_slice(), &src, dpool.as_slice(), &dst);

    // The receiving side: the decode engine truncates its pool; a hand-off
    // into it scatters into zero pages and its arrival is a failure.
    truncate_shm(dpool.name(), 4096);
    let r = good
        .transfer_blocks(3, "decode-0", &src, &[9, 10])
        .await
        .expect("transfer answered");
    println!("truncated destination, sender's view: {r:?}");
    let arr = decode
        .await_arrival(3, "prefill-good", Duration::from_secs(10))
        .await;
    println!("truncated destination, decode's view: {arr:?}");
    assert!(
        !matches!(&arr, Ok(a) if a.outcome() == pb::Outcome::Success),
        "{arr:?}"
    );
    assert!(scrape(&b).contains("kvfabric_engines"), "agent b answers");
    drop((bad_pool, dpool));
    good.detach().await.unwrap();
    // Close every connection first (the agents' drain waits on open ones).
    drop((client, bad, decode));
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.agent.terminate();
    b.agent.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "current_thread")]
async fn a_hand_off_into_a_re_attached_engine_is_refused_by_incarnation() {
    let Some(etcd) = Etcd::start("engines-inc") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvf-engines-inc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = format!("enginc-{}", std::process::id());
    let Some(mut a) = spawn_agent(&etcd, &fabric, "node-a", "prefill", &dir) else {
        return;
    };
    let mut b = spawn_agent(&etcd, &fabric, "node-b", "decode", &dir).expect("agent b");
    let l = layout(0, 1, 32);
    let (prefill, mut ppool) = attach(&a, "prefill-0", pb::Role::Prefill, l.clone()).await;
    for (i, x) in ppool.as_mut_slice().iter_mut().enumerate() {
        *x = pattern(i);
    }
    // The decode engine allocates blocks 5, 6 under its first attach ...
    let (decode, dpool) = attach(&b, "decode-0", pb::Role::Decode, l.clone()).await;
    let first = decode.incarnation();
    assert_ne!(first, 0);
    let r =
        until_found(|| prefill.transfer_blocks_checked(1, "decode-0", first, &[3, 17], &[5, 6]))
            .await
            .expect("transfer");
    assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
    // ... then re-attaches (a restart) with a fresh pool: a hand-off still
    // naming the first attach is refused, nothing written.
    decode.detach().await.unwrap();
    drop(dpool);
    let client = Client::connect(&b.socket).await.unwrap();
    let pool2 = ShmPool::create(
        &format!(
            "/kvf-test-{}-decode-0-again-{}",
            std::process::id(),
            SHM_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ),
        kvfabric_client::pool_bytes(&l),
    )
    .unwrap();
    let again = client
        .attach("decode-0", "uid-decode-0", pb::Role::Decode, l.clone())
        .await
        .unwrap();
    again.register_shm(&pool2).await.unwrap();
    assert_ne!(again.incarnation(), first);
    let t0 = Instant::now();
    let e = loop {
        match prefill
            .transfer_blocks_checked(2, "decode-0", first, &[3, 17], &[5, 6])
            .await
        {
            // The old record may still be the one resolved for a moment.
            Err(e) if e.code() == Some(tonic::Code::NotFound) => {}
            Err(e) => break e,
            Ok(r)
                if r.outcome() != pb::Outcome::Success
                    && t0.elapsed() < Duration::from_secs(10) => {}
            Ok(r) => panic!("a hand-off into the re-attached engine was not refused: {r:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(e.code(), Some(tonic::Code::FailedPrecondition), "{e}");
    assert!(e.to_string().contains("re-attached"), "{e}");
    assert!(
        pool2.as_slice().iter().all(|&x| x == 0),
        "the new pool was written"
    );
    // Naming the current attach works.
    let r = until_found(|| {
        prefill.transfer_blocks_checked(3, "decode-0", again.incarnation(), &[3, 17], &[5, 6])
    })
    .await
    .expect("transfer");
    assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
    prefill.detach().await.unwrap();
    again.detach().await.unwrap();
    drop(client);
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.agent.terminate();
    b.agent.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Cancel that comes while its request is listed in flight but still
/// being routed (path "pending": here held there 3 s by the test fault
/// hook) is accepted, and the Transfer resolves CANCELLED by the transport
/// once it is submitted — not SUCCESS. Once
/// resolved, the request is not in flight: a second Cancel says so. The
/// next hand-off between the same engines lands byte-exact.
#[tokio::test(flavor = "current_thread")]
async fn a_cancel_while_the_request_is_being_routed_cancels_it() {
    let Some(etcd) = Etcd::start("engines-cancel") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvf-engines-cancel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fabric = format!("engcan-{}", std::process::id());
    let faults = [("KVFABRIC_TEST_FAULTS", "1")];
    let Some(mut a) = spawn_agent_env(&etcd, &fabric, "node-a", "prefill", &dir, &faults) else {
        return;
    };
    let mut b = spawn_agent(&etcd, &fabric, "node-b", "decode", &dir).expect("agent b");
    let l = layout(0, 1, 32);
    let (prefill, mut ppool) = attach(&a, "prefill-0", pb::Role::Prefill, l.clone()).await;
    let (decode, dpool) = attach(&b, "decode-0", pb::Role::Decode, l.clone()).await;
    for (i, x) in ppool.as_mut_slice().iter_mut().enumerate() {
        *x = pattern(i);
    }
    let r = until_found(|| prefill.transfer_blocks(1, "decode-0", &[0], &[0]))
        .await
        .expect("transfer");
    assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");

    let hold = Duration::from_secs(3);
    let (code, body) = arm_faults(&a, r#"{"route_delay_ms": 3000, "delayed_routes": 1}"#);
    assert_eq!(code, 200, "{body}");
    let t0 = Instant::now();
    let transfer = prefill.transfer(pb::TransferRequest {
        request_id: 2,
        dst_engine: "decode-0".into(),
        src_blocks: vec![1, 2],
        dst_blocks: vec![1, 2],
        path: pb::Path::Bounce as i32,
        timeout_ms: 20_000,
        ..Default::default()
    });
    let cancel = async {
        // Listed in flight, not routed yet.
        loop {
            let st = prefill.status().await.expect("status");
            if st
                .in_flight
                .iter()
                .any(|f| f.request_id == 2 && f.path == "pending")
            {
                break;
            }
            assert!(
                t0.elapsed() < hold,
                "request 2 never listed as pending: {st:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        prefill.cancel(2).await.expect("cancel")
    };
    let (r, cancelled) = tokio::join!(transfer, cancel);
    let r = r.expect("transfer 2");
    assert!(cancelled, "a request listed in flight was not cancelled");
    assert_eq!(r.outcome(), pb::Outcome::Cancelled, "{r:?}");
    // Cancelled in the transport (not a completed write relabelled).
    assert!(
        r.reason.contains("cancelled by the engine") && !r.reason.contains("completed before"),
        "{r:?}"
    );
    assert!(
        t0.elapsed() < hold + Duration::from_secs(10),
        "cancelled only after {:?}",
        t0.elapsed()
    );
    assert!(!prefill.cancel(2).await.expect("cancel again"));
    let st = prefill.status().await.expect("status");
    assert!(st.in_flight.is_empty(), "{st:?}");
    // The decode side learns it failed; the engines keep working.
    let arr = decode
        .await_arrival(2, "prefill-0", Duration::from_secs(5))
        .await
        .expect("await");
    assert_ne!(arr.outcome(), pb::Outcome::Success, "{arr:?}");
    let r = prefill
        .transfer_blocks(3, "decode-0", &[3], &[3])
        .await
        .expect("transfer 3");
    assert_eq!(r.outcome(), pb::Outcome::Success, "{r:?}");
    assert_blocks_landed(&l, ppool.as_slice(), &[3], dpool.as_slice(), &[3]);
    prefill.detach().await.unwrap();
    decode.detach().await.unwrap();
    a.agent.terminate();
    b.agent.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}
