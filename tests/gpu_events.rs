//! GPU health through the inventory's event API, with the fake NVML library injecting faults.
//! Each test sets the process environment before NVML is opened and uses its own inject file;
//! nextest (the project's runner) gives every test a process of its own. Under plain `cargo test`
//! the lock serializes them, though an event thread still winding down may keep the previous
//! test's NVML open: run them with nextest.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpumem::gpu::{GpuEvent, GpuInventory, NvmlSource};

fn open(profile: &str, inject: &std::path::Path) -> NvmlSource {
    // SAFETY: set before any thread of this test reads the environment (NVML is opened right after).
    unsafe {
        std::env::set_var("GPUMEM_FAKE_NVML_PROFILE", profile);
        std::env::set_var("GPUMEM_FAKE_NVML_INJECT", inject);
    }
    let lib = support::fake_nvml_dir().join("libnvidia-ml.so.1");
    NvmlSource::open(Some(&lib)).expect("the fake NVML library loads through nvml-wrapper")
}

#[test]
fn an_injected_xid_arrives_on_the_event_api() {
    let _one_at_a_time = support::fake_nvml_lock();
    let dir = tempfile::tempdir().unwrap();
    let mut inject = support::InjectFile::new(dir.path().join("inject.toml"));
    let nvml = open("dgx-a100", inject.path());
    let inventory = GpuInventory::discover(&nvml).unwrap();
    let events = nvml.health_events(|| {}).unwrap();
    assert_eq!(
        events.next(Duration::from_millis(300)).unwrap(),
        None,
        "nothing injected yet"
    );

    inject.push_xid(5, 79);
    let event = events
        .next(Duration::from_secs(5))
        .unwrap()
        .expect("the XID arrives");
    assert_eq!(
        event,
        GpuEvent::Xid {
            index: 5,
            uuid: inventory.gpus[5].uuid.clone(),
            xid: 79
        }
    );

    inject.push_xid(2, 48);
    let event = events
        .next(Duration::from_secs(5))
        .unwrap()
        .expect("a second XID arrives");
    assert!(
        matches!(
            event,
            GpuEvent::Xid {
                index: 2,
                xid: 48,
                ..
            }
        ),
        "{event:?}"
    );
}

#[test]
fn a_lost_gpu_is_reported_as_lost_and_memory_use_is_seen() {
    let _one_at_a_time = support::fake_nvml_lock();
    let dir = tempfile::tempdir().unwrap();
    let mut inject = support::InjectFile::new(dir.path().join("inject.toml"));
    let nvml = open("t4x4", inject.path());
    inject.set_memory_used(1, 2048);
    assert_eq!(nvml.memory_used_mib(1).unwrap(), 2048);
    assert_eq!(nvml.memory_used_mib(0).unwrap(), 0);

    inject.set_lost(&[3]);
    let err = nvml.memory_used_mib(3).unwrap_err();
    assert!(
        matches!(err, gpumem::gpu::GpuError::GpuLost { index: 3 }),
        "{err}"
    );
    let err = GpuInventory::discover(&nvml).unwrap_err();
    assert!(err.to_string().contains("GPU 3 has fallen off the bus"), "{err}");
}

#[test]
fn the_watch_survives_an_nvml_error_and_says_when_it_runs() {
    let _one_at_a_time = support::fake_nvml_lock();
    let dir = tempfile::tempdir().unwrap();
    let mut inject = support::InjectFile::new(dir.path().join("inject.toml"));
    let nvml = open("t4x4", inject.path());
    let waits = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&waits);
    let events = nvml
        .health_events(move || {
            counter.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
    let progressing = |what: &str| {
        let from = waits.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while waits.load(Ordering::Relaxed) < from + 2 {
            assert!(Instant::now() < deadline, "no progress {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    progressing("at the start");

    // Every wait fails: no progress while it lasts, and no event, but the thread stays.
    inject.set_event_wait_error(Some(999));
    std::thread::sleep(Duration::from_millis(500));
    let stalled = waits.load(Ordering::Relaxed);
    assert_eq!(events.next(Duration::from_millis(700)).unwrap(), None);
    assert_eq!(
        waits.load(Ordering::Relaxed),
        stalled,
        "progress while NVML fails"
    );

    inject.set_event_wait_error(None);
    progressing("after NVML recovered");
    inject.push_xid(3, 48);
    let event = events
        .next(Duration::from_secs(10))
        .unwrap()
        .expect("an XID after the error arrives");
    assert!(
        matches!(
            event,
            GpuEvent::Xid {
                index: 3,
                xid: 48,
                ..
            }
        ),
        "{event:?}"
    );
}
