//! The agent's hot paths on the largest node it serves: an 8 x 80 GB node at the finest memory unit
//! whose device list fits the kubelet's limit (5 MiB: 131,072 units).
//!
//! `cargo bench --bench agent`

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use prost::Message as _;

use gpumem::agent::state::{HealthPolicy, NodeState};
use gpumem::gpu::GpuInventory;
use gpumem::plugin::devices;
use gpumem_profile::Profile;

fn node(unit_mib: u64) -> NodeState {
    let inventory = GpuInventory::discover(&Profile::load("dgx-a100").expect("built-in")).expect("profile");
    NodeState::new(
        inventory,
        unit_mib,
        devices::GPU_RESOURCE.into(),
        devices::MEM_RESOURCE.into(),
        HealthPolicy {
            ignored_xids: Vec::new(),
            quiet_period: std::time::Duration::from_secs(300),
        },
    )
}

fn bench(c: &mut Criterion) {
    let probe = node(1);
    let unit = devices::smallest_fitting_unit(&probe.inventory).expect("some unit fits");
    let state = node(unit);
    // What the kubelet offers: every unit; the pod asks for 5000 MiB.
    let available: Vec<String> = state.mem_devices().into_iter().map(|d| d.id).collect();
    let size = (5000 / unit) as usize;
    eprintln!(
        "dgx-a100 at {unit} MiB: {} units offered, request of {size} units",
        available.len()
    );

    c.bench_function(
        "gpu-mem GetPreferredAllocation + Allocate (dgx-a100, finest unit)",
        |b| {
            b.iter_batched(
                || node(unit),
                |state| {
                    let ids = state.prefer_mem(&available, &[], size, None).expect("fits");
                    state.allocate_mem(&ids).expect("allocates")
                },
                BatchSize::SmallInput,
            )
        },
    );

    let bytes = gpumem::plugin::proto::v1beta1::ListAndWatchResponse {
        devices: state.mem_devices(),
    }
    .encoded_len();
    eprintln!("one gpu-mem ListAndWatch response: {bytes} bytes");
    c.bench_function(
        "gpu-mem ListAndWatch build + encode (dgx-a100, finest unit)",
        |b| {
            b.iter(|| {
                let response = gpumem::plugin::proto::v1beta1::ListAndWatchResponse {
                    devices: state.mem_devices(),
                };
                response.encode_to_vec()
            })
        },
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
