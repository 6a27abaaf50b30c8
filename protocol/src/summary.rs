//! The run summary line shared by the server's API and every client that
//! shows or checks it: `9,996 already converged, 4 provisioned, 0 failed`.
//!
//! Pure text formatting; the counts come from the caller.

/// `N already converged, N provisioned, N failed`, then `, N skipped` and
/// `, N superseded` only when non-zero; numbers with `,` thousands separators.
pub fn summary_line(
    already_converged: u64,
    provisioned: u64,
    failed: u64,
    skipped: u64,
    superseded: u64,
) -> String {
    let mut line = format!(
        "{} already converged, {} provisioned, {} failed",
        with_thousands(already_converged),
        with_thousands(provisioned),
        with_thousands(failed)
    );
    for (n, words) in [(skipped, "skipped"), (superseded, "superseded")] {
        if n > 0 {
            line.push_str(&format!(", {} {words}", with_thousands(n)));
        }
    }
    line
}

/// `9996` → `9,996`.
pub fn with_thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_main_outcomes_are_always_named() {
        assert_eq!(
            summary_line(9_996, 4, 0, 0, 0),
            "9,996 already converged, 4 provisioned, 0 failed"
        );
    }

    #[test]
    fn skipped_and_superseded_appear_only_when_non_zero() {
        assert_eq!(
            summary_line(1, 2, 3, 4, 0),
            "1 already converged, 2 provisioned, 3 failed, 4 skipped"
        );
        assert_eq!(
            summary_line(0, 0, 0, 0, 1_000_000),
            "0 already converged, 0 provisioned, 0 failed, 1,000,000 superseded"
        );
    }

    #[test]
    fn thousands_separators_are_placed_every_three_digits() {
        assert_eq!(with_thousands(0), "0");
        assert_eq!(with_thousands(999), "999");
        assert_eq!(with_thousands(1_000), "1,000");
        assert_eq!(with_thousands(12_345_678), "12,345,678");
    }
}
