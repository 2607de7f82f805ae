//! The host's sink is foreign code: one that calls back into the plugin from `deliver` must not
//! deadlock it. (A sink that panics aborts the process at the ABI's `extern "C"` boundary: hosts must
//! not panic in `deliver`.)

mod common;
use common::*;
use kvgate_abi::abi_stable::std_types::{RSlice, RStr};
use kvgate_abi::sdk::sink_from_fn;
use kvgate_abi::{Event, EventKind, TransportBox, XferId};
use std::sync::{mpsc, Arc, Mutex, OnceLock};

/// Opens a sender whose sink is `on_event(transport, event)`, connected to a plain receiver, with a
/// 64 KiB source and destination registered.
fn sender_with_sink(
    on_event: impl Fn(&TransportBox, Event) + Send + Sync + 'static,
) -> (Arc<OnceLock<TransportBox>>, Instance, [kvgate_plugin_shm::SharedRegion; 2], kvgate_abi::Segment) {
    sender_with_config_and_sink("workers = 1", on_event)
}

/// [`sender_with_sink`] with the sender opened on `config`.
fn sender_with_config_and_sink(
    config: &str,
    on_event: impl Fn(&TransportBox, Event) + Send + Sync + 'static,
) -> (Arc<OnceLock<TransportBox>>, Instance, [kvgate_plugin_shm::SharedRegion; 2], kvgate_abi::Segment) {
    let cell: Arc<OnceLock<TransportBox>> = Arc::new(OnceLock::new());
    let in_sink = Arc::clone(&cell);
    let sink = sink_from_fn(move |e| on_event(in_sink.get().expect("opened"), e));
    let sender = ok((kvgate_plugin_shm::module().open())(RStr::from_str(config), sink));
    let receiver = Instance::open("");
    ok(sender.connect(RECEIVER, RSlice::from_slice(&receiver.transport.local_endpoint())));
    let (src, dst) = (region(1 << 16), region(1 << 16));
    let local = ok(sender.register(&src.desc())).key;
    let dest = ok(receiver.transport.register(&dst.desc()));
    let remote = ok(sender.import_remote_key(RECEIVER, RSlice::from_slice(&dest.remote_key)));
    let _ = cell.set(sender);
    (cell, receiver, [src, dst], segment(local, 0, remote, 0, 1 << 16))
}

#[test]
fn a_sink_that_calls_back_into_the_plugin_does_not_deadlock_it() {
    let (tx, rx) = mpsc::channel::<(XferId, EventKind, u64)>();
    let tx = Mutex::new(tx);
    let (cell, _receiver, _regions, seg) = sender_with_sink(move |t, e| {
        // Re-entrant calls from inside deliver: stats, cancel (of this and another id), submit refusal.
        let live = t.stats().live_transfers;
        t.cancel(e.xfer);
        t.cancel(XferId(12345));
        let _ = tx.lock().unwrap().send((e.xfer, e.kind, live));
    });
    let sender = cell.get().unwrap();
    for x in 1..=20 {
        ok(sender.submit(request(x, NO_TIMEOUT_NS, &[seg])));
    }
    let mut terminals = 0;
    while terminals < 20 {
        let (_, kind, _) = rx.recv_timeout(WAIT).expect("events keep coming");
        if kind == EventKind::SUCCEEDED || kind == EventKind::FAILED {
            terminals += 1;
        }
    }
    assert_eq!(sender.stats().live_transfers, 0);
    sender.shutdown();
}

/// A transfer of at most `inline_copy_bytes` submitted while nothing is queued is copied, and its
/// event delivered, by the thread that called `submit`, before `submit` returns; one byte more, or the
/// bound at 0, goes to a worker thread.
#[test]
fn a_small_transfer_is_copied_by_submit_and_a_larger_one_by_a_worker() {
    let cases = [
        ("inline_copy_bytes = 4096", 4096, true),
        ("inline_copy_bytes = 4096", 4097, false),
        ("inline_copy_bytes = 0", 1, false),
    ];
    for (config, len, inline) in cases {
        let (tx, rx) = mpsc::channel::<(EventKind, std::thread::ThreadId)>();
        let tx = Mutex::new(tx);
        let (cell, _receiver, _regions, seg) = sender_with_config_and_sink(config, move |_, e| {
            let _ = tx.lock().unwrap().send((e.kind, std::thread::current().id()));
        });
        let sender = cell.get().unwrap();
        ok(sender.submit(request(1, NO_TIMEOUT_NS, &[kvgate_abi::Segment { len, ..seg }])));
        let here = std::thread::current().id();
        let (kind, by) = if inline {
            rx.try_recv().unwrap_or_else(|_| panic!("{config}, {len} B: no event before submit returned"))
        } else {
            rx.recv_timeout(WAIT).expect("the worker's event")
        };
        assert_eq!(kind, EventKind::SUCCEEDED, "{config}, {len} B");
        assert_eq!(by == here, inline, "{config}, {len} B: delivered by the submitting thread?");
        sender.shutdown();
    }
}
