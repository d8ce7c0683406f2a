//! Generates the C header from the exported functions into OUT_DIR; a test
//! checks that the committed `include/mooncake.h` is the same.

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("set by cargo"));
    let config =
        cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml");
    cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .expect("the C header")
        .write_to_file(out.join("mooncake.h"));
    println!("cargo:rerun-if-changed=src/lib.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
}
