//! The bytes this plugin hands to peers: its endpoint and its remote keys (fixed layouts, little
//! endian, magic + version + checksum). Owns encoding and strict decoding; never trusts a peer's
//! bytes (every length, magic, version, checksum and range is checked) and never touches CUDA.
//!
//! Remote keys come in two forms under one magic, told apart by their wire version: version 1
//! ([`RemoteKeyWire`]) names an allocation by its CUDA IPC handle; version 2 ([`VmmKeyWire`]) names
//! a CUDA VMM allocation whose descriptor the registering instance serves on its descriptor
//! socket. A plugin that knows only version 1 refuses a version-2 key with `VERSION_MISMATCH`.

use kvgate_abi::{PluginError, ReasonCode};

/// Size of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

const REMOTE_KEY_MAGIC: &[u8; 8] = b"KVGNVRK1";
const ENDPOINT_MAGIC: &[u8; 8] = b"KVGNVEP1";
/// Wire version of the endpoint and of IPC-handle remote keys; a peer with another one is refused
/// with `VERSION_MISMATCH`.
pub const WIRE_VERSION: u16 = 1;
/// Wire version of a remote key that names a CUDA VMM allocation ([`VmmKeyWire`]).
pub const VMM_KEY_VERSION: u16 = 2;
/// Longest descriptor-socket name a VMM key carries, in bytes (abstract namespace, no NUL).
pub const MAX_SOCKET_NAME_BYTES: usize = 64;
/// Size of the per-region secret a VMM key carries, in bytes.
pub const VMM_SECRET_BYTES: usize = 16;

/// What a peer needs to write into one registered region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteKeyWire {
    /// Nonce of the plugin instance that registered the region (ties the key to one endpoint).
    pub instance_nonce: u64,
    /// The region's local key in the registering instance (for messages only).
    pub region_id: u64,
    /// CUDA ordinal of the region's device, as the registering process sees it.
    pub device: i32,
    /// UUID of that device (ordinals differ between processes; UUIDs do not).
    pub device_uuid: [u8; 16],
    /// Process that registered the region; a same-process importer uses `holder_addr` directly
    /// (CUDA refuses to open an IPC handle in the process that exported it).
    pub holder_pid: u32,
    /// Device address of the region's first byte in the holder process.
    pub holder_addr: u64,
    /// Offset of the region's first byte inside the allocation `ipc_handle` names.
    pub offset_in_allocation: u64,
    /// Region length in bytes (never 0).
    pub len: u64,
    /// `cuIpcGetMemHandle` of the allocation.
    pub ipc_handle: [u8; IPC_HANDLE_BYTES],
}

/// Encoded size of a [`RemoteKeyWire`].
pub const REMOTE_KEY_BYTES: usize = 8 + 2 + 2 + 4 + 8 + 8 + 16 + 4 + 4 + 8 + 8 + 8 + IPC_HANDLE_BYTES + 8;

/// How a peer reaches this instance: which process on which boot of which host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointWire {
    pub instance_nonce: u64,
    pub pid: u32,
    /// `/proc/sys/kernel/random/boot_id`; all zero where unreadable.
    pub boot_id: [u8; 16],
}

/// Encoded size of an [`EndpointWire`].
pub const ENDPOINT_BYTES: usize = 8 + 2 + 2 + 8 + 4 + 16 + 8;

/// FNV-1a, 64 bit: catches truncation and corruption of our own layouts (not an authenticator).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= b as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

fn refuse(code: ReasonCode, what: &str, why: String) -> PluginError {
    PluginError::new(code, format!("nvlink {what}: {why}"))
}

/// A little reader over a fixed layout whose length was already checked.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        s
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take(2).try_into().expect("2 bytes"))
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().expect("4 bytes"))
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().expect("8 bytes"))
    }
    fn array<const N: usize>(&mut self) -> [u8; N] {
        self.take(N).try_into().expect("N bytes")
    }
}

/// Checks length, magic, version and checksum; returns a reader positioned after the header.
fn open_layout<'a>(
    bytes: &'a [u8],
    magic: &[u8; 8],
    version: u16,
    size: usize,
    what: &str,
) -> Result<Reader<'a>, PluginError> {
    if bytes.len() < 8 || &bytes[..8] != magic {
        return Err(refuse(
            ReasonCode::INVALID_ARGUMENT,
            what,
            "not produced by the nvlink plugin (wrong magic)".into(),
        ));
    }
    if bytes.len() >= 10 {
        let found = u16::from_le_bytes([bytes[8], bytes[9]]);
        if found != version {
            return Err(refuse(
                ReasonCode::VERSION_MISMATCH,
                what,
                format!("wire version {found}, this plugin speaks {version}"),
            ));
        }
    }
    if bytes.len() != size {
        return Err(refuse(ReasonCode::INVALID_ARGUMENT, what, format!("{} bytes, expected {size}", bytes.len())));
    }
    let body = &bytes[..size - 8];
    let sum = u64::from_le_bytes(bytes[size - 8..].try_into().expect("8 bytes"));
    if fnv1a64(body) != sum {
        return Err(refuse(ReasonCode::INVALID_ARGUMENT, what, "checksum mismatch (corrupted bytes)".into()));
    }
    let mut reader = Reader { bytes, at: 8 };
    let _version = reader.u16();
    let _reserved = reader.u16();
    Ok(reader)
}

fn seal(mut out: Vec<u8>) -> Vec<u8> {
    let sum = fnv1a64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

impl RemoteKeyWire {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(REMOTE_KEY_BYTES);
        out.extend_from_slice(REMOTE_KEY_MAGIC);
        out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.device.to_le_bytes());
        out.extend_from_slice(&self.instance_nonce.to_le_bytes());
        out.extend_from_slice(&self.region_id.to_le_bytes());
        out.extend_from_slice(&self.device_uuid);
        out.extend_from_slice(&self.holder_pid.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.holder_addr.to_le_bytes());
        out.extend_from_slice(&self.offset_in_allocation.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.ipc_handle);
        let out = seal(out);
        debug_assert_eq!(out.len(), REMOTE_KEY_BYTES);
        out
    }

    /// Strict decode: any malformed, foreign, corrupted or impossible key is refused.
    pub fn decode(bytes: &[u8]) -> Result<RemoteKeyWire, PluginError> {
        let mut r = open_layout(bytes, REMOTE_KEY_MAGIC, WIRE_VERSION, REMOTE_KEY_BYTES, "remote key")?;
        let key = RemoteKeyWire {
            device: r.u32() as i32,
            instance_nonce: r.u64(),
            region_id: r.u64(),
            device_uuid: r.array(),
            holder_pid: {
                let pid = r.u32();
                let _pad = r.u32();
                pid
            },
            holder_addr: r.u64(),
            offset_in_allocation: r.u64(),
            len: r.u64(),
            ipc_handle: r.array(),
        };
        let bad = |why: String| Err(refuse(ReasonCode::INVALID_ARGUMENT, "remote key", why));
        if key.len == 0 {
            return bad("zero-length region".into());
        }
        if key.device < 0 {
            return bad(format!("negative device ordinal {}", key.device));
        }
        if key.offset_in_allocation.checked_add(key.len).is_none() || key.holder_addr.checked_add(key.len).is_none() {
            return bad(format!("offset {} + length {} overflows", key.offset_in_allocation, key.len));
        }
        if key.holder_addr == 0 {
            return bad("null device address".into());
        }
        Ok(key)
    }
}

/// What a peer needs to write into one registered CUDA VMM region: where to ask for the
/// allocation's descriptor (the registering instance's abstract-namespace socket), the proof it may
/// (region id and per-region secret), and where the region lies in the allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmKeyWire {
    /// Nonce of the plugin instance that registered the region (ties the key to one endpoint).
    pub instance_nonce: u64,
    /// The region's local key in the registering instance; names it on the descriptor socket.
    pub region_id: u64,
    /// CUDA ordinal of the region's device, as the registering process sees it.
    pub device: i32,
    /// UUID of that device.
    pub device_uuid: [u8; 16],
    /// Process that registered the region (for messages).
    pub holder_pid: u32,
    /// Abstract-namespace name of the registering instance's descriptor socket (no leading NUL),
    /// 1..=[`MAX_SOCKET_NAME_BYTES`] printable ASCII bytes.
    pub socket_name: String,
    /// The region's secret: the descriptor socket hands the descriptor out only with it.
    pub secret: [u8; VMM_SECRET_BYTES],
    /// Offset of the region's first byte inside the allocation.
    pub offset_in_allocation: u64,
    /// Region length in bytes (never 0).
    pub len: u64,
    /// Size of the whole allocation in bytes (an importer maps all of it).
    pub allocation_size: u64,
}

/// Encoded size of a [`VmmKeyWire`].
pub const VMM_KEY_BYTES: usize =
    8 + 2 + 2 + 4 + 8 + 8 + 16 + 4 + 2 + 2 + 8 + 8 + 8 + VMM_SECRET_BYTES + MAX_SOCKET_NAME_BYTES + 8;

impl VmmKeyWire {
    pub fn encode(&self) -> Vec<u8> {
        let name = self.socket_name.as_bytes();
        assert!(
            valid_socket_name(name),
            "socket name {:?} is not 1..={MAX_SOCKET_NAME_BYTES} printable bytes",
            self.socket_name
        );
        let mut out = Vec::with_capacity(VMM_KEY_BYTES);
        out.extend_from_slice(REMOTE_KEY_MAGIC);
        out.extend_from_slice(&VMM_KEY_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.device.to_le_bytes());
        out.extend_from_slice(&self.instance_nonce.to_le_bytes());
        out.extend_from_slice(&self.region_id.to_le_bytes());
        out.extend_from_slice(&self.device_uuid);
        out.extend_from_slice(&self.holder_pid.to_le_bytes());
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.offset_in_allocation.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.allocation_size.to_le_bytes());
        out.extend_from_slice(&self.secret);
        let mut padded = [0u8; MAX_SOCKET_NAME_BYTES];
        padded[..name.len()].copy_from_slice(name);
        out.extend_from_slice(&padded);
        let out = seal(out);
        debug_assert_eq!(out.len(), VMM_KEY_BYTES);
        out
    }

    /// Strict decode: any malformed, foreign, corrupted or impossible key is refused.
    pub fn decode(bytes: &[u8]) -> Result<VmmKeyWire, PluginError> {
        let what = "remote key (CUDA VMM)";
        let mut r = open_layout(bytes, REMOTE_KEY_MAGIC, VMM_KEY_VERSION, VMM_KEY_BYTES, what)?;
        let device = r.u32() as i32;
        let instance_nonce = r.u64();
        let region_id = r.u64();
        let device_uuid = r.array();
        let holder_pid = r.u32();
        let name_len = r.u16() as usize;
        let pad = r.u16();
        let offset_in_allocation = r.u64();
        let len = r.u64();
        let allocation_size = r.u64();
        let secret = r.array();
        let padded: [u8; MAX_SOCKET_NAME_BYTES] = r.array();
        let bad = |why: String| Err(refuse(ReasonCode::INVALID_ARGUMENT, what, why));
        if pad != 0 {
            return bad("non-zero padding".into());
        }
        if name_len == 0 || name_len > MAX_SOCKET_NAME_BYTES {
            return bad(format!("socket name of {name_len} bytes, expected 1..={MAX_SOCKET_NAME_BYTES}"));
        }
        let (name, rest) = padded.split_at(name_len);
        if !valid_socket_name(name) || rest.iter().any(|&b| b != 0) {
            return bad("socket name is not printable ASCII followed by zeros".into());
        }
        if len == 0 {
            return bad("zero-length region".into());
        }
        if device < 0 {
            return bad(format!("negative device ordinal {device}"));
        }
        if offset_in_allocation.checked_add(len).is_none_or(|end| end > allocation_size) {
            return bad(format!(
                "offset {offset_in_allocation} + length {len} exceeds the allocation ({allocation_size} bytes)"
            ));
        }
        let socket_name = String::from_utf8(name.to_vec()).expect("checked ASCII");
        Ok(VmmKeyWire {
            instance_nonce,
            region_id,
            device,
            device_uuid,
            holder_pid,
            socket_name,
            secret,
            offset_in_allocation,
            len,
            allocation_size,
        })
    }
}

/// 1..=[`MAX_SOCKET_NAME_BYTES`] printable ASCII bytes (no space, no NUL).
pub fn valid_socket_name(name: &[u8]) -> bool {
    (1..=MAX_SOCKET_NAME_BYTES).contains(&name.len()) && name.iter().all(|b| b.is_ascii_graphic())
}

/// A remote key of either form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnyRemoteKey {
    /// Version 1: an allocation named by its CUDA IPC handle.
    Ipc(RemoteKeyWire),
    /// Version 2: a CUDA VMM allocation whose descriptor the registering instance serves.
    Vmm(VmmKeyWire),
}

impl AnyRemoteKey {
    /// Decodes a key of either form, by its wire version; another version is `VERSION_MISMATCH`.
    pub fn decode(bytes: &[u8]) -> Result<AnyRemoteKey, PluginError> {
        if bytes.len() >= 10 && &bytes[..8] == REMOTE_KEY_MAGIC {
            match u16::from_le_bytes([bytes[8], bytes[9]]) {
                WIRE_VERSION => {}
                VMM_KEY_VERSION => return VmmKeyWire::decode(bytes).map(AnyRemoteKey::Vmm),
                other => {
                    return Err(refuse(
                        ReasonCode::VERSION_MISMATCH,
                        "remote key",
                        format!("wire version {other}, this plugin speaks {WIRE_VERSION} (IPC keys) and {VMM_KEY_VERSION} (VMM keys)"),
                    ))
                }
            }
        }
        RemoteKeyWire::decode(bytes).map(AnyRemoteKey::Ipc)
    }
}

impl EndpointWire {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENDPOINT_BYTES);
        out.extend_from_slice(ENDPOINT_MAGIC);
        out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.instance_nonce.to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.boot_id);
        let out = seal(out);
        debug_assert_eq!(out.len(), ENDPOINT_BYTES);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<EndpointWire, PluginError> {
        let mut r = open_layout(bytes, ENDPOINT_MAGIC, WIRE_VERSION, ENDPOINT_BYTES, "endpoint")?;
        Ok(EndpointWire { instance_nonce: r.u64(), pid: r.u32(), boot_id: r.array() })
    }

    /// Whether a peer with this endpoint runs on the same boot of the same host as `local`
    /// (unknown boot ids, all zero, are given the benefit of the doubt; CUDA IPC then decides).
    pub fn same_host_as(&self, local: &EndpointWire) -> bool {
        self.boot_id == [0; 16] || local.boot_id == [0; 16] || self.boot_id == local.boot_id
    }
}

/// This boot's id, from `/proc/sys/kernel/random/boot_id` (all zero where unreadable).
pub fn read_boot_id() -> [u8; 16] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    parse_uuid_text(text.trim()).unwrap_or([0; 16])
}

/// Parses `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (dashes optional).
pub fn parse_uuid_text(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text.bytes().filter(|b| *b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}
