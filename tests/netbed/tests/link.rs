//! The bed itself: packets cross the shaped link with its delay, its loss and its black hole, and
//! iperf3 measures it. Needs root; without it each test says why and fails when `KVGATE_NETBED=require`.

use kvgate_netbed::{available, required, Link, Profile};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// `Some(reason)` when the bed cannot run here (the test then stops, loudly).
fn skip() -> Option<String> {
    match available() {
        Ok(()) => None,
        Err(why) if required() => panic!("KVGATE_NETBED=require, but {why}"),
        Err(why) => {
            eprintln!("SKIPPED (not passed): {why}");
            Some(why)
        }
    }
}

/// An echo round trip over TCP from host 0 to host 1; returns the median RTT of `n` 1-byte echoes.
fn echo_rtt(link: &Link, n: usize) -> Duration {
    let server_addr: SocketAddr = format!("{}:7000", link.host(1).address).parse().unwrap();
    let listener =
        kvgate_netbed::in_namespace(&link.host(1).namespace, move || std::net::TcpListener::bind(server_addr))
            .unwrap()
            .unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; 1];
        while s.read_exact(&mut b).is_ok() {
            s.write_all(&b).unwrap();
        }
    });
    let mut c = link.tcp_connect(0, server_addr, Duration::from_secs(5)).unwrap();
    c.set_nodelay(true).unwrap();
    let mut rtts = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        c.write_all(&[7]).unwrap();
        let mut b = [0u8; 1];
        c.read_exact(&mut b).unwrap();
        rtts.push(t.elapsed());
    }
    drop(c);
    server.join().unwrap();
    rtts.sort();
    rtts[n / 2]
}

#[test]
fn the_link_delays_each_way_and_the_black_hole_stops_everything() {
    if skip().is_some() {
        return;
    }
    let link = Link::start(&Profile::parse("delay=5ms").unwrap()).unwrap();
    let rtt = echo_rtt(&link, 9);
    assert!(rtt >= Duration::from_millis(10) && rtt < Duration::from_millis(30), "RTT {rtt:?} at 5 ms each way");
    link.set_black_hole(true);
    let addr: SocketAddr = format!("{}:7001", link.host(1).address).parse().unwrap();
    let err = link.tcp_connect(0, addr, Duration::from_millis(500)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    assert!(link.counts(0).black_holed_packets > 0);
    link.set_black_hole(false);
    // Nothing listens on 7001: refused (a reset came back) once the link is back.
    let err = link.tcp_connect(0, addr, Duration::from_secs(2)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
}

#[test]
fn loss_drops_about_its_share_and_iperf3_measures_the_link() {
    if skip().is_some() {
        return;
    }
    if !kvgate_netbed::iperf3_available() {
        assert!(!required(), "KVGATE_NETBED=require, but iperf3 is not installed");
        eprintln!("SKIPPED (not passed): iperf3 is not installed");
        return;
    }
    let link = Link::start(&Profile::parse("delay=200us,loss=1%").unwrap()).unwrap();
    let r = link.iperf3(1.0, 1, None).unwrap();
    let counts = link.counts(0);
    let share = counts.lost_packets as f64 / (counts.lost_packets + counts.forwarded_packets) as f64;
    eprintln!("iperf3 at 1 % loss: {:.1} MB/s, {} retransmits; relay {counts:?}", r.bytes_per_s / 1e6, r.retransmits);
    assert!(r.bytes_per_s > 1e6, "{r:?}");
    assert!((0.003..0.03).contains(&share), "lost share {share} of {counts:?}");
    assert!(r.retransmits > 0, "{r:?}");
}

#[test]
fn a_rate_caps_the_link() {
    if skip().is_some() {
        return;
    }
    if !kvgate_netbed::iperf3_available() {
        assert!(!required(), "KVGATE_NETBED=require, but iperf3 is not installed");
        return;
    }
    let link = Link::start(&Profile::parse("delay=200us,rate=200mbit").unwrap()).unwrap();
    let r = link.iperf3(1.5, 1, None).unwrap();
    assert!(r.bytes_per_s < 26e6 && r.bytes_per_s > 10e6, "{r:?} at 25 MB/s");
}
