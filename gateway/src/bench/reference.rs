//! The physical references each plugin is measured against, in the same run and on the same bytes:
//! memcpy (shm), a plain blocking TCP loopback copy (QUIC). Each returns per-copy latencies; the
//! caller turns them into GB/s. Never touches a gateway.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Most copies one reference measurement makes (a 4 KiB memcpy takes about a microsecond).
pub const MAX_REFERENCE_COPIES: u64 = 200_000;

/// How long and how often a reference copies: at least `min_copies`, then until `budget` passed.
#[derive(Clone, Copy, Debug)]
pub struct CopyBudget {
    pub min_copies: u64,
    pub budget: Duration,
}

impl CopyBudget {
    fn more(&self, done: u64, started: Instant) -> bool {
        done < MAX_REFERENCE_COPIES && (done < self.min_copies || started.elapsed() < self.budget)
    }
}

/// Which reference a plugin is measured against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReferenceKind {
    /// One thread copying block by block between the same two pool files the gateways map.
    Memcpy,
    /// One blocking TCP connection on 127.0.0.1, block by block, with a one-byte acknowledgement.
    TcpLoopback,
}

impl ReferenceKind {
    pub fn describe(self) -> &'static str {
        match self {
            ReferenceKind::Memcpy => "memcpy, 1 thread, block by block between the same two pool files",
            ReferenceKind::TcpLoopback => "TCP loopback, 1 blocking connection (std::net, TCP_NODELAY), block by block, 1-byte ack per transfer",
        }
    }
}

/// Copy `blocks` blocks of `block` bytes from `src` to `dst` (same offsets), repeatedly; one latency
/// per whole transfer.
pub fn memcpy_copies(src: &[u8], dst: &mut [u8], block: usize, blocks: usize, budget: CopyBudget) -> Vec<Duration> {
    assert!(block * blocks <= src.len() && block * blocks <= dst.len(), "the transfer fits both buffers");
    let mut out = Vec::new();
    let started = Instant::now();
    while budget.more(out.len() as u64, started) {
        let t0 = Instant::now();
        for i in 0..blocks {
            let range = i * block..(i + 1) * block;
            dst[range.clone()].copy_from_slice(&src[range]);
        }
        std::hint::black_box(&dst[0]);
        out.push(t0.elapsed());
    }
    out
}

/// Send `blocks` blocks of `block` bytes from `src` over one loopback TCP connection into `dst`,
/// repeatedly; a transfer ends when the receiver acknowledged its last byte.
pub fn tcp_copies(src: &[u8], dst: &mut [u8], block: usize, blocks: usize, budget: CopyBudget) -> std::io::Result<Vec<Duration>> {
    assert!(block * blocks <= src.len() && block * blocks <= dst.len(), "the transfer fits both buffers");
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    std::thread::scope(|scope| {
        let receiver = scope.spawn(move || -> std::io::Result<()> {
            let (mut stream, _) = listener.accept()?;
            stream.set_nodelay(true)?;
            let mut go = [0u8; 1];
            // Each round: one byte from the sender says "a transfer follows" (0 = stop).
            while stream.read(&mut go)? == 1 && go[0] == 1 {
                for i in 0..blocks {
                    stream.read_exact(&mut dst[i * block..(i + 1) * block])?;
                }
                stream.write_all(&[1])?;
            }
            Ok(())
        });
        let mut stream = TcpStream::connect(address)?;
        stream.set_nodelay(true)?;
        let mut out = Vec::new();
        let started = Instant::now();
        let mut ack = [0u8; 1];
        while budget.more(out.len() as u64, started) {
            let t0 = Instant::now();
            stream.write_all(&[1])?;
            for i in 0..blocks {
                stream.write_all(&src[i * block..(i + 1) * block])?;
            }
            stream.read_exact(&mut ack)?;
            out.push(t0.elapsed());
        }
        stream.write_all(&[0])?;
        drop(stream);
        receiver.join().map_err(|_| std::io::Error::other("tcp reference receiver panicked"))??;
        Ok(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> CopyBudget {
        CopyBudget { min_copies: 3, budget: Duration::from_millis(1) }
    }

    #[test]
    fn memcpy_reference_moves_the_bytes() {
        let src: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let copies = memcpy_copies(&src, &mut dst, 4096, 16, budget());
        assert!(copies.len() >= 3);
        assert_eq!(src, dst);
    }

    #[test]
    fn tcp_reference_moves_the_bytes() {
        let src: Vec<u8> = (0..64 * 1024).map(|i| (i % 241) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let copies = tcp_copies(&src, &mut dst, 1024, 64, budget()).expect("loopback");
        assert!(copies.len() >= 3);
        assert_eq!(src, dst);
    }
}
