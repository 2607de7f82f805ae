//! Which transport a link ends up on, in process: a real listener (`listener::route` in front of the
//! gRPC server, as `kvgate serve` runs it), a real dial, and an "older gateway" whose listener is a
//! bare gRPC server that takes no framed link. And a framed link's session while the driver's thread,
//! which reads it, is busy.

use super::handshaken::Session;
use super::{dial, listener, LinkAuth, LocalIdentity, PeerDirectory, PeerLinkService};
use crate::config::{GatewayConfig, PeerAuthMode, PeerEntry, PeerTransport};
use crate::listeners::GuardedListener;
use crate::metrics::GatewayMetrics;
use kvgate_client::lane_frame::{encode_frame, FrameBuffer};
use kvgate_client::proto::{self, peer_frame::Frame, peer_link_server::PeerLinkServer, PeerFrame};
use prost::Message;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config(transport: Option<PeerTransport>) -> GatewayConfig {
    let mut config = GatewayConfig::default();
    config.peer_link.auth = Some(PeerAuthMode::None);
    config.peer_link.transport = transport;
    config
}

fn identity(name: &str) -> LocalIdentity {
    LocalIdentity {
        name: name.into(),
        incarnation: 1,
        host: "test".into(),
        plugins: Default::default(),
        features: Vec::new(),
    }
}

fn entry(name: &str, address: &str) -> PeerEntry {
    PeerEntry { name: name.into(), address: address.into(), same_host: true, tls_name: String::new() }
}

/// The "server" gateway, which knows the dialler `a`. `framed_listener`: today's listener; else a
/// bare gRPC server (an older kvgate). Returns its address, where it hands accepted sessions, and
/// its stop switch (the listener stops routing once that is dropped).
async fn server(
    framed_listener: bool,
) -> (String, tokio::sync::mpsc::Receiver<Session>, tokio::sync::watch::Sender<bool>) {
    let (address, incoming, stop, _) = server_with(framed_listener, config(None)).await;
    (address, incoming, stop)
}

/// [`server`] with its configuration, and its metrics.
async fn server_with(
    framed_listener: bool,
    config: GatewayConfig,
) -> (String, tokio::sync::mpsc::Receiver<Session>, tokio::sync::watch::Sender<bool>, Arc<GatewayMetrics>) {
    let config = Arc::new(config);
    let metrics = Arc::new(GatewayMetrics::default());
    let (directory, mut tasks) = PeerDirectory::with_static(&[entry("a", "127.0.0.1:1")]);
    let incoming = tasks.remove(0).1.incoming;
    let service = Arc::new(PeerLinkService::new(Arc::new(identity("b")), config.clone(), directory, LinkAuth::None));
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = tcp.local_addr().unwrap().to_string();
    let guarded = GuardedListener::new(tcp, "peer_link", config.peer_link.connections, metrics.clone());
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let stream = if framed_listener {
        listener::route(guarded, service.clone(), config.clone(), stop)
    } else {
        Box::pin(guarded.into_stream())
    };
    tokio::spawn(
        tonic::transport::Server::builder().add_service(PeerLinkServer::from_arc(service)).serve_with_incoming(stream),
    );
    (address, incoming, stop_tx, metrics)
}

async fn dial_b(transport: Option<PeerTransport>, address: &str) -> anyhow::Result<Session> {
    dial::dial(&config(transport), &entry("b", address), &identity("a"), &LinkAuth::None).await
}

#[tokio::test]
async fn a_framed_dial_links_framed_and_a_grpc_dial_links_grpc_on_the_same_listener() {
    let (address, mut accepted, _stop) = server(true).await;
    for (asked, expected) in [(None, PeerTransport::Framed), (Some(PeerTransport::Grpc), PeerTransport::Grpc)] {
        let dialled = dial_b(asked, &address).await.unwrap();
        assert_eq!(dialled.transport, expected);
        assert_eq!(dialled.hello.name, "b");
        let taken = accepted.recv().await.unwrap();
        assert_eq!(taken.transport, expected, "the server side agrees");
        assert_eq!(taken.hello.name, "a");
        // Frames cross both ways on it.
        let heartbeat = |seq| PeerFrame { frame: Some(Frame::Heartbeat(proto::Heartbeat { seq })), mac: Vec::new() };
        dialled.outbound.queue_bulk(heartbeat(7)).await.unwrap();
        taken.outbound.queue_bulk(heartbeat(8)).await.unwrap();
        let (mut dialled_in, mut taken_in) = (dialled.inbound, taken.inbound);
        assert_eq!(taken_in.next().await.unwrap().unwrap(), heartbeat(7));
        assert_eq!(dialled_in.next().await.unwrap().unwrap(), heartbeat(8));
    }
}

#[tokio::test]
async fn a_framed_dial_to_a_gateway_without_framed_links_falls_back_to_grpc() {
    let (address, mut accepted, _stop) = server(false).await;
    let dialled = dial_b(Some(PeerTransport::Framed), &address).await.unwrap();
    assert_eq!(dialled.transport, PeerTransport::Grpc);
    assert_eq!(accepted.recv().await.unwrap().transport, PeerTransport::Grpc);
}

/// Opens a raw framed connection to `address` and sends `frames` (after the magic); returns the
/// frames the server sent back before it closed.
async fn raw_framed(address: &str, frames: &[Vec<u8>]) -> Vec<PeerFrame> {
    let mut tcp = tokio::net::TcpStream::connect(address).await.unwrap();
    tcp.write_all(super::framed::MAGIC).await.unwrap();
    let mut magic = [0u8; 8];
    tcp.read_exact(&mut magic).await.unwrap();
    assert_eq!(&magic, super::framed::MAGIC, "the server echoes the magic");
    for frame in frames {
        tcp.write_all(frame).await.unwrap();
    }
    let mut buffer = FrameBuffer::default();
    let mut got = Vec::new();
    loop {
        while let Some(body) = buffer.take(1 << 20).unwrap() {
            got.push(PeerFrame::decode(body).unwrap());
        }
        match tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_buf(buffer.spare())).await {
            Ok(Ok(0)) | Ok(Err(_)) => return got,
            Ok(Ok(_)) => {}
            Err(_) => panic!("the server neither answered nor closed within 5 s: {got:?}"),
        }
    }
}

#[tokio::test]
async fn a_framed_stranger_gets_a_refusal_with_its_reason_and_the_connection_closes() {
    let (address, _accepted, _stop) = server(true).await;
    let hello = |name: &str| {
        let mut bytes = Vec::new();
        encode_frame(&identity(name).hello_to("b", PeerAuthMode::None, Vec::new(), Vec::new()), &mut bytes);
        bytes
    };
    let got = raw_framed(&address, &[hello("mallory")]).await;
    match got.as_slice() {
        [PeerFrame { frame: Some(Frame::Refused(r)), .. }] => {
            assert_eq!(r.reason, "unknown_peer", "{r:?}");
            assert!(r.message.contains("mallory"), "{r:?}");
        }
        other => panic!("expected one refusal, got {other:?}"),
    }
    // A dialler sees the reason in its error.
    let Err(e) = dial::dial(&config(None), &entry("b", &address), &identity("mallory"), &LinkAuth::None).await else {
        panic!("a stranger's dial succeeded")
    };
    assert!(format!("{e:#}").contains("unknown_peer"), "{e:#}");
    // Not a hello first: refused as a protocol violation.
    let mut heartbeat = Vec::new();
    encode_frame(
        &PeerFrame { frame: Some(Frame::Heartbeat(proto::Heartbeat { seq: 1 })), mac: Vec::new() },
        &mut heartbeat,
    );
    let got = raw_framed(&address, &[heartbeat]).await;
    assert!(
        matches!(got.as_slice(), [PeerFrame { frame: Some(Frame::Refused(r)), .. }] if r.reason == "protocol_violation"),
        "{got:?}"
    );
    // A length past the frame bound: the connection ends without reading the body.
    let too_long = ((super::max_decoding_bytes(&config(None)) + 1) as u32).to_le_bytes().to_vec();
    let got = raw_framed(&address, &[too_long]).await;
    assert!(
        matches!(got.as_slice(), [PeerFrame { frame: Some(Frame::Refused(r)), .. }] if r.reason == "protocol_violation" && r.message.contains("max_frame_bytes")),
        "{got:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_read_on_a_blocked_driver_thread_stays_up_while_its_peer_speaks_and_is_lost_once_it_is_silent() {
    use crate::channels::{DriverInput, LinkEnd, PeerEvent};
    use std::time::Duration;
    let (address, mut accepted, _stop) = server(true).await;
    let dialled = dial_b(None, &address).await.unwrap();
    assert_eq!(dialled.transport, PeerTransport::Framed);
    let theirs = accepted.recv().await.unwrap();
    let (driver, _driver_stop) = super::intake::driver_thread();
    // A silence bound of 200 ms; the driver's thread will be blocked for 1 000.
    let mut settings = config(None);
    settings.peer_link.heartbeat_interval_ms = 50;
    settings.peer_link.heartbeat_misses = 4;
    let (events_tx, mut events) = tokio::sync::mpsc::channel(1024);
    let (_incoming_tx, incoming) = tokio::sync::mpsc::channel(1);
    let (_entry_tx, entry) = tokio::sync::watch::channel(Some(entry("b", &address)));
    let mut task = super::session::PeerTask {
        config: Arc::new(settings),
        name: "b".into(),
        entry,
        directory: PeerDirectory::with_static(&[]).0,
        identity: Arc::new(identity("a")),
        events: events_tx,
        incoming,
        auth: LinkAuth::None,
        driver_runtime: Some(driver.clone()),
        last_auth_warning: None,
    };
    let run = tokio::spawn(async move { task.run_session(dialled).await.is_none() });
    assert!(matches!(events.recv().await, Some(DriverInput::Peer(PeerEvent::Up { .. }))));
    // The peer speaks every 10 ms.
    let urgent = theirs.outbound.urgent.clone();
    let speaker = tokio::spawn(async move {
        for seq in 0.. {
            let beat = PeerFrame { frame: Some(Frame::Heartbeat(proto::Heartbeat { seq })), mac: Vec::new() };
            if urgent.send(beat).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    // A plugin call blocks the driver's thread for 5 silence bounds: nothing reads the link.
    let (blocked_tx, blocked) = std::sync::mpsc::channel();
    driver.spawn(async move {
        blocked_tx.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(1000));
    });
    blocked.recv().unwrap();
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert!(!run.is_finished(), "the session ended while its peer spoke and only the driver's thread was busy");
    assert!(events.try_recv().is_err(), "the peer was declared lost (or a heartbeat handed to the driver)");
    // The peer falls silent: lost within the bound (and some slack), with that reason.
    speaker.abort();
    let lost = tokio::time::timeout(Duration::from_secs(5), events.recv()).await.expect("lost in time");
    assert!(
        matches!(lost, Some(DriverInput::Peer(PeerEvent::Lost { end: LinkEnd::HeartbeatTimeout, .. }))),
        "expected a heartbeat timeout"
    );
    assert!(run.await.unwrap(), "no replacement session");
    drop(theirs);
}

#[tokio::test]
async fn a_connection_silent_past_connect_timeout_is_closed_and_counted_as_a_refusal() {
    use std::time::Duration;
    let mut settings = config(None);
    settings.peer_link.connect_timeout_ms = 200;
    let (address, _accepted, _stop, metrics) = server_with(true, settings).await;
    let refusals = || metrics.listener_refusals("peer_link", "handshake_timeout");
    // Silent: closed at the bound, and counted.
    let mut silent = tokio::net::TcpStream::connect(&address).await.unwrap();
    let started = std::time::Instant::now();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut byte)).await.expect("closed in time");
    assert!(matches!(read, Ok(0) | Err(_)), "the listener closed it: {read:?}");
    assert!(started.elapsed() >= Duration::from_millis(190), "closed before the bound: {:?}", started.elapsed());
    assert_eq!(refusals(), 1);
    // A dialler that speaks within the bound links, and counts nothing.
    let dialled = dial_b(None, &address).await.unwrap();
    assert_eq!(dialled.transport, PeerTransport::Framed);
    // One that closes before speaking is not a refusal either.
    drop(tokio::net::TcpStream::connect(&address).await.unwrap());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(refusals(), 1, "only the silent connection counts");
}
