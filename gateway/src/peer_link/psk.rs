//! Pre-shared-key authentication of peer links (`peer_link.auth = "psk"`): the key file (mode 0600,
//! hex), the challenge-response both gateways prove in their Hellos (the key never crosses the wire),
//! and the per-direction frame MACs that keep every later frame of the link from being forged,
//! replayed, dropped or reordered by whoever can reach the port.
//!
//! The handshake, over fresh 32-byte nonces `nd` (dialler) and `ns` (server):
//!   dialler -> Hello { nonce: nd }
//!   server  -> Hello { nonce: ns, proof: HMAC(k, "server" | transcript) }
//!   dialler -> AuthProof { proof: HMAC(k, "dialler" | transcript) }   (the server hands the link on only now)
//! where the transcript binds both names, both nonces and both incarnations. Each side then derives
//! the link key HMAC(k, "link" | transcript) and MACs every non-Hello frame with it, under a label
//! for its direction and a sequence number counted by both ends.

use anyhow::{bail, Context};
use kvgate_client::proto::{peer_frame::Frame, PeerFrame};
use prost::Message;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Bytes of key a key file must hold at least (256 bits).
pub const PSK_MIN_BYTES: usize = 32;
/// Bytes of a key `kvgate keygen psk` makes.
pub const PSK_GENERATED_BYTES: usize = 32;
/// Bytes of each Hello nonce.
pub const NONCE_BYTES: usize = 32;
/// Largest key file read (a key file is a line of hex).
const PSK_FILE_MAX_BYTES: u64 = 4096;

/// The deployment's pre-shared key.
pub struct Psk {
    key: hmac::Key,
}

impl std::fmt::Debug for Psk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Psk(..)")
    }
}

impl Psk {
    /// Read a key file: a regular file owned by this user, readable by nobody else (no group or
    /// other permission bits), holding at least `PSK_MIN_BYTES` bytes as hex.
    pub fn load(path: &Path) -> anyhow::Result<Psk> {
        let meta = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
        if !meta.is_file() {
            bail!("{} is not a regular file", path.display());
        }
        if meta.mode() & 0o077 != 0 {
            bail!(
                "{} has mode {:o}: a key file must be readable by its owner only (chmod 600)",
                path.display(),
                meta.mode() & 0o777
            );
        }
        let euid = nix::unistd::geteuid().as_raw();
        if meta.uid() != euid {
            bail!("{} is owned by uid {}, not by this gateway's uid {euid}", path.display(), meta.uid());
        }
        if meta.len() > PSK_FILE_MAX_BYTES {
            bail!(
                "{} is {} bytes: a key file is one line of hex (at most {PSK_FILE_MAX_BYTES} bytes)",
                path.display(),
                meta.len()
            );
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let bytes = decode_hex(text.trim()).with_context(|| format!("{} does not hold a hex key", path.display()))?;
        if bytes.len() < PSK_MIN_BYTES {
            bail!("{} holds {} bytes of key: at least {PSK_MIN_BYTES} are needed", path.display(), bytes.len());
        }
        Ok(Psk { key: hmac::Key::new(hmac::HMAC_SHA256, &bytes) })
    }

    /// A key nobody holds (a fresh random one, never written): a gateway with no peer configured
    /// and no key file refuses every link with it.
    pub fn unusable() -> Psk {
        Psk {
            key: hmac::Key::generate(hmac::HMAC_SHA256, &SystemRandom::new())
                .expect("the system random number generator"),
        }
    }

    /// Write a new random key to `path` (mode 0600, created; an existing file is replaced only with
    /// `overwrite`).
    pub fn generate(path: &Path, overwrite: bool) -> anyhow::Result<()> {
        let mut key = [0u8; PSK_GENERATED_BYTES];
        SystemRandom::new().fill(&mut key).map_err(|_| anyhow::anyhow!("the system random number generator failed"))?;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).mode(0o600);
        if overwrite {
            options.create(true).truncate(true);
        } else {
            options.create_new(true);
        }
        let mut file = options.open(path).with_context(|| match overwrite {
            false => format!("cannot create {} (it exists? pass --force to replace it)", path.display()),
            true => format!("cannot write {}", path.display()),
        })?;
        // An existing file keeps its mode when truncated: make sure it is 0600.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        use std::io::Write;
        writeln!(file, "{}", encode_hex(&key))?;
        file.sync_all()?;
        Ok(())
    }

    fn tag(&self, label: &[u8], transcript: &Transcript) -> hmac::Tag {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(b"kvgate peer-link v1 ");
        ctx.update(label);
        transcript.feed(&mut ctx);
        ctx.sign()
    }

    /// What the server sends in its Hello.
    pub fn server_proof(&self, transcript: &Transcript) -> Vec<u8> {
        self.tag(b"server", transcript).as_ref().to_vec()
    }

    /// What the dialler sends in its `AuthProof`.
    pub fn dialler_proof(&self, transcript: &Transcript) -> Vec<u8> {
        self.tag(b"dialler", transcript).as_ref().to_vec()
    }

    /// Whether `proof` is the server's (constant time).
    pub fn check_server_proof(&self, transcript: &Transcript, proof: &[u8]) -> bool {
        constant_time_eq(self.tag(b"server", transcript).as_ref(), proof)
    }

    /// Whether `proof` is the dialler's (constant time).
    pub fn check_dialler_proof(&self, transcript: &Transcript, proof: &[u8]) -> bool {
        constant_time_eq(self.tag(b"dialler", transcript).as_ref(), proof)
    }

    /// The MACs of one established link, for the side that dialled (`dialler`) or accepted it.
    pub fn link_macs(&self, transcript: &Transcript, dialler: bool) -> (FrameSealer, FrameOpener) {
        let link = self.tag(b"link", transcript);
        let key = hmac::Key::new(hmac::HMAC_SHA256, link.as_ref());
        let (out_label, in_label): (&'static [u8], &'static [u8]) =
            if dialler { (b"d->s", b"s->d") } else { (b"s->d", b"d->s") };
        (FrameSealer { key: key.clone(), label: out_label, seq: 0 }, FrameOpener { key, label: in_label, seq: 0 })
    }
}

/// A fresh random nonce.
pub fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE_BYTES];
    SystemRandom::new().fill(&mut n).expect("the system random number generator");
    n
}

/// What both proofs and the link key are bound to.
pub struct Transcript<'a> {
    pub dialler: &'a str,
    pub server: &'a str,
    pub dialler_nonce: &'a [u8],
    pub server_nonce: &'a [u8],
    pub dialler_incarnation: u64,
    pub server_incarnation: u64,
}

impl Transcript<'_> {
    fn feed(&self, ctx: &mut hmac::Context) {
        for field in [self.dialler.as_bytes(), self.server.as_bytes(), self.dialler_nonce, self.server_nonce] {
            ctx.update(&(field.len() as u64).to_be_bytes());
            ctx.update(field);
        }
        ctx.update(&self.dialler_incarnation.to_be_bytes());
        ctx.update(&self.server_incarnation.to_be_bytes());
    }
}

fn frame_tag(key: &hmac::Key, label: &[u8], seq: u64, frame: &PeerFrame) -> hmac::Tag {
    let mut ctx = hmac::Context::with_key(key);
    ctx.update(label);
    ctx.update(&seq.to_be_bytes());
    ctx.update(&frame.encode_to_vec());
    ctx.sign()
}

/// MACs outbound frames (every one but a Hello), numbering them in send order.
pub struct FrameSealer {
    key: hmac::Key,
    label: &'static [u8],
    seq: u64,
}

impl FrameSealer {
    pub fn seal(&mut self, mut frame: PeerFrame) -> PeerFrame {
        if matches!(frame.frame, Some(Frame::Hello(_))) {
            return frame;
        }
        frame.mac.clear();
        let tag = frame_tag(&self.key, self.label, self.seq, &frame);
        self.seq += 1;
        frame.mac = tag.as_ref().to_vec();
        frame
    }
}

/// Checks inbound frames' MACs in arrival order.
pub struct FrameOpener {
    key: hmac::Key,
    label: &'static [u8],
    seq: u64,
}

impl FrameOpener {
    /// The frame, if its MAC is the next one of this direction.
    pub fn open(&mut self, mut frame: PeerFrame) -> Result<PeerFrame, String> {
        let mac = std::mem::take(&mut frame.mac);
        if mac.is_empty() {
            return Err(format!("frame {} carries no MAC", self.seq));
        }
        let expected = frame_tag(&self.key, self.label, self.seq, &frame);
        if !constant_time_eq(expected.as_ref(), &mac) {
            return Err(format!("frame {} has a bad MAC (forged, replayed or reordered)", self.seq));
        }
        self.seq += 1;
        Ok(frame)
    }
}

/// Whether two byte strings are equal, in time that does not depend on where they differ.
pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_hex(text: &str) -> anyhow::Result<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        bail!("an odd number of hex digits");
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(text.get(i..i + 2).unwrap_or("zz"), 16)
                .map_err(|_| anyhow::anyhow!("not hex at character {i}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_client::proto;

    fn transcript<'a>(dn: &'a [u8], sn: &'a [u8]) -> Transcript<'a> {
        Transcript {
            dialler: "decode-0",
            server: "prefill-0",
            dialler_nonce: dn,
            server_nonce: sn,
            dialler_incarnation: 1,
            server_incarnation: 2,
        }
    }

    fn key_in(dir: &Path, name: &str) -> Psk {
        let path = dir.join(name);
        Psk::generate(&path, false).unwrap();
        Psk::load(&path).unwrap()
    }

    #[test]
    fn a_generated_key_is_0600_and_not_overwritten_without_force() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("peer.key");
        Psk::generate(&path, false).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        let first = std::fs::read_to_string(&path).unwrap();
        assert_eq!(first.trim().len(), 2 * PSK_GENERATED_BYTES);
        assert!(Psk::generate(&path, false).unwrap_err().to_string().contains("--force"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        Psk::generate(&path, true).unwrap();
        assert_ne!(std::fs::read_to_string(&path).unwrap(), first);
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
    }

    #[test]
    fn a_key_file_others_can_read_or_a_short_key_is_refused_with_why() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        Psk::generate(&path, false).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(Psk::load(&path).unwrap_err().to_string().contains("chmod 600"));
        std::fs::write(&path, "00ff\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Psk::load(&path).unwrap_err().to_string().contains("at least 32"));
        std::fs::write(&path, "zz".repeat(40)).unwrap();
        assert!(format!("{:#}", Psk::load(&path).unwrap_err()).contains("not hex"));
        assert!(Psk::load(&dir.path().join("missing")).unwrap_err().to_string().contains("cannot read"));
    }

    #[test]
    fn proofs_hold_only_under_the_same_key_and_transcript() {
        let dir = tempfile::tempdir().unwrap();
        let (k, other) = (key_in(dir.path(), "a"), key_in(dir.path(), "b"));
        let (dn, sn) = (nonce(), nonce());
        let t = transcript(&dn, &sn);
        assert!(k.check_server_proof(&t, &k.server_proof(&t)));
        assert!(k.check_dialler_proof(&t, &k.dialler_proof(&t)));
        // The server's proof is not the dialler's (no reflection), another key proves nothing, and a
        // proof made for other nonces (a replay) fails.
        assert!(!k.check_dialler_proof(&t, &k.server_proof(&t)));
        assert!(!k.check_server_proof(&t, &other.server_proof(&t)));
        let fresh = nonce();
        assert!(!k.check_server_proof(&transcript(&dn, &fresh), &k.server_proof(&t)));
        assert!(!k.check_server_proof(&t, &[]));
    }

    #[test]
    fn frames_open_only_in_order_unmodified_and_in_their_direction() {
        let dir = tempfile::tempdir().unwrap();
        let k = key_in(dir.path(), "a");
        let (dn, sn) = (nonce(), nonce());
        let t = transcript(&dn, &sn);
        let (mut d_out, mut d_in) = k.link_macs(&t, true);
        let (mut s_out, mut s_in) = k.link_macs(&t, false);
        let hb = |seq| PeerFrame { frame: Some(Frame::Heartbeat(proto::Heartbeat { seq })), mac: vec![] };
        let (a, b) = (d_out.seal(hb(1)), d_out.seal(hb(2)));
        // Reordered: b first fails; then a and b in order pass.
        let mut s_in2 = k.link_macs(&t, false).1;
        assert!(s_in2.open(b.clone()).is_err());
        assert_eq!(s_in.open(a.clone()).unwrap(), hb(1));
        assert!(s_in.open(a.clone()).is_err(), "a replay fails");
        assert_eq!(s_in.open(b).unwrap(), hb(2));
        // A modified frame fails; a frame reflected back to its sender fails.
        let mut tampered = s_out.seal(hb(3));
        tampered.frame = Some(Frame::Heartbeat(proto::Heartbeat { seq: 4 }));
        assert!(d_in.open(tampered).is_err());
        let mut d_in2 = k.link_macs(&t, true).1;
        assert!(d_in2.open(d_out.seal(hb(5))).is_err());
        // A Hello is never sealed; an unsealed frame never opens.
        let hello = PeerFrame { frame: Some(Frame::Hello(proto::Hello::default())), mac: vec![] };
        assert!(d_out.seal(hello.clone()).mac.is_empty());
        assert!(k.link_macs(&t, false).1.open(hb(1)).unwrap_err().contains("no MAC"));
    }
}
