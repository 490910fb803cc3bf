//! Which allocation had which size: a preallocated, lock-free open-addressing hash table.
//!
//! Why a table and not `cuMemGetAddressRange_v2` on free: the VMM handles of `cuMemCreate` and the
//! `CUarray`s of the array calls have no size query at all, so a table is needed anyway; asking
//! the driver would add a driver call (with the driver's own locking) to every free; and the
//! driver reports the size it rounded up to, not the size that was reserved, so the books would
//! drift. The table costs one uncontended CAS per allocation and per free, never allocates, never
//! locks and never makes a syscall: its memory is allocated and touched once, when the process
//! first allocates device memory.
//!
//! Linear probing over `2^bits` entries of (key, value), keys stored as `key + 2` (0 marks a never
//! used entry, 1 a removed one). Insertion takes the first empty or removed entry after the key's
//! hash; lookup walks from the hash until it finds the key or a never-used entry. Both give up
//! after [`MAX_PROBE`] entries, so a pathological table costs a bounded scan, not a hang. Keys are
//! unique while live (the driver never hands out an address or handle twice before it is freed),
//! which is what makes the simple protocol correct: an entry is claimed by a CAS on its key, its
//! value written after, and a key is only looked up after the allocation that inserted it returned.

use std::sync::atomic::{AtomicU64, Ordering};

const EMPTY: u64 = 0;
const REMOVED: u64 = 1;
/// Entries visited at most by one insertion or lookup.
pub const MAX_PROBE: usize = 4096;

#[derive(Default)]
struct Entry {
    key: AtomicU64,
    value: AtomicU64,
}

pub struct Table {
    entries: Box<[Entry]>,
    mask: usize,
    shift: u32,
}

impl Table {
    /// A table of `2^bits` entries (16 bytes each), all touched now.
    pub fn new(bits: u32) -> Self {
        let bits = bits.clamp(4, 30);
        let entries: Box<[Entry]> = (0..1usize << bits).map(|_| Entry::default()).collect();
        Self {
            mask: entries.len() - 1,
            entries,
            shift: 64 - bits,
        }
    }

    #[inline]
    fn encode(key: u64) -> Option<u64> {
        key.checked_add(2)
    }

    #[inline]
    fn start(&self, stored: u64) -> usize {
        (stored.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Records `key` → `value`. False when the key cannot be stored (no free entry within
    /// [`MAX_PROBE`] of its hash: the table is nearly full).
    #[inline]
    pub fn insert(&self, key: u64, value: u64) -> bool {
        let Some(stored) = Self::encode(key) else {
            return false;
        };
        let mut index = self.start(stored);
        for _ in 0..MAX_PROBE.min(self.entries.len()) {
            if let Some(entry) = self.entries.get(index) {
                let current = entry.key.load(Ordering::Relaxed);
                if (current == EMPTY || current == REMOVED)
                    && entry
                        .key
                        .compare_exchange(current, stored, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                {
                    entry.value.store(value, Ordering::Release);
                    return true;
                }
            }
            index = (index + 1) & self.mask;
        }
        false
    }

    /// Removes `key` and returns its value; `None` if it is not in the table.
    #[inline]
    pub fn remove(&self, key: u64) -> Option<u64> {
        let stored = Self::encode(key)?;
        let mut index = self.start(stored);
        for _ in 0..MAX_PROBE.min(self.entries.len()) {
            let entry = self.entries.get(index)?;
            match entry.key.load(Ordering::Acquire) {
                EMPTY => return None,
                current if current == stored => {
                    let value = entry.value.load(Ordering::Acquire);
                    // Losing this CAS means another thread removed the key first (a double free
                    // racing with itself): only one of them gives the memory back.
                    return entry
                        .key
                        .compare_exchange(stored, REMOVED, Ordering::AcqRel, Ordering::Relaxed)
                        .ok()
                        .map(|_| value);
                }
                _ => {}
            }
            index = (index + 1) & self.mask;
        }
        None
    }

    /// The value of `key`, if present.
    #[cfg(test)]
    pub fn get(&self, key: u64) -> Option<u64> {
        let stored = Self::encode(key)?;
        let mut index = self.start(stored);
        for _ in 0..MAX_PROBE.min(self.entries.len()) {
            let entry = self.entries.get(index)?;
            match entry.key.load(Ordering::Acquire) {
                EMPTY => return None,
                current if current == stored => return Some(entry.value.load(Ordering::Acquire)),
                _ => {}
            }
            index = (index + 1) & self.mask;
        }
        None
    }
}

/// A table value: the size in bytes (up to 2^56) and the device ordinal.
#[inline]
pub fn pack(bytes: u64, device: usize) -> u64 {
    (bytes.min(u64::MAX >> 8) << 8) | (device as u64 & 0xff)
}

/// (bytes, device) of a table value.
#[inline]
pub fn unpack(value: u64) -> (u64, usize) {
    (value >> 8, (value & 0xff) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_reuse() {
        let table = Table::new(10);
        for key in 0..700u64 {
            assert!(table.insert(key * 4096, pack(key, 1)));
        }
        for key in (0..700u64).step_by(2) {
            assert_eq!(table.remove(key * 4096).map(unpack), Some((key, 1)));
        }
        assert_eq!(table.remove(0), None, "removed once");
        assert_eq!(table.remove(12345), None, "never inserted");
        for key in 0..300u64 {
            assert!(
                table.insert((key + 1000) * 4096, pack(key, 2)),
                "removed entries are reused"
            );
        }
        for key in (1..700u64).step_by(2) {
            assert_eq!(table.get(key * 4096).map(unpack), Some((key, 1)));
        }
        assert_eq!(table.get(1000 * 4096).map(unpack), Some((0, 2)));
    }

    #[test]
    fn full_table_refuses() {
        let table = Table::new(4);
        for key in 0..16u64 {
            assert!(table.insert(key, key));
        }
        assert!(!table.insert(99, 99));
        assert!(
            !table.insert(u64::MAX, 1),
            "keys that cannot be encoded are refused"
        );
        assert_eq!(table.remove(7), Some(7));
        assert!(table.insert(99, 99));
    }

    #[test]
    fn pack_round_trip() {
        assert_eq!(unpack(pack(5 << 30, 3)), (5 << 30, 3));
        assert_eq!(unpack(pack(0, 15)), (0, 15));
    }

    #[test]
    fn concurrent_threads_keep_their_own_keys() {
        let table = Table::new(12);
        std::thread::scope(|s| {
            for thread in 0..4u64 {
                let table = &table;
                s.spawn(move || {
                    for round in 0..2000u64 {
                        let key = (thread << 32) | (round % 500) << 12;
                        assert!(table.insert(key, pack(round, thread as usize)));
                        assert_eq!(table.remove(key).map(unpack), Some((round, thread as usize)));
                    }
                });
            }
        });
    }
}
