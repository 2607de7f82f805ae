//! The userspace relay between the two TUN devices: per direction a reader thread (reads IP packets
//! from one TUN, drops at random or while the link is black-holed, queues behind the rate) and a
//! writer thread (writes each packet into the other TUN once its delay has passed). The shaping can
//! change while packets flow. Holds the TUN file descriptors; stopping it closes them, which removes
//! both devices.

use crate::profile::Profile;
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The largest packet read from a TUN (its MTU is at most 65535).
const MAX_PACKET: usize = 65_536;
/// How often the threads look at the stop flag while nothing moves.
const IDLE_POLL_MS: i32 = 50;

/// What the relay does to packets now; changed through `Link::set_profile` / `set_black_hole`.
#[derive(Default)]
pub(crate) struct Shaping {
    delay_ns: AtomicU64,
    /// Loss probability in parts per 2^32.
    loss_per_2_32: AtomicU64,
    /// 0: no rate.
    rate_bytes_per_s: AtomicU64,
    queue_bytes: AtomicU64,
    black_hole: AtomicBool,
}

impl Shaping {
    pub(crate) fn set(&self, p: &Profile) {
        self.delay_ns.store(p.one_way_delay.as_nanos() as u64, Relaxed);
        self.loss_per_2_32.store((p.loss * 4_294_967_296.0) as u64, Relaxed);
        self.rate_bytes_per_s.store(p.rate_bytes_per_s.unwrap_or(0), Relaxed);
        self.queue_bytes.store(p.queue_bytes, Relaxed);
    }
    pub(crate) fn set_black_hole(&self, on: bool) {
        self.black_hole.store(on, Relaxed);
    }
}

/// Counters of one direction.
#[derive(Default, Debug)]
pub struct DirectionStats {
    pub forwarded_packets: AtomicU64,
    pub forwarded_bytes: AtomicU64,
    /// Dropped by the random loss.
    pub lost_packets: AtomicU64,
    /// Dropped while the link was black-holed.
    pub black_holed_packets: AtomicU64,
    /// Dropped because the rate's queue was full.
    pub queue_drops: AtomicU64,
}

/// A snapshot of one direction's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirectionCounts {
    pub forwarded_packets: u64,
    pub forwarded_bytes: u64,
    pub lost_packets: u64,
    pub black_holed_packets: u64,
    pub queue_drops: u64,
}

impl DirectionStats {
    pub fn snapshot(&self) -> DirectionCounts {
        DirectionCounts {
            forwarded_packets: self.forwarded_packets.load(Relaxed),
            forwarded_bytes: self.forwarded_bytes.load(Relaxed),
            lost_packets: self.lost_packets.load(Relaxed),
            black_holed_packets: self.black_holed_packets.load(Relaxed),
            queue_drops: self.queue_drops.load(Relaxed),
        }
    }
}

pub(crate) struct Shared {
    pub(crate) shaping: Shaping,
    /// [0]: host 0 to host 1; [1]: host 1 to host 0.
    pub(crate) stats: [DirectionStats; 2],
    stop: AtomicBool,
}

struct Queue {
    packets: Mutex<VecDeque<(Instant, Vec<u8>)>>,
    ready: Condvar,
}

pub(crate) struct Relay {
    pub(crate) shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Relay {
    /// Start forwarding between `tun0` (host 0's device) and `tun1` (host 1's).
    pub(crate) fn start(tun0: OwnedFd, tun1: OwnedFd, profile: &Profile, seed: u64) -> std::io::Result<Relay> {
        let shared =
            Arc::new(Shared { shaping: Shaping::default(), stats: Default::default(), stop: AtomicBool::new(false) });
        shared.shaping.set(profile);
        let fds = [Arc::new(tun0), Arc::new(tun1)];
        for fd in &fds {
            set_nonblocking(fd)?;
        }
        let mut threads = Vec::new();
        for dir in 0..2 {
            let queue = Arc::new(Queue { packets: Mutex::new(VecDeque::new()), ready: Condvar::new() });
            let (from, to) = (fds[dir].clone(), fds[1 - dir].clone());
            let (s, q) = (shared.clone(), queue.clone());
            let rng = seed ^ (0x9e37_79b9_7f4a_7c15u64.wrapping_mul(dir as u64 + 1));
            threads.push(
                std::thread::Builder::new()
                    .name(format!("netbed-read-{dir}"))
                    .spawn(move || read_loop(&from, &s, &q, dir, rng))?,
            );
            let s = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("netbed-write-{dir}"))
                    .spawn(move || write_loop(&to, &s, &queue, dir))?,
            );
        }
        Ok(Relay { shared, threads })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn set_nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor this process owns.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// xorshift64*: the relay's loss needs speed and independence between packets, not cryptography.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

fn read_loop(fd: &OwnedFd, shared: &Shared, queue: &Queue, dir: usize, seed: u64) {
    let mut rng = seed | 1;
    let mut buf = vec![0u8; MAX_PACKET];
    // When the rate's serialiser is next free.
    let mut next_free = Instant::now();
    let stats = &shared.stats[dir];
    let shaping = &shared.shaping;
    while !shared.stop.load(Relaxed) {
        let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, IDLE_POLL_MS) };
        if ready <= 0 {
            continue;
        }
        let mut batch: Vec<(Instant, Vec<u8>)> = Vec::new();
        loop {
            // SAFETY: reading into a buffer of MAX_PACKET bytes.
            let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            let n = n as usize;
            if shaping.black_hole.load(Relaxed) {
                stats.black_holed_packets.fetch_add(1, Relaxed);
                continue;
            }
            let loss = shaping.loss_per_2_32.load(Relaxed);
            if loss > 0 && (next_random(&mut rng) >> 32) < loss {
                stats.lost_packets.fetch_add(1, Relaxed);
                continue;
            }
            let now = Instant::now();
            let rate = shaping.rate_bytes_per_s.load(Relaxed);
            let departs = if rate == 0 {
                now
            } else {
                let start = next_free.max(now);
                let backlog = start - now;
                let limit = Duration::from_secs_f64(shaping.queue_bytes.load(Relaxed) as f64 / rate as f64);
                if backlog > limit {
                    stats.queue_drops.fetch_add(1, Relaxed);
                    continue;
                }
                next_free = start + Duration::from_nanos(n as u64 * 1_000_000_000 / rate);
                next_free
            };
            batch.push((departs + Duration::from_nanos(shaping.delay_ns.load(Relaxed)), buf[..n].to_vec()));
            if batch.len() >= 64 {
                break;
            }
        }
        if !batch.is_empty() {
            queue.packets.lock().unwrap_or_else(|e| e.into_inner()).extend(batch);
            queue.ready.notify_one();
        }
    }
    queue.ready.notify_all();
}

fn write_loop(fd: &OwnedFd, shared: &Shared, queue: &Queue, dir: usize) {
    let stats = &shared.stats[dir];
    let mut due: Vec<Vec<u8>> = Vec::new();
    while !shared.stop.load(Relaxed) {
        let wait = {
            let mut q = queue.packets.lock().unwrap_or_else(|e| e.into_inner());
            if q.is_empty() {
                let (guard, _) = queue
                    .ready
                    .wait_timeout(q, Duration::from_millis(IDLE_POLL_MS as u64))
                    .unwrap_or_else(|e| e.into_inner());
                q = guard;
            }
            let now = Instant::now();
            while q.front().is_some_and(|(at, _)| *at <= now) {
                due.push(q.pop_front().expect("front exists").1);
            }
            q.front().map(|(at, _)| *at - now)
        };
        for packet in due.drain(..) {
            // SAFETY: writing one whole packet from a live buffer.
            let n = unsafe { libc::write(fd.as_raw_fd(), packet.as_ptr().cast(), packet.len()) };
            if n == packet.len() as isize {
                stats.forwarded_packets.fetch_add(1, Relaxed);
                stats.forwarded_bytes.fetch_add(packet.len() as u64, Relaxed);
            }
        }
        if let Some(wait) = wait {
            if !wait.is_zero() {
                // Sleeping is coarse (tens of microseconds late); the last stretch spins on yields.
                if wait > Duration::from_micros(100) {
                    std::thread::sleep(wait - Duration::from_micros(50));
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}
