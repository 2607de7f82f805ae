//! The SDK's promises, checked through the same `PluginModRef` a host gets: every entry catches
//! panics (CONFORMANCE: HYGIENE-1), open errors pass through unchanged, and code sets survive
//! round trips and unknown values.

use kvgate_abi::sdk::{self, Plugin, PluginFactory, Sink};
use kvgate_abi::*;
use std::sync::{Arc, Mutex};

struct Panicky;

impl Plugin for Panicky {
    fn info(&self) -> PluginInfo {
        Factory::info()
    }
    fn local_endpoint(&self) -> Vec<u8> {
        b"ep".to_vec()
    }
    fn connect(&self, _peer: PeerId, _endpoint: &[u8]) -> Result<(), PluginError> {
        panic!("connect exploded")
    }
    fn disconnect(&self, _peer: PeerId) {}
    fn register(&self, _region: &RegionDesc) -> Result<Registration, PluginError> {
        Err(PluginError::new(ReasonCode::UNSUPPORTED_MEMORY, "no"))
    }
    fn deregister(&self, _key: LocalKey) -> Result<(), PluginError> {
        Ok(())
    }
    fn import_remote_key(&self, _peer: PeerId, _bytes: &[u8]) -> Result<RemoteKey, PluginError> {
        Ok(RemoteKey(7))
    }
    fn release_remote_key(&self, _key: RemoteKey) {}
    fn submit(&self, request: &SubmitRequest<'_>) -> Result<(), PluginError> {
        let _ = request.segments[request.segments.len()]; // index out of bounds: a panic
        Ok(())
    }
    fn cancel(&self, _xfer: XferId) {
        panic!("cancel exploded")
    }
    fn stats(&self) -> Stats {
        Stats::default()
    }
    fn shutdown(&self) {}
}

struct Factory;

impl PluginFactory for Factory {
    type Plugin = Panicky;
    fn info() -> PluginInfo {
        PluginInfo {
            name: "panicky".into(),
            version: "0".into(),
            abi_version: ABI_VERSION,
            capabilities: Capabilities::default(),
        }
    }
    fn open(config: &str, _sink: Sink) -> Result<Panicky, PluginError> {
        match config {
            "ok" => Ok(Panicky),
            "panic" => panic!("open exploded"),
            other => Err(PluginError::new(ReasonCode::INVALID_ARGUMENT, format!("bad config {other:?}"))),
        }
    }
}

fn open(config: &str) -> (Result<TransportBox, PluginError>, Arc<Mutex<Vec<Event>>>) {
    let module = sdk::module::<Factory>();
    let events = Arc::new(Mutex::new(Vec::new()));
    let seen = events.clone();
    let sink = sdk::sink_from_fn(move |e| seen.lock().unwrap().push(e));
    (module.open()(config.into(), sink).into_result(), events)
}

#[test]
fn module_reports_abi_version_and_info() {
    let module = sdk::module::<Factory>();
    assert_eq!(module.abi_version()(), ABI_VERSION);
    assert_eq!(module.info()().name.as_str(), "panicky");
}

#[test]
fn open_errors_and_panics_come_back_as_errors() {
    let err = open("nonsense").0.err().expect("bad config must fail");
    assert_eq!(err.code, ReasonCode::INVALID_ARGUMENT);
    assert!(err.message.contains("nonsense"), "{err}");

    let err = open("panic").0.err().expect("a panicking open must fail, not abort");
    assert_eq!(err.code, ReasonCode::PANIC);
    assert!(err.message.contains("open exploded"), "{err}");
}

#[test]
fn panics_in_calls_become_errors_or_unhealthy_events() {
    let (transport, events) = open("ok");
    let transport = transport.expect("opens");

    let err = transport.connect(PeerId(1), b"x"[..].into()).into_result().unwrap_err();
    assert_eq!(err.code, ReasonCode::PANIC);
    assert!(err.message.contains("connect exploded"));

    let segments = [Segment::default()];
    let request = SubmitRequest {
        xfer: XferId(1),
        peer: PeerId(1),
        ticket: Ticket(0),
        timeout_ns: 1,
        segments: segments[..].into(),
    };
    let err = transport.submit(request).into_result().unwrap_err();
    assert_eq!(err.code, ReasonCode::PANIC);

    assert!(events.lock().unwrap().is_empty());
    transport.cancel(XferId(1));
    let events = events.lock().unwrap();
    assert_eq!(events.len(), 1, "a panic in cancel is reported once: {events:?}");
    assert_eq!(events[0].kind, EventKind::UNHEALTHY);
    assert!(events[0].message.contains("cancel exploded"));
}

#[test]
fn errors_pass_through_unchanged() {
    let (transport, _) = open("ok");
    let err = transport.unwrap().register(&RegionDesc::default()).into_result().unwrap_err();
    assert_eq!(err.code, ReasonCode::UNSUPPORTED_MEMORY);
}

#[test]
fn code_sets_round_trip_and_unknown_values_are_named_unknown() {
    for code in ReasonCode::ALL {
        assert_eq!(ReasonCode::from_name(code.as_str()), Some(*code));
    }
    for kind in EventKind::ALL {
        assert_eq!(EventKind::from_name(kind.as_str()), Some(*kind));
    }
    assert_eq!(ReasonCode(9999).as_str(), "unknown");
    assert!(!EventKind(77).is_known());
    assert!(Capabilities { memory_kinds: MemoryKind::HOST.bit(), ..Default::default() }.serves(MemoryKind::HOST));
    assert!(
        !Capabilities { memory_kinds: MemoryKind::HOST.bit(), ..Default::default() }.serves(MemoryKind::CUDA_DEVICE)
    );
}

#[test]
fn terminal_classification() {
    assert!(Event::succeeded(XferId(1), 5).is_terminal());
    assert!(Event::failed(XferId(1), ReasonCode::CANCELLED, "x").is_terminal());
    assert!(!Event::quiesced(XferId(1)).is_terminal());
    assert!(!Event::incoming_failed(PeerId(1), Ticket(2), ReasonCode::OUT_OF_RANGE, "x").is_terminal());
    assert!(Event::incoming_quiesced(PeerId(1), Ticket(2)).is_incoming());
}
