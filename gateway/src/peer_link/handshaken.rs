//! A link once its handshake (and authentication) is done: what the dialler and the server hand the
//! peer's link task. Plain data.

use crate::channels::Outbound;
use kvgate_client::proto::{self, PeerFrame};
use tonic::Streaming;

/// A handshaken (and authenticated) link: the peer's hello, its inbound frames, our outbound queue
/// and, with `peer_link.auth = "psk"`, the check of every inbound frame's MAC.
pub struct Session {
    pub hello: proto::Hello,
    pub inbound: Streaming<PeerFrame>,
    pub outbound: Outbound,
    pub opener: Option<super::psk::FrameOpener>,
}
