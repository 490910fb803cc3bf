//! The layout's one rule that a reader relies on: dependencies go one way, between a crate's top-level
//! modules and between the files of one module. A module that imports from a module that (directly or
//! through others) imports it back makes both unreadable on their own; these tests find any such cycle,
//! in every crate of the workspace, by the `crate::` and `super::` paths each file names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The source folder of every crate in the workspace.
const CRATES: [&str; 7] = [
    "src",
    "profile/src",
    "fake-nvml/src",
    "accounting/src",
    "shim/src",
    "fake-cuda/src",
    "scale/src",
];

/// Every `.rs` file under `root` (a crate's source folder): its path relative to `root`, and its text.
fn sources_of(root: &str) -> Vec<(PathBuf, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(root);
    let mut files = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("a source file");
                files.push((path.strip_prefix(&src).expect("under src").to_path_buf(), text));
            }
        }
    }
    files
}

/// Every `.rs` file of the main crate (`src/`).
fn sources() -> Vec<(PathBuf, String)> {
    sources_of("src")
}

/// A module's name as `crate::` and `super::` paths spell it: lower case, digits, underscores.
fn module_name(rest: &str) -> String {
    rest.chars()
        .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
        .collect()
}

/// Top-level module of the crate at `root` → the top-level modules its files name (`crate::x`).
fn imports(root: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (relative, text) in sources_of(root) {
        let first = relative.components().next().expect("a component");
        let module = first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if module == "main" || module == "lib" {
            continue;
        }
        let named = graph.entry(module.clone()).or_default();
        for (at, _) in text.match_indices("crate::") {
            let rest = &text[at + "crate::".len()..];
            let name = module_name(rest);
            if !name.is_empty() && name != module {
                named.insert(name);
            }
        }
    }
    graph
}

/// A cycle through `start`, if there is one.
fn cycle_through(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![vec![start.to_string()]];
    let mut seen = BTreeSet::new();
    while let Some(path) = stack.pop() {
        let last = path.last().expect("non-empty").clone();
        for next in graph.get(&last).into_iter().flatten() {
            if next == start {
                let mut cycle = path.clone();
                cycle.push(next.clone());
                return Some(cycle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push(longer);
            }
        }
    }
    None
}

#[test]
fn top_level_modules_depend_one_way() {
    let graph = imports("src");
    assert!(
        graph.contains_key("agent") && graph.contains_key("plugin"),
        "{graph:?}"
    );
    // Names with digits are read whole (`k8s` was read as `k`, and a cycle through it went unseen).
    assert!(
        imports("scale/src").values().any(|named| named.contains("k8s")),
        "{:?}",
        imports("scale/src")
    );
    let cycles: Vec<String> = CRATES
        .iter()
        .flat_map(|root| {
            let graph = imports(root);
            graph
                .keys()
                .filter_map(|m| cycle_through(&graph, m))
                .map(|c| format!("{root}: {}", c.join(" -> ")))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(cycles.is_empty(), "modules that import each other: {cycles:#?}");
    // The kubelet protocol knows nothing of the agent that serves it.
    assert!(!graph["plugin"].contains("agent"), "{:?}", graph["plugin"]);
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(str::to_string).collect()))
    .collect();
    assert_eq!(
        cycle_through(&graph, "a"),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    assert_eq!(cycle_through(&graph, "d"), None);
}

/// One name per concept: no public type name is declared twice in `src/` (two `Config`s, two
/// `NodeState`s make a reader ask which one is meant), at any depth and with any `pub(..)`. Private
/// types, trait-associated types (`type Output`) and the other crates (FFI mirrors of one C struct
/// in each) are left out.
#[test]
fn no_public_type_name_is_declared_twice() {
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (relative, text) in sources() {
        for line in text.lines() {
            let line = line.trim_start();
            let line = ["pub(crate) ", "pub(super) ", "pub "]
                .iter()
                .find_map(|p| line.strip_prefix(p))
                .unwrap_or("");
            for kind in ["struct ", "enum ", "trait ", "type "] {
                if let Some(rest) = line.strip_prefix(kind) {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    seen.entry(name).or_default().push(relative.display().to_string());
                }
            }
        }
    }
    assert!(seen.len() > 50, "{} public types found", seen.len());
    let twice: Vec<_> = seen.iter().filter(|(_, files)| files.len() > 1).collect();
    assert!(twice.is_empty(), "declared more than once: {twice:?}");
}

/// The files of one module (a folder of `src/`) and the siblings each names: `super::x` (or
/// `super::{x, y}`) from a file in the folder, `super::super::x` from a file one folder down (that
/// subfolder counts as one sibling), and `crate::<folder path>::x` from either. `mod.rs` is the module
/// itself, which declares its files: it is left out.
fn sibling_imports(root: &str) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut folders: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let files = sources_of(root);
    for (relative, text) in &files {
        let parts: Vec<String> = relative
            .components()
            .map(|c| {
                c.as_os_str()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_string()
            })
            .collect();
        // (folder, the sibling this file is, the `super` chain that reaches the folder)
        let mut places = Vec::new();
        if parts.len() >= 2 && parts[parts.len() - 1] != "mod" {
            places.push((
                parts[..parts.len() - 1].join("::"),
                parts[parts.len() - 1].clone(),
                "super::",
            ));
        }
        if parts.len() >= 3 {
            places.push((
                parts[..parts.len() - 2].join("::"),
                parts[parts.len() - 2].clone(),
                "super::super::",
            ));
        }
        // What the file's code uses: not its comments, not its tests.
        let code: String = text
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for (folder, me, up) in places {
            let named = folders
                .entry(folder.clone())
                .or_default()
                .entry(me.clone())
                .or_default();
            let crate_path = format!("crate::{folder}::");
            for prefix in [up, crate_path.as_str()] {
                for (at, _) in code.match_indices(prefix) {
                    // `super::super::x` is not `super::x` named `super`.
                    if prefix == "super::" && code[..at].ends_with("super::") {
                        continue;
                    }
                    let rest = &code[at + prefix.len()..];
                    let list = match rest.strip_prefix('{') {
                        Some(group) => group.split('}').next().unwrap_or_default().to_string(),
                        None => rest
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect(),
                    };
                    for name in list.split(',') {
                        let name = module_name(name.trim());
                        if !name.is_empty() && name != me && name != "super" && name != "self" {
                            named.insert(name);
                        }
                    }
                }
            }
        }
    }
    // Only siblings that are files or folders of the module.
    for siblings in folders.values_mut() {
        let names: BTreeSet<String> = siblings.keys().cloned().collect();
        for named in siblings.values_mut() {
            named.retain(|n| names.contains(n));
        }
    }
    folders
}

/// Inside a module too, dependencies go one way: two files that name each other (directly or
/// through others) cannot be read one before the other.
#[test]
fn files_inside_a_module_depend_one_way() {
    let folders = sibling_imports("src");
    assert!(
        folders
            .get("placer")
            .is_some_and(|p| p.get("controller").is_some_and(|c| c.contains("place"))),
        "{:?}",
        folders.get("placer")
    );
    let cycles: Vec<String> = CRATES
        .iter()
        .flat_map(|root| {
            sibling_imports(root)
                .into_iter()
                .flat_map(|(folder, graph)| {
                    graph
                        .keys()
                        .filter_map(|f| cycle_through(&graph, f))
                        .map(|c| format!("{root} {folder}: {}", c.join(" -> ")))
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(cycles.is_empty(), "files that import each other: {cycles:#?}");
}
