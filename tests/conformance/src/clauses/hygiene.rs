//! HYGIENE-1, -3, -4: hostile inputs never panic or kill the host (and every call of the run is
//! inspected for `PANIC`), malformed configs are refused, module and instance info agree.

use super::*;
use crate::peer::protocol::{Op, Outcome};
use crate::world::{seg, Side, TX_PEER};
use kvgate_abi::{ReasonCode, ABI_VERSION};

// CONFORMANCE: HYGIENE-1
pub fn hygiene_1(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let src = p.alloc_src(1 << 16, ctx.rng.next_u64(), ctx)?;
        let dst = p.alloc_dst(1 << 16, ctx.rng.next_u64(), ctx)?;
        let peer = p.rx_peer;
        let hostile: Vec<(Side, Op)> = vec![
            (Side::Tx, Op::Deregister { key: 0xdead_beef }),
            (Side::Tx, Op::Release { key: 0xdead_beef }),
            (Side::Tx, Op::Disconnect { peer: 0x999 }),
            (Side::Rx, Op::CancelIncoming { peer: 0x999, ticket: 5 }),
            (
                Side::Rx,
                Op::ExpectIncoming {
                    ticket: 77,
                    peer: TX_PEER,
                    timeout_ns: 1_000_000,
                    ranges: vec![(0xdead_beef, 0, 10)],
                },
            ),
            (
                Side::Rx,
                Op::ExpectIncoming {
                    ticket: 78,
                    peer: TX_PEER,
                    timeout_ns: 1_000_000,
                    ranges: vec![(dst.key, u64::MAX - 3, 10)],
                },
            ),
            (Side::Tx, Op::Submit { xfer: 0xffff_0001, peer, ticket: 1, timeout_ns: 1_000_000, segments: vec![] }),
            (
                Side::Tx,
                Op::Submit {
                    xfer: 0xffff_0002,
                    peer,
                    ticket: 1,
                    timeout_ns: 0,
                    segments: vec![seg(&src, 0, &dst, 0, 0)],
                },
            ),
            (Side::Tx, Op::Cancel { xfer: u64::MAX }),
            (Side::Tx, Op::Stats),
            (Side::Tx, Op::Info),
        ];
        let n = hostile.len();
        for (side, op) in hostile {
            if let Op::Submit { xfer, timeout_ns, segments, .. } = &op {
                let (xfer, timeout_ns, bytes) = (*xfer, *timeout_ns, total_bytes(segments));
                let reply = p.call(side, op, ctx)?;
                let accepted = matches!(reply.outcome, Outcome::Done);
                p.xfers.insert(xfer, crate::world::Xfer::new(accepted, reply.t_ns, timeout_ns, bytes));
            } else {
                p.call(side, op, ctx)?;
            }
        }
        sleep_ms(50);
        let s = p.stats(Side::Tx, ctx)?;
        Ok(format!("{n} hostile calls: both peer processes alive, sender healthy = {}; every call of the run checked for PANIC", s.healthy))
    })
}

// CONFORMANCE: HYGIENE-3
pub fn hygiene_3(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, ctx| {
        let cases =
            [("malformed TOML", "[[[ this is not toml"), ("an unknown key", "kvgate_conformance_no_such_key = 1")];
        let (mut lines, mut problems) = (Vec::new(), Vec::new());
        for (what, config) in cases {
            match p.call(Side::Tx, Op::TryOpen { config: config.into() }, ctx)?.outcome {
                Outcome::Failed { error }
                    if error.code == ReasonCode::INVALID_ARGUMENT.0 && !error.message.trim().is_empty() =>
                {
                    lines.push(format!(
                        "{what} → invalid_argument ({})",
                        error.message.chars().take(60).collect::<String>()
                    ))
                }
                Outcome::Failed { error } => problems.push(format!(
                    "{what} refused with {} {:?} (want invalid_argument with a message)",
                    error.code_name, error.message
                )),
                other => problems.push(format!("open with {what} was accepted ({other:?})")),
            }
        }
        verdict_of(problems, lines.join("; "))
    })
}

// CONFORMANCE: HYGIENE-4
pub fn hygiene_4(ctx: &mut Ctx) -> CheckResult {
    with_pair(ctx, |p, _ctx| {
        let (m, i) = (&p.module_info, &p.info);
        let mut problems = Vec::new();
        if m.name.is_empty() || m.name != i.name {
            problems.push(format!("module name {:?}, instance name {:?}", m.name, i.name));
        }
        if m.abi_version != ABI_VERSION || i.abi_version != ABI_VERSION {
            problems.push(format!(
                "ABI versions: module {}, instance {}, host {ABI_VERSION}",
                m.abi_version, i.abi_version
            ));
        }
        verdict_of(problems, format!("module and instance agree: {} {} ABI v{}", i.name, i.version, i.abi_version))
    })
}
