//! Spare `Vec`s the progress thread reuses on its hot path (active-message headers UCX reads until
//! a send completes, the request tokens of each transfer), so a steady stream of transfers allocates
//! none of them. Bounded in how many it keeps and how large a kept one may be.

pub struct VecPool<T> {
    spare: Vec<Vec<T>>,
    /// Most spare vectors kept; more are freed.
    max_spare: usize,
    /// A vector that grew past this many elements is freed rather than kept.
    max_capacity: usize,
}

impl<T> VecPool<T> {
    pub fn new(max_spare: usize, max_capacity: usize) -> VecPool<T> {
        VecPool { spare: Vec::new(), max_spare, max_capacity }
    }

    /// An empty vector, with a kept allocation when there is one.
    pub fn take(&mut self) -> Vec<T> {
        self.spare.pop().unwrap_or_default()
    }

    /// Hand a vector back for reuse (emptied here).
    pub fn give(&mut self, mut v: Vec<T>) {
        let capacity = v.capacity();
        if capacity == 0 || capacity > self.max_capacity || self.spare.len() >= self.max_spare {
            return;
        }
        v.clear();
        self.spare.push(v);
    }

    #[cfg(test)]
    fn spare(&self) -> usize {
        self.spare.len()
    }
}

#[cfg(test)]
mod tests {
    use super::VecPool;

    #[test]
    fn a_given_vector_comes_back_empty_with_its_allocation() {
        let mut pool = VecPool::new(4, 64);
        let mut v = pool.take();
        assert_eq!(v.capacity(), 0, "an empty pool hands out an unallocated vector");
        v.extend_from_slice(&[1u8, 2, 3]);
        let address = v.as_ptr();
        pool.give(v);
        let again = pool.take();
        assert!(again.is_empty());
        assert_eq!(again.as_ptr(), address, "the kept allocation is reused");
        assert_eq!(pool.spare(), 0);
    }

    #[test]
    fn keeps_at_most_max_spare_vectors() {
        let mut pool = VecPool::new(2, 64);
        for _ in 0..3 {
            pool.give(vec![0u64; 4]);
        }
        assert_eq!(pool.spare(), 2, "the third is freed");
    }

    #[test]
    fn frees_vectors_past_max_capacity_and_unallocated_ones() {
        let mut pool = VecPool::new(8, 64);
        pool.give(Vec::<u8>::with_capacity(64));
        assert_eq!(pool.spare(), 1, "at max_capacity it is kept");
        pool.give(Vec::<u8>::with_capacity(65));
        assert_eq!(pool.spare(), 1, "just past max_capacity it is freed");
        pool.give(Vec::<u8>::new());
        assert_eq!(pool.spare(), 1, "an unallocated vector is not worth keeping");
    }
}
