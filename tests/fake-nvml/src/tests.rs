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
    for want in ["dgx-a100.json", "mixed.json", "none.json"] {
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
