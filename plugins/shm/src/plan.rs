//! The copy plan of one transfer: resolved pieces (source address, destination address, length) and a
//! cursor that hands out chunks of at most `chunk_bytes`, so several workers can share one transfer.
//! Pure bookkeeping: never dereferences an address ([`copy_chunk`] copies through the SDK's region
//! views, on the worker's behalf).

use crate::stream_copy::{copy_streaming_unfenced, store_fence};
use kvgate_abi::sdk::RegionView;
use kvgate_abi::PluginError;

/// One contiguous copy: `len` bytes from the start of `src` to the start of `dst`, both views cut to
/// the segment at submit (so their ranges were checked against their regions there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub src: RegionView,
    pub dst: RegionView,
    pub len: u64,
}

impl Piece {
    /// A piece of `len` bytes that must never be copied (bookkeeping tests).
    #[cfg(test)]
    pub fn unbacked(len: u64) -> Piece {
        // SAFETY: empty views; any copy through them is refused by their bounds check.
        let nowhere = unsafe { RegionView::from_raw_parts(0, 0) };
        Piece { src: nowhere, dst: nowhere, len }
    }
}

/// A run of bytes of a transfer handed to one worker: start at `piece`/`offset`, copy `bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub piece: usize,
    pub offset: u64,
    pub bytes: u64,
}

/// Where the next chunk of a transfer starts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    piece: usize,
    offset: u64,
    started: bool,
}

impl Cursor {
    /// Whether every chunk has been handed out (a transfer of zero bytes hands out one empty chunk,
    /// so that its completion runs through the same path as any other).
    pub fn is_done(&self, pieces: &[Piece]) -> bool {
        self.started && self.piece >= pieces.len()
    }

    /// The next chunk of at most `chunk_bytes` bytes, or `None` once every chunk was handed out.
    pub fn next_chunk(&mut self, pieces: &[Piece], chunk_bytes: u64) -> Option<Chunk> {
        if self.is_done(pieces) {
            return None;
        }
        self.started = true;
        let chunk_start = (self.piece, self.offset);
        let mut left = chunk_bytes;
        while self.piece < pieces.len() && left > 0 {
            let available = pieces[self.piece].len - self.offset;
            let take = available.min(left);
            self.offset += take;
            left -= take;
            if self.offset == pieces[self.piece].len {
                self.piece += 1;
                self.offset = 0;
            }
        }
        while self.piece < pieces.len() && pieces[self.piece].len == 0 {
            self.piece += 1;
        }
        Some(Chunk { piece: chunk_start.0, offset: chunk_start.1, bytes: chunk_bytes - left })
    }
}

/// Copy one chunk, with streaming stores when `streaming` (then fenced before returning, so a
/// completion published afterwards is ordered after every byte). Each piece's views keep their
/// regions mapped for the copy (the worker's ledger hold: the local region cannot be deregistered
/// nor the peer mapping unmapped meanwhile); a range outside its view is refused, never copied.
pub fn copy_chunk(pieces: &[Piece], chunk: Chunk, streaming: bool) -> Result<(), PluginError> {
    let mut piece = chunk.piece;
    let mut offset = chunk.offset;
    let mut left = chunk.bytes;
    let mut result = Ok(());
    while left > 0 && result.is_ok() {
        let p = pieces[piece];
        let take = (p.len - offset).min(left);
        result = if streaming {
            p.src.copy_to_with(offset, &p.dst, offset, take, copy_streaming_unfenced)
        } else {
            p.src.copy_to(offset, &p.dst, offset, take)
        };
        left -= take;
        offset += take;
        if offset == p.len {
            piece += 1;
            offset = 0;
        }
    }
    if streaming {
        store_fence();
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(lens: &[u64]) -> Vec<Piece> {
        lens.iter().map(|&len| Piece::unbacked(len)).collect()
    }

    fn all_chunks(lens: &[u64], chunk_bytes: u64) -> Vec<Chunk> {
        let p = pieces(lens);
        let mut cursor = Cursor::default();
        std::iter::from_fn(|| cursor.next_chunk(&p, chunk_bytes)).collect()
    }

    #[test]
    fn zero_bytes_give_one_empty_chunk() {
        assert_eq!(all_chunks(&[], 10), vec![Chunk { piece: 0, offset: 0, bytes: 0 }]);
        assert_eq!(all_chunks(&[0, 0], 10), vec![Chunk { piece: 0, offset: 0, bytes: 0 }]);
    }

    #[test]
    fn a_large_piece_is_split_at_chunk_bytes() {
        let chunks = all_chunks(&[25], 10);
        assert_eq!(chunks.iter().map(|c| (c.offset, c.bytes)).collect::<Vec<_>>(), vec![(0, 10), (10, 10), (20, 5)]);
    }

    #[test]
    fn small_pieces_are_grouped_and_bytes_add_up() {
        let lens = [3, 0, 4, 5, 0, 1, 9];
        let chunks = all_chunks(&lens, 6);
        assert_eq!(chunks.iter().map(|c| c.bytes).sum::<u64>(), lens.iter().sum::<u64>());
        assert!(chunks.iter().all(|c| c.bytes <= 6 && c.bytes > 0));
        assert_eq!(chunks[0], Chunk { piece: 0, offset: 0, bytes: 6 });
        assert_eq!(chunks[1], Chunk { piece: 2, offset: 3, bytes: 6 });
    }

    #[test]
    fn copy_chunk_copies_exactly_the_chunk() {
        for streaming in [false, true] {
            copy_chunk_copies_exactly_the_chunk_with(streaming);
        }
    }

    fn copy_chunk_copies_exactly_the_chunk_with(streaming: bool) {
        let mut src: Vec<u8> = (0..40u8).collect();
        let mut dst = vec![0xEEu8; 40];
        // SAFETY: both buffers outlive the views, used only in this test.
        let (s, d) = unsafe {
            (
                RegionView::from_raw_parts(src.as_mut_ptr() as usize, 40),
                RegionView::from_raw_parts(dst.as_mut_ptr() as usize, 40),
            )
        };
        let p = vec![
            Piece { src: s.slice(0, 15).unwrap(), dst: d.slice(20, 15).unwrap(), len: 15 },
            Piece { src: s.slice(15, 10).unwrap(), dst: d.slice(0, 10).unwrap(), len: 10 },
        ];
        let mut cursor = Cursor::default();
        let first = cursor.next_chunk(&p, 12).unwrap();
        copy_chunk(&p, first, streaming).unwrap();
        assert_eq!(&dst[20..32], &src[0..12]);
        assert_eq!(dst[32], 0xEE);
        let second = cursor.next_chunk(&p, 12).unwrap();
        copy_chunk(&p, second, streaming).unwrap();
        assert_eq!(&dst[20..35], &src[0..15]);
        assert_eq!(&dst[0..9], &src[15..24]);
        assert_eq!(dst[9], 0xEE);
    }
}
