//! Reusable staging buffers for outgoing stream data: a buffer handed to quinn comes back here when
//! quinn drops it (acknowledged or abandoned), so steady sending touches no fresh pages. Owns only
//! memory it allocated; never holds more idle bytes than `staging_pool_bytes`.

use bytes::Bytes;
use std::sync::{Arc, Mutex};

/// Room past a buffer's class size for frame headers: a part of one class-sized segment (PART_BEGIN,
/// SEGMENT and PART_END frames, 75 bytes) fits in one buffer of its class.
pub const HEADER_ROOM_BYTES: usize = 128;

/// Smallest chunk class: a lane smaller than this still gets a buffer of this size.
pub const SMALLEST_CHUNK_BYTES: usize = 4096;

/// Idle buffers by size class: class `k` holds chunks of `min(4096 << k, chunk_bytes)` bytes, so a
/// small lane does not pin a whole `write_chunk_bytes` buffer while quinn holds it.
pub struct StagingPool {
    idle: Mutex<Idle>,
    /// The largest chunk (`write_chunk_bytes`).
    chunk_bytes: usize,
    /// Most idle bytes kept (`staging_pool_bytes`); buffers beyond are freed.
    max_idle_bytes: u64,
}

struct Idle {
    by_class: Vec<Vec<Vec<u8>>>,
    bytes: u64,
}

/// One filled buffer on its way through quinn; returns to its pool when quinn drops it.
struct Staged {
    buf: Vec<u8>,
    pool: Arc<StagingPool>,
}

impl AsRef<[u8]> for Staged {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.buf));
    }
}

impl StagingPool {
    pub fn new(chunk_bytes: usize, max_idle_bytes: u64) -> Arc<StagingPool> {
        let chunk_bytes = chunk_bytes.max(SMALLEST_CHUNK_BYTES);
        let mut classes = 1;
        while Self::class_chunk(chunk_bytes, classes - 1) < chunk_bytes {
            classes += 1;
        }
        Arc::new(StagingPool {
            idle: Mutex::new(Idle { by_class: vec![Vec::new(); classes], bytes: 0 }),
            chunk_bytes,
            max_idle_bytes,
        })
    }

    fn class_chunk(chunk_bytes: usize, class: usize) -> usize {
        SMALLEST_CHUNK_BYTES.checked_shl(class as u32).unwrap_or(usize::MAX).min(chunk_bytes)
    }

    fn capacity_of(chunk: usize) -> usize {
        chunk + HEADER_ROOM_BYTES
    }

    /// An empty buffer for `wanted` bytes (frames and payload): the smallest class whose buffer holds
    /// them, or the `chunk_bytes` class for more. An idle one when there is one.
    pub fn take(&self, wanted: usize) -> Vec<u8> {
        let wanted_chunk = wanted.saturating_sub(HEADER_ROOM_BYTES).min(self.chunk_bytes);
        let mut class = 0;
        while Self::class_chunk(self.chunk_bytes, class) < wanted_chunk {
            class += 1;
        }
        let chunk = Self::class_chunk(self.chunk_bytes, class);
        let mut idle = self.idle.lock().expect("staging pool lock");
        match idle.by_class[class].pop() {
            Some(buf) => {
                idle.bytes -= buf.capacity() as u64;
                buf
            }
            None => Vec::with_capacity(Self::capacity_of(chunk)),
        }
    }

    /// The size class of a buffer from `take`.
    pub fn class_bytes(buf: &Vec<u8>) -> usize {
        buf.capacity().saturating_sub(HEADER_ROOM_BYTES)
    }

    fn give_back(&self, mut buf: Vec<u8>) {
        let mut idle = self.idle.lock().expect("staging pool lock");
        // Only buffers of a class size are kept (a grown one would not fit its class).
        let Some(class) = (0..idle.by_class.len())
            .find(|&k| Self::capacity_of(Self::class_chunk(self.chunk_bytes, k)) == buf.capacity())
        else {
            return;
        };
        if idle.bytes + buf.capacity() as u64 > self.max_idle_bytes {
            return;
        }
        buf.clear();
        idle.bytes += buf.capacity() as u64;
        idle.by_class[class].push(buf);
    }

    /// Hand a filled buffer to quinn without copying it; it comes back when the last `Bytes` is dropped.
    pub fn freeze(self: &Arc<Self>, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Staged { buf, pool: self.clone() })
    }

    /// (idle buffers, idle bytes) right now.
    pub fn idle(&self) -> (usize, u64) {
        let idle = self.idle.lock().expect("staging pool lock");
        (idle.by_class.iter().map(Vec::len).sum(), idle.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_buffer_returns_and_is_reused() {
        let pool = StagingPool::new(65536, 1 << 20);
        let mut buf = pool.take(65536);
        assert_eq!(StagingPool::class_bytes(&buf), 65536);
        buf.extend_from_slice(&[1, 2, 3]);
        let ptr = buf.as_ptr();
        let bytes = pool.freeze(buf);
        assert_eq!(&bytes[..], &[1, 2, 3]);
        assert_eq!(pool.idle().0, 0);
        let slice = bytes.slice(1..);
        drop(bytes);
        assert_eq!(pool.idle().0, 0, "a slice still holds the buffer");
        drop(slice);
        assert_eq!(pool.idle(), (1, (65536 + HEADER_ROOM_BYTES) as u64));
        let again = pool.take(40_000);
        assert_eq!(again.as_ptr(), ptr);
        assert!(again.is_empty());
    }

    #[test]
    fn a_small_part_gets_a_small_buffer() {
        let pool = StagingPool::new(1 << 20, 1 << 30);
        assert_eq!(StagingPool::class_bytes(&pool.take(1)), 4096);
        assert_eq!(StagingPool::class_bytes(&pool.take(4096 + HEADER_ROOM_BYTES)), 4096);
        assert_eq!(StagingPool::class_bytes(&pool.take(4097 + HEADER_ROOM_BYTES)), 8192);
        // A 64 KiB part with its three frames (75 bytes) fits in the 64 KiB class.
        assert_eq!(StagingPool::class_bytes(&pool.take(65536 + 75)), 65536);
        assert_eq!(StagingPool::class_bytes(&pool.take(65536 + HEADER_ROOM_BYTES + 1)), 131072);
        assert_eq!(StagingPool::class_bytes(&pool.take(1 << 20)), 1 << 20);
        assert_eq!(StagingPool::class_bytes(&pool.take(usize::MAX)), 1 << 20);
        // A chunk size between classes is the last class.
        let pool = StagingPool::new(100_000, 1 << 30);
        assert_eq!(StagingPool::class_bytes(&pool.take(70_000)), 100_000);
        assert_eq!(StagingPool::class_bytes(&pool.take(usize::MAX)), 100_000);
    }

    #[test]
    fn idle_bytes_stay_within_the_pool_bytes() {
        let size = (4096 + HEADER_ROOM_BYTES) as u64;
        // At the limit: two buffers fit; the third is freed.
        let pool = StagingPool::new(4096, 2 * size);
        let all: Vec<Bytes> = (0..3).map(|_| pool.freeze(pool.take(4096))).collect();
        drop(all);
        assert_eq!(pool.idle(), (2, 2 * size));
        // Just past it: one byte less holds only one buffer.
        let pool = StagingPool::new(4096, 2 * size - 1);
        let all: Vec<Bytes> = (0..3).map(|_| pool.freeze(pool.take(4096))).collect();
        drop(all);
        assert_eq!(pool.idle(), (1, size));
        // Zero keeps nothing.
        let pool = StagingPool::new(4096, 0);
        drop(pool.freeze(pool.take(4096)));
        assert_eq!(pool.idle(), (0, 0));
    }

    #[test]
    fn a_grown_buffer_is_not_kept() {
        let pool = StagingPool::new(4096, 1 << 20);
        let mut buf = pool.take(4096);
        buf.extend_from_slice(&[0u8; 8192]);
        drop(pool.freeze(buf));
        assert_eq!(pool.idle(), (0, 0));
    }
}
