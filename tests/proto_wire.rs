//! Wire-format checks for the generated kubelet API types.
//!
//! Each test builds a message, encodes it with prost and compares the bytes with an encoding
//! written out by hand from the `.proto` field numbers and types, then decodes those bytes back.
//! A wrong field number, a wrong wire type (say `sint64` for `int64`, or an unpacked repeated
//! scalar) or a wrong nesting changes the bytes, so the comparison fails.
//!
//! Reminder of the encoding (protobuf proto3):
//! - tag byte = `(field_number << 3) | wire_type`, for field numbers below 16;
//! - wire type 0 = varint (bool, int32, int64, uint64), 2 = length-delimited (string, message,
//!   map entry, packed repeated scalars);
//! - a length (or varint) of 128 or more takes several bytes, 7 bits each, low bits first, high
//!   bit set on all but the last;
//! - proto3 scalars equal to their default (0, false, "") and absent messages are not written;
//! - a `map<string, string>` entry is a nested message with key = field 1, value = field 2;
//! - `repeated int64` is packed: one length-delimited field holding the varints back to back.

use std::collections::HashMap;

use gpumem::plugin::proto::podresources::{
    ClaimResource, ContainerDevices, ContainerMemory, ContainerResources, DynamicResource,
    GetPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use gpumem::plugin::proto::v1beta1::{
    AllocateResponse, CdiDevice, ContainerAllocateResponse, ContainerPreferredAllocationRequest, Device,
    DevicePluginOptions, DeviceSpec, ListAndWatchResponse, Mount, NumaNode, RegisterRequest, TopologyInfo,
};
use gpumem::plugin::proto::{self, podresources};
use prost::Message;

/// Concatenates hand-written pieces (tag/length bytes and string contents) into one buffer.
fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// Encodes `msg`, checks the bytes against `expected`, then checks that `expected` decodes back
/// to `msg`.
fn assert_wire<M: Message + Default + PartialEq + std::fmt::Debug>(msg: &M, expected: &[u8]) {
    let encoded = msg.encode_to_vec();
    assert_eq!(encoded, expected, "encoding of {msg:?}");
    assert_eq!(msg.encoded_len(), expected.len());
    let decoded = M::decode(expected).expect("hand-written bytes must decode");
    assert_eq!(&decoded, msg);
}

fn gpu0_device() -> Device {
    Device {
        id: "GPU-0".into(),
        health: proto::HEALTHY.into(),
        topology: Some(TopologyInfo {
            nodes: vec![NumaNode { id: 1 }],
        }),
    }
}

#[test]
fn device_with_numa_topology() {
    let expected = cat(&[
        // Device.ID: field 1, wire type 2 -> 0x0a; 5 bytes.
        &[0x0a, 0x05],
        b"GPU-0",
        // Device.health: field 2, wire type 2 -> 0x12; 7 bytes.
        &[0x12, 0x07],
        b"Healthy",
        // Device.topology: field 3, wire type 2 -> 0x1a; the TopologyInfo is 4 bytes:
        //   TopologyInfo.nodes: field 1, wire type 2 -> 0x0a; the NUMANode is 2 bytes:
        //     NUMANode.ID: field 1, wire type 0 -> 0x08; varint 1.
        &[0x1a, 0x04, 0x0a, 0x02, 0x08, 0x01],
    ]);
    assert_eq!(expected.len(), 22);
    assert_wire(&gpu0_device(), &expected);

    // ListAndWatchResponse.devices: field 1, wire type 2 -> 0x0a; the Device above is 22 bytes.
    let list = ListAndWatchResponse {
        devices: vec![gpu0_device()],
    };
    assert_wire(&list, &cat(&[&[0x0a, 22], &expected]));
}

#[test]
fn numa_node_id_is_int64_not_sint64() {
    // int64 -1 is sign-extended to 64 bits: a 10-byte varint. (sint64 would zigzag it to 0x01;
    // int32 would also give 10 bytes but could not hold the value 2^33 below.)
    let minus_one = NumaNode { id: -1 };
    assert_wire(
        &minus_one,
        &[0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
    );

    // 2^33 = 0x2_0000_0000: seven bits at a time, low first: 0,0,0,0 then 0x20.
    let big = NumaNode { id: 1 << 33 };
    assert_wire(&big, &[0x08, 0x80, 0x80, 0x80, 0x80, 0x20]);
}

#[test]
fn register_request() {
    let msg = RegisterRequest {
        version: proto::VERSION.into(),
        endpoint: "gpumem.sock".into(),
        resource_name: "example.com/vram".into(),
        options: Some(DevicePluginOptions {
            pre_start_required: true,
            get_preferred_allocation_available: true,
        }),
    };
    let expected = cat(&[
        // RegisterRequest.version: field 1, wire type 2 -> 0x0a; 7 bytes.
        &[0x0a, 0x07],
        b"v1beta1",
        // RegisterRequest.endpoint: field 2, wire type 2 -> 0x12; 11 bytes.
        &[0x12, 0x0b],
        b"gpumem.sock",
        // RegisterRequest.resource_name: field 3, wire type 2 -> 0x1a; 16 bytes.
        &[0x1a, 0x10],
        b"example.com/vram",
        // RegisterRequest.options: field 4, wire type 2 -> 0x22; the options are 4 bytes:
        //   pre_start_required: field 1, wire type 0 -> 0x08; true = 1.
        //   get_preferred_allocation_available: field 2, wire type 0 -> 0x10; true = 1.
        &[0x22, 0x04, 0x08, 0x01, 0x10, 0x01],
    ]);
    assert_wire(&msg, &expected);
}

#[test]
fn default_scalars_are_not_written() {
    // pre_start_required = false is the proto3 default, so only field 2 (tag 0x10) appears.
    let opts = DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    };
    assert_wire(&opts, &[0x10, 0x01]);
    assert_wire(&DevicePluginOptions::default(), &[]);
}

#[test]
fn container_preferred_allocation_request() {
    let msg = ContainerPreferredAllocationRequest {
        available_device_i_ds: vec!["a".into(), "b".into()],
        must_include_device_i_ds: vec!["b".into()],
        allocation_size: 2,
    };
    let expected = [
        // available_deviceIDs: field 1, wire type 2 -> 0x0a, once per element (strings never pack).
        0x0a, 0x01, b'a', //
        0x0a, 0x01, b'b', //
        // must_include_deviceIDs: field 2, wire type 2 -> 0x12.
        0x12, 0x01, b'b', //
        // allocation_size: field 3, wire type 0 -> 0x18; varint 2.
        0x18, 0x02,
    ];
    assert_wire(&msg, &expected);
}

#[test]
fn allocate_response() {
    let container = ContainerAllocateResponse {
        envs: HashMap::from([("GPU_MEM_MB".to_string(), "2048".to_string())]),
        mounts: vec![Mount {
            container_path: "/usr/lib/gpumem".into(),
            host_path: "/opt/gpumem/lib".into(),
            read_only: true,
        }],
        devices: vec![DeviceSpec {
            container_path: "/dev/nvidia0".into(),
            host_path: "/dev/nvidia0".into(),
            permissions: "rw".into(),
        }],
        annotations: HashMap::from([("gpumem/dev".to_string(), "GPU-0".to_string())]),
        cdi_devices: vec![CdiDevice {
            name: "nvidia.com/gpu=0".into(),
        }],
    };
    let msg = AllocateResponse {
        container_responses: vec![container],
    };

    let container_bytes = cat(&[
        // envs: field 1, wire type 2 -> 0x0a; the map entry is 2+10+2+4 = 18 = 0x12 bytes:
        //   key: field 1, wire type 2 -> 0x0a; 10 bytes. value: field 2 -> 0x12; 4 bytes.
        &[0x0a, 0x12, 0x0a, 0x0a],
        b"GPU_MEM_MB",
        &[0x12, 0x04],
        b"2048",
        // mounts: field 2, wire type 2 -> 0x12; the Mount is 2+15+2+15+2 = 36 = 0x24 bytes:
        //   container_path: field 1 -> 0x0a; 15 bytes. host_path: field 2 -> 0x12; 15 bytes.
        //   read_only: field 3, wire type 0 -> 0x18; true = 1.
        &[0x12, 0x24, 0x0a, 0x0f],
        b"/usr/lib/gpumem",
        &[0x12, 0x0f],
        b"/opt/gpumem/lib",
        &[0x18, 0x01],
        // devices: field 3, wire type 2 -> 0x1a; the DeviceSpec is 2+12+2+12+2+2 = 32 = 0x20 bytes:
        //   container_path: 0x0a; 12 bytes. host_path: 0x12; 12 bytes.
        //   permissions: field 3, wire type 2 -> 0x1a; 2 bytes.
        &[0x1a, 0x20, 0x0a, 0x0c],
        b"/dev/nvidia0",
        &[0x12, 0x0c],
        b"/dev/nvidia0",
        &[0x1a, 0x02],
        b"rw",
        // annotations: field 4, wire type 2 -> 0x22; the map entry is 2+10+2+5 = 19 = 0x13 bytes.
        &[0x22, 0x13, 0x0a, 0x0a],
        b"gpumem/dev",
        &[0x12, 0x05],
        b"GPU-0",
        // cdi_devices: field 5, wire type 2 -> 0x2a; the CDIDevice is 2+16 = 18 = 0x12 bytes:
        //   name: field 1 -> 0x0a; 16 bytes.
        &[0x2a, 0x12, 0x0a, 0x10],
        b"nvidia.com/gpu=0",
    ]);
    // 20 + 38 + 34 + 21 + 20 bytes.
    assert_eq!(container_bytes.len(), 133);

    // container_responses: field 1, wire type 2 -> 0x0a; length 133 does not fit in 7 bits:
    // 133 = 0b1_0000101 -> low seven bits 0x05 with the continuation bit (0x85), then 0x01.
    let expected = cat(&[&[0x0a, 0x85, 0x01], &container_bytes]);
    assert_wire(&msg, &expected);
}

#[test]
fn list_pod_resources_response() {
    let msg = ListPodResourcesResponse {
        pod_resources: vec![PodResources {
            name: "trainer".into(),
            namespace: "ml".into(),
            containers: vec![ContainerResources {
                name: "main".into(),
                devices: vec![ContainerDevices {
                    resource_name: "example.com/vram".into(),
                    device_ids: vec!["GPU-0".into()],
                    topology: None,
                }],
                cpu_ids: vec![2, 3],
                memory: vec![],
                dynamic_resources: vec![],
            }],
        }],
    };
    let expected = cat(&[
        // ListPodResourcesResponse.pod_resources: field 1, wire type 2 -> 0x0a; 52 = 0x34 bytes.
        &[0x0a, 0x34],
        // PodResources.name: field 1 -> 0x0a; 7 bytes.
        &[0x0a, 0x07],
        b"trainer",
        // PodResources.namespace: field 2 -> 0x12; 2 bytes.
        &[0x12, 0x02],
        b"ml",
        // PodResources.containers: field 3, wire type 2 -> 0x1a; 37 = 0x25 bytes.
        &[0x1a, 0x25],
        // ContainerResources.name: field 1 -> 0x0a; 4 bytes.
        &[0x0a, 0x04],
        b"main",
        // ContainerResources.devices: field 2 -> 0x12; 25 = 0x19 bytes.
        &[0x12, 0x19],
        //   ContainerDevices.resource_name: field 1 -> 0x0a; 16 bytes.
        &[0x0a, 0x10],
        b"example.com/vram",
        //   ContainerDevices.device_ids: field 2 -> 0x12; 5 bytes. (topology absent: not written.)
        &[0x12, 0x05],
        b"GPU-0",
        // ContainerResources.cpu_ids: field 3, packed -> wire type 2 -> 0x1a; 2 bytes: varints 2, 3.
        &[0x1a, 0x02, 0x02, 0x03],
    ]);
    // 9 + 4 + 39 bytes of PodResources behind the 2-byte header.
    assert_eq!(expected.len(), 2 + 52);
    assert_wire(&msg, &expected);
}

#[test]
fn container_memory_and_dynamic_resources() {
    let msg = ContainerResources {
        name: String::new(),
        devices: vec![],
        cpu_ids: vec![],
        memory: vec![ContainerMemory {
            memory_type: "memory".into(),
            size: 1 << 30,
            topology: Some(podresources::TopologyInfo {
                nodes: vec![podresources::NumaNode { id: 0 }],
            }),
        }],
        dynamic_resources: vec![DynamicResource {
            claim_name: "c".into(),
            claim_namespace: "ns".into(),
            claim_resources: vec![ClaimResource {
                cdi_devices: vec![podresources::CdiDevice { name: "v/g=0".into() }],
                driver_name: "d".into(),
                pool_name: "p".into(),
                device_name: "g".into(),
            }],
        }],
    };
    let expected = cat(&[
        // ContainerResources.memory: field 4, wire type 2 -> 0x22; 2+6+6+4 = 18 = 0x12 bytes:
        &[0x22, 0x12],
        //   memory_type: field 1 -> 0x0a; 6 bytes.
        &[0x0a, 0x06],
        b"memory",
        //   size: field 2, wire type 0 -> 0x10; 2^30 as varint: 0x80 0x80 0x80 0x80 0x04.
        &[0x10, 0x80, 0x80, 0x80, 0x80, 0x04],
        //   topology: field 3 -> 0x1a; 2 bytes: one NUMANode (0x0a) of 0 bytes, since ID 0 is the
        //   default and is not written.
        &[0x1a, 0x02, 0x0a, 0x00],
        // ContainerResources.dynamic_resources: field 5, wire type 2 -> 0x2a; 3+4+20 = 27 = 0x1b
        // bytes:
        &[0x2a, 0x1b],
        //   claim_name: field 2 -> 0x12 (field 1, the removed class_name, never appears); 1 byte.
        &[0x12, 0x01],
        b"c",
        //   claim_namespace: field 3 -> 0x1a; 2 bytes.
        &[0x1a, 0x02],
        b"ns",
        //   claim_resources: field 4 -> 0x22; 9+3+3+3 = 18 = 0x12 bytes:
        &[0x22, 0x12],
        //     cdi_devices: field 1 -> 0x0a; 7 bytes: CDIDevice.name (0x0a) of 5 bytes.
        &[0x0a, 0x07, 0x0a, 0x05],
        b"v/g=0",
        //     driver_name: field 2 -> 0x12; pool_name: field 3 -> 0x1a; device_name: field 4 -> 0x22.
        &[0x12, 0x01],
        b"d",
        &[0x1a, 0x01],
        b"p",
        &[0x22, 0x01],
        b"g",
    ]);
    // memory: 2 + 18; dynamic_resources: 2 + 27 (of which claim_resources: 2 + 18).
    assert_eq!(expected.len(), 20 + 29);
    assert_wire(&msg, &expected);
}

#[test]
fn get_pod_resources_request() {
    let msg = GetPodResourcesRequest {
        pod_name: "p".into(),
        pod_namespace: "ns".into(),
    };
    // pod_name: field 1 -> 0x0a; pod_namespace: field 2 -> 0x12.
    assert_wire(&msg, &[0x0a, 0x01, b'p', 0x12, 0x02, b'n', b's']);
}

#[test]
fn constants_agree_with_kubelet_paths() {
    // Upstream's KubeletSocket is DevicePluginPath + "kubelet.sock".
    assert_eq!(
        format!("{}{}", proto::DEVICE_PLUGIN_DIR, proto::KUBELET_SOCKET),
        "/var/lib/kubelet/device-plugins/kubelet.sock"
    );
    assert_eq!(proto::KUBELET_MAX_RECV_BYTES, 4_194_304);
}
