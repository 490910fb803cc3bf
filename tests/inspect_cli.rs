//! `gpumem inspect` as a user runs it: the built-in profiles, the same node through the fake NVML
//! library (the real nvml-wrapper path), and a machine without a GPU.

mod support;

use std::collections::BTreeSet;
use std::process::{Command, Output};

use serde_json::Value;

fn gpumem(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpumem"));
    cmd.args(args)
        .env_remove("GPUMEM_FAKE_NVML_PROFILE")
        .env_remove("GPUMEM_FAKE_NVML_INJECT");
    cmd
}

fn json_of(output: Output) -> Value {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "gpumem failed: {stderr}");
    serde_json::from_slice(&output.stdout).expect("inspect --output json prints JSON")
}

fn inspect_profile(name: &str) -> Value {
    json_of(
        gpumem(&["inspect", "--profile", name, "--output", "json"])
            .output()
            .unwrap(),
    )
}

fn inspect_through_fake_nvml(name: &str) -> Value {
    let dir = support::fake_nvml_dir();
    let output = gpumem(&["inspect", "--output", "json"])
        .env("LD_LIBRARY_PATH", dir)
        .env("GPUMEM_FAKE_NVML_PROFILE", name)
        .output()
        .unwrap();
    json_of(output)
}

fn matrix(report: &Value) -> Vec<Vec<String>> {
    serde_json::from_value(report["topology"]["matrix"].clone()).unwrap()
}

fn resource<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap()
}

#[test]
fn dgx_a100_shows_eight_gpus_two_numa_nodes_four_switch_pairs_and_nvlink_everywhere() {
    let report = inspect_profile("dgx-a100");
    let gpus = report["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    let uuids: BTreeSet<&str> = gpus.iter().map(|g| g["uuid"].as_str().unwrap()).collect();
    assert_eq!(uuids.len(), 8);
    let numa: BTreeSet<u64> = gpus.iter().map(|g| g["numaNode"].as_u64().unwrap()).collect();
    assert_eq!(numa, BTreeSet::from([0, 1]));
    let mut switches: Vec<Vec<u64>> = vec![Vec::new(); 4];
    for g in gpus {
        switches[g["pcieSwitch"].as_u64().unwrap() as usize].push(g["index"].as_u64().unwrap());
    }
    assert_eq!(switches, vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
    for (a, row) in matrix(&report).iter().enumerate() {
        for (b, cell) in row.iter().enumerate() {
            assert_eq!(cell, if a == b { "X" } else { "NV12" }, "GPU{a} -> GPU{b}");
        }
    }
    assert_eq!(report["labels"]["gpumem.io/nvlink"], "all-to-all");
}

#[test]
fn t4x4_has_no_nvlink_and_sys_between_numa_nodes() {
    let report = inspect_profile("t4x4");
    let m = matrix(&report);
    assert!(m.iter().flatten().all(|cell| !cell.starts_with("NV")));
    assert_eq!(m[0][1], "NODE");
    assert_eq!(m[0][2], "SYS");
    assert_eq!(m[3][1], "SYS");
    assert_eq!(
        report["topology"]["numaAffinity"],
        serde_json::json!([0, 0, 1, 1])
    );
}

#[test]
fn the_list_and_watch_budget_names_the_unit_that_fits() {
    let dgx = inspect_profile("dgx-a100");
    let mem = resource(&dgx, "nvidia.com/gpu-mem");
    assert_eq!(mem["devices"], 8 * 81920);
    assert_eq!(mem["fits"], false);
    assert!(mem["listAndWatchBytes"].as_u64().unwrap() > 4_194_304);
    let unit = mem["smallestFittingUnitMiB"].as_u64().unwrap();
    assert!(unit > 1);

    let at_unit = gpumem(&[
        "inspect",
        "--profile",
        "dgx-a100",
        "--output",
        "json",
        "--mem-unit-mib",
    ])
    .arg(unit.to_string())
    .output()
    .unwrap();
    let at_unit = json_of(at_unit);
    let mem = resource(&at_unit, "nvidia.com/gpu-mem");
    assert_eq!(mem["fits"], true);
    assert_eq!(at_unit["labels"]["gpumem.io/mem-unit-mib"], unit.to_string());

    let t4 = inspect_profile("t4x4");
    assert_eq!(resource(&t4, "nvidia.com/gpu-mem")["fits"], true);
    assert_eq!(resource(&t4, "nvidia.com/gpu")["devices"], 4);
}

#[test]
fn the_table_says_what_does_not_fit_and_what_to_use() {
    let output = gpumem(&["inspect", "--profile", "dgx-a100"]).output().unwrap();
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    assert!(text.contains("EXCEEDS the kubelet's 4194304 B limit"), "{text}");
    assert!(text.contains("--mem-unit-mib"), "{text}");
    assert!(text.contains("NUMA Affinity"), "{text}");
    assert!(
        text.contains("nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB"),
        "{text}"
    );
}

#[test]
fn the_fake_nvml_library_gives_the_same_answers_as_the_profile() {
    for name in ["dgx-a100", "t4x4", "mixed", "hgx-h100"] {
        let mut direct = inspect_profile(name);
        let mut through_nvml = inspect_through_fake_nvml(name);
        assert_eq!(through_nvml["source"], "NVML");
        direct["source"] = Value::Null;
        through_nvml["source"] = Value::Null;
        assert_eq!(direct, through_nvml, "profile {name}");
    }
}

#[test]
fn without_a_gpu_or_a_flag_it_says_why_in_one_line() {
    if std::path::Path::new("/proc/driver/nvidia").exists() {
        eprintln!("an NVIDIA driver is loaded here: the no-GPU path cannot be observed");
        return;
    }
    let output = gpumem(&["inspect"])
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("NVML library not found") && stderr.contains("--profile"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"));
}

#[test]
fn bad_input_is_a_clear_error() {
    let output = gpumem(&["inspect", "--profile", "dgx-z100"]).output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("unknown profile") && stderr.contains("dgx-a100"),
        "{stderr}"
    );

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("broken.toml");
    std::fs::write(
        &file,
        "name = 'x'\ndriver_version = '1'\ncuda_version = 'twelve'\n[[gpus]]\n",
    )
    .unwrap();
    let output = gpumem(&["inspect", "--profile", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("cuda_version"), "{stderr}");

    let output = gpumem(&["inspect", "--profile", "t4x4", "--mem-unit-mib", "0"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "clap rejects a zero unit");
}

#[test]
fn the_dra_slice_shows_each_gpus_memory_as_capacity_in_units() {
    let report = json_of(
        gpumem(&[
            "inspect",
            "--profile",
            "mixed",
            "--mem-unit-mib",
            "5",
            "--output",
            "json",
        ])
        .output()
        .unwrap(),
    );
    let slice = &report["resourceSlice"];
    assert_eq!(slice["driver"], "gpumem.io");
    let devices = slice["devices"].as_array().unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
    let t4 = &devices[2];
    assert_eq!(t4["allowMultipleAllocations"], true);
    // 15360 MiB is 3072 units of 5 MiB: all of it.
    assert_eq!(t4["capacity"]["memory"]["value"], "15Gi");
    assert_eq!(
        t4["capacity"]["memory"]["requestPolicy"]["validRange"]["step"],
        "5Mi"
    );
    assert_eq!(t4["attributes"]["productName"]["string"], "Tesla T4");
    let table = String::from_utf8(
        gpumem(&["inspect", "--profile", "mixed"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert!(
        table.contains("ResourceSlice NODE-gpumem.io")
            && table.contains("gpu-3: memory 15Gi in steps of 1Mi"),
        "{table}"
    );
}
