use super::*;
use serde_json::json;

fn owned(paths: &[&str]) -> OwnedFields {
    OwnedFields::new(paths.iter().map(|p| parse_path(p).unwrap()).collect())
}

#[test]
fn paths_read_as_diffs_write_them() {
    for text in [
        "uptime",
        "net.rssi",
        "labels[\"a.b\"]",
        "[\"odd key\"].x",
        "a_b.c-d",
    ] {
        let path = parse_path(text).unwrap();
        assert_eq!(path.to_string(), text);
    }
}

#[test]
fn a_path_that_is_empty_malformed_or_an_array_item_is_refused() {
    assert!(matches!(parse_path(""), Err(PathError::Empty(_))));
    assert!(matches!(parse_path("servers[2]"), Err(PathError::Index(_))));
    for bad in [
        "net..rssi",
        ".net",
        "net.",
        "1abc",
        "a[\"x\"",
        "a b",
        "a[x]",
    ] {
        assert!(
            matches!(parse_path(bad), Err(PathError::Syntax(_))),
            "{bad}"
        );
    }
}

#[test]
fn a_report_that_differs_only_in_owned_fields_has_the_desired_convergence_digest() {
    let fields = owned(&["uptime", "net.rssi"]);
    let desired = json!({"fw": "2.1", "net": {"ssid": "plant"}});
    let reported = json!({"fw": "2.1", "uptime": 86400, "net": {"ssid": "plant", "rssi": -61}});
    assert_eq!(fields.digest(&reported), fields.digest(&desired));
    let elsewhere = json!({"fw": "2.2", "uptime": 86400, "net": {"ssid": "plant", "rssi": -61}});
    assert_ne!(fields.digest(&elsewhere), fields.digest(&desired));
}

#[test]
fn stripping_removes_owned_paths_and_borrows_a_spec_without_them() {
    let fields = owned(&["uptime", "net.rssi"]);
    let spec = json!({"fw": "2.1", "net": {"ssid": "plant"}});
    assert!(matches!(fields.strip(&spec), Cow::Borrowed(_)));
    let with = json!({"fw": "2.1", "uptime": 3, "net": {"ssid": "plant", "rssi": -61}});
    assert_eq!(fields.strip(&with).into_owned(), spec);
}

#[test]
fn an_owned_path_covers_everything_under_it() {
    let fields = owned(&["net.rssi"]);
    assert!(fields.covers(&parse_path("net.rssi").unwrap()));
    assert!(fields.covers(&parse_path("net.rssi.avg").unwrap()));
    assert!(!fields.covers(&parse_path("net").unwrap()));
    assert!(!fields.covers(&parse_path("net.ssid").unwrap()));
}

#[test]
fn a_device_owns_the_server_wide_paths_and_those_of_every_selector_its_labels_match() {
    let set = OwnedFieldSet {
        everywhere: vec![parse_path("uptime").unwrap()],
        by_selector: vec![
            (
                BTreeMap::from([("kind".to_owned(), "pump".to_owned())]),
                vec![parse_path("flow.rate").unwrap()],
            ),
            (
                BTreeMap::from([("site".to_owned(), "lab".to_owned())]),
                vec![parse_path("debug").unwrap()],
            ),
        ],
    };
    let mut resolver = OwnedResolver::new(set);
    let pump = resolver
        .for_labels(&json!({"kind": "pump", "site": "plant"}))
        .unwrap();
    assert!(pump.covers(&parse_path("flow.rate").unwrap()));
    assert!(pump.covers(&parse_path("uptime").unwrap()));
    assert!(!pump.covers(&parse_path("debug").unwrap()));
    let other_pump = resolver.for_labels(&json!({"kind": "pump"})).unwrap();
    assert!(
        Arc::ptr_eq(&pump, &other_pump),
        "devices matching alike share one set"
    );
    let nothing = OwnedResolver::new(OwnedFieldSet::default()).for_labels(&json!({}));
    assert!(nothing.is_none());
}

#[test]
fn a_declaration_beyond_a_bound_is_refused_naming_the_list_and_the_limit() {
    use idem_protocol::api::{OwnedBySelector, Selector};
    let declaration = |fields: Vec<String>, selectors: usize| OwnedFieldsDeclaration {
        fields,
        by_selector: (0..selectors)
            .map(|i| OwnedBySelector {
                selector: Selector {
                    labels: [("site".to_owned(), format!("s{i}"))].into(),
                },
                fields: vec!["battery".to_owned()],
            })
            .collect(),
    };
    let many: Vec<String> = (0..=MAX_OWNED_FIELDS).map(|i| format!("k{i}")).collect();
    let refused = OwnedFieldSet::from_declaration(&declaration(many, 0)).unwrap_err();
    assert_eq!(
        refused.to_string(),
        "`fields` names 65 paths; a list holds at most 64"
    );
    let refused =
        OwnedFieldSet::from_declaration(&declaration(vec![], MAX_OWNED_SELECTORS + 1)).unwrap_err();
    assert_eq!(
        refused.to_string(),
        "`by_selector` has 17 selectors; at most 16 are allowed"
    );
    let long = "k".repeat(MAX_OWNED_PATH_CHARS + 1);
    let refused = OwnedFieldSet::from_declaration(&declaration(vec![long], 0)).unwrap_err();
    assert!(refused.to_string().contains("at most 200"), "{refused}");
    let refused =
        OwnedFieldSet::from_declaration(&declaration(vec!["ok".into(), "a..b".into()], 0))
            .unwrap_err();
    assert!(refused.to_string().starts_with("`fields[1]`"), "{refused}");
    let set = OwnedFieldSet::from_declaration(&declaration(vec!["uptime".into()], 2)).unwrap();
    assert_eq!((set.everywhere.len(), set.by_selector.len()), (1, 2));
}

#[test]
fn a_new_spec_digest_leaves_out_what_each_device_owns_and_is_the_whole_digest_for_the_rest() {
    let spec = json!({"fw": 2, "uptime": 0});
    let full = SpecDigest::of(&spec);
    let mut digests = NewSpecDigests::new(&spec, full);
    let uptime = Arc::new(owned(&["uptime"]));
    assert_eq!(digests.for_device(None), full);
    assert_eq!(
        digests.for_device(Some(&uptime)),
        SpecDigest::of(&json!({"fw": 2}))
    );
    assert_eq!(digests.for_device(Some(&Arc::new(owned(&[])))), full);
}

#[test]
fn an_object_left_empty_by_stripping_is_stripped_too_on_either_side() {
    let fields = owned(&["net.rssi"]);
    let desired = json!({"fw": "2.1"});
    let reported = json!({"fw": "2.1", "net": {"rssi": -61}});
    assert_eq!(fields.digest(&reported), fields.digest(&desired));
    // An empty object on the way is gone as well, so both sides agree.
    assert_eq!(
        fields.digest(&json!({"fw": "2.1", "net": {}})),
        fields.digest(&desired)
    );
    // Something else under `net` stays.
    assert_eq!(
        fields
            .strip(&json!({"net": {"rssi": 1, "ssid": "a"}}))
            .into_owned(),
        json!({"net": {"ssid": "a"}})
    );
}

#[test]
fn a_change_is_ignored_when_it_lies_wholly_in_what_the_device_owns() {
    use crate::reconcile::diff::diff;
    let fields = owned(&["net.rssi", "uptime"]);
    let ignored = |old: Value, new: Value| {
        let changes = diff(&old, &new);
        let marks = fields.ignored(&old, &new, &changes);
        changes
            .iter()
            .zip(marks)
            .map(|(c, ignored)| (c.path().to_string(), ignored))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        ignored(json!({"net": {"rssi": -61}, "uptime": 5}), json!({})),
        vec![("net".to_owned(), true), ("uptime".to_owned(), true)]
    );
    assert_eq!(
        ignored(json!({"net": {"rssi": -61, "ssid": "a"}}), json!({})),
        vec![("net".to_owned(), false)]
    );
    assert_eq!(
        ignored(json!({"net": {"rssi": -61}}), json!({"net": {"ssid": "b"}})),
        vec![
            ("net.rssi".to_owned(), true),
            ("net.ssid".to_owned(), false)
        ]
    );
}
