//! Mutual TLS material for peer links (rustls through tonic): this gateway's identity, the CA that
//! must have signed every peer, and the check that a dialling peer's certificate carries the name
//! configured for it. Never accepts a peer without a certificate once TLS is configured.

use crate::config::PeerTlsSection;
use anyhow::Context;
use rustls_pki_types::{CertificateDer, ServerName};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

pub struct PeerTls {
    identity: Identity,
    ca: Certificate,
}

impl PeerTls {
    pub fn load(section: &PeerTlsSection) -> anyhow::Result<PeerTls> {
        let read = |key: &str, path: &str| {
            std::fs::read(path).with_context(|| format!("peer_link.tls.{key}: cannot read {path}"))
        };
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

/// Whether `leaf` (a dialling peer's end-entity certificate, already chain-verified against the CA by
/// rustls) is valid for `expected` (its `peers.tls_name`, a DNS name or an IP address). The CA check
/// alone would let any gateway of the cluster claim any other's name in its Hello.
pub fn check_certificate_name(leaf: Option<&CertificateDer<'_>>, expected: &str) -> Result<(), String> {
    let leaf = leaf.ok_or("no client certificate was presented")?;
    let name =
        ServerName::try_from(expected).map_err(|e| format!("{expected:?} is not a DNS name or IP address: {e}"))?;
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(|e| format!("unreadable certificate: {e}"))?;
    cert.verify_is_valid_for_subject_name(&name).map_err(|e| format!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_for(names: &[&str]) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn a_certificate_is_accepted_only_for_the_names_it_carries() {
        let cert = cert_for(&["decode.kv.internal", "10.0.0.7"]);
        assert_eq!(check_certificate_name(Some(&cert), "decode.kv.internal"), Ok(()));
        assert_eq!(check_certificate_name(Some(&cert), "10.0.0.7"), Ok(()));
        let wrong = check_certificate_name(Some(&cert), "prefill.kv.internal").unwrap_err();
        assert!(wrong.contains("NotValidForName"), "{wrong}");
        assert!(check_certificate_name(Some(&cert), "10.0.0.8").is_err());
    }

    #[test]
    fn a_missing_certificate_or_a_malformed_name_is_refused_with_why() {
        assert_eq!(check_certificate_name(None, "decode").unwrap_err(), "no client certificate was presented");
        let cert = cert_for(&["decode"]);
        assert!(check_certificate_name(Some(&cert), "not a name!")
            .unwrap_err()
            .contains("is not a DNS name or IP address"));
        let garbage = CertificateDer::from(vec![0u8; 16]);
        assert!(check_certificate_name(Some(&garbage), "decode").unwrap_err().contains("unreadable certificate"));
    }
}
