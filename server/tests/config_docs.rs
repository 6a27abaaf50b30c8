//! The README's flag table against the server's command line: every flag
//! it lists exists with the variable it names, every flag `idem-server
//! --help` shows is listed, and `--help` shows the flags in their groups.
//! Needs no services: it reads README.md and runs the built binary.

// Test code: a panic with its message is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::process::Command;

use clap::CommandFactory;

const README: &str = include_str!("../../README.md");

/// The headings `idem-server --help` groups the flags under, in order.
const HEADINGS: [&str; 11] = [
    "Fleet",
    "Database",
    "MQTT broker",
    "HTTP API",
    "Event streams (SSE)",
    "Security",
    "Engine",
    "Changes",
    "Events",
    "Retention",
    "Readiness",
];

/// The flag tables of "Running the server against your own PostgreSQL and
/// broker", one per `###` heading: each flag (without `--`) with the
/// variable the same row names in the same position (`--a` / `--b` |
/// `IDEM_A` / `IDEM_B`) and the heading it is listed under.
fn readme_tables() -> Vec<(String, Vec<(String, String)>)> {
    let section = README
        .split("\n## Running the server against your own PostgreSQL and broker\n")
        .nth(1)
        .expect("README.md has the section on running the server")
        .split("\n## ")
        .next()
        .unwrap();
    let mut tables = Vec::new();
    for group in section.split("\n### ").skip(1) {
        let (heading, body) = group.split_once('\n').unwrap();
        let table = body
            .split("| flag | variable | default |\n| --- | --- | --- |\n")
            .nth(1)
            .unwrap_or_else(|| panic!("README's {heading:?} has no flag table"));
        let mut flags = Vec::new();
        for row in table.lines().take_while(|l| l.starts_with('|')) {
            // The third cell may hold `|` inside code; the first two never do.
            let mut cells = row.trim_start_matches('|').splitn(3, '|');
            let code = |cell: Option<&str>, prefix: &str| -> Vec<String> {
                cell.unwrap_or_default()
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .filter(|s| s.starts_with(prefix))
                    .map(str::to_owned)
                    .collect()
            };
            let names = code(cells.next(), "--");
            let variables = code(cells.next(), "IDEM_");
            assert!(
                !names.is_empty() && names.len() == variables.len(),
                "README row names {names:?} but variables {variables:?}: {row}"
            );
            for (name, variable) in names.into_iter().zip(variables) {
                flags.push((name.trim_start_matches("--").to_owned(), variable));
            }
        }
        tables.push((heading.to_owned(), flags));
    }
    tables
}

/// Every flag of the README's tables with its variable and heading; no
/// flag may be listed twice.
fn readme_flags() -> BTreeMap<String, (String, String)> {
    let mut flags = BTreeMap::new();
    for (heading, rows) in readme_tables() {
        for (name, variable) in rows {
            let listed = flags.insert(name.clone(), (variable, heading.clone()));
            assert!(listed.is_none(), "--{name} is listed twice in the README");
        }
    }
    assert!(flags.len() > 40, "only {} flags read", flags.len());
    flags
}

fn help() -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_idem-server"))
        .arg("--help")
        .output()
        .expect("running idem-server --help");
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn every_flag_in_the_readme_exists_with_its_variable_under_the_heading_it_is_listed_under() {
    let command = idem_server::Config::command();
    for (name, (variable, heading)) in readme_flags() {
        let arg = command
            .get_arguments()
            .find(|a| a.get_long() == Some(name.as_str()))
            .unwrap_or_else(|| panic!("README lists --{name}, which idem-server does not have"));
        let env = arg.get_env().and_then(|e| e.to_str());
        assert_eq!(
            env,
            Some(variable.as_str()),
            "README gives --{name} the variable {variable}"
        );
        assert_eq!(
            arg.get_help_heading(),
            Some(heading.as_str()),
            "README lists --{name} under {heading:?}"
        );
    }
}

#[test]
fn every_flag_of_idem_server_help_is_in_the_readme_table() {
    let documented = readme_flags();
    let help = help();
    let shown: Vec<&str> = help
        .lines()
        .filter_map(|l| l.trim_start().split(' ').find(|w| w.starts_with("--")))
        .map(|w| w.trim_start_matches("--").trim_end_matches(','))
        .filter(|name| !["help", "version"].contains(name))
        .collect();
    assert!(
        shown.len() > 40,
        "only {} flags in --help:\n{help}",
        shown.len()
    );
    for name in shown {
        assert!(
            documented.contains_key(name),
            "--{name} is missing from the README's flag table"
        );
    }
}

#[test]
fn idem_server_help_shows_the_headings_of_the_readme_in_the_same_order() {
    let readme: Vec<String> = readme_tables().into_iter().map(|(h, _)| h).collect();
    assert_eq!(readme, HEADINGS, "README's headings");
    let help = help();
    let mut from = 0;
    for heading in HEADINGS {
        let line = format!("\n{heading}:\n");
        let at = help[from..]
            .find(&line)
            .unwrap_or_else(|| panic!("no {heading:?} heading after byte {from} in:\n{help}"));
        from += at + line.len();
    }
    let engine = help.split("\nEngine:\n").nth(1).unwrap();
    let engine = engine.split("\n\n").next().unwrap();
    assert!(
        engine.contains("--push-rate") && engine.contains("--recheck-rate"),
        "{engine}"
    );
}
