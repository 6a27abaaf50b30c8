//! How large the broker's queues must be for a fleet, as one formula: every
//! broker drops QoS 1 messages for a client past its queue limits (after
//! the publisher already has its PUBACK), so the server's session must be
//! allowed to hold what all devices may send before the server acknowledges.
//!
//! Pure: numbers and Mosquitto configuration text; nothing is applied.

/// Messages one device may have waiting for the server at once: its status
/// and first report on connect, and the report answering a push or a
/// `get`, with one to spare.
pub const MESSAGES_IN_FLIGHT_PER_DEVICE: u64 = 4;
/// Never size a queue below this (small fleets, and fleets that grow).
pub const MIN_QUEUED_MESSAGES: u64 = 100_000;

/// `max_queued_messages` for a fleet of `devices`: devices × messages in
/// flight per device, at least [`MIN_QUEUED_MESSAGES`].
pub fn queued_messages_for(devices: u64) -> u64 {
    devices
        .saturating_mul(MESSAGES_IN_FLIGHT_PER_DEVICE)
        .max(MIN_QUEUED_MESSAGES)
}

/// The Mosquitto settings for a fleet of `devices` (global: they bound every
/// client's queue, and only the server's grows with the fleet).
pub fn mosquitto_queue_settings(devices: u64) -> String {
    format!(
        "# Queues sized for {devices} devices: devices x {MESSAGES_IN_FLIGHT_PER_DEVICE} messages in flight\n\
         # per device (at least {MIN_QUEUED_MESSAGES}); raise them as the fleet grows.\n\
         max_queued_messages {}\n\
         max_queued_bytes 0\n\
         max_inflight_messages 0\n\
         # $SYS counters every 10 s: the server reads the dropped count.\n\
         sys_interval 10\n",
        queued_messages_for(devices)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_queue_grows_with_the_fleet_and_never_below_the_floor() {
        assert_eq!(queued_messages_for(0), MIN_QUEUED_MESSAGES);
        assert_eq!(queued_messages_for(10_000), MIN_QUEUED_MESSAGES);
        assert_eq!(queued_messages_for(100_000), 400_000);
        assert_eq!(queued_messages_for(u64::MAX), u64::MAX);
        let text = mosquitto_queue_settings(100_000);
        assert!(text.contains("max_queued_messages 400000\n"), "{text}");
        assert!(text.contains("max_inflight_messages 0\n"), "{text}");
    }
}
