//! Mutual TLS material for peer links (rustls through tonic): this gateway's identity and the CA that
//! must have signed every peer. Never accepts a peer without a certificate once TLS is configured.

use crate::config::PeerTlsSection;
use anyhow::Context;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

pub struct PeerTls {
    identity: Identity,
    ca: Certificate,
}

impl PeerTls {
    pub fn load(section: &PeerTlsSection) -> anyhow::Result<PeerTls> {
        let read = |key: &str, path: &str| std::fs::read(path).with_context(|| format!("peer_link.tls.{key}: cannot read {path}"));
        let cert = read("cert_file", &section.cert_file)?;
        let key = read("key_file", &section.key_file)?;
        let ca = read("ca_file", &section.ca_file)?;
        Ok(PeerTls { identity: Identity::from_pem(cert, key), ca: Certificate::from_pem(ca) })
    }

    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity.clone()).client_ca_root(self.ca.clone())
    }

    pub fn client_config(&self, domain: &str) -> ClientTlsConfig {
        ClientTlsConfig::new().identity(self.identity.clone()).ca_certificate(self.ca.clone()).domain_name(domain)
    }
}
