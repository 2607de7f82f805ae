//! A two-host test bed on one machine: two network namespaces ("hosts"), each with a TUN device
//! `kvb0` (host 0 is 10.77.0.1, host 1 is 10.77.0.2, MTU 1500 unless the profile says otherwise),
//! joined by a userspace relay that delays every packet, drops packets at random, serialises them at
//! a rate, and can black-hole the link, each way. It needs no `netem` (many kernels lack it), only
//! root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), `/dev/net/tun` and iproute2's `ip`.
//!
//! Processes run inside a host through `Link::command` (a `std::process::Command` that enters the
//! namespace before exec); this process reaches a host's TCP listeners through `Link::tcp_connect` or
//! `Link::http_get` (sockets made inside the namespace). Unix sockets are files, shared by both hosts
//! and this process. Dropping the `Link` stops the relay and deletes both namespaces; namespaces left
//! by a process that died are deleted by the next `Link::start`.
//!
//! Used by the gateway's end-to-end tests (`gateway/tests/e2e_netbed.rs`) and by
//! `kvgate bench --link-profile` (docs/netbed.md).

mod iperf;
mod profile;
mod relay;

pub use iperf::{iperf3_available, Iperf3Result};
pub use profile::Profile;
pub use relay::DirectionCounts;

use std::ffi::CString;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The TUN device's name inside each host.
pub const DEVICE: &str = "kvb0";
/// Prefix of every namespace this crate makes (`kvb-<pid>-<n>-<host>`).
const NS_PREFIX: &str = "kvb-";

/// Why the bed cannot run here, or `Ok` when it can. Tests that need the bed report this reason
/// (they never pass silently without it).
pub fn available() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("the two-host test bed needs root (network namespaces and TUN devices)".into());
    }
    if !Path::new("/dev/net/tun").exists() {
        return Err("the two-host test bed needs /dev/net/tun (the tun kernel module)".into());
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => {}
        _ => return Err("the two-host test bed needs iproute2's `ip`".into()),
    }
    Ok(())
}

/// Whether a test that needs the bed must fail rather than skip when it is unavailable: set
/// `KVGATE_NETBED=require` (CI runs as root and sets it, so a broken bed cannot pass as a skip).
pub fn required() -> bool {
    std::env::var("KVGATE_NETBED").is_ok_and(|v| v == "require")
}

/// One host of the bed.
#[derive(Clone, Debug)]
pub struct Host {
    /// The network namespace (`ip netns` name; `/run/netns/<name>`).
    pub namespace: String,
    pub address: Ipv4Addr,
}

/// The two hosts and the shaped link between them.
pub struct Link {
    hosts: [Host; 2],
    profile: std::sync::Mutex<Profile>,
    relay: Option<relay::Relay>,
}

fn run_ip(args: &[&str]) -> std::io::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())))
    }
}

/// A TUN device (IFF_TUN | IFF_NO_PI: whole IP packets) named `name`, in this thread's namespace.
fn open_tun(name: &str) -> std::io::Result<OwnedFd> {
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    let path = CString::new("/dev/net/tun").expect("no NUL");
    // SAFETY: open of a constant path.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor this function owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req =
        IfReq { name: [0; libc::IFNAMSIZ], flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short, _pad: [0; 22] };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes one ifreq.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF as _, &mut req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// Deletes namespaces of this crate whose process is gone (a test killed mid-run).
fn delete_stale_namespaces() {
    let Ok(entries) = std::fs::read_dir("/run/netns") else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(NS_PREFIX) else { continue };
        let pid: Option<i32> = rest.split('-').next().and_then(|p| p.parse().ok());
        // SAFETY: kill with signal 0 only checks for the process.
        if pid.is_some_and(|p| unsafe { libc::kill(p, 0) } != 0) {
            let _ = run_ip(&["netns", "del", &name]);
        }
    }
}

/// Runs `f` on a fresh thread that entered `namespace`'s network namespace.
pub fn in_namespace<T: Send + 'static>(namespace: &str, f: impl FnOnce() -> T + Send + 'static) -> std::io::Result<T> {
    let ns = std::fs::File::open(format!("/run/netns/{namespace}"))?;
    std::thread::spawn(move || {
        // SAFETY: setns on this thread only, with a namespace file this closure owns.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(f())
    })
    .join()
    .map_err(|_| std::io::Error::other("the namespace thread panicked"))?
}

impl Link {
    /// Make both hosts and start the relay with `profile`.
    pub fn start(profile: &Profile) -> std::io::Result<Link> {
        available().map_err(std::io::Error::other)?;
        delete_stale_namespaces();
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let hosts = [0u8, 1]
            .map(|i| Host { namespace: format!("{NS_PREFIX}{pid}-{n}-{i}"), address: Ipv4Addr::new(10, 77, 0, i + 1) });
        let mut link = Link { hosts: hosts.clone(), profile: std::sync::Mutex::new(profile.clone()), relay: None };
        let mut fds = Vec::new();
        for (i, host) in hosts.iter().enumerate() {
            let peer = &hosts[1 - i];
            run_ip(&["netns", "add", &host.namespace])?;
            // Made in this namespace under a unique name, moved into the host, renamed there.
            let temp = format!("kvb{:x}{n}{i}", pid % 0x00ff_ffff);
            let fd = open_tun(&temp)?;
            let ns = host.namespace.as_str();
            run_ip(&["link", "set", "dev", &temp, "netns", ns])?;
            run_ip(&["-n", ns, "link", "set", "dev", &temp, "name", DEVICE])?;
            run_ip(&["-n", ns, "link", "set", "dev", DEVICE, "mtu", &profile.mtu.to_string(), "txqueuelen", "1000"])?;
            run_ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/32", host.address),
                "peer",
                &format!("{}/32", peer.address),
                "dev",
                DEVICE,
            ])?;
            run_ip(&["-n", ns, "link", "set", "dev", DEVICE, "up"])?;
            run_ip(&["-n", ns, "link", "set", "dev", "lo", "up"])?;
            fds.push(fd);
        }
        let tun1 = fds.pop().expect("two");
        let tun0 = fds.pop().expect("two");
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        link.relay = Some(relay::Relay::start(tun0, tun1, profile, seed)?);
        Ok(link)
    }

    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }
    pub fn profile(&self) -> Profile {
        self.profile.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn relay(&self) -> &relay::Relay {
        self.relay.as_ref().expect("the relay runs while the link exists")
    }

    /// Change delay, loss and rate while packets flow (MTU stays).
    pub fn set_profile(&self, profile: &Profile) {
        self.relay().shared.shaping.set(profile);
        *self.profile.lock().unwrap_or_else(|e| e.into_inner()) = profile.clone();
    }

    /// Drop every packet both ways (`true`) until called with `false`.
    pub fn set_black_hole(&self, on: bool) {
        self.relay().shared.shaping.set_black_hole(on);
    }

    /// Counters of the direction from host `from` to the other.
    pub fn counts(&self, from: usize) -> DirectionCounts {
        self.relay().shared.stats[from].snapshot()
    }

    /// A command that runs `program` inside host `i`: `ip netns exec`, which enters the namespace and
    /// mounts a `/sys` of it (UCX finds its network devices there), then execs `program` (the child's
    /// pid is the program's).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> std::io::Result<Command> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.hosts[i].namespace]).arg(program);
        Ok(cmd)
    }

    /// A TCP connection made inside host `i` to `addr` (e.g. a gateway's admin listener on its
    /// 127.0.0.1), usable from any thread of this process.
    pub fn tcp_connect(&self, i: usize, addr: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
        in_namespace(&self.hosts[i].namespace, move || TcpStream::connect_timeout(&addr, timeout))?
    }

    /// `(status, body)` of an HTTP/1.0 `GET path` on `addr` inside host `i` (blocking, bounded by `timeout`).
    pub fn http_get(
        &self,
        i: usize,
        addr: SocketAddr,
        path: &str,
        timeout: Duration,
    ) -> std::io::Result<(u16, String)> {
        let mut stream = self.tcp_connect(i, addr, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        Ok((code, body.to_string()))
    }

    /// iperf3 (TCP) from host 0 to host 1 for `seconds`, with `streams` parallel streams and TCP
    /// congestion control `congestion` (`None`: the kernel's default).
    pub fn iperf3(&self, seconds: f64, streams: u32, congestion: Option<&str>) -> Result<Iperf3Result, String> {
        iperf::run(self, seconds, streams, congestion)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Stopping the relay closes both TUN descriptors (the devices go with them).
        self.relay = None;
        for h in &self.hosts {
            let _ = run_ip(&["netns", "del", &h.namespace]);
        }
    }
}
