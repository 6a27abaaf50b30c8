//! Bulk inserts through PostgreSQL's `COPY … FROM STDIN` (text format): the
//! row encoder, which escapes every field so no value can end a field or a
//! row early, and the one call that streams the rows in the caller's
//! transaction. The write floor `scripts/bench` measures is `COPY`; next to
//! `UNNEST` it measured about even here (docs/ARCHITECTURE.md, "Known
//! limits"), and streaming lets PostgreSQL parse one chunk while the next
//! is encoded.

use std::io::Write as _;

use serde_json::Value;
use sqlx::{Postgres, Transaction};

use super::{Context, StoreError};
use crate::tuning::COPY_CHUNK_BYTES;

/// Rows in `COPY` text format: fields separated by tabs, rows ended by a
/// newline, `\N` for NULL, and backslash, tab, newline and carriage return
/// inside values written as escapes. Those four are ASCII, never part of a
/// multi-byte UTF-8 sequence, so escaping byte by byte keeps the text valid.
#[derive(Debug)]
pub struct CopyRows {
    bytes: Vec<u8>,
    /// No field written yet in the current row.
    row_start: bool,
}

impl Default for CopyRows {
    fn default() -> Self {
        Self {
            bytes: Vec::new(),
            row_start: true,
        }
    }
}

/// Appends `value` to `out`, escaped for a `COPY` text field.
fn push_escaped(out: &mut Vec<u8>, value: &[u8]) {
    if !value
        .iter()
        .any(|b| matches!(b, b'\\' | b'\t' | b'\n' | b'\r'))
    {
        out.extend_from_slice(value);
        return;
    }
    for &b in value {
        match b {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\t' => out.extend_from_slice(b"\\t"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b => out.push(b),
        }
    }
}

/// Escapes whatever is written through it into a `COPY` field.
struct Escaping<'a>(&'a mut Vec<u8>);

impl std::io::Write for Escaping<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        push_escaped(self.0, buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CopyRows {
    fn separate(&mut self) {
        if !self.row_start {
            self.bytes.push(b'\t');
        }
        self.row_start = false;
    }

    /// A text field, escaped.
    pub fn text(&mut self, value: &str) -> &mut Self {
        self.separate();
        push_escaped(&mut self.bytes, value.as_bytes());
        self
    }

    /// A text field or NULL.
    pub fn optional_text(&mut self, value: Option<&str>) -> &mut Self {
        match value {
            Some(value) => self.text(value),
            None => self.null(),
        }
    }

    /// A JSON value as a text field, serialised straight into the rows
    /// (escaped on the way), without building its text first.
    pub fn json(&mut self, value: &Value) -> &mut Self {
        self.separate();
        // A `Value` always serialises (its map keys are strings) and the
        // writer never fails.
        let _ = serde_json::to_writer(Escaping(&mut self.bytes), value);
        self
    }

    /// A field whose `Display` form needs no escaping: numbers, UUIDs,
    /// RFC 3339 timestamps.
    pub fn plain(&mut self, value: impl std::fmt::Display) -> &mut Self {
        self.separate();
        // Writing to a Vec cannot fail.
        let _ = write!(self.bytes, "{value}");
        self
    }

    /// A [`CopyRows::plain`] field or NULL.
    pub fn optional_plain(&mut self, value: Option<impl std::fmt::Display>) -> &mut Self {
        match value {
            Some(value) => self.plain(value),
            None => self.null(),
        }
    }

    pub fn null(&mut self) -> &mut Self {
        self.separate();
        self.bytes.extend_from_slice(b"\\N");
        self
    }

    /// Ends the current row.
    pub fn end_row(&mut self) {
        self.bytes.push(b'\n');
        self.row_start = true;
    }

    /// Rows ended so far: every unescaped newline ends one.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.bytes.iter().filter(|b| **b == b'\n').count()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The encoded rows.
    #[cfg(test)]
    fn as_text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }
}

/// Runs `statement` (`COPY table (columns) FROM STDIN`) in the caller's
/// transaction with one row per item, `encode(rows, item)` writing its
/// fields; returns the rows PostgreSQL stored. Nothing is sent for no items.
pub async fn copy_in<I, F>(
    tx: &mut Transaction<'_, Postgres>,
    statement: &str,
    context: &'static str,
    items: I,
    mut encode: F,
) -> Result<u64, StoreError>
where
    I: IntoIterator,
    F: FnMut(&mut CopyRows, I::Item),
{
    let mut items = items.into_iter().peekable();
    if items.peek().is_none() {
        return Ok(0);
    }
    let mut copy = tx.copy_in_raw(statement).await.context(context)?;
    let mut chunk = CopyRows::default();
    while let Some(item) = items.next() {
        encode(&mut chunk, item);
        chunk.end_row();
        if chunk.bytes.len() >= COPY_CHUNK_BYTES || items.peek().is_none() {
            if let Err(e) = copy.send(std::mem::take(&mut chunk.bytes)).await {
                // End the statement so the connection stays usable for the
                // rollback, and report the send's error.
                let _ = copy.abort("the rows could not be sent").await;
                return Err(e).context(context);
            }
        }
    }
    copy.finish().await.context(context)
}

#[cfg(test)]
mod tests {
    use super::CopyRows;

    #[test]
    fn fields_are_tab_separated_rows_newline_ended_and_null_is_backslash_n() {
        let mut rows = CopyRows::default();
        rows.text("a").plain(7).null();
        rows.end_row();
        rows.optional_text(Some("b"))
            .optional_plain(None::<i64>)
            .optional_text(None);
        rows.end_row();
        assert_eq!(rows.as_text(), "a\t7\t\\N\nb\t\\N\t\\N\n");
        assert_eq!(rows.len(), 2);
    }

    #[test]
    fn backslashes_tabs_and_line_breaks_inside_a_value_are_escaped() {
        let mut rows = CopyRows::default();
        rows.text("x\\y\tz\nw\rv \"q\" \\N é");
        rows.end_row();
        assert_eq!(rows.as_text(), "x\\\\y\\tz\\nw\\rv \"q\" \\\\N é\n");
    }

    #[test]
    fn a_json_field_is_serialised_with_its_escapes_escaped_again() {
        let mut rows = CopyRows::default();
        rows.json(&serde_json::json!({"reason": "a\tb\nc \\ d"}));
        rows.end_row();
        // serde_json writes `\t`, `\n`, `\\`; COPY must receive each
        // backslash doubled so PostgreSQL reads the JSON text back unchanged.
        assert_eq!(
            rows.as_text(),
            "{\"reason\":\"a\\\\tb\\\\nc \\\\\\\\ d\"}\n"
        );
    }

    #[test]
    fn no_rows_is_empty() {
        let rows = CopyRows::default();
        assert!(rows.is_empty());
        assert_eq!(rows.as_text(), "");
    }
}
