//! The peer process: opens the plugin under test through `kvgate-host`, owns its regions, and carries
//! out the controller's requests one at a time, timing every plugin call and forwarding every event
//! with a timestamp. Never judges a result and never blocks the plugin's sink (events go to a writer thread).

use super::memory::{self, MemoryProvider};
use super::protocol::*;
use super::region::Region;
use crate::plugin_spec;
use kvgate_abi::abi_stable::std_types::{RResult, RSlice};
use kvgate_abi::sdk::sink_from_fn;
use kvgate_abi::*;
use kvgate_host::{OpenError, PluginHost};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();

fn now_ns() -> u64 {
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

fn call_error(e: &PluginError) -> CallError {
    CallError { code: e.code.0, code_name: e.code.as_str().to_string(), message: e.message.to_string() }
}

fn wire_info(i: &PluginInfo) -> WireInfo {
    let c = &i.capabilities;
    WireInfo {
        name: i.name.to_string(),
        version: i.version.to_string(),
        abi_version: i.abi_version,
        memory_kinds: c.memory_kinds,
        scope: c.scope,
        flags: c.flags,
        max_segments_per_submit: c.max_segments_per_submit,
        max_inflight_transfers: c.max_inflight_transfers,
        max_transfer_bytes: c.max_transfer_bytes,
    }
}

fn wire_stats(s: &Stats) -> WireStats {
    WireStats {
        live_transfers: s.live_transfers,
        unquiesced_transfers: s.unquiesced_transfers,
        live_tickets: s.live_tickets,
        registered_regions: s.registered_regions,
        registered_bytes: s.registered_bytes,
        imported_remote_keys: s.imported_remote_keys,
        connected_peers: s.connected_peers,
        workers_alive: s.workers_alive,
        healthy: s.healthy,
    }
}

struct Peer {
    host: Option<(PluginHost, String)>,
    opened: Option<kvgate_host::OpenedPlugin>,
    regions: HashMap<u32, Region>,
    /// Where regions live (host memory until `Open` chose from the plugin's memory kinds).
    memory: Box<dyn MemoryProvider>,
    out: mpsc::Sender<Line>,
}

/// Run the peer loop on stdin/stdout until `Exit` or end of input. Returns the exit status.
pub fn peer_main() -> i32 {
    START.get_or_init(Instant::now);
    let (tx, rx) = mpsc::channel::<Line>();
    let (exit_tx, exit_rx) = mpsc::channel::<()>();
    // The writer owns stdout. The plugin's sink keeps a sender alive for ever, so the writer ends
    // the process itself once the reply to `Exit` is written (or stdin closed).
    std::thread::spawn(move || {
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::new(stdout.lock());
        loop {
            match rx.recv_timeout(std::time::Duration::from_millis(5)) {
                Ok(line) => {
                    let _ = serde_json::to_writer(&mut out, &line);
                    let _ = out.write_all(b"\n");
                    // Drain what is queued before flushing: a storm of events costs one write.
                    while let Ok(more) = rx.try_recv() {
                        let _ = serde_json::to_writer(&mut out, &more);
                        let _ = out.write_all(b"\n");
                    }
                    let _ = out.flush();
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if exit_rx.try_recv().is_ok() {
                        let _ = out.flush();
                        std::process::exit(0);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let _ = out.flush();
                    std::process::exit(0);
                }
            }
        }
    });
    let mut peer =
        Peer { host: None, opened: None, regions: HashMap::new(), memory: Box::new(memory::HostProvider), out: tx };
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let request: Request = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("peer: bad request line: {e}");
                continue;
            }
        };
        let exit = matches!(request.op, Op::Exit);
        let started = Instant::now();
        let outcome = peer.serve(request.op);
        let call_ns = started.elapsed().as_nanos() as u64;
        let _ = peer.out.send(Line::Reply(Reply { id: request.id, t_ns: now_ns(), call_ns, outcome }));
        if exit {
            break;
        }
    }
    peer.regions.clear();
    // Never drop the plugin here: one that was shut down already joined its workers, and one that
    // was not must not get a chance to hang the exit. The writer exits once the last reply is out.
    std::mem::forget(peer.opened);
    let _ = exit_tx.send(());
    loop {
        std::thread::park();
    }
}

fn done<E>(r: RResult<(), E>, f: impl Fn(&E) -> CallError) -> Outcome {
    match r {
        RResult::ROk(()) => Outcome::Done,
        RResult::RErr(e) => Outcome::Failed { error: f(&e) },
    }
}

// Every operation answers with an `Outcome`; failing ones return it early through `?` as `Err`, so
// both sides of these `Result`s are the one reply type and boxing the error would buy nothing.
#[allow(clippy::result_large_err)]
impl Peer {
    fn t(&self) -> Result<&TransportBox, Outcome> {
        self.opened.as_ref().map(|o| o.transport()).ok_or(Outcome::PeerError { message: "plugin not open".into() })
    }

    fn serve(&mut self, op: Op) -> Outcome {
        match self.serve_inner(op) {
            Ok(o) => o,
            Err(o) => o,
        }
    }

    fn serve_inner(&mut self, op: Op) -> Result<Outcome, Outcome> {
        let perr = |m: String| Outcome::PeerError { message: m };
        Ok(match op {
            Op::Open { plugin, config, memory } => {
                let (host, name) = plugin_spec::load(&plugin).map_err(perr)?;
                let out = self.out.clone();
                let sink = sink_from_fn(move |e: Event| {
                    let _ = out.send(Line::Event(WireEvent {
                        kind: e.kind.0,
                        xfer: e.xfer.0,
                        peer: e.peer.0,
                        reason: e.reason.0,
                        bytes: e.bytes,
                        flags: e.flags,
                        message: e.message.to_string(),
                        t_ns: now_ns(),
                    }));
                });
                let opened = host.open(&name, &config, sink);
                let result = match opened {
                    Ok(opened) => {
                        let module = host.module(&name).map(|m| wire_info(&(m.info())()));
                        let instance = wire_info(opened.info());
                        self.opened = Some(opened);
                        // The regions' memory, as the plugin declares it serves (or as configured).
                        match memory::choose(&memory, instance.memory_kinds) {
                            Ok(provider) => {
                                self.memory = provider;
                                Outcome::Info { module: module.unwrap_or_else(|| instance.clone()), instance }
                            }
                            Err(reason) => {
                                Outcome::Unavailable { reason: format!("memory provider {memory:?}: {reason}"), module }
                            }
                        }
                    }
                    Err(OpenError::Unavailable { reason, .. }) => {
                        Outcome::Unavailable { reason, module: host.module(&name).map(|m| wire_info(&(m.info())())) }
                    }
                    Err(e) => Outcome::PeerError { message: format!("open failed ({}): {e}", e.code()) },
                };
                self.host = Some((host, name));
                result
            }
            Op::TryOpen { config } => {
                let (host, name) = self.host.as_ref().ok_or_else(|| perr("plugin not loaded".into()))?;
                let module = host.module(name).ok_or_else(|| perr("module missing".into()))?;
                match (module.open())(config.as_str().into(), sink_from_fn(|_| {})) {
                    RResult::ROk(t) => {
                        t.shutdown();
                        Outcome::Done
                    }
                    RResult::RErr(e) => Outcome::Failed { error: call_error(&e) },
                }
            }
            Op::Info => {
                let i = wire_info(&self.t()?.info());
                Outcome::Info { module: i.clone(), instance: i }
            }
            Op::Endpoint => Outcome::Bytes { bytes: self.t()?.local_endpoint().to_vec() },
            Op::Connect { peer, endpoint } => {
                done(self.t()?.connect(PeerId(peer), RSlice::from_slice(&endpoint)), call_error)
            }
            Op::Disconnect { peer } => {
                self.t()?.disconnect(PeerId(peer));
                Outcome::Done
            }
            Op::Alloc { rid, len, seed } => {
                let mut region = self.memory.alloc(rid, len).map_err(perr)?;
                region.fill(0, len, seed).map_err(perr)?;
                self.regions.insert(rid, region);
                Outcome::Done
            }
            Op::Register { rid } => {
                let r = self.regions.get(&rid).ok_or_else(|| perr(format!("no region {rid}")))?;
                let desc = self.memory.describe(r);
                self.register(&desc)?
            }
            Op::RegisterRaw { region } => {
                let (addr, backing) = match region.rid {
                    Some(rid) => {
                        let r = self.regions.get(&rid).ok_or_else(|| perr(format!("no region {rid}")))?;
                        (r.addr as u64 + region.addr_offset, r.path.to_string_lossy().to_string())
                    }
                    None => (0, String::new()),
                };
                let desc = RegionDesc {
                    kind: MemoryKind(region.kind),
                    device: region.device,
                    addr,
                    len: region.len,
                    backing_path: if region.backing { backing.as_str().into() } else { "".into() },
                    backing_offset: if region.backing { region.addr_offset } else { 0 },
                    ipc_handle: region.ipc_handle.into(),
                };
                self.register(&desc)?
            }
            Op::Deregister { key } => done(self.t()?.deregister(LocalKey(key)), call_error),
            Op::Import { peer, bytes } => match self.t()?.import_remote_key(PeerId(peer), RSlice::from_slice(&bytes)) {
                RResult::ROk(k) => Outcome::Key { key: k.0 },
                RResult::RErr(e) => Outcome::Failed { error: call_error(&e) },
            },
            Op::Release { key } => {
                self.t()?.release_remote_key(RemoteKey(key));
                Outcome::Done
            }
            Op::Fill { rid, offset, len, seed } => {
                let r = self.regions.get_mut(&rid).ok_or_else(|| perr(format!("no region {rid}")))?;
                r.fill(offset, len, seed).map_err(perr)?;
                Outcome::Done
            }
            Op::Checksum { rid, ranges } => {
                let r = self.regions.get_mut(&rid).ok_or_else(|| perr(format!("no region {rid}")))?;
                Outcome::Checksum { value: r.checksum(&ranges).map_err(perr)? }
            }
            Op::Submit { xfer, peer, ticket, timeout_ns, segments } => {
                let segs = to_segments(&segments);
                done(self.t()?.submit(request(xfer, peer, ticket, timeout_ns, &segs)), call_error)
            }
            Op::SubmitMany { first_xfer, count, peer, ticket, timeout_ns, segments } => {
                let t = self.t()?;
                let segs = to_segments(&segments);
                let mut errors = Vec::with_capacity(count as usize);
                let (mut started_ns, mut returned_ns) =
                    (Vec::with_capacity(count as usize), Vec::with_capacity(count as usize));
                let (mut max_call_ns, mut slowest_index) = (0, 0);
                for i in 0..count {
                    started_ns.push(now_ns());
                    let started = Instant::now();
                    let r = t.submit(request(first_xfer + i, peer, ticket, timeout_ns, &segs));
                    let ns = started.elapsed().as_nanos() as u64;
                    returned_ns.push(now_ns());
                    if ns > max_call_ns {
                        (max_call_ns, slowest_index) = (ns, i);
                    }
                    errors.push(r.into_result().err().map(|e| call_error(&e)));
                }
                Outcome::Batch { errors, max_call_ns, slowest_index, started_ns, returned_ns }
            }
            Op::Cancel { xfer } => {
                self.t()?.cancel(XferId(xfer));
                Outcome::Done
            }
            Op::CancelMany { xfers } => {
                let t = self.t()?;
                let (mut max_call_ns, mut slowest_index) = (0, 0);
                let (mut started_ns, mut returned_ns) =
                    (Vec::with_capacity(xfers.len()), Vec::with_capacity(xfers.len()));
                for (i, x) in xfers.iter().enumerate() {
                    started_ns.push(now_ns());
                    let started = Instant::now();
                    t.cancel(XferId(*x));
                    let ns = started.elapsed().as_nanos() as u64;
                    returned_ns.push(now_ns());
                    if ns > max_call_ns {
                        (max_call_ns, slowest_index) = (ns, i as u64);
                    }
                }
                Outcome::Batch { errors: vec![None; xfers.len()], max_call_ns, slowest_index, started_ns, returned_ns }
            }
            Op::ExpectIncoming { ticket, peer, timeout_ns, ranges } => {
                let ranges: Vec<LocalRange> =
                    ranges.iter().map(|&(k, o, l)| LocalRange { key: LocalKey(k), offset: o, len: l }).collect();
                let req = IncomingRequest {
                    ticket: Ticket(ticket),
                    peer: PeerId(peer),
                    timeout_ns,
                    ranges: RSlice::from_slice(&ranges),
                };
                done(self.t()?.expect_incoming(req), call_error)
            }
            Op::CancelIncoming { peer, ticket } => {
                self.t()?.cancel_incoming(PeerId(peer), Ticket(ticket));
                Outcome::Done
            }
            Op::Stats => Outcome::Stats { stats: wire_stats(&self.t()?.stats()) },
            Op::Shutdown => {
                self.t()?.shutdown();
                Outcome::Done
            }
            Op::Exit => Outcome::Done,
        })
    }

    fn register(&self, desc: &RegionDesc) -> Result<Outcome, Outcome> {
        Ok(match self.t()?.register(desc) {
            RResult::ROk(r) => Outcome::Registered { key: r.key.0, remote_key: r.remote_key.to_vec() },
            RResult::RErr(e) => Outcome::Failed { error: call_error(&e) },
        })
    }
}

fn to_segments(segs: &[Seg]) -> Vec<Segment> {
    segs.iter()
        .map(|s| Segment {
            local: LocalKey(s.local),
            local_offset: s.local_offset,
            remote: RemoteKey(s.remote),
            remote_offset: s.remote_offset,
            len: s.len,
        })
        .collect()
}

fn request(xfer: u64, peer: u64, ticket: u64, timeout_ns: u64, segs: &[Segment]) -> SubmitRequest<'_> {
    SubmitRequest {
        xfer: XferId(xfer),
        peer: PeerId(peer),
        ticket: Ticket(ticket),
        timeout_ns,
        segments: RSlice::from_slice(segs),
    }
}
