//! `scripts/import-cycles` on small fixture crates
//! (`tests/fixtures/import_cycles/`), one per kind of arrow it must catch:
//! a cycle through `use` lines, one through a path written inline
//! (`super::devices::rows_of(…)`), one through a nested `use` tree and a
//! path in a type, an arrow up the layer table and a folder missing from
//! it; and a crate it must pass, whose only mentions of another module are
//! in comments, strings, a test module and a `self::` path to its own
//! child.

use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the workspace")
        .to_path_buf()
}

/// The checker's exit code and output on the fixture `name`, with `args`
/// before its source folder.
fn check(name: &str, args: &[&str]) -> (i32, String) {
    let src = format!("tests/fixtures/import_cycles/{name}/src");
    let out = Command::new("python3")
        .arg("scripts/import-cycles")
        .args(args)
        .arg(&src)
        .current_dir(workspace())
        .output()
        .expect("python3 runs (scripts/test installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn a_cycle_through_use_lines_is_reported_with_both_arrows() {
    let (code, out) = check("use_cycle", &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("cycle: a <-> b"), "{out}");
    assert!(
        out.contains("a -> b  (tests/fixtures/import_cycles/use_cycle/src/a.rs:1)"),
        "{out}"
    );
    assert!(
        out.contains("b -> a  (tests/fixtures/import_cycles/use_cycle/src/b.rs:1)"),
        "{out}"
    );
}

#[test]
fn a_cycle_through_a_path_written_inline_is_reported_at_its_line() {
    let (code, out) = check("inline_super_cycle", &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("cycle: store::devices <-> store::writer"),
        "{out}"
    );
    assert!(
        out.contains(
            "store::writer -> store::devices  (tests/fixtures/import_cycles/inline_super_cycle/src/store/writer.rs:6)"
        ),
        "{out}"
    );
}

#[test]
fn a_cycle_through_a_nested_use_tree_and_a_path_in_a_type_is_reported() {
    let (code, out) = check("use_tree_cycle", &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("cycle: engine <-> mqtt"), "{out}");
    assert!(
        out.contains(
            "engine -> mqtt  (tests/fixtures/import_cycles/use_tree_cycle/src/engine/mod.rs:3)"
        ),
        "{out}"
    );
}

#[test]
fn comments_strings_test_modules_and_paths_to_its_own_children_make_no_arrow() {
    let (code, out) = check("clean", &[]);
    assert_eq!((code, out.as_str()), (0, ""));
}

#[test]
fn an_arrow_up_the_layer_table_and_a_folder_missing_from_it_are_reported() {
    let table = "tests/fixtures/import_cycles/layers/LAYERS.md";
    let (code, out) = check("layers", &["--layers", table]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("low -> high goes against the layer table"),
        "{out}"
    );
    assert!(
        out.contains("low -> high  (tests/fixtures/import_cycles/layers/src/low/mod.rs:3)"),
        "{out}"
    );
    assert!(out.contains("`extra` is not in the layer table"), "{out}");
    assert!(!out.contains(": cycle:"), "{out}");
}

#[test]
fn the_servers_own_folders_keep_to_the_layer_table_of_the_architecture_doc() {
    let out = Command::new("python3")
        .args([
            "scripts/import-cycles",
            "--layers",
            "docs/ARCHITECTURE.md",
            "server/src",
        ])
        .current_dir(workspace())
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
