//! quinn plumbing: the transport configuration built from the plugin's knobs, the UDP endpoints, and
//! the mapping of quinn's connection errors onto kvgate reason codes. Holds no plugin state.

use crate::config::{CongestionController, QuicConfig};
use kvgate_abi::{PluginError, ReasonCode};
use quinn::congestion::{BbrConfig, CubicConfig, NewRenoConfig};
use quinn::{ConnectionError, IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Application error code of a connection or stream close: the `ReasonCode` number.
pub fn app_code(reason: ReasonCode) -> VarInt {
    VarInt::from_u32(reason.0)
}

fn varint(key: &str, value: u64) -> Result<VarInt, PluginError> {
    VarInt::from_u64(value)
        .map_err(|_| PluginError::new(ReasonCode::INVALID_ARGUMENT, format!("quic config: `{key}` is too large")))
}

pub fn transport_config(config: &QuicConfig) -> Result<Arc<TransportConfig>, PluginError> {
    let mut t = TransportConfig::default();
    t.max_concurrent_bidi_streams(VarInt::from_u32(config.max_concurrent_streams_per_connection));
    t.max_concurrent_uni_streams(VarInt::from_u32(0));
    t.stream_receive_window(varint("stream_window_bytes", config.stream_window_bytes)?);
    t.receive_window(varint("connection_window_bytes", config.connection_window_bytes)?);
    t.send_window(config.send_window_bytes);
    let idle = IdleTimeout::try_from(Duration::from_millis(config.idle_timeout_ms))
        .map_err(|_| PluginError::new(ReasonCode::INVALID_ARGUMENT, "quic config: `idle_timeout_ms` is too large"))?;
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some(Duration::from_millis(config.keep_alive_interval_ms)));
    t.initial_mtu(config.initial_mtu_bytes);
    t.min_mtu(config.min_mtu_bytes);
    if config.disable_mtu_discovery {
        t.mtu_discovery_config(None);
    } else {
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(config.mtu_discovery_upper_bound_bytes);
        mtu.black_hole_cooldown(Duration::from_millis(config.mtu_black_hole_cooldown_ms));
        t.mtu_discovery_config(Some(mtu));
    }
    t.enable_segmentation_offload(config.segmentation_offload);
    t.datagram_receive_buffer_size(None);
    let window = config.effective_initial_congestion_window_bytes();
    match config.congestion_controller {
        CongestionController::Cubic => {
            let mut c = CubicConfig::default();
            c.initial_window(window);
            t.congestion_controller_factory(Arc::new(c));
        }
        CongestionController::Bbr => {
            let mut c = BbrConfig::default();
            c.initial_window(window);
            t.congestion_controller_factory(Arc::new(c));
        }
        CongestionController::Newreno => {
            let mut c = NewRenoConfig::default();
            c.initial_window(window);
            t.congestion_controller_factory(Arc::new(c));
        }
    }
    Ok(Arc::new(t))
}

/// A UDP socket with the configured buffer sizes, bound to `addr`.
pub fn udp_socket(addr: SocketAddr, buffer_bytes: usize) -> Result<std::net::UdpSocket, PluginError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let fail =
        |what: &str, e: std::io::Error| PluginError::new(ReasonCode::UNAVAILABLE, format!("quic: {what} {addr}: {e}"));
    let socket =
        Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP)).map_err(|e| fail("socket for", e))?;
    // The kernel caps both at net.core.{r,w}mem_max; a smaller buffer only costs throughput.
    let _ = socket.set_recv_buffer_size(buffer_bytes);
    let _ = socket.set_send_buffer_size(buffer_bytes);
    socket.bind(&addr.into()).map_err(|e| fail("cannot bind", e))?;
    Ok(socket.into())
}

/// The reason code and message for a connection that ended or never came up.
pub fn classify_connection_error(e: &ConnectionError, established: bool) -> PluginError {
    let lost = if established { ReasonCode::PEER_LOST } else { ReasonCode::PEER_UNREACHABLE };
    match e {
        ConnectionError::TransportError(t) if is_crypto(u64::from(t.code)) => {
            PluginError::new(ReasonCode::AUTH_FAILED, format!("TLS authentication failed on this side: {t}"))
        }
        ConnectionError::ConnectionClosed(close) if is_crypto(u64::from(close.error_code)) => PluginError::new(
            ReasonCode::AUTH_FAILED,
            format!("the peer refused this side's certificate or TLS handshake: {close}"),
        ),
        ConnectionError::ApplicationClosed(close) => {
            let code = close.error_code.into_inner();
            let reason = String::from_utf8_lossy(&close.reason).into_owned();
            let rc = u32::try_from(code).map(ReasonCode).unwrap_or(ReasonCode::PEER_LOST);
            match rc {
                ReasonCode::VERSION_MISMATCH | ReasonCode::AUTH_FAILED | ReasonCode::PROTOCOL_VIOLATION => {
                    PluginError::new(rc, format!("the peer closed the connection: {reason}"))
                }
                _ => PluginError::new(lost, format!("the peer closed the connection ({rc}): {reason}")),
            }
        }
        ConnectionError::TimedOut => {
            PluginError::new(lost, format!("no packet from the peer within the idle timeout ({e})"))
        }
        other => PluginError::new(lost, format!("connection ended: {other}")),
    }
}

/// Whether the peer refused this side's certificate (its TLS alert, or its application close with
/// `AUTH_FAILED`). Right after the gateways exchange endpoints the peer may not know us yet, so such a
/// refusal is retried until `connect_timeout_ms`; a pin mismatch on this side never is.
pub fn peer_refused_our_certificate(e: &ConnectionError) -> bool {
    match e {
        ConnectionError::ConnectionClosed(close) => is_crypto(u64::from(close.error_code)),
        ConnectionError::ApplicationClosed(close) => {
            close.error_code.into_inner() == u64::from(ReasonCode::AUTH_FAILED.0)
        }
        _ => false,
    }
}

/// QUIC CRYPTO_ERROR codes (a TLS alert) are 0x100..=0x1ff.
fn is_crypto(code: u64) -> bool {
    (0x100..=0x1ff).contains(&code)
}
