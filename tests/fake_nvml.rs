//! The fake `libnvidia-ml.so.1` (workspace member `gpumem-fake-nvml`), driven through nvml-wrapper
//! exactly as the agent drives the real library.

mod support;

use std::path::Path;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use gpumem_profile::Profile;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    P2pCapabilitiesIndex, P2pStatus, TemperatureSensor, TopologyLevel,
};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use support::{INJECT_ENV, InjectFile, PROFILE_ENV, fake_nvml_dir, fake_nvml_lib, fake_nvml_lock};

const MIB: u64 = 1024 * 1024;

/// An initialised fake NVML; the field order makes `nvml` shut down before the lock is released.
struct Session {
    nvml: Nvml,
    _serial: MutexGuard<'static, ()>,
}

/// Why every test holds this lock (see `fake_nvml_lock`): the fake library keeps process-wide state
/// and reads its environment variables at the first init after the last shutdown. nextest runs each
/// test in a process of its own, but `cargo test` runs them as threads of one process; so each test
/// sets the variables and uses NVML only while holding the lock, and shuts NVML down (drops its
/// `Nvml`) before letting go.
fn serial() -> MutexGuard<'static, ()> {
    fake_nvml_lock()
}

/// Sets the fake library's environment. Only called with the lock held.
fn set_env(profile: Option<&str>, inject: Option<&Path>) {
    // SAFETY: the tests of this binary touch the environment only with the lock held, and nothing
    // else in the process reads it concurrently.
    unsafe {
        match profile {
            Some(p) => std::env::set_var(PROFILE_ENV, p),
            None => std::env::remove_var(PROFILE_ENV),
        }
        match inject {
            Some(p) => std::env::set_var(INJECT_ENV, p),
            None => std::env::remove_var(INJECT_ENV),
        }
    }
}

fn init() -> Result<Nvml, NvmlError> {
    Nvml::builder().lib_path(fake_nvml_lib().as_os_str()).init()
}

fn start(profile: &str, inject: Option<&Path>) -> Session {
    let lib = fake_nvml_lib(); // build before taking the lock: a failed build must not poison it
    let serial = serial();
    set_env(Some(profile), inject);
    let nvml = init().unwrap_or_else(|e| panic!("fake NVML ({}) with profile {profile}: {e}", lib.display()));
    Session {
        nvml,
        _serial: serial,
    }
}

#[test]
fn dgx_a100_answers_like_the_profile() {
    let s = start("dgx-a100", None);
    let profile = Profile::load("dgx-a100").unwrap();
    let nvml = &s.nvml;

    assert_eq!(nvml.sys_driver_version().unwrap(), "550.90.07");
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12040);
    assert_eq!(nvml.sys_nvml_version().unwrap(), "12.550.90.07");
    assert_eq!(nvml.device_count().unwrap(), 8);

    let devices: Vec<_> = (0..8).map(|i| nvml.device_by_index(i).unwrap()).collect();
    let mut uuids = Vec::new();
    for (i, (device, spec)) in devices.iter().zip(&profile.gpus).enumerate() {
        assert_eq!(device.index().unwrap(), i as u32);
        assert_eq!(device.minor_number().unwrap(), spec.minor_number);
        assert_eq!(device.name().unwrap(), "NVIDIA A100-SXM4-80GB");
        let uuid = device.uuid().unwrap();
        assert_eq!(uuid, spec.uuid);
        uuids.push(uuid);

        let memory = device.memory_info().unwrap();
        assert_eq!(memory.total, 81920 * MIB);
        assert_eq!((memory.used, memory.free), (0, memory.total));

        let pci = device.pci_info().unwrap();
        assert_eq!(pci.bus_id, spec.bus_id);
        assert_eq!(
            format!("{:08X}:{:02X}:{:02X}.0", pci.domain, pci.bus, pci.device),
            spec.bus_id
        );
        assert_eq!(pci.pci_device_id, 0x20B2_10DE);
        assert!(pci.pci_sub_system_id.is_some());

        let cc = device.cuda_compute_capability().unwrap();
        assert_eq!((cc.major, cc.minor), (8, 0));
        assert_eq!(device.numa_node_id().unwrap(), if i < 4 { 0 } else { 1 });
        assert!(device.running_compute_processes().unwrap().is_empty());
        assert!(
            device
                .supported_event_types()
                .unwrap()
                .contains(EventTypes::CRITICAL_XID_ERROR)
        );
        assert!(device.temperature(TemperatureSensor::Gpu).unwrap() > 0);
        assert!(device.power_usage().unwrap() > 0);
        assert_eq!(device.utilization_rates().unwrap().gpu, 0);

        // Look-ups by UUID and bus id find the same GPU.
        assert_eq!(
            nvml.device_by_uuid(spec.uuid.as_str()).unwrap().index().unwrap(),
            i as u32
        );
        assert_eq!(
            nvml.device_by_pci_bus_id(spec.bus_id.as_str())
                .unwrap()
                .index()
                .unwrap(),
            i as u32
        );
    }
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), 8, "UUIDs must be distinct");
    assert!(matches!(
        nvml.device_by_uuid("GPU-nope"),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(nvml.device_by_index(8), Err(NvmlError::InvalidArg)));

    let level = |a: u32, b: u32| {
        let other = nvml.device_by_index(b).unwrap();
        nvml.device_by_index(a)
            .unwrap()
            .topology_common_ancestor(other)
            .unwrap()
    };
    assert_eq!(level(0, 1), TopologyLevel::Single);
    assert_eq!(level(0, 2), TopologyLevel::Node);
    assert_eq!(level(0, 7), TopologyLevel::System);
    assert_eq!(level(3, 3), TopologyLevel::Internal);

    // 12 active links each, all into NVSwitch (no remote end is a GPU), the other 6 disabled.
    for device in &devices {
        let mut active = 0;
        for link in 0..18 {
            let link = device.link_wrapper_for(link);
            if link.is_active().unwrap() {
                active += 1;
                let remote = link.remote_pci_info().unwrap();
                assert!(
                    profile.gpu_by_bus_id(&remote.bus_id).is_none(),
                    "{} is a GPU",
                    remote.bus_id
                );
                assert_eq!(remote.pci_sub_system_id, None);
            } else {
                assert!(matches!(link.remote_pci_info(), Err(NvmlError::NotSupported)));
            }
        }
        assert_eq!(active, 12);
        assert!(matches!(
            device.link_wrapper_for(18).is_active(),
            Err(NvmlError::InvalidArg)
        ));
    }
    assert_eq!(
        devices[0]
            .p2p_status(&devices[7], P2pCapabilitiesIndex::NvLink)
            .unwrap(),
        P2pStatus::Ok
    );
}

#[test]
fn t4x4_has_no_nvlink_and_crosses_numa_nodes_over_the_system() {
    let s = start("t4x4", None);
    let nvml = &s.nvml;
    assert_eq!(nvml.device_count().unwrap(), 4);
    let d0 = nvml.device_by_index(0).unwrap();
    let d2 = nvml.device_by_index(2).unwrap();
    assert!(matches!(
        d0.link_wrapper_for(0).is_active(),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        d0.link_wrapper_for(0).remote_pci_info(),
        Err(NvmlError::NotSupported)
    ));
    assert_eq!(d0.memory_info().unwrap().total, 15360 * MIB);
    assert_eq!(
        d0.p2p_status(&d2, P2pCapabilitiesIndex::NvLink).unwrap(),
        P2pStatus::NotSupported
    );
    assert_eq!(
        d0.p2p_status(&d2, P2pCapabilitiesIndex::Read).unwrap(),
        P2pStatus::IohTopologyNotSupported
    );
    let d1 = nvml.device_by_index(1).unwrap();
    assert_eq!(
        d0.p2p_status(&d1, P2pCapabilitiesIndex::Read).unwrap(),
        P2pStatus::Ok
    );
    assert_eq!(d0.topology_common_ancestor(d1).unwrap(), TopologyLevel::Node);
    let d0 = nvml.device_by_index(0).unwrap();
    assert_eq!(d0.topology_common_ancestor(d2).unwrap(), TopologyLevel::System);
}

#[test]
fn mixed_links_the_v100_pair_to_each_other() {
    let s = start("mixed", None);
    let profile = Profile::load("mixed").unwrap();
    let nvml = &s.nvml;
    let d0 = nvml.device_by_index(0).unwrap();
    let d1 = nvml.device_by_index(1).unwrap();
    let d2 = nvml.device_by_index(2).unwrap();

    let remote_type = nvml.lib().nvmlDeviceGetNvLinkRemoteDeviceType.as_ref().unwrap();
    let mut active = 0;
    for link in 0..18 {
        let wrapper = d0.link_wrapper_for(link);
        if wrapper.is_active().unwrap() {
            active += 1;
            let remote = wrapper.remote_pci_info().unwrap();
            assert_eq!(remote.bus_id, profile.gpus[1].bus_id);
            assert_eq!(remote.pci_device_id, 0x1DB5_10DE);
            // nvml-wrapper 0.13's remote_device_type() drops the answer, so ask the C function.
            let mut kind = 255;
            assert_eq!(unsafe { remote_type(d0.handle(), link, &mut kind) }, 0);
            assert_eq!(kind, 0, "NVML_NVLINK_DEVICE_TYPE_GPU");
        }
    }
    assert_eq!(active, 6);
    assert_eq!(
        d0.p2p_status(&d1, P2pCapabilitiesIndex::NvLink).unwrap(),
        P2pStatus::Ok
    );
    assert_eq!(
        d0.p2p_status(&d2, P2pCapabilitiesIndex::NvLink).unwrap(),
        P2pStatus::NotSupported
    );
    // The T4s have no NVLink at all.
    assert!(matches!(
        d2.link_wrapper_for(0).is_active(),
        Err(NvmlError::NotSupported)
    ));
    assert_eq!(d2.name().unwrap(), "Tesla T4");
    assert_eq!(d2.cuda_compute_capability().unwrap().minor, 5);

    // An NVSwitch link reports SWITCH. (`Nvml::shutdown` also unloads the library, so this checks
    // that it loads and initialises afresh with another profile.)
    let Session { nvml, _serial } = s;
    nvml.shutdown().unwrap();
    drop(_serial);
    let s = start("hgx-h100", None);
    let d5 = s.nvml.device_by_index(5).unwrap();
    let remote_type = s.nvml.lib().nvmlDeviceGetNvLinkRemoteDeviceType.as_ref().unwrap();
    let mut kind = 255;
    assert_eq!(unsafe { remote_type(d5.handle(), 17, &mut kind) }, 0);
    assert_eq!(kind, 2, "NVML_NVLINK_DEVICE_TYPE_SWITCH");
}

#[test]
fn injected_memory_use_shows_in_memory_info() {
    let dir = tempfile::tempdir().unwrap();
    let mut inject = InjectFile::new(dir.path().join("inject.toml"));
    let s = start("dgx-a100", Some(inject.path()));
    let d0 = s.nvml.device_by_index(0).unwrap();
    let d1 = s.nvml.device_by_index(1).unwrap();
    assert_eq!(d0.memory_info().unwrap().used, 0);

    inject.set_memory_used(0, 2048);
    let memory = d0.memory_info().unwrap();
    assert_eq!(memory.used, 2048 * MIB);
    assert_eq!(memory.free, (81920 - 2048) * MIB);
    assert_eq!(d1.memory_info().unwrap().used, 0);
    assert_eq!(d0.utilization_rates().unwrap().gpu, 2);

    // Rewrites are noticed at once, even within one modification-time tick.
    inject.set_memory_used(0, 4096);
    assert_eq!(d0.memory_info().unwrap().used, 4096 * MIB);
    inject.set_memory_used(0, 999_999);
    assert_eq!(d0.memory_info().unwrap().free, 0, "used is capped at the total");

    // A broken file is ignored (the previous faults stay), a deleted one means no faults.
    std::fs::write(inject.path(), "memory_used_mib = oops").unwrap();
    assert_eq!(d0.memory_info().unwrap().used, 81920 * MIB);
    std::fs::remove_file(inject.path()).unwrap();
    assert_eq!(d0.memory_info().unwrap().used, 0);
}

#[test]
fn a_lost_gpu_answers_gpu_lost_until_it_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut inject = InjectFile::new(dir.path().join("inject.toml"));
    let s = start("dgx-a100", Some(inject.path()));
    let d3 = s.nvml.device_by_index(3).unwrap();
    let d2 = s.nvml.device_by_index(2).unwrap();
    let uuid = d3.uuid().unwrap();

    inject.set_lost(&[3]);
    assert!(matches!(d3.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(d3.memory_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(d3.pci_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(
        d3.link_wrapper_for(0).is_active(),
        Err(NvmlError::GpuLost)
    ));
    assert!(matches!(s.nvml.device_by_index(3), Err(NvmlError::GpuLost)));
    assert!(matches!(
        s.nvml.device_by_uuid(uuid.as_str()),
        Err(NvmlError::GpuLost)
    ));
    assert_eq!(s.nvml.device_count().unwrap(), 8, "a lost GPU is still counted");
    assert!(d2.uuid().is_ok());
    assert!(matches!(d2.topology_common_ancestor(d3), Err(NvmlError::GpuLost)));

    inject.set_lost(&[]);
    assert_eq!(s.nvml.device_by_index(3).unwrap().uuid().unwrap(), uuid);
}

#[test]
fn a_hung_gpu_blocks_its_calls_only_until_released() {
    let dir = tempfile::tempdir().unwrap();
    let mut inject = InjectFile::new(dir.path().join("inject.toml"));
    let s = start("t4x4", Some(inject.path()));
    let (d0, d1) = (
        s.nvml.device_by_index(0).unwrap(),
        s.nvml.device_by_index(1).unwrap(),
    );
    let mut set = s.nvml.create_event_set().unwrap();
    set = d1.register_events(EventTypes::CRITICAL_XID_ERROR, set).unwrap();
    inject.set_hung(&[0]);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let answer = d0.memory_info().map(|m| m.total);
            let _ = done_tx.send(answer);
        });
        // Blocked, while the other GPU, the handle look-ups and event waits still answer. Every
        // check is made before the release and asserted after it, so a failure cannot hang the scope.
        let blocked = done_rx.recv_timeout(Duration::from_millis(300)).is_err();
        let other = d1.memory_info().map(|m| m.total);
        let lookup = s.nvml.device_by_index(0).map(|_| ());
        let wait = set.wait(50).map(|_| ());
        inject.set_hung(&[]);
        let answer = done_rx.recv_timeout(Duration::from_secs(10)).expect("released");
        assert!(blocked, "a hung GPU's call returned at once");
        assert_eq!(other.unwrap(), 15360 * MIB);
        assert!(lookup.is_ok());
        assert!(matches!(wait, Err(NvmlError::Timeout)), "{wait:?}");
        assert_eq!(answer.unwrap(), 15360 * MIB);
    });
}

#[test]
fn an_injected_event_wait_error_fails_every_wait_until_removed() {
    let dir = tempfile::tempdir().unwrap();
    let mut inject = InjectFile::new(dir.path().join("inject.toml"));
    let s = start("t4x4", Some(inject.path()));
    let d2 = s.nvml.device_by_index(2).unwrap();
    let set = s.nvml.create_event_set().unwrap();
    let set = d2.register_events(EventTypes::CRITICAL_XID_ERROR, set).unwrap();
    inject.set_event_wait_error(Some(999));
    inject.push_xid(2, 48);
    for _ in 0..2 {
        assert!(matches!(set.wait(1_000), Err(NvmlError::Unknown)));
    }
    inject.set_event_wait_error(None);
    let event = set.wait(1_000).unwrap();
    assert!(matches!(event.event_data, Some(XidError::Value(48))));
}

#[test]
fn injected_xid_reaches_a_waiting_event_set() {
    let dir = tempfile::tempdir().unwrap();
    let mut inject = InjectFile::new(dir.path().join("inject.toml"));
    let s = start("dgx-a100", Some(inject.path()));
    let devices: Vec<_> = (0..8).map(|i| s.nvml.device_by_index(i).unwrap()).collect();
    let mut set = s.nvml.create_event_set().unwrap();
    for device in &devices {
        set = device
            .register_events(EventTypes::CRITICAL_XID_ERROR, set)
            .unwrap();
    }

    // Nothing injected: the wait times out, after (about) the time asked for.
    let started = Instant::now();
    assert!(matches!(set.wait(100), Err(NvmlError::Timeout)));
    assert!(started.elapsed() >= Duration::from_millis(100));

    // An XID appended while a wait is blocked is delivered to it.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            inject.push_xid(1, 79);
        });
        let event = set.wait(5_000).unwrap();
        assert_eq!(event.device.index().unwrap(), 1);
        assert!(event.event_type.contains(EventTypes::CRITICAL_XID_ERROR));
        assert!(matches!(event.event_data, Some(XidError::Value(79))));
    });
    // Delivered once.
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));

    // Several, in order; a GPU the set did not register for is skipped.
    let other = s.nvml.create_event_set().unwrap();
    let other = devices[6]
        .register_events(EventTypes::CRITICAL_XID_ERROR, other)
        .unwrap();
    inject.push_xid(6, 48);
    inject.push_xid(2, 94);
    let first = set.wait(1_000).unwrap();
    let second = set.wait(1_000).unwrap();
    assert_eq!(first.device.index().unwrap(), 6);
    assert!(matches!(first.event_data, Some(XidError::Value(48))));
    assert_eq!(second.device.index().unwrap(), 2);
    // The second set sees every entry for GPU 6, including those injected before it registered.
    let seen = other.wait(1_000).unwrap();
    assert_eq!(seen.device.index().unwrap(), 6);
    assert!(matches!(other.wait(50), Err(NvmlError::Timeout)));

    // A GPU falling off the bus arrives as XID 79 on that GPU (whose calls then fail).
    inject.set_lost(&[4]);
    let lost = set.wait(1_000).unwrap();
    assert_eq!(unsafe { lost.device.handle() }, unsafe { devices[4].handle() });
    assert!(matches!(lost.event_data, Some(XidError::Value(79))));
    assert!(matches!(lost.device.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
    set.release_events().unwrap();
}

#[test]
fn init_fails_without_a_valid_profile() {
    let _ = fake_nvml_lib();
    let _serial = serial();
    set_env(None, None);
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));
    set_env(Some("dgx-z100"), None);
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));
    set_env(Some("/nonexistent/profile.toml"), None);
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));
}

#[test]
fn a_profile_file_works_too() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("one.toml");
    std::fs::write(
        &path,
        "name = 'one'\ndriver_version = '1.2.3'\ncuda_version = '12.8'\n\
         [[gpus]]\nproduct = 'Test GPU'\nmemory_mib = 1000\ncompute_capability = '9.0'\n",
    )
    .unwrap();
    let s = start(path.to_str().unwrap(), None);
    assert_eq!(s.nvml.device_count().unwrap(), 1);
    let d0 = s.nvml.device_by_index(0).unwrap();
    assert_eq!(d0.name().unwrap(), "Test GPU");
    assert!(matches!(d0.numa_node_id(), Err(NvmlError::NotSupported)));
    assert_eq!(s.nvml.sys_cuda_driver_version().unwrap(), 12080);
}

/// The C-level conventions: reference-counted init, null pointers, small buffers, bad handles.
#[test]
fn c_calls_follow_nvml_conventions() {
    let s = start("t4x4", None);
    let lib = s.nvml.lib();
    let d0 = s.nvml.device_by_index(0).unwrap();
    let handle = unsafe { d0.handle() };

    let get_uuid = lib.nvmlDeviceGetUUID.as_ref().unwrap();
    let mut small = [0 as std::ffi::c_char; 8];
    assert_eq!(
        unsafe { get_uuid(handle, small.as_mut_ptr(), small.len() as u32) },
        7,
        "INSUFFICIENT_SIZE"
    );
    assert_eq!(
        unsafe { get_uuid(handle, std::ptr::null_mut(), 80) },
        2,
        "INVALID_ARGUMENT"
    );
    let mut index = 0;
    let get_index = lib.nvmlDeviceGetIndex.as_ref().unwrap();
    assert_eq!(unsafe { get_index(handle, std::ptr::null_mut()) }, 2);
    assert_eq!(
        unsafe { get_index(handle.wrapping_byte_add(4), &mut index) },
        2,
        "past the 4 GPUs"
    );
    assert_eq!(unsafe { get_index(std::ptr::null_mut(), &mut index) }, 2);
    let error_string = lib.nvmlErrorString.as_ref().unwrap();
    let text = unsafe { std::ffi::CStr::from_ptr(error_string(15)) };
    assert_eq!(text.to_str().unwrap(), "GPU is lost");

    // Init is reference-counted: a second init needs a second shutdown.
    let second = init().unwrap();
    second.shutdown().unwrap();
    assert_eq!(s.nvml.device_count().unwrap(), 4);
    let shutdown = lib.nvmlShutdown.as_ref().unwrap();
    assert_eq!(unsafe { shutdown() }, 0);
    assert!(matches!(s.nvml.device_count(), Err(NvmlError::Uninitialized)));
    assert_eq!(unsafe { get_index(handle, &mut index) }, 1, "UNINITIALIZED");
    assert_eq!(unsafe { shutdown() }, 1);
    // Dropping `s.nvml` shuts down once more; the library ignores it (UNINITIALIZED).
}

/// A process that finds the fake through `LD_LIBRARY_PATH` and a plain `Nvml::init()`, as the agent
/// does: this test runs itself again as a child with the environment set.
#[test]
fn plain_init_finds_the_fake_through_ld_library_path() {
    const CHILD: &str = "GPUMEM_FAKE_NVML_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let _serial = serial();
        let nvml = Nvml::init().expect("Nvml::init() in the child");
        assert_eq!(nvml.device_count().unwrap(), 4);
        assert_eq!(nvml.device_by_index(3).unwrap().name().unwrap(), "Tesla T4");
        return;
    }
    let dir = fake_nvml_dir();
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "plain_init_finds_the_fake_through_ld_library_path",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", &dir)
        .env(PROFILE_ENV, "mixed")
        .env_remove(INJECT_ENV)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "child failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "the child did not run the test:\n{text}"
    );
}
