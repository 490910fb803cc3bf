//! `gpumem certs`: the certificates that authenticate kube-scheduler and the scorer to each other.
//!
//! A fresh CA signs two certificates: the scorer's (server: the names it is reached by) and
//! kube-scheduler's (client). The CA's key is never written: nobody can later issue another
//! certificate the scorer trusts. Rotating is running it again and replacing both sides.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

/// `gpumem certs` command line.
#[derive(Debug, clap::Args)]
pub struct CertsArgs {
    /// Directory to write ca.crt, scorer.crt, scorer.key, scheduler.crt and scheduler.key into.
    #[arg(long)]
    pub out: PathBuf,
    /// The scorer's Service name, for its default DNS names (NAME, NAME.NAMESPACE,
    /// NAME.NAMESPACE.svc, NAME.NAMESPACE.svc.cluster.local).
    #[arg(long, default_value = "gpumem-scorer")]
    pub service: String,
    /// The scorer's namespace.
    #[arg(long, default_value = "gpumem-system")]
    pub namespace: String,
    /// Another DNS name or IP address kube-scheduler reaches the scorer by (repeatable);
    /// `localhost` and 127.0.0.1 are always included.
    #[arg(long = "scorer-name", value_name = "NAME")]
    pub scorer_names: Vec<String>,
    /// Days the certificates are valid.
    #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=3650))]
    pub days: u32,
    /// Replace certificates already in `--out`.
    #[arg(long)]
    pub force: bool,
}

/// What [`generate`] makes: PEM text.
pub struct Bundle {
    pub ca_cert: String,
    pub scorer_cert: String,
    pub scorer_key: String,
    pub scheduler_cert: String,
    pub scheduler_key: String,
}

/// The files of a [`Bundle`] in a directory, and whether each is secret.
pub const FILES: [(&str, bool); 5] = [
    ("ca.crt", false),
    ("scorer.crt", false),
    ("scorer.key", true),
    ("scheduler.crt", false),
    ("scheduler.key", true),
];

/// The names the scorer's certificate carries for a Service `service` in `namespace`, plus `extra`.
pub fn scorer_names(service: &str, namespace: &str, extra: &[String]) -> Vec<String> {
    let mut names = vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
        "localhost".to_string(),
        "127.0.0.1".to_string(),
    ];
    for name in extra {
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
    names
}

/// A CA and the two certificates it signs, valid from an hour ago (clocks differ) for `days`.
pub fn generate(scorer_names: &[String], days: u32) -> anyhow::Result<Bundle> {
    let now = OffsetDateTime::now_utc();
    let validity = |params: &mut CertificateParams| {
        params.not_before = now - Duration::hours(1);
        params.not_after = now + Duration::days(i64::from(days));
    };

    let ca_key = KeyPair::generate().context("generating the CA key")?;
    let mut ca = CertificateParams::default();
    validity(&mut ca);
    ca.distinguished_name = name("gpumem extender CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).context("signing the CA")?;
    let issuer = Issuer::new(ca, ca_key);

    let mut sans = Vec::with_capacity(scorer_names.len());
    for n in scorer_names {
        sans.push(match n.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => {
                crate::names::check_subdomain(n)
                    .map_err(|e| anyhow::anyhow!("{n:?} is not an IP address nor a DNS name: {e}"))?;
                SanType::DnsName(n.as_str().try_into().context("a DNS name")?)
            }
        });
    }
    let scorer_key = KeyPair::generate().context("generating the scorer's key")?;
    let mut scorer = CertificateParams::default();
    validity(&mut scorer);
    scorer.distinguished_name = name("gpumem-scorer");
    scorer.subject_alt_names = sans;
    scorer.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    scorer.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let scorer_cert = scorer
        .signed_by(&scorer_key, &issuer)
        .context("signing the scorer's certificate")?;

    let scheduler_key = KeyPair::generate().context("generating kube-scheduler's key")?;
    let mut scheduler = CertificateParams::default();
    validity(&mut scheduler);
    scheduler.distinguished_name = name("kube-scheduler");
    scheduler.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    scheduler.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let scheduler_cert = scheduler
        .signed_by(&scheduler_key, &issuer)
        .context("signing kube-scheduler's certificate")?;

    Ok(Bundle {
        ca_cert: ca_cert.pem(),
        scorer_cert: scorer_cert.pem(),
        scorer_key: scorer_key.serialize_pem(),
        scheduler_cert: scheduler_cert.pem(),
        scheduler_key: scheduler_key.serialize_pem(),
    })
}

fn name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

impl Bundle {
    fn contents(&self) -> [&str; 5] {
        [
            &self.ca_cert,
            &self.scorer_cert,
            &self.scorer_key,
            &self.scheduler_cert,
            &self.scheduler_key,
        ]
    }

    /// Writes [`FILES`] into `dir` (keys readable by the owner only), each durably
    /// ([`crate::durable`]): a reader never sees half a file. Without `force`, refuses if any exists.
    pub fn write(&self, dir: &Path, force: bool) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        if !force && let Some((file, _)) = FILES.iter().find(|(file, _)| dir.join(file).exists()) {
            anyhow::bail!(
                "{} exists: pass --force to replace the certificates in {}",
                dir.join(file).display(),
                dir.display()
            );
        }
        for ((file, secret), text) in FILES.iter().zip(self.contents()) {
            let path = dir.join(file);
            crate::durable::write(&path, text.as_bytes(), if *secret { 0o600 } else { 0o644 })
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

/// `gpumem certs`.
pub fn run(args: &CertsArgs) -> anyhow::Result<()> {
    crate::names::check_label(&args.service).map_err(|e| anyhow::anyhow!("--service: {e}"))?;
    crate::names::check_label(&args.namespace).map_err(|e| anyhow::anyhow!("--namespace: {e}"))?;
    let names = scorer_names(&args.service, &args.namespace, &args.scorer_names);
    let bundle = generate(&names, args.days)?;
    bundle.write(&args.out, args.force)?;
    let dir = args.out.display();
    println!(
        "wrote {dir}/{{ca.crt,scorer.crt,scorer.key,scheduler.crt,scheduler.key}}, valid {} days",
        args.days
    );
    println!("scorer certificate names: {}", names.join(", "));
    println!("next (docs/operate.md, \"Security\"):");
    println!(
        "  kubectl -n {ns} create secret generic gpumem-scorer-tls --from-file=tls.crt={dir}/scorer.crt \
         --from-file=tls.key={dir}/scorer.key --from-file=ca.crt={dir}/ca.crt",
        ns = args.namespace
    );
    println!(
        "  kubectl -n {ns} create secret generic gpumem-scheduler-tls --from-file=tls.crt={dir}/scheduler.crt \
         --from-file=tls.key={dir}/scheduler.key --from-file=ca.crt={dir}/ca.crt",
        ns = args.namespace
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cover_the_service_and_the_loopback_without_duplicates() {
        let names = scorer_names("s", "ns", &["10.0.0.7".into(), "localhost".into()]);
        assert_eq!(
            names,
            [
                "s",
                "s.ns",
                "s.ns.svc",
                "s.ns.svc.cluster.local",
                "localhost",
                "127.0.0.1",
                "10.0.0.7"
            ]
        );
    }

    #[test]
    fn a_name_that_is_neither_dns_nor_ip_is_refused() {
        let err = generate(&["not a name".into()], 1).err().expect("refused");
        assert!(err.to_string().contains("\"not a name\""), "{err:#}");
    }
}
