//! Pure arithmetic: latency percentiles, pacing, per-second counts.

use std::time::Duration;

use serde::Serialize;

/// The nearest-rank percentile `p` (0 < p <= 100) of `sorted` (ascending); None when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// p50, p95, p99 and max of some latencies (ms).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    pub count: usize,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Latency {
    pub fn of(latencies_ms: &[f64]) -> Option<Latency> {
        let mut sorted = latencies_ms.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Latency {
            count: sorted.len(),
            p50_ms: percentile(&sorted, 50.0)?,
            p95_ms: percentile(&sorted, 95.0)?,
            p99_ms: percentile(&sorted, 99.0)?,
            max_ms: *sorted.last()?,
        })
    }
}

/// When pod `i` (from 0) is due at `rate` pods per second: i / rate after the start.
pub fn due(i: u64, rate: f64) -> Duration {
    Duration::from_secs_f64(i as f64 / rate)
}

/// How many pods `rate` pods/s for `seconds` makes.
pub fn pod_count(rate: f64, seconds: f64) -> u64 {
    (rate * seconds).round().max(0.0) as u64
}

/// Pods per second: `count` bindings between the first create and the last binding.
pub fn throughput(count: usize, span: Duration) -> Option<f64> {
    let s = span.as_secs_f64();
    (count > 0 && s > 0.0).then(|| count as f64 / s)
}

/// When the placement rate came back: the start of the first `window_s` window (stepping by 1 s from 0,
/// ending by `now_s`) holding at least 80% of `baseline_per_s` × `window_s` of the `times` (seconds from
/// the fault's end). `None`: not yet.
pub fn recovered_after(times: &[f64], baseline_per_s: f64, window_s: f64, now_s: f64) -> Option<f64> {
    let need = (0.8 * baseline_per_s * window_s).ceil() as usize;
    let mut start = 0.0;
    while start + window_s <= now_s {
        let n = times
            .iter()
            .filter(|&&t| t >= start && t < start + window_s)
            .count();
        if n >= need {
            return Some(start);
        }
        start += 1.0;
    }
    None
}

/// How many events fall in each whole second (from 0) of the offsets given (seconds).
pub fn per_second(offsets_s: &[f64]) -> Vec<u64> {
    let Some(last) = offsets_s.iter().copied().filter(|x| *x >= 0.0).reduce(f64::max) else {
        return Vec::new();
    };
    let mut bins = vec![0u64; last.floor() as usize + 1];
    for &x in offsets_s {
        if x >= 0.0 {
            bins[x.floor() as usize] += 1;
        }
    }
    bins
}

/// The empirical CDF of `values` as (value, fraction at or below), thinned to at most `points`.
pub fn cdf(values: &[f64], points: usize) -> Vec<(f64, f64)> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    if n == 0 || points == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(points).max(1);
    let mut out: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (sorted[i], (i + 1) as f64 / n as f64))
        .collect();
    if out.last().is_some_and(|p| p.1 < 1.0) {
        out.push((sorted[n - 1], 1.0));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 95.0), Some(95.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 50.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        let l = Latency::of(&[5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!((l.count, l.p50_ms, l.p95_ms, l.max_ms), (5, 3.0, 5.0, 5.0));
        assert!(Latency::of(&[]).is_none());
    }

    #[test]
    fn recovery_is_the_first_window_back_near_the_baseline() {
        // 10/s before; nothing for 12 s after the end; then 10/s again.
        let times: Vec<f64> = (0..300)
            .map(|i| i as f64 / 10.0 - 5.0)
            .filter(|t| *t < 0.0 || *t >= 12.0)
            .collect();
        assert_eq!(recovered_after(&times, 10.0, 5.0, 10.0), None);
        // The window [8, 13) holds 10 (< 40 needed); [11, 16) holds 40.
        assert_eq!(recovered_after(&times, 10.0, 5.0, 30.0), Some(11.0));
        // Nothing to come back to: at once.
        assert_eq!(recovered_after(&[], 0.0, 5.0, 5.0), Some(0.0));
        assert_eq!(recovered_after(&[], 0.0, 5.0, 4.0), None);
    }

    #[test]
    fn pacing() {
        assert_eq!(pod_count(100.0, 30.0), 3000);
        assert_eq!(pod_count(2.5, 3.0), 8);
        assert_eq!(due(0, 100.0), Duration::ZERO);
        assert_eq!(due(150, 100.0), Duration::from_millis(1500));
        assert_eq!(due(2999, 100.0), Duration::from_millis(29_990));
        assert_eq!(throughput(300, Duration::from_secs(2)), Some(150.0));
        assert_eq!(throughput(0, Duration::from_secs(2)), None);
        assert_eq!(throughput(5, Duration::ZERO), None);
    }

    #[test]
    fn counts_per_second_and_cdf() {
        assert_eq!(per_second(&[0.1, 0.9, 1.0, 3.5, -1.0]), vec![2, 1, 0, 1]);
        assert!(per_second(&[]).is_empty());
        let c = cdf(&[3.0, 1.0, 2.0, 4.0], 10);
        assert_eq!(c, vec![(1.0, 0.25), (2.0, 0.5), (3.0, 0.75), (4.0, 1.0)]);
        let thin = cdf(&(1..=1000).map(f64::from).collect::<Vec<_>>(), 10);
        assert!(thin.len() <= 11);
        assert_eq!(thin.last(), Some(&(1000.0, 1.0)));
    }
}
