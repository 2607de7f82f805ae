//! The progress thread's deadlines: a min-heap of `(when, transfer)` whose entries for finished
//! transfers are dropped in bulk once they outnumber the live ones, so its size follows the live
//! transfers, not the transfer rate times the deadline. Owns no transfer state; never fires anything.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// Stale entries tolerated above twice the live transfers before the heap is rebuilt without them
/// (each transfer has at most two entries: its deadline and, once cancelled, its quiesce bound).
pub const STALE_DEADLINES_FLOOR: usize = 4_096;

#[derive(Default)]
pub struct DeadlineHeap {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
}

impl DeadlineHeap {
    pub fn push(&mut self, at: Instant, xfer: u64) {
        self.heap.push(Reverse((at, xfer)));
    }

    /// The earliest entry, live or not.
    pub fn peek(&self) -> Option<(Instant, u64)> {
        self.heap.peek().map(|Reverse(e)| *e)
    }

    pub fn pop(&mut self) {
        self.heap.pop();
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// After a transfer is forgotten: once the heap holds more than `STALE_DEADLINES_FLOOR` entries
    /// beyond twice the `live` transfers, keep only the entries `is_live` accepts (amortised O(1)
    /// per forgotten transfer: a rebuild follows at least `STALE_DEADLINES_FLOOR` forgotten ones).
    pub fn drop_stale(&mut self, live: usize, is_live: impl Fn(u64) -> bool) -> bool {
        if self.heap.len() <= STALE_DEADLINES_FLOOR + 2 * live {
            return false;
        }
        self.heap.retain(|Reverse((_, xfer))| is_live(*xfer));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_heap_is_rebuilt_just_past_its_floor_and_keeps_live_entries_in_order() {
        let t0 = Instant::now();
        let mut heap = DeadlineHeap::default();
        let live = [7u64, 3];
        for xfer in 0..(STALE_DEADLINES_FLOOR as u64 + 4) {
            heap.push(t0 + Duration::from_millis(1_000 - xfer % 1_000), xfer);
        }
        // At the limit: floor + 2 x live entries stay untouched.
        assert!(!heap.drop_stale(2, |x| live.contains(&x)));
        assert_eq!(heap.len(), STALE_DEADLINES_FLOOR + 4);
        heap.push(t0, 99);
        // Just past it: only the live transfers' entries remain, earliest first.
        assert!(heap.drop_stale(2, |x| live.contains(&x)));
        assert_eq!(heap.len(), 2);
        assert_eq!(heap.peek(), Some((t0 + Duration::from_millis(993), 7)));
        heap.pop();
        assert_eq!(heap.peek(), Some((t0 + Duration::from_millis(997), 3)));
        heap.pop();
        assert!(heap.is_empty());
    }

    #[test]
    fn a_steady_stream_of_short_transfers_keeps_the_heap_bounded() {
        let t0 = Instant::now();
        let mut heap = DeadlineHeap::default();
        let mut most = 0;
        // 200 000 transfers with a 60 s deadline, 8 live at a time, each forgotten long before it.
        for xfer in 0..200_000u64 {
            heap.push(t0 + Duration::from_secs(60), xfer);
            let oldest_live = xfer.saturating_sub(7);
            heap.drop_stale(8, |x| x >= oldest_live);
            most = most.max(heap.len());
        }
        assert!(most <= STALE_DEADLINES_FLOOR + 2 * 8 + 1, "{most} entries");
    }
}
