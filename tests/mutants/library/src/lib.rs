//! The conformance mutants as one plugin library: the base plugin with the defect that
//! `KVGATE_MUTANT` names switched on (a row of `kvgate_mutant_base::DEFECTS`; unset, `reference`).
//! The defect is read when the module's info is asked for and again at each open, so the module and
//! its instances report the same name (`mutant-<defect>`). An unknown name opens nothing and says
//! which names exist. Test code only: it exists to prove the harness catches each defect, and never
//! ships.

use kvgate_abi::sdk::{PluginFactory, Sink};
use kvgate_abi::{PluginError, PluginInfo, ReasonCode};
use kvgate_mutant_base::{Defect, RefPlugin, DEFECTS, DEFECT_ENV};

/// The name the library reports when `KVGATE_MUTANT` names no defect.
const UNKNOWN_PLUGIN: &str = "mutant-unknown";

fn chosen() -> Result<&'static Defect, String> {
    let name = std::env::var(DEFECT_ENV).unwrap_or_else(|_| "reference".into());
    kvgate_mutant_base::defect(&name).ok_or_else(|| {
        let known: Vec<&str> = DEFECTS.iter().map(|d| d.name).collect();
        format!("{DEFECT_ENV}={name:?} names no defect; known: {}", known.join(", "))
    })
}

pub struct Factory;

impl PluginFactory for Factory {
    type Plugin = RefPlugin;
    fn info() -> PluginInfo {
        match chosen() {
            Ok(d) => kvgate_mutant_base::info_with(d.plugin, &d.faults),
            Err(_) => kvgate_mutant_base::info(UNKNOWN_PLUGIN),
        }
    }
    fn open(config: &str, sink: Sink) -> Result<RefPlugin, PluginError> {
        let d = chosen().map_err(|e| PluginError::new(ReasonCode::INVALID_ARGUMENT, e))?;
        kvgate_mutant_base::open(d.plugin, config, sink, d.faults)
    }
}

kvgate_abi::export_plugin!(Factory);
