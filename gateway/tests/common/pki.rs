//! Throwaway certificate authorities and certificates (rcgen) for the TLS tests.

pub struct Pki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// A fresh CA named `ca_name`: its issuer and its certificate (PEM).
pub fn pki(ca_name: &str) -> (rcgen::Issuer<'static, rcgen::KeyPair>, String) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.distinguished_name.push(rcgen::DnType::CommonName, ca_name);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (rcgen::Issuer::new(params, key), cert.pem())
}

/// A certificate for `localhost` signed by `issuer`.
pub fn leaf(issuer: &rcgen::Issuer<'static, rcgen::KeyPair>, ca_pem: &str) -> Pki {
    leaf_named(issuer, ca_pem, "localhost")
}

/// A certificate for `name` (a DNS name or an IP address) signed by `issuer`.
pub fn leaf_named(issuer: &rcgen::Issuer<'static, rcgen::KeyPair>, ca_pem: &str, name: &str) -> Pki {
    let params = rcgen::CertificateParams::new(vec![name.to_string()]).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    Pki { ca_pem: ca_pem.to_string(), cert_pem: cert.pem(), key_pem: key.serialize_pem() }
}

/// Writes `own`'s certificate and key, and `ca_pem`, into `dir` as `<name>.pem`, `<name>.key` and
/// `<name>-ca.pem`; returns the three paths.
pub fn pem_files(dir: &std::path::Path, name: &str, own: &Pki, ca_pem: &str) -> (String, String, String) {
    let write = |file: String, text: &str| {
        let path = dir.join(file);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    (
        write(format!("{name}.pem"), &own.cert_pem),
        write(format!("{name}.key"), &own.key_pem),
        write(format!("{name}-ca.pem"), ca_pem),
    )
}

/// A `[peer_link.tls]` table presenting `own` and trusting `trusted_ca_pem`, its files written into `dir`.
pub fn tls_toml(dir: &std::path::Path, name: &str, own: &Pki, trusted_ca_pem: &str) -> String {
    let (cert, key, ca) = pem_files(dir, name, own, trusted_ca_pem);
    format!("[peer_link.tls]\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\nca_file = \"{ca}\"\n")
}
