//! Memory registered by descriptor, through real `kvgate serve` processes: the decode engine passes a
//! memfd on the gateway's fd socket (SCM_RIGHTS), registers it by token and closes its own copy; a
//! room lands in it (the prefill gateway's shm plugin maps it through the decode gateway's descriptor),
//! and the gateway closes the descriptor when the region is unregistered. Tokens are single-use, the
//! table is bounded (`engine_api.max_passed_fds`), and a message without a descriptor is refused.

mod common;

use common::*;
use kvgate_client::fd_pass::{fd_socket_path, pass_fd, PassError};
use kvgate_client::{proto, reason_of, room_key, slice, Client};
use kvgate_demo::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use kvgate_demo::pool::{checksum, KvPool};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::time::Duration;

const LEN: u64 = 1 << 20;
const WAIT: Duration = Duration::from_secs(20);

fn memfd(name: &std::ffi::CStr) -> std::fs::File {
    let fd = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    let file = std::fs::File::from(fd);
    file.set_len(LEN).unwrap();
    file
}

/// Whether process `pid` holds a descriptor of a memfd named `name`.
fn holds_memfd(pid: i32, name: &str) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.flatten().any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains(name)))
        })
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memfd_passed_by_descriptor_receives_a_room_and_is_closed_at_unregister() {
    let _serial = serial().await;
    let dir = work_dir();
    let env = vec![("KVGATE__ENGINE_API__MAX_PASSED_FDS".to_string(), "2".to_string())];
    let settings = PairSettings { env_decode: env, ..PairSettings::default() };
    let mut pair = GatewayPair::start(&binary(), dir.path(), &settings).await.unwrap();
    let decode = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let prefill = Client::connect_unix(&pair.prefill.socket).await.unwrap();
    let gateway_pid = pair.decode.pid().unwrap();

    // The engine's pool: a memfd it maps itself, passed to the gateway, its own descriptor closed.
    let pool = memfd(c"kvgate-passed-pool");
    // SAFETY: a memfd of this test, shared with the gateway that writes into it.
    let mapping = unsafe { memmap2::MmapOptions::new().len(LEN as usize).map(&pool) }.unwrap();
    let token = pass_fd(&pair.decode.socket, pool.as_fd()).unwrap();
    let region = decode.register_passed_fd(token, 0, LEN, "memfd pool").await.unwrap();
    drop(pool);
    assert!(holds_memfd(gateway_pid, "kvgate-passed-pool"), "the gateway keeps the descriptor");
    let e = decode.register_passed_fd(token, 0, LEN, "again").await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("unknown_fd_token"), "a token is used once");

    // A room lands in it.
    let mut src = KvPool::create(dir.path(), "src", LEN, 1).unwrap();
    let src_region =
        prefill.register_shared_memory(&src.path.display().to_string(), 0, src.len(), "src").await.unwrap();
    let sum = src.fill(0, 5);
    let room = 8_000;
    let mut d_events = decode.watch(Some(room_key(room, 0))).await.unwrap();
    decode.expect(room_key(room, 0), PREFILL_NAME, vec![vec![slice(region, 0, LEN)]], 0).await.unwrap();
    let send = proto::SendRequest {
        key: Some(room_key(room, 0)),
        part: 0,
        chunk: 0,
        slices: vec![slice(src_region, 0, LEN)],
        last: true,
        peer: DECODE_NAME.into(),
        offset: None,
    };
    prefill.send(send).await.unwrap();
    let d = terminal_event(&mut d_events, room, WAIT).await;
    assert!(d.succeeded, "{d:?}\n{}", pair.decode.log());
    assert_eq!(checksum(&mapping[..]), sum, "every byte landed in the engine's memfd");

    // Unregistered: the gateway closes its descriptor.
    decode.unregister_memory(region).await.unwrap();
    eventually(WAIT, "the descriptor closed", || async { !holds_memfd(gateway_pid, "kvgate-passed-pool") }, &|| {
        pair.decode.log()
    })
    .await;

    // The table's bound: at the limit, then one past it.
    let (a, b, c) = (memfd(c"kvgate-a"), memfd(c"kvgate-b"), memfd(c"kvgate-c"));
    pass_fd(&pair.decode.socket, a.as_fd()).unwrap();
    pass_fd(&pair.decode.socket, b.as_fd()).unwrap();
    match pass_fd(&pair.decode.socket, c.as_fd()) {
        Err(PassError::Refused { reason, message }) => {
            assert_eq!(reason, "too_many_passed_fds");
            assert!(message.contains("engine_api.max_passed_fds = 2"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let e = decode.register_passed_fd(424242, 0, LEN, "never passed").await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("unknown_fd_token"));
    // A message with no descriptor is refused with its reason.
    let mut raw = std::os::unix::net::UnixStream::connect(fd_socket_path(&pair.decode.socket)).unwrap();
    raw.write_all(b"F").unwrap();
    let mut line = String::new();
    BufReader::new(&raw).read_line(&mut line).unwrap();
    assert!(line.starts_with("err one_fd_per_message"), "{line:?}");
    pair.stop();
    assert!(!fd_socket_path(&pair.decode.socket).exists(), "the fd socket is removed at stop");
}

/// CUDA VMM memory by descriptor on gateways whose plugin (shm) serves no CUDA memory: the
/// registration is refused `unsupported_memory`, naming each plugin and why; the range is checked
/// against the allocation first; a token is good once and an unknown one is `unknown_fd_token`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cuda_vmm_descriptor_is_refused_by_plugins_that_serve_no_cuda_memory_saying_why() {
    let _serial = serial().await;
    let dir = work_dir();
    let mut pair = GatewayPair::start(&binary(), dir.path(), &PairSettings::default()).await.unwrap();
    let decode = Client::connect_unix(&pair.decode.socket).await.unwrap();
    let size = 2 << 20;
    // Any descriptor stands in for the CUDA one here: no plugin of these gateways gets that far.
    let stand_in = memfd(c"kvgate-vmm-stand-in");
    let token = pass_fd(&pair.decode.socket, stand_in.as_fd()).unwrap();
    let e = decode.register_cuda_vmm_fd(token, 0, 0, size, size, "vmm").await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("unsupported_memory"), "{e:?}");
    assert!(
        e.message().contains("shm: memory kind cuda_device not served"),
        "the shm plugin's refusal not named: {}",
        e.message()
    );
    let e = decode.register_cuda_vmm_fd(token, 0, 0, size, size, "again").await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("unknown_fd_token"), "a token is used once: {e:?}");
    // The region must lie inside the allocation: at its end is checked by the plugins, one byte past
    // it is refused by the gateway.
    let token = pass_fd(&pair.decode.socket, stand_in.as_fd()).unwrap();
    let e = decode.register_cuda_vmm_fd(token, 0, 1, size, size, "past").await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("slice_out_of_range"), "{e:?}");
    let token = pass_fd(&pair.decode.socket, stand_in.as_fd()).unwrap();
    let e = decode.register_cuda_vmm_fd(token, 0, 1, size - 1, size, "at the end").await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("unsupported_memory"), "{e:?}");
    let token = pass_fd(&pair.decode.socket, stand_in.as_fd()).unwrap();
    let e = decode.register_cuda_vmm_fd(token, -1, 0, size, size, "bad device").await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("invalid_device"), "{e:?}");
    let e = decode.register_cuda_vmm_fd(424242, 0, 0, size, size, "never passed").await.unwrap_err();
    assert_eq!(reason_of(&e).as_deref(), Some("unknown_fd_token"), "{e:?}");
    pair.stop();
}
