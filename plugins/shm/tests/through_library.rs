//! The shm plugin as the gateway meets it from a file: `libkvgate_shm.so` loaded by kvgate-host
//! through the stable ABI, two instances opened from it, a checksummed transfer between them.

mod common;
use common::*;
use kvgate_abi::abi_stable::std_types::RSlice;
use kvgate_abi::{EventKind, XferId};
use kvgate_host::artifacts::built_or_build_cdylib;
use kvgate_host::PluginHost;
use std::path::Path;
use std::sync::Arc;

fn open_from(host: &PluginHost) -> Instance {
    let events = Arc::new(Recorder::default());
    let opened = host.open("shm", "workers = 2", events.sink()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(opened.info().name.as_str(), "shm");
    let transport = opened.transport_arc();
    drop(opened);
    Instance { transport: Arc::try_unwrap(transport).ok().expect("the host keeps no reference"), events }
}

// CONFORMANCE: HYGIENE-4
#[test]
fn the_loaded_library_moves_bytes_between_two_instances() {
    let path = built_or_build_cdylib("kvgate-plugin-shm-so", "kvgate_shm", Path::new(env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut host = PluginHost::new();
    assert_eq!(host.load_library(&path).unwrap(), "shm");
    let pair = Pair { sender: open_from(&host), receiver: open_from(&host) };
    ok(pair.sender.transport.connect(RECEIVER, RSlice::from_slice(&pair.receiver.transport.local_endpoint())));
    let (src, dst) = (region((3 << 20) + 5), region((3 << 20) + 5));
    fill(src.as_mut_slice(), 0xABCD);
    let (local, _, remote) = pair.regions(&src, &dst);
    ok(pair.submit(1, NO_TIMEOUT_NS, &[segment(local, 0, remote, 0, src.len() as u64)]));
    let done = pair.sender.events.settled(XferId(1));
    assert_eq!((done.kind, done.bytes), (EventKind::SUCCEEDED, src.len() as u64));
    assert_eq!(checksum(src.as_slice()), checksum(dst.as_slice()));
    pair.sender.transport.shutdown();
    assert_eq!(pair.sender.stats().workers_alive, 0);
}
