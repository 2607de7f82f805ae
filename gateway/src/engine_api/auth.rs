//! Bearer-token check for the TCP engine API. Constant-time comparison; a missing or wrong token is
//! `unauthenticated` and reaches nothing else.

use tonic::{Request, Status};

#[derive(Clone)]
pub struct BearerCheck {
    expected: Option<String>,
}

impl BearerCheck {
    /// `None`: every call passes (the Unix socket, protected by its file mode).
    pub fn new(token: Option<String>) -> BearerCheck {
        BearerCheck { expected: token.map(|t| format!("Bearer {}", t.trim())) }
    }
}

fn equal_constant_time(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl tonic::service::Interceptor for BearerCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else { return Ok(request) };
        let presented = request.metadata().get("authorization").map(|v| v.as_bytes()).unwrap_or_default();
        if equal_constant_time(presented, expected.as_bytes()) {
            Ok(request)
        } else {
            tracing::warn!("engine API call refused: missing or wrong bearer token");
            let mut status = Status::unauthenticated("bad_token: missing or wrong bearer token");
            status.metadata_mut().insert(kvgate_client::REASON_METADATA_KEY, "bad_token".parse().expect("ascii"));
            Err(status)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    fn with_auth(value: Option<&str>) -> Request<()> {
        let mut r = Request::new(());
        if let Some(v) = value {
            r.metadata_mut().insert("authorization", v.parse().unwrap());
        }
        r
    }

    #[test]
    fn right_token_passes_wrong_or_missing_token_is_refused() {
        let mut check = BearerCheck::new(Some("s3cret".into()));
        assert!(check.call(with_auth(Some("Bearer s3cret"))).is_ok());
        assert_eq!(check.call(with_auth(Some("Bearer s3creT"))).unwrap_err().code(), tonic::Code::Unauthenticated);
        assert_eq!(check.call(with_auth(Some("Bearer s3cret2"))).unwrap_err().code(), tonic::Code::Unauthenticated);
        assert_eq!(check.call(with_auth(None)).unwrap_err().code(), tonic::Code::Unauthenticated);
        assert!(BearerCheck::new(None).call(with_auth(None)).is_ok());
    }
}
