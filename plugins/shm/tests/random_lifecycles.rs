//! 10 000 seeded random lifecycles (sizes, scatter, cancels at random moments, short timeouts,
//! refused submits) on one pair: every accepted transfer settles with exactly one terminal event,
//! every successful one delivered its bytes, and every gauge returns to its baseline.
//! Replay a failure with `KVGATE_SHM_SEED=<printed seed>`.

mod common;
use common::*;
use kvgate_abi::{EventKind, ReasonCode, XferId};

const LIFECYCLES: u64 = 10_000;
const REGION_BYTES: usize = 1 << 20;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// CONFORMANCE: RES-1, RES-2
#[test]
fn ten_thousand_random_lifecycles_settle_and_stats_return_to_baseline() {
    let seed = std::env::var("KVGATE_SHM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    println!("KVGATE_SHM_SEED={seed}");
    let mut rng = Rng(seed);
    let pair = Pair::new("workers = 2\nchunk_bytes = 4096\nmax_inflight_transfers = 64");
    let base = pair.sender.stats();
    let (src, dst) = (region(REGION_BYTES), region(REGION_BYTES));
    fill(src.as_mut_slice(), seed);
    let (local, _, remote) = pair.regions(&src, &dst);
    let mut accepted = Vec::new();
    for xfer in 1..=LIFECYCLES {
        // Up to 8 segments, each a random range; one in 50 submits carries an out-of-range segment.
        let mut segments = Vec::new();
        for _ in 0..=rng.below(8) {
            let len = rng.below(20_000);
            let (s, d) = (rng.below(REGION_BYTES as u64 - len), rng.below(REGION_BYTES as u64 - len));
            segments.push(segment(local, s, remote, d, len));
        }
        let out_of_range = rng.below(50) == 0;
        if out_of_range {
            segments.push(segment(local, REGION_BYTES as u64, remote, 0, 1));
        }
        let timeout_ns = if rng.below(10) == 0 { 1 + rng.below(200_000) } else { NO_TIMEOUT_NS };
        match pair.submit(xfer, timeout_ns, &segments).into_result() {
            Ok(()) => {
                assert!(!out_of_range, "seed {seed}: an out-of-range submit was accepted");
                accepted.push(xfer);
            }
            Err(e) if e.code == ReasonCode::RESOURCE_EXHAUSTED => {
                // max_inflight_transfers reached (checked before the segments): let the queue drain.
                assert!(e.message.contains("max_inflight_transfers"), "seed {seed}: {e}");
                pair.sender.events.settled(XferId(*accepted.last().unwrap()));
            }
            Err(e) => {
                assert!(out_of_range, "seed {seed}: a valid submit was refused: {e}");
                assert_eq!(e.code, ReasonCode::OUT_OF_RANGE, "seed {seed}: {e}");
            }
        }
        match rng.below(4) {
            0 => pair.sender.transport.cancel(XferId(xfer)),
            1 => pair.sender.transport.cancel(XferId(xfer.saturating_sub(rng.below(5)))),
            _ => {}
        }
    }
    let mut outcomes = [0u64; 3];
    for &xfer in &accepted {
        let terminal = pair.sender.events.settled(XferId(xfer));
        outcomes[match (terminal.kind, terminal.reason) {
            (EventKind::SUCCEEDED, _) => 0,
            (EventKind::FAILED, ReasonCode::CANCELLED) => 1,
            (EventKind::FAILED, ReasonCode::TIMEOUT) => 2,
            other => panic!("seed {seed}: transfer {xfer} ended {other:?}"),
        }] += 1;
    }
    println!("succeeded {}, cancelled {}, timed out {}", outcomes[0], outcomes[1], outcomes[2]);
    assert!(outcomes[0] > 0 && outcomes[1] > 0, "seed {seed}: the mix exercised success and cancel: {outcomes:?}");
    let s = pair.sender.stats();
    assert_eq!((s.live_transfers, s.unquiesced_transfers), (0, 0), "seed {seed}: {s:?}");
    pair.sender.transport.release_remote_key(remote);
    ok(pair.sender.transport.deregister(local));
    assert_eq!(pair.sender.stats(), base, "seed {seed}");
    // The last successful transfers' bytes are checked by the integrity tests; here, one more copy of
    // the whole region after all that churn must still be exact.
    let (local, _, remote) = pair.regions(&src, &dst);
    ok(pair.submit(LIFECYCLES + 1, NO_TIMEOUT_NS, &[segment(local, 0, remote, 0, REGION_BYTES as u64)]));
    assert_eq!(pair.sender.events.settled(XferId(LIFECYCLES + 1)).kind, EventKind::SUCCEEDED);
    assert_eq!(checksum(src.as_slice()), checksum(dst.as_slice()), "seed {seed}");
}
