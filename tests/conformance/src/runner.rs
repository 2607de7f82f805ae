//! Runs the selected clause checks against one plugin and assembles the report: probes the plugin
//! first (UNAVAILABLE makes every clause unsupported, never pass), then runs each check with its own
//! peers and merges the run-wide findings. Never prints; the CLI renders the report.

use crate::config::HarnessLimits;
use crate::controller::{PeerCommand, PeerProcess};
use crate::peer::protocol::{Op, Outcome};
use crate::registry::{registry, selected};
use crate::report::{ClauseResult, Report, Status};
use crate::rng::SplitMix64;
use crate::world::{Ctx, Findings, Verdict};
use std::time::{Duration, Instant};

pub struct RunPlan {
    pub plugin: String,
    pub plugin_config: String,
    pub limits: HarnessLimits,
    pub clauses: Option<String>,
    pub seed: u64,
    pub quick: bool,
    pub cmd: PeerCommand,
}

enum Probe {
    Ready { name: String, abi_version: u32 },
    Unavailable(String, Option<(String, u32)>),
    Broken(String),
}

fn probe(plan: &RunPlan) -> Probe {
    let mut peer = match PeerProcess::spawn(&plan.cmd, "probe") {
        Ok(p) => p,
        Err(e) => return Probe::Broken(e),
    };
    let op = Op::Open {
        plugin: plan.plugin.clone(),
        config: plan.plugin_config.clone(),
        memory: plan.limits.memory_provider.clone(),
    };
    let result = match peer.call(&op, Duration::from_millis(plan.limits.reply_bound_ms)) {
        Ok(r) => match r.outcome {
            Outcome::Info { instance, .. } => Probe::Ready { name: instance.name, abi_version: instance.abi_version },
            Outcome::Unavailable { reason, module } => {
                Probe::Unavailable(reason, module.map(|m| (m.name, m.abi_version)))
            }
            Outcome::PeerError { message } => Probe::Broken(message),
            other => Probe::Broken(format!("unexpected reply to open: {other:?}")),
        },
        Err(e) => Probe::Broken(format!("open: {e}")),
    };
    peer.close(Duration::from_millis(2_000));
    result
}

pub fn run_plan(plan: RunPlan) -> Report {
    let started = Instant::now();
    let selected_clauses: Vec<_> =
        registry().into_iter().filter(|c| selected(plan.clauses.as_deref(), c.id, c.group)).collect();
    let mut report = Report {
        plugin: plan.plugin.clone(),
        plugin_name: String::new(),
        abi_version: 0,
        seed: plan.seed,
        profile: if plan.quick { "quick".into() } else { "full".into() },
        limits: plan.limits.clone(),
        clauses: Vec::new(),
        elapsed_ms: 0,
    };
    let blanket = match probe(&plan) {
        Probe::Ready { name, abi_version } => {
            report.plugin_name = name;
            report.abi_version = abi_version;
            None
        }
        Probe::Unavailable(reason, module) => {
            if let Some((name, abi_version)) = module {
                report.plugin_name = name;
                report.abi_version = abi_version;
            }
            Some((Status::Unsupported, format!("plugin unavailable on this machine: {reason}")))
        }
        Probe::Broken(why) => Some((Status::Fail, format!("the plugin could not be opened: {why}"))),
    };
    if let Some((status, evidence)) = blanket {
        report.clauses = selected_clauses
            .iter()
            .map(|c| ClauseResult {
                id: c.id.into(),
                group: c.group.into(),
                status,
                evidence: evidence.clone(),
                elapsed_ms: 0,
            })
            .collect();
        report.elapsed_ms = started.elapsed().as_millis() as u64;
        return report;
    }
    let mut ctx = Ctx {
        limits: plan.limits.clone(),
        plugin: plan.plugin.clone(),
        plugin_config: plan.plugin_config.clone(),
        cmd: plan.cmd.clone(),
        rng: SplitMix64::new(plan.seed),
        findings: Findings::default(),
        current: "",
        exercised: Default::default(),
    };
    for clause in &selected_clauses {
        ctx.current = clause.id;
        // Each clause draws from its own stream, so selecting clauses does not change another's data.
        ctx.rng = SplitMix64::new(plan.seed ^ fxhash(clause.id));
        let t = Instant::now();
        let verdict = match (clause.check)(&mut ctx) {
            Ok(evidence) => Verdict::Pass(evidence),
            Err(v) => v,
        };
        let (status, evidence) = match verdict {
            Verdict::Pass(e) => (Status::Pass, e),
            Verdict::Fail(e) => (Status::Fail, e),
            Verdict::Unsupported(e) => (Status::Unsupported, e),
        };
        report.clauses.push(ClauseResult {
            id: clause.id.into(),
            group: clause.group.into(),
            status,
            evidence,
            elapsed_ms: t.elapsed().as_millis() as u64,
        });
    }
    for result in &mut report.clauses {
        // A clause that passed without its situation ever arising is not a pass.
        if let Some(list) = ctx.exercised.get(result.id.as_str()) {
            if result.status == Status::Pass {
                let counts = list
                    .iter()
                    .map(|e| format!("{}: {} of {}", e.what, e.seen, e.tries))
                    .collect::<Vec<_>>()
                    .join("; ");
                match list.iter().find(|e| e.seen == 0) {
                    Some(e) => {
                        result.status = e.absent;
                        result.evidence = format!("{counts}; {}", result.evidence);
                    }
                    None => result.evidence = format!("{} ({counts})", result.evidence),
                }
            }
        }
        // A run-wide finding is a violation seen: it fails the clause whatever its own check said.
        if let Some(found) = ctx.findings.by_clause.get(result.id.as_str()) {
            let seen = found.join("; ");
            result.evidence = match result.status {
                Status::Fail => format!("{}; also seen during the run: {seen}", result.evidence),
                _ => format!("seen during the run: {seen}"),
            };
            result.status = Status::Fail;
        }
    }
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    report
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}
