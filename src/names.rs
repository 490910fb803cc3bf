//! Kubernetes names: the rules the API server applies to object names (apimachinery's
//! `IsDNS1123Label` / `IsDNS1123Subdomain`, and `IsExtendedResourceName` for resource names), checked
//! before a name from outside is put into an API path or offered to the kubelet.

/// Longest DNS-1123 label (namespaces).
const LABEL_MAX: usize = 63;
/// Longest DNS-1123 subdomain (pod and node names).
const SUBDOMAIN_MAX: usize = 253;

/// A namespace name: lowercase alphanumerics and '-', starting and ending alphanumeric, at most 63.
pub fn check_label(name: &str) -> Result<(), String> {
    if name.len() > LABEL_MAX {
        return Err(format!(
            "{:?} is longer than {LABEL_MAX} characters",
            truncated(name)
        ));
    }
    if !is_label(name) {
        return Err(format!(
            "{:?} is not a DNS-1123 label (lowercase letters, digits and '-', starting and ending \
             with a letter or digit)",
            truncated(name)
        ));
    }
    Ok(())
}

/// A pod or node name: DNS-1123 labels joined by '.', at most 253 characters.
pub fn check_subdomain(name: &str) -> Result<(), String> {
    if name.len() > SUBDOMAIN_MAX {
        return Err(format!(
            "{:?} is longer than {SUBDOMAIN_MAX} characters",
            truncated(name)
        ));
    }
    if !name.split('.').all(is_label) {
        return Err(format!(
            "{:?} is not a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', each part \
             starting and ending with a letter or digit)",
            truncated(name)
        ));
    }
    Ok(())
}

/// What the API server accepts as an extended resource name, the rules of Kubernetes'
/// `IsExtendedResourceName`: not in the `kubernetes.io` domain (no `/` at all means that domain too),
/// no `requests.` prefix, and `requests.<name>` a qualified name: a DNS-1123 subdomain of at most 253
/// characters, one `/`, and a name part of 1 to 63 letters, digits, `-`, `_`, `.` that starts and ends
/// alphanumeric. The kubelet refuses to register anything else, so the agent would retry forever.
pub fn check_extended_resource_name(name: &str) -> Result<(), String> {
    const QUOTA_PREFIX: &str = "requests.";
    const NAME_MAX: usize = 63;
    let Some((domain, local)) = name.split_once('/') else {
        return Err("it needs a domain: <domain>/<name>, e.g. example.com/gpu-mem".into());
    };
    if name.contains("kubernetes.io/") {
        return Err(
            "Kubernetes keeps the kubernetes.io domain (any name containing \"kubernetes.io/\") \
                    for its own resources"
                .into(),
        );
    }
    if name.starts_with(QUOTA_PREFIX) {
        return Err(format!(
            "it must not start with {QUOTA_PREFIX:?} (the prefix of resource quota names)"
        ));
    }
    if local.contains('/') {
        return Err("it has more than one '/'".into());
    }
    // The quota name `requests.<domain>/<name>` must be valid too, which costs the domain 9 characters.
    let domain_max = SUBDOMAIN_MAX - QUOTA_PREFIX.len();
    if domain.len() > domain_max {
        return Err(format!("the domain is longer than {domain_max} characters"));
    }
    if !domain.split('.').all(is_label) {
        return Err(format!(
            "the domain {domain:?} is not a DNS subdomain: lower-case letters, digits, '-' and '.', \
             every dot-separated part starting and ending with a letter or digit"
        ));
    }
    if local.is_empty() || local.len() > NAME_MAX {
        return Err(format!("the part after '/' must have 1 to {NAME_MAX} characters"));
    }
    let alnum = |c: char| c.is_ascii_alphanumeric();
    if !(local.starts_with(alnum)
        && local.ends_with(alnum)
        && local.chars().all(|c| alnum(c) || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "the part after '/', {local:?}, may hold only letters, digits, '-', '_' and '.' \
             (no spaces) and must start and end with a letter or digit"
        ));
    }
    Ok(())
}

/// One label without the length limit (a subdomain's parts are bounded only by the whole).
fn is_label(part: &str) -> bool {
    let bytes = part.as_bytes();
    let edge = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => edge(first) && edge(last) && bytes.iter().all(|b| edge(b) || *b == b'-'),
        _ => false,
    }
}

/// Error messages quote at most this much of a name that came from outside.
fn truncated(name: &str) -> &str {
    let mut end = name.len().min(80);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        for good in ["a", "team-a", "0", "a-0-b", &"x".repeat(63)] {
            assert_eq!(check_label(good), Ok(()), "{good}");
        }
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", "a b", "ä", &"x".repeat(64)] {
            assert!(check_label(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn subdomains() {
        for good in ["node-0001", "gpu-node-1.example.com", "a.b.c", &"x".repeat(253)] {
            assert_eq!(check_subdomain(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            ".a",
            "a.",
            "a..b",
            "victim/../../../../api/v1/nodes/node-0001",
            "a%2Fb",
            "a b",
            "Node",
            &"x".repeat(254),
        ] {
            assert!(check_subdomain(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn messages_quote_a_bounded_prefix() {
        let long = "é".repeat(1000);
        let e = check_subdomain(&long).unwrap_err();
        assert!(e.len() < 200, "{e}");
    }

    #[test]
    fn resource_names_follow_the_api_servers_rules_for_extended_resources() {
        let long_domain = format!("{}.com/gpu", "a".repeat(241));
        let longest_domain = format!("{}.com/gpu", "a".repeat(240));
        let long_name = format!("example.com/{}", "g".repeat(64));
        let longest_name = format!("example.com/{}", "g".repeat(63));
        for good in [
            "nvidia.com/gpu-mem",
            "example.com/VRAM_1.5",
            "example/gpu",
            "a-1.b-2.example.com/x",
            longest_domain.as_str(),
            longest_name.as_str(),
        ] {
            assert_eq!(check_extended_resource_name(good), Ok(()), "{good}");
        }
        for (bad, why) in [
            ("gpu-mem", "needs a domain"),
            ("kubernetes.io/gpu", "kubernetes.io"),
            ("gpu.kubernetes.io/mem", "kubernetes.io"),
            ("requests.example.com/gpu", "requests."),
            ("example.com/gpu/mem", "more than one '/'"),
            ("/gpu", "not a DNS subdomain"),
            ("Example.com/gpu", "not a DNS subdomain"),
            ("example..com/gpu", "not a DNS subdomain"),
            ("-example.com/gpu", "not a DNS subdomain"),
            ("example.com-/gpu", "not a DNS subdomain"),
            ("exa mple.com/gpu", "not a DNS subdomain"),
            (long_domain.as_str(), "longer than 244"),
            ("example.com/", "1 to 63"),
            (long_name.as_str(), "1 to 63"),
            ("example.com/gpu mem", "no spaces"),
            ("example.com/gpu ", "no spaces"),
            ("example.com/-gpu", "start and end"),
            ("example.com/gpu.", "start and end"),
            ("example.com/gpu+mem", "only letters"),
        ] {
            let err = check_extended_resource_name(bad).expect_err(bad);
            assert!(err.contains(why), "{bad}: {err}");
        }
    }
}
