//! Unit tests of the recipe reader: markers, substitutions, the sandbox
//! check and `EnvironmentFile=` parsing.

use std::path::Path;

use super::*;

const DOC: &str = "intro\n\
    <!-- recipe: dynsec password-file -->\n\
    ```sh\n\
    umask 077\n\
    ```\n\
    text\n\
    <!-- recipe: dynsec -->\n\
    \n\
    ```sh\n\
    echo dynsec\n\
    ```\n\
    ```sh\n\
    echo unmarked\n\
    ```\n\
    <!-- recipe: password-file; after registering devices -->\n\
    ```sh\n\
    echo again\n\
    ```\n";

#[test]
fn the_markers_choose_each_modes_blocks_and_phase_in_document_order() {
    let found = blocks(DOC).unwrap();
    assert_eq!(found.len(), 3);
    let dynsec = script(&found, "dynsec", Phase::Setup);
    assert!(dynsec.contains("umask 077\n") && dynsec.contains("echo dynsec\n"));
    assert!(dynsec.find("umask").unwrap() < dynsec.find("echo dynsec").unwrap());
    assert!(!dynsec.contains("unmarked") && !dynsec.contains("again"));
    let file = script(&found, "password-file", Phase::Setup);
    assert!(file.contains("umask 077") && !file.contains("echo dynsec"));
    assert_eq!(
        script(&found, "password-file", Phase::AfterRegistration),
        "# --- docs/OPERATIONS.md line 15 ---\necho again\n"
    );
}

#[test]
fn a_marker_with_an_unknown_mode_or_phase_or_without_a_shell_block_is_an_error() {
    for (doc, expected) in [
        (
            "<!-- recipe: mqtt -->\n```sh\nx\n```\n",
            "unknown recipe mode",
        ),
        (
            "<!-- recipe: dynsec; later -->\n```sh\nx\n```\n",
            "unknown recipe phase",
        ),
        ("<!-- recipe: dynsec -->\n```text\nx\n```\n", "```sh block"),
        ("<!-- recipe: dynsec -->\n```sh\nx\n", "never closed"),
        ("<!-- recipe: -->\n```sh\nx\n```\n", "no mode"),
    ] {
        let err = blocks(doc).unwrap_err().to_string();
        assert!(err.contains(expected), "{doc:?}: {err}");
    }
}

#[test]
fn a_required_substitution_the_recipe_lacks_is_an_error_and_the_rest_apply_in_order() {
    let rules = Substitutions::new()
        .required("/etc/", "/sandbox/etc/")
        .optional("absent", "x");
    assert_eq!(
        rules.apply("cat /etc/a", "cat /etc/a").unwrap(),
        "cat /sandbox/etc/a"
    );
    let err = Substitutions::new()
        .required("listener 8883", "listener 1")
        .apply("x", "x")
        .unwrap_err();
    assert!(err.to_string().contains("listener 8883"), "{err}");
}

#[test]
fn a_script_naming_a_system_path_outside_the_sandbox_is_refused() {
    let root = Path::new("/tmp/sandbox");
    check_confined("cat /tmp/sandbox/etc/idem/x /tmp/sandbox/var/lib/y", root).unwrap();
    for script in [
        "cat /etc/passwd",
        "x=/tmp/sandbox/etc/a:/etc/b",
        "ls /var/lib/mosquitto",
        "cp x /usr/local/bin/",
        "cat ~/.token",
    ] {
        assert!(check_confined(script, root).is_err(), "{script}");
    }
}

#[test]
fn an_environment_file_is_read_as_systemd_reads_it() {
    let env = environment_file(
        "# comment\n\nIDEM_DATABASE_URL='postgres://a@b/c?x=1&y=2'\nIDEM_INSTANCE=\"i-1\"\nIDEM_X=plain\n",
    );
    assert_eq!(env["IDEM_DATABASE_URL"], "postgres://a@b/c?x=1&y=2");
    assert_eq!(env["IDEM_INSTANCE"], "i-1");
    assert_eq!(env["IDEM_X"], "plain");
    assert_eq!(env.len(), 3);
}
