//! Tests call the exported functions directly, with real pointers, the way
//! nvml-wrapper does. Each test points its own thread at its own config file
//! (`state::set_test_config`) and has its own init count, so tests run in
//! parallel without sharing FAKE_NVML_CONFIG.

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_uint, c_ulong, c_ulonglong};
use std::path::{Path, PathBuf};
use std::ptr::{self, null_mut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::config::{self, BusId, PER_DEVICE_FUNCTIONS};
use crate::events::*;
use crate::exports::*;
use crate::ffi::*;
use crate::state;

// ----- fixtures -----

/// A config file for this test's thread; removed (and NVML shut down) on drop.
struct Machine {
    path: PathBuf,
}

static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

impl Machine {
    /// Writes `cfg` and points this thread at it, without nvmlInit.
    fn uninit(cfg: &Value) -> Machine {
        let path = std::env::temp_dir().join(format!(
            "fake-nvml-test-{}-{}.json",
            std::process::id(),
            NEXT_FILE.fetch_add(1, Ordering::Relaxed)
        ));
        let m = Machine { path };
        m.write(cfg);
        state::set_test_config(Some(m.path.clone()));
        m
    }

    /// Writes `cfg`, points this thread at it and calls nvmlInit_v2.
    fn new(cfg: &Value) -> Machine {
        let m = Machine::uninit(cfg);
        assert_eq!(nvmlInit_v2(), NVML_SUCCESS);
        m
    }

    /// Replaces the machine (atomically: write then rename).
    fn write(&self, cfg: &Value) {
        write_config(&self.path, cfg);
    }
}

fn write_config(path: &Path, cfg: &Value) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, cfg.to_string()).expect("write config");
    std::fs::rename(&tmp, path).expect("rename config");
}

impl Drop for Machine {
    fn drop(&mut self) {
        while nvmlShutdown() == NVML_SUCCESS {}
        state::set_test_config(None);
        let _ = std::fs::remove_file(&self.path);
    }
}

fn gpu(i: usize) -> Value {
    json!({
        "uuid": format!("GPU-{i:08x}-1111-4222-8333-444455556666"),
        "name": "NVIDIA A100-SXM4-40GB",
    })
}

/// A machine of `n` default GPUs.
fn gpus(n: usize) -> Value {
    json!({ "gpus": (0..n).map(gpu).collect::<Vec<_>>() })
}

fn with(mut base: Value, patch: Value) -> Value {
    if let (Some(b), Some(p)) = (base.as_object_mut(), patch.as_object()) {
        for (k, v) in p {
            b.insert(k.clone(), v.clone());
        }
    }
    base
}

fn handle(index: u32) -> nvmlDevice_t {
    let mut h = null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(index, &mut h) },
        NVML_SUCCESS
    );
    h
}

type StrFn = unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;

fn get_str(f: StrFn, h: nvmlDevice_t, len: usize) -> Result<String, nvmlReturn_t> {
    let mut buf = vec![0 as c_char; len];
    let r = unsafe { f(h, buf.as_mut_ptr(), len as c_uint) };
    if r != NVML_SUCCESS {
        return Err(r);
    }
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Ok(s.to_str().expect("utf-8").to_string())
}

fn name(h: nvmlDevice_t) -> Result<String, nvmlReturn_t> {
    get_str(nvmlDeviceGetName, h, 96)
}

fn uuid(h: nvmlDevice_t) -> Result<String, nvmlReturn_t> {
    get_str(nvmlDeviceGetUUID, h, 96)
}

fn sys_str(
    f: unsafe extern "C" fn(*mut c_char, c_uint) -> nvmlReturn_t,
    len: usize,
) -> Result<String, nvmlReturn_t> {
    let mut buf = vec![0 as c_char; len];
    let r = unsafe { f(buf.as_mut_ptr(), len as c_uint) };
    if r != NVML_SUCCESS {
        return Err(r);
    }
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Ok(s.to_str().expect("utf-8").to_string())
}

fn cstr_field(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8(bytes).expect("utf-8")
}

fn pci_info(h: nvmlDevice_t) -> Result<nvmlPciInfo_t, nvmlReturn_t> {
    // Garbage-filled, to see that every byte that matters is written.
    let mut p = nvmlPciInfo_t {
        busIdLegacy: [0x55; 16],
        domain: 7,
        bus: 7,
        device: 7,
        pciDeviceId: 7,
        pciSubSystemId: 7,
        busId: [0x55; 32],
    };
    match unsafe { nvmlDeviceGetPciInfo_v3(h, &mut p) } {
        NVML_SUCCESS => Ok(p),
        e => Err(e),
    }
}

fn count() -> Result<u32, nvmlReturn_t> {
    let mut n = 0;
    match unsafe { nvmlDeviceGetCount_v2(&mut n) } {
        NVML_SUCCESS => Ok(n),
        e => Err(e),
    }
}

fn configs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("configs")
}

// ----- config -----

#[test]
fn minimal_config_gets_defaults() {
    let cfg = config::parse(
        r#"{"gpus": [{"uuid": "GPU-a", "name": "X"}, {"uuid": "GPU-b", "name": "Y"}]}"#,
    )
    .expect("parses");
    assert_eq!(cfg.driver_version, "535.129.03");
    assert_eq!(cfg.cuda_driver_version, 12020);
    assert_eq!(cfg.init_error, None);
    assert!(cfg.events.is_empty());
    let g = &cfg.gpus[1];
    assert_eq!(g.minor, 1);
    assert_eq!(g.pci_bus_id.canonical(), "00000000:02:00.0");
    assert_eq!(cfg.gpus[0].pci_bus_id.canonical(), "00000000:01:00.0");
    assert_ne!(cfg.gpus[0].serial, g.serial);
    assert_eq!(g.memory_total_mib, 16384);
    assert_eq!(g.memory_used_mib, 0);
    assert_eq!(g.compute_capability, [8, 0]);
    assert_eq!(g.numa_node, 0);
    assert_eq!(g.pci_switch, None);
    assert!(g.nvlinks.is_empty());
    assert!(!g.lost && !g.mig.mode && !g.mig.pending);
    assert!(g.errors.is_empty());
    let host = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(g.cpu_affinity.len(), host);

    let empty = config::parse("{}").expect("empty object is a machine without GPUs");
    assert!(empty.gpus.is_empty());
}

#[test]
fn config_mistakes_are_errors() {
    let bad = [
        (r#"{"gpu": []}"#, "unknown field"),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "colour": 1}]}"#,
            "unknown field",
        ),
        (r#"{"gpus": [{"name": "x"}]}"#, "uuid"),
        (r#"{"init_error": "BROKEN"}"#, "unknown NVML error"),
        (r#"{"init_error": "SUCCESS"}"#, "unknown NVML error"),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "errors": {"nvmlDeviceGetFoo": "UNKNOWN"}}]}"#,
            "nvmlDeviceGetFoo",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "pci_bus_id": "07:00"}]}"#,
            "bad PCI bus id",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "nvlinks": ["zz"]}]}"#,
            "bad PCI bus id",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "cpu_affinity": "0-x"}]}"#,
            "cpu list",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "cpu_affinity": "9-3"}]}"#,
            "backwards",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x"}, {"uuid": "a", "name": "y"}]}"#,
            "duplicate uuid",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "pci_bus_id": "0000:07:00.0"},
                         {"uuid": "b", "name": "y", "pci_bus_id": "00000000:07:00.0"}]}"#,
            "also gpus[0]",
        ),
        (
            r#"{"events": [{"id": 1, "gpu_index": 0, "type": "fire"}]}"#,
            "unknown variant",
        ),
        ("not json", "expected"),
    ];
    for (text, want) in bad {
        let e = config::parse(text).expect_err(text);
        assert!(e.contains(want), "{text}: {e}");
    }
    let links =
        json!({"gpus": [{"uuid": "a", "name": "x", "nvlinks": vec!["00000000:07:00.0"; 19]}]});
    let e = config::parse(&links.to_string()).expect_err("19 links");
    assert!(e.contains("at most 18"), "{e}");
    // Both spellings of an error name.
    let ok = config::parse(r#"{"init_error": "NVML_ERROR_NO_PERMISSION"}"#).expect("prefixed name");
    assert_eq!(ok.init_error.map(|e| e.0), Some(4));
}

#[test]
fn bus_ids_and_cpu_lists_parse() {
    let b = BusId::parse("0000:4e:00.0").expect("legacy lowercase");
    assert_eq!(b, BusId::parse("00000000:4E:00.0").expect("canonical"));
    assert_eq!(b.canonical(), "00000000:4E:00.0");
    assert_eq!(b.legacy(), "0000:4E:00.0");
    assert_eq!(BusId::parse("00000000:4E:20.0"), None); // device < 32
    assert_eq!(BusId::parse("00000000:4E:00.8"), None); // function < 8
    assert_eq!(BusId::parse("000000000:4E:00.0"), None); // 9-digit domain
    assert_eq!(config::parse_cpu_list(""), Ok(vec![]));
    assert_eq!(config::parse_cpu_list("3, 0-1,1"), Ok(vec![0, 1, 3]));
}

#[test]
fn example_configs_parse() {
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(configs_dir()).expect("configs/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "json") {
            config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen.push(path.file_name().map(|n| n.to_string_lossy().into_owned()));
        }
    }
    for want in ["dgx-a100.json", "mixed.json", "none.json", "mig.json"] {
        assert!(seen.contains(&Some(want.to_string())), "{want} missing");
    }
}

#[test]
fn dgx_a100_is_fully_nvlinked_and_realistic() {
    let cfg = config::load(&configs_dir().join("dgx-a100.json")).expect("dgx-a100.json");
    assert_eq!(cfg.driver_version, "535.129.03");
    assert_eq!(cfg.cuda_driver_version, 12020);
    assert_eq!(cfg.gpus.len(), 8);
    let buses: Vec<u32> = cfg.gpus.iter().map(|g| g.pci_bus_id.bus).collect();
    assert_eq!(buses, [0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD]);
    for (i, g) in cfg.gpus.iter().enumerate() {
        assert_eq!(g.name, "NVIDIA A100-SXM4-40GB");
        assert_eq!(g.minor as usize, i);
        assert_eq!(g.compute_capability, [8, 0]);
        assert_eq!(g.uuid.len(), 40, "{}", g.uuid);
        assert!(g.uuid.starts_with("GPU-"));
        assert_eq!(g.nvlinks.len(), 12);
        for (j, peer) in cfg.gpus.iter().enumerate() {
            let n = |a: &config::Gpu, b: &config::Gpu| {
                a.nvlinks.iter().filter(|r| **r == b.pci_bus_id).count()
            };
            if i == j {
                assert_eq!(n(g, peer), 0, "GPU {i} links to itself");
            } else {
                assert!(n(g, peer) >= 1, "GPU {i} and {j} not connected");
                assert_eq!(n(g, peer), n(peer, g), "links {i}<->{j} asymmetric");
            }
        }
    }
    let uuids: std::collections::BTreeSet<_> = cfg.gpus.iter().map(|g| &g.uuid).collect();
    let serials: std::collections::BTreeSet<_> = cfg.gpus.iter().map(|g| &g.serial).collect();
    assert_eq!((uuids.len(), serials.len()), (8, 8));
    // Pairs share a PCIe switch and a NUMA node.
    for pair in cfg.gpus.chunks(2) {
        assert_eq!(pair[0].pci_switch, pair[1].pci_switch);
        assert_eq!(pair[0].numa_node, pair[1].numa_node);
    }
}

#[test]
fn mixed_and_none_are_what_they_say() {
    let cfg = config::load(&configs_dir().join("mixed.json")).expect("mixed.json");
    let names: Vec<&str> = cfg.gpus.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "Tesla V100-SXM2-16GB",
            "Tesla V100-SXM2-16GB",
            "Tesla T4",
            "Tesla T4"
        ]
    );
    assert_eq!(cfg.gpus[0].nvlinks, vec![cfg.gpus[1].pci_bus_id; 2]);
    assert_eq!(cfg.gpus[1].nvlinks, vec![cfg.gpus[0].pci_bus_id; 2]);
    assert!(cfg.gpus[2].nvlinks.is_empty() && cfg.gpus[3].nvlinks.is_empty());
    assert_eq!(cfg.gpus[2].memory_total_mib, 15360);
    assert_eq!(cfg.gpus[2].compute_capability, [7, 5]);
    assert_eq!(cfg.gpus[0].compute_capability, [7, 0]);
    assert!(cfg.gpus.iter().all(|g| g.numa_node == 0));
    assert_ne!(cfg.gpus[2].pci_switch, cfg.gpus[3].pci_switch);

    let none = config::load(&configs_dir().join("none.json")).expect("none.json");
    assert!(none.gpus.is_empty());
    let _m = Machine::new(
        &serde_json::from_str::<Value>(
            &std::fs::read_to_string(configs_dir().join("none.json")).expect("read"),
        )
        .expect("json"),
    );
    assert_eq!(count(), Ok(0));
}

// ----- init, shutdown, config file -----

#[test]
fn calls_before_init_are_uninitialized_and_shutdown_counts() {
    let _m = Machine::uninit(&gpus(1));
    assert_eq!(count(), Err(NVML_ERROR_UNINITIALIZED));
    assert_eq!(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
    let mut h = null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(0, &mut h) },
        NVML_ERROR_UNINITIALIZED
    );
    assert_eq!(
        sys_str(nvmlSystemGetDriverVersion, 80),
        Err(NVML_ERROR_UNINITIALIZED)
    );
    let mut set = null_mut();
    assert_eq!(
        unsafe { nvmlEventSetCreate(&mut set) },
        NVML_ERROR_UNINITIALIZED
    );

    assert_eq!(nvmlInit_v2(), NVML_SUCCESS);
    assert_eq!(nvmlInitWithFlags(0), NVML_SUCCESS);
    assert_eq!(count(), Ok(1));
    assert_eq!(nvmlShutdown(), NVML_SUCCESS);
    assert_eq!(count(), Ok(1), "one reference left");
    assert_eq!(nvmlShutdown(), NVML_SUCCESS);
    assert_eq!(count(), Err(NVML_ERROR_UNINITIALIZED));
    assert_eq!(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
}

#[test]
fn init_error_is_returned_by_both_inits() {
    let m = Machine::uninit(&with(gpus(1), json!({"init_error": "DRIVER_NOT_LOADED"})));
    assert_eq!(nvmlInit_v2(), 9);
    assert_eq!(nvmlInitWithFlags(1), 9);
    assert_eq!(
        count(),
        Err(NVML_ERROR_UNINITIALIZED),
        "a failed init holds nothing"
    );
    m.write(&with(
        gpus(1),
        json!({"init_error": "LIB_RM_VERSION_MISMATCH"}),
    ));
    assert_eq!(nvmlInit_v2(), 18);
    m.write(&with(gpus(1), json!({"init_error": "NO_PERMISSION"})));
    assert_eq!(nvmlInitWithFlags(0), 4);
    m.write(&with(gpus(1), json!({"init_error": null})));
    assert_eq!(nvmlInit_v2(), NVML_SUCCESS);
}

#[test]
fn missing_or_bad_config_is_unknown() {
    let m = Machine::uninit(&gpus(1));
    state::set_test_config(Some(
        m.path.with_file_name("fake-nvml-test-does-not-exist.json"),
    ));
    assert_eq!(nvmlInit_v2(), NVML_ERROR_UNKNOWN);
    assert_eq!(nvmlInitWithFlags(0), NVML_ERROR_UNKNOWN);

    state::set_test_config(Some(m.path.clone()));
    std::fs::write(&m.path, "{ not json").expect("write");
    assert_eq!(nvmlInit_v2(), NVML_ERROR_UNKNOWN);

    // Initialized, then the file goes bad: calls answer UNKNOWN.
    m.write(&gpus(1));
    assert_eq!(nvmlInit_v2(), NVML_SUCCESS);
    std::fs::write(&m.path, r#"{"gpus": 3}"#).expect("write");
    assert_eq!(count(), Err(NVML_ERROR_UNKNOWN));
    m.write(&gpus(2));
    assert_eq!(count(), Ok(2));
}

/// The only test that uses the FAKE_NVML_CONFIG variable itself; every other
/// test sets a per-thread path, which takes precedence.
#[test]
fn config_path_comes_from_the_environment() {
    let m = Machine::uninit(&gpus(3));
    state::set_test_config(None);
    std::env::remove_var(state::CONFIG_ENV);
    assert_eq!(nvmlInit_v2(), NVML_ERROR_UNKNOWN);
    std::env::set_var(state::CONFIG_ENV, &m.path);
    assert_eq!(nvmlInit_v2(), NVML_SUCCESS);
    assert_eq!(count(), Ok(3));
    std::env::remove_var(state::CONFIG_ENV);
}

#[test]
fn error_strings_cover_every_code() {
    for (code, short, msg) in RETURN_CODES {
        let s = unsafe { CStr::from_ptr(nvmlErrorString(*code)) };
        assert_eq!(s, *msg, "{short}");
        assert!(!s.is_empty());
    }
    let lost = unsafe { CStr::from_ptr(nvmlErrorString(NVML_ERROR_GPU_IS_LOST)) };
    assert_eq!(lost.to_str(), Ok("GPU is lost"));
    let odd = unsafe { CStr::from_ptr(nvmlErrorString(12345)) };
    assert_eq!(odd.to_str(), Ok("Unknown Error"));
}

// ----- system -----

#[test]
fn system_versions_and_string_sizes() {
    let _m = Machine::new(&with(
        gpus(0),
        json!({"driver_version": "550.54.15", "cuda_driver_version": 12040}),
    ));
    assert_eq!(
        sys_str(nvmlSystemGetDriverVersion, 80).as_deref(),
        Ok("550.54.15")
    );
    assert_eq!(
        sys_str(nvmlSystemGetNVMLVersion, 80).as_deref(),
        Ok("12.550.54.15")
    );
    // Exactly the string without room for its NUL: too small.
    assert_eq!(
        sys_str(nvmlSystemGetDriverVersion, 9),
        Err(NVML_ERROR_INSUFFICIENT_SIZE)
    );
    assert_eq!(
        sys_str(nvmlSystemGetDriverVersion, 10).as_deref(),
        Ok("550.54.15")
    );
    assert_eq!(
        unsafe { nvmlSystemGetDriverVersion(null_mut(), 80) },
        NVML_ERROR_INVALID_ARGUMENT
    );
    let mut v: c_int = 0;
    assert_eq!(
        unsafe { nvmlSystemGetCudaDriverVersion_v2(&mut v) },
        NVML_SUCCESS
    );
    assert_eq!(v, 12040);
    v = 0;
    assert_eq!(
        unsafe { nvmlSystemGetCudaDriverVersion(&mut v) },
        NVML_SUCCESS
    );
    assert_eq!(v, 12040);
    assert_eq!(
        unsafe { nvmlSystemGetCudaDriverVersion_v2(null_mut()) },
        NVML_ERROR_INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetCount_v2(null_mut()) },
        NVML_ERROR_INVALID_ARGUMENT
    );
}

// ----- handles -----

#[test]
fn handles_by_index_uuid_and_bus_id() {
    let mut cfg = gpus(3);
    cfg["gpus"][2]["pci_bus_id"] = json!("00000000:4E:00.0");
    let _m = Machine::new(&cfg);
    assert_eq!(count(), Ok(3));
    let hs: Vec<nvmlDevice_t> = (0..3).map(handle).collect();
    assert!(hs.iter().all(|h| !h.is_null()));
    assert_ne!(hs[0], hs[1]);
    for (i, h) in hs.iter().enumerate() {
        let mut idx: c_uint = 99;
        assert_eq!(unsafe { nvmlDeviceGetIndex(*h, &mut idx) }, NVML_SUCCESS);
        assert_eq!(idx as usize, i);
        assert_eq!(
            uuid(*h),
            Ok(cfg["gpus"][i]["uuid"].as_str().expect("uuid").to_string())
        );
    }
    let mut h = null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(3, &mut h) },
        NVML_ERROR_INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(0, null_mut()) },
        NVML_ERROR_INVALID_ARGUMENT
    );

    let u = CString::new(cfg["gpus"][1]["uuid"].as_str().expect("uuid")).expect("cstring");
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(u.as_ptr(), &mut h) },
        NVML_SUCCESS
    );
    assert_eq!(h, hs[1]);
    let nope = CString::new("GPU-nope").expect("cstring");
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(nope.as_ptr(), &mut h) },
        NVML_ERROR_NOT_FOUND
    );
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(ptr::null(), &mut h) },
        NVML_ERROR_INVALID_ARGUMENT
    );

    for spelling in ["00000000:4E:00.0", "0000:4e:00.0"] {
        let b = CString::new(spelling).expect("cstring");
        h = null_mut();
        assert_eq!(
            unsafe { nvmlDeviceGetHandleByPciBusId_v2(b.as_ptr(), &mut h) },
            NVML_SUCCESS,
            "{spelling}"
        );
        assert_eq!(h, hs[2]);
    }
    let b = CString::new("00000000:99:00.0").expect("cstring");
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(b.as_ptr(), &mut h) },
        NVML_ERROR_NOT_FOUND
    );
    let b = CString::new("bogus").expect("cstring");
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(b.as_ptr(), &mut h) },
        NVML_ERROR_INVALID_ARGUMENT
    );

    // Handles that are not ours.
    assert_eq!(name(null_mut()), Err(NVML_ERROR_INVALID_ARGUMENT));
    assert_eq!(
        name(ptr::without_provenance_mut(0x1234)),
        Err(NVML_ERROR_INVALID_ARGUMENT)
    );
}

#[test]
fn handle_of_a_gpu_gone_from_the_config_is_lost() {
    let m = Machine::new(&gpus(2));
    let h1 = handle(1);
    assert!(name(h1).is_ok());
    m.write(&gpus(1));
    assert_eq!(count(), Ok(1));
    assert_eq!(name(h1), Err(NVML_ERROR_GPU_IS_LOST));
    assert_eq!(uuid(h1), Err(NVML_ERROR_GPU_IS_LOST));
}

#[test]
fn config_is_reread_on_every_call() {
    let mut cfg = gpus(1);
    let m = Machine::new(&cfg);
    let h = handle(0);
    assert_eq!(name(h).as_deref(), Ok("NVIDIA A100-SXM4-40GB"));
    cfg["gpus"][0]["name"] = json!("Tesla T4");
    cfg["gpus"][0]["temperature_c"] = json!(87);
    m.write(&cfg);
    assert_eq!(name(h).as_deref(), Ok("Tesla T4"));
    let mut t = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU, &mut t) },
        NVML_SUCCESS
    );
    assert_eq!(t, 87);
    m.write(&gpus(4));
    assert_eq!(count(), Ok(4));
}

// ----- per-device queries -----

#[test]
fn device_queries_answer_from_the_config() {
    let mut cfg = gpus(2);
    cfg["gpus"][1] = json!({
        "uuid": "GPU-2f6c1e4e-0000-4000-8000-000000000001",
        "name": "NVIDIA A100-SXM4-40GB",
        "serial": "1562720012345",
        "memory_total_mib": 40960, "memory_used_mib": 1024,
        "minor": 5, "pci_bus_id": "00000000:0F:00.0", "pci_device_id": 0x20B0_10DE_u32,
        "numa_node": 1, "cpu_affinity": "0-31,64-95,130",
        "compute_capability": [9, 0],
        "utilization_gpu_pct": 42, "utilization_memory_pct": 17,
        "temperature_c": 34, "power_mw": 61000,
        "mig_enabled": true,
    });
    let _m = Machine::new(&cfg);
    let h = handle(1);
    assert_eq!(
        get_str(nvmlDeviceGetSerial, h, 30).as_deref(),
        Ok("1562720012345")
    );

    let mut mem = nvmlMemory_t {
        total: 1,
        free: 1,
        used: 1,
    };
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo(h, &mut mem) },
        NVML_SUCCESS
    );
    assert_eq!(mem.total, 40960 << 20);
    assert_eq!(mem.used, 1024 << 20);
    assert_eq!(mem.free, (40960 - 1024) << 20);

    let mut m2 = nvmlMemory_v2_t {
        version: nvmlMemory_v2,
        total: 1,
        reserved: 1,
        free: 1,
        used: 1,
    };
    assert_eq!(nvmlMemory_v2, 0x0200_0028);
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo_v2(h, &mut m2) },
        NVML_SUCCESS
    );
    assert_eq!(
        (m2.total, m2.used, m2.free, m2.reserved),
        (mem.total, mem.used, mem.free, 0)
    );
    assert_eq!(m2.version, nvmlMemory_v2);
    m2.version = 1;
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo_v2(h, &mut m2) },
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    );

    let mut minor = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetMinorNumber(h, &mut minor) },
        NVML_SUCCESS
    );
    assert_eq!(minor, 5);

    let p = pci_info(h).expect("pci info");
    assert_eq!(cstr_field(&p.busId), "00000000:0F:00.0");
    assert_eq!(cstr_field(&p.busIdLegacy), "0000:0F:00.0");
    assert_eq!((p.domain, p.bus, p.device), (0, 0x0F, 0));
    assert_eq!(p.pciDeviceId, 0x20B0_10DE);
    assert_eq!(p.pciSubSystemId, 0);

    let mut cpus: [c_ulong; 3] = [!0; 3];
    assert_eq!(
        unsafe { nvmlDeviceGetCpuAffinity(h, 3, cpus.as_mut_ptr()) },
        NVML_SUCCESS
    );
    assert_eq!(cpus, [0xFFFF_FFFF, 0xFFFF_FFFF, 1 << 2]);
    let mut one: [c_ulong; 2] = [7, 7];
    assert_eq!(
        unsafe { nvmlDeviceGetCpuAffinity(h, 1, one.as_mut_ptr()) },
        NVML_SUCCESS
    );
    assert_eq!(one, [0xFFFF_FFFF, 7], "only cpuSetSize words are written");
    assert_eq!(
        unsafe { nvmlDeviceGetCpuAffinity(h, 0, one.as_mut_ptr()) },
        NVML_ERROR_INSUFFICIENT_SIZE
    );

    let mut node = 9;
    assert_eq!(
        unsafe { nvmlDeviceGetNumaNodeId(h, &mut node) },
        NVML_SUCCESS
    );
    assert_eq!(node, 1);

    let (mut major, mut minor_cc) = (0, 0);
    assert_eq!(
        unsafe { nvmlDeviceGetCudaComputeCapability(h, &mut major, &mut minor_cc) },
        NVML_SUCCESS
    );
    assert_eq!((major, minor_cc), (9, 0));

    let mut u = nvmlUtilization_t { gpu: 0, memory: 0 };
    assert_eq!(
        unsafe { nvmlDeviceGetUtilizationRates(h, &mut u) },
        NVML_SUCCESS
    );
    assert_eq!((u.gpu, u.memory), (42, 17));

    let mut t = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU, &mut t) },
        NVML_SUCCESS
    );
    assert_eq!(t, 34);
    assert_eq!(
        unsafe { nvmlDeviceGetTemperature(h, 1, &mut t) },
        NVML_ERROR_INVALID_ARGUMENT
    );

    let mut mw = 0;
    assert_eq!(unsafe { nvmlDeviceGetPowerUsage(h, &mut mw) }, NVML_SUCCESS);
    assert_eq!(mw, 61000);

    let (mut cur, mut pend) = (9, 9);
    assert_eq!(
        unsafe { nvmlDeviceGetMigMode(h, &mut cur, &mut pend) },
        NVML_SUCCESS
    );
    assert_eq!(
        (cur, pend),
        (NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE)
    );
    assert_eq!(
        unsafe { nvmlDeviceGetMigMode(handle(0), &mut cur, &mut pend) },
        NVML_SUCCESS
    );
    assert_eq!(
        (cur, pend),
        (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_DISABLE)
    );

    let mut ev: c_ulonglong = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetSupportedEventTypes(h, &mut ev) },
        NVML_SUCCESS
    );
    assert_eq!(ev, 1 | 2 | 4 | 8 | 16);
}

#[test]
fn string_outputs_honour_the_callers_length() {
    let mut cfg = gpus(1);
    cfg["gpus"][0]["serial"] = json!("12345");
    let _m = Machine::new(&cfg);
    let h = handle(0);
    let u = uuid(h).expect("uuid");
    let n = name(h).expect("name");
    for (f, s) in [
        (nvmlDeviceGetUUID as StrFn, u.as_str()),
        (nvmlDeviceGetName, n.as_str()),
        (nvmlDeviceGetSerial, "12345"),
    ] {
        assert_eq!(
            get_str(f, h, s.len()),
            Err(NVML_ERROR_INSUFFICIENT_SIZE),
            "{s}"
        );
        assert_eq!(get_str(f, h, 0), Err(NVML_ERROR_INSUFFICIENT_SIZE), "{s}");
        assert_eq!(get_str(f, h, s.len() + 1).as_deref(), Ok(s));
        assert_eq!(unsafe { f(h, null_mut(), 96) }, NVML_ERROR_INVALID_ARGUMENT);
    }
    // Too small leaves the buffer alone.
    let mut buf = [0x41 as c_char; 4];
    assert_eq!(
        unsafe { nvmlDeviceGetSerial(h, buf.as_mut_ptr(), 4) },
        NVML_ERROR_INSUFFICIENT_SIZE
    );
    assert_eq!(buf, [0x41; 4]);
}

#[test]
fn null_out_pointers_are_invalid_arguments() {
    let _m = Machine::new(&gpus(2));
    let h = handle(0);
    let e = NVML_ERROR_INVALID_ARGUMENT;
    unsafe {
        assert_eq!(nvmlDeviceGetIndex(h, null_mut()), e);
        assert_eq!(nvmlDeviceGetMemoryInfo(h, null_mut()), e);
        assert_eq!(nvmlDeviceGetMemoryInfo_v2(h, null_mut()), e);
        assert_eq!(nvmlDeviceGetMinorNumber(h, null_mut()), e);
        assert_eq!(nvmlDeviceGetPciInfo_v3(h, null_mut()), e);
        assert_eq!(nvmlDeviceGetCpuAffinity(h, 2, null_mut()), e);
        assert_eq!(nvmlDeviceGetNumaNodeId(h, null_mut()), e);
        let mut i: c_int = 0;
        assert_eq!(nvmlDeviceGetCudaComputeCapability(h, &mut i, null_mut()), e);
        assert_eq!(nvmlDeviceGetCudaComputeCapability(h, null_mut(), &mut i), e);
        assert_eq!(nvmlDeviceGetUtilizationRates(h, null_mut()), e);
        assert_eq!(nvmlDeviceGetTemperature(h, 0, null_mut()), e);
        assert_eq!(nvmlDeviceGetPowerUsage(h, null_mut()), e);
        let mut u: c_uint = 0;
        assert_eq!(nvmlDeviceGetMigMode(h, &mut u, null_mut()), e);
        assert_eq!(
            nvmlDeviceGetTopologyCommonAncestor(h, handle(1), null_mut()),
            e
        );
        assert_eq!(nvmlDeviceGetNvLinkState(h, 0, null_mut()), e);
        assert_eq!(nvmlDeviceGetNvLinkRemotePciInfo_v2(h, 0, null_mut()), e);
        assert_eq!(nvmlDeviceGetSupportedEventTypes(h, null_mut()), e);
        assert_eq!(nvmlEventSetCreate(null_mut()), e);
        assert_eq!(nvmlEventSetWait_v2(null_mut(), null_mut(), 0), e);
        let mut data = std::mem::zeroed::<nvmlEventData_t>();
        assert_eq!(nvmlEventSetWait_v2(null_mut(), &mut data, 0), e);
        assert_eq!(nvmlEventSetFree(null_mut()), e);
        assert_eq!(nvmlDeviceRegisterEvents(h, 8, null_mut()), e);
    }
}

// ----- NVLink and topology -----

#[test]
fn nvlink_state_and_remote_pci_info() {
    let mut cfg = gpus(3);
    cfg["gpus"][0]["pci_bus_id"] = json!("00000000:07:00.0");
    cfg["gpus"][1]["pci_bus_id"] = json!("00000000:0F:00.0");
    cfg["gpus"][1]["pci_device_id"] = json!(0x1DB1_10DE_u32);
    cfg["gpus"][0]["nvlinks"] = json!(["00000000:0F:00.0", "00000000:0F:00.0", "0001:a0:1f.0"]);
    cfg["gpus"][1]["nvlinks"] = json!(["00000000:07:00.0", "00000000:07:00.0"]);
    let _m = Machine::new(&cfg);
    let (h0, h2) = (handle(0), handle(2));
    let state = |h, link| {
        let mut s = 77;
        match unsafe { nvmlDeviceGetNvLinkState(h, link, &mut s) } {
            NVML_SUCCESS => Ok(s),
            e => Err(e),
        }
    };
    let remote = |h, link| {
        let mut p = unsafe { std::mem::zeroed::<nvmlPciInfo_t>() };
        match unsafe { nvmlDeviceGetNvLinkRemotePciInfo_v2(h, link, &mut p) } {
            NVML_SUCCESS => Ok(p),
            e => Err(e),
        }
    };
    for link in 0..3 {
        assert_eq!(state(h0, link), Ok(NVML_FEATURE_ENABLED), "link {link}");
    }
    for link in 3..18 {
        assert_eq!(state(h0, link), Ok(NVML_FEATURE_DISABLED), "link {link}");
        assert_eq!(
            remote(h0, link).map(|_| ()),
            Err(NVML_ERROR_INVALID_ARGUMENT)
        );
    }
    assert_eq!(state(h0, 18), Err(NVML_ERROR_INVALID_ARGUMENT));
    assert_eq!(remote(h0, 18).map(|_| ()), Err(NVML_ERROR_INVALID_ARGUMENT));

    let p = remote(h0, 1).expect("link 1");
    assert_eq!(cstr_field(&p.busId), "00000000:0F:00.0");
    assert_eq!(cstr_field(&p.busIdLegacy), "0000:0F:00.0");
    assert_eq!((p.domain, p.bus, p.device), (0, 0x0F, 0));
    assert_eq!(p.pciDeviceId, 0x1DB1_10DE, "the peer GPU's device id");
    assert_eq!(p.pciSubSystemId, 0);
    // A remote that is not a GPU of this machine (an NVSwitch, say).
    let p = remote(h0, 2).expect("link 2");
    assert_eq!(cstr_field(&p.busId), "00000001:A0:1F.0");
    assert_eq!(
        (p.domain, p.bus, p.device, p.pciDeviceId),
        (1, 0xA0, 0x1F, 0)
    );

    // No NVLink at all.
    assert_eq!(state(h2, 0), Err(NVML_ERROR_NOT_SUPPORTED));
    assert_eq!(remote(h2, 0).map(|_| ()), Err(NVML_ERROR_NOT_SUPPORTED));
}

#[test]
fn topology_levels() {
    let mut cfg = gpus(5);
    let place = [("sw0", 0), ("sw0", 0), ("sw1", 0), ("sw2", 1), ("", 0)];
    for (i, (sw, node)) in place.iter().enumerate() {
        cfg["gpus"][i]["pci_switch"] = json!(sw);
        cfg["gpus"][i]["numa_node"] = json!(node);
    }
    let _m = Machine::new(&cfg);
    let level = |a, b| {
        let mut l = 99;
        let r = unsafe { nvmlDeviceGetTopologyCommonAncestor(handle(a), handle(b), &mut l) };
        assert_eq!(r, NVML_SUCCESS);
        l
    };
    assert_eq!(level(0, 0), NVML_TOPOLOGY_INTERNAL);
    assert_eq!(level(0, 1), NVML_TOPOLOGY_SINGLE);
    assert_eq!(level(1, 0), NVML_TOPOLOGY_SINGLE);
    assert_eq!(level(0, 2), NVML_TOPOLOGY_NODE);
    assert_eq!(level(0, 3), NVML_TOPOLOGY_SYSTEM);
    assert_eq!(level(3, 2), NVML_TOPOLOGY_SYSTEM);
    assert_eq!(level(4, 0), NVML_TOPOLOGY_NODE);

    // Two GPUs without a switch do not share one.
    let mut cfg = gpus(2);
    cfg["gpus"][0]["pci_switch"] = json!("");
    let m2 = Machine::new(&cfg);
    assert_eq!(level(0, 1), NVML_TOPOLOGY_NODE);
    drop(m2);
}

// ----- lost GPUs and error overrides -----

#[test]
fn a_lost_gpu_keeps_only_its_identity() {
    let mut cfg = gpus(2);
    cfg["gpus"][1]["lost"] = json!(true);
    cfg["gpus"][1]["pci_bus_id"] = json!("00000000:47:00.0");
    cfg["gpus"][1]["nvlinks"] = json!(["00000000:01:00.0"]);
    let _m = Machine::new(&cfg);
    assert_eq!(count(), Ok(2));
    let h = handle(1);
    let mut h2 = null_mut();
    let u = CString::new(cfg["gpus"][1]["uuid"].as_str().expect("uuid")).expect("cstring");
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByUUID(u.as_ptr(), &mut h2) },
        NVML_SUCCESS
    );
    assert_eq!(h2, h);
    assert_eq!(uuid(h).ok().as_deref(), cfg["gpus"][1]["uuid"].as_str());
    let mut idx = 0;
    assert_eq!(unsafe { nvmlDeviceGetIndex(h, &mut idx) }, NVML_SUCCESS);
    assert_eq!(idx, 1);
    let p = pci_info(h).expect("pci info of a lost GPU");
    assert_eq!(cstr_field(&p.busId), "00000000:47:00.0");

    let lost = NVML_ERROR_GPU_IS_LOST;
    let b = CString::new("00000000:47:00.0").expect("cstring");
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(b.as_ptr(), &mut h2) },
        lost
    );
    assert_eq!(name(h), Err(lost));
    assert_eq!(get_str(nvmlDeviceGetSerial, h, 30), Err(lost));
    unsafe {
        let mut mem = std::mem::zeroed::<nvmlMemory_v2_t>();
        mem.version = nvmlMemory_v2;
        assert_eq!(nvmlDeviceGetMemoryInfo_v2(h, &mut mem), lost);
        let mut u: c_uint = 0;
        let mut i: c_int = 0;
        assert_eq!(nvmlDeviceGetMinorNumber(h, &mut u), lost);
        assert_eq!(nvmlDeviceGetNumaNodeId(h, &mut u), lost);
        assert_eq!(nvmlDeviceGetCudaComputeCapability(h, &mut i, &mut i), lost);
        assert_eq!(nvmlDeviceGetPowerUsage(h, &mut u), lost);
        assert_eq!(nvmlDeviceGetTemperature(h, 0, &mut u), lost);
        assert_eq!(nvmlDeviceGetNvLinkState(h, 0, &mut u), lost);
        assert_eq!(
            nvmlDeviceGetTopologyCommonAncestor(handle(0), h, &mut u),
            lost
        );
        let mut set = null_mut();
        assert_eq!(nvmlEventSetCreate(&mut set), NVML_SUCCESS);
        assert_eq!(nvmlDeviceRegisterEvents(h, 8, set), lost);
        assert_eq!(nvmlEventSetFree(set), NVML_SUCCESS);
    }
    // The other GPU is fine.
    assert!(name(handle(0)).is_ok());
}

/// Calls per-device function `func` on GPU 0 (and GPU 1 where it takes two)
/// with valid arguments.
fn call(func: &str, cfg: &Value) -> nvmlReturn_t {
    // Not `handle(0)`: nvmlDeviceGetHandleByIndex_v2 may be the one failing.
    let h = state::handle_for(0);
    let mut u: c_uint = 0;
    let mut i: c_int = 0;
    let mut ull: c_ulonglong = 0;
    let mut buf = [0 as c_char; 96];
    let mut pci = unsafe { std::mem::zeroed::<nvmlPciInfo_t>() };
    let mut dev = null_mut();
    unsafe {
        match func {
            "nvmlDeviceGetHandleByIndex_v2" => nvmlDeviceGetHandleByIndex_v2(0, &mut dev),
            "nvmlDeviceGetHandleByUUID" => {
                let s = CString::new(cfg["gpus"][0]["uuid"].as_str().unwrap_or("")).expect("c");
                nvmlDeviceGetHandleByUUID(s.as_ptr(), &mut dev)
            }
            "nvmlDeviceGetHandleByPciBusId_v2" => {
                let s = CString::new("00000000:01:00.0").expect("c");
                nvmlDeviceGetHandleByPciBusId_v2(s.as_ptr(), &mut dev)
            }
            "nvmlDeviceGetIndex" => nvmlDeviceGetIndex(h, &mut u),
            "nvmlDeviceGetName" => nvmlDeviceGetName(h, buf.as_mut_ptr(), 96),
            "nvmlDeviceGetUUID" => nvmlDeviceGetUUID(h, buf.as_mut_ptr(), 96),
            "nvmlDeviceGetSerial" => nvmlDeviceGetSerial(h, buf.as_mut_ptr(), 30),
            "nvmlDeviceGetMemoryInfo" => {
                let mut m = std::mem::zeroed::<nvmlMemory_t>();
                nvmlDeviceGetMemoryInfo(h, &mut m)
            }
            "nvmlDeviceGetMemoryInfo_v2" => {
                let mut m = std::mem::zeroed::<nvmlMemory_v2_t>();
                m.version = nvmlMemory_v2;
                nvmlDeviceGetMemoryInfo_v2(h, &mut m)
            }
            "nvmlDeviceGetMinorNumber" => nvmlDeviceGetMinorNumber(h, &mut u),
            "nvmlDeviceGetPciInfo_v3" => nvmlDeviceGetPciInfo_v3(h, &mut pci),
            "nvmlDeviceGetCpuAffinity" => {
                let mut set: [c_ulong; 4] = [0; 4];
                nvmlDeviceGetCpuAffinity(h, 4, set.as_mut_ptr())
            }
            "nvmlDeviceGetNumaNodeId" => nvmlDeviceGetNumaNodeId(h, &mut u),
            "nvmlDeviceGetCudaComputeCapability" => {
                let mut j: c_int = 0;
                nvmlDeviceGetCudaComputeCapability(h, &mut i, &mut j)
            }
            "nvmlDeviceGetUtilizationRates" => {
                let mut x = nvmlUtilization_t { gpu: 0, memory: 0 };
                nvmlDeviceGetUtilizationRates(h, &mut x)
            }
            "nvmlDeviceGetTemperature" => nvmlDeviceGetTemperature(h, 0, &mut u),
            "nvmlDeviceGetPowerUsage" => nvmlDeviceGetPowerUsage(h, &mut u),
            "nvmlDeviceGetMigMode" => {
                let mut p: c_uint = 0;
                nvmlDeviceGetMigMode(h, &mut u, &mut p)
            }
            "nvmlDeviceGetTopologyCommonAncestor" => {
                nvmlDeviceGetTopologyCommonAncestor(h, state::handle_for(1), &mut u)
            }
            "nvmlDeviceGetNvLinkState" => nvmlDeviceGetNvLinkState(h, 0, &mut u),
            "nvmlDeviceGetNvLinkRemotePciInfo_v2" => {
                nvmlDeviceGetNvLinkRemotePciInfo_v2(h, 0, &mut pci)
            }
            "nvmlDeviceRegisterEvents" => {
                let mut set = null_mut();
                assert_eq!(nvmlEventSetCreate(&mut set), NVML_SUCCESS);
                let r = nvmlDeviceRegisterEvents(h, 8, set);
                assert_eq!(nvmlEventSetFree(set), NVML_SUCCESS);
                r
            }
            "nvmlDeviceGetSupportedEventTypes" => nvmlDeviceGetSupportedEventTypes(h, &mut ull),
            "nvmlDeviceGetComputeRunningProcesses_v3" => {
                nvmlDeviceGetComputeRunningProcesses_v3(h, &mut u, null_mut())
            }
            "nvmlDeviceGetMPSComputeRunningProcesses_v3" => {
                nvmlDeviceGetMPSComputeRunningProcesses_v3(h, &mut u, null_mut())
            }
            // No process has a sample here: NOT_FOUND is its answer
            // without an override.
            "nvmlDeviceGetProcessUtilization" => {
                match nvmlDeviceGetProcessUtilization(h, null_mut(), &mut u, 0) {
                    NVML_ERROR_NOT_FOUND => NVML_SUCCESS,
                    r => r,
                }
            }
            other => panic!("no call for {other}"),
        }
    }
}

#[test]
fn every_per_device_function_honours_its_error_override() {
    let mut base = gpus(2);
    base["gpus"][0]["pci_bus_id"] = json!("00000000:01:00.0");
    base["gpus"][0]["nvlinks"] = json!(["00000000:02:00.0"]);
    let m = Machine::new(&base);
    for func in PER_DEVICE_FUNCTIONS {
        m.write(&base);
        assert_eq!(call(func, &base), NVML_SUCCESS, "{func} without override");
        let mut cfg = base.clone();
        cfg["gpus"][0]["errors"] = json!({ *func: "IN_USE" });
        m.write(&cfg);
        assert_eq!(call(func, &cfg), 19, "{func} with override");
    }
}

#[test]
fn an_override_hits_only_its_gpu_and_function() {
    let mut cfg = gpus(2);
    cfg["gpus"][0]["errors"] = json!({"nvmlDeviceGetPowerUsage": "NOT_SUPPORTED"});
    let _m = Machine::new(&cfg);
    let mut mw = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetPowerUsage(handle(0), &mut mw) },
        NVML_ERROR_NOT_SUPPORTED
    );
    assert_eq!(
        unsafe { nvmlDeviceGetPowerUsage(handle(1), &mut mw) },
        NVML_SUCCESS
    );
    assert!(name(handle(0)).is_ok());
}

// ----- processes -----

type ProcFn =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> nvmlReturn_t;

/// Sizes the list, then reads it with exactly that much room, as NVML's
/// callers do.
fn processes(f: ProcFn, h: nvmlDevice_t) -> Result<Vec<nvmlProcessInfo_t>, nvmlReturn_t> {
    let mut n: c_uint = 0;
    match unsafe { f(h, &mut n, null_mut()) } {
        NVML_SUCCESS => return Ok(Vec::new()),
        NVML_ERROR_INSUFFICIENT_SIZE => {}
        e => return Err(e),
    }
    let mut list = vec![unsafe { std::mem::zeroed::<nvmlProcessInfo_t>() }; n as usize];
    let r = unsafe { f(h, &mut n, list.as_mut_ptr()) };
    if r != NVML_SUCCESS {
        return Err(r);
    }
    list.truncate(n as usize);
    Ok(list)
}

fn proc_info(pid: u32, bytes: u64) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid,
        usedGpuMemory: bytes,
        gpuInstanceId: NO_INSTANCE,
        computeInstanceId: NO_INSTANCE,
    }
}

#[test]
fn running_processes_follow_nvmls_sizing_protocol() {
    let mut cfg = gpus(3);
    cfg["gpus"][0]["processes"] = json!([
        {"pid": 4242, "memory_used_mib": 512},
        {"pid": 77, "memory_used_mib": 0},
        {"pid": 9000},
    ]);
    let _m = Machine::new(&cfg);
    let want = vec![
        proc_info(4242, 512 * 1024 * 1024),
        proc_info(77, 0),
        proc_info(9000, NVML_VALUE_NOT_AVAILABLE_ULL),
    ];
    let both: [ProcFn; 2] = [
        nvmlDeviceGetComputeRunningProcesses_v3,
        nvmlDeviceGetMPSComputeRunningProcesses_v3,
    ];
    for f in both {
        assert_eq!(processes(f, handle(0)), Ok(want.clone()));
        // No processes: sizing succeeds with 0.
        let mut n: c_uint = 0;
        assert_eq!(unsafe { f(handle(1), &mut n, null_mut()) }, NVML_SUCCESS);
        assert_eq!(n, 0);
        assert_eq!(processes(f, handle(1)), Ok(vec![]));
        // Too little room: the count needed, nothing written.
        let mut two = [proc_info(1, 1); 2];
        let mut n: c_uint = 2;
        assert_eq!(
            unsafe { f(handle(0), &mut n, two.as_mut_ptr()) },
            NVML_ERROR_INSUFFICIENT_SIZE
        );
        assert_eq!(n, 3);
        assert_eq!(two, [proc_info(1, 1); 2]);
        // More room than needed: the count written.
        let mut five = [proc_info(1, 1); 5];
        let mut n: c_uint = 5;
        assert_eq!(
            unsafe { f(handle(0), &mut n, five.as_mut_ptr()) },
            NVML_SUCCESS
        );
        assert_eq!(n, 3);
        assert_eq!(five[..3], want[..]);
        assert_eq!(five[3], proc_info(1, 1));
        // Null count; room claimed with a null array.
        assert_eq!(
            unsafe { f(handle(0), ptr::null_mut(), five.as_mut_ptr()) },
            NVML_ERROR_INVALID_ARGUMENT
        );
        let mut n: c_uint = 4;
        assert_eq!(
            unsafe { f(handle(0), &mut n, null_mut()) },
            NVML_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            unsafe { f(handle(2), &mut n, null_mut()) },
            NVML_ERROR_INVALID_ARGUMENT
        );
    }
}

#[test]
fn running_processes_of_a_lost_gpu_a_mig_device_and_an_override() {
    let mut cfg = gpus(2);
    cfg["gpus"][0]["lost"] = json!(true);
    cfg["gpus"][0]["processes"] = json!([{"pid": 1, "memory_used_mib": 1}]);
    cfg["gpus"][1]["processes"] = json!([{"pid": 2, "memory_used_mib": 2}]);
    cfg["gpus"][1]["errors"] =
        json!({"nvmlDeviceGetMPSComputeRunningProcesses_v3": "NOT_SUPPORTED"});
    let m = Machine::new(&cfg);
    let (compute, mps): (ProcFn, ProcFn) = (
        nvmlDeviceGetComputeRunningProcesses_v3,
        nvmlDeviceGetMPSComputeRunningProcesses_v3,
    );
    assert_eq!(processes(compute, handle(0)), Err(NVML_ERROR_GPU_IS_LOST));
    assert_eq!(processes(mps, handle(0)), Err(NVML_ERROR_GPU_IS_LOST));
    assert_eq!(
        processes(compute, handle(1)),
        Ok(vec![proc_info(2, 2 << 20)])
    );
    assert_eq!(processes(mps, handle(1)), Err(NVML_ERROR_NOT_SUPPORTED));
    // A MIG device handle: NOT_SUPPORTED, as for the other whole-GPU queries.
    m.write(&mig_json());
    let mig = mig_device(handle(0), 0).expect("a MIG device");
    assert_eq!(processes(compute, mig), Err(NVML_ERROR_NOT_SUPPORTED));
}

#[test]
fn a_process_that_bypassed_mps_is_in_the_compute_list_only() {
    let mut cfg = gpus(1);
    cfg["gpus"][0]["processes"] = json!([
        {"pid": 10, "memory_used_mib": 1},
        {"pid": 11, "memory_used_mib": 2, "mps_client": false},
        {"pid": 12, "memory_used_mib": 3, "mps_client": true},
    ]);
    let _m = Machine::new(&cfg);
    assert_eq!(
        processes(nvmlDeviceGetComputeRunningProcesses_v3, handle(0)),
        Ok(vec![
            proc_info(10, 1 << 20),
            proc_info(11, 2 << 20),
            proc_info(12, 3 << 20)
        ])
    );
    assert_eq!(
        processes(nvmlDeviceGetMPSComputeRunningProcesses_v3, handle(0)),
        Ok(vec![proc_info(10, 1 << 20), proc_info(12, 3 << 20)])
    );
}

#[test]
fn process_mistakes_are_errors() {
    let bad = [
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "processes": [{"pid": 1, "mem": 3}]}]}"#,
            "unknown field",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "processes": [{"memory_used_mib": 3}]}]}"#,
            "pid",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "processes": [{"pid": 1}, {"pid": 1}]}]}"#,
            "duplicate pid 1",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "x", "processes": [{"pid": 1, "memory_used_mib": 18446744073709551615}]}]}"#,
            "more than",
        ),
    ];
    for (text, want) in bad {
        let e = config::parse(text).expect_err(text);
        assert!(e.contains(want), "{text}: {e}");
    }
    let ok = config::parse(
        r#"{"gpus": [{"uuid": "a", "name": "x", "processes": [{"pid": 1, "memory_used_mib": null}]}]}"#,
    )
    .expect("null memory is not available");
    assert_eq!(ok.gpus[0].processes[0].memory_used_mib, None);
}

// ----- events -----

fn new_set() -> nvmlEventSet_t {
    let mut set = null_mut();
    assert_eq!(unsafe { nvmlEventSetCreate(&mut set) }, NVML_SUCCESS);
    assert!(!set.is_null());
    set
}

fn wait(set: nvmlEventSet_t, timeout_ms: u32) -> Result<nvmlEventData_t, nvmlReturn_t> {
    let mut d = nvmlEventData_t {
        device: null_mut(),
        eventType: 0,
        eventData: 0,
        gpuInstanceId: 0,
        computeInstanceId: 0,
    };
    match unsafe { nvmlEventSetWait_v2(set, &mut d, timeout_ms) } {
        NVML_SUCCESS => Ok(d),
        e => Err(e),
    }
}

#[test]
fn events_are_delivered_once_per_set_and_respect_the_mask() {
    let cfg = with(
        gpus(3),
        json!({"events": [
            {"id": 1, "gpu_index": 2, "type": "xid", "data": 79},
            {"id": 2, "gpu_index": 0, "type": "double_bit_ecc"},
            {"id": 3, "gpu_index": 0, "type": "xid", "data": 48},
            {"id": 4, "gpu_index": 1, "type": "single_bit_ecc"},
        ]}),
    );
    let _m = Machine::new(&cfg);
    let xid_only = new_set();
    let everything = new_set();
    unsafe {
        assert_eq!(
            nvmlDeviceRegisterEvents(handle(2), nvmlEventTypeXidCriticalError, xid_only),
            NVML_SUCCESS
        );
        assert_eq!(
            nvmlDeviceRegisterEvents(handle(0), nvmlEventTypeXidCriticalError, xid_only),
            NVML_SUCCESS
        );
        for i in 0..3 {
            assert_eq!(
                nvmlDeviceRegisterEvents(handle(i), SUPPORTED_EVENT_TYPES, everything),
                NVML_SUCCESS
            );
        }
    }
    let e = wait(xid_only, 0).expect("xid on GPU 2");
    assert_eq!(e.device, handle(2));
    assert_eq!(e.eventType, nvmlEventTypeXidCriticalError);
    assert_eq!(e.eventData, 79);
    assert_eq!(
        (e.gpuInstanceId, e.computeInstanceId),
        (NO_INSTANCE, NO_INSTANCE)
    );
    // The double-bit error on GPU 0 is not in this set's mask: skipped.
    let e = wait(xid_only, 0).expect("xid on GPU 0");
    assert_eq!((e.device, e.eventData), (handle(0), 48));
    assert_eq!(wait(xid_only, 0).map(|_| ()), Err(NVML_ERROR_TIMEOUT));

    // Another set sees every event, in order, once.
    let got: Vec<(nvmlDevice_t, u64)> = (0..4)
        .map(|_| wait(everything, 0).map(|e| (e.device, e.eventType)))
        .collect::<Result<_, _>>()
        .expect("four events");
    assert_eq!(
        got,
        [
            (handle(2), nvmlEventTypeXidCriticalError),
            (handle(0), nvmlEventTypeDoubleBitEccError),
            (handle(0), nvmlEventTypeXidCriticalError),
            (handle(1), nvmlEventTypeSingleBitEccError),
        ]
    );
    assert_eq!(wait(everything, 0).map(|_| ()), Err(NVML_ERROR_TIMEOUT));
    unsafe {
        assert_eq!(nvmlEventSetFree(xid_only), NVML_SUCCESS);
        assert_eq!(nvmlEventSetFree(everything), NVML_SUCCESS);
    }
}

#[test]
fn wait_times_out_after_the_timeout_and_sees_new_events() {
    let m = Machine::new(&gpus(1));
    let set = new_set();
    unsafe {
        assert_eq!(
            nvmlDeviceRegisterEvents(handle(0), nvmlEventTypeXidCriticalError, set),
            NVML_SUCCESS
        );
    }
    let t = Instant::now();
    assert_eq!(wait(set, 150).map(|_| ()), Err(NVML_ERROR_TIMEOUT));
    assert!(
        t.elapsed() >= Duration::from_millis(150),
        "{:?}",
        t.elapsed()
    );

    // An event appears in the file while we wait.
    let path = m.path.clone();
    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(120));
        let cfg = with(
            gpus(1),
            json!({"events": [{"id": 7, "gpu_index": 0, "type": "xid", "data": 94}]}),
        );
        write_config(&path, &cfg);
    });
    let t = Instant::now();
    let e = wait(set, 10_000).expect("the new event");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(e.eventData, 94);
    writer.join().expect("writer");
    assert_eq!(wait(set, 0).map(|_| ()), Err(NVML_ERROR_TIMEOUT));
    unsafe { assert_eq!(nvmlEventSetFree(set), NVML_SUCCESS) };
}

#[test]
fn event_set_misuse_is_an_error_not_a_crash() {
    let _m = Machine::new(&gpus(1));
    let set = new_set();
    unsafe {
        assert_eq!(
            nvmlDeviceRegisterEvents(handle(0), 1 << 40, set),
            NVML_ERROR_NOT_SUPPORTED
        );
        assert_eq!(nvmlEventSetFree(set), NVML_SUCCESS);
        assert_eq!(nvmlEventSetFree(set), NVML_ERROR_INVALID_ARGUMENT);
        assert_eq!(
            nvmlDeviceRegisterEvents(handle(0), 8, set),
            NVML_ERROR_INVALID_ARGUMENT
        );
    }
    assert_eq!(wait(set, 0).map(|_| ()), Err(NVML_ERROR_INVALID_ARGUMENT));
    let stray: nvmlEventSet_t = ptr::without_provenance_mut(0x10);
    assert_eq!(wait(stray, 0).map(|_| ()), Err(NVML_ERROR_INVALID_ARGUMENT));
}

#[test]
fn a_panic_becomes_unknown() {
    let r = state::guard("test", || panic!("boom"));
    assert_eq!(r, NVML_ERROR_UNKNOWN);
}

// ----- MIG -----

use crate::config::MIG_FUNCTIONS;
use crate::mig::*;
use crate::profiles;

fn mig_json() -> Value {
    let text = std::fs::read_to_string(configs_dir().join("mig.json")).expect("mig.json");
    serde_json::from_str(&text).expect("json")
}

/// The config file as it is on disk now.
fn on_disk(m: &Machine) -> Value {
    serde_json::from_str(&std::fs::read_to_string(&m.path).expect("read")).expect("json")
}

type U32Fn = unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> nvmlReturn_t;

fn get_u32(f: U32Fn, h: nvmlDevice_t) -> Result<u32, nvmlReturn_t> {
    let mut v: c_uint = 0xDEAD;
    match unsafe { f(h, &mut v) } {
        NVML_SUCCESS => Ok(v),
        e => Err(e),
    }
}

fn mig_mode(h: nvmlDevice_t) -> Result<(u32, u32), nvmlReturn_t> {
    let (mut c, mut p) = (9, 9);
    match unsafe { nvmlDeviceGetMigMode(h, &mut c, &mut p) } {
        NVML_SUCCESS => Ok((c, p)),
        e => Err(e),
    }
}

fn mig_device(h: nvmlDevice_t, index: u32) -> Result<nvmlDevice_t, nvmlReturn_t> {
    let mut d = null_mut();
    match unsafe { nvmlDeviceGetMigDeviceHandleByIndex(h, index, &mut d) } {
        NVML_SUCCESS => Ok(d),
        e => Err(e),
    }
}

fn memory_v2(h: nvmlDevice_t) -> Result<nvmlMemory_v2_t, nvmlReturn_t> {
    let mut m = unsafe { std::mem::zeroed::<nvmlMemory_v2_t>() };
    m.version = nvmlMemory_v2;
    match unsafe { nvmlDeviceGetMemoryInfo_v2(h, &mut m) } {
        NVML_SUCCESS => Ok(m),
        e => Err(e),
    }
}

fn attributes(h: nvmlDevice_t) -> Result<nvmlDeviceAttributes_t, nvmlReturn_t> {
    let mut a = unsafe { std::mem::zeroed::<nvmlDeviceAttributes_t>() };
    match unsafe { nvmlDeviceGetAttributes_v2(h, &mut a) } {
        NVML_SUCCESS => Ok(a),
        e => Err(e),
    }
}

fn remaining_capacity(h: nvmlDevice_t, profile_id: u32) -> Result<u32, nvmlReturn_t> {
    let mut n = 0xDEAD;
    match unsafe { nvmlDeviceGetGpuInstanceRemainingCapacity(h, profile_id, &mut n) } {
        NVML_SUCCESS => Ok(n),
        e => Err(e),
    }
}

/// nvml-wrapper's `possible_placements`: count first, then the array.
fn placements(h: nvmlDevice_t, profile_id: u32) -> Result<Vec<(u32, u32)>, nvmlReturn_t> {
    let mut n: c_uint = 0;
    let r =
        unsafe { nvmlDeviceGetGpuInstancePossiblePlacements_v2(h, profile_id, null_mut(), &mut n) };
    if r != NVML_SUCCESS {
        return Err(r);
    }
    let mut v = vec![
        nvmlGpuInstancePlacement_t {
            start: 99,
            size: 99
        };
        n as usize
    ];
    let r = unsafe {
        nvmlDeviceGetGpuInstancePossiblePlacements_v2(h, profile_id, v.as_mut_ptr(), &mut n)
    };
    if r != NVML_SUCCESS {
        return Err(r);
    }
    Ok(v.iter()
        .take(n as usize)
        .map(|p| (p.start, p.size))
        .collect())
}

fn create_gi(h: nvmlDevice_t, profile_id: u32) -> Result<nvmlGpuInstance_t, nvmlReturn_t> {
    let mut gi = null_mut();
    match unsafe { nvmlDeviceCreateGpuInstance(h, profile_id, &mut gi) } {
        NVML_SUCCESS => Ok(gi),
        e => Err(e),
    }
}

fn create_gi_at(
    h: nvmlDevice_t,
    profile_id: u32,
    start: u32,
    size: u32,
) -> Result<nvmlGpuInstance_t, nvmlReturn_t> {
    let mut gi = null_mut();
    let p = nvmlGpuInstancePlacement_t { start, size };
    match unsafe { nvmlDeviceCreateGpuInstanceWithPlacement(h, profile_id, &p, &mut gi) } {
        NVML_SUCCESS => Ok(gi),
        e => Err(e),
    }
}

fn gi_info(gi: nvmlGpuInstance_t) -> Result<nvmlGpuInstanceInfo_t, nvmlReturn_t> {
    let mut i = unsafe { std::mem::zeroed::<nvmlGpuInstanceInfo_t>() };
    match unsafe { nvmlGpuInstanceGetInfo(gi, &mut i) } {
        NVML_SUCCESS => Ok(i),
        e => Err(e),
    }
}

fn create_ci(gi: nvmlGpuInstance_t, profile: u32) -> Result<nvmlComputeInstance_t, nvmlReturn_t> {
    let mut ci = null_mut();
    match unsafe { nvmlGpuInstanceCreateComputeInstance(gi, profile, &mut ci) } {
        NVML_SUCCESS => Ok(ci),
        e => Err(e),
    }
}

fn set_mig_mode(h: nvmlDevice_t, mode: u32) -> Result<nvmlReturn_t, nvmlReturn_t> {
    let mut status = 12345;
    match unsafe { nvmlDeviceSetMigMode(h, mode, &mut status) } {
        NVML_SUCCESS => Ok(status),
        e => Err(e),
    }
}

fn is_mig_uuid(u: &str) -> bool {
    let parts: Vec<&str> = u.strip_prefix("MIG-").unwrap_or("").split('-').collect();
    parts.iter().map(|p| p.len()).collect::<Vec<_>>() == [8, 4, 4, 4, 12]
        && parts
            .iter()
            .all(|p| p.chars().all(|c| c.is_ascii_hexdigit()))
}

#[test]
fn profile_tables_are_consistent() {
    for t in profiles::TABLES {
        for p in t.profiles {
            assert_eq!(p.starts.len() as u32, p.instance_count, "{}", p.name);
            for s in p.starts {
                assert!(
                    s + p.mem_slices <= profiles::MEM_SLICES,
                    "{} at {s}",
                    p.name
                );
            }
            assert!(p.slices <= profiles::COMPUTE_SLICES);
            assert!(p.index < NVML_GPU_INSTANCE_PROFILE_COUNT);
            assert!(p.name.starts_with(&format!("{}g.", p.slices)));
        }
    }
    let a100 = profiles::table_for("NVIDIA A100-PCIE-40GB").expect("A100 table");
    let mem: Vec<u64> = a100.profiles.iter().map(|p| p.memory_mib).collect();
    assert_eq!(mem, [4864, 9856, 19968, 19968, 40192]);
    let ids: Vec<u32> = a100.profiles.iter().map(|p| p.id).collect();
    assert_eq!(ids, [19, 14, 9, 5, 0]);
    assert!(a100.needs_reset);
    let h100 = profiles::table_for("NVIDIA H100 PCIe").expect("H100 table");
    assert!(!h100.needs_reset);
    assert_eq!(
        h100.by_index(9).map(|p| (p.id, p.name)),
        Some((15, "1g.20gb"))
    );
    assert!(profiles::table_for("Tesla T4").is_none());
}

#[test]
fn mig_example_config_is_what_it_says() {
    let cfg = config::load(&configs_dir().join("mig.json")).expect("mig.json");
    let a100 = &cfg.gpus[0].mig;
    assert!(a100.mode && a100.pending && a100.needs_reset);
    let names: Vec<&str> = a100.instances.iter().map(|i| i.profile.name).collect();
    assert_eq!(names, ["3g.20gb", "2g.10gb", "1g.5gb"]);
    let h100 = &cfg.gpus[1].mig;
    assert!(h100.mode && !h100.needs_reset);
    assert_eq!(h100.devices().len(), 7);
    assert!(h100.instances.iter().all(|i| i.profile.name == "1g.10gb"));
    let ids: Vec<u32> = h100.instances.iter().map(|i| i.gi_id).collect();
    assert_eq!(
        ids,
        [1, 2, 3, 4, 5, 6, 7],
        "default ids: lowest free from 1"
    );
    assert!(!cfg.gpus[2].mig.mode && cfg.gpus[2].mig.instances.is_empty());
}

#[test]
fn mig_devices_are_discovered_with_their_identity() {
    let cfg = mig_json();
    let _m = Machine::new(&cfg);
    let (a100, h100, plain) = (handle(0), handle(1), handle(2));
    assert_eq!(mig_mode(a100), Ok((1, 1)));
    assert_eq!(mig_mode(plain), Ok((0, 0)));
    assert_eq!(get_u32(nvmlDeviceGetMaxMigDeviceCount, a100), Ok(7));
    assert_eq!(get_u32(nvmlDeviceGetMaxMigDeviceCount, plain), Ok(0));
    assert_eq!(get_u32(nvmlDeviceIsMigDeviceHandle, a100), Ok(0));

    // A100: by GPU instance id: 2 (3g), 3 (2g), 9 (1g).
    let parent_uuid = cfg["gpus"][0]["uuid"].as_str().expect("uuid");
    let want = [
        (2, "3g.20gb", 19968, 0, 42, 3),
        (3, "2g.10gb", 9856, 0, 28, 2),
        (9, "1g.5gb", 4864, 1024, 14, 1),
    ];
    let mut seen = Vec::new();
    for (i, (gi, prof, mib, used, sms, slices)) in want.into_iter().enumerate() {
        let d = mig_device(a100, i as u32).expect("mig device");
        assert_ne!(d, a100);
        assert_eq!(get_u32(nvmlDeviceIsMigDeviceHandle, d), Ok(1));
        assert_eq!(get_u32(nvmlDeviceGetGpuInstanceId, d), Ok(gi));
        assert_eq!(get_u32(nvmlDeviceGetComputeInstanceId, d), Ok(0));
        let u = uuid(d).expect("uuid");
        assert!(is_mig_uuid(&u), "{u}");
        assert_eq!(u, config::derived_mig_uuid(parent_uuid, gi));
        assert_eq!(
            name(d).as_deref(),
            Ok(format!("NVIDIA A100-SXM4-40GB MIG {prof}").as_str())
        );
        let m = memory_v2(d).expect("memory");
        assert_eq!((m.total, m.used), (mib << 20, used << 20));
        assert_eq!(m.free, (mib - used) << 20);
        let mut m1 = nvmlMemory_t {
            total: 0,
            free: 0,
            used: 0,
        };
        assert_eq!(unsafe { nvmlDeviceGetMemoryInfo(d, &mut m1) }, NVML_SUCCESS);
        assert_eq!(m1.total, mib << 20);
        let a = attributes(d).expect("attributes");
        assert_eq!(a.multiprocessorCount, sms);
        assert_eq!(a.gpuInstanceSliceCount, slices);
        assert_eq!(a.computeInstanceSliceCount, slices);
        assert_eq!(a.memorySizeMB, mib);
        let mut parent = null_mut();
        assert_eq!(
            unsafe { nvmlDeviceGetDeviceHandleFromMigDeviceHandle(d, &mut parent) },
            NVML_SUCCESS
        );
        assert_eq!(parent, a100);
        seen.push(u);
    }
    assert_eq!(mig_device(a100, 3), Err(NVML_ERROR_NOT_FOUND));
    assert_eq!(mig_device(a100, 7), Err(NVML_ERROR_INVALID_ARGUMENT));
    assert_eq!(mig_device(plain, 0), Err(NVML_ERROR_NOT_FOUND));

    // H100: seven 1g.10gb.
    for i in 0..7 {
        let d = mig_device(h100, i).expect("h100 mig device");
        assert_eq!(name(d).as_deref(), Ok("NVIDIA H100 80GB HBM3 MIG 1g.10gb"));
        assert_eq!(memory_v2(d).map(|m| m.total), Ok(9984 << 20));
        assert_eq!(attributes(d).map(|a| a.multiprocessorCount), Ok(16));
        seen.push(uuid(d).expect("uuid"));
    }
    assert_eq!(mig_device(h100, 7), Err(NVML_ERROR_INVALID_ARGUMENT));
    let distinct: std::collections::BTreeSet<_> = seen.iter().collect();
    assert_eq!(distinct.len(), 10);

    // What a MIG device refuses, and what a GPU handle refuses.
    let d = mig_device(a100, 0).expect("mig device");
    let ns = NVML_ERROR_NOT_SUPPORTED;
    unsafe {
        let mut u: c_uint = 0;
        let mut x = nvmlUtilization_t { gpu: 0, memory: 0 };
        assert_eq!(nvmlDeviceGetMinorNumber(d, &mut u), ns);
        assert_eq!(nvmlDeviceGetUtilizationRates(d, &mut x), ns);
        assert_eq!(nvmlDeviceGetTemperature(d, 0, &mut u), ns);
        assert_eq!(nvmlDeviceGetPowerUsage(d, &mut u), ns);
        assert_eq!(nvmlDeviceGetNvLinkState(d, 0, &mut u), ns);
        assert_eq!(nvmlDeviceGetTopologyCommonAncestor(d, h100, &mut u), ns);
        assert_eq!(nvmlDeviceGetIndex(d, &mut u), ns);
        assert_eq!(mig_mode(d), Err(ns));
        assert_eq!(get_u32(nvmlDeviceGetMaxMigDeviceCount, d), Err(ns));
        assert_eq!(pci_info(d).err(), Some(ns));
        let mut parent = null_mut();
        assert_eq!(
            nvmlDeviceGetDeviceHandleFromMigDeviceHandle(a100, &mut parent),
            NVML_ERROR_INVALID_ARGUMENT
        );
    }
    assert_eq!(get_u32(nvmlDeviceGetGpuInstanceId, a100), Err(ns));
    assert_eq!(get_u32(nvmlDeviceGetComputeInstanceId, a100), Err(ns));
    assert_eq!(attributes(a100).err(), Some(ns));
    // Handles of one kind are not taken for another.
    let mut info = unsafe { std::mem::zeroed::<nvmlGpuInstanceInfo_t>() };
    assert_eq!(
        unsafe { nvmlGpuInstanceGetInfo(d.cast(), &mut info) },
        NVML_ERROR_INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlGpuInstanceGetInfo(a100.cast(), &mut info) },
        NVML_ERROR_INVALID_ARGUMENT
    );
    assert_eq!(
        name(state::gi_handle(0, 2).cast()),
        Err(NVML_ERROR_INVALID_ARGUMENT)
    );
}

#[test]
fn a_model_without_mig_answers_not_supported() {
    let _m = Machine::new(&json!({"gpus": [{"uuid": "GPU-t4", "name": "Tesla T4"}]}));
    let h = handle(0);
    let ns = NVML_ERROR_NOT_SUPPORTED;
    assert_eq!(mig_mode(h), Err(ns));
    assert_eq!(get_u32(nvmlDeviceGetMaxMigDeviceCount, h), Ok(0));
    assert_eq!(mig_device(h, 0), Err(ns));
    assert_eq!(set_mig_mode(h, NVML_DEVICE_MIG_ENABLE), Err(ns));
    assert_eq!(placements(h, 19), Err(ns));
    assert_eq!(create_gi(h, 19), Err(ns));
    let mut info = unsafe { std::mem::zeroed::<nvmlGpuInstanceProfileInfo_t>() };
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceProfileInfo(h, 0, &mut info) },
        ns
    );
}

#[test]
fn profile_info_placements_and_remaining_capacity() {
    let _m = Machine::new(&mig_json());
    let (a100, h100, plain) = (handle(0), handle(1), handle(2));
    let mut info = unsafe { std::mem::zeroed::<nvmlGpuInstanceProfileInfo_t>() };
    let r = unsafe { nvmlDeviceGetGpuInstanceProfileInfo(a100, 0, &mut info) };
    assert_eq!(r, NVML_SUCCESS);
    assert_eq!(
        (
            info.id,
            info.sliceCount,
            info.instanceCount,
            info.multiprocessorCount
        ),
        (19, 1, 7, 14)
    );
    assert_eq!((info.memorySizeMB, info.copyEngineCount), (4864, 1));
    // MIG mode is not needed to read profiles.
    let r = unsafe { nvmlDeviceGetGpuInstanceProfileInfo(plain, 4, &mut info) };
    assert_eq!(r, NVML_SUCCESS);
    assert_eq!((info.id, info.sliceCount, info.memorySizeMB), (0, 7, 40192));
    let r = unsafe { nvmlDeviceGetGpuInstanceProfileInfo(a100, 9, &mut info) };
    assert_eq!(r, NVML_ERROR_NOT_SUPPORTED, "1g.20gb is H100's");
    let r = unsafe { nvmlDeviceGetGpuInstanceProfileInfo(h100, 9, &mut info) };
    assert_eq!(r, NVML_SUCCESS);
    assert_eq!(
        (info.id, info.instanceCount, info.multiprocessorCount),
        (15, 4, 26)
    );
    let r = unsafe { nvmlDeviceGetGpuInstanceProfileInfo(a100, 17, &mut info) };
    assert_eq!(r, NVML_ERROR_INVALID_ARGUMENT);

    // The V form: version checked, name filled.
    let mut v2 = unsafe { std::mem::zeroed::<nvmlGpuInstanceProfileInfo_v2_t>() };
    let r = unsafe { nvmlDeviceGetGpuInstanceProfileInfoV(a100, 2, &mut v2) };
    assert_eq!(r, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    v2.version = nvmlGpuInstanceProfileInfo_v2;
    assert_eq!(nvmlGpuInstanceProfileInfo_v2, 0x0200_0098);
    let r = unsafe { nvmlDeviceGetGpuInstanceProfileInfoV(a100, 2, &mut v2) };
    assert_eq!(r, NVML_SUCCESS);
    assert_eq!(cstr_field(&v2.name), "MIG 3g.20gb");
    assert_eq!((v2.id, v2.sliceCount, v2.memorySizeMB), (9, 3, 19968));
    assert_eq!(v2.version, nvmlGpuInstanceProfileInfo_v2);
    let mut v3 = unsafe { std::mem::zeroed::<nvmlGpuInstanceProfileInfo_v3_t>() };
    v3.version = nvmlGpuInstanceProfileInfo_v3;
    let r = unsafe { nvmlDeviceGetGpuInstanceProfileInfoV(h100, 4, (&raw mut v3).cast()) };
    assert_eq!(r, NVML_SUCCESS);
    assert_eq!(cstr_field(&v3.name), "MIG 7g.80gb");
    assert_eq!(
        (v3.id, v3.multiprocessorCount, v3.memorySizeMB),
        (0, 132, 81152)
    );

    // Placements: all of them, whatever exists.
    assert_eq!(
        placements(a100, 19),
        Ok((0..7).map(|s| (s, 1)).collect::<Vec<_>>())
    );
    assert_eq!(placements(a100, 14), Ok(vec![(0, 2), (2, 2), (4, 2)]));
    assert_eq!(placements(a100, 9), Ok(vec![(0, 4), (4, 4)]));
    assert_eq!(placements(a100, 5), Ok(vec![(0, 4)]));
    assert_eq!(placements(plain, 0), Ok(vec![(0, 8)]));
    assert_eq!(
        placements(h100, 15),
        Ok(vec![(0, 2), (2, 2), (4, 2), (6, 2)])
    );
    assert_eq!(placements(a100, 15), Err(NVML_ERROR_INVALID_ARGUMENT));
    assert_eq!(placements(a100, 99), Err(NVML_ERROR_INVALID_ARGUMENT));
    let mut small = [nvmlGpuInstancePlacement_t { start: 9, size: 9 }; 1];
    let mut n: c_uint = 1;
    let r = unsafe {
        nvmlDeviceGetGpuInstancePossiblePlacements_v2(a100, 9, small.as_mut_ptr(), &mut n)
    };
    assert_eq!((r, n), (NVML_ERROR_INSUFFICIENT_SIZE, 2));
    assert_eq!(small[0].start, 9, "nothing written");

    // A100: 2g@0, 1g@2, 3g@4 leave one 1g slot (slice 3) and nothing else.
    assert_eq!(remaining_capacity(a100, 19), Ok(1));
    for id in [14, 9, 5, 0] {
        assert_eq!(remaining_capacity(a100, id), Ok(0), "profile {id}");
    }
    for id in [19, 15, 14, 9, 5, 0] {
        assert_eq!(remaining_capacity(h100, id), Ok(0), "profile {id}");
    }
    assert_eq!(
        remaining_capacity(a100, 99),
        Err(NVML_ERROR_INVALID_ARGUMENT)
    );
    assert_eq!(remaining_capacity(plain, 19), Err(NVML_ERROR_NOT_SUPPORTED));

    // An empty GPU in MIG mode.
    let mut cfg = mig_json();
    cfg["gpus"][2]["mig"] = json!({"mode": true});
    let _m2 = Machine::new(&cfg);
    let plain = handle(2);
    let want = [(19, 7), (14, 3), (9, 2), (5, 1), (0, 1)];
    for (id, n) in want {
        assert_eq!(remaining_capacity(plain, id), Ok(n), "profile {id}");
    }
}

#[test]
fn create_gpu_and_compute_instances_persist_and_destroy() {
    let m = Machine::new(&mig_json());
    let a100 = handle(0);

    // A GPU instance without a compute instance: no MIG device yet.
    let gi = create_gi(a100, 19).expect("create 1g.5gb");
    let info = gi_info(gi).expect("info");
    assert_eq!(info.device, a100);
    assert_eq!((info.id, info.profileId), (1, 19), "lowest free id");
    assert_eq!(
        info.placement,
        nvmlGpuInstancePlacement_t { start: 3, size: 1 }
    );
    assert_eq!(mig_device(a100, 3), Err(NVML_ERROR_NOT_FOUND));
    assert_eq!(remaining_capacity(a100, 19), Ok(0));
    assert_eq!(create_gi(a100, 19), Err(NVML_ERROR_INSUFFICIENT_RESOURCES));

    // Written back: other fields as they were.
    let disk = on_disk(&m);
    let inst = disk["gpus"][0]["mig"]["instances"]
        .as_array()
        .expect("instances")
        .clone();
    assert_eq!(inst.len(), 4);
    assert_eq!(inst[2]["memory_used_mib"], json!(1024));
    assert_eq!(
        inst[3],
        json!({"profile": "1g.5gb", "start": 3, "gi_id": 1})
    );
    assert_eq!(disk["gpus"][0]["serial"], json!("1562720054321"));
    assert_eq!(disk["gpus"][1]["mig"]["instances"][6]["busy"], json!(true));
    assert_eq!(disk["driver_version"], json!("535.129.03"));
    // ... and read back by a later call (or another process).
    let mut by_id = null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceById(a100, 1, &mut by_id) },
        NVML_SUCCESS
    );
    assert_eq!(by_id, gi);
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceById(a100, 5, &mut by_id) },
        NVML_ERROR_NOT_FOUND
    );

    // Compute instance profiles: only the one spanning the GPU instance.
    let mut cp = unsafe { std::mem::zeroed::<nvmlComputeInstanceProfileInfo_t>() };
    let r = unsafe { nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, 0, &mut cp) };
    assert_eq!(r, NVML_SUCCESS);
    assert_eq!(
        (
            cp.id,
            cp.sliceCount,
            cp.instanceCount,
            cp.multiprocessorCount
        ),
        (0, 1, 1, 14)
    );
    let r = unsafe { nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 1, 0, &mut cp) };
    assert_eq!(r, NVML_ERROR_NOT_SUPPORTED);
    let r = unsafe { nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 8, 0, &mut cp) };
    assert_eq!(r, NVML_ERROR_INVALID_ARGUMENT);
    let mut cv = unsafe { std::mem::zeroed::<nvmlComputeInstanceProfileInfo_v2_t>() };
    cv.version = nvmlComputeInstanceProfileInfo_v2;
    let r = unsafe { nvmlGpuInstanceGetComputeInstanceProfileInfoV(gi, 0, 0, &mut cv) };
    assert_eq!(r, NVML_SUCCESS);
    assert_eq!(cstr_field(&cv.name), "MIG 1g.5gb");
    cv.version = 1;
    let r = unsafe { nvmlGpuInstanceGetComputeInstanceProfileInfoV(gi, 0, 0, &mut cv) };
    assert_eq!(r, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);

    // The compute instance makes the MIG device appear (first: lowest GI id).
    assert_eq!(create_ci(gi, 1), Err(NVML_ERROR_NOT_SUPPORTED));
    let ci = create_ci(gi, 0).expect("create ci");
    assert_eq!(create_ci(gi, 0), Err(NVML_ERROR_INSUFFICIENT_RESOURCES));
    let mut ci_info = unsafe { std::mem::zeroed::<nvmlComputeInstanceInfo_t>() };
    assert_eq!(
        unsafe { nvmlComputeInstanceGetInfo_v2(ci, &mut ci_info) },
        NVML_SUCCESS
    );
    assert_eq!((ci_info.device, ci_info.gpuInstance), (a100, gi));
    assert_eq!((ci_info.id, ci_info.profileId), (0, 0));
    assert_eq!(ci_info.placement.size, 1);
    let d = mig_device(a100, 0).expect("new mig device");
    assert_eq!(get_u32(nvmlDeviceGetGpuInstanceId, d), Ok(1));
    assert_eq!(name(d).as_deref(), Ok("NVIDIA A100-SXM4-40GB MIG 1g.5gb"));
    assert!(mig_device(a100, 3).is_ok());
    assert_eq!(
        on_disk(&m)["gpus"][0]["mig"]["instances"][3]["ci_id"],
        json!(0)
    );
    let mut cis = [null_mut(); 1];
    let mut n: c_uint = 0;
    assert_eq!(
        unsafe { nvmlGpuInstanceGetComputeInstances(gi, 0, cis.as_mut_ptr(), &mut n) },
        NVML_SUCCESS
    );
    assert_eq!((n, cis[0]), (1, ci));

    // GPU instances by profile.
    let mut gis = [null_mut(); 7];
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstances(a100, 19, gis.as_mut_ptr(), &mut n) },
        NVML_SUCCESS
    );
    assert_eq!(n, 2);
    let ids: Vec<u32> = gis[..2]
        .iter()
        .map(|g| gi_info(*g).expect("info").id)
        .collect();
    assert_eq!(ids, [1, 9]);

    // Destroy: the GPU instance is in use while its compute instance lives.
    assert_eq!(unsafe { nvmlGpuInstanceDestroy(gi) }, NVML_ERROR_IN_USE);
    assert_eq!(unsafe { nvmlComputeInstanceDestroy(ci) }, NVML_SUCCESS);
    assert_eq!(mig_device(a100, 3), Err(NVML_ERROR_NOT_FOUND));
    assert_eq!(
        unsafe { nvmlComputeInstanceGetInfo_v2(ci, &mut ci_info) },
        NVML_ERROR_INVALID_ARGUMENT,
        "a destroyed compute instance"
    );
    assert_eq!(unsafe { nvmlGpuInstanceDestroy(gi) }, NVML_SUCCESS);
    assert_eq!(gi_info(gi).err(), Some(NVML_ERROR_INVALID_ARGUMENT));
    let after = on_disk(&m);
    assert_eq!(
        after["gpus"][0]["mig"]["instances"]
            .as_array()
            .map(Vec::len),
        Some(3)
    );
    assert_eq!(remaining_capacity(a100, 19), Ok(1));

    // With a placement.
    assert_eq!(
        create_gi_at(a100, 19, 4, 1),
        Err(NVML_ERROR_INSUFFICIENT_RESOURCES)
    );
    assert_eq!(
        create_gi_at(a100, 19, 7, 1),
        Err(NVML_ERROR_INSUFFICIENT_RESOURCES)
    );
    assert_eq!(
        create_gi_at(a100, 19, 3, 2),
        Err(NVML_ERROR_INVALID_ARGUMENT)
    );
    assert_eq!(
        create_gi_at(a100, 99, 3, 1),
        Err(NVML_ERROR_INVALID_ARGUMENT)
    );
    assert_eq!(create_gi(a100, 99), Err(NVML_ERROR_INVALID_ARGUMENT));
    let gi = create_gi_at(a100, 19, 3, 1).expect("1g at 3");
    assert_eq!(gi_info(gi).map(|i| i.placement.start), Ok(3));
    let mut gi2 = null_mut();
    assert_eq!(
        unsafe { nvmlDeviceCreateGpuInstanceWithPlacement(a100, 19, ptr::null(), &mut gi2) },
        NVML_ERROR_INVALID_ARGUMENT
    );

    // Busy instances (a process holds them) cannot be destroyed.
    let h100 = handle(1);
    let busy = mig_device(h100, 6).expect("busy device");
    let gi_id = get_u32(nvmlDeviceGetGpuInstanceId, busy).expect("gi id");
    let mut bgi = null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstanceById(h100, gi_id, &mut bgi) },
        NVML_SUCCESS
    );
    assert_eq!(
        unsafe { nvmlGpuInstanceGetComputeInstances(bgi, 0, cis.as_mut_ptr(), &mut n) },
        NVML_SUCCESS
    );
    assert_eq!(
        unsafe { nvmlComputeInstanceDestroy(cis[0]) },
        NVML_ERROR_IN_USE
    );
    let mut cfg = on_disk(&m);
    cfg["gpus"][1]["mig"]["instances"][6]["ci_id"] = Value::Null;
    if let Some(o) = cfg["gpus"][1]["mig"]["instances"][6].as_object_mut() {
        o.remove("ci_id");
    }
    m.write(&cfg);
    assert_eq!(unsafe { nvmlGpuInstanceDestroy(bgi) }, NVML_ERROR_IN_USE);

    // MIG mode off: nothing to create or list.
    let plain = handle(2);
    assert_eq!(create_gi(plain, 19), Err(NVML_ERROR_NOT_SUPPORTED));
    assert_eq!(
        unsafe { nvmlDeviceGetGpuInstances(plain, 19, gis.as_mut_ptr(), &mut n) },
        NVML_ERROR_NOT_SUPPORTED
    );
}

#[test]
fn set_mig_mode_is_pending_or_applied() {
    let mut cfg = mig_json();
    cfg["gpus"].as_array_mut().expect("gpus").push(json!({
        "uuid": "GPU-h100-empty", "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": "00000000:C0:00.0"
    }));
    cfg["gpus"].as_array_mut().expect("gpus").push(json!({
        "uuid": "GPU-t4", "name": "Tesla T4", "pci_bus_id": "00000000:C1:00.0"
    }));
    let m = Machine::new(&cfg);
    let (a100, plain, h100, t4) = (handle(0), handle(2), handle(3), handle(4));

    // A100: waits for a reset.
    assert_eq!(
        set_mig_mode(plain, NVML_DEVICE_MIG_ENABLE),
        Ok(NVML_ERROR_RESET_REQUIRED)
    );
    assert_eq!(mig_mode(plain), Ok((0, 1)));
    let disk = on_disk(&m);
    assert_eq!(
        disk["gpus"][2]["mig"],
        json!({"mode": false, "pending": true, "instances": []})
    );
    assert_eq!(disk["gpus"][2]["serial"], json!("1562720054322"));
    // The "reset": a test writes the mode.
    let mut reset = disk.clone();
    reset["gpus"][2]["mig"]["mode"] = json!(true);
    m.write(&reset);
    assert_eq!(mig_mode(plain), Ok((1, 1)));
    assert_eq!(
        set_mig_mode(plain, NVML_DEVICE_MIG_ENABLE),
        Ok(NVML_SUCCESS)
    );

    // H100: applies at once when no instance exists.
    assert_eq!(mig_mode(h100), Ok((0, 0)));
    assert_eq!(set_mig_mode(h100, NVML_DEVICE_MIG_ENABLE), Ok(NVML_SUCCESS));
    assert_eq!(mig_mode(h100), Ok((1, 1)));
    assert_eq!(get_u32(nvmlDeviceGetMaxMigDeviceCount, h100), Ok(7));
    assert_eq!(
        set_mig_mode(h100, NVML_DEVICE_MIG_DISABLE),
        Ok(NVML_SUCCESS)
    );
    assert_eq!(mig_mode(h100), Ok((0, 0)));

    // Instances exist: leaving MIG mode is refused.
    assert_eq!(
        set_mig_mode(a100, NVML_DEVICE_MIG_DISABLE),
        Err(NVML_ERROR_IN_USE)
    );
    assert_eq!(mig_mode(a100), Ok((1, 1)));
    assert_eq!(set_mig_mode(a100, NVML_DEVICE_MIG_ENABLE), Ok(NVML_SUCCESS));

    // needs_reset can be turned off for an A100 (and on for an H100).
    let mut cfg = on_disk(&m);
    cfg["gpus"][2]["mig"]["needs_reset"] = json!(false);
    cfg["gpus"][3]["mig"] = json!({"needs_reset": true});
    m.write(&cfg);
    assert_eq!(
        set_mig_mode(plain, NVML_DEVICE_MIG_DISABLE),
        Ok(NVML_SUCCESS)
    );
    assert_eq!(mig_mode(plain), Ok((0, 0)));
    assert_eq!(
        set_mig_mode(h100, NVML_DEVICE_MIG_ENABLE),
        Ok(NVML_ERROR_RESET_REQUIRED)
    );
    assert_eq!(mig_mode(h100), Ok((0, 1)));
    assert_eq!(on_disk(&m)["gpus"][2]["mig"]["needs_reset"], json!(false));

    // Errors.
    assert_eq!(set_mig_mode(a100, 2), Err(NVML_ERROR_INVALID_ARGUMENT));
    assert_eq!(
        set_mig_mode(t4, NVML_DEVICE_MIG_ENABLE),
        Err(NVML_ERROR_NOT_SUPPORTED)
    );
    assert_eq!(
        unsafe { nvmlDeviceSetMigMode(a100, 1, null_mut()) },
        NVML_ERROR_INVALID_ARGUMENT
    );
    let d = mig_device(a100, 0).expect("mig device");
    assert_eq!(set_mig_mode(d, 1), Err(NVML_ERROR_NOT_SUPPORTED));
}

#[test]
fn mig_enabled_is_an_alias_of_mig_mode() {
    let cfg = config::parse(
        r#"{"gpus": [{"uuid": "a", "name": "NVIDIA A100-SXM4-40GB", "mig_enabled": true}]}"#,
    )
    .expect("parses");
    assert!(cfg.gpus[0].mig.mode && cfg.gpus[0].mig.pending);
    let mut base = gpus(1);
    base["gpus"][0]["mig_enabled"] = json!(true);
    let m = Machine::new(&base);
    let gi = create_gi(handle(0), 0).expect("7g");
    assert!(!gi.is_null());
    let disk = on_disk(&m);
    assert_eq!(
        disk["gpus"][0].get("mig_enabled"),
        None,
        "folded into mig.mode"
    );
    assert_eq!(disk["gpus"][0]["mig"]["mode"], json!(true));
}

#[test]
fn mig_config_mistakes_are_errors() {
    let a100 = |mig: Value| {
        json!({"gpus": [{"uuid": "GPU-a", "name": "NVIDIA A100-SXM4-40GB", "mig": mig}]})
            .to_string()
    };
    let bad = [
        (a100(json!({"mode": true, "colour": 1})), "unknown field"),
        (
            a100(json!({"mode": true, "instances": [{"profile": "1g.5gb", "start": 0, "x": 1}]})),
            "unknown field",
        ),
        (
            a100(json!({"mode": true, "instances": [{"profile": "1g.10gb", "start": 0}]})),
            "not one of",
        ),
        (
            a100(json!({"mode": true, "instances": [{"profile": "3g.20gb", "start": 2}]})),
            "not a free placement",
        ),
        (
            a100(json!({"mode": true, "instances": [
                {"profile": "4g.20gb", "start": 0}, {"profile": "2g.10gb", "start": 2}]})),
            "not a free placement",
        ),
        (
            a100(json!({"mode": true, "instances": [
                {"profile": "1g.5gb", "start": 0, "gi_id": 3},
                {"profile": "1g.5gb", "start": 1, "gi_id": 3}]})),
            "duplicate gi_id",
        ),
        (
            a100(json!({"mode": true, "instances": [
                {"profile": "1g.5gb", "start": 0, "gi_id": 64}]})),
            "gi_id 64",
        ),
        (
            a100(json!({"mode": true, "instances": [
                {"profile": "1g.5gb", "start": 0, "ci_id": 8}]})),
            "ci_id 8",
        ),
        (
            a100(json!({"mode": false, "instances": [{"profile": "1g.5gb", "start": 0}]})),
            "without MIG mode",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "NVIDIA A100-SXM4-40GB",
                 "mig_enabled": true, "mig": {"mode": false}}]}"#
                .to_string(),
            "disagree",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "Tesla T4", "mig": {"mode": true}}]}"#.to_string(),
            "has no MIG",
        ),
        (
            r#"{"gpus": [{"uuid": "a", "name": "Tesla T4", "mig_enabled": true}]}"#.to_string(),
            "has no MIG",
        ),
    ];
    for (text, want) in bad {
        let e = config::parse(&text).expect_err(&text);
        assert!(e.contains(want), "{text}: {e}");
    }
    // Explicit ids are kept clear of the defaults.
    let ok = config::parse(&a100(json!({"mode": true, "instances": [
        {"profile": "1g.5gb", "start": 0},
        {"profile": "1g.5gb", "start": 1, "gi_id": 1}]})))
    .expect("parses");
    let ids: Vec<u32> = ok.gpus[0].mig.instances.iter().map(|i| i.gi_id).collect();
    assert_eq!(ids, [2, 1]);
}

/// Calls MIG function `func` on GPU 0 of [`mig_override_machine`] with valid
/// arguments.
fn call_mig(func: &str) -> nvmlReturn_t {
    let h = state::handle_for(0);
    let mig = state::mig_handle(0, 1, 0);
    let gi_with_ci = state::gi_handle(0, 1);
    let gi_bare = state::gi_handle(0, 2);
    let ci = state::ci_handle(0, 1, 0);
    let mut u: c_uint = 0;
    let mut dev = null_mut();
    let mut gi = null_mut();
    let mut cih = null_mut();
    unsafe {
        match func {
            "nvmlDeviceSetMigMode" => nvmlDeviceSetMigMode(h, 1, &mut u),
            "nvmlDeviceGetMaxMigDeviceCount" => nvmlDeviceGetMaxMigDeviceCount(h, &mut u),
            "nvmlDeviceGetMigDeviceHandleByIndex" => {
                nvmlDeviceGetMigDeviceHandleByIndex(h, 0, &mut dev)
            }
            "nvmlDeviceIsMigDeviceHandle" => nvmlDeviceIsMigDeviceHandle(mig, &mut u),
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle" => {
                nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig, &mut dev)
            }
            "nvmlDeviceGetAttributes_v2" => {
                let mut a = std::mem::zeroed::<nvmlDeviceAttributes_t>();
                nvmlDeviceGetAttributes_v2(mig, &mut a)
            }
            "nvmlDeviceGetGpuInstanceId" => nvmlDeviceGetGpuInstanceId(mig, &mut u),
            "nvmlDeviceGetComputeInstanceId" => nvmlDeviceGetComputeInstanceId(mig, &mut u),
            "nvmlDeviceGetGpuInstanceProfileInfo" => {
                let mut i = std::mem::zeroed::<nvmlGpuInstanceProfileInfo_t>();
                nvmlDeviceGetGpuInstanceProfileInfo(h, 0, &mut i)
            }
            "nvmlDeviceGetGpuInstanceProfileInfoV" => {
                let mut i = std::mem::zeroed::<nvmlGpuInstanceProfileInfo_v2_t>();
                i.version = nvmlGpuInstanceProfileInfo_v2;
                nvmlDeviceGetGpuInstanceProfileInfoV(h, 0, &mut i)
            }
            "nvmlDeviceGetGpuInstancePossiblePlacements_v2" => {
                nvmlDeviceGetGpuInstancePossiblePlacements_v2(h, 19, null_mut(), &mut u)
            }
            "nvmlDeviceGetGpuInstanceRemainingCapacity" => {
                nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19, &mut u)
            }
            "nvmlDeviceCreateGpuInstance" => nvmlDeviceCreateGpuInstance(h, 19, &mut gi),
            "nvmlDeviceCreateGpuInstanceWithPlacement" => {
                let p = nvmlGpuInstancePlacement_t { start: 6, size: 1 };
                nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, &p, &mut gi)
            }
            "nvmlDeviceGetGpuInstances" => {
                let mut a = [null_mut(); 2];
                nvmlDeviceGetGpuInstances(h, 9, a.as_mut_ptr(), &mut u)
            }
            "nvmlDeviceGetGpuInstanceById" => nvmlDeviceGetGpuInstanceById(h, 1, &mut gi),
            "nvmlGpuInstanceGetInfo" => {
                let mut i = std::mem::zeroed::<nvmlGpuInstanceInfo_t>();
                nvmlGpuInstanceGetInfo(gi_with_ci, &mut i)
            }
            "nvmlGpuInstanceDestroy" => nvmlGpuInstanceDestroy(gi_bare),
            "nvmlGpuInstanceGetComputeInstanceProfileInfo" => {
                let mut i = std::mem::zeroed::<nvmlComputeInstanceProfileInfo_t>();
                nvmlGpuInstanceGetComputeInstanceProfileInfo(gi_with_ci, 2, 0, &mut i)
            }
            "nvmlGpuInstanceGetComputeInstanceProfileInfoV" => {
                let mut i = std::mem::zeroed::<nvmlComputeInstanceProfileInfo_v2_t>();
                i.version = nvmlComputeInstanceProfileInfo_v2;
                nvmlGpuInstanceGetComputeInstanceProfileInfoV(gi_with_ci, 2, 0, &mut i)
            }
            "nvmlGpuInstanceCreateComputeInstance" => {
                nvmlGpuInstanceCreateComputeInstance(gi_bare, 0, &mut cih)
            }
            "nvmlGpuInstanceGetComputeInstances" => {
                let mut a = [null_mut(); 1];
                nvmlGpuInstanceGetComputeInstances(gi_with_ci, 2, a.as_mut_ptr(), &mut u)
            }
            "nvmlComputeInstanceGetInfo_v2" => {
                let mut i = std::mem::zeroed::<nvmlComputeInstanceInfo_t>();
                nvmlComputeInstanceGetInfo_v2(ci, &mut i)
            }
            "nvmlComputeInstanceDestroy" => nvmlComputeInstanceDestroy(ci),
            other => panic!("no call for {other}"),
        }
    }
}

/// An A100 with a 3g.20gb MIG device (GI 1, CI 0) and a bare 1g.5gb (GI 2).
fn mig_override_machine() -> Value {
    json!({"gpus": [{
        "uuid": "GPU-a", "name": "NVIDIA A100-SXM4-40GB",
        "mig": {"mode": true, "instances": [
            {"profile": "3g.20gb", "start": 0, "gi_id": 1, "ci_id": 0},
            {"profile": "1g.5gb", "start": 4, "gi_id": 2}
        ]}
    }]})
}

#[test]
fn every_mig_function_honours_its_error_override() {
    let base = mig_override_machine();
    let m = Machine::new(&base);
    for func in MIG_FUNCTIONS {
        m.write(&base);
        assert_eq!(call_mig(func), NVML_SUCCESS, "{func} without override");
        let mut cfg = base.clone();
        cfg["gpus"][0]["errors"] = json!({ *func: "NO_PERMISSION" });
        m.write(&cfg);
        assert_eq!(call_mig(func), 4, "{func} with override");
        assert_eq!(on_disk(&m), cfg, "{func}: a failed call writes nothing");
    }
}

#[test]
fn mig_calls_before_init_and_on_a_lost_gpu() {
    let mut cfg = mig_override_machine();
    let m = Machine::uninit(&cfg);
    assert_eq!(
        call_mig("nvmlDeviceCreateGpuInstance"),
        NVML_ERROR_UNINITIALIZED
    );
    assert_eq!(call_mig("nvmlGpuInstanceGetInfo"), NVML_ERROR_UNINITIALIZED);
    assert_eq!(nvmlInit_v2(), NVML_SUCCESS);
    cfg["gpus"][0]["lost"] = json!(true);
    m.write(&cfg);
    for func in MIG_FUNCTIONS {
        assert_eq!(call_mig(func), NVML_ERROR_GPU_IS_LOST, "{func}");
    }
}

// ----- cgroup memory limits -----

use crate::memlimits::{nvmlDeviceGetMemoryLimits_v1, nvmlDeviceSetMemoryLimits_v1, on_cgroup2};

/// A cgroup2 hierarchy mounted on a temp dir, with one group of this test's
/// own; the group is removed and the hierarchy unmounted on drop. None
/// (the test says it is skipped) where mounting needs a root we are not.
struct Cgroup2 {
    mount: PathBuf,
    group: PathBuf,
}

impl Cgroup2 {
    fn mount() -> Option<Cgroup2> {
        let n = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
        let mount = std::env::temp_dir().join(format!("fake-nvml-cg2-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&mount).expect("mount point");
        let mounted = std::process::Command::new("mount")
            .args(["-t", "cgroup2", "none"])
            .arg(&mount)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            let _ = std::fs::remove_dir(&mount);
            eprintln!("skipped: cannot mount cgroup2 (needs root)");
            return None;
        }
        let group = mount.join(format!("fake-nvml-test-{}-{n}", std::process::id()));
        std::fs::create_dir(&group).expect("cgroup");
        Some(Cgroup2 { mount, group })
    }

    fn group(&self) -> &str {
        self.group.to_str().expect("utf-8 path")
    }
}

impl Drop for Cgroup2 {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.group);
        let _ = std::process::Command::new("umount")
            .arg(&self.mount)
            .status();
        let _ = std::fs::remove_dir(&self.mount);
    }
}

fn set_limits(h: nvmlDevice_t, path: &str, soft: u64, hard: u64) -> nvmlReturn_t {
    let path = CString::new(path).expect("path");
    let mut l = nvmlSetMemoryLimits_v1_t {
        nameSpace: path.as_ptr(),
        softLimit: soft,
        hardLimit: hard,
    };
    unsafe { nvmlDeviceSetMemoryLimits_v1(h, &mut l) }
}

/// (soft, hard, used).
fn get_limits(h: nvmlDevice_t, path: &str) -> Result<(u64, u64, u64), nvmlReturn_t> {
    let path = CString::new(path).expect("path");
    let mut l = nvmlGetMemoryLimits_v1_t {
        nameSpace: path.as_ptr(),
        softLimit: 7,
        hardLimit: 7,
        currentUsed: 7,
    };
    match unsafe { nvmlDeviceGetMemoryLimits_v1(h, &mut l) } {
        NVML_SUCCESS => {
            assert_eq!(l.nameSpace, path.as_ptr(), "nameSpace is an input");
            Ok((l.softLimit, l.hardLimit, l.currentUsed))
        }
        e => Err(e),
    }
}

#[test]
fn memory_limit_structs_have_nvmls_layout() {
    use std::mem::{offset_of, size_of};
    assert_eq!(size_of::<nvmlSetMemoryLimits_v1_t>(), 24);
    assert_eq!(size_of::<nvmlGetMemoryLimits_v1_t>(), 32);
    assert_eq!(offset_of!(nvmlSetMemoryLimits_v1_t, softLimit), 8);
    assert_eq!(offset_of!(nvmlSetMemoryLimits_v1_t, hardLimit), 16);
    assert_eq!(offset_of!(nvmlGetMemoryLimits_v1_t, softLimit), 8);
    assert_eq!(offset_of!(nvmlGetMemoryLimits_v1_t, hardLimit), 16);
    assert_eq!(offset_of!(nvmlGetMemoryLimits_v1_t, currentUsed), 24);
}

#[test]
fn memory_limits_are_refused_where_the_driver_refuses_them() {
    // Not a cgroup2 directory (the temp dir is on another file system).
    let plain = std::env::temp_dir();
    let plain = plain.to_str().expect("utf-8");
    let m = Machine::uninit(&gpus(1));
    assert_eq!(
        set_limits(null_mut(), plain, 1, 1),
        NVML_ERROR_UNINITIALIZED
    );
    drop(m);
    // A driver without them (the default).
    let m = Machine::new(&gpus(1));
    assert_eq!(set_limits(handle(0), plain, 1, 1), NVML_ERROR_NOT_SUPPORTED);
    assert_eq!(get_limits(handle(0), plain), Err(NVML_ERROR_NOT_SUPPORTED));
    drop(m);
    let mut cfg = with(mig_json(), json!({ "memory_limits": true }));
    let m = Machine::new(&cfg);
    // GPU 0 is in MIG mode: neither it nor its MIG devices.
    assert_eq!(set_limits(handle(0), plain, 1, 1), NVML_ERROR_NOT_SUPPORTED);
    let mig = mig_device(handle(0), 0).expect("MIG device");
    assert_eq!(set_limits(mig, plain, 1, 1), NVML_ERROR_NOT_SUPPORTED);
    assert_eq!(get_limits(mig, plain), Err(NVML_ERROR_NOT_SUPPORTED));
    // GPU 2 (MIG off) gets as far as the path.
    let h = handle(2);
    for bad in [plain, "sys/fs/cgroup", "/no/such/dir"] {
        assert_eq!(
            set_limits(h, bad, 1, 1),
            NVML_ERROR_INVALID_ARGUMENT,
            "{bad}"
        );
        assert_eq!(
            get_limits(h, bad),
            Err(NVML_ERROR_INVALID_ARGUMENT),
            "{bad}"
        );
    }
    assert_eq!(
        unsafe { nvmlDeviceSetMemoryLimits_v1(h, null_mut()) },
        NVML_ERROR_INVALID_ARGUMENT
    );
    let mut l = nvmlSetMemoryLimits_v1_t {
        nameSpace: ptr::null(),
        softLimit: 1,
        hardLimit: 1,
    };
    assert_eq!(
        unsafe { nvmlDeviceSetMemoryLimits_v1(h, &mut l) },
        NVML_ERROR_INVALID_ARGUMENT
    );
    // An override comes first.
    cfg["gpus"][2]["errors"] = json!({ "nvmlDeviceSetMemoryLimits_v1": "NO_PERMISSION" });
    m.write(&cfg);
    assert_eq!(set_limits(h, plain, 1, 1), 4);
    assert!(on_disk(&m)["gpus"][2].get("cgroup_memory_limits").is_none());
}

#[test]
fn a_set_is_recorded_in_the_config_and_read_back() {
    let Some(cg) = Cgroup2::mount() else { return };
    assert!(on_cgroup2(&cg.mount) && on_cgroup2(&cg.group));
    assert!(!on_cgroup2(&cg.group.join("cgroup.procs")), "a file");
    assert!(!on_cgroup2(&std::env::temp_dir()));
    let m = Machine::new(&with(gpus(2), json!({ "memory_limits": true })));
    let (h, group) = (handle(0), cg.group());
    // What a config may say of them.
    for (bad, why) in [
        (
            json!([{"cgroup": "/a", "soft_bytes": 2, "hard_bytes": 1}]),
            "soft_bytes over",
        ),
        (
            json!([{"cgroup": "/a", "soft_bytes": 0, "hard_bytes": 1}, {"cgroup": "/a", "soft_bytes": 0, "hard_bytes": 1}]),
            "duplicate",
        ),
    ] {
        let mut cfg = gpus(1);
        cfg["gpus"][0]["cgroup_memory_limits"] = bad;
        let err = config::parse(&cfg.to_string()).expect_err("invalid");
        assert!(err.contains(why), "{err}");
    }
    const GIB: u64 = 1 << 30;
    // Never set: no limit.
    assert_eq!(
        get_limits(h, group),
        Ok((0, NVML_DEVICE_MEMORY_LIMIT_MAX, 0))
    );
    assert_eq!(set_limits(h, group, GIB, 2 * GIB), NVML_SUCCESS);
    assert_eq!(
        on_disk(&m)["gpus"][0]["cgroup_memory_limits"],
        json!([{ "cgroup": group, "soft_bytes": GIB, "hard_bytes": 2 * GIB }])
    );
    assert_eq!(get_limits(h, group), Ok((GIB, 2 * GIB, 0)));
    // Only on that GPU.
    assert_eq!(
        get_limits(handle(1), group),
        Ok((0, NVML_DEVICE_MEMORY_LIMIT_MAX, 0))
    );
    // A test says what the group uses; a later Set keeps it.
    let mut cfg = on_disk(&m);
    cfg["gpus"][0]["cgroup_memory_limits"][0]["used_bytes"] = json!(12345);
    m.write(&cfg);
    assert_eq!(set_limits(h, group, GIB, GIB), NVML_SUCCESS);
    assert_eq!(get_limits(h, group), Ok((GIB, GIB, 12345)));
    // Soft over hard is refused and changes nothing.
    assert_eq!(
        set_limits(h, group, 2 * GIB, GIB),
        NVML_ERROR_INVALID_ARGUMENT
    );
    assert_eq!(get_limits(h, group), Ok((GIB, GIB, 12345)));
    // The clear is recorded too.
    assert_eq!(
        set_limits(h, group, 0, NVML_DEVICE_MEMORY_LIMIT_MAX),
        NVML_SUCCESS
    );
    let rec = &on_disk(&m)["gpus"][0]["cgroup_memory_limits"][0];
    assert_eq!(rec["soft_bytes"], json!(0));
    assert_eq!(rec["hard_bytes"], json!(NVML_DEVICE_MEMORY_LIMIT_MAX));
    assert_eq!(
        get_limits(h, group),
        Ok((0, NVML_DEVICE_MEMORY_LIMIT_MAX, 12345))
    );
    // The root of the hierarchy is a cgroup too.
    assert_eq!(
        set_limits(h, cg.mount.to_str().expect("utf-8"), 1, 1),
        NVML_SUCCESS
    );
    assert_eq!(
        on_disk(&m)["gpus"][0]["cgroup_memory_limits"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
}

/// Per-process utilization: the processes with `sm_util_pct`, a count
/// first (INSUFFICIENT_SIZE when there are some, NOT_FOUND when there are
/// none), then the samples; what
/// nvml-wrapper's `process_utilization_stats` reads.
#[test]
fn process_utilization_lists_the_sampled_processes() {
    let mut base = gpus(1);
    base["gpus"][0]["processes"] = json!([
        { "pid": 10, "memory_used_mib": 100, "sm_util_pct": 30 },
        { "pid": 11, "memory_used_mib": 100 },
        { "pid": 12, "sm_util_pct": 55 }
    ]);
    let m = Machine::new(&base);
    let h = handle(0);
    let mut n: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetProcessUtilization(h, null_mut(), &mut n, 0) },
        NVML_ERROR_INSUFFICIENT_SIZE
    );
    assert_eq!(n, 2);
    let mut out = vec![
        nvmlProcessUtilizationSample_t {
            pid: 0,
            timeStamp: 0,
            smUtil: 0,
            memUtil: 0,
            encUtil: 0,
            decUtil: 0,
        };
        2
    ];
    assert_eq!(
        unsafe { nvmlDeviceGetProcessUtilization(h, out.as_mut_ptr(), &mut n, 0) },
        NVML_SUCCESS
    );
    let got: Vec<(u32, u32)> = out.iter().map(|s| (s.pid, s.smUtil)).collect();
    assert_eq!(got, [(10, 30), (12, 55)]);
    assert!(out[0].timeStamp > 0);
    // No process with a sample: NOT_FOUND, as NVML says it.
    let mut idle = gpus(1);
    idle["gpus"][0]["processes"] = json!([{ "pid": 11, "memory_used_mib": 100 }]);
    m.write(&idle);
    let mut n: c_uint = 5;
    assert_eq!(
        unsafe { nvmlDeviceGetProcessUtilization(handle(0), null_mut(), &mut n, 0) },
        NVML_ERROR_NOT_FOUND
    );
    assert_eq!(n, 0);
}
