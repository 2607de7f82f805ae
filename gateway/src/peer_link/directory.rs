//! The peers this gateway knows: its static `[[peers]]` and those discovery found, each with the
//! channel its link task takes accepted sessions from and the entry that task dials. Owns when a
//! discovered peer's task starts (its first record) and ends (its record withdrawn and no session
//! left); never decides that a live link is lost (heartbeats do).

use super::handshaken::Session;
use crate::config::PeerEntry;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use tokio::sync::{mpsc, watch};

/// Where a peer's entry came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerSource {
    Static,
    Discovered,
}

impl PeerSource {
    pub fn as_str(self) -> &'static str {
        match self {
            PeerSource::Static => "static",
            PeerSource::Discovered => "etcd",
        }
    }
}

struct Known {
    source: PeerSource,
    /// The entry its task dials; `None` once a discovered peer's record is withdrawn.
    entry: watch::Sender<Option<PeerEntry>>,
    incoming: mpsc::Sender<Session>,
}

/// What a new peer's link task needs from the directory.
pub struct NewPeer {
    pub entry: watch::Receiver<Option<PeerEntry>>,
    pub incoming: mpsc::Receiver<Session>,
}

/// What `upsert_discovered` did with a record.
pub enum Upsert {
    /// A new peer: start its link task with this.
    Added(NewPeer),
    /// A known discovered peer: its task dials the new entry from now on.
    Updated,
    /// The name is a static peer's, whose entry the configuration owns.
    StaticWins,
    /// `discovery.max_peers` discovered peers are known already.
    LimitReached,
}

/// One gateway's peers, shared by the link tasks, the link server, discovery and the driver.
#[derive(Default)]
pub struct PeerDirectory {
    known: RwLock<HashMap<String, Known>>,
}

/// Sessions a peer's task has not taken yet (a dialled link waits here for its task).
const INCOMING_SESSIONS: usize = 4;

impl PeerDirectory {
    /// A directory holding `peers` as static peers, and the link tasks to start for them (by name).
    pub fn with_static(peers: &[PeerEntry]) -> (Arc<PeerDirectory>, Vec<(String, NewPeer)>) {
        let directory = Arc::new(PeerDirectory::default());
        let mut tasks = Vec::new();
        {
            let mut known = directory.known.write().expect("directory lock");
            for peer in peers {
                let (known_peer, new) = Self::make(PeerSource::Static, peer.clone());
                known.insert(peer.name.clone(), known_peer);
                tasks.push((peer.name.clone(), new));
            }
        }
        (directory, tasks)
    }

    fn make(source: PeerSource, entry: PeerEntry) -> (Known, NewPeer) {
        let (entry_tx, entry_rx) = watch::channel(Some(entry));
        let (session_tx, session_rx) = mpsc::channel(INCOMING_SESSIONS);
        (Known { source, entry: entry_tx, incoming: session_tx }, NewPeer { entry: entry_rx, incoming: session_rx })
    }

    /// Adds or updates a discovered peer (`Added` carries what its link task needs).
    pub fn upsert_discovered(&self, entry: PeerEntry, max_peers: u64) -> Upsert {
        let mut known = self.known.write().expect("directory lock");
        if let Some(existing) = known.get(&entry.name) {
            if existing.source == PeerSource::Static {
                return Upsert::StaticWins;
            }
            existing.entry.send_if_modified(|current| {
                let changed = current.as_ref() != Some(&entry);
                *current = Some(entry);
                changed
            });
            return Upsert::Updated;
        }
        let discovered = known.values().filter(|k| k.source == PeerSource::Discovered).count() as u64;
        if discovered >= max_peers {
            return Upsert::LimitReached;
        }
        let name = entry.name.clone();
        let (known_peer, new) = Self::make(PeerSource::Discovered, entry);
        known.insert(name, known_peer);
        Upsert::Added(new)
    }

    /// A discovered peer's record is gone: its task stops dialling and ends once no session is left.
    /// Returns whether a discovered, not yet withdrawn peer of that name was known.
    pub fn withdraw(&self, name: &str) -> bool {
        let known = self.known.read().expect("directory lock");
        match known.get(name) {
            Some(k) if k.source == PeerSource::Discovered => {
                k.entry.send_if_modified(|current| current.take().is_some())
            }
            _ => false,
        }
    }

    /// Called by a peer's task once it holds no session: forgets the peer if it is still withdrawn
    /// (true: the task ends) or keeps it (false: a record came back meanwhile, the task goes on).
    pub fn retire(&self, name: &str) -> bool {
        let mut known = self.known.write().expect("directory lock");
        let withdrawn = known.get(name).is_some_and(|k| k.entry.borrow().is_none());
        if withdrawn {
            known.remove(name);
        }
        withdrawn
    }

    /// The entry of a peer that may take new links and rooms: static, or discovered and not withdrawn.
    pub fn entry(&self, name: &str) -> Option<PeerEntry> {
        self.known.read().expect("directory lock").get(name).and_then(|k| k.entry.borrow().clone())
    }

    /// Where the link server hands a session dialled by `name`, while `name` may take new links.
    pub fn incoming(&self, name: &str) -> Option<mpsc::Sender<Session>> {
        let known = self.known.read().expect("directory lock");
        known.get(name).filter(|k| k.entry.borrow().is_some()).map(|k| k.incoming.clone())
    }

    /// Every peer, sorted by name, with its entry (`None` for a withdrawn discovered peer whose link
    /// task still runs) and its source.
    pub fn list(&self) -> Vec<(String, Option<PeerEntry>, PeerSource)> {
        let known = self.known.read().expect("directory lock");
        let mut peers: Vec<_> =
            known.iter().map(|(name, k)| (name.clone(), k.entry.borrow().clone(), k.source)).collect();
        peers.sort_by(|a, b| a.0.cmp(&b.0));
        peers
    }

    /// The names of discovered peers that are not withdrawn.
    pub fn discovered_names(&self) -> Vec<String> {
        let known = self.known.read().expect("directory lock");
        known
            .iter()
            .filter(|(_, k)| k.source == PeerSource::Discovered && k.entry.borrow().is_some())
            .map(|(n, _)| n.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(name: &str, address: &str) -> PeerEntry {
        PeerEntry { name: name.into(), address: address.into(), ..PeerEntry::default() }
    }

    #[test]
    fn a_static_peer_is_never_replaced_or_withdrawn_by_discovery() {
        let (directory, tasks) = PeerDirectory::with_static(&[peer("a", "10.0.0.1:7100")]);
        assert_eq!(tasks.len(), 1);
        assert!(matches!(directory.upsert_discovered(peer("a", "10.0.0.9:7100"), 8), Upsert::StaticWins));
        assert!(!directory.withdraw("a"));
        assert_eq!(directory.entry("a").unwrap().address, "10.0.0.1:7100");
        assert!(directory.incoming("a").is_some());
    }

    #[test]
    fn a_discovered_peer_is_added_once_updated_in_place_and_retired_only_while_withdrawn() {
        let (directory, _) = PeerDirectory::with_static(&[]);
        let Upsert::Added(mut new) = directory.upsert_discovered(peer("b", "10.0.0.2:7100"), 8) else {
            panic!("not added")
        };
        assert!(matches!(directory.upsert_discovered(peer("b", "10.0.0.3:7100"), 8), Upsert::Updated));
        assert!(new.entry.has_changed().unwrap());
        assert_eq!(new.entry.borrow_and_update().as_ref().unwrap().address, "10.0.0.3:7100");
        // The same record again changes nothing the task must see.
        directory.upsert_discovered(peer("b", "10.0.0.3:7100"), 8);
        assert!(!new.entry.has_changed().unwrap());

        assert!(directory.withdraw("b"));
        assert!(!directory.withdraw("b"), "a second withdrawal is not a change");
        assert!(directory.entry("b").is_none() && directory.incoming("b").is_none());
        // A record back before the task retired: the task goes on with it.
        directory.upsert_discovered(peer("b", "10.0.0.4:7100"), 8);
        assert!(!directory.retire("b"));
        assert_eq!(directory.entry("b").unwrap().address, "10.0.0.4:7100");
        directory.withdraw("b");
        assert!(directory.retire("b"));
        assert!(directory.list().is_empty());
    }

    #[test]
    fn max_peers_is_enforced_at_and_just_past_the_limit() {
        let (directory, _) = PeerDirectory::with_static(&[peer("static", "10.0.0.1:7100")]);
        let added = |what: Upsert| matches!(what, Upsert::Added(_));
        assert!(added(directory.upsert_discovered(peer("d1", "10.0.0.2:7100"), 2)));
        assert!(added(directory.upsert_discovered(peer("d2", "10.0.0.3:7100"), 2)));
        assert!(matches!(directory.upsert_discovered(peer("d3", "10.0.0.4:7100"), 2), Upsert::LimitReached));
        assert!(directory.entry("d3").is_none());
        // Known peers still update at the limit, and a retired one frees its place.
        assert!(matches!(directory.upsert_discovered(peer("d2", "10.0.0.5:7100"), 2), Upsert::Updated));
        directory.withdraw("d1");
        assert!(directory.retire("d1"));
        assert!(added(directory.upsert_discovered(peer("d3", "10.0.0.4:7100"), 2)));
        let names: Vec<String> = directory.list().into_iter().map(|(n, _, _)| n).collect();
        assert_eq!(names, ["d2", "d3", "static"]);
    }
}
