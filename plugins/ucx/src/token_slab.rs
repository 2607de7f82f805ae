//! Books keyed by the token a UCX completion callback hands back: a slab whose token is the slot's
//! index with the slot's generation, so a completion finds its entry without hashing, and a token
//! of an entry already removed finds nothing even once its slot is reused. Owns only the storage.

/// Bits of a token that carry the slot index (the low 32); the generation takes the next 30, so the
/// two top bits of a token are always clear for callers' tags.
const INDEX_BITS: u32 = 32;
const GENERATION_MASK: u64 = (1 << 30) - 1;

struct Slot<T> {
    generation: u64,
    value: Option<T>,
}

pub struct TokenSlab<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
}

impl<T> Default for TokenSlab<T> {
    fn default() -> Self {
        TokenSlab { slots: Vec::new(), free: Vec::new(), live: 0 }
    }
}

impl<T> TokenSlab<T> {
    /// Store `value`; its token (never with either of the two top bits set).
    pub fn insert(&mut self, value: T) -> u64 {
        let index = match self.free.pop() {
            Some(index) => index,
            None => {
                let index = u32::try_from(self.slots.len()).expect("fewer than 2^32 entries live at once");
                self.slots.push(Slot { generation: 0, value: None });
                index
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.value = Some(value);
        self.live += 1;
        (slot.generation << INDEX_BITS) | index as u64
    }

    fn slot(&mut self, token: u64) -> Option<&mut Slot<T>> {
        let slot = self.slots.get_mut((token & u32::MAX as u64) as usize)?;
        (slot.generation == token >> INDEX_BITS && slot.value.is_some()).then_some(slot)
    }

    pub fn get_mut(&mut self, token: u64) -> Option<&mut T> {
        self.slot(token)?.value.as_mut()
    }

    /// Take the entry out; its token then finds nothing, whatever the slot holds next.
    pub fn remove(&mut self, token: u64) -> Option<T> {
        let slot = self.slot(token)?;
        let value = slot.value.take();
        slot.generation = (slot.generation + 1) & GENERATION_MASK;
        self.free.push((token & u32::MAX as u64) as u32);
        self.live -= 1;
        value
    }

    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|s| s.value.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_finds_its_entry_until_removed() {
        let mut slab = TokenSlab::default();
        let a = slab.insert("a");
        let b = slab.insert("b");
        assert_ne!(a, b);
        assert_eq!(slab.len(), 2);
        assert_eq!(slab.get_mut(b).copied(), Some("b"));
        assert_eq!(slab.remove(a), Some("a"));
        assert_eq!(slab.remove(a), None, "removed twice");
        assert_eq!(slab.get_mut(a), None);
        assert_eq!(slab.values().copied().collect::<Vec<_>>(), vec!["b"]);
        assert_eq!(slab.len(), 1);
        assert!(!slab.is_empty());
        slab.remove(b);
        assert!(slab.is_empty());
    }

    #[test]
    fn a_stale_token_misses_the_slot_reused_after_it() {
        let mut slab = TokenSlab::default();
        let old = slab.insert(1);
        slab.remove(old);
        let new = slab.insert(2);
        assert_eq!(new & u32::MAX as u64, old & u32::MAX as u64, "the slot is reused");
        assert_eq!(slab.remove(old), None);
        assert_eq!(slab.get_mut(new).copied(), Some(2));
    }

    #[test]
    fn tokens_keep_the_two_top_bits_clear_as_generations_wrap() {
        let mut slab = TokenSlab::default();
        let first = slab.insert(());
        slab.remove(first);
        slab.slots[0].generation = GENERATION_MASK;
        let last = slab.insert(());
        assert_eq!(last >> 62, 0);
        assert_eq!(last >> INDEX_BITS, GENERATION_MASK);
        slab.remove(last);
        let wrapped = slab.insert(());
        assert_eq!(wrapped >> INDEX_BITS, 0, "the generation wraps to zero");
        assert_eq!(wrapped >> 62, 0);
    }

    #[test]
    fn an_unknown_index_finds_nothing() {
        let mut slab: TokenSlab<u8> = TokenSlab::default();
        assert_eq!(slab.get_mut(7), None);
        assert_eq!(slab.remove(u64::MAX >> 2), None);
    }
}
