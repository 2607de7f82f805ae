//! The demo's fault act, on a fresh shm gateway pair: an abort storm (either engine aborting at every
//! phase, late counterparts refused) and a frozen (SIGSTOP) decode gateway with rooms in flight.
//! Prints every room's terminal reason on both sides and checks that nothing is left in `/rooms`.

use super::engine::{expect_into, send_all, wait_terminal, Engine, SideOutcome};
use super::gateways::{GatewayPair, PairSettings, DECODE_NAME, PREFILL_NAME};
use super::pool::{KvPool, KvShape};
use kvgate::admin_client as http;
use kvgate_client::room_key;
use std::path::Path;
use std::time::{Duration, Instant};

/// Extra time, on top of `heartbeat_interval_ms * heartbeat_misses`, that a frozen peer's rooms may
/// take to end (the driver's scheduling and the event path).
pub const PEER_LOSS_GRACE_MS: u64 = 500;

fn show(side: &str, o: &Result<SideOutcome, anyhow::Error>) -> String {
    match o {
        Ok(o) if o.succeeded => format!("{side}: succeeded"),
        Ok(o) => format!("{side}: {} ({}, {} ms)", o.reason, o.phase, o.elapsed_ms),
        Err(e) if e.to_string() == "never created" => format!("{side}: no room (tombstone only)"),
        Err(e) => format!("{side}: no terminal event ({e})"),
    }
}

/// Returns whether every check of the act held.
pub async fn run(binary: &Path, dir: &Path, shape: &KvShape) -> anyhow::Result<bool> {
    println!(
        "\nfault act (shm, heartbeat {} ms x {} misses)",
        PairSettings::default().heartbeat_interval_ms,
        PairSettings::default().heartbeat_misses
    );
    let settings = PairSettings::default();
    let mut pair = GatewayPair::start(binary, dir, &settings).await?;
    let slots = 16;
    let prefill = Engine::connect(
        &pair.prefill.socket,
        KvPool::create(dir, "fault-prefill-pool", shape.request_bytes(), slots)?,
        "prefill",
    )
    .await?;
    let decode = Engine::connect(
        &pair.decode.socket,
        KvPool::create(dir, "fault-decode-pool", shape.request_bytes(), slots)?,
        "decode",
    )
    .await?;
    let storm_ok = abort_storm(&prefill, &decode, shape).await?;
    let frozen_ok = frozen_decode(&pair, &prefill, &decode, shape, &settings).await?;
    pair.stop();
    println!(
        "fault act: {}",
        if storm_ok && frozen_ok {
            "every room terminal with its reason"
        } else {
            "SOME CHECKS FAILED (see the lines above)"
        }
    );
    Ok(storm_ok && frozen_ok)
}

async fn abort_storm(prefill: &Engine, decode: &Engine, shape: &KvShape) -> anyhow::Result<bool> {
    println!("  abort storm:");
    let mut ok = true;
    let timeout = Duration::from_secs(10);
    for (i, case) in [
        "decode aborts before any send",
        "prefill aborts before the expect",
        "decode aborts mid-transfer",
        "prefill aborts mid-transfer",
    ]
    .iter()
    .enumerate()
    {
        for j in 0..3u64 {
            let room = 900_000 + i as u64 * 10 + j;
            let slot = i as u64 * 3 + j;
            let (mut p_rx, mut d_rx) = (prefill.events.listen(room), decode.events.listen(room));
            let started = Instant::now();
            let mut late = String::new();
            match i {
                0 => {
                    expect_into(decode, shape, room, slot, PREFILL_NAME, 0).await?;
                    decode.client.abort(room_key(room, 0), "demo: decode abort before send").await?;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    late = match send_all(prefill, shape, room, slot, DECODE_NAME, Some(1)).await {
                        Ok(()) => "late send ACCEPTED".into(),
                        Err(s) => format!("late send refused: {}", kvgate_client::reason_of(&s).unwrap_or_default()),
                    };
                }
                1 => {
                    send_all(prefill, shape, room, slot, DECODE_NAME, Some(1)).await?;
                    prefill.client.abort(room_key(room, 0), "demo: prefill abort before expect").await?;
                    // Let the abort reach the decode gateway first (a counterpart racing the abort on
                    // the wire is refused by the prefill side instead).
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    late = match expect_into(decode, shape, room, slot, PREFILL_NAME, 0).await {
                        Ok(()) => "late expect ACCEPTED".into(),
                        Err(s) => format!("late expect refused: {}", kvgate_client::reason_of(&s).unwrap_or_default()),
                    };
                }
                _ => {
                    expect_into(decode, shape, room, slot, PREFILL_NAME, 0).await?;
                    send_all(prefill, shape, room, slot, DECODE_NAME, Some(1)).await?;
                    let (who, client) = if i == 2 { ("decode", &decode.client) } else { ("prefill", &prefill.client) };
                    client.abort(room_key(room, 0), &format!("demo: {who} abort mid-transfer")).await?;
                }
            }
            // When the prefill engine aborts before the expect, the decode gateway never has a room:
            // it keeps a tombstone (the late expect is refused) and reports no terminal event.
            let (p, d) = if i == 1 {
                (wait_terminal(&mut p_rx, started, timeout).await, Err(anyhow::anyhow!("never created")))
            } else {
                tokio::join!(wait_terminal(&mut p_rx, started, timeout), wait_terminal(&mut d_rx, started, timeout))
            };
            let refused_late = late.is_empty() || late.contains("refused");
            let both_failed = match i {
                // Only the aborting side's room exists when the counterpart never appeared.
                0 => d.as_ref().is_ok_and(|o| !o.succeeded),
                1 => p.as_ref().is_ok_and(|o| !o.succeeded),
                _ => p.as_ref().is_ok_and(|o| !o.succeeded) && d.as_ref().is_ok_and(|o| !o.succeeded),
            };
            ok &= refused_late && both_failed;
            if j == 0 {
                println!(
                    "    {case:<34} room {room}: {} | {} {}",
                    show("prefill", &p),
                    show("decode", &d),
                    if late.is_empty() { String::new() } else { format!("| {late}") }
                );
            }
            prefill.events.forget(room);
            decode.events.forget(room);
        }
    }
    println!("    (12 rooms: 3 per case, first of each shown; all as expected: {ok})");
    Ok(ok)
}

async fn frozen_decode(
    pair: &GatewayPair,
    prefill: &Engine,
    decode: &Engine,
    shape: &KvShape,
    settings: &PairSettings,
) -> anyhow::Result<bool> {
    let bound = Duration::from_millis(settings.heartbeat_interval_ms * settings.heartbeat_misses + PEER_LOSS_GRACE_MS);
    println!(
        "  frozen decode gateway (SIGSTOP), bound = {} ms x {} + {} ms grace:",
        settings.heartbeat_interval_ms, settings.heartbeat_misses, PEER_LOSS_GRACE_MS
    );
    let rooms: Vec<u64> = (0..6).map(|i| 950_000 + i).collect();
    let mut listeners = Vec::new();
    for (i, room) in rooms.iter().enumerate() {
        let (p_rx, d_rx) = (prefill.events.listen(*room), decode.events.listen(*room));
        expect_into(decode, shape, *room, 12 + (i as u64 % 4), PREFILL_NAME, 0).await?;
        if i < 4 {
            // In flight: the first chunk of each part sent, the rest held back by the engine.
            send_all(prefill, shape, *room, i as u64, DECODE_NAME, Some(1)).await?;
        }
        listeners.push((p_rx, d_rx));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    pair.decode.freeze()?;
    let frozen_at = Instant::now();
    let mut ok = true;
    let mut worst = Duration::ZERO;
    for (room, (p_rx, _)) in rooms.iter().zip(listeners.iter_mut()) {
        let outcome = wait_terminal(p_rx, frozen_at, bound + Duration::from_secs(5)).await;
        let within = outcome.as_ref().is_ok_and(|o| !o.succeeded && o.reason == "peer_lost" && o.seen_after <= bound);
        if let Ok(o) = &outcome {
            worst = worst.max(o.seen_after);
        }
        ok &= within;
        println!(
            "    room {room} on prefill: {} after {} ms{}",
            show("", &outcome).trim_start_matches(": "),
            outcome.as_ref().map(|o| o.seen_after.as_millis()).unwrap_or(0),
            if within { "" } else { "  <-- outside the bound" }
        );
    }
    println!("    slowest: {} ms (bound {} ms)", worst.as_millis(), bound.as_millis());
    pair.decode.thaw()?;
    let thawed_at = Instant::now();
    let mut decode_reasons = std::collections::BTreeMap::new();
    for (_, d_rx) in listeners.iter_mut() {
        let o = wait_terminal(d_rx, thawed_at, bound + Duration::from_secs(5)).await;
        let reason = match &o {
            Ok(o) if o.succeeded => "succeeded".to_string(),
            Ok(o) => o.reason.clone(),
            Err(_) => "no terminal event".to_string(),
        };
        ok &= o.is_ok_and(|o| !o.succeeded);
        *decode_reasons.entry(reason).or_insert(0) += 1;
    }
    println!("    after SIGCONT, the decode gateway's rooms: {decode_reasons:?}");
    // Give the link time to come back, then both /rooms must be empty.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for g in [&pair.prefill, &pair.decode] {
        let (_, body) = http::get(&g.admin, "/rooms").await?;
        let empty = body.trim() == "[]";
        ok &= empty;
        println!("    /rooms on {}: {}", g.name, if empty { "empty".to_string() } else { body });
    }
    Ok(ok)
}
