//! A sender and a receiver peer process with the plugin open in each, connected both ways, plus the
//! ledger of every transfer the harness submitted. Checks talk to the plugin only through a `Pair`;
//! the run-wide invariants (RES-1, RES-3 ordering, OBS-1, OBS-5, HYGIENE-1) are read off the ledger here.
//! Never decides a clause's own verdict (the checks do), only records run-wide findings.

use crate::config::HarnessLimits;
use crate::controller::{NoReply, PeerCommand, PeerProcess};
use crate::peer::protocol::*;
use crate::report::Status;
use crate::rng::SplitMix64;
use kvgate_abi::{cap_flags, event_flags, EventKind, ReasonCode};
use std::collections::BTreeMap;
use std::time::Duration;

/// The receiver as the sender's plugin knows it (first generation).
pub const RX_PEER: u64 = 1;
/// The sender as the receiver's plugin knows it.
pub const TX_PEER: u64 = 2;

/// A clause check's verdict; evidence says what was done, what was seen and how long it took.
#[derive(Debug, Clone)]
pub enum Verdict {
    Pass(String),
    Fail(String),
    Unsupported(String),
}

/// Run-wide observations attributed to clauses (every event and every call error is inspected).
#[derive(Default, Debug)]
pub struct Findings {
    pub by_clause: BTreeMap<&'static str, Vec<String>>,
}

const MAX_FINDINGS_PER_CLAUSE: usize = 8;

impl Findings {
    pub fn add(&mut self, clause: &'static str, what: String) {
        let list = self.by_clause.entry(clause).or_default();
        if list.len() < MAX_FINDINGS_PER_CLAUSE {
            list.push(what);
        }
    }
}

/// Whether a clause's situation arose: of `tries` attempts to bring it about, `seen` did (for example,
/// cancels that reached a live transfer). A clause that passes with `seen` 0 is reported `absent`
/// (`NotExercised`, or `Unsupported` for an optional feature the plugin does not use), never pass.
#[derive(Debug, Clone)]
pub struct Exercise {
    pub what: String,
    pub seen: u64,
    pub tries: u64,
    pub absent: Status,
}

pub struct Ctx {
    pub limits: HarnessLimits,
    pub plugin: String,
    pub plugin_config: String,
    pub cmd: PeerCommand,
    pub rng: SplitMix64,
    pub findings: Findings,
    /// The clause being checked (for run-wide findings' context).
    pub current: &'static str,
    /// Per clause id: whether each of its situations arose (see [`Exercise`]).
    pub exercised: BTreeMap<&'static str, Vec<Exercise>>,
}

impl Ctx {
    /// Record that `seen` of `tries` attempts brought about `clause`'s situation `what`; adds up over
    /// calls with the same `what`. A clause may have several situations (ABORT-4: a storm, and cancels
    /// under load), each of which must arise. `absent` is the verdict for a passing clause one of whose
    /// situations never arose.
    pub fn exercise(&mut self, clause: &'static str, what: &str, seen: u64, tries: u64, absent: Status) {
        let list = self.exercised.entry(clause).or_default();
        let i = match list.iter().position(|e| e.what == what) {
            Some(i) => i,
            None => {
                list.push(Exercise { what: what.to_string(), seen: 0, tries: 0, absent });
                list.len() - 1
            }
        };
        let e = &mut list[i];
        e.seen += seen;
        e.tries += tries;
        if absent == Status::NotExercised {
            e.absent = absent;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Tx,
    Rx,
}

#[derive(Debug, Clone)]
pub struct Xfer {
    pub accepted: bool,
    /// Accepted submits under this id (an id may be reused once its transfer ended).
    pub accepted_submits: u32,
    /// Sender clock when `submit` returned.
    pub submitted_ns: u64,
    pub timeout_ns: u64,
    /// The bytes of each accepted submit under this id, in order (the first when none was accepted).
    pub bytes: Vec<u64>,
}

impl Xfer {
    /// The ledger entry of one submit of `bytes` bytes.
    pub fn new(accepted: bool, submitted_ns: u64, timeout_ns: u64, bytes: u64) -> Xfer {
        Xfer { accepted, accepted_submits: u32::from(accepted), submitted_ns, timeout_ns, bytes: vec![bytes] }
    }
}

/// The bytes a segment list moves.
pub fn total_bytes(segments: &[Seg]) -> u64 {
    segments.iter().fold(0u64, |sum, s| sum.saturating_add(s.len))
}

/// A source region on the sender.
#[derive(Debug, Clone, Copy)]
pub struct Src {
    pub rid: u32,
    pub len: u64,
    pub key: u64,
}

/// A destination region on the receiver, imported by the sender.
#[derive(Debug, Clone)]
pub struct Dst {
    pub rid: u32,
    pub len: u64,
    pub key: u64,
    pub remote: u64,
    pub remote_bytes: Vec<u8>,
}

/// How long `Pair::settle_ticket` waits, after `SUCCEEDED`, to see its bytes in the destination.
pub const SETTLE_LANDING_BOUND_MS: u64 = 1_000;

pub struct Pair {
    pub tx: PeerProcess,
    pub rx: PeerProcess,
    pub module_info: WireInfo,
    pub info: WireInfo,
    pub xfers: BTreeMap<u64, Xfer>,
    pub limits: HarnessLimits,
    pub rx_peer: u64,
    next_xfer: u64,
    next_ticket: u64,
    next_rid: u32,
    context: &'static str,
}

pub fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

pub fn is_terminal(e: &WireEvent) -> bool {
    e.flags & event_flags::INCOMING == 0 && (e.kind == EventKind::SUCCEEDED.0 || e.kind == EventKind::FAILED.0)
}

pub fn describe(e: &WireEvent) -> String {
    let mut s = format!("{}(xfer {}", EventKind(e.kind).as_str(), e.xfer);
    if e.reason != 0 {
        s.push_str(&format!(", {}", ReasonCode(e.reason).as_str()));
    }
    if e.flags & event_flags::QUIESCED != 0 {
        s.push_str(", quiesced");
    }
    s.push_str(&format!(") at {:.1} ms", ms(e.t_ns)));
    s
}

fn fail_no_reply(side: &str, what: &str, e: NoReply) -> Verdict {
    Verdict::Fail(format!("{side} peer: {what}: {e}"))
}

impl Pair {
    /// Start both peers, open the plugin in each, connect them both ways.
    pub fn open(ctx: &mut Ctx) -> Result<Pair, Verdict> {
        let mut tx = PeerProcess::spawn(&ctx.cmd, "sender").map_err(Verdict::Fail)?;
        let mut rx = PeerProcess::spawn(&ctx.cmd, "receiver").map_err(Verdict::Fail)?;
        let bound = Duration::from_millis(ctx.limits.reply_bound_ms);
        let open = Op::Open {
            plugin: ctx.plugin.clone(),
            config: ctx.plugin_config.clone(),
            memory: ctx.limits.memory_provider.clone(),
        };
        let mut infos = Vec::new();
        for p in [&mut tx, &mut rx] {
            let reply = p.call(&open, bound).map_err(|e| fail_no_reply(&p.role, "open", e))?;
            match reply.outcome {
                Outcome::Info { module, instance } => infos.push((module, instance)),
                Outcome::Unavailable { reason, .. } => {
                    return Err(Verdict::Unsupported(format!("plugin unavailable: {reason}")))
                }
                Outcome::PeerError { message } => return Err(Verdict::Fail(message)),
                other => return Err(Verdict::Fail(format!("open: unexpected reply {other:?}"))),
            }
        }
        let (module_info, info) = infos.swap_remove(0);
        let mut pair = Pair {
            tx,
            rx,
            module_info,
            info,
            xfers: BTreeMap::new(),
            limits: ctx.limits.clone(),
            rx_peer: RX_PEER,
            next_xfer: 1,
            next_ticket: 1,
            next_rid: 1,
            context: ctx.current,
        };
        let rx_endpoint = pair.endpoint(Side::Rx, ctx)?;
        let tx_endpoint = pair.endpoint(Side::Tx, ctx)?;
        pair.expect_done(Side::Tx, Op::Connect { peer: RX_PEER, endpoint: rx_endpoint }, ctx, "connect")?;
        pair.expect_done(Side::Rx, Op::Connect { peer: TX_PEER, endpoint: tx_endpoint }, ctx, "connect")?;
        Ok(pair)
    }

    pub fn peer(&mut self, side: Side) -> &mut PeerProcess {
        match side {
            Side::Tx => &mut self.tx,
            Side::Rx => &mut self.rx,
        }
    }

    pub fn bound(&self) -> Duration {
        Duration::from_millis(self.limits.reply_bound_ms)
    }

    /// Send a request and wait for its reply; a plugin error is inspected for OBS-1/HYGIENE-1.
    pub fn call(&mut self, side: Side, op: Op, ctx: &mut Ctx) -> Result<Reply, Verdict> {
        let what = op_name(&op);
        let bound = self.bound();
        let reply = self.peer(side).call(&op, bound).map_err(|e| {
            if let NoReply::Died { .. } = e {
                ctx.findings.add("HYGIENE-1", format!("[{}] peer process died during {what}: {e}", ctx.current));
            }
            fail_no_reply(&self.peer(side).role.clone(), what, e)
        })?;
        self.inspect(&reply.outcome, what, ctx);
        if let Outcome::PeerError { message } = &reply.outcome {
            return Err(Verdict::Fail(format!("harness peer could not {what}: {message}")));
        }
        Ok(reply)
    }

    /// Inspect a call's outcome for run-wide findings.
    pub fn inspect(&self, outcome: &Outcome, what: &str, ctx: &mut Ctx) {
        let mut errors: Vec<&CallError> = Vec::new();
        match outcome {
            Outcome::Failed { error } => errors.push(error),
            Outcome::Batch { errors: list, .. } => errors.extend(list.iter().flatten()),
            _ => {}
        }
        for e in errors {
            let code = ReasonCode(e.code);
            if code == ReasonCode::PANIC {
                ctx.findings.add("HYGIENE-1", format!("[{}] {what} returned PANIC: {}", ctx.current, e.message));
            }
            if !code.is_known() || e.message.trim().is_empty() {
                ctx.findings.add(
                    "OBS-1",
                    format!("[{}] {what} returned error code {} with message {:?}", ctx.current, e.code, e.message),
                );
            }
        }
    }

    fn expect_done(&mut self, side: Side, op: Op, ctx: &mut Ctx, what: &str) -> Result<(), Verdict> {
        match self.call(side, op, ctx)?.outcome {
            Outcome::Done => Ok(()),
            Outcome::Failed { error } => {
                Err(Verdict::Fail(format!("{what} failed: {}: {}", error.code_name, error.message)))
            }
            other => Err(Verdict::Fail(format!("{what}: unexpected reply {other:?}"))),
        }
    }

    pub fn endpoint(&mut self, side: Side, ctx: &mut Ctx) -> Result<Vec<u8>, Verdict> {
        match self.call(side, Op::Endpoint, ctx)?.outcome {
            Outcome::Bytes { bytes } => Ok(bytes),
            other => Err(Verdict::Fail(format!("local_endpoint: unexpected reply {other:?}"))),
        }
    }

    pub fn rid(&mut self) -> u32 {
        self.next_rid += 1;
        self.next_rid
    }

    pub fn ticket(&mut self) -> u64 {
        self.next_ticket += 1;
        self.next_ticket
    }

    pub fn xfer_id(&mut self) -> u64 {
        self.next_xfer += 1;
        self.next_xfer
    }

    fn alloc_register(
        &mut self,
        side: Side,
        len: u64,
        seed: u64,
        ctx: &mut Ctx,
    ) -> Result<(u32, u64, Vec<u8>), Verdict> {
        let rid = self.rid();
        self.call(side, Op::Alloc { rid, len, seed }, ctx)?;
        match self.call(side, Op::Register { rid }, ctx)?.outcome {
            Outcome::Registered { key, remote_key } => Ok((rid, key, remote_key)),
            Outcome::Failed { error } => Err(Verdict::Fail(format!(
                "register of a {len}-byte region (memory provider {:?}) refused: {}: {}",
                self.limits.memory_provider, error.code_name, error.message
            ))),
            other => Err(Verdict::Fail(format!("register: unexpected reply {other:?}"))),
        }
    }

    pub fn alloc_src(&mut self, len: u64, seed: u64, ctx: &mut Ctx) -> Result<Src, Verdict> {
        let (rid, key, _) = self.alloc_register(Side::Tx, len, seed, ctx)?;
        Ok(Src { rid, len, key })
    }

    pub fn alloc_dst(&mut self, len: u64, seed: u64, ctx: &mut Ctx) -> Result<Dst, Verdict> {
        let (rid, key, remote_bytes) = self.alloc_register(Side::Rx, len, seed, ctx)?;
        let remote = self.import(&remote_bytes, ctx)?;
        Ok(Dst { rid, len, key, remote, remote_bytes })
    }

    pub fn import(&mut self, bytes: &[u8], ctx: &mut Ctx) -> Result<u64, Verdict> {
        let peer = self.rx_peer;
        match self.call(Side::Tx, Op::Import { peer, bytes: bytes.to_vec() }, ctx)?.outcome {
            Outcome::Key { key } => Ok(key),
            Outcome::Failed { error } => {
                Err(Verdict::Fail(format!("import_remote_key refused: {}: {}", error.code_name, error.message)))
            }
            other => Err(Verdict::Fail(format!("import: unexpected reply {other:?}"))),
        }
    }

    /// Authorise incoming writes into the whole of `dst` under a fresh ticket.
    pub fn authorise(&mut self, dst: &Dst, ctx: &mut Ctx) -> Result<u64, Verdict> {
        let ticket = self.ticket();
        let timeout_ns = self.limits.long_timeout_ms * 1_000_000;
        let op = Op::ExpectIncoming { ticket, peer: TX_PEER, timeout_ns, ranges: vec![(dst.key, 0, dst.len)] };
        self.expect_done(Side::Rx, op, ctx, "expect_incoming")?;
        Ok(ticket)
    }

    /// Submit; the ledger records it. Returns the id and, when accepted, the sender clock at return.
    pub fn submit(
        &mut self,
        ticket: u64,
        timeout_ms: u64,
        segments: Vec<Seg>,
        ctx: &mut Ctx,
    ) -> Result<(u64, Result<u64, CallError>), Verdict> {
        let xfer = self.xfer_id();
        self.submit_as(xfer, ticket, timeout_ms * 1_000_000, segments, ctx).map(|r| (xfer, r))
    }

    pub fn submit_as(
        &mut self,
        xfer: u64,
        ticket: u64,
        timeout_ns: u64,
        segments: Vec<Seg>,
        ctx: &mut Ctx,
    ) -> Result<Result<u64, CallError>, Verdict> {
        let peer = self.rx_peer;
        let bytes = total_bytes(&segments);
        let reply = self.call(Side::Tx, Op::Submit { xfer, peer, ticket, timeout_ns, segments }, ctx)?;
        let result = match reply.outcome {
            Outcome::Done => Ok(reply.t_ns),
            Outcome::Failed { error } => Err(error),
            other => return Err(Verdict::Fail(format!("submit: unexpected reply {other:?}"))),
        };
        // A second submit of a live id must not replace the first's ledger entry.
        let entry = Xfer::new(result.is_ok(), reply.t_ns, timeout_ns, bytes);
        match self.xfers.get_mut(&xfer) {
            Some(existing) if existing.accepted => {
                existing.accepted_submits += entry.accepted_submits;
                if entry.accepted {
                    existing.bytes.push(bytes);
                }
            }
            _ => {
                self.xfers.insert(xfer, entry);
            }
        }
        Ok(result)
    }

    pub fn cancel(&mut self, xfer: u64, ctx: &mut Ctx) -> Result<Reply, Verdict> {
        self.call(Side::Tx, Op::Cancel { xfer }, ctx)
    }

    pub fn stats(&mut self, side: Side, ctx: &mut Ctx) -> Result<WireStats, Verdict> {
        match self.call(side, Op::Stats, ctx)?.outcome {
            Outcome::Stats { stats } => Ok(stats),
            other => Err(Verdict::Fail(format!("stats: unexpected reply {other:?}"))),
        }
    }

    /// Bytes `offset..offset + len` of region `rid` of `side`, read from its shared file by the
    /// controller itself: this works while that peer is frozen, and sees what a plugin wrote into the
    /// mapping from any process.
    pub fn region_bytes(&self, side: Side, rid: u32, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let pid = match side {
            Side::Tx => self.tx.pid(),
            Side::Rx => self.rx.pid(),
        };
        let path = crate::peer::region::region_file(pid, rid);
        let mut buf = vec![0u8; len as usize];
        std::fs::File::open(&path)?.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    }

    /// Wait until `dst[offset..offset + len]` holds the same bytes as `src[offset..offset + len]`,
    /// polling every millisecond for at most `bound`. True when it did.
    pub fn wait_landed(&self, src: &Src, dst: &Dst, offset: u64, len: u64, bound: Duration) -> bool {
        let Ok(want) = self.region_bytes(Side::Tx, src.rid, offset, len) else { return false };
        let start = std::time::Instant::now();
        loop {
            if self.region_bytes(Side::Rx, dst.rid, offset, len).is_ok_and(|got| got == want) {
                return true;
            }
            if start.elapsed() >= bound {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn checksum(&mut self, side: Side, rid: u32, ranges: Vec<(u64, u64)>, ctx: &mut Ctx) -> Result<u64, Verdict> {
        match self.call(side, Op::Checksum { rid, ranges }, ctx)?.outcome {
            Outcome::Checksum { value } => Ok(value),
            other => Err(Verdict::Fail(format!("checksum: unexpected reply {other:?}"))),
        }
    }

    /// The first terminal event of `xfer` on the sender, if any yet.
    pub fn terminal(&self, xfer: u64) -> Option<WireEvent> {
        self.tx.events().into_iter().find(|e| e.xfer == xfer && is_terminal(e))
    }

    pub fn wait_terminal(&self, xfer: u64, bound: Duration) -> Option<WireEvent> {
        let mut found = None;
        self.tx.wait_events(bound, |events| {
            found = events.iter().find(|e| e.xfer == xfer && is_terminal(e)).cloned();
            found.is_some()
        });
        found
    }

    /// Wait until every accepted transfer in `xfers` has a terminal event; returns those without.
    pub fn wait_all_terminal(&self, xfers: &[u64], bound: Duration) -> Vec<u64> {
        let wanted: std::collections::BTreeSet<u64> = xfers.iter().copied().filter(|x| self.accepted(*x)).collect();
        let mut missing = Vec::new();
        self.tx.wait_events(bound, |events| {
            let done: std::collections::BTreeSet<u64> =
                events.iter().filter(|e| is_terminal(e)).map(|e| e.xfer).collect();
            missing = wanted.difference(&done).copied().collect();
            missing.is_empty()
        });
        missing
    }

    /// Move the last 4 KiB of `dst` under `ticket` and wait for it to succeed and for its bytes to
    /// be seen in the destination. Afterwards the sender surely holds the receiver's grant, so a
    /// clause that freezes the receiver or cancels next tests transfers past the grant, not ones still
    /// waiting for the grant to arrive, which a fixed wait cannot promise on a loaded host. Waiting for
    /// the bytes too keeps a plugin that reports success early (DATA-1's defect) from writing them into
    /// the next case of the clause; a plugin whose bytes never show gets `SETTLE_LANDING_BOUND_MS`
    /// and is left to the DATA clauses.
    pub fn settle_ticket(&mut self, src: &Src, dst: &Dst, ticket: u64, ctx: &mut Ctx) -> Result<(), Verdict> {
        let len = 4096.min(src.len).min(dst.len);
        let offset = src.len.min(dst.len) - len;
        let (x, r) = self.submit(ticket, self.limits.long_timeout_ms, vec![seg(src, offset, dst, offset, len)], ctx)?;
        if let Err(e) = r {
            return Err(Verdict::Fail(format!(
                "settling the ticket: a {len} B transfer with the receiver running was refused: {}: {}",
                e.code_name, e.message
            )));
        }
        match self.wait_terminal(x, self.bound()) {
            Some(e) if e.kind == EventKind::SUCCEEDED.0 => {
                self.wait_landed(src, dst, offset, len, Duration::from_millis(SETTLE_LANDING_BOUND_MS));
                Ok(())
            }
            Some(e) => Err(Verdict::Fail(format!(
                "settling the ticket: a {len} B transfer with the receiver running ended {}",
                describe(&e)
            ))),
            None => Err(Verdict::Fail(format!(
                "settling the ticket: a {len} B transfer with the receiver running did not end within {} ms",
                self.bound().as_millis()
            ))),
        }
    }

    pub fn accepted(&self, xfer: u64) -> bool {
        self.xfers.get(&xfer).is_some_and(|x| x.accepted)
    }

    /// Whether `xfer`'s destination can no longer be written: succeeded, or failed and quiesced.
    pub fn quiesced(events: &[WireEvent], xfer: u64) -> bool {
        events.iter().any(|e| {
            e.xfer == xfer
                && e.flags & event_flags::INCOMING == 0
                && (e.kind == EventKind::SUCCEEDED.0
                    || e.kind == EventKind::QUIESCED.0
                    || (e.kind == EventKind::FAILED.0 && e.flags & event_flags::QUIESCED != 0))
        })
    }

    /// End the pair: let late events arrive, read the run-wide invariants off the ledger, close peers.
    /// Returns what RES-1's missing-terminal invariant found (see [`Pair::unended`]), for the caller
    /// to attribute (`clauses::with_pair`).
    pub fn finish(mut self, ctx: &mut Ctx) -> Option<String> {
        if self.rx.frozen {
            self.rx.resume();
        }
        std::thread::sleep(Duration::from_millis(30));
        let unended = self.unended(ctx);
        let tx_events = self.tx.events();
        self.check_ledger(&tx_events, ctx);
        let with_progress: std::collections::BTreeSet<u64> = tx_events
            .iter()
            .filter(|e| {
                e.kind == EventKind::PROGRESS.0 && e.flags & event_flags::INCOMING == 0 && self.accepted(e.xfer)
            })
            .map(|e| e.xfer)
            .collect();
        let transfers = self.xfers.values().filter(|x| x.accepted).count() as u64;
        let absent =
            if self.info.flags & cap_flags::PROGRESS_EVENTS != 0 { Status::NotExercised } else { Status::Unsupported };
        ctx.exercise("OBS-5", "transfers with PROGRESS events", with_progress.len() as u64, transfers, absent);
        for e in tx_events.iter().chain(self.rx.events().iter()) {
            check_event_fields(e, ctx);
        }
        for peer in [&mut self.tx, &mut self.rx] {
            if let Some(death) = peer.unreported_death() {
                ctx.findings.add(
                    "HYGIENE-1",
                    format!("[{}] {} peer process died during the clause: {death}", self.context, peer.role),
                );
            }
        }
        let bound = Duration::from_millis(2_000);
        self.tx.close(bound);
        self.rx.close(bound);
        unended
    }

    /// RES-1's run-wide invariant: every accepted submit has its terminal event by the end of the
    /// clause. Transfers still without one get `G + deadline slack + 1 s` more (a clause need not wait
    /// for every transfer it leaves moving), are then cancelled (a transfer the plugin still holds ends
    /// within G; one it has forgotten stays silent) and get `G + 1 s` more. Those still without a
    /// terminal event are named, with the clause. Nothing is said when the sender process died (that
    /// is HYGIENE-1's).
    fn unended(&mut self, ctx: &mut Ctx) -> Option<String> {
        if self.tx.exited() {
            return None;
        }
        let first_wait = Duration::from_millis(self.limits.abort_grace_ms + self.limits.deadline_slack_ms + 1_000);
        let waited = std::time::Instant::now();
        let mut missing = Vec::new();
        self.tx.wait_events(first_wait, |events| {
            missing = without_terminal(&self.xfers, events);
            missing.is_empty()
        });
        if missing.is_empty() || self.tx.exited() {
            return None;
        }
        let first_ms = waited.elapsed().as_millis();
        if self.call(Side::Tx, Op::CancelMany { xfers: missing.clone() }, ctx).is_err() {
            return None;
        }
        let second_wait = Duration::from_millis(self.limits.abort_grace_ms + 1_000);
        self.tx.wait_events(second_wait, |events| {
            missing = without_terminal(&self.xfers, events);
            missing.is_empty()
        });
        if missing.is_empty() || self.tx.exited() {
            return None;
        }
        let shown: Vec<String> = missing
            .iter()
            .take(5)
            .map(|x| {
                let l = &self.xfers[x];
                format!(
                    "transfer {x} (submitted at {:.1} ms, timeout {} ms, {} B)",
                    ms(l.submitted_ns),
                    l.timeout_ns / 1_000_000,
                    l.bytes.last().copied().unwrap_or(0)
                )
            })
            .collect();
        Some(format!(
            "{} accepted transfer(s) never got a terminal event in clause {} (waited {first_ms} ms after the clause, cancelled them, waited {} ms more): {}{}",
            missing.len(),
            self.context,
            second_wait.as_millis(),
            shown.join(", "),
            if missing.len() > shown.len() { ", ..." } else { "" }
        ))
    }

    fn check_ledger(&self, events: &[WireEvent], ctx: &mut Ctx) {
        let mut terminals: BTreeMap<u64, Vec<&WireEvent>> = BTreeMap::new();
        for e in events.iter().filter(|e| e.flags & event_flags::INCOMING == 0) {
            let kind = EventKind(e.kind);
            if kind != EventKind::SUCCEEDED
                && kind != EventKind::FAILED
                && kind != EventKind::QUIESCED
                && kind != EventKind::PROGRESS
            {
                continue;
            }
            match self.xfers.get(&e.xfer) {
                None => ctx.findings.add(
                    "RES-1",
                    format!(
                        "[{}] event {} for transfer id {} the harness never submitted",
                        self.context,
                        describe(e),
                        e.xfer
                    ),
                ),
                Some(x) if !x.accepted => ctx.findings.add(
                    "RES-1",
                    format!(
                        "[{}] event {} for transfer {} whose submit was refused",
                        self.context,
                        describe(e),
                        e.xfer
                    ),
                ),
                Some(_) => {}
            }
            if is_terminal(e) {
                terminals.entry(e.xfer).or_default().push(e);
            }
        }
        for (xfer, list) in &terminals {
            let allowed = self.xfers.get(xfer).map_or(1, |x| x.accepted_submits.max(1) as usize);
            if list.len() > allowed {
                let seen: Vec<String> = list.iter().map(|e| describe(e)).collect();
                ctx.findings.add(
                    "RES-1",
                    format!(
                        "[{}] transfer {xfer} got {} terminal events: {}",
                        self.context,
                        list.len(),
                        seen.join(", ")
                    ),
                );
            }
        }
        let reused = |xfer: u64| self.xfers.get(&xfer).is_some_and(|x| x.accepted_submits > 1);
        for (clause, finding) in event_order_findings(events, reused) {
            ctx.findings.add(clause, format!("[{}] {finding}", self.context));
        }
        // CONFORMANCE: OBS-5 (every PROGRESS event of the run)
        let lives =
            |xfer: u64| self.xfers.get(&xfer).filter(|x| x.accepted).map(|x| x.bytes.clone()).unwrap_or_default();
        for finding in progress_findings(events, lives) {
            ctx.findings.add("OBS-5", format!("[{}] {finding}", self.context));
        }
    }
}

/// The accepted transfers of `xfers` with fewer terminal events in `events` than accepted submits.
fn without_terminal(xfers: &BTreeMap<u64, Xfer>, events: &[WireEvent]) -> Vec<u64> {
    let mut ended: BTreeMap<u64, u32> = BTreeMap::new();
    for e in events.iter().filter(|e| is_terminal(e)) {
        *ended.entry(e.xfer).or_default() += 1;
    }
    xfers
        .iter()
        .filter(|(x, l)| l.accepted && ended.get(x).copied().unwrap_or(0) < l.accepted_submits)
        .map(|(x, _)| *x)
        .collect()
}

/// OBS-5 on one side's outgoing events: the `PROGRESS` bytes of a transfer never go down, never exceed
/// the bytes it was submitted with, and no `PROGRESS` comes after its terminal event. `lives(xfer)`
/// gives the bytes of each accepted submit under the id, in order: an id submitted again after its
/// first transfer ended (DATA-3) starts a new life, with its own total, at the first `PROGRESS` or
/// terminal event after that end. Events of ids with no accepted submit are RES-1's.
fn progress_findings(events: &[WireEvent], lives: impl Fn(u64) -> Vec<u64>) -> Vec<String> {
    struct Life {
        index: usize,
        last: Option<u64>,
        ended: bool,
    }
    let mut findings = Vec::new();
    let mut state: BTreeMap<u64, Life> = BTreeMap::new();
    for e in events.iter().filter(|e| e.flags & event_flags::INCOMING == 0) {
        let kind = EventKind(e.kind);
        let progress = kind == EventKind::PROGRESS;
        if !progress && !is_terminal(e) {
            continue;
        }
        let totals = lives(e.xfer);
        if totals.is_empty() {
            continue;
        }
        let life = state.entry(e.xfer).or_insert(Life { index: 0, last: None, ended: false });
        if life.ended && life.index + 1 < totals.len() {
            *life = Life { index: life.index + 1, last: None, ended: false };
        }
        if !progress {
            life.ended = true;
            continue;
        }
        let total = totals[life.index];
        if life.ended {
            findings.push(format!("{} carries {} bytes after the transfer's terminal event", describe(e), e.bytes));
        } else if let Some(last) = life.last.filter(|last| e.bytes < *last) {
            findings.push(format!(
                "{} carries {} bytes after a PROGRESS of {last} bytes: progress went backwards",
                describe(e),
                e.bytes
            ));
        } else if e.bytes > total {
            findings.push(format!(
                "{} carries {} bytes, more than the {total} bytes the transfer was submitted with",
                describe(e),
                e.bytes
            ));
        }
        life.last = Some(life.last.map_or(e.bytes, |l| l.max(e.bytes)));
    }
    findings
}

/// RES-3 on the order of one side's outgoing events: QUIESCED only after a FAILED that did not carry
/// the flag, at most once (PROGRESS after a terminal event is OBS-5's, [`progress_findings`]). An id
/// the harness submitted again after its first transfer ended (`reused`, DATA-3) starts a new life at
/// its next terminal event.
fn event_order_findings(events: &[WireEvent], reused: impl Fn(u64) -> bool) -> Vec<(&'static str, String)> {
    let mut findings = Vec::new();
    let mut state: BTreeMap<u64, &str> = BTreeMap::new();
    for e in events.iter().filter(|e| e.flags & event_flags::INCOMING == 0) {
        let kind = EventKind(e.kind);
        let s = match state.get(&e.xfer).copied().unwrap_or("live") {
            "done" if (kind == EventKind::SUCCEEDED || kind == EventKind::FAILED) && reused(e.xfer) => "live",
            s => s,
        };
        let next = match (s, kind) {
            ("live", EventKind::SUCCEEDED) => "done",
            ("live", EventKind::FAILED) if e.flags & event_flags::QUIESCED != 0 => "done",
            ("live", EventKind::FAILED) => "failed",
            ("failed", EventKind::QUIESCED) => "done",
            (_, EventKind::QUIESCED) => {
                findings.push((
                    "RES-3",
                    format!(
                        "{} came while the transfer was {s} (QUIESCED only follows a FAILED without the flag)",
                        describe(e)
                    ),
                ));
                s
            }
            _ => s,
        };
        state.insert(e.xfer, next);
    }
    findings
}

/// OBS-1 and HYGIENE-1 on one event's fields.
fn check_event_fields(e: &WireEvent, ctx: &mut Ctx) {
    let kind = EventKind(e.kind);
    if !kind.is_known() {
        ctx.findings.add("OBS-1", format!("[{}] event of undeclared kind {}", ctx.current, e.kind));
        return;
    }
    let needs_reason =
        [EventKind::FAILED, EventKind::INCOMING_FAILED, EventKind::PEER_DOWN, EventKind::UNHEALTHY].contains(&kind);
    if needs_reason {
        let reason = ReasonCode(e.reason);
        if e.reason == 0 || !reason.is_known() || e.message.trim().is_empty() {
            ctx.findings.add(
                "OBS-1",
                format!(
                    "[{}] {} carries reason code {} and message {:?}",
                    ctx.current,
                    describe(e),
                    e.reason,
                    e.message
                ),
            );
        }
        if reason == ReasonCode::PANIC {
            ctx.findings.add("HYGIENE-1", format!("[{}] {}: {}", ctx.current, describe(e), e.message));
        }
    }
}

pub fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Open { .. } => "open",
        Op::TryOpen { .. } => "open",
        Op::Info => "info",
        Op::Endpoint => "local_endpoint",
        Op::Connect { .. } => "connect",
        Op::Disconnect { .. } => "disconnect",
        Op::Alloc { .. } => "alloc",
        Op::Register { .. } | Op::RegisterRaw { .. } => "register",
        Op::Deregister { .. } => "deregister",
        Op::Import { .. } => "import_remote_key",
        Op::Release { .. } => "release_remote_key",
        Op::Fill { .. } => "fill",
        Op::Checksum { .. } => "checksum",
        Op::Submit { .. } | Op::SubmitMany { .. } => "submit",
        Op::Cancel { .. } | Op::CancelMany { .. } => "cancel",
        Op::ExpectIncoming { .. } => "expect_incoming",
        Op::CancelIncoming { .. } => "cancel_incoming",
        Op::Stats => "stats",
        Op::Shutdown => "shutdown",
        Op::Exit => "exit",
    }
}

/// One segment covering `len` bytes at the given offsets.
pub fn seg(src: &Src, src_off: u64, dst: &Dst, dst_off: u64, len: u64) -> Seg {
    Seg { local: src.key, local_offset: src_off, remote: dst.remote, remote_offset: dst_off, len }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_situation_of_a_clause_is_counted_on_its_own() {
        let mut ctx = Ctx {
            limits: HarnessLimits::default(),
            plugin: String::new(),
            plugin_config: String::new(),
            cmd: PeerCommand::from_current_process().unwrap(),
            rng: SplitMix64::new(1),
            findings: Findings::default(),
            current: "ABORT-4",
            exercised: BTreeMap::new(),
        };
        ctx.exercise("ABORT-4", "storm", 5, 10, Status::NotExercised);
        ctx.exercise("ABORT-4", "under load", 0, 400, Status::NotExercised);
        ctx.exercise("ABORT-4", "storm", 1, 10, Status::NotExercised);
        let list = &ctx.exercised["ABORT-4"];
        assert_eq!(list.len(), 2);
        assert_eq!((list[0].seen, list[0].tries), (6, 20), "the same situation adds up");
        assert_eq!(
            (list[1].seen, list[1].tries),
            (0, 400),
            "another situation is kept apart: one never seen leaves the clause not exercised"
        );
    }

    fn event(xfer: u64, kind: EventKind, flags: u32) -> WireEvent {
        WireEvent { kind: kind.0, xfer, peer: 1, reason: 0, bytes: 0, flags, message: String::new(), t_ns: 0 }
    }

    #[test]
    fn quiesced_only_follows_a_failed_without_the_flag() {
        let ok = [event(1, EventKind::FAILED, 0), event(1, EventKind::QUIESCED, 0), event(2, EventKind::SUCCEEDED, 0)];
        assert!(event_order_findings(&ok, |_| false).is_empty());
        let late = [event(1, EventKind::SUCCEEDED, 0), event(1, EventKind::QUIESCED, 0)];
        let findings = event_order_findings(&late, |_| false);
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].0, "RES-3");
        let twice = [event(1, EventKind::FAILED, event_flags::QUIESCED), event(1, EventKind::QUIESCED, 0)];
        assert_eq!(event_order_findings(&twice, |_| false).len(), 1);
    }

    fn progress(xfer: u64, bytes: u64) -> WireEvent {
        WireEvent { bytes, ..event(xfer, EventKind::PROGRESS, 0) }
    }

    // CONFORMANCE: OBS-5
    #[test]
    fn progress_moves_forward_within_the_total_and_stops_at_the_terminal_event() {
        let lives = |x: u64| if x == 9 { vec![] } else { vec![100] };
        let ok = [
            progress(1, 10),
            progress(1, 10),
            progress(1, 100),
            event(1, EventKind::SUCCEEDED, 0),
            progress(2, 0),
            event(2, EventKind::FAILED, 0),
            event(2, EventKind::QUIESCED, 0),
        ];
        assert!(progress_findings(&ok, lives).is_empty(), "{:?}", progress_findings(&ok, lives));
        let backwards = [progress(1, 60), progress(1, 40), progress(1, 50)];
        let f = progress_findings(&backwards, lives);
        assert_eq!(f.len(), 2, "40 after 60, and 50 after 60: {f:?}");
        assert!(f[0].contains("went backwards"), "{f:?}");
        let beyond = progress_findings(&[progress(1, 101)], lives);
        assert!(beyond.len() == 1 && beyond[0].contains("more than the 100 bytes"), "{beyond:?}");
        let after = progress_findings(&[event(1, EventKind::FAILED, event_flags::QUIESCED), progress(1, 5)], lives);
        assert!(after.len() == 1 && after[0].contains("after the transfer's terminal event"), "{after:?}");
        // Events of an id never accepted are RES-1's, not OBS-5's; incoming events are not a transfer's.
        assert!(progress_findings(&[progress(9, 5000)], lives).is_empty());
        assert!(progress_findings(&[WireEvent { flags: event_flags::INCOMING, ..progress(1, 5000) }], lives).is_empty());
    }

    #[test]
    fn an_id_submitted_again_starts_its_progress_afresh_with_its_own_total() {
        let lives = |_| vec![1000, 64];
        let events = [
            progress(7, 900),
            event(7, EventKind::SUCCEEDED, 0),
            progress(7, 10),
            progress(7, 64),
            event(7, EventKind::SUCCEEDED, 0),
        ];
        assert!(progress_findings(&events, lives).is_empty(), "{:?}", progress_findings(&events, lives));
        let over = [event(7, EventKind::SUCCEEDED, 0), progress(7, 65)];
        assert_eq!(progress_findings(&over, lives).len(), 1, "the second life's total is 64");
        let third = [event(7, EventKind::SUCCEEDED, 0), event(7, EventKind::SUCCEEDED, 0), progress(7, 1)];
        assert_eq!(progress_findings(&third, lives).len(), 1, "no third life: progress after the last terminal event");
    }

    #[test]
    fn a_transfer_is_unended_until_each_accepted_submit_has_its_terminal_event() {
        let mut xfers = BTreeMap::new();
        xfers.insert(1, Xfer::new(true, 0, 1, 10));
        xfers.insert(2, Xfer::new(false, 0, 1, 10));
        let mut twice = Xfer::new(true, 0, 1, 10);
        twice.accepted_submits = 2;
        xfers.insert(3, twice);
        assert_eq!(without_terminal(&xfers, &[]), vec![1, 3], "a refused submit needs no event");
        let one_each =
            [event(1, EventKind::SUCCEEDED, 0), event(3, EventKind::FAILED, 0), event(3, EventKind::QUIESCED, 0)];
        assert_eq!(without_terminal(&xfers, &one_each), vec![3], "QUIESCED is not terminal; id 3 was accepted twice");
        let incoming = [WireEvent { flags: event_flags::INCOMING, ..event(1, EventKind::FAILED, 0) }];
        assert_eq!(without_terminal(&xfers, &incoming), vec![1, 3], "an incoming event ends no transfer");
    }

    #[test]
    fn an_id_submitted_again_after_it_ended_starts_a_new_life() {
        // The first transfer succeeded; the second, under the same id, was cancelled mid-copy.
        let events =
            [event(7, EventKind::SUCCEEDED, 0), event(7, EventKind::FAILED, 0), event(7, EventKind::QUIESCED, 0)];
        assert!(event_order_findings(&events, |x| x == 7).is_empty());
        // The same events for an id submitted once break RES-3.
        assert_eq!(event_order_findings(&events, |_| false).len(), 1);
        // A reused id still gets one QUIESCED per life.
        let extra = [
            event(7, EventKind::SUCCEEDED, 0),
            event(7, EventKind::FAILED, 0),
            event(7, EventKind::QUIESCED, 0),
            event(7, EventKind::QUIESCED, 0),
        ];
        assert_eq!(event_order_findings(&extra, |x| x == 7).len(), 1);
    }
}
