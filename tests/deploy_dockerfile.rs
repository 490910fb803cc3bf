//! The Dockerfile, linted by reading (no container engine here): multi-stage, both artifacts built
//! for glibc 2.17, the shim where the agent's init container copies it from, a non-root default
//! user, and a build context that leaves out build outputs.

mod deploy_support;

use deploy_support::*;

/// Instructions (continuation lines joined, comments dropped) as (KEYWORD, arguments).
fn instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if let Some(body) = trimmed.strip_suffix('\\') {
            current.push_str(body.trim_end());
            current.push(' ');
            continue;
        }
        current.push_str(trimmed);
        let (kw, args) = current.split_once(' ').unwrap_or((&current, ""));
        out.push((kw.to_ascii_uppercase(), args.trim().to_string()));
        current.clear();
    }
    out
}

#[test]
fn the_image_is_built_as_the_deployment_expects() {
    let text = read(&repo().join("Dockerfile"));
    let ins = instructions(&text);
    const KNOWN: &[&str] = &[
        "ARG",
        "FROM",
        "RUN",
        "WORKDIR",
        "COPY",
        "LABEL",
        "USER",
        "ENTRYPOINT",
        "CMD",
        "ENV",
    ];
    for (kw, _) in &ins {
        assert!(KNOWN.contains(&kw.as_str()), "unknown instruction {kw}");
    }
    let froms: Vec<&String> = ins.iter().filter(|(k, _)| k == "FROM").map(|(_, a)| a).collect();
    assert!(froms.len() >= 2, "multi-stage");
    let stages: Vec<&str> = froms.iter().filter_map(|a| a.split(" AS ").nth(1)).collect();
    for (kw, args) in &ins {
        if kw == "COPY"
            && let Some(from) = args.split_whitespace().find_map(|w| w.strip_prefix("--from="))
        {
            assert!(stages.contains(&from), "COPY --from={from}: no such stage");
        }
    }
    let run = ins
        .iter()
        .filter(|(k, _)| k == "RUN")
        .map(|(_, a)| a.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        run.contains("cargo zigbuild") && run.contains("x86_64-unknown-linux-gnu.2.17"),
        "glibc 2.17 build"
    );
    assert!(run.contains("--locked"));
    assert!(run.contains("--package gpumem-cuda-shim") && run.contains("--bin gpumem"));
    // The final stage: the paths the chart uses, a non-root user, the binary as entrypoint.
    let last_from = ins.iter().rposition(|(k, _)| k == "FROM").unwrap();
    let last = &ins[last_from..];
    let copies: Vec<&str> = last
        .iter()
        .filter(|(k, _)| k == "COPY")
        .map(|(_, a)| a.as_str())
        .collect();
    for dest in [
        "/usr/local/lib/gpumem/libgpumem_cuda.so",
        "/usr/local/bin/gpumem",
        "/bin/busybox",
    ] {
        assert!(
            copies.iter().any(|c| c.ends_with(dest)),
            "the image has no {dest}"
        );
    }
    let user = last
        .iter()
        .rev()
        .find(|(k, _)| k == "USER")
        .map(|(_, a)| a.as_str())
        .expect("a USER");
    assert!(!user.starts_with("0") && !user.starts_with("root"), "USER {user}");
    let entry = last.iter().find(|(k, _)| k == "ENTRYPOINT").unwrap();
    assert_eq!(entry.1, r#"["/usr/local/bin/gpumem"]"#);
    // The chart's init container and commands use what the image has.
    let ds = read(&chart_dir().join("templates/agent-daemonset.yaml"));
    assert!(ds.contains("- /bin/busybox") && ds.contains("cp /usr/local/lib/gpumem/libgpumem_cuda.so"));

    let ignore = read(&repo().join(".dockerignore"));
    assert!(
        ignore.lines().any(|l| l.trim() == "target/"),
        ".dockerignore leaves out target/"
    );
    for needed in [
        "src",
        "proto",
        "shim",
        "accounting",
        "profile",
        "Cargo.lock",
        "build.rs",
    ] {
        assert!(
            !ignore.lines().any(|l| l.trim().trim_end_matches('/') == needed),
            "{needed} is needed to build"
        );
    }
}

#[test]
fn the_lint_can_fail() {
    let ins = instructions("FROM a AS b\n# c\nRUN x \\\n  y\nUSER 0\n");
    assert_eq!(
        ins,
        [
            ("FROM".into(), "a AS b".into()),
            ("RUN".into(), "x y".into()),
            ("USER".into(), "0".into())
        ]
    );
}
