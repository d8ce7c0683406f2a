//! The documents stay true: the Python snippet of docs/block-keys.md, run
//! by a real Python, reproduces the test vectors the Rust code pins.

use std::process::Command;

#[test]
fn block_key_spec_python_snippet_reproduces_the_vectors() {
    // Read at run time: the checkout may have moved since the build.
    let root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let doc = std::fs::read_to_string(root.join("../docs/block-keys.md")).unwrap();
    let start = doc.find("```python\n").expect("a python snippet") + "```python\n".len();
    let len = doc[start..].find("\n```").expect("end of the snippet");
    let snippet = &doc[start..start + len];
    let out = Command::new("python3")
        .arg("-c")
        .arg(snippet)
        .output()
        .expect("python3 is installed by tools/test.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // And the vectors in the document are the ones the Rust code computes.
    let tokens: Vec<u32> = (0..8).collect();
    for key in mooncake_proto::PrefixHasher::chain(b"", &tokens, 4, b"") {
        assert!(doc.contains(&key.to_hex()), "{key} missing from the spec");
    }
    let opaque = mooncake_proto::BlockHash::from_opaque(b"vllm-block-42");
    assert!(doc.contains(&opaque.to_hex()));
}
