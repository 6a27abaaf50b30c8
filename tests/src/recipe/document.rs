//! The recipe blocks of docs/OPERATIONS.md: each `<!-- recipe: MODE… -->`
//! marker and the ```` ```sh ```` block after it, and the script of one mode
//! and phase they make.

use anyhow::{anyhow, bail, Result};

/// The broker modes the document has a recipe for.
pub const MODES: [&str; 2] = ["dynsec", "password-file"];
/// The phase text of blocks that run after the test registered devices.
const AFTER_REGISTRATION: &str = "after registering devices";

/// When a block runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Setting the machine up, before any device is registered.
    Setup,
    /// After the test registered a device through the API.
    AfterRegistration,
}

/// One marked shell block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub modes: Vec<String>,
    pub phase: Phase,
    /// The block's text, without the fences.
    pub text: String,
    /// 1-based line of the marker in the document.
    pub line: usize,
}

/// Every marked block of `markdown`, in document order. A marker must be
/// followed (blank lines aside) by a ```` ```sh ```` block, name only known
/// modes and at most the phase [`AFTER_REGISTRATION`].
pub fn blocks(markdown: &str) -> Result<Vec<Block>> {
    let lines: Vec<&str> = markdown.lines().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        let Some(marker) = line
            .strip_prefix("<!-- recipe:")
            .and_then(|rest| rest.strip_suffix("-->"))
        else {
            i += 1;
            continue;
        };
        let at = i + 1;
        let (modes, phase) = match marker.split_once(';') {
            Some((modes, phase)) => (modes, Some(phase.trim())),
            None => (marker, None),
        };
        let phase = match phase {
            None => Phase::Setup,
            Some(AFTER_REGISTRATION) => Phase::AfterRegistration,
            Some(other) => bail!(
                "docs line {at}: unknown recipe phase {other:?} (known: {AFTER_REGISTRATION:?})"
            ),
        };
        let modes: Vec<String> = modes.split_whitespace().map(str::to_owned).collect();
        if modes.is_empty() {
            bail!("docs line {at}: a recipe marker names no mode");
        }
        if let Some(unknown) = modes.iter().find(|m| !MODES.contains(&m.as_str())) {
            bail!("docs line {at}: unknown recipe mode {unknown:?} (known: {MODES:?})");
        }
        let mut j = i + 1;
        while j < lines.len() && lines[j].trim().is_empty() {
            j += 1;
        }
        if lines.get(j).map(|l| l.trim()) != Some("```sh") {
            bail!("docs line {at}: a recipe marker must be followed by a ```sh block");
        }
        let start = j + 1;
        let end = (start..lines.len())
            .find(|&k| lines[k].trim() == "```")
            .ok_or_else(|| anyhow!("docs line {at}: the recipe's ```sh block is never closed"))?;
        found.push(Block {
            modes,
            phase,
            text: lines[start..end].join("\n") + "\n",
            line: at,
        });
        i = end + 1;
    }
    Ok(found)
}

/// The blocks of `mode` in `phase`, joined in document order into one
/// script (one terminal session: `umask`, variables and `cd` carry over).
pub fn script(blocks: &[Block], mode: &str, phase: Phase) -> String {
    blocks
        .iter()
        .filter(|b| b.phase == phase && b.modes.iter().any(|m| m == mode))
        .map(|b| format!("# --- docs/OPERATIONS.md line {} ---\n{}", b.line, b.text))
        .collect()
}
