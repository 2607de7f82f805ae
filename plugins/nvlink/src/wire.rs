//! The bytes this plugin hands to peers: its endpoint and its remote keys (fixed layouts, little
//! endian, magic + version + checksum). Owns encoding and strict decoding; never trusts a peer's
//! bytes (every length, magic, version, checksum and range is checked) and never touches CUDA.

use kvgate_abi::{PluginError, ReasonCode};

/// Size of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

const REMOTE_KEY_MAGIC: &[u8; 8] = b"KVGNVRK1";
const ENDPOINT_MAGIC: &[u8; 8] = b"KVGNVEP1";
/// Wire version of both layouts; a peer with another one is refused with `VERSION_MISMATCH`.
pub const WIRE_VERSION: u16 = 1;

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
fn open_layout<'a>(bytes: &'a [u8], magic: &[u8; 8], size: usize, what: &str) -> Result<Reader<'a>, PluginError> {
    if bytes.len() < 8 || &bytes[..8] != magic {
        return Err(refuse(ReasonCode::INVALID_ARGUMENT, what, "not produced by the nvlink plugin (wrong magic)".into()));
    }
    if bytes.len() >= 10 {
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != WIRE_VERSION {
            return Err(refuse(
                ReasonCode::VERSION_MISMATCH,
                what,
                format!("wire version {version}, this plugin speaks {WIRE_VERSION}"),
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
        let mut r = open_layout(bytes, REMOTE_KEY_MAGIC, REMOTE_KEY_BYTES, "remote key")?;
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
        let mut r = open_layout(bytes, ENDPOINT_MAGIC, ENDPOINT_BYTES, "endpoint")?;
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
