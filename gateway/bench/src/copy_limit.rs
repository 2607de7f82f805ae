//! The machine's copy limit, the shm plugin's reference: the best of two copy methods, glibc's memcpy
//! (cached stores) and streaming (non-temporal) stores, each run on as many threads as the plugin
//! copies with (its `workers`), over a working set larger than the last-level cache, so that no
//! pass is served from cache. One thread of memcpy is not the limit: the plugin copies with two
//! threads and streaming stores, which by themselves give a structural ~2.8x over it on a host
//! with little cache, while on a host with a large last-level cache a cached reference can still
//! win. Measures only this process's own buffers; never touches a gateway or a pool.

use kvgate_plugin_shm::stream_copy::{copy_streaming_unfenced, store_fence, streaming_instructions};
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Each of the two buffers (source, destination) is at least this large.
pub const MIN_LIMIT_BUFFER_BYTES: u64 = 256 << 20;
/// Each buffer is a multiple of this, and at least the last-level cache: the working set (both
/// buffers) is then at least twice the cache.
pub const LIMIT_BUFFER_ROUND_BYTES: u64 = 64 << 20;
/// Each thread's share starts on a page.
const SHARE_ALIGN_BYTES: usize = 4096;

/// How many bytes each buffer holds for a last-level cache of `llc_kib` KiB (0 = unknown).
pub fn limit_buffer_bytes(llc_kib: u64) -> u64 {
    let llc = llc_kib.saturating_mul(1024);
    (llc.div_ceil(LIMIT_BUFFER_ROUND_BYTES) * LIMIT_BUFFER_ROUND_BYTES).max(MIN_LIMIT_BUFFER_BYTES)
}

/// One way of copying a thread's share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMethod {
    /// `copy_from_slice` (glibc's memcpy: cached stores at these sizes).
    Memcpy,
    /// The shm plugin's own non-temporal copy (AVX-512, AVX2 or SSE2 stores that bypass the cache).
    Streaming,
}

/// What the limit passes moved so far, per method: bytes and the wall time of their passes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LimitSamples {
    pub memcpy_bytes: u64,
    pub memcpy_time: Duration,
    pub streaming_bytes: u64,
    pub streaming_time: Duration,
}

impl LimitSamples {
    pub fn add(&mut self, other: &LimitSamples) {
        self.memcpy_bytes += other.memcpy_bytes;
        self.memcpy_time += other.memcpy_time;
        self.streaming_bytes += other.streaming_bytes;
        self.streaming_time += other.streaming_time;
    }
    fn record(&mut self, method: CopyMethod, bytes: u64, time: Duration) {
        match method {
            CopyMethod::Memcpy => {
                self.memcpy_bytes += bytes;
                self.memcpy_time += time;
            }
            CopyMethod::Streaming => {
                self.streaming_bytes += bytes;
                self.streaming_time += time;
            }
        }
    }
    pub fn memcpy_gbps(&self) -> f64 {
        super::stats::gbps(self.memcpy_bytes, self.memcpy_time)
    }
    pub fn streaming_gbps(&self) -> f64 {
        super::stats::gbps(self.streaming_bytes, self.streaming_time)
    }
    /// The limit: the faster of the two methods.
    pub fn best_gbps(&self) -> f64 {
        self.memcpy_gbps().max(self.streaming_gbps())
    }
}

/// The two buffers of the limit measurement, written once (so no page is the kernel's zero page),
/// and how many threads copy between them.
pub struct LimitBuffers {
    src: Vec<u8>,
    dst: Vec<u8>,
    threads: usize,
}

impl LimitBuffers {
    /// Two buffers of `bytes_each` bytes, every page written; `threads` threads (at least 1) copy.
    pub fn new(bytes_each: u64, threads: usize) -> LimitBuffers {
        let len = bytes_each as usize;
        LimitBuffers { src: vec![0x5A; len], dst: vec![0xA5; len], threads: threads.max(1) }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Source and destination together: what every pass streams through the caches.
    pub fn working_set_bytes(&self) -> u64 {
        (self.src.len() + self.dst.len()) as u64
    }

    /// One pass: every thread copies its share of the source into the destination with `method`,
    /// all started together; the wall time from the start to the last thread's end.
    pub fn pass(&mut self, method: CopyMethod) -> Duration {
        let share = (self.src.len() / self.threads).div_ceil(SHARE_ALIGN_BYTES).max(1) * SHARE_ALIGN_BYTES;
        let barrier = Barrier::new(self.threads + 1);
        std::thread::scope(|scope| {
            for (s, d) in self.src.chunks(share).zip(self.dst.chunks_mut(share)) {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    copy_with(method, s, d);
                });
            }
            // Fewer shares than threads only for buffers smaller than `threads` pages.
            for _ in self.src.chunks(share).len()..self.threads {
                scope.spawn(|| {
                    barrier.wait();
                });
            }
            barrier.wait();
            let started = Instant::now();
            // The scope joins every thread before it returns.
            started
        })
        .elapsed()
    }

    /// Passes, alternating the two methods, for at least `budget` and at least one of each.
    pub fn measure(&mut self, budget: Duration) -> LimitSamples {
        let mut samples = LimitSamples::default();
        let started = Instant::now();
        let bytes = self.src.len() as u64;
        let mut n = 0u64;
        while n < 2 || started.elapsed() < budget {
            let method = if n.is_multiple_of(2) { CopyMethod::Memcpy } else { CopyMethod::Streaming };
            samples.record(method, bytes, self.pass(method));
            n += 1;
        }
        samples
    }

    /// Whether the destination holds the source (after at least one pass).
    pub fn copied(&self) -> bool {
        self.src == self.dst
    }
}

fn copy_with(method: CopyMethod, src: &[u8], dst: &mut [u8]) {
    match method {
        CopyMethod::Memcpy => dst.copy_from_slice(src),
        CopyMethod::Streaming => {
            assert_eq!(src.len(), dst.len(), "shares of equal length");
            // SAFETY: both ranges are live slices of `len` bytes for the whole call and do not overlap
            // (two distinct allocations).
            unsafe { copy_streaming_unfenced(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
            store_fence();
        }
    }
}

/// `best of memcpy and streaming stores (avx512f), 2 threads, 512 MiB -> 512 MiB (1 GiB working set)`.
pub fn describe(threads: u64, working_set_bytes: u64) -> String {
    let half = super::stats::size_label(working_set_bytes / 2);
    format!(
        "the best of memcpy and streaming stores ({}), {threads} thread{} (the plugin's workers), {half} -> {half} ({} working set)",
        streaming_instructions(),
        if threads == 1 { "" } else { "s" },
        super::stats::size_label(working_set_bytes)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_buffers_outgrow_the_last_level_cache() {
        assert_eq!(limit_buffer_bytes(0), MIN_LIMIT_BUFFER_BYTES);
        assert_eq!(limit_buffer_bytes(32 * 1024), MIN_LIMIT_BUFFER_BYTES, "a 32 MiB cache");
        assert_eq!(limit_buffer_bytes(480 * 1024), 512 << 20, "a 480 MiB cache");
        assert_eq!(limit_buffer_bytes(512 * 1024), 512 << 20);
        assert_eq!(limit_buffer_bytes(512 * 1024 + 1), 576 << 20);
        for kib in [0, 1, 32 * 1024, 480 * 1024, 1 << 20] {
            assert!(2 * limit_buffer_bytes(kib) > kib * 1024, "{kib}");
        }
    }

    #[test]
    fn both_methods_copy_every_byte_on_any_thread_count() {
        for threads in [1, 2, 3] {
            let mut b = LimitBuffers::new(1 << 20, threads);
            b.src.iter_mut().enumerate().for_each(|(i, x)| *x = (i % 253) as u8);
            for method in [CopyMethod::Memcpy, CopyMethod::Streaming] {
                b.dst.fill(0);
                b.pass(method);
                assert!(b.copied(), "{threads} threads, {method:?}");
            }
        }
        let mut tiny = LimitBuffers::new(4096, 4);
        tiny.pass(CopyMethod::Streaming);
        assert!(tiny.copied(), "more threads than pages");
    }

    #[test]
    fn a_measurement_runs_both_methods_and_the_best_is_the_limit() {
        let mut b = LimitBuffers::new(1 << 20, 2);
        let s = b.measure(Duration::ZERO);
        assert_eq!((s.memcpy_bytes, s.streaming_bytes), (1 << 20, 1 << 20), "one pass of each");
        assert!(s.memcpy_gbps() > 0.0 && s.streaming_gbps() > 0.0);
        assert_eq!(s.best_gbps(), s.memcpy_gbps().max(s.streaming_gbps()));
        let mut sum = s;
        sum.add(&s);
        assert_eq!(sum.memcpy_bytes, 2 << 20);
        assert_eq!(sum.memcpy_gbps(), s.memcpy_gbps());
    }
}
