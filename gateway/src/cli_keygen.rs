//! `kvgate keygen`: the material that authenticates peer links. `psk FILE` writes a random
//! pre-shared key (mode 0600) for `peer_link.auth = "psk"`; `tls --dir DIR --name A --name B` makes a
//! CA and one certificate and key per gateway name for `peer_link.auth = "tls"`. Never overwrites a
//! file unless told to.

use crate::peer_link::psk::Psk;
use anyhow::{bail, Context};
use clap::Subcommand;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug)]
pub enum KeygenCommand {
    /// Write a new pre-shared key (peer_link.psk_file): every gateway of the deployment uses the same file.
    Psk {
        file: PathBuf,
        /// Replace an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Make a CA and a certificate + key per gateway (peer_link.tls): DIR/ca.pem, DIR/NAME.pem, DIR/NAME.key.
    Tls {
        #[arg(long)]
        dir: PathBuf,
        /// A gateway name; its certificate is valid for this DNS name (its peers' `tls_name`). Repeat per gateway.
        #[arg(long = "name", required = true)]
        names: Vec<String>,
        /// Extra names or IP addresses every certificate is also valid for (e.g. 127.0.0.1).
        #[arg(long = "also")]
        also: Vec<String>,
        /// Replace existing files.
        #[arg(long)]
        force: bool,
    },
}

pub fn run(command: KeygenCommand) -> i32 {
    let result = match command {
        KeygenCommand::Psk { file, force } => Psk::generate(&file, force).map(|()| {
            println!("wrote a pre-shared key to {} (mode 0600)", file.display());
            println!(
                "give every gateway of the deployment this file: [peer_link] psk_file = {:?}",
                file.display().to_string()
            );
        }),
        KeygenCommand::Tls { dir, names, also, force } => make_tls(&dir, &names, &also, force),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvgate keygen: {e:#}");
            1
        }
    }
}

fn write_file(path: &Path, text: &str, mode: u32, force: bool) -> anyhow::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).mode(mode);
    if force {
        options.create(true).truncate(true);
    } else {
        options.create_new(true);
    }
    let mut file = options
        .open(path)
        .with_context(|| format!("cannot create {} (it exists? pass --force to replace it)", path.display()))?;
    use std::io::Write;
    file.write_all(text.as_bytes())?;
    Ok(())
}

fn make_tls(dir: &Path, names: &[String], also: &[String], force: bool) -> anyhow::Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    for name in names {
        if name.is_empty()
            || !name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
            || !seen.insert(name)
        {
            bail!("--name {name:?}: each gateway name once, of [A-Za-z0-9._-]");
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, "kvgate peer-link CA");
    let ca_key = rcgen::KeyPair::generate()?;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    write_file(&dir.join("ca.pem"), &ca_cert.pem(), 0o644, force)?;
    write_file(&dir.join("ca.key"), &ca_key.serialize_pem(), 0o600, force)?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    for name in names {
        let sans: Vec<String> = std::iter::once(name.clone()).chain(also.iter().cloned()).collect();
        let params = rcgen::CertificateParams::new(sans).with_context(|| format!("names of {name}"))?;
        let key = rcgen::KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        write_file(&dir.join(format!("{name}.pem")), &cert.pem(), 0o644, force)?;
        write_file(&dir.join(format!("{name}.key")), &key.serialize_pem(), 0o600, force)?;
    }
    println!("wrote {}/ca.pem (keep ca.key offline) and a certificate + key per gateway:", dir.display());
    for name in names {
        println!("  {name}: [peer_link.tls] cert_file = \"{0}/{name}.pem\", key_file = \"{0}/{name}.key\", ca_file = \"{0}/ca.pem\"; its peers set tls_name = \"{name}\"", dir.display());
    }
    Ok(())
}
