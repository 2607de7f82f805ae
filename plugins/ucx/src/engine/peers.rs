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
        if let Some(conn) = self.conns.get_mut(&instance) {
            conn.users.push(peer);
            self.peers.insert(peer, instance);
            return;
        }
        let token = self.token();
        let try_peer_mode = !self.shared.config.shared_memory_only();
        let mut created =
            self.worker.connect(address, try_peer_mode, Some(receiver::ep_failed), token).map(|ep| (ep, try_peer_mode));
        if created.is_err() && try_peer_mode {
            tracing::info!(peer = peer.0, "ucx endpoint without peer-failure handling (the transport offers none)");
            created = self.worker.connect(address, false, Some(receiver::ep_failed), token).map(|ep| (ep, false));
        }
        match created {
            Ok((ep, peer_failure_handling)) => {
                self.ep_tokens.insert(token, instance);
                let watched = process.filter(|_| !peer_failure_handling);
                let process_fd = watched.and_then(|pid| open_process_fd(peer, pid));
                let conn =
                    PeerConn { ep, peer_failure_handling, token, rkeys: HashMap::new(), process_fd, users: vec![peer] };
                self.conns.insert(instance, conn);
                self.peers.insert(peer, instance);
                if let (Some(pid), None) = (watched, process_fd) {
                    if process_gone(pid) {
                        self.peer_process_exited(instance, pid);
                    }
                }
            }
            Err(e) => {
                let message = format!("cannot create a UCX endpoint to peer {}: {e}", peer.0);
                tracing::warn!(reason = "peer_unreachable", peer = peer.0, "{message}");
                if let Some(p) = self.shared.lock().peers.get_mut(&peer) {
                    p.down = true;
                }
                self.shared.sink.deliver(Event::peer_down(peer, ReasonCode::PEER_UNREACHABLE, message));
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
    }

    /// Fail every transfer to `peer` with `PEER_LOST` and forget the peer; close its endpoint (by force
    /// where UCX allows) when no other peer id uses it and `keep_endpoint` is false. With
    /// `close_quiesces`, its transfers quiesce once the close completes; on an endpoint that stays
    /// open they end with a cancel message and quiesce on the receiver's answer, as any failure.
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
        let closes_endpoint = instance.is_some() && !shared_with_others && !keep_endpoint;
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
        let mut closed_at_once = true;
        if let Some(instance) = instance {
            if let Some(conn) = self.conns.get_mut(&instance) {
                conn.users.retain(|p| *p != peer);
            }
            let conn = if closes_endpoint { self.conns.remove(&instance) } else { None };
            if let Some(conn) = conn {
                self.ep_tokens.remove(&conn.token);
                if let Some(fd) = conn.process_fd {
                    // SAFETY: the pidfd was opened by this thread for this endpoint and leaves the books
                    // here, so it is closed once.
                    unsafe { libc::close(fd) };
                }
                for (_, rkey) in conn.rkeys {
                    // SAFETY: unpacked by this thread, dropped from the books here, used by nothing in flight.
                    unsafe { ucp::rkey_destroy(rkey) };
                }
                let token = self.token();
                let force = conn.peer_failure_handling || peer_gone;
                // SAFETY: the endpoint leaves `conns` here, so it is closed once.
                match unsafe { ucp::close_ep(conn.ep, force, Some(receiver::send_done), token) } {
                    Posted::Pending(request) => {
                        closed_at_once = false;
                        let xfers = if close_quiesces { victims.clone() } else { Vec::new() };
                        let kind = ReqKind::Close { xfers };
                        self.requests.insert(token, Req { request, kind, header: Vec::new(), bytes: 0 });
                    }
                    Posted::Done => {}
                    Posted::Failed(status) => {
                        tracing::warn!(
                            reason = "transport_error",
                            peer = peer.0,
                            "ucx endpoint close: {}",
                            ucp::status_text(status)
                        );
                    }
                }
            }
        }
        if closes_endpoint && closed_at_once && close_quiesces {
            self.closed(&victims);
        }
        if announce_down {
            tracing::warn!(reason = "peer_lost", peer = peer.0, "ucx peer lost: {why}");
            self.shared.sink.deliver(Event::peer_down(peer, ReasonCode::PEER_LOST, why.to_string()));
        }
    }

    /// The endpoint of these transfers is closed: nothing of theirs can land any more.
    pub(super) fn closed(&mut self, xfers: &[u64]) {
        for xfer in xfers {
            if let Some(x) = self.xfers.get_mut(XferId(*xfer)) {
                x.awaiting_reply = false;
                x.flush_done = true;
                x.closing = false;
                // UCX moves nothing more on a closed endpoint; requests it has not handed back yet are
                // freed when their callbacks come (the transfer is gone by then).
                x.posted = 0;
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
