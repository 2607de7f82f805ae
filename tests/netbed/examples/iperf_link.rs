//! `cargo run --release -p kvgate-netbed --example iperf_link -- b [seconds] [cc]`: iperf3 over a
//! link of that profile (as root), with the relay's counters.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let profile =
        kvgate_netbed::Profile::parse(args.first().map_or("a", |s| s.as_str())).unwrap_or_else(|e| panic!("{e}"));
    let seconds: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let link = kvgate_netbed::Link::start(&profile).expect("start the link");
    let r = link.iperf3(seconds, 1, args.get(2).map(|s| s.as_str())).expect("iperf3");
    println!(
        "{}: iperf3 {:.3} GB/s ({}, {} retransmits, CPU sender {:.0} % receiver {:.0} %)",
        profile.describe(),
        r.bytes_per_s / 1e9,
        r.congestion,
        r.retransmits,
        r.cpu_sender_percent,
        r.cpu_receiver_percent
    );
    println!("relay 0->1 {:?}", link.counts(0));
}
