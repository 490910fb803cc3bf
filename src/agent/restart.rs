//! Restarts without lost pods. From the agent's exit until its next registration the kubelet counts every
//! device of its plugins unhealthy, and a pod it admits meanwhile fails for good
//! (`UnexpectedAdmissionError`, terminal for a bare pod). On SIGTERM (a rolling update, a drain) the agent
//! marks its Node ([`AGENT_RESTARTING_ANNOTATION`]), keeps serving for [`DRAIN`] so that pods bound before
//! the scorers saw the mark are admitted, and stops. The next agent keeps the mark until the kubelet has
//! been sent each resource's device list, then takes it off and announces room, so that kube-scheduler
//! tries the pods the scorer refused meanwhile. A crash (SIGKILL) leaves no mark: its window stays.
//!
//! [`AGENT_RESTARTING_ANNOTATION`]: crate::node::AGENT_RESTARTING_ANNOTATION

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

/// How long a stopping agent keeps serving after its mark is on the Node: a pod bound just before the
/// scorers saw the mark reaches the kubelet's admission within it.
pub const DRAIN: Duration = Duration::from_secs(3);
/// How long a stopping agent waits for its mark to be written (the API server may be away).
pub const MARK_TIMEOUT: Duration = Duration::from_secs(2);

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
    expected: Option<BTreeSet<String>>,
    /// The resources whose device list the kubelet has been sent.
    sent: BTreeSet<String>,
    /// This agent is stopping: its mark stays.
    stopping: bool,
}

impl Fence {
    /// A fence that keeps `inherited` (the mark a stopping agent left on the Node) until the kubelet has
    /// the device list of every resource [`Fence::expect`] names.
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

    /// The resources served (none on the DRA path, where the kubelet retries a claim's preparation).
    pub fn expect<'a>(&self, resources: impl IntoIterator<Item = &'a str>) {
        let mut lists = self.lists();
        lists.expected = Some(resources.into_iter().map(String::from).collect());
        self.lift_if_listed(&lists);
    }

    /// The kubelet has been sent `resource`'s device list.
    pub fn listed(&self, resource: &str) {
        let mut lists = self.lists();
        if !lists.sent.contains(resource) {
            lists.sent.insert(resource.to_string());
            self.lift_if_listed(&lists);
        }
    }

    fn lift_if_listed(&self, lists: &Lists) {
        let all_listed = lists.expected.as_ref().is_some_and(|e| e.is_subset(&lists.sent));
        if all_listed && !lists.stopping && self.mark.borrow().is_some() {
            tracing::info!("the kubelet has every device list again: restart mark lifted");
            self.mark.send_replace(None);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inherited_mark_holds_until_every_resource_is_listed() {
        let at = Timestamp::now();
        let fence = Fence::new(Some(at));
        fence.listed("nvidia.com/gpu");
        assert_eq!(fence.mark(), Some(at), "what is served is not known yet");
        fence.expect(["nvidia.com/gpu", "nvidia.com/gpu-mem"]);
        assert_eq!(fence.mark(), Some(at), "gpu-mem not listed yet");
        fence.listed("nvidia.com/gpu-mem");
        assert_eq!(fence.mark(), None);
    }

    #[test]
    fn nothing_served_lifts_at_once_and_no_mark_stays_none() {
        let fence = Fence::new(Some(Timestamp::now()));
        fence.expect([]);
        assert_eq!(fence.mark(), None, "the DRA path serves no device list");
        let fresh = Fence::new(None);
        fresh.expect(["nvidia.com/gpu"]);
        fresh.listed("nvidia.com/gpu");
        assert_eq!(fresh.mark(), None);
    }

    #[tokio::test]
    async fn a_stopping_agent_marks_and_keeps_its_mark() {
        let fence = Fence::new(None);
        fence.expect(["nvidia.com/gpu"]);
        let mut changes = fence.subscribe();
        let at = fence.stopping();
        assert!(changes.has_changed().unwrap_or(false));
        assert_eq!(*changes.borrow_and_update(), Some(at));
        fence.listed("nvidia.com/gpu");
        assert_eq!(
            fence.mark(),
            Some(at),
            "a late list does not lift a stopping agent's mark"
        );
        // Written or not within the timeout.
        assert!(!fence.wait_written(at, Duration::from_millis(20)).await);
        fence.written(Some(at));
        assert!(fence.wait_written(at, Duration::from_millis(20)).await);
    }
}
