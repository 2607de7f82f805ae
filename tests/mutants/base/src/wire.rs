//! What crosses between two instances: endpoint names (abstract Unix socket names), remote-key bytes
//! (`kvref1|path|offset|len`), control datagrams, and the writable mapping of a peer's region.
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

pub fn encode_key(path: &str, offset: u64, len: u64) -> Vec<u8> {
    format!("{KEY_PREFIX}|{path}|{offset}|{len}").into_bytes()
}

pub fn parse_key(bytes: &[u8]) -> Result<(String, u64, u64), PluginError> {
    let s = std::str::from_utf8(bytes).map_err(|_| invalid("remote key is not UTF-8".into()))?;
    let parts: Vec<&str> = s.split('|').collect();
    if parts.len() != 4 || parts[0] != KEY_PREFIX {
        return Err(invalid("remote key is not a kvref1 key".into()));
    }
    let num = |p: &str| p.parse::<u64>().map_err(|_| invalid(format!("remote key field {p:?} is not a number")));
    Ok((parts[1].to_string(), num(parts[2])?, num(parts[3])?))
}

/// A peer's region mapped writable into this process; unmapped when the last user drops it.
pub struct RemoteMap {
    base: *mut u8,
    map_len: usize,
    pub addr: *mut u8,
    pub len: u64,
}

unsafe impl Send for RemoteMap {}
unsafe impl Sync for RemoteMap {}

impl RemoteMap {
    pub fn map(path: &str, offset: u64, len: u64) -> Result<RemoteMap, PluginError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| PluginError::new(ReasonCode::UNKNOWN_KEY, format!("cannot open {path:?}: {e}")))?;
        let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let end = offset.checked_add(len).filter(|e| *e <= file_len && len > 0);
        let Some(end) = end else {
            return Err(PluginError::new(ReasonCode::OUT_OF_RANGE, format!("{offset}+{len} outside {path:?} of {file_len} bytes")));
        };
        let page = 4096u64;
        let map_off = offset / page * page;
        let map_len = (end - map_off) as usize;
        // SAFETY: a fresh shared mapping of a file opened read-write; checked below.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), map_off as libc::off_t)
        };
        if base == libc::MAP_FAILED {
            return Err(PluginError::new(ReasonCode::RESOURCE_EXHAUSTED, format!("mmap {path:?}: {}", std::io::Error::last_os_error())));
        }
        let base = base as *mut u8;
        // SAFETY: inside the mapping just made.
        let addr = unsafe { base.add((offset - map_off) as usize) };
        Ok(RemoteMap { base, map_len, addr, len })
    }
}

impl Drop for RemoteMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, no longer used by anyone (last Arc).
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.map_len) };
    }
}

/// Control datagrams (text, one message per line, several per datagram).
#[derive(Debug, PartialEq, Eq)]
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
}

impl Msg {
    pub fn encode(&self) -> String {
        match self {
            Msg::Ticket(t) => format!("TICKET {t}"),
            Msg::Revoke(t) => format!("REVOKE {t}"),
            Msg::Done(x) => format!("DONE {x}"),
            Msg::Ack(x) => format!("ACK {x}"),
            Msg::Note(x) => format!("NOTE {x}"),
        }
    }
    pub fn parse(line: &str) -> Option<Msg> {
        let (word, n) = line.split_once(' ')?;
        let n: u64 = n.trim().parse().ok()?;
        Some(match word {
            "TICKET" => Msg::Ticket(n),
            "REVOKE" => Msg::Revoke(n),
            "DONE" => Msg::Done(n),
            "ACK" => Msg::Ack(n),
            "NOTE" => Msg::Note(n),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_messages_round_trip_and_garbage_is_refused() {
        let k = encode_key("/dev/shm/x", 4, 10);
        assert_eq!(parse_key(&k).unwrap(), ("/dev/shm/x".to_string(), 4, 10));
        assert!(parse_key(&k[..k.len() / 2]).is_err());
        assert!(parse_key(&[0xff; 13]).is_err());
        assert!(parse_endpoint(b"").is_err());
        assert_eq!(Msg::parse(&Msg::Ack(7).encode()), Some(Msg::Ack(7)));
        assert_eq!(Msg::parse("BOGUS 1"), None);
    }
}
