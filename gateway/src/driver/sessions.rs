//! Engine sessions: an engine opens one by name (`OpenSession`), and the regions it registers and the
//! rooms it expects or sends into under it (calls carrying `kvgate-session` metadata) belong to it.
//! A session is attached while at least one of its `Watch` streams is open. When it ends (closed, or
//! detached for longer than `engine_api.session_grace_ms`), its live rooms fail `engine_lost` (peers
//! told) and its regions are released once no room holds them. An engine that opens the same name
//! again within the grace resumes the session. Plain bookkeeping: the driver acts on what it returns.

use kvgate_core::{At, Role, RoomKey, Span};
use std::collections::BTreeSet;
// Keyed by engine-chosen room ids, touched on every room: foldhash (randomly seeded).
use foldhash::{HashMap, HashSet};

/// The metadata key engine calls carry their session id in.
pub const SESSION_METADATA_KEY: &str = "kvgate-session";

pub struct Session {
    pub name: String,
    pub rooms: HashSet<(RoomKey, Role)>,
    pub regions: BTreeSet<u64>,
    /// Open `Watch` streams of the session.
    attached: u32,
    /// Since when no stream is open (a new session starts detached: it must attach within the grace).
    detached_at: Option<At>,
}

/// Why a session call was refused (reason code, message).
pub type SessionRefusal = (&'static str, String);

#[derive(Default)]
pub struct Sessions {
    by_id: HashMap<u64, Session>,
    by_name: HashMap<String, u64>,
    room_owner: HashMap<(RoomKey, Role), u64>,
}

impl Sessions {
    /// Open `name`, or resume it when it exists and has no stream open. Returns `(id, resumed)`.
    pub fn open(&mut self, name: &str, now: At, max_sessions: u64) -> Result<(u64, bool), SessionRefusal> {
        if let Some(&id) = self.by_name.get(name) {
            let session = self.by_id.get_mut(&id).expect("by_name names held sessions");
            if session.attached > 0 {
                return Err((
                    "session_in_use",
                    format!("session {name:?} has a Watch stream open: one engine per session name"),
                ));
            }
            session.detached_at = Some(now);
            return Ok((id, true));
        }
        if self.by_id.len() as u64 >= max_sessions {
            return Err((
                "too_many_sessions",
                format!("engine_api.max_sessions = {max_sessions} sessions are open already"),
            ));
        }
        // Random, never reused: an id kept from a previous gateway process (or a closed session)
        // cannot name someone else's session.
        let id = loop {
            let id: u64 = rand::random::<u64>() >> 11; // below 2^53: exact in JSON and every language's numbers
            if id != 0 && !self.by_id.contains_key(&id) {
                break id;
            }
        };
        let session = Session {
            name: name.to_string(),
            rooms: HashSet::default(),
            regions: BTreeSet::new(),
            attached: 0,
            detached_at: Some(now),
        };
        self.by_id.insert(id, session);
        self.by_name.insert(name.to_string(), id);
        Ok((id, false))
    }

    /// Whether `id` is an open session.
    pub fn check(&self, id: u64) -> Result<(), SessionRefusal> {
        match self.by_id.contains_key(&id) {
            true => Ok(()),
            false => Err((
                "unknown_session",
                format!("session {id} is not open (closed, or ended after its grace): open it again"),
            )),
        }
    }

    pub fn name(&self, id: u64) -> Option<&str> {
        self.by_id.get(&id).map(|s| s.name.as_str())
    }

    pub fn attach(&mut self, id: u64) -> Result<(), SessionRefusal> {
        self.check(id)?;
        let session = self.by_id.get_mut(&id).expect("checked");
        session.attached += 1;
        session.detached_at = None;
        Ok(())
    }

    pub fn detach(&mut self, id: u64, now: At) {
        if let Some(session) = self.by_id.get_mut(&id) {
            session.attached = session.attached.saturating_sub(1);
            if session.attached == 0 {
                session.detached_at = Some(now);
            }
        }
    }

    pub fn own_region(&mut self, id: u64, region: u64) {
        if let Some(session) = self.by_id.get_mut(&id) {
            session.regions.insert(region);
        }
    }

    /// The engine unregistered the region itself.
    pub fn disown_region(&mut self, region: u64) {
        for session in self.by_id.values_mut() {
            session.regions.remove(&region);
        }
    }

    pub fn own_room(&mut self, id: u64, room: RoomKey, role: Role) {
        if let Some(session) = self.by_id.get_mut(&id) {
            if session.rooms.insert((room, role)) {
                self.room_owner.insert((room, role), id);
            }
        }
    }

    /// The room is over and reusable: nobody needs to end it any more.
    pub fn room_reusable(&mut self, room: RoomKey, role: Role) {
        if let Some(id) = self.room_owner.remove(&(room, role)) {
            if let Some(session) = self.by_id.get_mut(&id) {
                session.rooms.remove(&(room, role));
            }
        }
    }

    /// Sessions detached for longer than `grace`.
    pub fn expired(&self, now: At, grace: Span) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .by_id
            .iter()
            .filter(|(_, s)| s.detached_at.is_some_and(|at| now.saturating_since(at) > grace))
            .map(|(id, _)| *id)
            .collect();
        ids.sort();
        ids
    }

    /// Remove the session; the caller ends its rooms and releases its regions.
    pub fn end(&mut self, id: u64) -> Option<Session> {
        let session = self.by_id.remove(&id)?;
        self.by_name.remove(&session.name);
        for key in &session.rooms {
            self.room_owner.remove(key);
        }
        Some(session)
    }

    /// Open sessions.
    pub fn count(&self) -> usize {
        self.by_id.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Span = Span(1_000);

    #[test]
    fn a_session_must_attach_within_its_grace_and_ends_a_grace_after_its_last_stream_closes() {
        let mut s = Sessions::default();
        let (id, resumed) = s.open("prefill-rank-3", At(0), 8).unwrap();
        assert!(!resumed);
        assert!(s.expired(At(1_000), GRACE).is_empty(), "at the grace it is still open");
        assert_eq!(s.expired(At(1_001), GRACE), [id], "just past it, it has ended");
        s.attach(id).unwrap();
        s.attach(id).unwrap();
        s.detach(id, At(5_000));
        assert!(s.expired(At(100_000), GRACE).is_empty(), "one stream still open");
        s.detach(id, At(6_000));
        assert!(s.expired(At(7_000), GRACE).is_empty());
        assert_eq!(s.expired(At(7_001), GRACE), [id]);
    }

    #[test]
    fn the_same_name_resumes_a_detached_session_and_is_refused_while_attached() {
        let mut s = Sessions::default();
        let (id, _) = s.open("decode-0", At(0), 8).unwrap();
        s.own_region(id, 4);
        s.attach(id).unwrap();
        assert_eq!(s.open("decode-0", At(1), 8).unwrap_err().0, "session_in_use");
        s.detach(id, At(10));
        assert_eq!(s.open("decode-0", At(500), 8).unwrap(), (id, true));
        // Resuming restarts the grace.
        assert!(s.expired(At(1_400), GRACE).is_empty());
        let ended = s.end(id).unwrap();
        assert_eq!(ended.regions.into_iter().collect::<Vec<_>>(), [4]);
        assert_eq!(s.check(id).unwrap_err().0, "unknown_session");
        assert!(!s.open("decode-0", At(2_000), 8).unwrap().1, "a fresh session after the end");
    }

    #[test]
    fn rooms_leave_their_session_when_reusable_and_the_session_count_is_bounded() {
        let mut s = Sessions::default();
        let (id, _) = s.open("a", At(0), 2).unwrap();
        let room = RoomKey::new(9, 1);
        s.own_room(id, room, Role::Sender);
        s.own_room(id, RoomKey::new(10, 0), Role::Receiver);
        s.room_reusable(room, Role::Sender);
        let (b, _) = s.open("b", At(0), 2).unwrap();
        assert_eq!(s.open("c", At(0), 2).unwrap_err().0, "too_many_sessions");
        assert_eq!(s.count(), 2);
        let ended = s.end(id).unwrap();
        assert_eq!(ended.rooms.into_iter().collect::<Vec<_>>(), [(RoomKey::new(10, 0), Role::Receiver)]);
        assert!(s.end(b).is_some());
    }
}
