//! Topic layout v1: building and parsing `{root}/{id}/{channel}` topics.
//!
//! The root is configurable (default `idem/v1`) and may span several levels;
//! it never contains wildcards. Parsing is total: any topic either yields a
//! valid device id and channel or a typed error.

use std::fmt;

use crate::device_id::{DeviceId, InvalidDeviceId};

/// The default topic root.
pub const DEFAULT_TOPIC_ROOT: &str = "idem/v1";

/// A validated topic root such as `idem/v1`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TopicRoot(String);

/// The per-device topic channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    Reported,
    Desired,
    Status,
    Get,
}

impl Channel {
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Reported => "reported",
            Channel::Desired => "desired",
            Channel::Status => "status",
            Channel::Get => "get",
        }
    }
}

/// A topic split into its device and channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedTopic {
    pub device: DeviceId,
    pub channel: Channel,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    #[error("topic root must be non-empty, without leading or trailing '/', and contain no '+', '#' or NUL")]
    InvalidRoot,
    #[error("topic is not under the root")]
    OutsideRoot,
    #[error("topic has no `{{id}}/{{channel}}` after the root")]
    Shape,
    #[error("unknown channel {0:?}")]
    UnknownChannel(String),
    #[error("invalid device id in topic: {0}")]
    InvalidDeviceId(#[from] InvalidDeviceId),
}

impl TopicError {
    /// Stable, low-cardinality name of the reason, for counters and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            TopicError::InvalidRoot | TopicError::OutsideRoot | TopicError::Shape => {
                "invalid_topic"
            }
            TopicError::UnknownChannel(_) => "unknown_channel",
            TopicError::InvalidDeviceId(_) => "invalid_device_id",
        }
    }
}

impl TopicRoot {
    pub fn new(root: impl Into<String>) -> Result<Self, TopicError> {
        let root = root.into();
        let valid = !root.is_empty()
            && !root.starts_with('/')
            && !root.ends_with('/')
            && !root.contains("//")
            && !root.contains(['+', '#', '\0']);
        if valid {
            Ok(Self(root))
        } else {
            Err(TopicError::InvalidRoot)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `{root}/{id}/{channel}`.
    pub fn topic(&self, device: &DeviceId, channel: Channel) -> String {
        format!("{}/{}/{}", self.0, device, channel.as_str())
    }

    /// Subscription filter matching `channel` for every device: `{root}/+/{channel}`.
    pub fn filter(&self, channel: Channel) -> String {
        format!("{}/+/{}", self.0, channel.as_str())
    }

    /// `{root}/events/{type}/{subject}` where the outcome events are published.
    pub fn event_topic(&self, event_type: &str, subject: &str) -> String {
        format!("{}/events/{}/{}", self.0, event_type, subject)
    }

    /// Filter for every outcome event: `{root}/events/#`.
    pub fn events_filter(&self) -> String {
        format!("{}/events/#", self.0)
    }

    /// Splits a topic received from the broker into device and channel.
    pub fn parse(&self, topic: &str) -> Result<ParsedTopic, TopicError> {
        let rest = topic
            .strip_prefix(self.0.as_str())
            .and_then(|r| r.strip_prefix('/'))
            .ok_or(TopicError::OutsideRoot)?;
        let (id, channel) = rest.split_once('/').ok_or(TopicError::Shape)?;
        let channel = match channel {
            "reported" => Channel::Reported,
            "desired" => Channel::Desired,
            "status" => Channel::Status,
            "get" => Channel::Get,
            other => return Err(TopicError::UnknownChannel(other.to_owned())),
        };
        Ok(ParsedTopic {
            device: DeviceId::parse(id)?,
            channel,
        })
    }
}

impl Default for TopicRoot {
    fn default() -> Self {
        Self(DEFAULT_TOPIC_ROOT.to_owned())
    }
}

impl fmt::Display for TopicRoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TopicRoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TopicRoot({})", self.0)
    }
}

impl std::str::FromStr for TopicRoot {
    type Err = TopicError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> TopicRoot {
        TopicRoot::new("idem/v1").unwrap()
    }

    #[test]
    fn topics_are_built_from_root_id_and_channel() {
        let id = DeviceId::parse("pump-7").unwrap();
        assert_eq!(
            root().topic(&id, Channel::Reported),
            "idem/v1/pump-7/reported"
        );
        assert_eq!(
            root().topic(&id, Channel::Desired),
            "idem/v1/pump-7/desired"
        );
        assert_eq!(root().filter(Channel::Status), "idem/v1/+/status");
        assert_eq!(
            root().event_topic("io.idem.device.provisioned", "pump-7"),
            "idem/v1/events/io.idem.device.provisioned/pump-7"
        );
    }

    #[test]
    fn a_built_topic_parses_back() {
        let id = DeviceId::parse("a.b_c-1").unwrap();
        for channel in [
            Channel::Reported,
            Channel::Desired,
            Channel::Status,
            Channel::Get,
        ] {
            let parsed = root().parse(&root().topic(&id, channel)).unwrap();
            assert_eq!(
                parsed,
                ParsedTopic {
                    device: id.clone(),
                    channel
                }
            );
        }
    }

    #[test]
    fn foreign_and_malformed_topics_are_typed_errors() {
        let r = root();
        assert_eq!(r.parse("other/x/reported"), Err(TopicError::OutsideRoot));
        assert_eq!(r.parse("idem/v1x/a/reported"), Err(TopicError::OutsideRoot));
        assert_eq!(r.parse("idem/v1/a"), Err(TopicError::Shape));
        assert_eq!(
            r.parse("idem/v1/a/b/reported"),
            Err(TopicError::UnknownChannel("b/reported".into()))
        );
        assert_eq!(
            r.parse("idem/v1/$bad/reported").unwrap_err().reason(),
            "invalid_device_id"
        );
        assert_eq!(
            r.parse("idem/v1/a/echo"),
            Err(TopicError::UnknownChannel("echo".into()))
        );
    }

    #[test]
    fn a_root_shows_and_parses_as_its_text() {
        let root: TopicRoot = "acme/fleet".parse().unwrap();
        assert_eq!(root, TopicRoot::new("acme/fleet").unwrap());
        assert_eq!(root.as_str(), "acme/fleet");
        assert_eq!(root.to_string(), "acme/fleet");
        assert_eq!(format!("{root:?}"), "TopicRoot(acme/fleet)");
        assert_eq!(root.events_filter(), "acme/fleet/events/#");
        assert_eq!("acme/#".parse::<TopicRoot>(), Err(TopicError::InvalidRoot));
    }

    #[test]
    fn roots_with_wildcards_or_stray_slashes_are_refused() {
        for bad in ["", "/idem", "idem/", "idem//v1", "idem/+", "idem/#"] {
            assert_eq!(TopicRoot::new(bad), Err(TopicError::InvalidRoot), "{bad}");
        }
        assert!(TopicRoot::new("acme/fleet/idem/v1").is_ok());
    }
}
