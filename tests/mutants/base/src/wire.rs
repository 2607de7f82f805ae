//! What crosses between two instances: endpoint names (abstract Unix socket names), remote-key bytes
//! (`kvref1|path|offset|len|key`), control messages, and the writable mapping of a peer's region.
//! The UDP variant's own framing is in `udp_wire.rs`.
//! Never trusts a byte from the peer: every parse failure is an `INVALID_ARGUMENT`.

use kvgate_abi::{PluginError, ReasonCode};
use std::os::fd::AsRawFd;

pub const ENDPOINT_PREFIX: &str = "kvgate-refplugin-";
const KEY_PREFIX: &str = "kvref1";

fn invalid(what: String) -> PluginError {
    PluginError::new(ReasonCode::INVALID_ARGUMENT, what)
}

pub fn parse_endpoint(bytes: &[u8]) -> Result<String, PluginError> {
    let s = std::str::from_utf8(bytes).map_err(|_| invalid("endpoint is not UTF-8".into()))?;
    if !s.starts_with(ENDPOINT_PREFIX) || s.len() > 100 {
        return Err(invalid(format!("endpoint {s:?} is not a kvgate-refplugin endpoint")));
    }
    Ok(s.to_string())
}

/// A region as its owner describes it to peers: the backing file, where the region starts in it, its
/// length, and the owner's local key (which the UDP variant's data datagrams name).
#[derive(Debug, PartialEq, Eq)]
pub struct KeyBytes {
    pub path: String,
    pub offset: u64,
    pub len: u64,
    pub owner_key: u64,
}

pub fn encode_key(path: &str, offset: u64, len: u64, owner_key: u64) -> Vec<u8> {
    format!("{KEY_PREFIX}|{path}|{offset}|{len}|{owner_key}").into_bytes()
}

pub fn parse_key(bytes: &[u8]) -> Result<KeyBytes, PluginError> {
    let s = std::str::from_utf8(bytes).map_err(|_| invalid("remote key is not UTF-8".into()))?;
    let parts: Vec<&str> = s.split('|').collect();
    if parts.len() != 5 || parts[0] != KEY_PREFIX {
        return Err(invalid("remote key is not a kvref1 key".into()));
    }
    let num = |p: &str| p.parse::<u64>().map_err(|_| invalid(format!("remote key field {p:?} is not a number")));
    Ok(KeyBytes { path: parts[1].to_string(), offset: num(parts[2])?, len: num(parts[3])?, owner_key: num(parts[4])? })
}

/// A peer's region mapped writable into this process; unmapped when the last user drops it.
pub struct RemoteMap {
    base: *mut u8,
    map_len: usize,
    pub addr: *mut u8,
    pub len: u64,
    /// The owner's local key for the region.
    pub owner_key: u64,
}

// SAFETY: `addr` is a shared mapping that outlives every use (the base plugin keeps it while a key
// names it); the value holds no Rust-owned data behind the pointer.
unsafe impl Send for RemoteMap {}
// SAFETY: as for Send: readers and the plugin's workers synchronise through the plugin's state.
unsafe impl Sync for RemoteMap {}

impl RemoteMap {
    pub fn map(key: &KeyBytes) -> Result<RemoteMap, PluginError> {
        let (path, offset, len) = (key.path.as_str(), key.offset, key.len);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| PluginError::new(ReasonCode::UNKNOWN_KEY, format!("cannot open {path:?}: {e}")))?;
        let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let end = offset.checked_add(len).filter(|e| *e <= file_len && len > 0);
        let Some(end) = end else {
            return Err(PluginError::new(
                ReasonCode::OUT_OF_RANGE,
                format!("{offset}+{len} outside {path:?} of {file_len} bytes"),
            ));
        };
        let page = 4096u64;
        let map_off = offset / page * page;
        let map_len = (end - map_off) as usize;
        // SAFETY: a fresh shared mapping of a file opened read-write; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                map_off as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(PluginError::new(
                ReasonCode::RESOURCE_EXHAUSTED,
                format!("mmap {path:?}: {}", std::io::Error::last_os_error()),
            ));
        }
        let base = base as *mut u8;
        // SAFETY: inside the mapping just made.
        let addr = unsafe { base.add((offset - map_off) as usize) };
        Ok(RemoteMap { base, map_len, addr, len, owner_key: key.owner_key })
    }
}

impl Drop for RemoteMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, no longer used by anyone (last Arc).
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.map_len) };
    }
}

/// Control messages (text, one per line, several per datagram).
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum Msg {
    /// Receiver → sender: writes under this ticket are allowed.
    Ticket(u64),
    /// Receiver → sender: the ticket is withdrawn.
    Revoke(u64),
    /// Sender → receiver: every byte of this transfer is written.
    Done(u64),
    /// Receiver → sender: `Done` seen.
    Ack(u64),
    /// Sender → receiver: a transfer was submitted (informational).
    Note(u64),
    /// UDP, sender → receiver at connect: "I am the peer bound to this port; answer me here" (the
    /// receiver then sends this peer's tickets along the path the hello came by).
    Hello(u16),
    /// UDP, receiver → sender: the first `n` data datagrams of the transfer are staged.
    Got(u64, u32),
    /// UDP, sender → receiver: all `n` data datagrams sent; write them unless the monotonic clock has
    /// passed `expiry_ns` (the transfer's deadline).
    Commit(u64, u32, u64),
    /// UDP, receiver → sender: the commit was refused (data missing, expired or its region gone).
    Nack(u64),
}

impl Msg {
    pub fn encode(&self) -> String {
        match self {
            Msg::Ticket(t) => format!("TICKET {t}"),
            Msg::Revoke(t) => format!("REVOKE {t}"),
            Msg::Done(x) => format!("DONE {x}"),
            Msg::Ack(x) => format!("ACK {x}"),
            Msg::Note(x) => format!("NOTE {x}"),
            Msg::Hello(port) => format!("HELLO {port}"),
            Msg::Got(x, n) => format!("GOT {x} {n}"),
            Msg::Commit(x, n, expiry) => format!("COMMIT {x} {n} {expiry}"),
            Msg::Nack(x) => format!("NACK {x}"),
        }
    }
    pub fn parse(line: &str) -> Option<Msg> {
        let mut words = line.split_whitespace();
        let word = words.next()?;
        let nums: Vec<u64> = words.map(|w| w.parse().ok()).collect::<Option<_>>()?;
        Some(match (word, nums.as_slice()) {
            ("TICKET", &[t]) => Msg::Ticket(t),
            ("REVOKE", &[t]) => Msg::Revoke(t),
            ("DONE", &[x]) => Msg::Done(x),
            ("ACK", &[x]) => Msg::Ack(x),
            ("NOTE", &[x]) => Msg::Note(x),
            ("HELLO", &[port]) => Msg::Hello(u16::try_from(port).ok()?),
            ("GOT", &[x, n]) => Msg::Got(x, u32::try_from(n).ok()?),
            ("COMMIT", &[x, n, expiry]) => Msg::Commit(x, u32::try_from(n).ok()?, expiry),
            ("NACK", &[x]) => Msg::Nack(x),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_messages_round_trip_and_garbage_is_refused() {
        let k = encode_key("/dev/shm/x", 4, 10, 3);
        assert_eq!(parse_key(&k).unwrap(), KeyBytes { path: "/dev/shm/x".into(), offset: 4, len: 10, owner_key: 3 });
        assert!(parse_key(&k[..k.len() / 2]).is_err());
        assert!(parse_key(&[0xff; 13]).is_err());
        assert!(parse_endpoint(b"").is_err());
        assert_eq!(Msg::parse(&Msg::Ack(7).encode()), Some(Msg::Ack(7)));
        assert_eq!(Msg::parse("BOGUS 1"), None);
        for m in [Msg::Hello(9), Msg::Got(4, 2), Msg::Commit(4, 2, 99), Msg::Nack(4)] {
            assert_eq!(Msg::parse(&m.encode()), Some(m));
        }
        assert_eq!(Msg::parse("GOT 4"), None);
        assert_eq!(Msg::parse("HELLO 70000"), None);
    }
}
