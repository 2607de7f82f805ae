//! Plugin instances by slot, with their generation and lifecycle. An instance is `active` (offered
//! for new rooms), `draining` (retired by a plugin reload: it finishes what it holds and is offered
//! for no new room while a current instance of a shared plugin reaches the peer) or `closed` (shut
//! down). A slot is never reused, so a late event of a closed instance can never reach another.
//! Generations count per plugin name from 1; an instance's wire name is the plugin name for
//! generation 1 and `NAME@GEN` after (what a peer's Hello, region keys and notices call it).

use std::time::Instant;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstanceState {
    Active,
    /// Retired at `since` by the plugin change numbered `change` (see `PluginsChanged.seq`).
    Draining {
        since: Instant,
        change: u64,
    },
    Closed,
}

impl InstanceState {
    pub fn as_str(&self) -> &'static str {
        match self {
            InstanceState::Active => "active",
            InstanceState::Draining { .. } => "draining",
            InstanceState::Closed => "closed",
        }
    }
}

/// What the driver knows of one instance besides its transport object.
#[derive(Clone, Debug)]
pub struct Instance {
    pub generation: u32,
    pub wire_name: String,
    pub state: InstanceState,
    /// The plugin's config text it was opened with (a reload reopens it when this changes).
    pub config_text: String,
    /// Where its module came from (`builtin` or the library path): a new library reopens it.
    pub origin: String,
    /// Why it closed (`drained`, `drain_timeout`, ...), for `/plugins`.
    pub closed_reason: String,
}

impl Instance {
    pub fn new(name: &str, generation: u32, config_text: String, origin: String) -> Instance {
        Instance {
            generation,
            wire_name: wire_name(name, generation),
            state: InstanceState::Active,
            config_text,
            origin,
            closed_reason: String::new(),
        }
    }
    pub fn is_active(&self) -> bool {
        self.state == InstanceState::Active
    }
    pub fn is_open(&self) -> bool {
        self.state != InstanceState::Closed
    }
}

/// The wire name of generation `generation` of plugin `name`.
pub fn wire_name(name: &str, generation: u32) -> String {
    if generation <= 1 {
        name.to_string()
    } else {
        format!("{name}@{generation}")
    }
}

/// The plugin name of a wire name (`shm@2` -> `shm`).
pub fn plugin_of(wire_name: &str) -> &str {
    wire_name.split('@').next().unwrap_or(wire_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_generation_keeps_the_plain_name_so_older_peers_still_match_it() {
        assert_eq!(wire_name("shm", 1), "shm");
        assert_eq!(wire_name("shm", 2), "shm@2");
        assert_eq!(plugin_of("shm@2"), "shm");
        assert_eq!(plugin_of("quic"), "quic");
    }
}
