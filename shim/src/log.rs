//! `GPUMEM <level> [pid]: ...` lines on stderr, formatted on the stack (no allocation) and written
//! with one `write(2)`.

use std::fmt::{self, Write};

use crate::config::Level;

struct Line {
    bytes: [u8; 1024],
    len: usize,
}

impl Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = self.bytes.len() - 1 - self.len; // keep one byte for the newline
        let take = s.len().min(room);
        if let (Some(dst), Some(src)) = (
            self.bytes.get_mut(self.len..self.len + take),
            s.as_bytes().get(..take),
        ) {
            dst.copy_from_slice(src);
            self.len += take;
        }
        Ok(())
    }
}

/// Writes one line at `level` if `max` lets it through.
pub fn emit(max: Level, level: Level, args: fmt::Arguments<'_>) {
    if level > max || level == Level::Off {
        return;
    }
    let mut line = Line {
        bytes: [0; 1024],
        len: 0,
    };
    // SAFETY: getpid cannot fail.
    let pid = unsafe { libc::getpid() };
    let _ = write!(line, "GPUMEM {} [pid {pid}]: ", level.name());
    let _ = line.write_fmt(args);
    if let Some(end) = line.bytes.get_mut(line.len) {
        *end = b'\n';
        line.len += 1;
    }
    // SAFETY: a valid buffer of `len` bytes; a failed write to stderr is ignored.
    unsafe { libc::write(2, line.bytes.as_ptr().cast(), line.len) };
}
