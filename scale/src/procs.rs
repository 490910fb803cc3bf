//! CPU and memory of the processes under test, from /proc.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context as _, bail};
use serde::Serialize;

/// Linux reports utime/stime in USER_HZ ticks, 100 per second on every architecture Kubernetes runs on.
const TICKS_PER_SECOND: f64 = 100.0;

/// A process to watch.
#[derive(Debug, Clone)]
pub struct Watched {
    pub name: String,
    pub pid: u32,
}

/// One reading.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub cpu_s: f64,
    pub rss_kib: u64,
    pub hwm_kib: u64,
}

/// utime + stime (seconds) from the text of /proc/PID/stat.
pub fn parse_stat(text: &str) -> anyhow::Result<f64> {
    // "pid (comm) state ppid ...": comm may hold spaces and ')', so split after the last ')'.
    let rest = text.rsplit_once(')').map(|(_, r)| r).context("no ')' in stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After comm: state is field 3 of stat(5); utime is 14 and stime 15, i.e. 11 and 12 from here.
    if fields.len() < 13 {
        bail!(
            "stat has {} fields after comm, expected at least 13",
            fields.len()
        );
    }
    let ticks = |i: usize| -> anyhow::Result<f64> {
        fields[i]
            .parse::<u64>()
            .map(|t| t as f64 / TICKS_PER_SECOND)
            .with_context(|| format!("stat field {:?} is not a number", fields[i]))
    };
    Ok(ticks(11)? + ticks(12)?)
}

/// (VmRSS, VmHWM) in KiB from the text of /proc/PID/status.
pub fn parse_status(text: &str) -> anyhow::Result<(u64, u64)> {
    let field = |key: &str| -> anyhow::Result<u64> {
        let line = text
            .lines()
            .find(|l| l.starts_with(key))
            .with_context(|| format!("no {key} in status"))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("{key} {line:?} is not a number of kB"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

pub fn sample(pid: u32) -> anyhow::Result<Sample> {
    let dir = Path::new("/proc").join(pid.to_string());
    let stat =
        std::fs::read_to_string(dir.join("stat")).with_context(|| format!("reading /proc/{pid}/stat"))?;
    let status =
        std::fs::read_to_string(dir.join("status")).with_context(|| format!("reading /proc/{pid}/status"))?;
    let (rss_kib, hwm_kib) = parse_status(&status)?;
    Ok(Sample {
        cpu_s: parse_stat(&stat)?,
        rss_kib,
        hwm_kib,
    })
}

/// Resets the process's peak RSS (VmHWM) to its current RSS: `5` in /proc/PID/clear_refs (root).
pub fn reset_peak(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// The PID in a kit pid file ("PID STARTTIME").
pub fn pid_from_file(path: &Path) -> anyhow::Result<u32> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("{}: no PID in {text:?}", path.display()))
}

/// One process over one phase.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessUse {
    pub name: String,
    pub pid: u32,
    pub cpu_s: f64,
    /// Of one core, over `cpu_window_s`.
    pub cpu_pct: f64,
    /// From the phase's start to its last binding (rounded up to the next reading, 1 s apart).
    pub cpu_window_s: f64,
    pub peak_rss_mib: f64,
    pub end_rss_mib: f64,
}

/// Tracks the watched processes over one phase.
pub struct PhaseMeter {
    start: Vec<Option<Sample>>,
    peak_kib: Vec<u64>,
    reset: Vec<bool>,
    watched: Vec<Watched>,
    began: Instant,
    /// CPU seconds of each process at each poll.
    polls: Vec<(Instant, Vec<Option<f64>>)>,
}

impl PhaseMeter {
    pub fn start(watched: &[Watched]) -> Self {
        let reset = watched.iter().map(|w| reset_peak(w.pid)).collect();
        let start: Vec<Option<Sample>> = watched.iter().map(|w| sample(w.pid).ok()).collect();
        let peak_kib = start.iter().map(|s| s.map_or(0, |s| s.rss_kib)).collect();
        Self {
            start,
            peak_kib,
            reset,
            watched: watched.to_vec(),
            began: Instant::now(),
            polls: Vec::new(),
        }
    }

    /// A reading in between: the peak where VmHWM could not be reset, and the CPU time so far.
    pub fn poll(&mut self) {
        let mut cpu = Vec::with_capacity(self.watched.len());
        for (i, w) in self.watched.iter().enumerate() {
            match sample(w.pid) {
                Ok(s) => {
                    self.peak_kib[i] = self.peak_kib[i].max(s.rss_kib);
                    cpu.push(Some(s.cpu_s));
                }
                Err(_) => cpu.push(None),
            }
        }
        self.polls.push((Instant::now(), cpu));
    }

    /// The phase's use. CPU is counted from the start to the first reading at or after
    /// `active_end` (the phase's last binding): a phase that waits for pods that never bind
    /// would otherwise dilute the percentages with its idle wait. Peak RSS covers the whole phase.
    pub fn finish(mut self, active_end: Instant) -> Vec<ProcessUse> {
        self.poll();
        let (until, cpu_until) = self
            .polls
            .iter()
            .find(|(t, _)| *t >= active_end)
            .or(self.polls.last())
            .cloned()
            .unwrap_or((Instant::now(), Vec::new()));
        let window = (until - self.began).as_secs_f64().max(1e-9);
        let mut out = Vec::new();
        for (i, w) in self.watched.iter().enumerate() {
            let (Some(start), Ok(end), Some(Some(cpu_end))) =
                (self.start[i], sample(w.pid), cpu_until.get(i))
            else {
                tracing::warn!(process = %w.name, pid = w.pid, "cannot read the process; left out");
                continue;
            };
            let peak = if self.reset[i] {
                end.hwm_kib.max(self.peak_kib[i])
            } else {
                self.peak_kib[i]
            };
            let cpu_s = cpu_end - start.cpu_s;
            out.push(ProcessUse {
                name: w.name.clone(),
                pid: w.pid,
                cpu_s,
                cpu_pct: 100.0 * cpu_s / window,
                cpu_window_s: window,
                peak_rss_mib: peak as f64 / 1024.0,
                end_rss_mib: end.rss_kib as f64 / 1024.0,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_stat_and_status() {
        let stat = "1234 (kube sched) S 1 2 3 4 5 6 7 8 9 10 250 150 0 0 20 0 30 0";
        assert_eq!(parse_stat(stat).unwrap(), 4.0);
        assert!(parse_stat("1234 (x) S 1").is_err());
        let status = "Name:\tetcd\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(parse_status(status).unwrap(), (102_400, 204_800));
        assert!(parse_status("Name: x\n").is_err());
    }

    #[test]
    fn reads_this_process() {
        let s = sample(std::process::id()).unwrap();
        assert!(s.rss_kib > 0 && s.hwm_kib >= s.rss_kib, "{s:?}");
    }
}
