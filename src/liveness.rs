//! What `/healthz` says: whether the agent's own loops are alive. Each loop (a plugin's registration,
//! each ListAndWatch stream, the XID watch) holds a [`Heartbeat`] and beats it whenever it makes
//! progress; a loop silent for longer than its own limit, or one that ended, makes the agent not alive.
//! Nothing here calls NVML: a hung GPU must not get the agent restarted (and its devices withdrawn).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The loops of one agent.
#[derive(Debug)]
pub struct Liveness {
    epoch: Instant,
    loops: Mutex<Vec<Arc<Loop>>>,
}

#[derive(Debug)]
struct Loop {
    name: String,
    max_silence: Duration,
    /// Milliseconds from `epoch` to the last beat.
    last_beat_ms: AtomicU64,
    ended: AtomicBool,
    /// Gone with its heartbeat (a stream the kubelet closed) instead of reported as ended.
    transient: bool,
}

/// A loop's handle: beat it on progress. Dropping a lasting loop's heartbeat marks the loop ended.
#[derive(Debug)]
pub struct Heartbeat {
    liveness: Arc<Liveness>,
    entry: Arc<Loop>,
}

/// The answer to `/healthz`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub alive: bool,
    /// One line with the verdict (`ok`, or `stale:` and the loops), then one line per loop.
    pub report: String,
}

impl Default for Liveness {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            loops: Mutex::new(Vec::new()),
        }
    }
}

impl Liveness {
    /// A loop that lives as long as the agent: its end is reported.
    pub fn lasting(self: &Arc<Self>, name: impl Into<String>, max_silence: Duration) -> Heartbeat {
        self.add(name.into(), max_silence, false)
    }

    /// A loop that may end for good reasons (a ListAndWatch stream): it is forgotten when it ends.
    pub fn transient(self: &Arc<Self>, name: impl Into<String>, max_silence: Duration) -> Heartbeat {
        self.add(name.into(), max_silence, true)
    }

    fn add(self: &Arc<Self>, name: String, max_silence: Duration, transient: bool) -> Heartbeat {
        let entry = Arc::new(Loop {
            name,
            max_silence,
            last_beat_ms: AtomicU64::new(self.millis(Instant::now())),
            ended: AtomicBool::new(false),
            transient,
        });
        self.lock().push(Arc::clone(&entry));
        Heartbeat {
            liveness: Arc::clone(self),
            entry,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Loop>>> {
        // A loop list is valid after any panic: entries are only pushed and removed whole.
        self.loops.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn millis(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }

    /// The verdict now.
    pub fn check(&self) -> Verdict {
        self.check_at(Instant::now())
    }

    /// The verdict at `now` (a later instant in tests).
    pub fn check_at(&self, now: Instant) -> Verdict {
        let now_ms = self.millis(now);
        let mut loops = self.lock().clone();
        loops.sort_by(|a, b| a.name.cmp(&b.name));
        let mut stale = Vec::new();
        let mut lines = String::new();
        for entry in &loops {
            let silent =
                Duration::from_millis(now_ms.saturating_sub(entry.last_beat_ms.load(Ordering::Relaxed)));
            let limit = entry.max_silence.as_secs_f64();
            let state = if entry.ended.load(Ordering::Relaxed) {
                stale.push(entry.name.as_str());
                "ended".to_string()
            } else if silent > entry.max_silence {
                stale.push(entry.name.as_str());
                format!(
                    "no progress for {:.1} s (limit {limit:.1} s)",
                    silent.as_secs_f64()
                )
            } else {
                format!(
                    "alive, last progress {:.1} s ago (limit {limit:.1} s)",
                    silent.as_secs_f64()
                )
            };
            let _ = writeln!(lines, "{}: {state}", entry.name);
        }
        let alive = stale.is_empty();
        let head = if alive {
            "ok".to_string()
        } else {
            format!("stale: {}", stale.join(", "))
        };
        Verdict {
            alive,
            report: format!("{head}\n{lines}"),
        }
    }
}

impl Heartbeat {
    /// The loop made progress.
    pub fn beat(&self) {
        let now = self.liveness.millis(Instant::now());
        self.entry.last_beat_ms.store(now, Ordering::Relaxed);
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        if self.entry.transient {
            self.liveness.lock().retain(|e| !Arc::ptr_eq(e, &self.entry));
        } else {
            self.entry.ended.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_is_stale_past_its_own_limit_and_named() {
        let liveness = Arc::new(Liveness::default());
        let fast = liveness.lasting("registration example.com/gpu", Duration::from_secs(2));
        let _slow = liveness.lasting("XID watch", Duration::from_secs(30));
        let start = Instant::now();
        let verdict = liveness.check_at(start);
        assert!(verdict.alive, "{}", verdict.report);
        assert!(verdict.report.starts_with("ok\n"), "{}", verdict.report);
        assert!(verdict.report.contains("XID watch: alive"), "{}", verdict.report);

        let later = start + Duration::from_secs(5);
        let verdict = liveness.check_at(later);
        assert!(!verdict.alive);
        assert!(
            verdict
                .report
                .starts_with("stale: registration example.com/gpu\n"),
            "{}",
            verdict.report
        );
        assert!(verdict.report.contains("limit 2.0 s"), "{}", verdict.report);

        // A beat after `later`'s silence would have begun: alive again at the same instant.
        std::thread::sleep(Duration::from_millis(5));
        fast.beat();
        assert!(liveness.check_at(Instant::now()).alive);
    }

    #[test]
    fn an_ended_lasting_loop_is_stale_and_an_ended_stream_is_forgotten() {
        let liveness = Arc::new(Liveness::default());
        let stream = liveness.transient("ListAndWatch example.com/gpu", Duration::from_secs(30));
        let watch = liveness.lasting("XID watch", Duration::from_secs(30));
        assert!(
            liveness
                .check()
                .report
                .contains("ListAndWatch example.com/gpu: alive")
        );
        drop(stream);
        let verdict = liveness.check();
        assert!(
            verdict.alive && !verdict.report.contains("ListAndWatch"),
            "{}",
            verdict.report
        );
        drop(watch);
        let verdict = liveness.check();
        assert!(!verdict.alive);
        assert_eq!(verdict.report, "stale: XID watch\nXID watch: ended\n");
    }
}
