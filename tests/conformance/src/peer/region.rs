//! Memory regions of a peer process: `/dev/shm` files mapped shared, filled with seeded random bytes and
//! checksummed range by range. Owns the mappings and unlinks their files on drop; never interprets
//! what a plugin wrote.

use crate::rng::SplitMix64;
use std::fs::{File, OpenOptions};
use std::path::PathBuf;

/// The prefix of every region file; the controller removes `{prefix}{pid}-*` after a peer dies.
pub const REGION_FILE_PREFIX: &str = "/dev/shm/kvgate-conformance-";

/// The file behind region `rid` of the peer process `pid`.
pub fn region_file(pid: u32, rid: u32) -> PathBuf {
    PathBuf::from(format!("{REGION_FILE_PREFIX}{pid}-{rid}"))
}

pub struct Region {
    pub path: PathBuf,
    pub addr: *mut u8,
    pub len: u64,
    /// Device memory behind the region (the CUDA provider): fills are written through to it, and
    /// checksums read it back into the host file first (which is then a mirror of it).
    pub device: Option<Box<dyn super::memory::DeviceMemory>>,
    _file: File,
}

// SAFETY: the mapping is shared memory written by plugins from any thread; the peer only reads or
// fills it while serving one request at a time.
unsafe impl Send for Region {}
// SAFETY: as for Send.
unsafe impl Sync for Region {}

impl Region {
    pub fn create(rid: u32, len: u64) -> Result<Region, String> {
        let path = region_file(std::process::id(), rid);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| format!("create {}: {e}", path.display()))?;
        // A zero-length mapping is impossible; keep one page so a 0-byte region still has an address.
        let map_len = len.max(4096);
        file.set_len(map_len).map_err(|e| format!("size {}: {e}", path.display()))?;
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of a file we own, never unmapped while `Region` lives.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(format!("mmap {}: {}", path.display(), std::io::Error::last_os_error()));
        }
        Ok(Region { path, addr: addr as *mut u8, len, device: None, _file: file })
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), String> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(format!("range {offset}+{len} outside region of {} bytes", self.len));
        }
        Ok(())
    }

    fn bytes(&self, offset: u64, len: u64) -> Result<&[u8], String> {
        self.check_range(offset, len)?;
        // SAFETY: in bounds of the live mapping; plugins may write concurrently (bytes are plain data).
        Ok(unsafe { std::slice::from_raw_parts(self.addr.add(offset as usize), len as usize) })
    }

    fn bytes_mut(&mut self, offset: u64, len: u64) -> Result<&mut [u8], String> {
        self.check_range(offset, len)?;
        // SAFETY: in bounds of the live mapping, borrowed mutably through `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr.add(offset as usize), len as usize) })
    }

    pub fn fill(&mut self, offset: u64, len: u64, seed: u64) -> Result<(), String> {
        let bytes = self.bytes_mut(offset, len)?;
        SplitMix64::new(seed).fill(bytes);
        if let Some(device) = &self.device {
            device.write(offset, self.bytes(offset, len)?)?;
        }
        Ok(())
    }

    /// Copy `offset..offset + len` of the device memory behind the region (if any) into its host file.
    fn refresh_from_device(&mut self, offset: u64, len: u64) -> Result<(), String> {
        let Some(device) = &self.device else { return Ok(()) };
        let fresh = device.read(offset, len)?;
        self.bytes_mut(offset, len)?.copy_from_slice(&fresh);
        Ok(())
    }

    /// Hash of each range in turn; two regions holding the same bytes in the same ranges agree.
    pub fn checksum(&mut self, ranges: &[(u64, u64)]) -> Result<u64, String> {
        let mut total = 0xcbf2_9ce4_8422_2325u64;
        for &(offset, len) in ranges {
            self.refresh_from_device(offset, len)?;
            let h = hash_bytes(self.bytes(offset, len)?);
            total = (total ^ h).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
        }
        Ok(total)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `create`.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len.max(4096) as usize) };
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A word-at-a-time hash (volatile reads: a plugin may be writing while we read).
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64 ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h ^ w).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(31);
    }
    for &b in chunks.remainder() {
        h = (h ^ b as u64).wrapping_mul(0xc4ce_b9fe_1a85_ec53).rotate_left(17);
    }
    h ^ (h >> 33)
}

/// Remove the region files a dead peer process left behind.
pub fn remove_region_files_of(pid: u32) {
    let prefix = format!("kvgate-conformance-{pid}-");
    if let Ok(dir) = std::fs::read_dir("/dev/shm") {
        for entry in dir.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}
