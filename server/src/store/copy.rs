//! Bulk inserts through PostgreSQL's `COPY … FROM STDIN` (text format): the
//! row encoder, which escapes every field so no value can end a field or a
//! row early, and the one call that streams the rows in the caller's
//! transaction. `COPY` is the cheapest way to insert many rows (the write
//! floor `scripts/bench` measures is `COPY`; `UNNEST` costs more, see
//! docs/ARCHITECTURE.md).

use std::fmt::Write as _;

use sqlx::{Postgres, Transaction};

use super::{Context, StoreError};

/// Rows in `COPY` text format: fields separated by tabs, rows ended by a
/// newline, `\N` for NULL, and backslash, tab, newline and carriage return
/// inside values written as escapes.
#[derive(Debug)]
pub struct CopyRows {
    text: String,
    rows: usize,
    /// No field written yet in the current row.
    row_start: bool,
}

impl Default for CopyRows {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl CopyRows {
    /// Empty, with room for about `bytes` of text.
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            text: String::with_capacity(bytes),
            rows: 0,
            row_start: true,
        }
    }

    fn separate(&mut self) {
        if !self.row_start {
            self.text.push('\t');
        }
        self.row_start = false;
    }

    /// A text field, escaped.
    pub fn text(&mut self, value: &str) -> &mut Self {
        self.separate();
        if !value
            .bytes()
            .any(|b| matches!(b, b'\\' | b'\t' | b'\n' | b'\r'))
        {
            self.text.push_str(value);
            return self;
        }
        for c in value.chars() {
            match c {
                '\\' => self.text.push_str("\\\\"),
                '\t' => self.text.push_str("\\t"),
                '\n' => self.text.push_str("\\n"),
                '\r' => self.text.push_str("\\r"),
                c => self.text.push(c),
            }
        }
        self
    }

    /// A text field or NULL.
    pub fn optional_text(&mut self, value: Option<&str>) -> &mut Self {
        match value {
            Some(value) => self.text(value),
            None => self.null(),
        }
    }

    /// A field whose `Display` form needs no escaping: numbers, UUIDs,
    /// RFC 3339 timestamps.
    pub fn plain(&mut self, value: impl std::fmt::Display) -> &mut Self {
        self.separate();
        // Writing to a String cannot fail.
        let _ = write!(self.text, "{value}");
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
        self.text.push_str("\\N");
        self
    }

    /// Ends the current row.
    pub fn end_row(&mut self) {
        self.text.push('\n');
        self.rows += 1;
        self.row_start = true;
    }

    pub fn len(&self) -> usize {
        self.rows
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The encoded rows.
    pub fn as_text(&self) -> &str {
        &self.text
    }
}

/// Encoded rows are sent to PostgreSQL in chunks of about this size, so it
/// parses one chunk while the next is encoded.
const CHUNK_BYTES: usize = 256 * 1024;

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
    let fresh = || CopyRows::with_capacity(CHUNK_BYTES + CHUNK_BYTES / 4);
    let mut chunk = fresh();
    while let Some(item) = items.next() {
        encode(&mut chunk, item);
        chunk.end_row();
        if chunk.text.len() >= CHUNK_BYTES || items.peek().is_none() {
            let full = std::mem::replace(&mut chunk, fresh());
            if let Err(e) = copy.send(full.text.into_bytes()).await {
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
        let mut rows = CopyRows::with_capacity(0);
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
        let mut rows = CopyRows::with_capacity(0);
        rows.text("x\\y\tz\nw\rv \"q\" \\N é");
        rows.end_row();
        assert_eq!(rows.as_text(), "x\\\\y\\tz\\nw\\rv \"q\" \\\\N é\n");
    }

    #[test]
    fn no_rows_is_empty() {
        let rows = CopyRows::default();
        assert!(rows.is_empty());
        assert_eq!(rows.as_text(), "");
    }
}
