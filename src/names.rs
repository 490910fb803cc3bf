//! Kubernetes names: the rules the API server applies to object names (apimachinery's
//! `IsDNS1123Label` / `IsDNS1123Subdomain`), checked before a name from outside is put into an API path.

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
}
