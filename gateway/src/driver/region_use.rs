//! Which rooms hold which local regions: a room holds every region its accepted expect (destination)
//! or send (source) names, from the moment the core accepts the call until the room's `Reusable`
//! event (no byte can land in, or be read from, its memory any more). `UnregisterMemory` of a held
//! region is refused (`region_in_use`) naming the rooms. Never decides a room's fate.

use kvgate_core::{Role, RoomKey, Slice};
// Keyed by engine-chosen room ids, touched several times per room: foldhash (randomly seeded).
use foldhash::{HashMap, HashSet};

/// How many holders a refusal names (the count is always given).
pub const REGION_USERS_NAMED: usize = 4;

#[derive(Default)]
pub struct RegionUse {
    /// The distinct regions each holding room names (most rooms name one or two).
    by_room: HashMap<(RoomKey, Role), Vec<u64>>,
    by_region: HashMap<u64, HashSet<(RoomKey, Role)>>,
}

impl RegionUse {
    /// The room now holds every region `slices` name (a region it holds already is not counted twice).
    pub fn hold<'a>(&mut self, room: RoomKey, role: Role, slices: impl IntoIterator<Item = &'a Slice>) {
        let held = self.by_room.entry((room, role)).or_default();
        for slice in slices {
            let region = slice.region.0;
            if !held.contains(&region) {
                held.push(region);
                self.by_region.entry(region).or_default().insert((room, role));
            }
        }
    }

    /// The room's memory is reusable: it holds nothing any more.
    pub fn release(&mut self, room: RoomKey, role: Role) {
        let Some(held) = self.by_room.remove(&(room, role)) else { return };
        for region in held {
            if let Some(users) = self.by_region.get_mut(&region) {
                users.remove(&(room, role));
                if users.is_empty() {
                    self.by_region.remove(&region);
                }
            }
        }
    }

    /// The rooms holding `region`: how many, and up to `REGION_USERS_NAMED` of them (lowest room ids
    /// first, so the message is stable).
    pub fn users(&self, region: u64) -> Option<(usize, Vec<(RoomKey, Role)>)> {
        let users = self.by_region.get(&region)?;
        let mut named: Vec<(RoomKey, Role)> = users.iter().copied().collect();
        named.sort();
        named.truncate(REGION_USERS_NAMED);
        Some((users.len(), named))
    }

    /// Rooms holding at least one region.
    #[cfg(test)]
    pub fn holders(&self) -> usize {
        self.by_room.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::RegionId;

    fn s(region: u64) -> Slice {
        Slice::new(RegionId(region), 0, 16)
    }

    #[test]
    fn a_region_is_held_until_every_room_naming_it_is_reusable() {
        let mut use_ = RegionUse::default();
        let (a, b) = (RoomKey::new(1, 0), RoomKey::new(2, 0));
        use_.hold(a, Role::Receiver, &[s(7), s(7), s(8)]);
        use_.hold(b, Role::Sender, &[s(7)]);
        assert_eq!(use_.users(7).unwrap().0, 2);
        assert_eq!(use_.users(8).unwrap(), (1, vec![(a, Role::Receiver)]));
        use_.release(a, Role::Receiver);
        assert!(use_.users(8).is_none());
        assert_eq!(use_.users(7).unwrap(), (1, vec![(b, Role::Sender)]));
        // A later chunk of the same room adds only what it did not hold.
        use_.hold(b, Role::Sender, &[s(7), s(9)]);
        use_.release(b, Role::Sender);
        assert!(use_.users(7).is_none() && use_.users(9).is_none());
        assert_eq!(use_.holders(), 0);
        // Releasing a room that held nothing is harmless.
        use_.release(a, Role::Receiver);
    }

    #[test]
    fn a_refusal_names_at_most_the_first_few_rooms_by_id() {
        let mut use_ = RegionUse::default();
        for room in (0..10).rev() {
            use_.hold(RoomKey::new(room, 0), Role::Receiver, &[s(3)]);
        }
        let (count, named) = use_.users(3).unwrap();
        assert_eq!(count, 10);
        assert_eq!(named.iter().map(|(k, _)| k.room).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    }
}
