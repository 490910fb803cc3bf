//! The fault-injection file (`GPUMEM_FAKE_NVML_INJECT`): parsing, and re-reading it when it changes.
//! The format is documented at the top of `lib.rs`.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;
use std::time::SystemTime;

use serde::Deserialize;

/// What the inject file currently asks for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Faults {
    /// GPU indices that answer every per-device call with `NVML_ERROR_GPU_IS_LOST`.
    pub lost: Vec<u32>,
    /// Memory in use, MiB, per GPU index.
    pub memory_used_mib: BTreeMap<u32, u64>,
    /// Critical XID events, in the order they were injected.
    pub xid: Vec<XidEvent>,
    /// GPU indices whose per-device calls block until the GPU leaves this list (a hung GPU).
    pub hung: Vec<u32>,
    /// The NVML error code every `nvmlEventSetWait_v2` returns while set.
    pub event_wait_error: Option<u32>,
}

/// One injected critical XID event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XidEvent {
    pub gpu: u32,
    pub xid: u64,
}

impl Faults {
    /// Parses the inject file's text.
    pub fn parse(text: &str) -> Result<Self, String> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            #[serde(default)]
            lost: Vec<u32>,
            #[serde(default)]
            memory_used_mib: BTreeMap<String, u64>,
            #[serde(default)]
            xid: Vec<XidEvent>,
            #[serde(default)]
            hung: Vec<u32>,
            event_wait_error: Option<u32>,
        }
        let raw: Raw = toml::from_str(text).map_err(|e| e.message().to_string())?;
        let mut memory_used_mib = BTreeMap::new();
        for (key, mib) in raw.memory_used_mib {
            let gpu = key
                .trim()
                .parse::<u32>()
                .map_err(|_| format!("[memory_used_mib] key {key:?} is not a GPU index"))?;
            memory_used_mib.insert(gpu, mib);
        }
        // 0 is NVML_SUCCESS; an "error" of 0 would hand back an event nobody wrote.
        if raw.event_wait_error == Some(0) {
            return Err("event_wait_error = 0 is NVML_SUCCESS, not an error".into());
        }
        Ok(Self {
            lost: raw.lost,
            memory_used_mib,
            xid: raw.xid,
            hung: raw.hung,
            event_wait_error: raw.event_wait_error,
        })
    }

    pub fn is_lost(&self, gpu: u32) -> bool {
        self.lost.contains(&gpu)
    }

    pub fn is_hung(&self, gpu: u32) -> bool {
        self.hung.contains(&gpu)
    }

    pub fn memory_used_mib(&self, gpu: u32) -> u64 {
        self.memory_used_mib.get(&gpu).copied().unwrap_or(0)
    }
}

/// Identifies one version of the file: a rewrite by rename changes the inode, an in-place write
/// changes the modification time or (usually) the length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileKey {
    modified: Option<SystemTime>,
    len: u64,
    dev: u64,
    ino: u64,
}

/// The inject file of this process (if any) and what was last read from it.
#[derive(Debug, Default)]
pub struct InjectSource {
    path: Option<PathBuf>,
    /// `None` before the first look, `Some(None)` while the file does not exist.
    seen: Option<Option<FileKey>>,
    faults: Faults,
}

impl InjectSource {
    pub fn new(path: Option<PathBuf>) -> Self {
        Self {
            path,
            seen: None,
            faults: Faults::default(),
        }
    }

    /// The faults in force, re-reading the file first if it changed since the last look.
    pub fn current(&mut self) -> &Faults {
        self.refresh();
        &self.faults
    }

    fn refresh(&mut self) {
        let Some(path) = &self.path else { return };
        let key = std::fs::metadata(path).ok().map(|m| FileKey {
            modified: m.modified().ok(),
            len: m.len(),
            dev: m.dev(),
            ino: m.ino(),
        });
        if self.seen == Some(key) {
            return;
        }
        self.seen = Some(key);
        if key.is_none() {
            // No file (yet, or any more): no faults.
            self.faults = Faults::default();
            return;
        }
        let parsed = std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|text| Faults::parse(&text));
        match parsed {
            Ok(faults) => self.faults = faults,
            // Keep the previous faults: a half-written file is followed by a complete one, which
            // changes the key again and is read then.
            Err(message) => warn(&format!(
                "ignoring inject file {} (keeping the previous faults): {message}",
                path.display()
            )),
        }
    }
}

/// One line on stderr, never panicking (stderr may be closed).
pub fn warn(message: &str) {
    let _ = writeln!(std::io::stderr(), "gpumem-fake-nvml: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_example() {
        let text = "lost = [3]\nhung = [2]\nevent_wait_error = 999\n[memory_used_mib]\n\"0\" = 2048\n\
                    [[xid]]\ngpu = 1\nxid = 79\n";
        let faults = Faults::parse(text).unwrap();
        assert!(faults.is_lost(3) && !faults.is_lost(0));
        assert!(faults.is_hung(2) && !faults.is_hung(3));
        assert_eq!(faults.event_wait_error, Some(999));
        assert_eq!(faults.memory_used_mib(0), 2048);
        assert_eq!(faults.memory_used_mib(1), 0);
        assert_eq!(faults.xid, vec![XidEvent { gpu: 1, xid: 79 }]);
        assert_eq!(Faults::parse("").unwrap(), Faults::default());
    }

    #[test]
    fn rejects_typos_and_bad_keys() {
        assert!(Faults::parse("lots = [1]").is_err());
        assert!(Faults::parse("[memory_used_mib]\nzero = 1").is_err());
        assert!(Faults::parse("[[xid]]\ngpu = 1").is_err());
        assert!(Faults::parse("event_wait_error = 0").is_err());
    }
}
