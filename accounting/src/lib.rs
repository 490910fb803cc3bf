//! The GPU memory accounting file shared by every process of a container.
//!
//! `libgpumem_cuda.so` (the `gpumem-cuda-shim` package) counts each device allocation of each process
//! of a container in one small file, `<GPUMEM_ACCOUNTING_DIR>/gpumem-accounting`, which every process
//! maps `MAP_SHARED`: the limit is enforced across all of them with one atomic compare-and-swap on the
//! device's `used` counter. The agent mounts the directory (one per container) and reads a private
//! copy of the same file with [`read_usage`] to export real per-container usage as metrics.
//!
//! # File format, version 1
//!
//! Native-endian (the file never leaves the node), fixed size [`FILE_SIZE`], all counters 8-byte
//! aligned 64-bit atomics:
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `b"GPUMEMAC"` (written last, with release ordering: a reader that sees it sees the rest) |
//! | 8 | version (u32, [`VERSION`]) |
//! | 12, 16, 20 | [`MAX_DEVICES`], [`MAX_SLOTS`], slot size (u32 each) |
//! | 24 | file size (u64) |
//! | 32 | flags (u64): bit 0 [`FLAG_HOLDERS_LOCK`] |
//! | 64 | `limit[MAX_DEVICES]`: bytes, [`UNLIMITED`] for none (written once, at creation) |
//! | 192 | `used[MAX_DEVICES]`: bytes in use by the container (all processes) |
//! | 384 | `MAX_SLOTS` process slots of 192 bytes: `owner` (0 free, `u64::MAX` busy, else the PID), `start_time` (clock ticks after boot, field 22 of `/proc/<pid>/stat`, to tell a reused PID from its dead owner), `used[MAX_DEVICES]` |
//!
//! Invariant, whenever no allocation is in flight: `used[d]` = the sum of `slot.used[d]` over the
//! slots plus the usage of processes that got no slot (only when all slots are taken).
//!
//! Device indices are CUDA device ordinals of the container (see `docs/enforcement.md`).
//!
//! # Who writes what
//!
//! - Creation: the first process to open the file sizes and initialises it under an exclusive `flock`
//!   (later openers wait on the lock, then validate magic, version and size). Mode `0666` (forced
//!   past the umask): the processes of one container may run as different users, and the directory
//!   itself is private to the container.
//! - Allocation: [`Accounting::try_reserve`] (CAS against the limit) then [`Accounting::charge`] on the
//!   process's own slot; frees undo both ([`Accounting::release`], [`Accounting::discharge`]).
//! - Liveness: every process attached to a file it created with [`FLAG_HOLDERS_LOCK`] holds a shared
//!   open-file-description lock (`F_OFD_SETLK`, `F_RDLCK`) on its first byte for as long as it runs
//!   (its forked children share it; the kernel drops it when the last of them exits or execs). No
//!   such lock left means every process of the container has exited, killed or not: [`read_usage`]
//!   then counts nothing, whatever the counters say (nobody is left to reap a killed process's
//!   share). The lock is tested with `F_OFD_GETLK`, which takes nothing.
//! - Reaping: any process may reclaim the slot of a dead process ([`Accounting::reap`]): it wins the
//!   slot with a CAS on `owner` (so two reapers never subtract twice), subtracts the slot's usage from
//!   `used` and frees the slot. The driver frees a dead process's device memory itself; this only
//!   corrects the books. A process killed between its two counter updates of one allocation (two
//!   adjacent instructions) leaves an error of that one allocation; nothing else can go wrong.
//!
//! Nothing in the file is trusted by a reader: it is writable by the container, so a process could
//! write anything into it, or shrink it, or put a FIFO, a device node or a symlink in its place.
//! [`read_usage`] never maps it (a mapping of a file that shrinks faults the reader with SIGBUS),
//! opens nothing but a regular file, and rejects impossible numbers (see there). The shim is not a
//! security boundary (a process can always talk to the driver directly); it keeps honest programs
//! within their share.
//!
//! One file, over the usual ~600 lines: the file format, its layout checks and the lock-free operations
//! on it share invariants (who may write which word, in which order) that must be read together.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The file's name inside the accounting directory.
pub const FILE_NAME: &str = "gpumem-accounting";
/// The first 8 bytes of a valid file.
pub const MAGIC: u64 = u64::from_ne_bytes(*b"GPUMEMAC");
/// The layout version this crate reads and writes.
pub const VERSION: u32 = 1;
/// Devices per container the file has counters for (CUDA ordinals `0..MAX_DEVICES`).
pub const MAX_DEVICES: usize = 16;
/// Processes per container that can hold a slot at once.
pub const MAX_SLOTS: usize = 1024;
/// A limit of `UNLIMITED` bytes means the device is counted but not limited.
pub const UNLIMITED: u64 = u64::MAX;

/// One limit (bytes) per device ordinal.
pub type Limits = [u64; MAX_DEVICES];

/// The most bytes [`read_usage`] believes a counter or a limit (other than [`UNLIMITED`]): 1 PiB,
/// far beyond any GPU's memory.
pub const MAX_PLAUSIBLE_BYTES: u64 = 1 << 50;
/// PIDs are below the kernel's `pid_max`, which is at most 2^22 (`PID_MAX_LIMIT` on 64-bit).
const PID_MAX_LIMIT: u64 = 1 << 22;

/// Bit of the header's flags: every process attached to the file holds a shared lock on its first
/// byte while it runs (see "Liveness" above). Set by the creator.
pub const FLAG_HOLDERS_LOCK: u64 = 1;

const OWNER_FREE: u64 = 0;
const OWNER_BUSY: u64 = u64::MAX;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    max_devices: AtomicU32,
    max_slots: AtomicU32,
    slot_size: AtomicU32,
    file_size: AtomicU64,
    flags: AtomicU64,
    _reserved: [AtomicU64; 3],
    limit: [AtomicU64; MAX_DEVICES],
    used: [AtomicU64; MAX_DEVICES],
    _pad: [AtomicU64; 8],
}

#[repr(C)]
struct Slot {
    owner: AtomicU64,
    start_time: AtomicU64,
    used: [AtomicU64; MAX_DEVICES],
    _pad: [AtomicU64; 6],
}

const HEADER_SIZE: usize = size_of::<Header>();
const SLOT_SIZE: usize = size_of::<Slot>();
/// The size of a version-1 file in bytes.
pub const FILE_SIZE: usize = HEADER_SIZE + MAX_SLOTS * SLOT_SIZE;

const _: () = {
    assert!(HEADER_SIZE == 384);
    assert!(SLOT_SIZE == 192);
    assert!(std::mem::offset_of!(Header, limit) == 64);
    assert!(std::mem::offset_of!(Header, used) == 192);
    assert!(std::mem::offset_of!(Slot, used) == 16);
};

/// Why the accounting file could not be used.
#[derive(Debug)]
pub enum Error {
    /// An I/O call failed; `what` says which, on which path.
    Io { what: String, source: io::Error },
    /// What is there is not a regular file, not a version-1 accounting file of the expected size,
    /// or (read by [`read_usage`]) holds numbers no shim writes; `detail` says what was wrong.
    Incompatible {
        path: PathBuf,
        reason: Reason,
        detail: String,
    },
}

/// What was wrong with a file, in a word (for logs and metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// An I/O call failed ([`Error::Io`]).
    Io,
    /// Not a regular file: a symlink, a directory, a FIFO, a device node, a socket.
    NotRegularFile,
    /// Not [`FILE_SIZE`] bytes, or shrank while read.
    Size,
    /// Not version 1 of this layout: magic, version or shape.
    Format,
    /// A counter, a limit or a process's usage out of bounds.
    Counters,
}

impl Reason {
    /// The reason as a short snake_case word.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Io => "io",
            Reason::NotRegularFile => "not_regular_file",
            Reason::Size => "size",
            Reason::Format => "format",
            Reason::Counters => "counters",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Error {
    /// Why, in a word.
    pub fn reason(&self) -> Reason {
        match self {
            Error::Io { .. } => Reason::Io,
            Error::Incompatible { reason, .. } => *reason,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { what, source } => write!(f, "{what}: {source}"),
            Error::Incompatible { path, detail, .. } => {
                write!(
                    f,
                    "{} is not a gpumem accounting file this version can use: {detail}",
                    path.display()
                )
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Incompatible { .. } => None,
        }
    }
}

fn io_error(what: impl FnOnce() -> String) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io { what: what(), source }
}

fn incompatible(path: PathBuf, reason: Reason, detail: String) -> Error {
    Error::Incompatible { path, reason, detail }
}

/// [`FILE_SIZE`] bytes in the file's layout: the shared mapping, or the reader's private copy.
///
/// # Safety
///
/// `base` must point to `FILE_SIZE` bytes, 8-byte aligned (the alignment of [`Header`] and
/// [`Slot`]), that live as long as `self` and are only ever accessed through atomics.
unsafe trait Region {
    fn base(&self) -> *const u8;

    fn header(&self) -> &Header {
        // SAFETY: FILE_SIZE >= HEADER_SIZE bytes, aligned, living as long as `self` (the trait's
        // contract); every field is an atomic, valid for any bit pattern.
        unsafe { &*self.base().cast::<Header>() }
    }

    fn slot(&self, index: usize) -> Option<&Slot> {
        if index >= MAX_SLOTS {
            return None;
        }
        // SAFETY: in bounds (index < MAX_SLOTS), aligned (HEADER_SIZE and SLOT_SIZE are multiples
        // of 8); atomics only.
        Some(unsafe { &*self.base().add(HEADER_SIZE + index * SLOT_SIZE).cast::<Slot>() })
    }
}

/// A mapping of the whole file (or of anonymous shared memory), unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory accessed only through atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `FILE_SIZE` bytes of `fd` (or anonymous memory for `None`) read-write.
    fn new(fd: Option<&File>) -> io::Result<Self> {
        let (flags, raw) = match fd {
            Some(file) => (libc::MAP_SHARED, file.as_raw_fd()),
            None => (libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1),
        };
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a fresh mapping chosen by the kernel; the arguments are valid.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), FILE_SIZE, prot, flags, raw, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self { ptr, len: FILE_SIZE })
    }
}

// SAFETY: FILE_SIZE bytes, page-aligned, mapped until `self` drops; the writer touches them only
// through the atomics of `Header` and `Slot`.
unsafe impl Region for Mapping {
    fn base(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
}

/// The reader's private copy of a file, decoded through the same `Header` and `Slot` as the mapping.
struct FileCopy(Box<[AtomicU64]>);

impl FileCopy {
    /// The first `FILE_SIZE` bytes of `file`, read with `pread` (an error if it has fewer).
    fn read(file: &File) -> io::Result<Self> {
        let mut bytes = vec![0u8; FILE_SIZE];
        file.read_exact_at(&mut bytes, 0)?;
        let (words, _) = bytes.as_chunks::<8>();
        Ok(Self(
            words
                .iter()
                .map(|w| AtomicU64::new(u64::from_ne_bytes(*w)))
                .collect(),
        ))
    }
}

// SAFETY: FILE_SIZE / 8 atomics (`read` fills FILE_SIZE bytes, a multiple of 8), owned by `self`.
unsafe impl Region for FileCopy {
    fn base(&self) -> *const u8 {
        self.0.as_ptr().cast()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `Mapping::new` with this length and is not used after.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A process slot won by [`Accounting::claim_slot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotId(usize);

impl SlotId {
    /// The slot's index in the file.
    pub fn index(self) -> usize {
        self.0
    }
}

/// How a file was attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opened {
    /// This call created and initialised the file.
    Created,
    /// The file existed with the same limits.
    Existing,
    /// The file existed with other limits; this process enforces its own ([`Accounting::limit`]).
    LimitsDiffer,
}

/// The writer's view: a mapped accounting file (or process-private shared memory).
pub struct Accounting {
    map: Mapping,
    /// The file, open for as long as this process runs: it carries this process's liveness lock.
    _file: Option<File>,
    /// The limits this process enforces (its own environment's), kept process-local so the hot path
    /// does not read them from a file any process of the container could write.
    limits: Limits,
}

impl fmt::Debug for Accounting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Accounting")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Accounting {
    /// Opens `<dir>/gpumem-accounting`, creating and initialising it with `limits` if it does not
    /// exist or is empty. The directory must exist.
    pub fn open_or_create(dir: &Path, limits: &Limits) -> Result<(Self, Opened), Error> {
        let path = dir.join(FILE_NAME);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io_error(|| format!("cannot open {}", path.display())))?;
        let lock =
            FileLock::exclusive(&file).map_err(io_error(|| format!("cannot lock {}", path.display())))?;
        let len = file
            .metadata()
            .map_err(io_error(|| format!("cannot stat {}", path.display())))?
            .len();
        if len == 0 {
            // Every process of the container must be able to write it, whatever its user; the
            // umask must not take that away. Only the owner may chmod; another user finding an
            // empty file left by a creator that died is still fine with the creator's mode.
            // SAFETY: plain syscall on an open descriptor.
            unsafe { libc::fchmod(file.as_raw_fd(), 0o666) };
            file.set_len(FILE_SIZE as u64)
                .map_err(io_error(|| format!("cannot size {}", path.display())))?;
            let map =
                Mapping::new(Some(&file)).map_err(io_error(|| format!("cannot map {}", path.display())))?;
            hold_liveness_lock(&file).map_err(io_error(|| format!("cannot lock {}", path.display())))?;
            drop(lock);
            let accounting = Self {
                map,
                _file: Some(file),
                limits: *limits,
            };
            accounting.initialise();
            return Ok((accounting, Opened::Created));
        }
        if len != FILE_SIZE as u64 {
            let detail = format!("size {len}, expected {FILE_SIZE}");
            return Err(incompatible(path, Reason::Size, detail));
        }
        let map = Mapping::new(Some(&file)).map_err(io_error(|| format!("cannot map {}", path.display())))?;
        validate(map.header()).map_err(|detail| incompatible(path.clone(), Reason::Format, detail))?;
        let same = map
            .header()
            .limit
            .iter()
            .zip(limits)
            .all(|(stored, mine)| stored.load(Ordering::Relaxed) == *mine);
        let opened = if same {
            Opened::Existing
        } else {
            Opened::LimitsDiffer
        };
        hold_liveness_lock(&file).map_err(io_error(|| format!("cannot lock {}", path.display())))?;
        drop(lock);
        let accounting = Self {
            map,
            _file: Some(file),
            limits: *limits,
        };
        Ok((accounting, opened))
    }

    /// Process-private accounting (no directory given): the same counters in anonymous memory, so
    /// the limit holds per process.
    pub fn anonymous(limits: &Limits) -> Result<Self, Error> {
        let map = Mapping::new(None).map_err(io_error(|| "cannot map anonymous memory".to_owned()))?;
        let accounting = Self {
            map,
            _file: None,
            limits: *limits,
        };
        accounting.initialise();
        Ok(accounting)
    }

    fn initialise(&self) {
        let header = self.map.header();
        header.version.store(VERSION, Ordering::Relaxed);
        header.max_devices.store(MAX_DEVICES as u32, Ordering::Relaxed);
        header.max_slots.store(MAX_SLOTS as u32, Ordering::Relaxed);
        header.slot_size.store(SLOT_SIZE as u32, Ordering::Relaxed);
        header.file_size.store(FILE_SIZE as u64, Ordering::Relaxed);
        header.flags.store(FLAG_HOLDERS_LOCK, Ordering::Relaxed);
        for (stored, limit) in header.limit.iter().zip(&self.limits) {
            stored.store(*limit, Ordering::Relaxed);
        }
        header.magic.store(MAGIC, Ordering::Release);
    }

    /// The limit of device `device` in bytes ([`UNLIMITED`] for none or out of range).
    #[inline]
    pub fn limit(&self, device: usize) -> u64 {
        self.limits.get(device).copied().unwrap_or(UNLIMITED)
    }

    /// Bytes in use on `device` by the whole container (0 out of range).
    #[inline]
    pub fn used(&self, device: usize) -> u64 {
        self.map
            .header()
            .used
            .get(device)
            .map_or(0, |u| u.load(Ordering::Relaxed))
    }

    /// Reserves `bytes` on `device` if that keeps the container within its limit: one atomic
    /// read-modify-write on the shared counter. Out-of-range devices are not limited (nor counted).
    #[inline]
    pub fn try_reserve(&self, device: usize, bytes: u64) -> bool {
        let (Some(used), Some(&limit)) = (self.map.header().used.get(device), self.limits.get(device)) else {
            return true;
        };
        used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |current| {
            current.checked_add(bytes).filter(|&after| after <= limit)
        })
        .is_ok()
    }

    /// Gives back `bytes` reserved on `device` (never below zero).
    #[inline]
    pub fn release(&self, device: usize, bytes: u64) {
        if let Some(used) = self.map.header().used.get(device) {
            saturating_sub(used, bytes);
        }
    }

    /// Adds `bytes` to this process's own usage of `device` in `slot` (uncontended: only this
    /// process writes its slot's counters).
    #[inline]
    pub fn charge(&self, slot: SlotId, device: usize, bytes: u64) {
        if let Some(counter) = self.map.slot(slot.0).and_then(|s| s.used.get(device)) {
            counter.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Takes `bytes` off this process's own usage of `device` in `slot` (never below zero).
    #[inline]
    pub fn discharge(&self, slot: SlotId, device: usize, bytes: u64) {
        if let Some(counter) = self.map.slot(slot.0).and_then(|s| s.used.get(device)) {
            saturating_sub(counter, bytes);
        }
    }

    /// Takes a free slot for process `pid` (started at `start_time`, see [`process_start_time`]).
    ///
    /// A slot already holding the same `pid` and `start_time` belongs to an earlier image of this
    /// very process (before an `exec`, whose device memory the driver has freed): it is reclaimed
    /// and reused. Returns `None` when every slot is taken by a live process (reap first).
    pub fn claim_slot(&self, pid: u32, start_time: u64) -> Option<SlotId> {
        let me = u64::from(pid);
        if me == OWNER_FREE {
            return None;
        }
        for index in 0..MAX_SLOTS {
            let slot = self.map.slot(index)?;
            if slot.owner.load(Ordering::Acquire) == me
                && slot.start_time.load(Ordering::Relaxed) == start_time
                && self.take_over(slot, me)
            {
                slot.owner.store(me, Ordering::Release);
                return Some(SlotId(index));
            }
        }
        for index in 0..MAX_SLOTS {
            let slot = self.map.slot(index)?;
            if slot
                .owner
                .compare_exchange(OWNER_FREE, OWNER_BUSY, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                for counter in &slot.used {
                    counter.store(0, Ordering::Relaxed);
                }
                slot.start_time.store(start_time, Ordering::Relaxed);
                slot.owner.store(me, Ordering::Release);
                return Some(SlotId(index));
            }
        }
        None
    }

    /// Gives the slot back at a clean exit, with whatever usage it still holds (the driver frees
    /// the memory of an exiting process).
    pub fn release_slot(&self, slot: SlotId, pid: u32) {
        if let Some(s) = self.map.slot(slot.0)
            && self.take_over(s, u64::from(pid))
        {
            s.owner.store(OWNER_FREE, Ordering::Release);
        }
    }

    /// Reclaims the slots of processes for which `alive(pid, start_time)` is false: their usage is
    /// subtracted from the device counters and the slot freed. Returns the bytes reclaimed.
    pub fn reap(&self, mut alive: impl FnMut(u32, u64) -> bool) -> u64 {
        let mut reclaimed = 0;
        for index in 0..MAX_SLOTS {
            let Some(slot) = self.map.slot(index) else { break };
            let owner = slot.owner.load(Ordering::Acquire);
            if owner == OWNER_FREE || owner == OWNER_BUSY {
                continue;
            }
            let Ok(pid) = u32::try_from(owner) else {
                // Garbage written into the file: free the slot without touching the counters.
                let _ = slot
                    .owner
                    .compare_exchange(owner, OWNER_FREE, Ordering::AcqRel, Ordering::Relaxed);
                continue;
            };
            if alive(pid, slot.start_time.load(Ordering::Relaxed)) {
                continue;
            }
            let before: u64 = slot.used.iter().map(|u| u.load(Ordering::Relaxed)).sum();
            if self.take_over(slot, owner) {
                slot.owner.store(OWNER_FREE, Ordering::Release);
                reclaimed += before;
            }
        }
        reclaimed
    }

    /// Wins `slot` from `owner` (CAS to busy) and moves its usage out of the device counters.
    /// The caller then stores the new owner.
    fn take_over(&self, slot: &Slot, owner: u64) -> bool {
        if slot
            .owner
            .compare_exchange(owner, OWNER_BUSY, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        let header = self.map.header();
        for (counter, used) in slot.used.iter().zip(&header.used) {
            let bytes = counter.swap(0, Ordering::Relaxed);
            saturating_sub(used, bytes);
        }
        true
    }

    /// A snapshot of the whole file, as [`read_usage`] decodes it (without its bounds check).
    pub fn snapshot(&self) -> Usage {
        snapshot(&self.map)
    }
}

fn saturating_sub(counter: &AtomicU64, bytes: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
        Some(c.saturating_sub(bytes))
    });
}

fn validate(header: &Header) -> Result<(), String> {
    let magic = header.magic.load(Ordering::Acquire);
    if magic != MAGIC {
        return Err(format!("bad magic {magic:#018x}"));
    }
    let version = header.version.load(Ordering::Relaxed);
    if version != VERSION {
        return Err(format!("layout version {version}, this build reads {VERSION}"));
    }
    let shape = (
        header.max_devices.load(Ordering::Relaxed) as usize,
        header.max_slots.load(Ordering::Relaxed) as usize,
        header.slot_size.load(Ordering::Relaxed) as usize,
        header.file_size.load(Ordering::Relaxed),
    );
    if shape != (MAX_DEVICES, MAX_SLOTS, SLOT_SIZE, FILE_SIZE as u64) {
        return Err(format!(
            "unexpected shape (devices, slots, slot size, file size) = {shape:?}"
        ));
    }
    Ok(())
}

/// Holds an `flock` for as long as it lives.
/// The liveness lock's range: the file's first byte.
fn liveness_range(kind: libc::c_short) -> libc::flock {
    // SAFETY: all-zero is a valid `struct flock` (and required for `l_pid` with OFD locks).
    let mut range: libc::flock = unsafe { std::mem::zeroed() };
    range.l_type = kind;
    range.l_whence = libc::SEEK_SET as libc::c_short;
    range.l_start = 0;
    range.l_len = 1;
    range
}

/// Takes this process's shared liveness lock on `file` (an open file description lock: shared with
/// forked children, released by the kernel when the last descriptor of it closes).
fn hold_liveness_lock(file: &File) -> io::Result<()> {
    let range = liveness_range(libc::F_RDLCK as libc::c_short);
    // SAFETY: plain syscall on an open descriptor with a valid `struct flock`.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &range) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether some process still holds a liveness lock on `file` (tested without taking anything).
/// When the kernel cannot say, it is taken to be held: the counters are then believed.
fn liveness_lock_held(file: &File) -> bool {
    let mut range = liveness_range(libc::F_WRLCK as libc::c_short);
    // SAFETY: as above; the kernel writes the conflicting lock, if any, into `range`.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut range) };
    rc != 0 || range.l_type != libc::F_UNLCK as libc::c_short
}

struct FileLock<'a>(&'a File);

impl<'a> FileLock<'a> {
    fn exclusive(file: &'a File) -> io::Result<Self> {
        loop {
            // SAFETY: plain syscall on an open descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Self(file));
            }
            let error = io::Error::last_os_error();
            if error.kind() != io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
    }
}

impl Drop for FileLock<'_> {
    fn drop(&mut self) {
        // SAFETY: plain syscall on an open descriptor.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

// -------------------------------------------------------------------------------------------------
// Reader (the agent)

/// One device's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceUsage {
    /// The CUDA device ordinal inside the container.
    pub index: u32,
    /// The limit in bytes the file was created with (`None`: not limited).
    pub limit: Option<u64>,
    /// Bytes in use by all processes of the container.
    pub used: u64,
}

/// One process's usage (a process that holds a slot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUsage {
    /// The PID, in the container's PID namespace.
    pub pid: u32,
    /// Bytes in use per device ordinal.
    pub used: Limits,
}

/// What a container uses, from its accounting file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    /// Every device of the file, in ordinal order ([`MAX_DEVICES`] entries).
    pub devices: Vec<DeviceUsage>,
    /// Every process holding a slot, whether or not it still runs (the shim's processes reap dead
    /// ones; the agent, in another PID namespace, cannot tell).
    pub processes: Vec<ProcessUsage>,
}

impl Usage {
    /// Bytes in use on all devices together.
    pub fn total_used(&self) -> u64 {
        self.devices.iter().map(|d| d.used).fold(0, u64::saturating_add)
    }
}

/// Reads `<dir>/gpumem-accounting` without changing it and without a lock, into a private copy.
///
/// `Ok(None)`: no file yet, or one still being created (no process of the container has used
/// CUDA), or every process that used it has exited (a file whose creator set [`FLAG_HOLDERS_LOCK`]
/// and on which no process holds its liveness lock any more: killed processes leave their share in
/// the counters, which only another process of the container could reap). Whatever the container puts at that path is an error at worst, never a fault or a wait:
/// only a regular file is opened (never through a symlink), and it is read with `pread` rather
/// than mapped, so a file that shrinks is a short read ([`Reason::Size`]). Numbers no shim writes
/// reject the file ([`Reason::Counters`]): a limit above [`MAX_PLAUSIBLE_BYTES`], or a device's
/// `used`, or a process's, above the device's limit (or that bound when unlimited). A slot whose
/// owner is no possible PID (0, or 2^22 and above) is left out.
pub fn read_usage(dir: &Path) -> Result<Option<Usage>, Error> {
    let path = dir.join(FILE_NAME);
    let Some(file) = open_regular(&path)? else {
        return Ok(None);
    };
    let len = file
        .metadata()
        .map_err(io_error(|| format!("cannot stat {}", path.display())))?
        .len();
    if len == 0 {
        return Ok(None);
    }
    if len != FILE_SIZE as u64 {
        let detail = format!("size {len}, expected {FILE_SIZE}");
        return Err(incompatible(path, Reason::Size, detail));
    }
    // The creator writes the magic last (release): read it first, then the rest after it.
    let mut magic = [0; 8];
    file.read_exact_at(&mut magic, 0).map_err(read_error(&path))?;
    if u64::from_ne_bytes(magic) == 0 {
        return Ok(None);
    }
    std::sync::atomic::fence(Ordering::Acquire);
    let copy = FileCopy::read(&file).map_err(read_error(&path))?;
    validate(copy.header()).map_err(|detail| incompatible(path.clone(), Reason::Format, detail))?;
    if copy.header().flags.load(Ordering::Relaxed) & FLAG_HOLDERS_LOCK != 0 && !liveness_lock_held(&file) {
        // Every process that used it has exited: what the counters still hold (a killed process's
        // share, which only a process of the container could reap) is not in use.
        return Ok(None);
    }
    let usage = snapshot(&copy);
    check_bounds(&usage).map_err(|detail| incompatible(path, Reason::Counters, detail))?;
    Ok(Some(usage))
}

/// Opens `path` for reading if it is a regular file; `None` if nothing is there. Nothing else is
/// ever opened: an `O_PATH` descriptor has no open side effects (opening a FIFO blocks, opening a
/// device node reaches its driver with the agent's privileges), `fstat` tells its type, and
/// reopening it through `/proc/self/fd` reaches that very inode whatever the path now names.
fn open_regular(path: &Path) -> Result<Option<File>, Error> {
    let handle = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(handle) => handle,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(|| format!("cannot open {}", path.display()))(e)),
    };
    let kind = handle
        .metadata()
        .map_err(io_error(|| format!("cannot stat {}", path.display())))?
        .file_type();
    if !kind.is_file() {
        let what = if kind.is_symlink() {
            "a symlink"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "a device node"
        };
        let detail = format!("{what}, not a regular file");
        return Err(incompatible(path.to_path_buf(), Reason::NotRegularFile, detail));
    }
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(format!("/proc/self/fd/{}", handle.as_raw_fd()))
        .map(Some)
        .map_err(io_error(|| format!("cannot open {}", path.display())))
}

/// A read that comes up short: the file shrank after it was measured.
fn read_error(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
    move |source| {
        if source.kind() == io::ErrorKind::UnexpectedEof {
            incompatible(path.to_path_buf(), Reason::Size, "shrank while read".to_owned())
        } else {
            Error::Io {
                what: format!("cannot read {}", path.display()),
                source,
            }
        }
    }
}

/// Numbers no shim writes (see [`read_usage`]).
fn check_bounds(usage: &Usage) -> Result<(), String> {
    for device in &usage.devices {
        let d = device.index;
        let bound = match device.limit {
            Some(limit) if limit > MAX_PLAUSIBLE_BYTES => return Err(format!("device {d}: limit {limit}")),
            Some(limit) => limit,
            None => MAX_PLAUSIBLE_BYTES,
        };
        if device.used > bound {
            return Err(format!("device {d}: {} bytes used, above {bound}", device.used));
        }
        if let Some(p) = usage.processes.iter().find(|p| p.used[d as usize] > bound) {
            return Err(format!(
                "process {}: {} bytes used on device {d}, above {bound}",
                p.pid, p.used[d as usize]
            ));
        }
    }
    Ok(())
}

fn snapshot(region: &impl Region) -> Usage {
    let header = region.header();
    let devices = (0..MAX_DEVICES)
        .map(|d| {
            let limit = header.limit[d].load(Ordering::Relaxed);
            DeviceUsage {
                index: d as u32,
                limit: (limit != UNLIMITED).then_some(limit),
                used: header.used[d].load(Ordering::Relaxed),
            }
        })
        .collect();
    let processes = (0..MAX_SLOTS)
        .filter_map(|i| region.slot(i))
        .filter_map(|slot| {
            let owner = slot.owner.load(Ordering::Acquire);
            // 0 is a free slot, u64::MAX a busy one; anything else that no PID can be is garbage.
            let pid = u32::try_from(owner)
                .ok()
                .filter(|&p| p != 0 && u64::from(p) < PID_MAX_LIMIT)?;
            Some(ProcessUsage {
                pid,
                used: std::array::from_fn(|d| slot.used[d].load(Ordering::Relaxed)),
            })
        })
        .collect();
    Usage { devices, processes }
}

// -------------------------------------------------------------------------------------------------
// Liveness

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`: clock ticks after boot), which
/// with the PID identifies a process even after its PID is reused.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&stat).map(|(_, start)| start)
}

/// Whether process `pid`, started at `start_time`, still runs. Gone, a zombie (its device memory is
/// already freed), or a different process under the same PID: dead. When `/proc` cannot say
/// (permission), the process is taken to be alive: reaping a live process would corrupt the books.
pub fn is_alive(pid: u32, start_time: u64) -> bool {
    match std::fs::read(format!("/proc/{pid}/stat")) {
        Ok(stat) => match parse_stat(&stat) {
            Some((state, start)) => {
                !matches!(state, b'Z' | b'X' | b'x') && (start_time == 0 || start == start_time)
            }
            None => true,
        },
        Err(e) => e.kind() != io::ErrorKind::NotFound,
    }
}

/// (state, starttime) from the text of `/proc/<pid>/stat`. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted from the last `)`.
fn parse_stat(stat: &[u8]) -> Option<(u8, u64)> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(stat.get(close + 1..)?).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.bytes().next()?;
    // `rest` starts at field 3 (state); starttime is field 22.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(first: u64) -> Limits {
        let mut l = [UNLIMITED; MAX_DEVICES];
        l[0] = first;
        l
    }

    /// A valid file with 700 KiB in use on device 0 (limit 1 MiB) by PID 4242 in slot 0, as bytes.
    fn valid_file(dir: &Path) -> Vec<u8> {
        let (acct, _) = Accounting::open_or_create(dir, &limits(1 << 20)).expect("create");
        let slot = acct.claim_slot(4242, 7).expect("slot");
        assert!(acct.try_reserve(0, 700 << 10));
        acct.charge(slot, 0, 700 << 10);
        // Its writer stays attached for the rest of the test (its liveness lock held): a file nobody
        // holds reads as nothing in use.
        std::mem::forget(acct);
        std::fs::read(dir.join(FILE_NAME)).expect("read back")
    }

    /// Read through a mapping, as the reader once did, this died of SIGBUS within milliseconds.
    #[test]
    fn a_file_shrinking_under_the_reader_is_an_error_not_a_crash() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let content = valid_file(dir.path());
        let expected = read_usage(dir.path()).expect("read").expect("valid");
        let file = OpenOptions::new()
            .write(true)
            .open(dir.path().join(FILE_NAME))
            .expect("open for writing");
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (mut some, mut none, mut errors) = (0, 0, 0);
        std::thread::scope(|s| {
            s.spawn(|| {
                // What a hostile container can do to its own file, as fast as it can.
                while !stop.load(Ordering::Relaxed) {
                    let _ = file.set_len(0);
                    let _ = file.write_all_at(&content, 0);
                    let _ = file.set_len(FILE_SIZE as u64 / 2);
                    let _ = file.set_len(FILE_SIZE as u64);
                    let _ = file.write_all_at(&content, 0);
                }
            });
            for _ in 0..5000 {
                match read_usage(dir.path()) {
                    Ok(Some(usage)) => {
                        some += 1;
                        assert!(usage.processes.iter().all(|p| p.pid == 4242), "{usage:?}");
                    }
                    Ok(None) => none += 1,
                    Err(e) => {
                        errors += 1;
                        let reason = e.reason();
                        assert!(
                            matches!(reason, Reason::Size | Reason::Format | Reason::Counters),
                            "{e}"
                        );
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        eprintln!("{some} usages, {none} absent, {errors} rejected");
        assert_eq!(read_usage(dir.path()).expect("read").expect("valid"), expected);
    }

    #[test]
    fn a_fifo_is_refused_at_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        let made = std::process::Command::new("mkfifo")
            .arg(dir.path().join(FILE_NAME))
            .status()
            .expect("run mkfifo");
        assert!(made.success());
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = dir.path().to_path_buf();
        // A reader blocked in open would hang the test: give it a thread and a deadline.
        std::thread::spawn(move || tx.send(read_usage(&reader).map(|_| ())));
        let result = rx
            .recv_timeout(std::time::Duration::from_secs(1))
            .expect("read_usage blocked on a FIFO");
        let error = result.expect_err("a FIFO is no accounting file");
        assert_eq!(error.reason(), Reason::NotRegularFile, "{error}");
    }

    #[test]
    fn symlinks_and_directories_are_not_followed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let elsewhere = tempfile::tempdir().expect("temp dir");
        valid_file(elsewhere.path());
        std::os::unix::fs::symlink(elsewhere.path().join(FILE_NAME), dir.path().join(FILE_NAME))
            .expect("symlink");
        let error = read_usage(dir.path()).expect_err("a symlink is not followed");
        assert_eq!(error.reason(), Reason::NotRegularFile, "{error}");
        assert!(
            error.to_string().contains("a symlink, not a regular file"),
            "{error}"
        );
        std::fs::remove_file(dir.path().join(FILE_NAME)).expect("remove");
        std::fs::create_dir(dir.path().join(FILE_NAME)).expect("mkdir");
        let error = read_usage(dir.path()).expect_err("a directory is no accounting file");
        assert_eq!(error.reason(), Reason::NotRegularFile, "{error}");
    }

    #[test]
    fn absurd_counters_are_rejected_and_impossible_pids_ignored() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().expect("temp dir");
        let content = valid_file(dir.path());
        let path = dir.path().join(FILE_NAME);
        let put = |offset: usize, value: u64| {
            let file = OpenOptions::new().write(true).open(&path).expect("open");
            file.write_all_at(&value.to_ne_bytes(), offset as u64)
                .expect("write");
        };
        let used = |device: usize| std::mem::offset_of!(Header, used) + 8 * device;
        let slot = |index: usize| HEADER_SIZE + index * SLOT_SIZE;
        let slot_used =
            |index: usize, device: usize| slot(index) + std::mem::offset_of!(Slot, used) + 8 * device;

        let rejected = |why: &str| {
            let error = read_usage(dir.path()).expect_err(why);
            assert_eq!(error.reason(), Reason::Counters, "{why}: {error}");
        };
        put(used(0), u64::MAX);
        rejected("u64::MAX used");
        put(used(0), (1 << 20) + 1);
        rejected("over the limit");
        put(used(0), 700 << 10);
        put(used(1), MAX_PLAUSIBLE_BYTES + 1);
        rejected("over 1 PiB on an unlimited device");
        put(used(1), MAX_PLAUSIBLE_BYTES);
        assert!(
            read_usage(dir.path()).is_ok_and(|u| u.is_some()),
            "1 PiB is possible"
        );
        put(used(1), 0);
        put(
            std::mem::offset_of!(Header, limit) + 8 * 2,
            MAX_PLAUSIBLE_BYTES + 1,
        );
        rejected("a limit over 1 PiB");
        put(std::mem::offset_of!(Header, limit) + 8 * 2, UNLIMITED);
        put(slot_used(0, 3), u64::MAX);
        rejected("a process using u64::MAX");
        put(slot_used(0, 3), 0);
        put(slot_used(0, 0), (1 << 20) + 1);
        rejected("a process over the device's limit");
        std::fs::write(&path, &content).expect("restore");

        // PID 0 is a free slot, whatever it holds; PIDs at or above the kernel's maximum are not PIDs.
        put(slot_used(1, 0), 5);
        put(slot(2), 4_194_304);
        put(slot(3), u64::from(u32::MAX));
        put(slot(4), 4_194_303);
        let usage = read_usage(dir.path()).expect("read").expect("valid");
        let pids: Vec<u32> = usage.processes.iter().map(|p| p.pid).collect();
        assert_eq!(pids, [4242, 4_194_303]);
    }

    #[test]
    fn reserve_up_to_the_limit_and_not_a_byte_more() {
        let acct = Accounting::anonymous(&limits(1000)).expect("anonymous mapping");
        assert!(acct.try_reserve(0, 600));
        assert!(acct.try_reserve(0, 400));
        assert!(!acct.try_reserve(0, 1));
        acct.release(0, 400);
        assert!(acct.try_reserve(0, 400));
        assert!(!acct.try_reserve(0, u64::MAX), "no overflow past the limit");
        assert_eq!(acct.used(0), 1000);
        // Unlimited and out-of-range devices never refuse.
        assert!(acct.try_reserve(1, u64::MAX / 2));
        assert!(acct.try_reserve(MAX_DEVICES, 5));
        acct.release(0, 5000);
        assert_eq!(acct.used(0), 0, "release saturates at zero");
    }

    /// Killed processes leave their share in the counters; once no process holds the file (every
    /// one of them closed it, as the kernel does for a killed one), the reader counts nothing. A
    /// file an older shim created (no flag) is read as before.
    #[test]
    fn a_file_nobody_holds_counts_nothing() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (a, _) = Accounting::open_or_create(dir.path(), &limits(1 << 20)).expect("create");
        let (b, _) = Accounting::open_or_create(dir.path(), &limits(1 << 20)).expect("open");
        let slot = a.claim_slot(4242, 7).expect("slot");
        assert!(a.try_reserve(0, 700 << 10));
        a.charge(slot, 0, 700 << 10);
        drop(a);
        let usage = read_usage(dir.path()).expect("read").expect("b still holds it");
        assert_eq!(usage.devices[0].used, 700 << 10, "a's share, not reaped");
        drop(b);
        assert!(
            read_usage(dir.path()).expect("read").is_none(),
            "nobody holds it: nothing in use"
        );

        // The same file as an older shim left it: no flag, the counters are believed.
        let path = dir.path().join(FILE_NAME);
        let file = OpenOptions::new().write(true).open(&path).expect("open");
        file.write_all_at(&0u64.to_ne_bytes(), 32)
            .expect("clear the flags");
        let usage = read_usage(dir.path())
            .expect("read")
            .expect("no flag: read as before");
        assert_eq!(usage.devices[0].used, 700 << 10);
    }

    #[test]
    fn file_is_shared_and_validated() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (a, opened) = Accounting::open_or_create(dir.path(), &limits(1 << 20)).expect("create");
        assert_eq!(opened, Opened::Created);
        let (b, opened) = Accounting::open_or_create(dir.path(), &limits(1 << 20)).expect("open");
        assert_eq!(opened, Opened::Existing);
        let slot_a = a.claim_slot(4242, 7).expect("slot");
        assert!(a.try_reserve(0, 700 << 10));
        a.charge(slot_a, 0, 700 << 10);
        assert!(
            !b.try_reserve(0, 400 << 10),
            "the second mapping sees the first's usage"
        );
        assert!(b.try_reserve(0, 300 << 10));
        b.release(0, 300 << 10);

        let usage = read_usage(dir.path()).expect("read").expect("initialised");
        assert_eq!(
            usage.devices[0],
            DeviceUsage {
                index: 0,
                limit: Some(1 << 20),
                used: 700 << 10
            }
        );
        assert_eq!(usage.devices[1].limit, None);
        assert_eq!(usage.processes.len(), 1);
        assert_eq!(usage.processes[0].pid, 4242);
        assert_eq!(usage.processes[0].used[0], 700 << 10);
        assert_eq!(usage.total_used(), 700 << 10);

        let mode = std::fs::metadata(dir.path().join(FILE_NAME))
            .expect("stat")
            .permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o666);

        let (_, opened) = Accounting::open_or_create(dir.path(), &limits(5)).expect("open");
        assert_eq!(opened, Opened::LimitsDiffer);
    }

    #[test]
    fn missing_or_foreign_files() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert_eq!(read_usage(dir.path()).expect("no file is fine"), None);
        std::fs::write(dir.path().join(FILE_NAME), b"").expect("write");
        assert_eq!(read_usage(dir.path()).expect("empty file is fine"), None);
        std::fs::write(dir.path().join(FILE_NAME), b"not an accounting file").expect("write");
        let error = read_usage(dir.path()).expect_err("too short");
        assert_eq!(error.reason(), Reason::Size, "{error}");
        assert!(matches!(
            Accounting::open_or_create(dir.path(), &limits(1)),
            Err(Error::Incompatible { .. })
        ));
        std::fs::write(dir.path().join(FILE_NAME), vec![0xAB; FILE_SIZE]).expect("write");
        let error = read_usage(dir.path()).expect_err("bad magic");
        assert!(error.to_string().contains("bad magic"), "{error}");
        assert_eq!(error.reason(), Reason::Format);
        assert!(Accounting::open_or_create(&dir.path().join("absent"), &limits(1)).is_err());
    }

    #[test]
    fn an_empty_file_left_by_a_dead_creator_is_initialised() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join(FILE_NAME), b"").expect("write");
        let (acct, opened) = Accounting::open_or_create(dir.path(), &limits(1)).expect("open");
        assert_eq!(opened, Opened::Created);
        assert!(read_usage(dir.path()).expect("read").is_some());
        drop(acct);
    }

    #[test]
    fn reaping_returns_a_dead_process_share_exactly_once() {
        let acct = Accounting::anonymous(&limits(1000)).expect("anonymous mapping");
        let dead = acct.claim_slot(100, 1).expect("slot");
        let live = acct.claim_slot(200, 2).expect("slot");
        assert_ne!(dead, live);
        for (slot, bytes) in [(dead, 600), (live, 300)] {
            assert!(acct.try_reserve(0, bytes));
            acct.charge(slot, 0, bytes);
        }
        assert!(!acct.try_reserve(0, 200));
        assert_eq!(acct.reap(|pid, _| pid != 100), 600);
        assert_eq!(acct.reap(|pid, _| pid != 100), 0, "a reaped slot is free");
        assert_eq!(acct.used(0), 300);
        assert!(acct.try_reserve(0, 700));
        assert_eq!(
            acct.snapshot()
                .processes
                .iter()
                .map(|p| p.pid)
                .collect::<Vec<_>>(),
            [200]
        );
    }

    #[test]
    fn a_slot_of_an_earlier_image_of_the_same_process_is_reclaimed() {
        let acct = Accounting::anonymous(&limits(1000)).expect("anonymous mapping");
        let before_exec = acct.claim_slot(300, 9).expect("slot");
        assert!(acct.try_reserve(0, 500));
        acct.charge(before_exec, 0, 500);
        let after_exec = acct.claim_slot(300, 9).expect("slot");
        assert_eq!(before_exec, after_exec);
        assert_eq!(acct.used(0), 0);
        // Same PID, other start time: a different process, a different slot.
        assert_ne!(acct.claim_slot(300, 10).expect("slot"), after_exec);
    }

    #[test]
    fn slots_run_out_and_come_back() {
        let acct = Accounting::anonymous(&limits(UNLIMITED)).expect("anonymous mapping");
        for pid in 1..=MAX_SLOTS as u32 {
            assert!(acct.claim_slot(pid, 0).is_some());
        }
        assert_eq!(acct.claim_slot(5000, 0), None);
        acct.reap(|pid, _| pid % 2 == 0);
        assert!(acct.claim_slot(5000, 0).is_some());
        let slot = acct.claim_slot(6000, 0).expect("slot");
        acct.release_slot(slot, 6000);
        assert!(acct.claim_slot(7000, 0).is_some());
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_limit() {
        let acct = Accounting::anonymous(&limits(10_000)).expect("anonymous mapping");
        let granted = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        if acct.try_reserve(0, 7) {
                            granted.fetch_add(7, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(granted.load(Ordering::Relaxed), acct.used(0));
        assert!(acct.used(0) <= 10_000 && acct.used(0) > 10_000 - 7);
    }

    #[test]
    fn liveness_from_proc() {
        let me = std::process::id();
        let start = process_start_time(me).expect("own start time");
        assert!(is_alive(me, start));
        assert!(is_alive(me, 0));
        assert!(
            !is_alive(me, start + 1),
            "same PID, other start time: another process"
        );
        assert!(!is_alive(u32::MAX - 1, 0));
        assert_eq!(
            parse_stat(b"12 (a) b) c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 424242 0"),
            Some((b'S', 424242))
        );
        assert_eq!(parse_stat(b"garbage"), None);

        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while is_alive(pid, 0) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            !is_alive(pid, 0),
            "an exited child (a zombie until waited for) is dead"
        );
        child.wait().expect("wait");
    }
}
