//! The shm plugin's two wire formats: the endpoint (who this instance is: host, process, nonce) and
//! the remote key (what a peer needs to map a region: the descriptor the owner holds the file open
//! with and the file's identity, offset, length, region id, nonce; the path only for messages).
//! Decoding never trusts its input: every length is checked and a malformed blob is an error.

use kvgate_abi::{PluginError, ReasonCode};

const ENDPOINT_MAGIC: &[u8; 8] = b"KVSHMEP1";
const KEY_MAGIC: &[u8; 8] = b"KVSHMKY2";
/// Longest backing path a remote key may carry (Linux `PATH_MAX`).
pub const MAX_BACKING_PATH_BYTES: usize = 4096;

/// Identity of one shm plugin instance, exchanged through `local_endpoint`/`connect`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The kernel's boot id of the machine: a peer with another one is on another host.
    pub host_id: [u8; 16],
    pub pid: u32,
    /// Chosen at random when the instance opens; a restarted peer has a new one.
    pub nonce: u64,
}

/// Everything a peer needs to map a registered region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteKeyBytes {
    /// Nonce of the instance that registered the region.
    pub nonce: u64,
    /// The registering instance's `LocalKey`.
    pub region_id: u64,
    /// The path the owner's engine registered (for messages only: a peer never opens it).
    pub backing_path: String,
    pub backing_offset: u64,
    pub len: u64,
    /// The descriptor the owner process holds the backing file open with: a peer maps
    /// `/proc/<owner pid>/fd/<owner_fd>`, so it can only ever map a file the owner really registered.
    pub owner_fd: u32,
    /// The backing file's device and inode, checked by the peer after opening it (a descriptor
    /// number reused for another file is refused).
    pub dev: u64,
    pub ino: u64,
}

impl Endpoint {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(40);
        out.extend_from_slice(ENDPOINT_MAGIC);
        out.extend_from_slice(&self.host_id);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.nonce.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Endpoint, PluginError> {
        let mut r = Reader::new(bytes, "shm endpoint");
        r.magic(ENDPOINT_MAGIC)?;
        let host_id = r.array::<16>()?;
        let pid = u32::from_le_bytes(r.array::<4>()?);
        let nonce = r.u64()?;
        r.end()?;
        Ok(Endpoint { host_id, pid, nonce })
    }
}

impl RemoteKeyBytes {
    pub fn encode(&self) -> Vec<u8> {
        let path = self.backing_path.as_bytes();
        let mut out = Vec::with_capacity(44 + path.len());
        out.extend_from_slice(KEY_MAGIC);
        out.extend_from_slice(&self.nonce.to_le_bytes());
        out.extend_from_slice(&self.region_id.to_le_bytes());
        out.extend_from_slice(&self.backing_offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.owner_fd.to_le_bytes());
        out.extend_from_slice(&self.dev.to_le_bytes());
        out.extend_from_slice(&self.ino.to_le_bytes());
        out.extend_from_slice(&(path.len() as u32).to_le_bytes());
        out.extend_from_slice(path);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<RemoteKeyBytes, PluginError> {
        let mut r = Reader::new(bytes, "shm remote key");
        r.magic(KEY_MAGIC)?;
        let nonce = r.u64()?;
        let region_id = r.u64()?;
        let backing_offset = r.u64()?;
        let len = r.u64()?;
        let owner_fd = u32::from_le_bytes(r.array::<4>()?);
        let dev = r.u64()?;
        let ino = r.u64()?;
        let path_len = u32::from_le_bytes(r.array::<4>()?) as usize;
        if path_len == 0 || path_len > MAX_BACKING_PATH_BYTES {
            return Err(r.error(&format!("backing path length {path_len} is outside 1..={MAX_BACKING_PATH_BYTES}")));
        }
        let path = r.take(path_len)?;
        r.end()?;
        let backing_path = String::from_utf8(path.to_vec()).map_err(|_| r.error("backing path is not UTF-8"))?;
        if len == 0 {
            return Err(r.error("region length is 0"));
        }
        Ok(RemoteKeyBytes { nonce, region_id, backing_path, backing_offset, len, owner_fd, dev, ino })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Reader { bytes, at: 0, what }
    }
    fn error(&self, why: &str) -> PluginError {
        PluginError::new(ReasonCode::INVALID_ARGUMENT, format!("malformed {}: {why}", self.what))
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], PluginError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(self.error(&format!("truncated at byte {} of {}", self.at, self.bytes.len())));
        };
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], PluginError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u64(&mut self) -> Result<u64, PluginError> {
        Ok(u64::from_le_bytes(self.array::<8>()?))
    }
    fn magic(&mut self, magic: &[u8; 8]) -> Result<(), PluginError> {
        if self.take(8).ok() != Some(&magic[..]) {
            return Err(self.error("bad magic (not an shm plugin blob, or another format version)"));
        }
        Ok(())
    }
    fn end(&self) -> Result<(), PluginError> {
        if self.at != self.bytes.len() {
            return Err(self.error(&format!("{} trailing bytes", self.bytes.len() - self.at)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> RemoteKeyBytes {
        RemoteKeyBytes {
            nonce: 7,
            region_id: 3,
            backing_path: "/dev/shm/x".into(),
            backing_offset: 4096,
            len: 99,
            owner_fd: 12,
            dev: 5,
            ino: 77,
        }
    }

    #[test]
    fn endpoint_round_trips() {
        let e = Endpoint { host_id: [9; 16], pid: 42, nonce: u64::MAX };
        assert_eq!(Endpoint::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn remote_key_round_trips() {
        assert_eq!(RemoteKeyBytes::decode(&key().encode()).unwrap(), key());
    }

    #[test]
    fn every_truncation_of_a_key_is_refused() {
        let bytes = key().encode();
        for n in 0..bytes.len() {
            let e = RemoteKeyBytes::decode(&bytes[..n]).unwrap_err();
            assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT, "prefix of {n} bytes");
        }
    }

    #[test]
    fn trailing_bytes_and_bad_magic_are_refused() {
        let mut bytes = key().encode();
        bytes.push(0);
        assert!(RemoteKeyBytes::decode(&bytes).unwrap_err().message.contains("trailing"));
        let mut bytes = key().encode();
        bytes[0] ^= 1;
        assert!(RemoteKeyBytes::decode(&bytes).unwrap_err().message.contains("magic"));
        assert!(RemoteKeyBytes::decode(&Endpoint { host_id: [0; 16], pid: 1, nonce: 1 }.encode()).is_err());
    }

    #[test]
    fn zero_length_and_oversized_paths_are_refused() {
        let e = RemoteKeyBytes::decode(&RemoteKeyBytes { len: 0, ..key() }.encode()).unwrap_err();
        assert!(e.message.contains("length is 0"), "{e}");
        let long = RemoteKeyBytes { backing_path: "x".repeat(MAX_BACKING_PATH_BYTES + 1), ..key() };
        assert!(RemoteKeyBytes::decode(&long.encode()).unwrap_err().message.contains("path length"));
        let at_limit = RemoteKeyBytes { backing_path: "x".repeat(MAX_BACKING_PATH_BYTES), ..key() };
        assert!(RemoteKeyBytes::decode(&at_limit.encode()).is_ok());
    }
}
