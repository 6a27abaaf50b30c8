//! The bounds the API enforces on what it is sent, defined once: the server
//! checks requests against these, and the OpenAPI document states the same
//! values (`schema`, with the `openapi` feature). Lengths count characters
//! (Unicode scalar values), as JSON Schema's `maxLength` does.

/// Most items one list page returns (`limit`).
pub const PAGE_LIMIT_MAX: u32 = 1_000;
/// Items per list page without `limit`.
pub const PAGE_LIMIT_DEFAULT: u32 = 100;
/// Most labels one device may carry.
pub const MAX_LABELS: usize = 64;
/// Longest label key.
pub const MAX_LABEL_KEY_CHARS: usize = 128;
/// Longest label value.
pub const MAX_LABEL_VALUE_CHARS: usize = 256;
/// Most devices one `POST /v1/devices` may register.
pub const MAX_REGISTRATIONS_PER_REQUEST: usize = 10_000;
/// Most device ids one targeting request may name.
pub const MAX_TARGET_IDS_PER_REQUEST: usize = 100_000;
/// Longest text a query parameter (a cursor, a filter) may hold.
pub const MAX_QUERY_TEXT_CHARS: usize = 256;
/// Longest token name.
pub const MAX_TOKEN_NAME_CHARS: usize = 64;
/// Shortest broker password an operator may choose.
pub const MIN_PASSWORD_CHARS: usize = 12;
/// Longest broker password an operator may choose.
pub const MAX_PASSWORD_CHARS: usize = 256;
/// The roles a token may have, weakest first.
pub const TOKEN_ROLES: [&str; 3] = ["viewer", "operator", "admin"];

/// A token name: letters, digits, `_`, `.`, `-`.
pub const TOKEN_NAME_PATTERN: &str = "^[A-Za-z0-9_.-]+$";
/// A token lifetime: a whole number of up to six digits and a unit (`ms`,
/// `s` — the default —, `m`, `h`, `d`), so an expiry is always before the
/// year 5000.
pub const TOKEN_LIFETIME_PATTERN: &str = "^[0-9]{1,6}(ms|s|m|h|d)?$";

/// Longest reason of an exemption or an approval policy, in characters.
pub const MAX_EXEMPTION_REASON_CHARS: usize = 512;

/// Most exemptions in force at once (each is checked against every device
/// its selector may match).
pub const MAX_EXEMPTIONS: i64 = 1_000;

/// Most exemptions one operator token has in force at once, so that one
/// operator cannot take every slot of [`MAX_EXEMPTIONS`].
pub const MAX_EXEMPTIONS_PER_AUTHOR: i64 = 100;

/// Most declarations of owned fields waiting for approval at once (one per
/// author: a newer one replaces the author's last).
pub const MAX_OWNED_FIELDS_PROPOSALS: i64 = 32;

/// Most approval policies at once (each is checked against the devices of
/// every desired change).
pub const MAX_APPROVAL_POLICIES: i64 = 100;

/// Owned-field paths in one list (server-wide, or of one selector), at most.
pub const MAX_OWNED_FIELDS: usize = 64;
/// Selectors with owned fields, at most.
pub const MAX_OWNED_SELECTORS: usize = 16;
/// Characters of one owned-field path, at most.
pub const MAX_OWNED_PATH_CHARS: usize = 200;
/// An owned-field path: object keys, each a word (`net.rssi`, joined by
/// `.`) or a JSON string in brackets (`labels["a.b"]`, escapes other than
/// `\u` only).
pub const OWNED_PATH_PATTERN: &str = r#"^(?:[A-Za-z_][A-Za-z0-9_-]*|\["(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*"\])(?:\.[A-Za-z_][A-Za-z0-9_-]*|\["(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*"\])*$"#;

/// Text without a NUL character (`\u0000`), which PostgreSQL cannot store.
pub const NUL_FREE_PATTERN: &str = "^[^\\u0000]*$";

/// A UUID as the API writes it (hyphenated): what run and plan ids in a
/// path must look like.
pub const UUID_PATTERN: &str =
    "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$";

pub fn is_token_name(name: &str) -> bool {
    (1..=MAX_TOKEN_NAME_CHARS).contains(&name.chars().count())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// Whether `raw` is a token lifetime of [`TOKEN_LIFETIME_PATTERN`]'s form.
pub fn is_token_lifetime(raw: &str) -> bool {
    let digits = raw.bytes().take_while(u8::is_ascii_digit).count();
    (1..=6).contains(&digits) && matches!(&raw[digits..], "" | "ms" | "s" | "m" | "h" | "d")
}

/// Whether `password` is one an operator may choose: bounded, without
/// control characters.
pub fn is_broker_password(password: &str) -> bool {
    (MIN_PASSWORD_CHARS..=MAX_PASSWORD_CHARS).contains(&password.chars().count())
        && !password.chars().any(char::is_control)
}

/// The JSON Schemas of these bounds, for the OpenAPI document.
#[cfg(feature = "openapi")]
pub mod schema {
    use utoipa::openapi::extensions::Extensions;
    use utoipa::openapi::schema::{
        AdditionalProperties, ArrayBuilder, ObjectBuilder, Schema, SchemaType, Type,
    };
    use utoipa::openapi::RefOr;

    use super::*;

    /// A rule the server enforces that no JSON Schema keyword can say, as
    /// the `x-idem-rule` extension (the schema's description says it in
    /// words too): a client, a fuzzer or a reader sees it where the schema
    /// is.
    pub fn rule(text: &str) -> Extensions {
        Extensions::from_iter([("x-idem-rule", text)])
    }

    /// `not: {required: [a, b]}` ("at most one of `a` and `b`"), which
    /// utoipa's object builder has no keyword for: its extensions are
    /// serialized key by key, so the keyword is written as one.
    pub fn not_both(a: &str, b: &str) -> Extensions {
        Extensions::from_iter([("not", serde_json::json!({ "required": [a, b] }))])
    }

    fn text(min: usize, max: usize, pattern: Option<&str>) -> ObjectBuilder {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(min))
            .max_length(Some(max))
            .pattern(pattern)
    }

    /// A device id.
    pub fn device_id() -> Schema {
        crate::device_id::schema()
    }

    /// A list of device ids naming the targets of a bulk call.
    pub fn target_ids() -> Schema {
        ArrayBuilder::new()
            .items(RefOr::T(device_id()))
            .min_items(Some(1))
            .max_items(Some(MAX_TARGET_IDS_PER_REQUEST))
            .into()
    }

    /// The labels of a device: a flat object of strings.
    pub fn labels() -> Schema {
        labels_object(0).into()
    }

    /// Labels that may be absent or `null`.
    pub fn optional_labels() -> Schema {
        labels_object(0)
            .schema_type(SchemaType::from_iter([Type::Object, Type::Null]))
            .into()
    }

    /// The labels of a selector: at least one.
    pub fn selector_labels() -> Schema {
        labels_object(1).into()
    }

    fn labels_object(min: usize) -> ObjectBuilder {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .min_properties(Some(min))
            .max_properties(Some(MAX_LABELS))
            .property_names(Some(text(1, MAX_LABEL_KEY_CHARS, Some(NUL_FREE_PATTERN))))
            .additional_properties(Some(AdditionalProperties::RefOr(RefOr::T(
                text(0, MAX_LABEL_VALUE_CHARS, Some(NUL_FREE_PATTERN)).into(),
            ))))
    }

    const SPEC: &str = "any JSON value; its canonical JSON is at most the server's --max-spec-bytes (default 65536) and holds no NUL character";

    /// A desired spec: any JSON value (`null` included), its canonical
    /// size bounded by the server's `--max-spec-bytes`.
    pub fn spec() -> Schema {
        ObjectBuilder::new()
            .schema_type(SchemaType::AnyValue)
            .description(Some(SPEC))
            .into()
    }

    /// A spec where `null` means "none given" (so `null` is no spec).
    pub fn spec_not_null() -> Schema {
        ObjectBuilder::new()
            .schema_type(SchemaType::from_iter([
                Type::Object,
                Type::Array,
                Type::String,
                Type::Number,
                Type::Integer,
                Type::Boolean,
            ]))
            .description(Some(SPEC))
            .into()
    }

    /// A spec that may be absent; `null` records none.
    pub fn optional_spec() -> Schema {
        spec()
    }

    /// A page `limit`.
    pub fn page_limit() -> Schema {
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(1))
            .maximum(Some(PAGE_LIMIT_MAX))
            .description(Some(format!(
                "1 to {PAGE_LIMIT_MAX} (default {PAGE_LIMIT_DEFAULT})"
            )))
            .into()
    }

    /// A free-text query parameter (a cursor, a filter).
    pub fn query_text() -> Schema {
        text(0, MAX_QUERY_TEXT_CHARS, None).into()
    }

    /// A `label` filter: `key:value`.
    pub fn label_filter() -> Schema {
        let pattern =
            format!("^[^:]{{1,{MAX_LABEL_KEY_CHARS}}}:[\\s\\S]{{0,{MAX_LABEL_VALUE_CHARS}}}$");
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(pattern))
            .description(Some("`key:value`"))
            .into()
    }

    /// A token name.
    pub fn token_name() -> Schema {
        text(1, MAX_TOKEN_NAME_CHARS, Some(TOKEN_NAME_PATTERN)).into()
    }

    /// A token role.
    pub fn token_role() -> Schema {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(TOKEN_ROLES))
            .into()
    }

    /// A token lifetime such as `30d`.
    pub fn token_lifetime() -> Schema {
        ObjectBuilder::new()
            .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
            .pattern(Some(TOKEN_LIFETIME_PATTERN))
            .description(Some("e.g. `30d`; no expiry when absent"))
            .into()
    }

    /// A list of owned-field paths.
    pub fn owned_paths() -> Schema {
        ArrayBuilder::new()
            .items(text(1, MAX_OWNED_PATH_CHARS, Some(OWNED_PATH_PATTERN)))
            .max_items(Some(MAX_OWNED_FIELDS))
            .description(Some(
                "paths as diffs write them (`net.rssi`, `labels[\"a.b\"]`), object keys only",
            ))
            .into()
    }

    /// An exemption's or an approval policy's reason.
    pub fn exemption_reason() -> Schema {
        text(1, MAX_EXEMPTION_REASON_CHARS, Some(NUL_FREE_PATTERN))
            .description(Some("free text without a NUL character"))
            .into()
    }

    /// An exemption's lifetime: a duration such as `4h` or `7d`.
    pub fn exemption_lifetime() -> Schema {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(TOKEN_LIFETIME_PATTERN))
            .description(Some(
                "e.g. `4h`, `7d`: from 1s to the server's `--exemption-max` (default 30d)",
            ))
            .extensions(Some(rule(
                "at least 1s and at most the server's --exemption-max (default 30d); beyond it 400 invalid_expiry",
            )))
            .into()
    }

    /// A token name as a path parameter (`DELETE /v1/tokens/{name}`).
    pub struct TokenName;

    impl utoipa::PartialSchema for TokenName {
        fn schema() -> RefOr<Schema> {
            RefOr::T(token_name())
        }
    }
    impl utoipa::ToSchema for TokenName {}

    /// A run or plan id as a path parameter: a UUID in its hyphenated
    /// form (the form the API answers with).
    pub struct UuidText;

    impl utoipa::PartialSchema for UuidText {
        fn schema() -> RefOr<Schema> {
            RefOr::T(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .format(Some(utoipa::openapi::SchemaFormat::KnownFormat(
                        utoipa::openapi::KnownFormat::Uuid,
                    )))
                    .pattern(Some(UUID_PATTERN))
                    .into(),
            )
        }
    }
    impl utoipa::ToSchema for UuidText {}

    /// The body of `POST /v1/devices`: a list of registrations.
    pub struct Registrations;

    impl utoipa::PartialSchema for Registrations {
        fn schema() -> RefOr<Schema> {
            RefOr::T(
                ArrayBuilder::new()
                    .items(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(
                        "DeviceRegistration",
                    )))
                    .max_items(Some(MAX_REGISTRATIONS_PER_REQUEST))
                    .description(Some("devices to register or update, each id at most once"))
                    .extensions(Some(rule(
                        "each `id` at most once in one request; a repeated id is 400 duplicate_device_id",
                    )))
                    .into(),
            )
        }
    }
    impl utoipa::ToSchema for Registrations {
        fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
            schemas.push((
                "DeviceRegistration".to_owned(),
                <crate::api::DeviceRegistration as utoipa::PartialSchema>::schema(),
            ));
        }
    }

    /// A broker password an operator chooses.
    pub fn broker_password() -> Schema {
        ObjectBuilder::new()
            .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
            .min_length(Some(MIN_PASSWORD_CHARS))
            .max_length(Some(MAX_PASSWORD_CHARS))
            .pattern(Some("^[^\\u0000-\\u001f\\u007f-\\u009f]*$"))
            .description(Some("no control characters; generated when absent"))
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_names_lifetimes_and_passwords_follow_their_rules() {
        assert!(is_token_name("alice-ops_1.x"));
        assert!(!is_token_name("") && !is_token_name("a b") && !is_token_name(&"a".repeat(65)));
        for good in ["0", "30d", "12h", "999999m", "500ms", "90s", "7"] {
            assert!(is_token_lifetime(good), "{good}");
        }
        for bad in ["", "d", "1000000d", " 5d", "5 d", "5w", "-1d", "5D", "1.5h"] {
            assert!(!is_token_lifetime(bad), "{bad}");
        }
        assert!(is_broker_password("twelve chars"));
        assert!(is_broker_password(&"é".repeat(MAX_PASSWORD_CHARS)));
        assert!(!is_broker_password("short"));
        assert!(!is_broker_password("has a tab\there"));
    }
}
