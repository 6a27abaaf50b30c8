//! Process memory as Linux reports it in `/proc/{pid}/status`: resident set
//! (`VmRSS`) and its peak (`VmHWM`). Used to report what the simulator (and,
//! in the benchmark, the server) costs per device. Reads only; `None` where
//! `/proc` is unavailable.

/// Which `/proc/{pid}/status` field to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryField {
    /// Resident set size now.
    Rss,
    /// Peak resident set size ("high water mark") since the process started.
    PeakRss,
}

impl MemoryField {
    fn key(self) -> &'static str {
        match self {
            MemoryField::Rss => "VmRSS:",
            MemoryField::PeakRss => "VmHWM:",
        }
    }
}

/// `field` of process `pid` (`None` = this process), in bytes.
pub fn process_memory(pid: Option<u32>, field: MemoryField) -> Option<u64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".to_owned(),
    };
    let status = std::fs::read_to_string(path).ok()?;
    parse_status(&status, field)
}

/// This process's peak resident set size, in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    process_memory(None, MemoryField::PeakRss)
}

/// This process's resident set size now, in bytes.
pub fn rss_bytes() -> Option<u64> {
    process_memory(None, MemoryField::Rss)
}

fn parse_status(status: &str, field: MemoryField) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(field.key()))?;
    let mut parts = line[field.key().len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => Some(value * 1024),
        Some(_) => None,
    }
}

/// `1536` → `1.5 KiB`, `367001600` → `350.0 MiB`.
pub fn format_bytes(bytes: f64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_fields_are_read_in_bytes() {
        let status = "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(parse_status(status, MemoryField::PeakRss), Some(2 << 20));
        assert_eq!(parse_status(status, MemoryField::Rss), Some(1 << 20));
        assert_eq!(parse_status("Name: x\n", MemoryField::Rss), None);
    }

    #[test]
    fn this_process_has_a_resident_set() {
        let rss = rss_bytes().expect("/proc/self/status on Linux");
        assert!(rss > 0);
        assert!(peak_rss_bytes().unwrap() >= rss);
    }

    #[test]
    fn byte_counts_are_shown_in_binary_units() {
        assert_eq!(format_bytes(512.0), "512 B");
        assert_eq!(format_bytes(1536.0), "1.5 KiB");
        assert_eq!(format_bytes(350.0 * 1024.0 * 1024.0), "350.0 MiB");
    }
}
