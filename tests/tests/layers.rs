//! The crate graph keeps its layers (docs/ARCHITECTURE.md): every arrow
//! points down, servers never build on the client SDK, and the client SDK
//! builds on nothing of a server's. Read from `cargo metadata`, so a new
//! dependency that breaks a layer fails here, not in review.

use std::collections::BTreeMap;
use std::process::Command;

/// Each workspace crate and the workspace crates its library and binaries
/// may depend on. `optional`: only behind a cargo feature that is off by
/// default (a wheel that also runs a daemon, say). Tests may use anything.
const LAYERS: &[(&str, &[&str], &[&str])] = &[
    // (crate, may depend on, may depend on behind a non-default feature)
    ("mooncake-proto", &[], &[]),
    ("mooncake-net", &["mooncake-proto"], &[]),
    ("mooncake-coord", &[], &[]),
    ("mooncake-client", &["mooncake-proto", "mooncake-net"], &[]),
    ("mooncake-server", &["mooncake-proto", "mooncake-net"], &[]),
    (
        "mooncake-store-daemon",
        &[
            "mooncake-proto",
            "mooncake-net",
            "mooncake-server",
            "mooncake-coord",
        ],
        &[],
    ),
    (
        "mooncake-meta",
        &[
            "mooncake-proto",
            "mooncake-net",
            "mooncake-server",
            "mooncake-coord",
        ],
        &[],
    ),
    (
        "mooncake-local",
        &["mooncake-coord", "mooncake-store-daemon", "mooncake-meta"],
        &[],
    ),
    (
        "mooncake-py",
        &["mooncake-proto", "mooncake-net", "mooncake-client"],
        &["mooncake-coord", "mooncake-store-daemon"],
    ),
    (
        "mooncake-capi",
        &["mooncake-proto", "mooncake-net", "mooncake-client"],
        &[],
    ),
    (
        "mooncake-tools",
        &[
            "mooncake-proto",
            "mooncake-net",
            "mooncake-client",
            "mooncake-coord",
            "mooncake-server",
            "mooncake-store-daemon",
            "mooncake-meta",
            "mooncake-local",
        ],
        &[],
    ),
    (
        "mooncake-tests",
        &[
            "mooncake-proto",
            "mooncake-net",
            "mooncake-client",
            "mooncake-coord",
            "mooncake-store-daemon",
            "mooncake-meta",
            "mooncake-local",
        ],
        &[],
    ),
];

/// One dependency of a workspace crate on another, as `cargo metadata`
/// lists it.
#[derive(Debug)]
struct Edge {
    to: String,
    optional: bool,
    /// `None` for a normal dependency, "dev" or "build".
    kind: Option<String>,
}

/// `cargo metadata` of the workspace (its own packages only).
fn metadata() -> serde_json::Value {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--offline",
            "--format-version",
            "1",
        ])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Workspace crates and their edges to other workspace crates.
fn workspace_graph() -> BTreeMap<String, Vec<Edge>> {
    let meta = metadata();
    let packages = meta["packages"].as_array().unwrap();
    let names: Vec<&str> = packages
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    packages
        .iter()
        .map(|p| {
            let edges = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| names.contains(&d["name"].as_str().unwrap()))
                .map(|d| Edge {
                    to: d["name"].as_str().unwrap().to_string(),
                    optional: d["optional"].as_bool().unwrap(),
                    kind: d["kind"].as_str().map(str::to_string),
                })
                .collect();
            (p["name"].as_str().unwrap().to_string(), edges)
        })
        .collect()
}

#[test]
fn every_workspace_crate_depends_only_on_the_layers_below_it() {
    let graph = workspace_graph();
    let mut wrong = Vec::new();
    for (name, edges) in &graph {
        let Some((_, allowed, optional)) = LAYERS.iter().find(|(n, _, _)| n == name) else {
            wrong.push(format!(
                "{name} is not in LAYERS: place it in the crate graph (here and in docs/ARCHITECTURE.md)"
            ));
            continue;
        };
        for edge in edges.iter().filter(|e| e.kind.as_deref() != Some("dev")) {
            let ok = allowed.contains(&edge.to.as_str())
                || (edge.optional && optional.contains(&edge.to.as_str()));
            if !ok {
                wrong.push(format!("{name} -> {} ({edge:?})", edge.to));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "crate layers broken:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_server_crate_and_no_coordinator_builds_on_the_client_sdk() {
    let graph = workspace_graph();
    for server in [
        "mooncake-net",
        "mooncake-coord",
        "mooncake-server",
        "mooncake-store-daemon",
        "mooncake-meta",
    ] {
        let Some(edges) = graph.get(server) else {
            continue;
        };
        for edge in edges.iter().filter(|e| e.kind.as_deref() != Some("dev")) {
            assert_ne!(
                edge.to, "mooncake-client",
                "{server} depends on the client SDK"
            );
        }
    }
}

#[test]
fn no_two_crates_build_a_library_of_the_same_name() {
    // Two `libX.rlib` of one name in the target folder make every build
    // that links both ambiguous (rustdoc's doctests of the C library met
    // the SDK's `mooncake_client` so).
    let meta = metadata();
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    for package in meta["packages"].as_array().unwrap() {
        for target in package["targets"].as_array().unwrap() {
            let kinds: Vec<&str> = target["kind"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap())
                .collect();
            if !kinds.iter().any(|k| k.ends_with("lib")) {
                continue;
            }
            let lib = target["name"].as_str().unwrap().replace('-', "_");
            let crate_name = package["name"].as_str().unwrap().to_string();
            if let Some(other) = names.insert(lib.clone(), crate_name.clone()) {
                panic!("{crate_name} and {other} both build a library named {lib}");
            }
        }
    }
}
