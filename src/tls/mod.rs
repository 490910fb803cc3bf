//! TLS for the scorer's extender port: kube-scheduler's extender `tlsConfig` presents a client
//! certificate, which the scorer verifies against `clientCAFile`, so that only the scheduler can make
//! it filter, prioritize, preempt and bind. [`certs`] makes the certificates.
//!
//! The files are read again when they change (Kubernetes updates a mounted Secret in place), checked
//! at each new connection: a rotated certificate needs no restart, and a broken one (half-copied,
//! a key that does not match) is reported and the last good one kept.

pub mod certs;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use anyhow::Context as _;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

/// The `tls` key of the scorer's configuration: PEM files, as a `kubernetes.io/tls` Secret mounts
/// them (`tls.crt`, `tls.key`, `ca.crt`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TlsFiles {
    /// The server's certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// The CAs whose client certificates are accepted: kube-scheduler's `tlsConfig.certFile` must be
    /// signed by one of them. A client without a certificate is refused during the handshake.
    #[serde(rename = "clientCAFile")]
    pub client_ca_file: PathBuf,
}

impl TlsFiles {
    fn paths(&self) -> [&Path; 3] {
        [&self.cert_file, &self.key_file, &self.client_ca_file]
    }

    /// The server configuration these files make, or what is wrong with them.
    pub fn load(&self) -> anyhow::Result<Arc<ServerConfig>> {
        let chain = certificates(&self.cert_file)?;
        let key = PrivateKeyDer::from_pem_file(&self.key_file)
            .map_err(|e| anyhow::anyhow!("reading a private key from {}: {e}", self.key_file.display()))?;
        let mut roots = RootCertStore::empty();
        for ca in certificates(&self.client_ca_file)? {
            roots
                .add(ca)
                .with_context(|| format!("a CA certificate in {}", self.client_ca_file.display()))?;
        }
        // The provider is named rather than taken from the process default, which the kube client's
        // dependencies could set differently.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .context("the client CA")?;
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS versions")?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .with_context(|| {
                format!(
                    "{} and {} do not make a certificate and its key",
                    self.cert_file.display(),
                    self.key_file.display()
                )
            })?;
        // h2 first: rustls takes the server's order, and kube-scheduler offers both (why: the http
        // module's notes).
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

fn certificates(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("reading certificates from {}: {e}", path.display()))?;
    if certs.is_empty() {
        anyhow::bail!("{} holds no PEM certificate", path.display());
    }
    Ok(certs)
}

/// What identifies a version of a file: a Secret update replaces it (new inode, new time).
type Stamp = Option<(SystemTime, u64, u64)>;

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len(), meta.ino()))
}

/// The TLS side of a server: the configuration from [`TlsFiles`], reloaded when they change.
pub struct TlsServer {
    files: TlsFiles,
    current: Mutex<Current>,
}

struct Current {
    stamps: [Stamp; 3],
    acceptor: TlsAcceptor,
}

impl TlsServer {
    /// Fails if the files do not make a configuration: a server must not start without one.
    pub fn new(files: TlsFiles) -> anyhow::Result<TlsServer> {
        let stamps = files.paths().map(stamp);
        let acceptor = TlsAcceptor::from(files.load()?);
        Ok(TlsServer {
            files,
            current: Mutex::new(Current { stamps, acceptor }),
        })
    }

    pub fn client_ca_file(&self) -> &Path {
        &self.files.client_ca_file
    }

    /// The acceptor for a new connection: from the files as they are now if they changed and load,
    /// else the last good one.
    pub fn acceptor(&self) -> TlsAcceptor {
        let stamps = self.files.paths().map(stamp);
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if stamps != current.stamps {
            // Tried once per change: a bad file is reported once, not at every connection.
            current.stamps = stamps;
            match self.files.load() {
                Ok(config) => {
                    tracing::info!(cert = %self.files.cert_file.display(), "TLS files changed: reloaded");
                    current.acceptor = TlsAcceptor::from(config);
                }
                Err(e) => {
                    tracing::error!("TLS files changed but do not load, keeping the previous ones: {e:#}")
                }
            }
        }
        current.acceptor.clone()
    }
}
