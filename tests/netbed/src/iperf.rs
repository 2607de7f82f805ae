//! iperf3 over the bed: the TCP reference every transport figure on the link is a ratio of.

use crate::Link;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// What one iperf3 run moved.
#[derive(Clone, Debug, PartialEq)]
pub struct Iperf3Result {
    /// Received bytes per second (the receiver's figure).
    pub bytes_per_s: f64,
    pub retransmits: u64,
    /// The congestion control iperf3 reports the sender used.
    pub congestion: String,
    /// CPU percent of the sender and of the receiver process (iperf3's own figures).
    pub cpu_sender_percent: f64,
    pub cpu_receiver_percent: f64,
}

/// Whether iperf3 is installed (Debian `iperf3`; scripts/install-deps.sh installs it).
pub fn iperf3_available() -> bool {
    std::process::Command::new("iperf3")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Kills the iperf3 server when the run ends, however it ends.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn run(link: &Link, seconds: f64, streams: u32, congestion: Option<&str>) -> Result<Iperf3Result, String> {
    if !iperf3_available() {
        return Err("iperf3 is not installed (Debian iperf3; scripts/install-deps.sh)".into());
    }
    let server_ip = link.host(1).address.to_string();
    let port = 5201u16;
    let server = link
        .command(1, "iperf3")
        .map_err(|e| format!("iperf3 server: {e}"))?
        .args(["-s", "-B", &server_ip, "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("start the iperf3 server: {e}"))?;
    let _server = Server(server);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut client = link.command(0, "iperf3").map_err(|e| format!("iperf3 client: {e}"))?;
        client.args([
            "-c",
            &server_ip,
            "-p",
            &port.to_string(),
            "-J",
            "-t",
            &format!("{seconds}"),
            "-P",
            &streams.to_string(),
        ]);
        if let Some(cc) = congestion {
            client.args(["-C", cc]);
        }
        let out = client.stdin(Stdio::null()).output().map_err(|e| format!("run the iperf3 client: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        match parse(&text) {
            Ok(r) => return Ok(r),
            // The server may not listen yet.
            Err(e) if Instant::now() < deadline && (e.contains("connect") || e.contains("refused")) => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => return Err(format!("iperf3: {e}")),
        }
    }
}

/// The figures of iperf3's `-J` output.
pub(crate) fn parse(json: &str) -> Result<Iperf3Result, String> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("unreadable output ({e})"))?;
    if let Some(err) = v.get("error").and_then(|e| e.as_str()) {
        return Err(err.to_string());
    }
    let end = &v["end"];
    let bytes_per_s =
        end["sum_received"]["bits_per_second"].as_f64().ok_or("no end.sum_received.bits_per_second")? / 8.0;
    Ok(Iperf3Result {
        bytes_per_s,
        retransmits: end["sum_sent"]["retransmits"].as_u64().unwrap_or(0),
        congestion: end["sender_tcp_congestion"].as_str().unwrap_or("").to_string(),
        cpu_sender_percent: end["cpu_utilization_percent"]["host_total"].as_f64().unwrap_or(0.0),
        cpu_receiver_percent: end["cpu_utilization_percent"]["remote_total"].as_f64().unwrap_or(0.0),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_iperf3_json_and_its_errors() {
        let ok = r#"{"end":{"sum_sent":{"retransmits":7},"sum_received":{"bits_per_second":8e9},
            "cpu_utilization_percent":{"host_total":50.5,"remote_total":20.0},"sender_tcp_congestion":"cubic"}}"#;
        let r = super::parse(ok).unwrap();
        assert_eq!((r.bytes_per_s, r.retransmits, r.congestion.as_str()), (1e9, 7, "cubic"));
        assert_eq!(
            super::parse(r#"{"error":"unable to connect to server: Connection refused"}"#).unwrap_err(),
            "unable to connect to server: Connection refused"
        );
    }
}
