//! Accepted TCP sockets with TCP_NODELAY for the gateway's gRPC listeners (peer link, engine API
//! over TCP). Must never hand tonic a bare `TcpListenerStream`: tonic ignores `Server::tcp_nodelay`
//! for `serve_with_incoming*`, and Nagle then holds small frames ~40 ms behind the delayed ACK.

use tonic::transport::server::TcpIncoming;

/// The accepted-connection stream of `listener`, every accepted socket set to TCP_NODELAY.
pub fn nodelay_incoming(listener: tokio::net::TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    async fn accepted_nodelay(incoming: impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Unpin, addr: std::net::SocketAddr) -> bool {
        let mut incoming = incoming;
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        accepted.nodelay().unwrap()
    }

    #[tokio::test]
    async fn accepted_sockets_have_nodelay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(accepted_nodelay(nodelay_incoming(listener), addr).await);
    }

    /// The trap this module exists for: a plain listener stream accepts sockets with Nagle on.
    #[tokio::test]
    async fn plain_listener_stream_leaves_nagle_on() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(!accepted_nodelay(tokio_stream::wrappers::TcpListenerStream::new(listener), addr).await);
    }
}
