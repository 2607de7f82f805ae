//! Remote keys and endpoints: round trips, and refusal of malformed, truncated, corrupted, foreign
//! and other-version bytes.

use kvgate_abi::ReasonCode;
use kvgate_plugin_nvlink::wire::*;

fn sample_key() -> RemoteKeyWire {
    let mut handle = [0u8; IPC_HANDLE_BYTES];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    RemoteKeyWire {
        instance_nonce: 0xdead_beef_1234_5679,
        region_id: 42,
        device: 3,
        device_uuid: [9; 16],
        holder_pid: 4242,
        holder_addr: 0x7f00_0000_1000,
        offset_in_allocation: 4096,
        len: 1 << 30,
        ipc_handle: handle,
    }
}

fn sample_endpoint() -> EndpointWire {
    EndpointWire { instance_nonce: 77, pid: 99, boot_id: [5; 16] }
}

#[test]
fn remote_key_round_trips() {
    let key = sample_key();
    let bytes = key.encode();
    assert_eq!(bytes.len(), REMOTE_KEY_BYTES);
    assert_eq!(RemoteKeyWire::decode(&bytes).unwrap(), key);
}

#[test]
fn endpoint_round_trips() {
    let e = sample_endpoint();
    let bytes = e.encode();
    assert_eq!(bytes.len(), ENDPOINT_BYTES);
    assert_eq!(EndpointWire::decode(&bytes).unwrap(), e);
}

#[test]
fn every_single_byte_corruption_of_a_key_is_refused() {
    let bytes = sample_key().encode();
    for i in 0..bytes.len() {
        let mut bad = bytes.clone();
        bad[i] ^= 0x40;
        let e = RemoteKeyWire::decode(&bad).expect_err(&format!("flipped byte {i} accepted"));
        assert!(e.code == ReasonCode::INVALID_ARGUMENT || e.code == ReasonCode::VERSION_MISMATCH, "byte {i}: {e}");
    }
}

#[test]
fn truncated_and_extended_keys_are_refused() {
    let bytes = sample_key().encode();
    for len in [0, 1, 7, 8, 9, 10, 64, REMOTE_KEY_BYTES - 1] {
        let e = RemoteKeyWire::decode(&bytes[..len]).expect_err(&format!("{len} bytes accepted"));
        assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT, "{len}: {e}");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert_eq!(RemoteKeyWire::decode(&longer).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
}

#[test]
fn foreign_bytes_are_refused_as_not_ours() {
    // An endpoint is not a key, a key is not an endpoint, and another plugin's bytes are neither.
    let e = RemoteKeyWire::decode(&sample_endpoint().encode()).unwrap_err();
    assert!(e.message.contains("magic"), "{e}");
    let e = EndpointWire::decode(&sample_key().encode()).unwrap_err();
    assert!(e.message.contains("magic"), "{e}");
    let shm_like = b"KVGSHMK1 some other plugin's key bytes ..........".to_vec();
    assert_eq!(RemoteKeyWire::decode(&shm_like).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
}

#[test]
fn another_wire_version_is_a_version_mismatch() {
    let mut bytes = sample_key().encode();
    bytes[8] = 2;
    let e = RemoteKeyWire::decode(&bytes).unwrap_err();
    assert_eq!(e.code, ReasonCode::VERSION_MISMATCH, "{e}");
    let mut ep = sample_endpoint().encode();
    ep[8] = 9;
    assert_eq!(EndpointWire::decode(&ep).unwrap_err().code, ReasonCode::VERSION_MISMATCH);
}

/// Re-seals a key with a valid checksum, so that only the semantic checks can refuse it.
fn resealed(key: RemoteKeyWire) -> Vec<u8> {
    key.encode()
}

#[test]
fn impossible_keys_with_valid_checksums_are_refused() {
    let zero_len = RemoteKeyWire { len: 0, ..sample_key() };
    assert!(RemoteKeyWire::decode(&resealed(zero_len)).unwrap_err().message.contains("zero-length"));
    let negative = RemoteKeyWire { device: -1, ..sample_key() };
    assert!(RemoteKeyWire::decode(&resealed(negative)).unwrap_err().message.contains("negative"));
    let overflow = RemoteKeyWire { offset_in_allocation: u64::MAX - 10, ..sample_key() };
    assert!(RemoteKeyWire::decode(&resealed(overflow)).unwrap_err().message.contains("overflows"));
    let null = RemoteKeyWire { holder_addr: 0, ..sample_key() };
    assert!(RemoteKeyWire::decode(&resealed(null)).unwrap_err().message.contains("null"));
}

#[test]
fn same_host_is_decided_by_boot_id() {
    let local = sample_endpoint();
    assert!(EndpointWire { boot_id: [5; 16], ..sample_endpoint() }.same_host_as(&local));
    assert!(!EndpointWire { boot_id: [6; 16], ..sample_endpoint() }.same_host_as(&local));
    assert!(EndpointWire { boot_id: [0; 16], ..sample_endpoint() }.same_host_as(&local));
}

#[test]
fn uuid_text_parses_with_and_without_dashes() {
    let u = parse_uuid_text("0123abcd-4567-89ef-0123-456789abcdef").unwrap();
    assert_eq!(u[0], 0x01);
    assert_eq!(u[15], 0xef);
    assert_eq!(parse_uuid_text("0123abcd456789ef0123456789abcdef"), Some(u));
    assert_eq!(parse_uuid_text("0123"), None);
    assert_eq!(parse_uuid_text("zz23abcd-4567-89ef-0123-456789abcdef"), None);
}

#[test]
fn fnv_is_the_published_fnv1a64() {
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
}

fn sample_vmm_key() -> VmmKeyWire {
    VmmKeyWire {
        instance_nonce: 0x1234_5678_9abc_def1,
        region_id: 7,
        device: 2,
        device_uuid: [4; 16],
        holder_pid: 5151,
        socket_name: "kvgate-nvlink-0123456789abcdef".into(),
        secret: [0xa5; VMM_SECRET_BYTES],
        offset_in_allocation: 4099,
        len: 1 << 20,
        allocation_size: 4 << 20,
    }
}

#[test]
fn vmm_key_round_trips_and_both_forms_decode_as_any_key() {
    let key = sample_vmm_key();
    let bytes = key.encode();
    assert_eq!(bytes.len(), VMM_KEY_BYTES);
    assert_eq!(VmmKeyWire::decode(&bytes).unwrap(), key);
    assert_eq!(AnyRemoteKey::decode(&bytes).unwrap(), AnyRemoteKey::Vmm(key));
    // The old form (version 1, an IPC handle) still decodes, unchanged.
    let old = sample_key();
    assert_eq!(AnyRemoteKey::decode(&old.encode()).unwrap(), AnyRemoteKey::Ipc(old));
}

#[test]
fn a_version_1_only_decoder_refuses_a_vmm_key_as_a_version_mismatch() {
    let e = RemoteKeyWire::decode(&sample_vmm_key().encode()).unwrap_err();
    assert_eq!(e.code, ReasonCode::VERSION_MISMATCH, "{e}");
    let mut unknown = sample_vmm_key().encode();
    unknown[8] = 3;
    let e = AnyRemoteKey::decode(&unknown).unwrap_err();
    assert_eq!(e.code, ReasonCode::VERSION_MISMATCH, "{e}");
    assert!(e.message.contains("speaks 1") && e.message.contains("2 (VMM keys)"), "{e}");
}

#[test]
fn every_single_byte_corruption_of_a_vmm_key_is_refused() {
    let bytes = sample_vmm_key().encode();
    for i in 0..bytes.len() {
        let mut bad = bytes.clone();
        bad[i] ^= 0x40;
        let e = AnyRemoteKey::decode(&bad).expect_err(&format!("flipped byte {i} accepted"));
        assert!(e.code == ReasonCode::INVALID_ARGUMENT || e.code == ReasonCode::VERSION_MISMATCH, "byte {i}: {e}");
    }
    for len in [10, VMM_KEY_BYTES - 1, VMM_KEY_BYTES + 1] {
        let mut cut = bytes.clone();
        cut.resize(len, 0);
        assert_eq!(AnyRemoteKey::decode(&cut).unwrap_err().code, ReasonCode::INVALID_ARGUMENT, "{len} bytes");
    }
}

#[test]
fn impossible_vmm_keys_with_valid_checksums_are_refused() {
    let cases = [
        (VmmKeyWire { len: 0, ..sample_vmm_key() }, "zero-length"),
        (VmmKeyWire { device: -1, ..sample_vmm_key() }, "negative"),
        (
            VmmKeyWire { offset_in_allocation: 3 << 20, len: (1 << 20) + 1, ..sample_vmm_key() },
            "exceeds the allocation",
        ),
        (VmmKeyWire { offset_in_allocation: u64::MAX, ..sample_vmm_key() }, "exceeds the allocation"),
    ];
    for (key, why) in cases {
        let e = VmmKeyWire::decode(&key.encode()).unwrap_err();
        assert!(e.message.contains(why), "{why}: {e}");
    }
    // The region may end exactly at the allocation's end.
    let at_end = VmmKeyWire { offset_in_allocation: 3 << 20, len: 1 << 20, ..sample_vmm_key() };
    assert!(VmmKeyWire::decode(&at_end.encode()).is_ok());
}

#[test]
fn socket_names_are_bounded_at_their_limit() {
    let at_limit = VmmKeyWire { socket_name: "n".repeat(MAX_SOCKET_NAME_BYTES), ..sample_vmm_key() };
    assert_eq!(VmmKeyWire::decode(&at_limit.encode()).unwrap().socket_name.len(), MAX_SOCKET_NAME_BYTES);
    assert!(valid_socket_name(&[b'n'; MAX_SOCKET_NAME_BYTES]));
    assert!(!valid_socket_name(&[b'n'; MAX_SOCKET_NAME_BYTES + 1]), "one byte past the limit");
    assert!(!valid_socket_name(b""));
    assert!(!valid_socket_name(b"with space"));
    assert!(!valid_socket_name(b"nul\0"));
    // A name length past the limit in the bytes themselves (re-sealed) is refused.
    let mut bytes = sample_vmm_key().encode();
    let at = 8 + 2 + 2 + 4 + 8 + 8 + 16 + 4;
    bytes[at..at + 2].copy_from_slice(&((MAX_SOCKET_NAME_BYTES + 1) as u16).to_le_bytes());
    let body = bytes.len() - 8;
    let sum = fnv1a64(&bytes[..body]);
    bytes[body..].copy_from_slice(&sum.to_le_bytes());
    assert!(VmmKeyWire::decode(&bytes).unwrap_err().message.contains("socket name of 65 bytes"));
}
