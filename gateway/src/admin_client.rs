//! A minimal HTTP/1.0 GET for the admin endpoints (demo and tests read `/rooms`, `/plugins`,
//! `/healthz`, `/metrics`). Bounded by `ADMIN_GET_TIMEOUT_MS`; never follows redirects.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const ADMIN_GET_TIMEOUT_MS: u64 = 5_000;

/// `(status code, body)` of `GET path` on `addr`.
pub async fn get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    request(addr, "GET", path, Duration::from_millis(ADMIN_GET_TIMEOUT_MS)).await
}

/// `(status code, body)` of an empty `POST path` on `addr` (`/plugins/reload`), waiting at most `timeout`.
pub async fn post(addr: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    request(addr, "POST", path, timeout).await
}

async fn request(addr: &str, method: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let fut = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        let length = if method == "POST" { "Content-Length: 0\r\n" } else { "" };
        stream.write_all(format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n{length}\r\n").as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        Ok((code, body.to_string()))
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{method} {path} on {addr} timed out"))
    })?
}
