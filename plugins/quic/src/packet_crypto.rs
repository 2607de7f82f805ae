//! QUIC packet protection (the AEAD of every packet's payload) for the AES-GCM suites through aws-lc-rs,
//! whose AES-GCM is about twice ring's on CPUs with AVX-512 (the rest of TLS stays ring's). Owns only
//! the payload AEAD; never derives keys or nonces other than as RFC 9001 says (rustls derives them).

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce as AeadNonce, UnboundKey};
use rustls::crypto::cipher::{AeadKey, Iv, Nonce};
use rustls::quic::{Algorithm, HeaderProtectionKey, PacketKey, Tag};
use rustls::{CipherSuiteCommon, Error, SupportedCipherSuite, Tls13CipherSuite};
use std::sync::OnceLock;

// CONFORMANCE: DATA-7 (a packet whose payload fails its AEAD tag is dropped, never written)
/// `quic::Algorithm` of one AES-GCM suite: packet keys from aws-lc-rs, header protection (one AES
/// block per packet) from ring's implementation of the same suite.
struct AwsLcPacketAlgorithm {
    aead: &'static aead::Algorithm,
    ring: &'static dyn Algorithm,
}

/// Packets one AES-GCM key may protect, and forgeries it may see (RFC 9001 sections 6.6 and B.1), the
/// same figures ring's keys carry.
const AES_GCM_CONFIDENTIALITY_LIMIT: u64 = 1 << 23;
const AES_GCM_INTEGRITY_LIMIT: u64 = 1 << 52;

impl Algorithm for AwsLcPacketAlgorithm {
    fn packet_key(&self, key: AeadKey, iv: Iv) -> Box<dyn PacketKey> {
        let unbound = UnboundKey::new(self.aead, key.as_ref()).expect("rustls hands a key of the suite's length");
        Box::new(AwsLcPacketKey { key: LessSafeKey::new(unbound), iv })
    }

    fn header_protection_key(&self, key: AeadKey) -> Box<dyn HeaderProtectionKey> {
        self.ring.header_protection_key(key)
    }

    fn aead_key_len(&self) -> usize {
        self.aead.key_len()
    }
}

struct AwsLcPacketKey {
    key: LessSafeKey,
    iv: Iv,
}

impl PacketKey for AwsLcPacketKey {
    fn encrypt_in_place(&self, packet_number: u64, header: &[u8], payload: &mut [u8]) -> Result<Tag, Error> {
        let nonce = AeadNonce::assume_unique_for_key(Nonce::new(&self.iv, packet_number).0);
        let tag =
            self.key.seal_in_place_separate_tag(nonce, Aad::from(header), payload).map_err(|_| Error::EncryptError)?;
        Ok(Tag::from(tag.as_ref()))
    }

    fn decrypt_in_place<'a>(
        &self,
        packet_number: u64,
        header: &[u8],
        payload: &'a mut [u8],
    ) -> Result<&'a [u8], Error> {
        let nonce = AeadNonce::assume_unique_for_key(Nonce::new(&self.iv, packet_number).0);
        let plain = self.key.open_in_place(nonce, Aad::from(header), payload).map_err(|_| Error::DecryptError)?;
        Ok(plain)
    }

    fn tag_len(&self) -> usize {
        self.key.algorithm().tag_len()
    }

    fn confidentiality_limit(&self) -> u64 {
        AES_GCM_CONFIDENTIALITY_LIMIT
    }

    fn integrity_limit(&self) -> u64 {
        AES_GCM_INTEGRITY_LIMIT
    }
}

/// ring's TLS 1.3 suite with its QUIC packet protection done by aws-lc-rs (AES-GCM suites); any other
/// suite is returned as it is. Built once per process.
pub fn with_fast_packet_protection(suite: SupportedCipherSuite) -> SupportedCipherSuite {
    use rustls::crypto::ring::cipher_suite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384};
    static SUITES: OnceLock<[(rustls::CipherSuite, SupportedCipherSuite); 2]> = OnceLock::new();
    let suites = SUITES.get_or_init(|| {
        let swap = |ring_suite: SupportedCipherSuite,
                    aead: &'static aead::Algorithm|
         -> (rustls::CipherSuite, SupportedCipherSuite) {
            // Refutable only when another crate enables rustls' `tls12` feature.
            #[allow(irrefutable_let_patterns)]
            let SupportedCipherSuite::Tls13(inner) = ring_suite
            else {
                unreachable!("a TLS 1.3 suite")
            };
            let ring = inner.quic.expect("ring's TLS 1.3 suites support QUIC");
            // Leaked once per process: rustls keeps suites as `&'static`.
            let algorithm: &'static AwsLcPacketAlgorithm = Box::leak(Box::new(AwsLcPacketAlgorithm { aead, ring }));
            let common = CipherSuiteCommon {
                suite: inner.common.suite,
                hash_provider: inner.common.hash_provider,
                confidentiality_limit: inner.common.confidentiality_limit,
            };
            let fast = Tls13CipherSuite {
                common,
                hkdf_provider: inner.hkdf_provider,
                aead_alg: inner.aead_alg,
                quic: Some(algorithm),
            };
            let fast: &'static Tls13CipherSuite = Box::leak(Box::new(fast));
            (ring_suite.suite(), SupportedCipherSuite::Tls13(fast))
        };
        [swap(TLS13_AES_128_GCM_SHA256, &aead::AES_128_GCM), swap(TLS13_AES_256_GCM_SHA384, &aead::AES_256_GCM)]
    });
    suites.iter().find(|(id, _)| *id == suite.suite()).map(|(_, fast)| *fast).unwrap_or(suite)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::crypto::ring::cipher_suite::{
        TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
    };
    use rustls::quic::{Keys, Version};
    use rustls::Side;

    fn tls13(suite: SupportedCipherSuite) -> &'static Tls13CipherSuite {
        #[allow(unreachable_patterns)]
        match suite {
            SupportedCipherSuite::Tls13(s) => s,
            _ => unreachable!("TLS 1.3 suites only"),
        }
    }

    /// Keys derived the same way (RFC 9001 initial keys) give byte-identical packets in both
    /// implementations, each opens the other's, and a flipped bit (header, payload or tag) is refused.
    #[test]
    fn aws_lc_packets_equal_ring_packets_both_ways() {
        for suite in [TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384] {
            let ring_suite = tls13(suite);
            let fast_suite = tls13(with_fast_packet_protection(suite));
            assert!(!std::ptr::eq(ring_suite, fast_suite), "{:?} was not swapped", suite.suite());
            let keys = |s: &'static Tls13CipherSuite, side| {
                Keys::initial(Version::V1, s, s.quic.expect("quic"), b"kvgate-cid", side)
            };
            let (ring_client, fast_client) = (keys(ring_suite, Side::Client), keys(fast_suite, Side::Client));
            let (ring_server, fast_server) = (keys(ring_suite, Side::Server), keys(fast_suite, Side::Server));
            assert_eq!(fast_client.local.packet.tag_len(), ring_client.local.packet.tag_len());
            assert_eq!(
                fast_client.local.packet.confidentiality_limit(),
                ring_client.local.packet.confidentiality_limit()
            );
            assert_eq!(fast_client.local.packet.integrity_limit(), ring_client.local.packet.integrity_limit());
            let header = [0x40u8, 1, 2, 3, 4];
            for (pn, len) in [(0u64, 0usize), (1, 1), (7, 1200), (1 << 20, 65_000)] {
                let plain: Vec<u8> = (0..len).map(|i| (i * 31 + pn as usize) as u8).collect();
                let mut ring_packet = plain.clone();
                let ring_tag = ring_client.local.packet.encrypt_in_place(pn, &header, &mut ring_packet).unwrap();
                ring_packet.extend_from_slice(ring_tag.as_ref());
                let mut fast_packet = plain.clone();
                let fast_tag = fast_client.local.packet.encrypt_in_place(pn, &header, &mut fast_packet).unwrap();
                fast_packet.extend_from_slice(fast_tag.as_ref());
                assert_eq!(ring_packet, fast_packet, "{:?}: packet {pn} of {len} bytes differs", suite.suite());
                // Each side's receiver opens the other implementation's packet.
                let mut copy = ring_packet.clone();
                assert_eq!(fast_server.remote.packet.decrypt_in_place(pn, &header, &mut copy).unwrap(), &plain[..]);
                let mut copy = fast_packet.clone();
                assert_eq!(ring_server.remote.packet.decrypt_in_place(pn, &header, &mut copy).unwrap(), &plain[..]);
                // Tampering is refused: a payload or tag bit, the header, the packet number.
                let last = fast_packet.len() - 1;
                let mut bad = fast_packet.clone();
                bad[last / 2] ^= 1;
                assert!(fast_server.remote.packet.decrypt_in_place(pn, &header, &mut bad).is_err());
                let mut bad = fast_packet.clone();
                bad[last] ^= 0x80;
                assert!(fast_server.remote.packet.decrypt_in_place(pn, &header, &mut bad).is_err());
                let mut copy = fast_packet.clone();
                assert!(fast_server.remote.packet.decrypt_in_place(pn, &[0x41, 1, 2, 3, 4], &mut copy).is_err());
                let mut copy = fast_packet.clone();
                assert!(fast_server.remote.packet.decrypt_in_place(pn + 1, &header, &mut copy).is_err());
            }
        }
    }

    #[test]
    fn chacha20_stays_rings() {
        let suite = TLS13_CHACHA20_POLY1305_SHA256;
        assert!(std::ptr::eq(tls13(with_fast_packet_protection(suite)), tls13(suite)));
    }
}
