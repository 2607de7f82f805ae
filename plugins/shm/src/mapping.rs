//! Shared-file mappings: [`PeerMapping`] maps a peer's region writable into this process (one per
//! imported remote key, unmapped when the last transfer using it lets go), and [`SharedRegion`]
//! creates a memfd- or /dev/shm-backed buffer an engine, test or bench can register. Never copies.

use kvgate_abi::sdk::RegionView;
use kvgate_abi::{MemoryKind, PluginError, ReasonCode, RegionDesc};
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as u64
    } else {
        4096
    }
}

fn io_error(code: ReasonCode, what: String, e: std::io::Error) -> PluginError {
    PluginError::new(code, format!("{what}: {e}"))
}

/// tmpfs (`/dev/shm`, memfd) and hugetlbfs: the only file systems whose files are plain shared memory.
const TMPFS_MAGIC: i64 = 0x0102_1994;
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Refuse anything but a regular file on tmpfs or hugetlbfs, so a peer's key can never make this
/// process write into a file on disk (`/etc/passwd`, a model checkpoint...).
pub fn check_shared_memory_file(file: &File, path: &str, refusal: ReasonCode) -> Result<u64, PluginError> {
    let meta = file.metadata().map_err(|e| io_error(refusal, format!("fstat {path:?}"), e))?;
    if !meta.is_file() {
        return Err(PluginError::new(refusal, format!("{path:?} is not a regular file")));
    }
    // SAFETY: fstatfs writes into the zeroed struct we own; the fd is open for the whole call.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above: `fs` is ours and writable, the descriptor open.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) } != 0 {
        return Err(io_error(refusal, format!("fstatfs {path:?}"), std::io::Error::last_os_error()));
    }
    let fs_type = fs.f_type as i64;
    if fs_type != TMPFS_MAGIC && fs_type != HUGETLBFS_MAGIC {
        return Err(PluginError::new(
            refusal,
            format!("{path:?} is not shared memory (tmpfs such as /dev/shm, a memfd, or hugetlbfs); file system type {fs_type:#x}"),
        ));
    }
    Ok(meta.len())
}

/// The shared-memory file at `path`, opened (a registration holds it open, so that peers can map it
/// through this process's descriptor), and its size; or why it cannot back a region.
pub fn open_backing_file(path: &str) -> Result<(File, u64), PluginError> {
    let file =
        File::open(path).map_err(|e| io_error(ReasonCode::INVALID_ARGUMENT, format!("backing file {path:?}"), e))?;
    let len = check_shared_memory_file(&file, path, ReasonCode::INVALID_ARGUMENT)?;
    Ok((file, len))
}

/// `madvise` advice that faults a range in for writing (Linux 5.14; the libc crate may not name it).
const MADV_POPULATE_WRITE: libc::c_int = 23;
/// How much of a peer's mapping one pre-fault call covers (see `PeerMapping::populate`).
pub const POPULATE_CHUNK_BYTES: usize = 64 << 20;

/// A peer's region file, opened through its owner's descriptor and checked (the same file it
/// registered, shared memory, long enough), held open but not mapped: importing a key costs an
/// `open` and two `fstat`s, never a mapping or a page fault.
#[derive(Debug)]
pub struct PeerBacking {
    file: File,
    path: String,
    offset: u64,
    len: u64,
}

impl PeerBacking {
    /// Open the file at `path` read-write and check it: (device, inode) `identity` when given, a
    /// shared-memory file, at least `offset + len` bytes long.
    pub fn open(path: &str, identity: Option<(u64, u64)>, offset: u64, len: u64) -> Result<PeerBacking, PluginError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_error(ReasonCode::UNKNOWN_KEY, format!("cannot open peer region file {path:?}"), e))?;
        if let Some((dev, ino)) = identity {
            use std::os::unix::fs::MetadataExt;
            let meta = file.metadata().map_err(|e| io_error(ReasonCode::UNKNOWN_KEY, format!("fstat {path:?}"), e))?;
            if (meta.dev(), meta.ino()) != (dev, ino) {
                return Err(PluginError::new(
                    ReasonCode::UNKNOWN_KEY,
                    format!("{path:?} is no longer the file the peer registered (device/inode {}/{} instead of {dev}/{ino})", meta.dev(), meta.ino()),
                ));
            }
        }
        let file_len = check_shared_memory_file(&file, path, ReasonCode::INVALID_ARGUMENT)?;
        offset.checked_add(len).filter(|&end| end <= file_len).ok_or_else(|| {
            PluginError::new(
                ReasonCode::OUT_OF_RANGE,
                format!("peer region {offset}+{len} lies outside its file {path:?} of {file_len} bytes"),
            )
        })?;
        Ok(PeerBacking { file, path: path.to_string(), offset, len })
    }

    /// The region's length in bytes.
    pub fn region_len(&self) -> u64 {
        self.len
    }
}

/// A peer's region mapped writable (`MAP_SHARED`) into this process.
#[derive(Debug)]
pub struct PeerMapping {
    /// Start of the whole mapping (page aligned).
    map_addr: usize,
    map_len: usize,
    /// Where the region starts (`map_addr` + the in-page offset).
    region_addr: usize,
    region_len: u64,
}

// SAFETY: the mapping is plain shared memory; writers synchronise through the plugin's state.
unsafe impl Send for PeerMapping {}
// SAFETY: as for Send: shared references reach only the addresses, never a Rust-owned value.
unsafe impl Sync for PeerMapping {}

impl PeerMapping {
    /// Map `len` bytes at `offset` of the file at `path` (pre-faulted with `populate`). Refuses a
    /// file shorter than `offset + len`.
    pub fn map(path: &str, offset: u64, len: u64, populate: bool) -> Result<PeerMapping, PluginError> {
        let mapping = Self::map_backing(&PeerBacking::open(path, None, offset, len)?)?;
        if populate {
            mapping.populate(POPULATE_CHUNK_BYTES);
        }
        Ok(mapping)
    }

    /// Map an opened and checked peer file (one `mmap`: no page is touched, whatever the size).
    pub fn map_backing(backing: &PeerBacking) -> Result<PeerMapping, PluginError> {
        let (file, path, offset, len) = (&backing.file, &backing.path, backing.offset, backing.len);
        let end = offset + len;
        let page = page_size();
        let map_offset = offset / page * page;
        let map_len = usize::try_from(end - map_offset)
            .map_err(|_| PluginError::new(ReasonCode::RESOURCE_EXHAUSTED, "peer region too large to map"))?;
        // SAFETY: a fresh mapping of a file we opened read-write; the result is checked.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                map_offset as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(io_error(ReasonCode::RESOURCE_EXHAUSTED, format!("mmap of {path:?}"), e));
        }
        let map_addr = addr as usize;
        Ok(PeerMapping { map_addr, map_len, region_addr: map_addr + (offset - map_offset) as usize, region_len: len })
    }

    /// Pre-fault the whole mapping for writing, `chunk` bytes per call (`MADV_POPULATE_WRITE`), so
    /// that the first copy into it takes no page faults. Not `MAP_POPULATE`: that holds the
    /// process's memory-map lock for the whole region, and every other thread of the process that
    /// maps or unmaps memory meanwhile (an allocator growing, a runtime thread) waits for all of it:
    /// 0.6-1.6 s for a fresh 1 GiB file here, long enough for a gateway to miss its peer-link
    /// heartbeats. Between chunks the lock is free (the same 1 GiB: the longest such wait 3 ms).
    /// A kernel without `MADV_POPULATE_WRITE` (before 5.14) leaves the mapping to fault on first use,
    /// with one warning.
    pub fn populate(&self, chunk: usize) {
        let chunk = chunk.max(page_size() as usize);
        let mut done = 0;
        while done < self.map_len {
            let n = chunk.min(self.map_len - done);
            // SAFETY: a range inside our own live mapping; madvise only faults its pages in.
            if unsafe { libc::madvise((self.map_addr + done) as *mut libc::c_void, n, MADV_POPULATE_WRITE) } != 0 {
                let e = std::io::Error::last_os_error();
                tracing::warn!(
                    reason = "populate_unavailable", done, total = self.map_len,
                    "shm: pre-faulting a peer mapping stopped (madvise MADV_POPULATE_WRITE: {e}); the rest faults on first use (populate_mappings)"
                );
                return;
            }
            done += n;
        }
    }

    pub fn region_addr(&self) -> usize {
        self.region_addr
    }
    /// The mapped region as a view, to copy into through the SDK's bounds checks.
    pub fn view(&self) -> RegionView {
        // SAFETY: `region_addr..+region_len` lies in this mapping, which stays mapped until it is
        // dropped; every transfer that copies through the view holds the mapping (`Transfer::mappings`)
        // until it is quiesced.
        unsafe { RegionView::from_raw_parts(self.region_addr, self.region_len) }
    }
    pub fn region_len(&self) -> u64 {
        self.region_len
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped; no transfer holds it (it holds an Arc to us).
        unsafe { libc::munmap(self.map_addr as *mut libc::c_void, self.map_len) };
    }
}

/// A buffer backed by a shared file, registrable with the shm plugin (and mappable by a peer).
/// Created with [`SharedRegion::memfd`] (path `/proc/<pid>/fd/<n>`, freed with the last mapping) or
/// [`SharedRegion::in_dir`] (a named file, removed on drop). Pages are pre-faulted.
pub struct SharedRegion {
    addr: usize,
    len: usize,
    path: String,
    unlink_on_drop: bool,
    _file: File,
}

// SAFETY: plain shared memory owned by this value; users synchronise access themselves.
unsafe impl Send for SharedRegion {}
// SAFETY: as for Send: shared references reach only the mapped bytes, whose users synchronise.
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    /// An anonymous memfd of `len` bytes, reachable by peers as `/proc/<pid>/fd/<n>`. Its size is
    /// sealed (`F_SEAL_SHRINK | F_SEAL_GROW`), so no process can shrink it under a peer's mapping
    /// (a write past the end of a shrunk file would kill the writer with `SIGBUS`).
    pub fn memfd(len: usize) -> std::io::Result<SharedRegion> {
        let name = CString::new("kvgate-shm-region").expect("no NUL in a literal");
        // SAFETY: a valid NUL-terminated name; the fd is checked and owned by `File` below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let path = format!("/proc/{}/fd/{}", std::process::id(), fd);
        let region = SharedRegion::map_file(file, len, path, false)?;
        // SAFETY: fcntl on a descriptor we own; the result is checked.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(region)
    }

    /// A file named `name` in `dir` (e.g. `/dev/shm`), created exclusively and removed on drop.
    pub fn in_dir(dir: &Path, name: &str, len: usize) -> std::io::Result<SharedRegion> {
        let path = dir.join(name);
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        SharedRegion::map_file(file, len, path.to_string_lossy().into_owned(), true)
    }

    fn map_file(file: File, len: usize, path: String, unlink_on_drop: bool) -> std::io::Result<SharedRegion> {
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "a shared region needs len > 0"));
        }
        file.set_len(len as u64)?;
        // SAFETY: a fresh shared mapping of a file we own; the result is checked.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(SharedRegion { addr: addr as usize, len, path, unlink_on_drop, _file: file })
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn addr(&self) -> usize {
        self.addr
    }
    pub fn path(&self) -> &str {
        &self.path
    }
    /// The region as a slice. Another process or a plugin may write it concurrently: read it only
    /// once the transfers into it are terminal.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `addr..addr+len` is mapped for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
    /// The region as a mutable slice (same caveat as [`SharedRegion::as_slice`]).
    #[allow(clippy::mut_from_ref)]
    pub fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: as above; the caller ensures no transfer touches the region meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
    /// The descriptor to `register` the whole region.
    pub fn desc(&self) -> RegionDesc {
        RegionDesc {
            kind: MemoryKind::HOST,
            device: -1,
            addr: self.addr as u64,
            len: self.len as u64,
            backing_path: self.path.as_str().into(),
            backing_offset: 0,
            ipc_handle: Default::default(),
        }
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map_file`.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        if self.unlink_on_drop {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `mapping` present in memory, by `mincore`.
    fn resident_pages(mapping: &PeerMapping) -> usize {
        let page = page_size() as usize;
        let mut vec = vec![0u8; mapping.map_len.div_ceil(page)];
        // SAFETY: our own live mapping, and a vector of one byte per page of it.
        let rc = unsafe { libc::mincore(mapping.map_addr as *mut libc::c_void, mapping.map_len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }

    #[test]
    fn populate_faults_in_every_page_chunk_by_chunk_including_a_short_last_chunk() {
        let page = page_size() as usize;
        let path = format!("/dev/shm/kvgate-shm-populate-test-{}", std::process::id());
        let len = (3 << 20) + 5 * page as u64;
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.set_len(len).unwrap();
        let mapping = PeerMapping::map(&path, 0, len, false).unwrap();
        assert_eq!(resident_pages(&mapping), 0, "a fresh sparse file has no pages yet");
        mapping.populate(1 << 20);
        assert_eq!(resident_pages(&mapping), mapping.map_len / page, "every page, the short last chunk too");
        // A chunk under a page is taken as one page, not an endless loop; the contents stay zero.
        mapping.populate(1);
        // SAFETY: the mapping is live and `len` bytes long from region_addr.
        let bytes = unsafe { std::slice::from_raw_parts(mapping.region_addr() as *const u8, len as usize) };
        assert!(bytes.iter().all(|&b| b == 0));
        drop(mapping);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn map_with_populate_pre_faults_the_region() {
        let page = page_size() as usize;
        let path = format!("/dev/shm/kvgate-shm-populate-map-test-{}", std::process::id());
        let len = (POPULATE_CHUNK_BYTES as u64 / 16) + 3;
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.set_len(len).unwrap();
        let mapping = PeerMapping::map(&path, 0, len, true).unwrap();
        assert_eq!(resident_pages(&mapping), mapping.map_len.div_ceil(page));
        drop(mapping);
        std::fs::remove_file(&path).unwrap();
    }
}
