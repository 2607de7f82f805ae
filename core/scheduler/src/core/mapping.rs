//! Scatter/gather: maps one chunk's source slices onto the part's destination stream, splitting at
//! both sides' slice boundaries, into plugin segments. Pure function of its inputs; it validates
//! nothing about regions (the caller resolved keys and checked ranges) and never allocates twice.

use super::room::DestSlice;
use kvgate_abi::{LocalKey, Segment};

/// A source slice with its local key resolved.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SourceSlice {
    pub key: LocalKey,
    pub offset: u64,
    pub len: u64,
}

/// The chunk needs more segments than allowed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TooManySegments;

/// Map `sources` onto `dest` starting at `(cursor_slice, cursor_offset)`, into `segments` (an empty
/// buffer, possibly reused). The caller guarantees the destination has room for every source byte.
/// Returns the segments and the new cursor. `source_count` sizes the output (sources are usually
/// resolved on the fly, not collected).
pub(crate) fn map_chunk(
    sources: impl IntoIterator<Item = SourceSlice>,
    source_count: usize,
    dest: &[DestSlice],
    cursor_slice: u32,
    cursor_offset: u64,
    max_segments: u64,
    mut segments: Vec<Segment>,
) -> Result<(Vec<Segment>, u32, u64), TooManySegments> {
    debug_assert!(segments.is_empty());
    segments.reserve(source_count.min(max_segments as usize) + 1);
    let mut dest_index = cursor_slice as usize;
    let mut dest_offset = cursor_offset;
    for source in sources {
        let mut source_offset = 0u64;
        while source_offset < source.len {
            let target = &dest[dest_index];
            let dest_left = target.len - dest_offset;
            let len = dest_left.min(source.len - source_offset);
            if segments.len() as u64 >= max_segments {
                return Err(TooManySegments);
            }
            segments.push(Segment {
                local: source.key,
                local_offset: source.offset + source_offset,
                remote: target.key,
                remote_offset: target.offset + dest_offset,
                len,
            });
            source_offset += len;
            dest_offset += len;
            if dest_offset == target.len {
                dest_index += 1;
                dest_offset = 0;
            }
        }
    }
    Ok((segments, dest_index as u32, dest_offset))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_abi::RemoteKey;

    fn src(offset: u64, len: u64) -> SourceSlice {
        SourceSlice { key: LocalKey(1), offset, len }
    }
    fn dst(offset: u64, len: u64) -> DestSlice {
        DestSlice { key: RemoteKey(2), offset, len }
    }

    #[test]
    fn splits_at_both_sides_boundaries() {
        let dest = [dst(100, 10), dst(500, 5)];
        let (segments, slice, offset) = map_chunk([src(0, 4), src(50, 8)], 2, &dest, 0, 0, 10, Vec::new()).unwrap();
        let shape: Vec<(u64, u64, u64)> = segments.iter().map(|s| (s.local_offset, s.remote_offset, s.len)).collect();
        assert_eq!(shape, vec![(0, 100, 4), (50, 104, 6), (56, 500, 2)]);
        assert_eq!((slice, offset), (1, 2));
        let (segments, slice, offset) = map_chunk([src(7, 3)], 1, &dest, slice, offset, 10, Vec::new()).unwrap();
        assert_eq!((segments[0].remote_offset, segments[0].len), (502, 3));
        assert_eq!((slice, offset), (2, 0));
    }

    #[test]
    fn refuses_past_max_segments_and_accepts_at_it() {
        let dest = [dst(0, 1), dst(10, 1), dst(20, 1)];
        assert!(map_chunk([src(0, 3)], 1, &dest, 0, 0, 3, Vec::new()).is_ok());
        assert_eq!(map_chunk([src(0, 3)], 1, &dest, 0, 0, 2, Vec::new()), Err(TooManySegments));
    }
}

/// Where byte `at` of a part's destination stream (its slices concatenated) lies: the slice index and
/// the offset in it. `at` must be below the stream's length.
pub(crate) fn stream_position(dest: &[DestSlice], at: u64) -> (u32, u64) {
    let mut start = 0u64;
    for (index, slice) in dest.iter().enumerate() {
        if at < start + slice.len {
            return (index as u32, at - start);
        }
        start += slice.len;
    }
    debug_assert!(false, "byte {at} past the stream's {start} bytes");
    (dest.len() as u32, 0)
}

/// Put `[start, end)` into the sorted, non-overlapping `ranges` at `index` (the first range ending
/// after `start`; the caller checked it does not overlap), merging it with touching neighbours.
pub(crate) fn insert_range(ranges: &mut Vec<(u64, u64)>, index: usize, start: u64, end: u64) {
    let merges_next = ranges.get(index).is_some_and(|&(s, _)| s == end);
    let merges_prev = index > 0 && ranges[index - 1].1 == start;
    match (merges_prev, merges_next) {
        (true, true) => {
            ranges[index - 1].1 = ranges[index].1;
            ranges.remove(index);
        }
        (true, false) => ranges[index - 1].1 = end,
        (false, true) => ranges[index].0 = start,
        (false, false) => ranges.insert(index, (start, end)),
    }
}

#[cfg(test)]
mod placement_tests {
    use super::*;
    use kvgate_abi::RemoteKey;

    #[test]
    fn a_stream_position_is_found_in_the_slice_that_holds_the_byte() {
        let dest = [
            DestSlice { key: RemoteKey(1), offset: 100, len: 10 },
            DestSlice { key: RemoteKey(1), offset: 500, len: 5 },
        ];
        assert_eq!(stream_position(&dest, 0), (0, 0));
        assert_eq!(stream_position(&dest, 9), (0, 9));
        assert_eq!(stream_position(&dest, 10), (1, 0));
        assert_eq!(stream_position(&dest, 14), (1, 4));
    }

    #[test]
    fn ranges_stay_sorted_and_merge_with_touching_neighbours() {
        let mut r = Vec::new();
        let put = |r: &mut Vec<(u64, u64)>, s: u64, e: u64| {
            let i = r.partition_point(|&(_, end)| end <= s);
            insert_range(r, i, s, e);
        };
        put(&mut r, 10, 20);
        put(&mut r, 30, 40);
        assert_eq!(r, [(10, 20), (30, 40)]);
        put(&mut r, 0, 5);
        put(&mut r, 20, 30);
        assert_eq!(r, [(0, 5), (10, 40)]);
        put(&mut r, 5, 10);
        assert_eq!(r, [(0, 40)]);
        put(&mut r, 40, 41);
        assert_eq!(r, [(0, 41)]);
    }
}
