//! Registration checks (memory kind, device, handle, limits) and import routing (foreign keys,
//! same-process keys, device matching by UUID), all before any CUDA call.

use kvgate_abi::{MemoryKind, ReasonCode, RegionDesc};
use kvgate_plugin_nvlink::admission::*;
use kvgate_plugin_nvlink::wire::{EndpointWire, RemoteKeyWire, VmmKeyWire};

fn cuda_region() -> RegionDesc {
    RegionDesc { kind: MemoryKind::CUDA_DEVICE, device: 1, addr: 0x7000_0000, len: 4096, ..RegionDesc::default() }
}

fn check(region: &RegionDesc) -> Result<RegionPlan, kvgate_abi::PluginError> {
    check_region(region, &[0, 1], 0, 10)
}

#[test]
fn host_memory_is_refused_at_register_as_unsupported() {
    let host = RegionDesc { kind: MemoryKind::HOST, device: -1, addr: 0x1000, len: 10, ..RegionDesc::default() };
    let e = check(&host).unwrap_err();
    assert_eq!(e.code, ReasonCode::UNSUPPORTED_MEMORY);
    assert!(e.message.contains("host"), "{e}");
    assert_eq!(
        check(&RegionDesc { kind: MemoryKind(99), ..cuda_region() }).unwrap_err().code,
        ReasonCode::UNSUPPORTED_MEMORY
    );
}

#[test]
fn a_device_pointer_region_is_planned_on_its_device() {
    assert_eq!(check(&cuda_region()).unwrap(), RegionPlan { device_index: 1, source: RegionSource::LocalPointer });
}

#[test]
fn an_engine_handle_region_is_opened() {
    let r = RegionDesc { addr: 0, ipc_handle: vec![1u8; 64].into(), backing_offset: 128, ..cuda_region() };
    assert_eq!(check(&r).unwrap(), RegionPlan { device_index: 1, source: RegionSource::EngineHandle });
}

#[test]
fn a_cuda_vmm_descriptor_region_is_imported_and_checked_against_its_allocation() {
    let vmm = |offset: u64, len: u64, path: &str| RegionDesc {
        addr: 0,
        len,
        backing_path: path.into(),
        backing_offset: offset,
        ..cuda_region()
    };
    let plan = check(&vmm(4096, 4096, "cuda-vmm-fd:9:8192")).unwrap();
    assert_eq!(
        plan,
        RegionPlan { device_index: 1, source: RegionSource::VmmDescriptor { fd: 9, allocation_size: 8192 } }
    );
    // Ends exactly at the allocation's end: accepted; one byte past it: refused.
    let past = check(&vmm(4097, 4096, "cuda-vmm-fd:9:8192")).unwrap_err();
    assert_eq!(past.code, ReasonCode::OUT_OF_RANGE, "{past}");
    assert_eq!(check(&vmm(u64::MAX, 2, "cuda-vmm-fd:9:8192")).unwrap_err().code, ReasonCode::OUT_OF_RANGE);
    for bad in ["cuda-vmm-fd:9", "cuda-vmm-fd:-1:8192", "cuda-vmm-fd:9:0"] {
        assert_eq!(check(&vmm(0, 1, bad)).unwrap_err().code, ReasonCode::INVALID_ARGUMENT, "{bad}");
    }
    // Any other backing (a host file) is not a CUDA region's: refused, naming the three forms.
    let e = check(&vmm(0, 1, "/dev/shm/pool")).unwrap_err();
    assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
    assert!(e.message.contains("CUDA VMM descriptor"), "{e}");
}

#[test]
fn a_vmm_key_is_only_taken_from_the_instance_that_made_it() {
    let peer = EndpointWire { instance_nonce: 5, pid: 10, boot_id: [1; 16] };
    let key = VmmKeyWire {
        instance_nonce: 5,
        region_id: 1,
        device: 0,
        device_uuid: [8; 16],
        holder_pid: 10,
        socket_name: "kvgate-nvlink-x".into(),
        secret: [1; 16],
        offset_in_allocation: 0,
        len: 1,
        allocation_size: 2 << 20,
    };
    assert_eq!(route_vmm_import(&key, &peer, &[[7; 16], [8; 16]]).unwrap(), 1, "device found by UUID");
    assert_eq!(route_vmm_import(&key, &peer, &[[7; 16]]).unwrap(), 0, "unknown UUID: the first device");
    let foreign = VmmKeyWire { instance_nonce: 6, ..key };
    assert_eq!(route_vmm_import(&foreign, &peer, &[[8; 16]]).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
}

#[test]
fn malformed_regions_are_refused() {
    assert_eq!(check(&RegionDesc { len: 0, ..cuda_region() }).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    assert_eq!(check(&RegionDesc { device: -1, ..cuda_region() }).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    assert_eq!(check(&RegionDesc { device: 2, ..cuda_region() }).unwrap_err().code, ReasonCode::UNSUPPORTED_MEMORY);
    assert_eq!(check(&RegionDesc { addr: 0, ..cuda_region() }).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    let short_handle = RegionDesc { ipc_handle: vec![1u8; 63].into(), ..cuda_region() };
    assert_eq!(check(&short_handle).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
    assert_eq!(check(&RegionDesc { addr: u64::MAX, ..cuda_region() }).unwrap_err().code, ReasonCode::INVALID_ARGUMENT);
}

#[test]
fn region_limit_at_and_past() {
    check_region(&cuda_region(), &[1], 9, 10).unwrap();
    assert_eq!(check_region(&cuda_region(), &[1], 10, 10).unwrap_err().code, ReasonCode::RESOURCE_EXHAUSTED);
}

fn key(nonce: u64, pid: u32, uuid: [u8; 16]) -> RemoteKeyWire {
    RemoteKeyWire {
        instance_nonce: nonce,
        region_id: 1,
        device: 0,
        device_uuid: uuid,
        holder_pid: pid,
        holder_addr: 0x1000,
        offset_in_allocation: 0,
        len: 10,
        ipc_handle: [0; 64],
    }
}

#[test]
fn a_key_from_another_instance_than_the_peer_is_refused() {
    let local = EndpointWire { instance_nonce: 1, pid: 10, boot_id: [1; 16] };
    let peer = EndpointWire { instance_nonce: 2, pid: 20, boot_id: [1; 16] };
    let e = route_import(&key(3, 20, [0; 16]), &peer, &local, &[[0; 16]]).unwrap_err();
    assert_eq!(e.code, ReasonCode::INVALID_ARGUMENT);
    assert!(e.message.contains("foreign"), "{e}");
}

#[test]
fn a_key_from_this_process_is_used_directly() {
    let local = EndpointWire { instance_nonce: 1, pid: 10, boot_id: [1; 16] };
    let peer = EndpointWire { instance_nonce: 2, pid: 10, boot_id: [1; 16] };
    assert_eq!(route_import(&key(2, 10, [0; 16]), &peer, &local, &[[0; 16]]).unwrap(), ImportRoute::SameProcess);
}

#[test]
fn a_key_from_another_process_opens_the_handle_on_the_device_with_its_uuid() {
    let local = EndpointWire { instance_nonce: 1, pid: 10, boot_id: [1; 16] };
    let peer = EndpointWire { instance_nonce: 2, pid: 20, boot_id: [1; 16] };
    let uuids = [[0xa; 16], [0xb; 16]];
    assert_eq!(
        route_import(&key(2, 20, [0xb; 16]), &peer, &local, &uuids).unwrap(),
        ImportRoute::OpenHandle { device_index: 1 }
    );
    // A device this instance does not serve: open in the first device's context (peer access).
    assert_eq!(
        route_import(&key(2, 20, [0xc; 16]), &peer, &local, &uuids).unwrap(),
        ImportRoute::OpenHandle { device_index: 0 }
    );
}
