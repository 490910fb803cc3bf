//! Restarts without lost pods. From the agent's exit until the kubelet has the next agent's device lists,
//! the kubelet counts every device of its plugins unhealthy, and a pod it admits meanwhile fails for good
//! (`UnexpectedAdmissionError`, terminal for a bare pod). On SIGTERM (a rolling update, a drain) the agent
//! marks its Node ([`AGENT_RESTARTING_ANNOTATION`]), keeps serving for [`DRAIN`] so that pods bound before
//! the scorers saw the mark are admitted, and stops. The next agent keeps the mark (written again every
//! [`REFRESH`], so that the scorers do not take it for an agent that never came back) until the kubelet
//! counts its devices again (PodResources `GetAllocatableResources`), then takes it off and announces
//! room, so that kube-scheduler tries the pods the scorer refused meanwhile. A crash (SIGKILL) leaves no
//! mark: its window stays.
//!
//! [`AGENT_RESTARTING_ANNOTATION`]: crate::node::AGENT_RESTARTING_ANNOTATION

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

use crate::plugin::podresources::PodResources;

/// How long a stopping agent keeps serving after its mark is on the Node: a pod bound just before the
/// scorers saw the mark reaches the kubelet's admission within it.
pub const DRAIN: Duration = Duration::from_secs(3);
/// How long a stopping agent waits for its mark to be written (the API server may be away).
pub const MARK_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a waiting agent writes its mark again: well within
/// [`crate::node::AGENT_RESTART_MARK_HOLDS`].
pub const REFRESH: Duration = Duration::from_secs(20);
/// How often the kubelet's count is read while the mark waits for it.
const ASK_EVERY: Duration = Duration::from_millis(500);

/// The Node's restart mark, as the agent publishes it.
#[derive(Debug)]
pub struct Fence {
    /// The mark to publish (`None`: none).
    mark: watch::Sender<Option<Timestamp>>,
    /// The mark the Node has, as last written.
    written: watch::Sender<Option<Timestamp>>,
    lists: Mutex<Lists>,
}

#[derive(Debug, Default)]
struct Lists {
    /// The resources served, once known.
    expected: Option<Vec<String>>,
    /// The healthy devices of each resource's last device list sent to the kubelet.
    sent: BTreeMap<String, usize>,
    /// This agent is stopping: its mark stays.
    stopping: bool,
}

impl Fence {
    /// A fence that keeps `inherited` (the mark a stopping agent left on the Node) until lifted.
    pub fn new(inherited: Option<Timestamp>) -> Fence {
        Fence {
            mark: watch::Sender::new(inherited),
            written: watch::Sender::new(inherited),
            lists: Mutex::default(),
        }
    }

    fn lists(&self) -> std::sync::MutexGuard<'_, Lists> {
        self.lists.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The resources served.
    pub fn expect<'a>(&self, resources: impl IntoIterator<Item = &'a str>) {
        self.lists().expected = Some(resources.into_iter().map(String::from).collect());
    }

    /// The kubelet has been sent `resource`'s device list, `healthy` of its devices healthy.
    pub fn listed(&self, resource: &str, healthy: usize) {
        self.lists().sent.insert(resource.to_string(), healthy);
    }

    /// Whether the kubelet, counting `allocatable` devices of each resource, has had a device list of
    /// every resource served: a resource it counts none of while its last list offered some has not
    /// been read yet.
    pub fn counted(&self, allocatable: &BTreeMap<String, usize>) -> bool {
        let lists = self.lists();
        lists.expected.as_ref().is_some_and(|expected| {
            expected.iter().all(|r| match lists.sent.get(r) {
                None => false,
                Some(&healthy) => healthy == 0 || allocatable.get(r).is_some_and(|&n| n > 0),
            })
        })
    }

    /// Takes the mark off (unless this agent is stopping).
    pub fn lift(&self) {
        if !self.lists().stopping && self.mark.borrow().is_some() {
            self.mark.send_replace(None);
        }
    }

    /// Writes the mark again with the time now, if it is still on and this agent is not stopping.
    fn refresh(&self) {
        if !self.lists().stopping && self.mark.borrow().is_some() {
            self.mark.send_replace(Some(Timestamp::now()));
        }
    }

    /// This agent is stopping: the mark to publish from now on (kept until the process ends).
    pub fn stopping(&self) -> Timestamp {
        self.lists().stopping = true;
        let now = Timestamp::now();
        self.mark.send_replace(Some(now));
        now
    }

    /// The mark to publish now.
    pub fn mark(&self) -> Option<Timestamp> {
        *self.mark.borrow()
    }

    /// Wakes on every change of the mark to publish.
    pub fn subscribe(&self) -> watch::Receiver<Option<Timestamp>> {
        self.mark.subscribe()
    }

    /// The Node now carries `mark`.
    pub fn written(&self, mark: Option<Timestamp>) {
        self.written.send_replace(mark);
    }

    /// Waits until the Node carries `mark`, at most `timeout`; whether it does.
    pub async fn wait_written(&self, mark: Timestamp, timeout: Duration) -> bool {
        let mut written = self.written.subscribe();
        tokio::time::timeout(timeout, written.wait_for(|w| *w == Some(mark)))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// Lifts an inherited mark once the kubelet counts the devices of every resource again, writing it
/// again every [`REFRESH`] meanwhile (a kubelet 1.34+ may take minutes over a large device list). A
/// kubelet without `GetAllocatableResources` gets the lists' sending as its sign.
pub async fn lift_when_counted(fence: Arc<Fence>, kubelet: Arc<PodResources>) {
    let started = tokio::time::Instant::now();
    let mut refreshed = started;
    let mut failing = false;
    while fence.mark().is_some() && !fence.lists().stopping {
        let listed = {
            let lists = fence.lists();
            lists
                .expected
                .as_ref()
                .is_some_and(|e| e.iter().all(|r| lists.sent.contains_key(r)))
        };
        if listed {
            match kubelet.allocatable_counts().await {
                Ok(Some(counts)) if fence.counted(&counts) => {
                    tracing::info!(waited = ?started.elapsed(), "the kubelet counts the devices again: restart mark lifted");
                    fence.lift();
                }
                Ok(Some(_)) => {}
                Ok(None) => {
                    tracing::warn!(
                        "the kubelet does not serve GetAllocatableResources: restart mark lifted once the device lists were sent"
                    );
                    fence.lift();
                }
                Err(err) if !failing => {
                    tracing::warn!(error = %err, "cannot ask the kubelet what it counts; the restart mark stays");
                    failing = true;
                }
                Err(_) => {}
            }
        }
        if refreshed.elapsed() >= REFRESH {
            fence.refresh();
            refreshed = tokio::time::Instant::now();
        }
        tokio::time::sleep(ASK_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(of: &[(&str, usize)]) -> BTreeMap<String, usize> {
        of.iter().map(|(r, n)| (r.to_string(), *n)).collect()
    }

    #[test]
    fn counted_once_the_kubelet_has_every_list_it_was_sent() {
        let fence = Fence::new(Some(Timestamp::now()));
        let both = counts(&[("nvidia.com/gpu", 4), ("nvidia.com/gpu-mem", 61440)]);
        assert!(!fence.counted(&both), "what is served is not known yet");
        fence.expect(["nvidia.com/gpu", "nvidia.com/gpu-mem"]);
        fence.listed("nvidia.com/gpu", 4);
        assert!(!fence.counted(&both), "gpu-mem not sent yet");
        fence.listed("nvidia.com/gpu-mem", 61440);
        assert!(fence.counted(&both));
        // The kubelet counts none of gpu-mem yet: its list is not read.
        assert!(!fence.counted(&counts(&[("nvidia.com/gpu", 4)])));
        // No whole GPU offered (every GPU shared): none counted is all there is to count.
        fence.listed("nvidia.com/gpu", 0);
        assert!(fence.counted(&counts(&[("nvidia.com/gpu-mem", 61440)])));
    }

    #[test]
    fn a_stopping_agents_mark_is_neither_lifted_nor_refreshed() {
        let fence = Fence::new(None);
        fence.lift();
        fence.refresh();
        assert_eq!(fence.mark(), None, "no mark, none written");
        let mut changes = fence.subscribe();
        let at = fence.stopping();
        assert!(changes.has_changed().unwrap_or(false));
        assert_eq!(*changes.borrow_and_update(), Some(at));
        fence.lift();
        fence.refresh();
        assert_eq!(fence.mark(), Some(at));
    }

    #[test]
    fn an_inherited_mark_is_refreshed_then_lifted() {
        let old = Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(30);
        let fence = Fence::new(Some(old));
        fence.refresh();
        assert!(fence.mark().is_some_and(|m| m > old));
        fence.lift();
        assert_eq!(fence.mark(), None);
    }

    #[tokio::test]
    async fn a_stopping_agent_waits_for_its_mark_to_be_written() {
        let fence = Fence::new(None);
        let at = fence.stopping();
        assert!(!fence.wait_written(at, Duration::from_millis(20)).await);
        fence.written(Some(at));
        assert!(fence.wait_written(at, Duration::from_millis(20)).await);
    }
}
