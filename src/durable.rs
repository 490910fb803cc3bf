//! Files the agent must find whole after a crash or a power cut (the DRA checkpoint, CDI specs, the
//! shim's preload file, certificates): written to a temporary file beside the target, synced, renamed
//! over the target, and the directory synced, since a rename is only durable once its directory is.
//! A reader finds the old content or the new, never a part or an empty file.

use std::fs::{File, OpenOptions};
use std::io::{self, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

/// The temporary file [`write`] fills before renaming it to `path`: hidden, in the same directory (a
/// rename does not cross file systems), and not ending like the target (a CDI runtime reads every
/// `*.json` of its directory).
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.tmp"))
}

/// Replaces `path` with `bytes` durably, the file created with permission bits `mode`. A temporary file
/// left by a write that was cut short is overwritten.
pub fn write(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let temp = temp_path(path);
    // Created afresh, so that it has `mode` whatever a left-over temporary had.
    match std::fs::remove_file(&temp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&temp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&temp, path)?;
    sync_dir(path)
}

/// Syncs the directory holding `path`, so that a rename or removal in it survives a power cut.
pub fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn a_write_replaces_the_whole_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("checkpoint.json");
        write(&path, b"old", 0o644).expect("first write");
        write(&path, b"new content", 0o600).expect("second write");
        assert_eq!(std::fs::read(&path).expect("read"), b"new content");
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["checkpoint.json"]);
    }

    #[test]
    fn a_write_cut_short_leaves_the_old_file_and_the_next_write_goes_through() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("spec.json");
        write(&path, b"{\"whole\": true}", 0o644).expect("write");
        // A crash half-way through the next write: its temporary file holds a part.
        std::fs::write(temp_path(&path), b"{\"who").expect("partial");
        assert_eq!(std::fs::read(&path).expect("read"), b"{\"whole\": true}");
        assert!(
            !temp_path(&path).to_string_lossy().ends_with(".json"),
            "a runtime reading *.json never sees the temporary"
        );
        write(&path, b"{}", 0o600).expect("the next write");
        assert_eq!(std::fs::read(&path).expect("read"), b"{}");
        assert!(!temp_path(&path).exists());
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "not the left-over temporary's mode");
    }

    #[test]
    fn a_new_file_gets_the_mode_asked_for() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("key.pem");
        write(&path, b"secret", 0o600).expect("write");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_directory_that_is_gone_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("missing").join("file");
        assert!(write(&path, b"x", 0o644).is_err());
    }
}
