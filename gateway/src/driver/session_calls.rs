//! The driver's side of engine sessions (`sessions.rs` keeps the books): opening, attaching and
//! closing them, ending those detached past `engine_api.session_grace_ms` (their live rooms fail
//! `engine_lost`), and releasing an ended session's regions as soon as no room holds them. Every end
//! is logged with what it did.

use super::Driver;
use crate::channels::{ApiError, SessionEnd};
use kvgate_core::Span;

/// Longest session name.
pub const MAX_SESSION_NAME_BYTES: usize = 128;

fn refused((reason, message): (&'static str, String)) -> ApiError {
    let code = match reason {
        "unknown_session" => tonic::Code::NotFound,
        "too_many_sessions" => tonic::Code::ResourceExhausted,
        _ => tonic::Code::FailedPrecondition,
    };
    ApiError::new(code, reason, message)
}

impl Driver {
    pub(super) fn open_session(&mut self, name: &str) -> Result<(u64, bool), ApiError> {
        let valid = !name.is_empty()
            && name.len() <= MAX_SESSION_NAME_BYTES
            && name.chars().all(|c| c.is_ascii_alphanumeric() || "._:-".contains(c));
        if !valid {
            return Err(ApiError::invalid(
                "invalid_session_name",
                format!("a session name is 1..={MAX_SESSION_NAME_BYTES} characters of [A-Za-z0-9._:-]"),
            ));
        }
        let now = self.now();
        let (id, resumed) = self.sessions.open(name, now, self.config.engine_api.max_sessions).map_err(refused)?;
        tracing::info!(session = id, name, resumed, "engine session opened");
        Ok((id, resumed))
    }

    /// A call names `session`: it must be open.
    pub(super) fn check_session(&self, session: Option<u64>) -> Result<(), ApiError> {
        match session {
            Some(id) => self.sessions.check(id).map_err(refused),
            None => Ok(()),
        }
    }

    pub(super) fn attach_session(&mut self, id: u64) -> Result<(), ApiError> {
        self.sessions.attach(id).map_err(refused)
    }

    pub(super) fn detach_session(&mut self, id: u64) {
        let now = self.now();
        self.sessions.detach(id, now);
    }

    pub(super) fn close_session(&mut self, id: u64) -> Result<SessionEnd, ApiError> {
        self.sessions.check(id).map_err(refused)?;
        Ok(self.end_session(id, "closed by its engine"))
    }

    pub(super) fn end_expired_sessions(&mut self) {
        let grace = Span::from_ms(self.config.engine_api.session_grace_ms);
        for id in self.sessions.expired(self.now(), grace) {
            self.end_session(id, "no Watch stream open for engine_api.session_grace_ms");
        }
    }

    /// End a session: its live rooms fail `engine_lost` now; its regions go now if no room holds
    /// them, else as soon as the last one is reusable.
    fn end_session(&mut self, id: u64, why: &str) -> SessionEnd {
        let Some(session) = self.sessions.end(id) else { return SessionEnd::default() };
        let mut end = SessionEnd::default();
        let now = self.now();
        let mut rooms: Vec<_> = session.rooms.into_iter().collect();
        rooms.sort();
        for (room, role) in rooms {
            if self.core.handle_engine_lost(now, room, role) {
                end.rooms_ended += 1;
            }
        }
        // The failures' events (and any quarantine that ends at once) go out before the regions
        // are looked at.
        self.drain();
        for region in session.regions {
            if self.region_use.users(region).is_none() {
                if self.release_region(region).is_ok() {
                    end.regions_released += 1;
                }
            } else {
                self.orphan_regions.insert(region);
                end.regions_pending += 1;
            }
        }
        tracing::warn!(
            session = id, name = %session.name, rooms_ended = end.rooms_ended, regions_released = end.regions_released,
            regions_pending = end.regions_pending, "engine session ended ({why}): its live rooms failed engine_lost"
        );
        end
    }

    /// Release every region of an ended session that no room holds any more.
    pub(super) fn release_orphan_regions(&mut self) {
        if self.orphan_regions.is_empty() {
            return;
        }
        let free: Vec<u64> =
            self.orphan_regions.iter().copied().filter(|r| self.region_use.users(*r).is_none()).collect();
        for region in free {
            self.orphan_regions.remove(&region);
            if self.release_region(region).is_ok() {
                tracing::info!(region, "region of an ended engine session released (its last room is reusable)");
            }
        }
    }
}
