//! Copying with non-temporal ("streaming") stores: the destination is written around the cache, so
//! the copying core never reads destination lines in before overwriting them and a large transfer
//! does not evict the cache of the processes beside it. Owns the instruction-set choice (AVX-512F,
//! AVX2 or SSE2, detected once at run time; a plain copy elsewhere) and the store fence that makes
//! the stores ordered; never decides *whether* to stream (the plan does, from `streaming_stores*`).

/// Which store path [`copy_streaming_unfenced`] takes on this CPU, for logs and benchmark reports.
pub fn streaming_instructions() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            "avx512f"
        } else if std::arch::is_x86_feature_detected!("avx2") {
            "avx2"
        } else {
            "sse2"
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "none (plain copy)"
    }
}

/// Copy `len` bytes from `src` to `dst` with non-temporal stores where the CPU has them.
///
/// The stores are weakly ordered: the caller must call [`store_fence`] after its last streaming
/// copy and before anything that publishes the bytes (a lock, an atomic, an event).
///
/// # Safety
/// `src..src+len` must be readable, `dst..dst+len` writable, for the whole call, and the two ranges
/// must not overlap.
pub unsafe fn copy_streaming_unfenced(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        // The detection result is cached by std after the first call (one relaxed load).
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F; the ranges are the caller's promise.
            return unsafe { x86::copy_avx512(dst, src, len) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2; the ranges are the caller's promise.
            return unsafe { x86::copy_avx2(dst, src, len) };
        }
        // SAFETY: SSE2 is part of x86_64; the ranges are the caller's promise.
        unsafe { x86::copy_sse2(dst, src, len) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's promise.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    }
}

/// Order every earlier streaming store before any later store (`sfence`); a no-op where
/// [`copy_streaming_unfenced`] makes plain copies.
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions (SSE is part of x86_64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Split a copy into a plain head (up to the destination's next `align`-byte boundary), a body
    /// of whole `unit`s for the streaming loop, and a plain tail. Returns (head, body) lengths.
    pub(super) fn split(dst: usize, len: usize, align: usize, unit: usize) -> (usize, usize) {
        let head = dst.wrapping_neg() & (align - 1);
        if len < head + unit {
            return (len, 0);
        }
        let body = (len - head) / unit * unit;
        (head, body)
    }

    /// Generates one streaming copy per vector width: head and tail with `copy_nonoverlapping`, the
    /// body four vectors per iteration, loads unaligned, stores aligned and non-temporal.
    macro_rules! streaming_copy {
        ($name:ident, $feature:literal, $vec:ty, $load:ident, $stream:ident) => {
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn $name(dst: *mut u8, src: *const u8, len: usize) {
                const WIDTH: usize = std::mem::size_of::<$vec>();
                const UNIT: usize = 4 * WIDTH;
                let (head, body) = split(dst as usize, len, WIDTH, UNIT);
                // SAFETY: (whole body) every offset stays inside `0..len`, which the caller promised
                // readable at `src` and writable at `dst`; `dst + head` is WIDTH-aligned, as the
                // streaming store requires, and stays so in steps of UNIT.
                unsafe {
                    std::ptr::copy_nonoverlapping(src, dst, head);
                    let mut offset = head;
                    let end = head + body;
                    while offset < end {
                        let s = src.add(offset) as *const $vec;
                        let d = dst.add(offset) as *mut $vec;
                        let (a, b, c, e) = ($load(s), $load(s.add(1)), $load(s.add(2)), $load(s.add(3)));
                        $stream(d, a);
                        $stream(d.add(1), b);
                        $stream(d.add(2), c);
                        $stream(d.add(3), e);
                        offset += UNIT;
                    }
                    std::ptr::copy_nonoverlapping(src.add(end), dst.add(end), len - end);
                }
            }
        };
    }

    streaming_copy!(copy_avx512, "avx512f", __m512i, _mm512_loadu_si512, _mm512_stream_si512);
    streaming_copy!(copy_avx2, "avx2", __m256i, _mm256_loadu_si256, _mm256_stream_si256);
    streaming_copy!(copy_sse2, "sse2", __m128i, _mm_loadu_si128, _mm_stream_si128);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 + 7) as u8).collect()
    }

    /// Every path (head, body, tail, too short for a body) at every destination misalignment, for
    /// lengths around each vector width's unit: exactly the range is copied, nothing around it.
    #[test]
    fn copies_exactly_the_range_at_every_alignment_and_length() {
        let src = pattern(4096 + 128);
        let lengths = [0usize, 1, 15, 16, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 1000, 4096];
        for len in lengths {
            for dst_shift in 0..64 {
                for src_shift in [0usize, 1, 17] {
                    let mut dst = vec![0xEEu8; 4096 + 256];
                    // SAFETY: both ranges lie inside their vectors and do not overlap.
                    unsafe {
                        copy_streaming_unfenced(dst.as_mut_ptr().add(64 + dst_shift), src.as_ptr().add(src_shift), len)
                    };
                    store_fence();
                    let at = 64 + dst_shift;
                    assert_eq!(
                        &dst[at..at + len],
                        &src[src_shift..src_shift + len],
                        "len {len} dst+{dst_shift} src+{src_shift}"
                    );
                    assert!(dst[..at].iter().all(|&b| b == 0xEE), "wrote before the range: len {len} dst+{dst_shift}");
                    assert!(
                        dst[at + len..].iter().all(|&b| b == 0xEE),
                        "wrote past the range: len {len} dst+{dst_shift}"
                    );
                }
            }
        }
    }

    /// Each instruction-set path directly (not only the one this CPU would pick), on a large copy.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_vector_width_copies_a_large_block() {
        let src = pattern(1 << 20);
        type CopyFn = unsafe fn(*mut u8, *const u8, usize);
        let mut paths: Vec<(&str, CopyFn)> = vec![("sse2", x86::copy_sse2)];
        if std::arch::is_x86_feature_detected!("avx2") {
            paths.push(("avx2", x86::copy_avx2));
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            paths.push(("avx512f", x86::copy_avx512));
        }
        for (name, copy) in paths {
            let mut dst = vec![0u8; (1 << 20) + 64];
            // SAFETY: the CPU has the feature (checked above); the ranges are inside their vectors.
            unsafe { copy(dst.as_mut_ptr().add(3), src.as_ptr().add(5), (1 << 20) - 5) };
            store_fence();
            assert_eq!(&dst[3..3 + (1 << 20) - 5], &src[5..], "{name}");
            assert_eq!(dst[0..3], [0, 0, 0], "{name}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn split_keeps_the_body_aligned_and_whole_units() {
        assert_eq!(x86::split(0x1000, 1024, 64, 256), (0, 1024));
        assert_eq!(x86::split(0x1001, 1024, 64, 256), (63, 768));
        assert_eq!(x86::split(0x1001, 300, 64, 256), (300, 0), "too short for one unit after the head");
        assert_eq!(x86::split(0x1040, 255, 64, 256), (255, 0));
        assert_eq!(x86::split(0x1040, 256, 64, 256), (0, 256));
    }
}
