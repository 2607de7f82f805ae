//! Endpoints to remote instances: creating one per instance (shared by every peer id naming it),
//! dropping a peer or a whole instance (failing its transfers with `PEER_LOST`, closing the endpoint),
//! watching same-host peers' processes through a pidfd, and the remote keys unpacked on each endpoint.

use super::*;

impl Engine {
    pub(super) fn connect(&mut self, peer: PeerId, instance: u64, address: &[u8], process: Option<u32>) {
        if let Some(&old) = self.peers.get(&peer) {
            // A reconnect ends the peer's transfers; the endpoint stays when it reaches the same instance.
            self.drop_peer(peer, "peer reconnected (new incarnation)", false, false, true, old == instance);
        }
        // An endpoint kept since a disconnect reaching the instance at another worker address (the
        // peer now reached through a proxy, say) is closed: the new address gets its own endpoint.
        let moved = self.conns.get(&instance).is_some_and(|c| c.parked.is_some() && c.address != address);
        if moved {
            if let Some(conn) = self.conns.remove(&instance) {
                let quiesce = conn.parked.as_ref().map(|(_, xfers)| xfers.clone()).unwrap_or_default();
                self.retire_endpoint(instance, conn, false, quiesce);
            }
        }
        if let Some(conn) = self.conns.get_mut(&instance) {
            if conn.parked.take().is_some() {
                tracing::info!(peer = peer.0, "ucx endpoint kept since the disconnect taken up again");
            }
            conn.users.push(peer);
            self.peers.insert(peer, instance);
            return;
        }
        if self.closed_endpoints.contains(&(instance, address.to_vec())) {
            // Its endpoint was closed (lost, gone, or not taken up within endpoint_linger_ms): a
            // second endpoint to the same remote worker is what crashed UCX 1.13's TCP transport.
            let message = format!(
                "peer {} names a remote UCX worker address this plugin instance closed its endpoint to; a \
                 second endpoint to it is not made (reload the plugin, or restart the peer, to reach it again)",
                peer.0
            );
            tracing::warn!(reason = "peer_unreachable", peer = peer.0, "{message}");
            if let Some(p) = self.shared.lock().peers.get_mut(&peer) {
                p.down = true;
            }
            self.shared.sink.deliver(Event::peer_down(peer, ReasonCode::PEER_UNREACHABLE, message));
            return;
        }
        self.create_endpoint(instance, address, process, vec![peer]);
    }

    /// Create the one endpoint to `instance`, used by `users`.
    fn create_endpoint(&mut self, instance: u64, address: &[u8], process: Option<u32>, users: Vec<PeerId>) {
        let Some(&first) = users.first() else { return };
        let token = self.token();
        let try_peer_mode = !self.shared.config.shared_memory_only();
        let mut created =
            self.worker.connect(address, try_peer_mode, Some(receiver::ep_failed), token).map(|ep| (ep, try_peer_mode));
        if created.is_err() && try_peer_mode {
            tracing::info!(peer = first.0, "ucx endpoint without peer-failure handling (the transport offers none)");
            created = self.worker.connect(address, false, Some(receiver::ep_failed), token).map(|ep| (ep, false));
        }
        match created {
            Ok((ep, peer_failure_handling)) => {
                self.ep_tokens.insert(token, instance);
                let watched = process.filter(|_| !peer_failure_handling);
                let process_fd = watched.and_then(|pid| open_process_fd(first, pid));
                for peer in &users {
                    self.peers.insert(*peer, instance);
                }
                let conn = PeerConn {
                    ep,
                    address: address.to_vec(),
                    peer_failure_handling,
                    token,
                    rkeys: HashMap::new(),
                    process_fd,
                    users,
                    outstanding: 0,
                    parked: None,
                };
                self.conns.insert(instance, conn);
                if let (Some(pid), None) = (watched, process_fd) {
                    if process_gone(pid) {
                        self.peer_process_exited(instance, pid);
                    }
                }
            }
            Err(e) => {
                for peer in users {
                    let message = format!("cannot create a UCX endpoint to peer {}: {e}", peer.0);
                    tracing::warn!(reason = "peer_unreachable", peer = peer.0, "{message}");
                    if let Some(p) = self.shared.lock().peers.get_mut(&peer) {
                        p.down = true;
                    }
                    // No endpoint: its submits are refused `PEER_LOST`.
                    self.peers.remove(&peer);
                    self.shared.sink.deliver(Event::peer_down(peer, ReasonCode::PEER_UNREACHABLE, message));
                }
            }
        }
    }

    /// The endpoint `peer` uses.
    pub(super) fn conn_of(&self, peer: PeerId) -> Option<&PeerConn> {
        self.peers.get(&peer).and_then(|instance| self.conns.get(instance))
    }

    /// The remote instance is gone (goodbye, endpoint failure, process exit): every peer id that
    /// names it is marked down and dropped (`why` gets the peer id), and its endpoint closed by force.
    /// Peer ids whose endpoint this thread has not made yet are marked down too (their transfers
    /// are then refused with `PEER_LOST`).
    pub(super) fn drop_instance(&mut self, instance: u64, why: impl Fn(PeerId) -> String) {
        for info in self.shared.lock().peers.values_mut().filter(|p| p.instance == instance) {
            info.down = true;
        }
        let users = self.conns.get(&instance).map(|c| c.users.clone()).unwrap_or_default();
        for peer in users {
            self.drop_peer(peer, &why(peer), true, true, true, false);
        }
        // An endpoint kept after a disconnect goes now: its peer is gone or it failed.
        if self.conns.get(&instance).is_some_and(|c| c.users.is_empty()) {
            if let Some(conn) = self.conns.remove(&instance) {
                let quiesce = conn.parked.as_ref().map(|(_, xfers)| xfers.clone()).unwrap_or_default();
                self.retire_endpoint(instance, conn, true, quiesce);
            }
        }
    }

    /// Close the endpoints kept after a disconnect that nobody took up within `endpoint_linger_ms`.
    pub(super) fn close_lingering(&mut self, now: Instant) {
        let linger = Duration::from_millis(self.shared.config.endpoint_linger_ms);
        let expired: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.parked.as_ref().is_some_and(|(since, _)| now.duration_since(*since) >= linger))
            .map(|(instance, _)| *instance)
            .collect();
        for instance in expired {
            if let Some(conn) = self.conns.remove(&instance) {
                tracing::info!(instance, "ucx endpoint not taken up within endpoint_linger_ms: closed");
                let quiesce = conn.parked.as_ref().map(|(_, xfers)| xfers.clone()).unwrap_or_default();
                self.retire_endpoint(instance, conn, false, quiesce);
            }
        }
    }

    /// Close every endpoint kept after a disconnect (shutdown), claiming nothing quiesced.
    pub(super) fn close_all_lingering(&mut self) {
        let parked: Vec<u64> =
            self.conns.iter().filter(|(_, c)| c.users.is_empty()).map(|(instance, _)| *instance).collect();
        for instance in parked {
            if let Some(conn) = self.conns.remove(&instance) {
                self.retire_endpoint(instance, conn, false, Vec::new());
            }
        }
    }

    /// Fail every transfer to `peer` with `PEER_LOST` and forget the peer; close its endpoint (by force
    /// where UCX allows) when no other peer id uses it and `keep_endpoint` is false. With
    /// `close_quiesces`, its transfers quiesce once the endpoint is retired (closed, and every request
    /// posted on it handed back by UCX); on an endpoint that stays open they end with a cancel message
    /// and quiesce on the receiver's answer, as any failure.
    /// `peer_gone`: the peer said goodbye or UCX declared it dead, so closing by force cannot upset it.
    // CONFORMANCE: HANDSHAKE-2, TIME-3 (the peer's transfers fail, its keys and endpoint go)
    pub(super) fn drop_peer(
        &mut self,
        peer: PeerId,
        why: &str,
        announce_down: bool,
        peer_gone: bool,
        close_quiesces: bool,
        keep_endpoint: bool,
    ) {
        let instance = self.peers.get(&peer).copied();
        let shared_with_others =
            instance.and_then(|i| self.conns.get(&i)).is_some_and(|c| c.users.iter().any(|p| *p != peer));
        let has_endpoint = instance.is_some_and(|i| self.conns.contains_key(&i));
        let last_user = has_endpoint && !shared_with_others && !keep_endpoint;
        // A host's disconnect of an endpoint UCX has not failed keeps it for a while (see
        // `endpoint_linger_ms`); its transfers end as on an endpoint that stays open.
        let parks = last_user && !peer_gone && close_quiesces && self.shared.config.endpoint_linger_ms > 0;
        let closes_endpoint = last_user && !parks;
        let victims: Vec<u64> =
            self.xfers.iter().filter(|(_, e)| e.data.job.peer == peer).map(|(id, _)| id.0).collect();
        for xfer in &victims {
            if closes_endpoint {
                if let Some(x) = self.xfers.get_mut(XferId(*xfer)) {
                    x.next_segment = x.job.segments.len();
                    x.final_sent = true;
                    x.cancel_sent = true;
                    x.closing = close_quiesces;
                }
            }
            self.fail(*xfer, ReasonCode::PEER_LOST, why.to_string());
        }
        self.peers.remove(&peer);
        if let Some(instance) = instance {
            if let Some(conn) = self.conns.get_mut(&instance) {
                conn.users.retain(|p| *p != peer);
            }
            if parks {
                if let Some(conn) = self.conns.get_mut(&instance) {
                    conn.parked = Some((Instant::now(), victims.clone()));
                }
            }
            let conn = if closes_endpoint { self.conns.remove(&instance) } else { None };
            if let Some(conn) = conn {
                let quiesce = if close_quiesces { victims.clone() } else { Vec::new() };
                self.retire_endpoint(instance, conn, peer_gone, quiesce);
            }
        }
        if announce_down {
            tracing::warn!(reason = "peer_lost", peer = peer.0, "ucx peer lost: {why}");
            self.shared.sink.deliver(Event::peer_down(peer, ReasonCode::PEER_LOST, why.to_string()));
        }
    }

    /// Close `conn` (by force where UCX allows) and keep it as retiring until UCX has completed the
    /// close and handed back every request posted on it: only then are its remote keys destroyed
    /// and `quiesce` reported quiesced. The endpoint is never used again, and no other endpoint to
    /// the same address is made (`closed_endpoints`).
    fn retire_endpoint(&mut self, instance: u64, conn: PeerConn, peer_gone: bool, quiesce: Vec<u64>) {
        self.closed_endpoints.insert((instance, conn.address.clone()));
        self.ep_tokens.remove(&conn.token);
        if let Some(fd) = conn.process_fd {
            // SAFETY: the pidfd was opened by this thread for this endpoint and leaves the books here, so
            // it is closed once.
            unsafe { libc::close(fd) };
        }
        let retiring = RetiringConn {
            instance,
            rkeys: conn.rkeys,
            outstanding: conn.outstanding,
            close_pending: false,
            quiesce,
            since: Instant::now(),
            warned: false,
            abandoned: false,
        };
        self.retiring.insert(conn.token, retiring);
        let token = self.token();
        let force = conn.peer_failure_handling || peer_gone;
        // SAFETY: the endpoint left `conns` just before (it is never posted on again), so it is closed once.
        match unsafe { ucp::close_ep(conn.ep, force, Some(receiver::send_done), token) } {
            Posted::Pending(request) => {
                if let Some(r) = self.retiring.get_mut(&conn.token) {
                    r.close_pending = true;
                }
                let kind = ReqKind::Close { conn: conn.token };
                self.requests.insert(token, Req { request, kind, header: Vec::new(), bytes: 0, conn: 0, hold: None });
            }
            Posted::Done => {}
            Posted::Failed(status) if peer_gone => {
                // UCX keeps the endpoint (a force close needs peer-failure handling, which shared
                // memory lacks) and may never hand its requests back, but the peer is gone: nothing
                // reads or writes for them any more. They are left to UCX: each keeps its region
                // registered (a `deregister` of it quarantines it), and the remote keys are kept.
                let r = self.retiring.get_mut(&conn.token).expect("just listed");
                tracing::warn!(
                    reason = "endpoint_abandoned",
                    instance,
                    requests = r.outstanding,
                    "ucx endpoint to a gone peer not closed ({}): its {} request(s) are left to UCX, their \
                     regions stay registered",
                    ucp::status_text(status),
                    r.outstanding
                );
                r.outstanding = 0;
                r.abandoned = true;
                // Their bytes no longer count against `max_posted_bytes`.
                for req in self.requests.values_mut().filter(|req| req.conn == conn.token) {
                    self.posted_bytes -= std::mem::take(&mut req.bytes);
                }
            }
            Posted::Failed(status) => {
                tracing::warn!(
                    reason = "transport_error",
                    instance,
                    "ucx endpoint close: {}; retired once UCX hands back its requests",
                    ucp::status_text(status)
                );
            }
        }
        self.maybe_retire(conn.token);
    }

    /// Retire the closed endpoint `conn` if UCX holds nothing of it any more: destroy its remote
    /// keys (no request uses them) and quiesce its transfers.
    pub(super) fn maybe_retire(&mut self, conn: u64) {
        let done = self.retiring.get(&conn).is_some_and(|r| r.outstanding == 0 && !r.close_pending);
        if !done {
            return;
        }
        let Some(retired) = self.retiring.remove(&conn) else { return };
        if !retired.abandoned {
            for (_, rkey) in retired.rkeys {
                // SAFETY: unpacked by this thread on the retired endpoint; every request posted on it has
                // been handed back, so none uses the key; it leaves the books here.
                unsafe { ucp::rkey_destroy(rkey) };
            }
        }
        self.closed(&retired.quiesce, retired.abandoned);
    }

    /// Warn (once per endpoint) about endpoints still retiring after `quiesce_timeout_ms`: UCX has
    /// not handed back every request posted on them, so their transfers stay unquiesced, their
    /// source memory held, and a new endpoint to that instance waits.
    pub(super) fn check_retiring(&mut self, now: Instant) {
        let bound = Duration::from_millis(self.shared.config.quiesce_timeout_ms);
        for (token, r) in self.retiring.iter_mut() {
            if !r.warned && now.duration_since(r.since) >= bound {
                r.warned = true;
                tracing::warn!(
                    reason = "endpoint_retire_pending",
                    endpoint = *token,
                    instance = r.instance,
                    requests = r.outstanding,
                    close_pending = r.close_pending,
                    "ucx endpoint closed {} ms ago still has {} request(s) in UCX (quiesce_timeout_ms = {}); \
                     its transfers stay unquiesced and a new endpoint to that peer waits",
                    now.duration_since(r.since).as_millis(),
                    r.outstanding,
                    self.shared.config.quiesce_timeout_ms
                );
            }
        }
    }

    /// The endpoint of these transfers is retired: nothing of theirs can land any more (`abandoned`:
    /// their requests were left to UCX with a gone peer, and no longer count as posted).
    pub(super) fn closed(&mut self, xfers: &[u64], abandoned: bool) {
        for xfer in xfers {
            if let Some(x) = self.xfers.get_mut(XferId(*xfer)) {
                x.awaiting_reply = false;
                x.flush_done = true;
                x.closing = false;
                if abandoned {
                    x.posted = 0;
                }
            }
            self.maybe_finish(*xfer);
        }
    }

    pub(super) fn rkey_for(&mut self, peer: PeerId, remote_key: u64, xfer: u64) -> Result<ucp_rkey_h, String> {
        let instance = *self.peers.get(&peer).ok_or("no endpoint")?;
        let conn = self.conns.get_mut(&instance).ok_or("no endpoint")?;
        if let Some(rkey) = conn.rkeys.get(&remote_key) {
            return Ok(*rkey);
        }
        let x = self.xfers.get(XferId(xfer)).ok_or("no transfer")?;
        let remote =
            x.job.remote_regions.iter().find(|r| r.id == remote_key).ok_or("remote key not held by the job")?;
        // SAFETY: `conn.ep` is live while it is in `conns`.
        let rkey = unsafe { ucp::rkey_unpack(conn.ep, &remote.packed_rkey) }.map_err(|e| e.to_string())?;
        conn.rkeys.insert(remote_key, rkey);
        Ok(rkey)
    }

    /// Peers watched through a pidfd (same host, no UCX peer-failure handling): a process that has
    /// exited is a lost peer, as UCX's error handler would report over TCP. Runs every
    /// `SWEEP_INTERVAL_MS`, so a killed peer fails its transfers within about that.
    pub(super) fn check_peer_processes(&mut self) {
        let exited: Vec<u64> = self
            .conns
            .iter()
            .filter_map(|(instance, conn)| conn.process_fd.map(|fd| (*instance, fd)))
            .filter(|&(_, fd)| {
                let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                // SAFETY: `pfd` is one valid pollfd on the stack, the count is 1 and the timeout 0 (no wait).
                let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
                ready > 0 && pfd.revents != 0
            })
            .map(|(instance, _)| instance)
            .collect();
        for instance in exited {
            self.peer_process_exited(instance, 0);
        }
    }

    fn peer_process_exited(&mut self, instance: u64, pid: u32) {
        self.drop_instance(instance, |peer| {
            if pid != 0 {
                format!("peer {} process {pid} is gone", peer.0)
            } else {
                format!("peer {} process exited", peer.0)
            }
        });
    }

    pub(super) fn release_rkey(&mut self, id: u64) {
        let in_use = self.xfers.iter().any(|(_, e)| e.data.job.remote_regions.iter().any(|r| r.id == id));
        if in_use {
            return; // destroyed with the endpoint
        }
        for conn in self.conns.values_mut() {
            if let Some(rkey) = conn.rkeys.remove(&id) {
                // SAFETY: the last user of this rkey is gone; it leaves the books here.
                unsafe { ucp::rkey_destroy(rkey) };
            }
        }
    }
}

/// `pidfd_open(pid)`: a descriptor that becomes readable when the process exits; `None` (logged) when
/// the kernel refuses (no pidfd support, another pid namespace, the process already gone).
fn open_process_fd(peer: PeerId, pid: u32) -> Option<i32> {
    // SAFETY: pidfd_open takes a pid and flags by value and touches no memory of ours; a failure is returned
    // and handled.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        let error = std::io::Error::last_os_error();
        tracing::info!(
            peer = peer.0,
            pid,
            "ucx peer process not watched (pidfd_open: {error}); deadlines bound its transfers"
        );
        return None;
    }
    Some(fd as i32)
}

/// Whether `pid` names no process (`kill(pid, 0)` says ESRCH).
fn process_gone(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks that the process exists; it sends nothing and touches no memory
    // of ours.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}
