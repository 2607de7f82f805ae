//! Safe views of memory a plugin moves bytes in or out of: a registered region `(addr, len)` and
//! bounds-checked copies into, out of and between such views. The dereferences of foreign memory
//! live here, each under the one invariant stated on [`RegionView`]; a plugin that copies host
//! memory needs no `unsafe` of its own (one that hands addresses to a driver passes
//! [`RegionView::addr_at`] at the FFI call).

use crate::types::{PluginError, ReasonCode, RegionDesc};

/// A view of `len` bytes at `base` in this process.
///
/// Invariant: the bytes stay mapped, readable and writable for as long as the view may be used.
/// For a view made from a registration ([`RegionView::registered`]) the host guarantees it: a
/// registered region stays mapped until `deregister` returns (and the host's quarantine keeps a
/// failed transfer's destination untouched by engines until it is quiesced), and the plugin drops
/// the view, or stops using it, before its `deregister` returns. For memory the plugin mapped
/// itself ([`RegionView::from_raw_parts`]) the plugin guarantees it, by keeping the mapping alive
/// while the view is used.
///
/// The bytes may be written by other processes (the engines, a peer) while a view copies them:
/// copies never form references that outlive the copy, and say nothing about what a concurrent
/// writer leaves behind (the transfer protocol orders writers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionView {
    base: usize,
    len: u64,
}

fn out_of_range(what: &str, offset: u64, len: u64, region_len: u64) -> PluginError {
    PluginError::new(
        ReasonCode::OUT_OF_RANGE,
        format!("{what} range {offset}+{len} lies outside its region of {region_len} bytes"),
    )
}

impl RegionView {
    /// A view of a region the host registers (host memory at `desc.addr`). Refuses a zero address,
    /// a zero length and a range that wraps around the address space (`INVALID_ARGUMENT`).
    pub fn registered(desc: &RegionDesc) -> Result<RegionView, PluginError> {
        if desc.addr == 0 || desc.len == 0 {
            return Err(PluginError::new(ReasonCode::INVALID_ARGUMENT, "a region needs a non-zero addr and len"));
        }
        let fits = usize::try_from(desc.addr)
            .ok()
            .zip(usize::try_from(desc.len).ok())
            .is_some_and(|(addr, len)| addr.checked_add(len).is_some());
        if !fits {
            return Err(PluginError::new(ReasonCode::INVALID_ARGUMENT, "a region wraps around the address space"));
        }
        Ok(RegionView { base: desc.addr as usize, len: desc.len })
    }

    /// A view of memory the plugin mapped itself (or, in tests, owns).
    ///
    /// # Safety
    /// `base..base + len` must stay mapped, readable and writable while the view (or a copy of it)
    /// is used, and must not wrap around the address space.
    pub unsafe fn from_raw_parts(base: usize, len: u64) -> RegionView {
        RegionView { base, len }
    }

    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The address of the first byte (for an FFI call that takes the region whole).
    pub fn base(&self) -> usize {
        self.base
    }

    /// Check that `offset..offset + len` lies in the view (`OUT_OF_RANGE` otherwise, offsets near
    /// `u64::MAX` included).
    pub fn check(&self, offset: u64, len: u64) -> Result<(), PluginError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(out_of_range("the", offset, len, self.len)),
        }
    }

    /// The address of byte `offset` of a checked range, for an FFI call (a driver's copy, a
    /// network library's send) that moves `len` bytes there.
    pub fn addr_at(&self, offset: u64, len: u64) -> Result<usize, PluginError> {
        self.check(offset, len)?;
        Ok(self.base + offset as usize)
    }

    /// The sub-view `offset..offset + len`.
    pub fn slice(&self, offset: u64, len: u64) -> Result<RegionView, PluginError> {
        self.check(offset, len)?;
        Ok(RegionView { base: self.base + offset as usize, len })
    }

    /// Append `len` bytes at `offset` to `out`.
    pub fn copy_out(&self, offset: u64, len: usize, out: &mut Vec<u8>) -> Result<(), PluginError> {
        self.check(offset, len as u64).map_err(|_| out_of_range("source", offset, len as u64, self.len))?;
        out.reserve(len);
        let start = out.len();
        // SAFETY: the range lies in the view (checked above) and the view's memory is mapped while
        // it is used (the invariant of `RegionView`); `out` has room for `len` more bytes and does
        // not overlap foreign memory; `set_len` follows the copy of exactly `len` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping((self.base + offset as usize) as *const u8, out.as_mut_ptr().add(start), len);
            out.set_len(start + len);
        }
        Ok(())
    }

    /// Copy `data` into the view at `offset`.
    pub fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), PluginError> {
        let len = data.len() as u64;
        self.check(offset, len).map_err(|_| out_of_range("destination", offset, len, self.len))?;
        // SAFETY: as in `copy_out`; the destination range was checked above, and `data` is this
        // process's own memory (a borrowed slice), which `copy` allows to overlap.
        unsafe { std::ptr::copy(data.as_ptr(), (self.base + offset as usize) as *mut u8, data.len()) };
        Ok(())
    }

    /// Copy `len` bytes from this view at `offset` into `dst` at `dst_offset` with `copier`, which
    /// receives a checked destination, source and length (`std::ptr::copy` for [`RegionView::copy_to`];
    /// a plugin may pass its own, e.g. with streaming stores).
    pub fn copy_to_with(
        &self,
        offset: u64,
        dst: &RegionView,
        dst_offset: u64,
        len: u64,
        copier: Copier,
    ) -> Result<(), PluginError> {
        self.check(offset, len).map_err(|_| out_of_range("source", offset, len, self.len))?;
        dst.check(dst_offset, len).map_err(|_| out_of_range("destination", dst_offset, len, dst.len))?;
        let (to, from, n) = (dst.base + dst_offset as usize, self.base + offset as usize, len as usize);
        let overlap = n > 0 && to < from + n && from < to + n;
        let copier = if overlap { plain_copy as Copier } else { copier };
        // SAFETY: both ranges lie in their views (checked above), whose memory is mapped while they
        // are used (the invariant of `RegionView`); they do not overlap in this address space when
        // `copier` is the caller's (its contract), and `plain_copy` takes overlapping ones.
        unsafe { copier(to as *mut u8, from as *const u8, n) };
        Ok(())
    }

    /// Copy `len` bytes from this view at `offset` into `dst` at `dst_offset` (ranges may overlap).
    pub fn copy_to(&self, offset: u64, dst: &RegionView, dst_offset: u64, len: u64) -> Result<(), PluginError> {
        self.copy_to_with(offset, dst, dst_offset, len, plain_copy)
    }
}

/// Copies `len` bytes from a source to a destination address. Contract: sound whenever both
/// ranges are mapped (the source readable, the destination writable) for the whole call and do not
/// overlap ([`RegionView::copy_to_with`] never hands it overlapping ranges).
pub type Copier = unsafe fn(dst: *mut u8, src: *const u8, len: usize);

/// The plain [`Copier`]: `std::ptr::copy` (a `memmove`).
///
/// # Safety
/// As for every [`Copier`].
pub unsafe fn plain_copy(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: the caller's (the `Copier` contract); `copy` allows overlap.
    unsafe { std::ptr::copy(src, dst, len) }
}
