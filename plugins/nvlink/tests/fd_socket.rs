//! The descriptor socket of CUDA VMM regions, without a GPU: a memfd is served where a GPU machine
//! serves a CUDA descriptor. What arrives is the very file served; wrong secrets, unknown and
//! withdrawn regions are refused with their reasons; the request timeout holds on both sides, within
//! and past the limit; the answer bound holds at and past its limit; a stopped server is unreachable.

use kvgate_abi::ReasonCode;
use kvgate_plugin_nvlink::fd_socket::*;
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

const SECRET: [u8; 16] = [0x5a; 16];

fn memfd_with(bytes: &[u8]) -> OwnedFd {
    let fd = memfd_create(c"kvgate-nvlink-test", MFdFlags::MFD_CLOEXEC).unwrap();
    std::fs::File::from(fd.try_clone().unwrap()).write_all_at(bytes, 0).unwrap();
    fd
}

fn server(timeout_ms: u64) -> FdServer {
    FdServer::start(fresh_socket_name().unwrap(), Duration::from_millis(timeout_ms)).unwrap()
}

const LONG: Duration = Duration::from_secs(5);

#[test]
fn the_served_descriptor_arrives_and_names_the_same_file() {
    let s = server(2000);
    let fd = memfd_with(b"kv cache bytes");
    let ino = std::fs::File::from(fd.try_clone().unwrap()).metadata().unwrap().ino();
    s.serve(3, SECRET, fd);
    assert_eq!(s.served(), 1);
    for _ in 0..2 {
        let got = std::fs::File::from(request_fd(s.name(), 3, &SECRET, LONG).unwrap());
        assert_eq!(got.metadata().unwrap().ino(), ino, "another file arrived");
        let mut buf = [0u8; 14];
        got.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"kv cache bytes");
    }
    assert!(s.name().starts_with("kvgate-nvlink-") && s.name().len() == "kvgate-nvlink-".len() + 16, "{}", s.name());
}

#[test]
fn a_wrong_secret_is_refused_as_auth_failed() {
    let s = server(2000);
    s.serve(3, SECRET, memfd_with(b"x"));
    let mut wrong = SECRET;
    wrong[15] ^= 1;
    let e = request_fd(s.name(), 3, &wrong, LONG).unwrap_err();
    assert_eq!(e.code, ReasonCode::AUTH_FAILED, "{e}");
    assert!(e.message.contains("bad_secret"), "{e}");
}

#[test]
fn an_unknown_region_is_refused_as_unknown_key() {
    let s = server(2000);
    s.serve(3, SECRET, memfd_with(b"x"));
    let e = request_fd(s.name(), 4, &SECRET, LONG).unwrap_err();
    assert_eq!(e.code, ReasonCode::UNKNOWN_KEY, "{e}");
    assert!(e.message.contains("unknown_region"), "{e}");
}

#[test]
fn a_withdrawn_region_is_no_longer_served() {
    let s = server(2000);
    s.serve(3, SECRET, memfd_with(b"x"));
    assert!(request_fd(s.name(), 3, &SECRET, LONG).is_ok());
    assert!(s.withdraw(3));
    assert!(!s.withdraw(3), "withdrawn twice");
    assert_eq!(s.served(), 0);
    let e = request_fd(s.name(), 3, &SECRET, LONG).unwrap_err();
    assert_eq!(e.code, ReasonCode::UNKNOWN_KEY, "{e}");
}

fn raw_connect(name: &str) -> UnixStream {
    UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap()
}

fn request_bytes(region: u64, secret: &[u8; 16]) -> Vec<u8> {
    let mut r = REQUEST_MAGIC.to_vec();
    r.extend_from_slice(&region.to_le_bytes());
    r.extend_from_slice(secret);
    assert_eq!(r.len(), REQUEST_BYTES);
    r
}

#[test]
fn the_server_waits_for_a_request_within_its_timeout_and_drops_one_past_it() {
    let limit = Duration::from_millis(400);
    let s = server(limit.as_millis() as u64);
    s.serve(1, SECRET, memfd_with(b"x"));
    // Within the limit: a request that comes after a quarter of it is served.
    let mut early = raw_connect(s.name());
    std::thread::sleep(limit / 4);
    early.write_all(&request_bytes(1, &SECRET)).unwrap();
    let mut answer = [0u8; 3];
    early.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"ok\n");
    // Past the limit: a silent requester is answered `request_timeout` once the limit passed.
    let started = Instant::now();
    let mut silent = raw_connect(s.name());
    let mut line = String::new();
    silent.read_to_string(&mut line).unwrap();
    let waited = started.elapsed();
    assert!(line.starts_with("err request_timeout "), "{line:?}");
    assert!(waited >= limit && waited < limit + Duration::from_secs(2), "answered after {waited:?}");
    // The server serves the next request normally.
    assert!(request_fd(s.name(), 1, &SECRET, LONG).is_ok());
}

/// A fake server that accepts one connection, reads the request, waits `delay`, then answers with
/// `answer` (and `fd` attached, if any).
fn fake_server(delay: Duration, answer: Vec<u8>, fd: Option<OwnedFd>) -> (String, std::thread::JoinHandle<()>) {
    let name = fresh_socket_name().unwrap();
    let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let handle = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut request = [0u8; REQUEST_BYTES];
        stream.read_exact(&mut request).unwrap();
        std::thread::sleep(delay);
        let iov = [IoSlice::new(&answer)];
        let raw: Vec<i32> = fd.iter().map(|f| f.as_raw_fd()).collect();
        let cmsgs: Vec<ControlMessage> = if raw.is_empty() { vec![] } else { vec![ControlMessage::ScmRights(&raw)] };
        let _ = sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None);
        std::thread::sleep(Duration::from_millis(200));
    });
    (name, handle)
}

#[test]
fn an_importer_takes_an_answer_within_its_timeout_and_gives_up_past_it() {
    let (name, h) = fake_server(Duration::from_millis(100), b"ok\n".to_vec(), Some(memfd_with(b"y")));
    assert!(request_fd(&name, 1, &SECRET, Duration::from_millis(1500)).is_ok(), "answer within the limit refused");
    h.join().unwrap();

    let limit = Duration::from_millis(300);
    let (name, h) = fake_server(Duration::from_millis(1500), b"ok\n".to_vec(), Some(memfd_with(b"y")));
    let started = Instant::now();
    let e = request_fd(&name, 1, &SECRET, limit).unwrap_err();
    let waited = started.elapsed();
    assert_eq!(e.code, ReasonCode::TIMEOUT, "{e}");
    assert!(e.message.contains("vmm_fd_request_timeout_ms"), "{e}");
    assert!(waited >= limit && waited < limit + Duration::from_millis(900), "gave up after {waited:?}");
    h.join().unwrap();
}

#[test]
fn an_answer_is_read_up_to_its_bound_and_refused_past_it() {
    // Exactly MAX_ANSWER_BYTES with its newline: read and understood.
    let mut line = b"err bad_secret ".to_vec();
    line.resize(MAX_ANSWER_BYTES - 1, b'z');
    line.push(b'\n');
    let (name, h) = fake_server(Duration::ZERO, line, None);
    assert_eq!(request_fd(&name, 1, &SECRET, LONG).unwrap_err().code, ReasonCode::AUTH_FAILED);
    h.join().unwrap();
    // One byte more before the newline: a protocol violation.
    let mut line = b"err bad_secret ".to_vec();
    line.resize(MAX_ANSWER_BYTES, b'z');
    line.push(b'\n');
    let (name, h) = fake_server(Duration::ZERO, line, None);
    let e = request_fd(&name, 1, &SECRET, LONG).unwrap_err();
    assert_eq!(e.code, ReasonCode::PROTOCOL_VIOLATION, "{e}");
    h.join().unwrap();
}

#[test]
fn an_ok_without_a_descriptor_is_a_protocol_violation() {
    let (name, h) = fake_server(Duration::ZERO, b"ok\n".to_vec(), None);
    assert_eq!(request_fd(&name, 1, &SECRET, LONG).unwrap_err().code, ReasonCode::PROTOCOL_VIOLATION);
    h.join().unwrap();
}

#[test]
fn a_stopped_server_is_unreachable_and_stops_promptly() {
    let s = server(60_000);
    s.serve(1, SECRET, memfd_with(b"x"));
    let name = s.name().to_string();
    assert!(request_fd(&name, 1, &SECRET, LONG).is_ok());
    let started = Instant::now();
    s.stop();
    assert!(started.elapsed() < Duration::from_secs(2), "stop took {:?}", started.elapsed());
    assert_eq!(s.served(), 0, "served descriptors closed at stop");
    s.stop(); // idempotent
    drop(s);
    let e = request_fd(&name, 1, &SECRET, LONG).unwrap_err();
    assert_eq!(e.code, ReasonCode::PEER_UNREACHABLE, "{e}");
}

#[test]
fn secrets_and_names_are_random() {
    let a: [u8; 16] = random_bytes().unwrap();
    let b: [u8; 16] = random_bytes().unwrap();
    assert_ne!(a, b);
    assert_ne!(fresh_socket_name().unwrap(), fresh_socket_name().unwrap());
}
