//! Link profiles: one-way delay, random loss, rate and MTU of the shaped link, by name (`a`, `b`, `c`,
//! the issue's three) or spelled out (`delay=1ms,loss=0.1%,rate=1gbit,mtu=1500`).

use std::time::Duration;

/// How the link between the two hosts behaves, the same each way.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// Shown in reports (`a`, or the spelled-out form).
    pub name: String,
    /// Added to every packet, each way (so the round trip is twice this plus the relay's own time).
    pub one_way_delay: Duration,
    /// Probability that a packet is dropped, each way, independently (0.0..=1.0).
    pub loss: f64,
    /// Bytes per second each way (the relay serialises packets at this rate); `None`: as fast as the
    /// relay forwards.
    pub rate_bytes_per_s: Option<u64>,
    /// MTU of both TUN devices (IP packet bytes).
    pub mtu: u32,
    /// Most bytes queued in the relay waiting for the rate (tail drop beyond); only with a rate.
    pub queue_bytes: u64,
}

impl Profile {
    /// a: 0.2 ms one way, no loss (a rack).
    pub fn a() -> Profile {
        Profile::new("a", Duration::from_micros(200), 0.0)
    }
    /// b: 1 ms one way, 0.1 % loss (a data centre under load).
    pub fn b() -> Profile {
        Profile::new("b", Duration::from_millis(1), 0.001)
    }
    /// c: 5 ms one way, 1 % loss (across a region, a lossy path).
    pub fn c() -> Profile {
        Profile::new("c", Duration::from_millis(5), 0.01)
    }

    fn new(name: &str, one_way_delay: Duration, loss: f64) -> Profile {
        Profile { name: name.to_string(), one_way_delay, loss, rate_bytes_per_s: None, mtu: 1500, queue_bytes: 4 << 20 }
    }

    /// `a`, `b`, `c`, or comma-separated `delay=1ms`, `loss=0.1%` (or a fraction `0.001`),
    /// `rate=1gbit` / `rate=100mbyte` (per second), `mtu=1500`, `queue=4mib`, optionally starting
    /// from a named profile (`b,rate=1gbit`).
    pub fn parse(text: &str) -> Result<Profile, String> {
        let mut profile: Option<Profile> = None;
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "a" | "b" | "c" if profile.is_none() => {
                    profile = Some(match part {
                        "a" => Profile::a(),
                        "b" => Profile::b(),
                        _ => Profile::c(),
                    });
                    continue;
                }
                _ => {}
            }
            let p = profile.get_or_insert_with(|| Profile::new("", Duration::ZERO, 0.0));
            let (key, value) =
                part.split_once('=').ok_or_else(|| format!("link profile: {part:?} is not a, b, c or key=value"))?;
            match key {
                "delay" => p.one_way_delay = parse_duration(value)?,
                "loss" => p.loss = parse_loss(value)?,
                "rate" => p.rate_bytes_per_s = Some(parse_rate(value)?),
                "mtu" => {
                    p.mtu = value
                        .parse()
                        .ok()
                        .filter(|m| (576..=65535).contains(m))
                        .ok_or_else(|| format!("link profile: mtu={value} is not 576..=65535"))?
                }
                "queue" => p.queue_bytes = parse_bytes(value)?,
                other => return Err(format!("link profile: unknown key {other:?} (delay, loss, rate, mtu, queue)")),
            }
        }
        let mut p = profile.ok_or_else(|| "link profile: empty".to_string())?;
        if text.trim() != p.name {
            p.name = text.trim().to_string();
        }
        Ok(p)
    }

    /// One line for reports: `a (0.2 ms one way, 0 % loss, unlimited rate, MTU 1500)`.
    pub fn describe(&self) -> String {
        let rate = match self.rate_bytes_per_s {
            Some(r) => format!("{:.0} Mbit/s", r as f64 * 8.0 / 1e6),
            None => "rate as the relay forwards".to_string(),
        };
        format!(
            "{} ({} ms one way, {} % loss each way, {rate}, MTU {})",
            self.name,
            self.one_way_delay.as_secs_f64() * 1e3,
            self.loss * 100.0,
            self.mtu
        )
    }
}

fn parse_duration(value: &str) -> Result<Duration, String> {
    let bad = || format!("link profile: delay={value} is not a duration (e.g. 200us, 1ms, 0.5ms)");
    let (number, scale) = if let Some(n) = value.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = value.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = value.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err(bad());
    };
    let v: f64 = number.parse().map_err(|_| bad())?;
    if !(0.0..=10.0).contains(&(v * scale)) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(v * scale))
}

fn parse_loss(value: &str) -> Result<f64, String> {
    let bad = || format!("link profile: loss={value} is not a fraction 0..=1 or a percentage");
    let v: f64 = match value.strip_suffix('%') {
        Some(p) => p.parse::<f64>().map_err(|_| bad())? / 100.0,
        None => value.parse().map_err(|_| bad())?,
    };
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(bad())
    }
}

fn split_number(value: &str) -> (&str, &str) {
    let at = value.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(value.len());
    value.split_at(at)
}

/// Bytes per second from `10gbit`, `100mbit`, `1gbyte`, `500mbyte`, `12500000` (bytes).
fn parse_rate(value: &str) -> Result<u64, String> {
    let bad = || format!("link profile: rate={value} is not a rate (e.g. 1gbit, 100mbit, 200mbyte)");
    let (number, unit) = split_number(value);
    let v: f64 = number.parse().map_err(|_| bad())?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "byte" => 1.0,
        "kbit" => 1e3 / 8.0,
        "mbit" => 1e6 / 8.0,
        "gbit" => 1e9 / 8.0,
        "kbyte" => 1e3,
        "mbyte" => 1e6,
        "gbyte" => 1e9,
        _ => return Err(bad()),
    };
    let rate = (v * scale) as u64;
    if rate < 10_000 {
        return Err(bad());
    }
    Ok(rate)
}

fn parse_bytes(value: &str) -> Result<u64, String> {
    let bad = || format!("link profile: queue={value} is not a size (e.g. 4mib, 512kib)");
    let (number, unit) = split_number(value);
    let v: u64 = number.parse().map_err(|_| bad())?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        _ => return Err(bad()),
    };
    Ok(v * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_profiles_are_the_issues() {
        assert_eq!(Profile::parse("a").unwrap(), Profile::a());
        let b = Profile::parse("b").unwrap();
        assert_eq!((b.one_way_delay, b.loss), (Duration::from_millis(1), 0.001));
        let c = Profile::parse("c").unwrap();
        assert_eq!((c.one_way_delay, c.loss), (Duration::from_millis(5), 0.01));
    }

    #[test]
    fn spelled_out_profiles_parse_and_bad_ones_say_why() {
        let p = Profile::parse("delay=300us,loss=0.5%,rate=1gbit,mtu=9000").unwrap();
        assert_eq!(p.one_way_delay, Duration::from_micros(300));
        assert!((p.loss - 0.005).abs() < 1e-12);
        assert_eq!(p.rate_bytes_per_s, Some(125_000_000));
        assert_eq!(p.mtu, 9000);
        let p = Profile::parse("b,rate=200mbyte").unwrap();
        assert_eq!(
            (p.one_way_delay, p.rate_bytes_per_s, p.name.as_str()),
            (Duration::from_millis(1), Some(200_000_000), "b,rate=200mbyte")
        );
        assert!(Profile::parse("delay=1").unwrap_err().contains("delay=1"));
        assert!(Profile::parse("loss=2").unwrap_err().contains("loss"));
        assert!(Profile::parse("jitter=1ms").unwrap_err().contains("unknown key"));
        assert!(Profile::parse("").is_err());
    }
}
