//! Per-device MQTT identity on the broker: the Mosquitto dynamic-security
//! commands that give each device an account bound to its own topics (and
//! the server and dashboard readers theirs), device passwords and their
//! Mosquitto `password_file` hashes, and the static ACL file for brokers
//! without the plugin.
//!
//! Pure: builds and parses JSON and text; sending the commands is
//! `crate::broker::dynsec`.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use idem_protocol::{Channel, DeviceId, TopicRoot};
use serde_json::{json, Value};
use sha2::Sha512;

pub use crate::config::{password_file_accounts, BUILT_IN_RESERVED_USERNAMES};
pub use crate::mqtt::{CONTROL_TOPIC, RESPONSE_TOPIC};

/// The server's own role: publish desired state, report requests, events
/// and status clears; subscribe to reports and status; manage accounts.
pub const SERVER_ROLE: &str = "idem-server";
/// Read-only access to the outcome events, for dashboards.
pub const EVENTS_READER_ROLE: &str = "idem-events-reader";
/// PBKDF2 rounds of Mosquitto's `$7$` password hashes (its default).
const PBKDF2_ROUNDS: u32 = 101;
const SALT_BYTES: usize = 12;

/// The role holding exactly one device's topics. Device ids never contain
/// `:`, so no device role can be mistaken for another role.
pub fn device_role(id: &DeviceId) -> String {
    format!("idem-device:{id}")
}

fn acl(kind: &str, topic: String) -> Value {
    json!({"acltype": kind, "topic": topic, "allow": true})
}

/// Exactly what a device may do: publish its own `reported` and `status`
/// (its will included), subscribe to and receive its own `desired` and
/// `get` — nothing else.
pub fn device_acls(root: &TopicRoot, id: &DeviceId) -> Vec<Value> {
    let topic = |channel| root.topic(id, channel);
    vec![
        acl("publishClientSend", topic(Channel::Reported)),
        acl("publishClientSend", topic(Channel::Status)),
        acl("subscribePattern", topic(Channel::Desired)),
        acl("subscribePattern", topic(Channel::Get)),
        acl("publishClientReceive", topic(Channel::Desired)),
        acl("publishClientReceive", topic(Channel::Get)),
    ]
}

/// The commands that create a device's role and its account (username and
/// client id = the device id, so nobody else can connect as it).
pub fn create_device(root: &TopicRoot, id: &DeviceId, password: &str) -> Vec<Value> {
    vec![
        json!({"command": "createRole", "rolename": device_role(id), "acls": device_acls(root, id)}),
        json!({
            "command": "createClient",
            "username": id.as_str(),
            "password": password,
            "clientid": id.as_str(),
            "roles": [{"rolename": device_role(id)}],
        }),
    ]
}

/// Sets a new password on an existing device account.
pub fn set_device_password(id: &DeviceId, password: &str) -> Value {
    json!({"command": "setClientPassword", "username": id.as_str(), "password": password})
}

/// The commands that remove a device's account and role.
pub fn delete_device(id: &DeviceId) -> Vec<Value> {
    vec![
        json!({"command": "deleteClient", "username": id.as_str()}),
        delete_device_role(id),
    ]
}

/// The command that removes a device's role (only ever the device's own).
pub fn delete_device_role(id: &DeviceId) -> Value {
    json!({"command": "deleteRole", "rolename": device_role(id)})
}

/// The server's ACLs for the topic root.
pub fn server_acls(root: &TopicRoot) -> Vec<Value> {
    let any = |channel: Channel| root.filter(channel);
    vec![
        acl("publishClientSend", any(Channel::Desired)),
        acl("publishClientSend", any(Channel::Get)),
        acl("publishClientSend", any(Channel::Status)),
        acl("publishClientSend", root.events_filter()),
        acl("subscribePattern", any(Channel::Reported)),
        acl("subscribePattern", any(Channel::Status)),
        acl("publishClientReceive", any(Channel::Reported)),
        acl("publishClientReceive", any(Channel::Status)),
        acl("publishClientSend", CONTROL_TOPIC.to_owned()),
        acl("subscribePattern", RESPONSE_TOPIC.to_owned()),
        acl("publishClientReceive", RESPONSE_TOPIC.to_owned()),
        // The broker's counters, to notice dropped messages.
        acl(
            "subscribePattern",
            crate::mqtt::SYS_DROPPED_TOPIC.to_owned(),
        ),
        acl(
            "publishClientReceive",
            crate::mqtt::SYS_DROPPED_TOPIC.to_owned(),
        ),
        acl("subscribePattern", crate::mqtt::SYS_STORED_TOPIC.to_owned()),
        acl(
            "publishClientReceive",
            crate::mqtt::SYS_STORED_TOPIC.to_owned(),
        ),
    ]
}

/// A dashboard reader's ACLs: the event topics, read only.
pub fn events_reader_acls(root: &TopicRoot) -> Vec<Value> {
    vec![
        acl("subscribePattern", root.events_filter()),
        acl("publishClientReceive", root.events_filter()),
    ]
}

/// A role with `acls`, created or (when it exists) completed.
pub fn ensure_role(name: &str, acls: &[Value]) -> Vec<Value> {
    let mut commands = vec![json!({"command": "createRole", "rolename": name})];
    commands.extend(acls.iter().map(|a| {
        let mut add = a.clone();
        if let Some(map) = add.as_object_mut() {
            map.insert("command".into(), json!("addRoleACL"));
            map.insert("rolename".into(), json!(name));
        }
        add
    }));
    commands
}

/// An account with one role (created, or its password and role set when it
/// exists: the role is removed and added again, because the plugin answers
/// an error when adding a role the account has).
/// With `client_id`, the account may connect only with that client id, so
/// no other account can take over its session.
pub fn ensure_client(
    username: &str,
    password: &str,
    role: &str,
    client_id: Option<&str>,
) -> Vec<Value> {
    let mut create = json!({"command": "createClient", "username": username, "password": password, "roles": [{"rolename": role}]});
    let mut commands = Vec::new();
    if let Some(client_id) = client_id {
        create["clientid"] = json!(client_id);
    }
    commands.push(create);
    commands
        .push(json!({"command": "setClientPassword", "username": username, "password": password}));
    if let Some(client_id) = client_id {
        commands
            .push(json!({"command": "modifyClient", "username": username, "clientid": client_id}));
    }
    commands.push(json!({"command": "removeClientRole", "username": username, "rolename": role}));
    commands.push(json!({"command": "addClientRole", "username": username, "rolename": role}));
    commands
}

/// Asks the plugin for the account named like a device.
pub fn get_client(id: &DeviceId) -> Value {
    json!({"command": "getClient", "username": id.as_str()})
}

/// Whose a broker account named like a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccountOwner {
    /// No account has the name: the server may create the device's.
    Absent,
    /// The account the server creates for this device: client id = user
    /// name = the id, and the device's role as its only role.
    ThisDevice,
    /// Any other account (the server's, a reader's, an admin's, one made
    /// on the broker directly): never modified, deleted or re-passworded.
    Foreign,
}

/// Reads a `getClient` answer for `id`; `Err` when the plugin's answer
/// says neither "found" nor "not found".
pub fn account_owner(id: &DeviceId, answer: &CommandResult) -> Result<AccountOwner, String> {
    if let Some(error) = &answer.error {
        return if error.to_ascii_lowercase().contains("not found") {
            Ok(AccountOwner::Absent)
        } else {
            Err(format!("getClient {id}: {error}"))
        };
    }
    let client = answer
        .data
        .as_ref()
        .and_then(|d| d.get("client"))
        .ok_or_else(|| format!("getClient {id}: the answer has no client"))?;
    let roles: Vec<&str> = client["roles"]
        .as_array()
        .map(|roles| {
            roles
                .iter()
                .filter_map(|r| r["rolename"].as_str())
                .collect()
        })
        .unwrap_or_default();
    let device_role = device_role(id);
    let is_device_account = client["username"] == id.as_str()
        && client["clientid"] == id.as_str()
        && roles == [device_role.as_str()]
        && client["groups"].as_array().is_none_or(Vec::is_empty);
    Ok(if is_device_account {
        AccountOwner::ThisDevice
    } else {
        AccountOwner::Foreign
    })
}

/// The commands that give a device its account with `password`, by whose
/// the account named like it is now: created when absent, its password set
/// when it is this device's; `None` for a foreign account, which is never
/// touched.
pub fn provision_device(
    root: &TopicRoot,
    id: &DeviceId,
    password: &str,
    owner: AccountOwner,
) -> Option<Vec<Value>> {
    match owner {
        AccountOwner::Absent => Some(create_device(root, id, password)),
        AccountOwner::ThisDevice => Some(vec![
            // Answers "already exists" unless the role was lost; both fine.
            json!({"command": "createRole", "rolename": device_role(id), "acls": device_acls(root, id)}),
            set_device_password(id, password),
        ]),
        AccountOwner::Foreign => None,
    }
}

/// The answer to one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandResult {
    pub command: String,
    pub error: Option<String>,
    pub correlation: Option<String>,
    /// What a query command (`getClient`) answered.
    pub data: Option<Value>,
}

impl CommandResult {
    /// Errors that mean the object is already as asked (idempotent
    /// set-up and re-registration).
    pub fn is_already_done(&self) -> bool {
        self.error.as_deref().is_some_and(|e| {
            let e = e.to_ascii_lowercase();
            e.contains("already exists") || e.contains("already in")
        })
    }

    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }

    /// Whether this answer leaves things as asked: success, the object
    /// already as asked, or a role removal that only prepares adding it.
    pub fn is_acceptable(&self) -> bool {
        self.is_ok() || self.is_already_done() || self.command == "removeClientRole"
    }
}

/// The control-topic payload carrying `commands`, each tagged with
/// `batch` as its `correlationData` so the answers can be matched.
pub fn command_payload(commands: &[Value], batch: &str) -> Vec<u8> {
    let commands: Vec<Value> = commands
        .iter()
        .map(|c| {
            let mut c = c.clone();
            if let Some(map) = c.as_object_mut() {
                map.insert("correlationData".into(), Value::from(batch));
            }
            c
        })
        .collect();
    json!({ "commands": commands }).to_string().into_bytes()
}

/// Parses a payload of the response topic.
pub fn parse_responses(payload: &[u8]) -> Result<Vec<CommandResult>, String> {
    let value: Value = serde_json::from_slice(payload).map_err(|e| e.to_string())?;
    let responses = value["responses"]
        .as_array()
        .ok_or_else(|| "no `responses` array".to_owned())?;
    Ok(responses
        .iter()
        .map(|r| CommandResult {
            command: r["command"].as_str().unwrap_or_default().to_owned(),
            error: r["error"].as_str().map(str::to_owned),
            correlation: r["correlationData"].as_str().map(str::to_owned),
            data: r.get("data").cloned(),
        })
        .collect())
}

/// A new device password: 192 random bits as 48 hex digits.
pub fn generate_password() -> String {
    let bytes: [u8; 24] = rand::random();
    hex::encode(bytes)
}

/// The Mosquitto `password_file` hash of `password` (`$7$`: PBKDF2 with
/// HMAC-SHA512, 101 rounds, 12-byte salt), as `mosquitto_passwd` writes it.
pub fn mosquitto_hash(password: &str) -> String {
    let salt: [u8; SALT_BYTES] = rand::random();
    hash_with_salt(password, &salt, PBKDF2_ROUNDS)
}

fn hash_with_salt(password: &str, salt: &[u8], rounds: u32) -> String {
    let mut out = [0u8; 64];
    pbkdf2::pbkdf2_hmac::<Sha512>(password.as_bytes(), salt, rounds, &mut out);
    format!("$7${rounds}${}${}", BASE64.encode(salt), BASE64.encode(out))
}

/// Whether `password` matches a `$7$` hash.
pub fn verify_mosquitto_hash(password: &str, hash: &str) -> bool {
    let mut parts = hash.split('$');
    let (Some(""), Some("7"), Some(rounds), Some(salt), Some(_)) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return false;
    };
    let (Ok(rounds), Ok(salt)) = (rounds.parse::<u32>(), BASE64.decode(salt)) else {
        return false;
    };
    hash_with_salt(password, &salt, rounds) == hash
}

/// A Mosquitto `acl_file` for brokers without the dynamic-security plugin:
/// `pattern` lines bind every device (username = client id = device id) to
/// its own topics; the server's account gets its own block.
pub fn static_acl_file(root: &TopicRoot, server_username: &str) -> String {
    let r = root.as_str();
    format!(
        "# Generated by `idem-server broker files` for topic root {r}.\n\
         # Devices: username = client id = device id, bound to their own topics.\n\
         pattern write {r}/%u/reported\n\
         pattern write {r}/%u/status\n\
         pattern read {r}/%u/desired\n\
         pattern read {r}/%u/get\n\
         \n\
         # The idem server.\n\
         user {server_username}\n\
         topic write {r}/+/desired\n\
         topic write {r}/+/get\n\
         topic readwrite {r}/+/status\n\
         topic read {r}/+/reported\n\
         topic write {r}/events/#\n\
         topic read $SYS/broker/publish/messages/dropped\n\
         topic read $SYS/broker/store/messages/count\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_of_a_payload_carries_its_batch_as_correlation_data() {
        let commands = [
            json!({"command": "createRole"}),
            json!({"command": "createClient"}),
        ];
        let payload: Value = serde_json::from_slice(&command_payload(&commands, "b-1")).unwrap();
        let sent = payload["commands"].as_array().unwrap();
        assert_eq!(sent.len(), 2);
        assert!(sent.iter().all(|c| c["correlationData"] == "b-1"));
        assert_eq!(sent[1]["command"], "createClient");
    }

    fn root() -> TopicRoot {
        TopicRoot::new("idem/v1").unwrap()
    }

    #[test]
    fn a_device_may_publish_and_subscribe_only_its_own_topics() {
        let id = DeviceId::parse("pump-7").unwrap();
        let acls = device_acls(&root(), &id);
        for a in &acls {
            let topic = a["topic"].as_str().unwrap();
            assert!(topic.starts_with("idem/v1/pump-7/"), "{topic}");
            assert!(!topic.contains(['+', '#']), "{topic}");
        }
        let sends: Vec<&str> = acls
            .iter()
            .filter(|a| a["acltype"] == "publishClientSend")
            .map(|a| a["topic"].as_str().unwrap())
            .collect();
        assert_eq!(sends, ["idem/v1/pump-7/reported", "idem/v1/pump-7/status"]);
        let create = create_device(&root(), &id, "pw");
        assert_eq!(create[1]["clientid"], "pump-7");
        assert_eq!(create[1]["username"], "pump-7");
        assert_eq!(create[1]["roles"][0]["rolename"], "idem-device:pump-7");
    }

    #[test]
    fn the_server_may_publish_desired_get_and_events_and_read_reports() {
        let acls = server_acls(&root());
        let has = |kind: &str, topic: &str| {
            acls.iter()
                .any(|a| a["acltype"] == kind && a["topic"] == topic)
        };
        assert!(has("publishClientSend", "idem/v1/+/desired"));
        assert!(has("publishClientSend", "idem/v1/+/get"));
        assert!(has("publishClientSend", "idem/v1/events/#"));
        assert!(has("subscribePattern", "idem/v1/+/reported"));
        assert!(!has("publishClientSend", "idem/v1/+/reported"));
        let reader = events_reader_acls(&root());
        assert!(reader.iter().all(|a| a["acltype"] != "publishClientSend"));
    }

    #[test]
    fn responses_are_parsed_with_their_errors_and_already_existing_objects_count_as_done() {
        let payload = br#"{"responses":[{"command":"createRole","correlationData":"b1"},
            {"command":"createClient","error":"Client already exists","correlationData":"b1"},
            {"command":"deleteClient","error":"Client not found"}]}"#;
        let results = parse_responses(payload).unwrap();
        assert_eq!(results.len(), 3);
        assert!(results[0].is_ok());
        assert_eq!(results[0].correlation.as_deref(), Some("b1"));
        assert!(results[1].is_already_done());
        assert!(!results[2].is_already_done() && !results[2].is_ok());
        assert!(parse_responses(b"{}").is_err());
    }

    #[test]
    fn hashes_match_what_mosquitto_passwd_writes() {
        // `mosquitto_passwd -b pwf dev-1 s3cret-pw` (Mosquitto 2.0.11).
        let from_mosquitto = "$7$101$O+hhtWCNTGD1kTkl$DCNrpw0Gu+61DC5F7soCyRVEV61LJGgiIeKRyeT7fs54684k3zBIlnuTpnibF+1joo9MLjTxiVohMHrigynl4Q==";
        assert!(verify_mosquitto_hash("s3cret-pw", from_mosquitto));
        assert!(!verify_mosquitto_hash("wrong", from_mosquitto));
        let ours = mosquitto_hash("another");
        assert!(ours.starts_with("$7$101$"));
        assert!(verify_mosquitto_hash("another", &ours));
        assert!(!verify_mosquitto_hash("another", "$6$x$y"));
    }

    #[test]
    fn generated_passwords_are_long_and_distinct() {
        let (a, b) = (generate_password(), generate_password());
        assert_eq!(a.len(), 48);
        assert_ne!(a, b);
    }

    #[test]
    fn the_static_acl_binds_devices_by_username_pattern() {
        let text = static_acl_file(&root(), "idem-server");
        assert!(text.contains("pattern write idem/v1/%u/reported"));
        assert!(text.contains("pattern read idem/v1/%u/desired"));
        assert!(text.contains("user idem-server\ntopic write idem/v1/+/desired"));
    }

    fn answer(error: Option<&str>, data: Option<Value>) -> CommandResult {
        CommandResult {
            command: "getClient".into(),
            error: error.map(str::to_owned),
            correlation: None,
            data,
        }
    }

    fn client(username: &str, clientid: Option<&str>, roles: &[&str]) -> Option<Value> {
        let roles: Vec<Value> = roles.iter().map(|r| json!({"rolename": r})).collect();
        Some(
            json!({"client": {"username": username, "clientid": clientid, "roles": roles, "groups": []}}),
        )
    }

    #[test]
    fn only_the_account_made_for_a_device_counts_as_that_devices() {
        let id = DeviceId::parse("pump-7").unwrap();
        let owner = |a: CommandResult| account_owner(&id, &a).unwrap();
        assert_eq!(
            owner(answer(Some("Client not found"), None)),
            AccountOwner::Absent
        );
        assert_eq!(
            owner(answer(
                None,
                client("pump-7", Some("pump-7"), &["idem-device:pump-7"])
            )),
            AccountOwner::ThisDevice
        );
        // The server's, an admin's, one made by hand, one with more roles.
        for data in [
            client("pump-7", Some("idem-server:idem-1"), &["idem-server"]),
            client("pump-7", None, &["admin"]),
            client("pump-7", None, &[]),
            client("pump-7", Some("pump-7"), &["idem-device:pump-7", "admin"]),
            client("pump-7", None, &["idem-device:pump-7"]),
        ] {
            assert_eq!(
                owner(answer(None, data.clone())),
                AccountOwner::Foreign,
                "{data:?}"
            );
        }
        assert!(account_owner(&id, &answer(Some("Internal error"), None)).is_err());
        assert!(account_owner(&id, &answer(None, None)).is_err());
    }

    #[test]
    fn a_foreign_account_is_never_given_a_command_and_an_absent_one_is_only_created() {
        let id = DeviceId::parse("pump-7").unwrap();
        assert_eq!(
            provision_device(&root(), &id, "pw", AccountOwner::Foreign),
            None
        );
        let created = provision_device(&root(), &id, "pw", AccountOwner::Absent).unwrap();
        let names: Vec<&str> = created
            .iter()
            .map(|c| c["command"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["createRole", "createClient"]);
        let rekeyed = provision_device(&root(), &id, "pw", AccountOwner::ThisDevice).unwrap();
        assert_eq!(rekeyed[1]["command"], "setClientPassword");
        assert_eq!(rekeyed[1]["username"], "pump-7");
    }

    #[test]
    fn a_password_files_user_names_are_read_without_comments_and_blank_lines() {
        let text = "# accounts\nadmin:$7$a\n\ndashboards:$7$b\r\n";
        let users: Vec<&str> = password_file_accounts(text)
            .unwrap()
            .into_iter()
            .map(|(u, _)| u)
            .collect();
        assert_eq!(users, ["admin", "dashboards"]);
        assert!(password_file_accounts("admin\n").is_err());
        assert!(password_file_accounts(":hash\n").is_err());
    }
}
