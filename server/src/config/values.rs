//! The value parsers of the flags: durations (`500ms`, `30s`, `5m`, `1h`,
//! `7d`) with checked arithmetic, and the "`0` = off" forms, which read `0`
//! as `None` so that no subsystem sees a zero meaning "off"; also token
//! expiries (a duration after now) and the default per-client share of a
//! cap.

use std::num::{IntErrorKind, NonZeroU32};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// Parses `250ms`, `30s`, `5m`, `1h`, `7d` (a bare number means seconds).
/// A duration too long to represent is refused, never wrapped around.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let raw = raw.trim();
    let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (number, unit) = raw.split_at(split);
    if number.is_empty() {
        return Err(not_a_duration(raw));
    }
    // Seconds per unit; `None` for milliseconds.
    let seconds_per_unit: Option<u64> = match unit {
        "ms" => None,
        "" | "s" => Some(1),
        "m" => Some(60),
        "h" => Some(3_600),
        "d" => Some(86_400),
        other => {
            return Err(format!(
                "unknown duration unit {other:?} in {raw:?}; use ms, s, m, h or d"
            ))
        }
    };
    let most = seconds_per_unit.map_or(u64::MAX, |per_unit| u64::MAX / per_unit);
    let too_long = || format!("{raw:?} is too long a duration: at most {most}{unit}");
    let n: u64 = number.parse().map_err(|e: std::num::ParseIntError| {
        if *e.kind() == IntErrorKind::PosOverflow {
            too_long()
        } else {
            not_a_duration(raw)
        }
    })?;
    match seconds_per_unit {
        None => Ok(Duration::from_millis(n)),
        Some(per_unit) => n
            .checked_mul(per_unit)
            .map(Duration::from_secs)
            .ok_or_else(too_long),
    }
}

/// When something that expires `raw` after `now` (`30d`, `12h`, …)
/// expires: [`parse_duration`], refusing an expiry later than a timestamp
/// can hold (`POST /v1/tokens`, `idem-server token create`).
pub fn parse_expiry(raw: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    let duration = parse_duration(raw)?;
    chrono::Duration::from_std(duration)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .ok_or_else(|| format!("expiry {raw:?} is too far away"))
}

fn not_a_duration(raw: &str) -> String {
    format!("{raw:?} is not a duration; write e.g. 500ms, 30s, 5m, 1h or 7d")
}

/// A duration where `0` means off: [`parse_duration`], with any zero
/// duration (`0`, `0s`, `0ms`) read as `None`.
pub fn parse_duration_or_off(raw: &str) -> Result<Option<Duration>, String> {
    parse_duration(raw).map(|d| (!d.is_zero()).then_some(d))
}

/// A rate per second where `0` means off (or unlimited): `None` for `0`.
pub fn parse_rate_or_off(raw: &str) -> Result<Option<NonZeroU32>, String> {
    let raw = raw.trim();
    let n: u32 = raw.parse().map_err(|e: std::num::ParseIntError| {
        if *e.kind() == IntErrorKind::PosOverflow {
            format!("{raw:?} is too large: at most {}", u32::MAX)
        } else {
            format!("{raw:?} is not a whole number per second (0 = off)")
        }
    })?;
    Ok(NonZeroU32::new(n))
}

/// A quarter of `total`, rounded to the nearest whole number, at least 1
/// and at most `total` (when it is at least 1): the default share of one
/// client in the HTTP connection and SSE stream caps.
pub fn quarter_of(total: usize) -> usize {
    (total.saturating_add(2) / 4).clamp(1, total.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_accept_the_documented_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7_200)));
        assert_eq!(parse_duration(" 7d "), Ok(Duration::from_secs(604_800)));
        assert!(parse_duration("5 minutes")
            .unwrap_err()
            .contains("unknown duration unit"));
        assert!(parse_duration("soon")
            .unwrap_err()
            .contains("not a duration"));
        assert!(parse_duration("").unwrap_err().contains("not a duration"));
        assert!(parse_duration("-5s")
            .unwrap_err()
            .contains("not a duration"));
    }

    #[test]
    fn a_duration_too_long_to_represent_is_refused_naming_the_longest() {
        let err = parse_duration("999999999999999999d").unwrap_err();
        assert!(err.contains("too long a duration"), "{err}");
        assert!(err.contains("at most 213503982334601d"), "{err}");
        let err = parse_duration("99999999999999999999999999ms").unwrap_err();
        assert!(err.contains("too long a duration"), "{err}");
        let err = parse_duration("307445734561825861m").unwrap_err();
        assert!(err.contains("at most 307445734561825860m"), "{err}");
        assert_eq!(
            parse_duration("213503982334601d"),
            Ok(Duration::from_secs(213_503_982_334_601 * 86_400))
        );
        assert_eq!(
            parse_duration(&u64::MAX.to_string()),
            Ok(Duration::from_secs(u64::MAX))
        );
    }

    #[test]
    fn an_expiry_is_a_duration_after_now_and_one_past_the_last_timestamp_is_refused() {
        let now = DateTime::parse_from_rfc3339("2025-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(
            parse_expiry("30d", now),
            Ok(now + chrono::Duration::days(30))
        );
        for raw in ["100000000000d", "213503982334601d"] {
            let err = parse_expiry(raw, now).unwrap_err();
            assert!(err.contains("too far away"), "{raw}: {err}");
        }
        let err = parse_expiry("999999999999999999d", now).unwrap_err();
        assert!(err.contains("too long a duration"), "{err}");
        assert!(parse_expiry("soon", now)
            .unwrap_err()
            .contains("not a duration"));
    }

    #[test]
    fn zero_turns_a_duration_or_a_rate_off_and_anything_else_keeps_its_value() {
        for zero in ["0", "0s", "0ms", "0d"] {
            assert_eq!(parse_duration_or_off(zero), Ok(None), "{zero}");
        }
        assert_eq!(
            parse_duration_or_off("5s"),
            Ok(Some(Duration::from_secs(5)))
        );
        assert!(parse_duration_or_off("off").is_err());
        assert_eq!(parse_rate_or_off("0"), Ok(None));
        assert_eq!(parse_rate_or_off("5000"), Ok(NonZeroU32::new(5_000)));
        assert!(parse_rate_or_off("-1").unwrap_err().contains("0 = off"));
        assert!(parse_rate_or_off("4294967296")
            .unwrap_err()
            .contains("at most 4294967295"));
    }

    #[test]
    fn the_per_client_shares_default_to_a_quarter_rounded_and_never_exceed_the_cap() {
        assert_eq!(quarter_of(0), 1);
        assert_eq!(quarter_of(1), 1);
        assert_eq!(quarter_of(2), 1);
        assert_eq!(quarter_of(3), 1);
        assert_eq!(quarter_of(6), 2);
        assert_eq!(quarter_of(50), 13);
        assert_eq!(quarter_of(4_096), 1_024);
    }
}
