//! `libgpumem_cuda.so` preloaded into C programs that reach the (fake) CUDA driver the three ways
//! real code does: linked, `dlopen` + `dlsym`, and `cuGetProcAddress_v2` for every entry point as
//! the CUDA runtime does. The fake driver has 16 GiB; every limit below comes from the shim.

mod support;

use gpumem_accounting::read_usage;
use support::{
    Holder, MIB, MODES, Mode, Shim, accounting_dir, command, nvml_program, probe, run, stderr, stdout,
    usage_while_attached,
};

const LIMIT_MIB: &str = "64";
const LIMIT: u64 = 64 * MIB;

/// Every kind the probe allocates: every allocation call, in every ABI version, an async allocation on a
/// created stream, and a `cuMemCreate` mapped with `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess`.
const KINDS: [&str; 17] = [
    "alloc",
    "alloc_v1",
    "pitch",
    "pitch_v1",
    "managed",
    "async",
    "async_ptsz",
    "pool",
    "pool_ptsz",
    "create",
    "array",
    "array_v1",
    "array3d",
    "array3d_v1",
    "mipmap",
    "stream",
    "vmm",
];

/// The limit holds on every path: LIMIT bytes succeed, one more byte fails with
/// CUDA_ERROR_OUT_OF_MEMORY (2), the free succeeds and makes room again, LIMIT + 1 fails, LIMIT
/// succeeds again. cuMemGetInfo (both ABIs) reports the limit as total. One warning per process.
fn every_path_stops_at_the_limit(mode: Mode, extra_env: &[(&str, &str)]) {
    let dir = accounting_dir();
    let mut cmd = command(&probe(mode), &Shim::limit(LIMIT_MIB, Some(dir.path())));
    cmd.envs(extra_env.iter().copied());
    cmd.args(["check", &LIMIT.to_string(), "info", "info_v1"]);
    let output = run(cmd);
    let out = stdout(&output);
    for kind in KINDS {
        let expected = format!("check {kind} at_limit=0 one_more=2 free=0 over=2 again=0 free=0");
        assert!(
            out.lines().any(|l| l == expected),
            "{mode:?}: expected `{expected}` in:\n{out}"
        );
    }
    assert!(
        out.contains(&format!("info rc=0 free={LIMIT} total={LIMIT}\n")),
        "{mode:?}:\n{out}"
    );
    assert!(
        out.contains(&format!("info_v1 rc=0 free={LIMIT} total={LIMIT}\n")),
        "{mode:?}:\n{out}"
    );
    let err = stderr(&output);
    assert_eq!(
        err.matches("GPUMEM warn").count(),
        1,
        "{mode:?}: one warning per process:\n{err}"
    );
    assert!(err.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{err}");
    let usage = usage_while_attached(dir.path());
    assert_eq!(usage.devices[0].used, 0, "everything was freed");
    assert_eq!(usage.devices[0].limit, Some(LIMIT));
}

#[test]
fn linked_program_is_held_to_the_limit_on_every_path() {
    every_path_stops_at_the_limit(Mode::Direct, &[]);
}

#[test]
fn dlsym_program_is_held_to_the_limit_on_every_path() {
    every_path_stops_at_the_limit(Mode::Dlsym, &[]);
}

#[test]
fn get_proc_address_program_is_held_to_the_limit_on_every_path() {
    every_path_stops_at_the_limit(Mode::ProcAddr, &[]);
}

/// Through the CUDA 11.3 `cuGetProcAddress` (itself fetched through `cuGetProcAddress_v2`).
#[test]
fn get_proc_address_v1_is_intercepted_too() {
    every_path_stops_at_the_limit(Mode::ProcAddr, &[("PROBE_PROC_V1", "1")]);
}

/// A driver whose `cuGetProcAddress` hands out other addresses than its exported symbols: the
/// shim falls back to the name, version and flags to pick the wrapper of the right ABI version.
#[test]
fn get_proc_address_by_name_when_the_driver_hands_out_private_addresses() {
    every_path_stops_at_the_limit(Mode::ProcAddr, &[("GPUMEM_FAKE_CUDA_PROC_COPIES", "1")]);
}

/// The control: the same program without the shim is limited only by the fake's 16 GiB.
#[test]
fn without_the_shim_nothing_is_limited() {
    let output = run({
        let mut cmd = command(&probe(Mode::Direct), &Shim::off());
        cmd.args(["check", &LIMIT.to_string()]);
        cmd
    });
    let out = stdout(&output);
    assert_eq!(
        out.lines().filter(|l| l.contains("at_limit=0")).count(),
        KINDS.len(),
        "{out}"
    );
    // (cuMemCreate of 1 byte is invalid for the driver: not a multiple of its granularity.)
    assert!(!out.contains("=2 "), "nothing is out of memory:\n{out}");
}

/// Usage adds up across calls and kinds; free makes room; cuMemGetInfo's free follows the usage.
#[test]
fn usage_adds_up_and_free_makes_room() {
    let dir = accounting_dir();
    let half = (LIMIT / 2).to_string();
    let quarter = (LIMIT / 4).to_string();
    let mut cmd = command(&probe(Mode::Dlsym), &Shim::limit(LIMIT_MIB, Some(dir.path())));
    cmd.args([
        "alloc",
        "alloc",
        &half,
        "info",
        "alloc",
        "async",
        &quarter,
        "alloc",
        "create",
        &quarter.to_string(),
    ]);
    cmd.args([
        "alloc", "array", "1", "info", "free", "alloc", "managed", &quarter, "free", "free", "info",
    ]);
    let out = stdout(&run(cmd));
    let expected = [
        format!("alloc alloc {half} rc=0"),
        format!("info rc=0 free={half} total={LIMIT}"),
        format!("alloc async {quarter} rc=0"),
        format!("alloc create {quarter} rc=0"),
        "alloc array 1 rc=2".to_owned(),
        format!("info rc=0 free=0 total={LIMIT}"),
        "free rc=0".to_owned(),
        format!("alloc managed {quarter} rc=0"),
        "free rc=0".to_owned(),
        "free rc=0".to_owned(),
        format!("info rc=0 free={half} total={LIMIT}"),
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), expected, "{out}");
}

/// Two processes of one container share one limit through the accounting file; a process that
/// exits cleanly gives its share back at once.
#[test]
fn two_processes_share_one_limit() {
    let dir = accounting_dir();
    let shim = Shim::limit(LIMIT_MIB, Some(dir.path()));
    let first = Holder::start({
        let mut cmd = command(&probe(Mode::Direct), &shim);
        cmd.args(["alloc", "alloc", &(40 * MIB).to_string(), "hold", "free", "info"]);
        cmd
    });
    let usage = usage_while_attached(dir.path());
    assert_eq!(usage.devices[0].used, 40 * MIB);
    let holder = usage
        .processes
        .iter()
        .find(|p| p.pid == first.pid())
        .expect("the holder has a slot");
    assert_eq!(holder.used[0], 40 * MIB);

    let mut cmd = command(&probe(Mode::ProcAddr), &shim);
    cmd.args([
        "alloc",
        "alloc",
        &(30 * MIB).to_string(),
        "alloc",
        "alloc",
        &(24 * MIB).to_string(),
        "info",
    ]);
    let out = stdout(&run(cmd));
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            format!("alloc alloc {} rc=2", 30 * MIB),
            format!("alloc alloc {} rc=0", 24 * MIB),
            format!("info rc=0 free=0 total={LIMIT}"),
        ],
        "{out}"
    );
    // The second process exited holding 24 MiB: its exit gave them back.
    let usage = usage_while_attached(dir.path());
    assert_eq!(usage.devices[0].used, 40 * MIB);
    assert_eq!(usage.processes.len(), 1, "{usage:?}");

    let rest = first.release();
    assert_eq!(rest, format!("free rc=0\ninfo rc=0 free={LIMIT} total={LIMIT}\n"));
    let usage = usage_while_attached(dir.path());
    assert_eq!(
        (usage.devices[0].used, usage.processes.len()),
        (0, 0),
        "{usage:?}"
    );
}

/// A process killed while holding memory: its slot stays until another process needs the room,
/// which reclaims it (the driver frees a dead process's memory) instead of failing.
#[test]
fn a_killed_process_memory_is_reclaimed() {
    let dir = accounting_dir();
    let shim = Shim::limit(LIMIT_MIB, Some(dir.path()));
    let victim = Holder::start({
        let mut cmd = command(&probe(Mode::Dlsym), &shim);
        cmd.args(["alloc", "managed", &(60 * MIB).to_string(), "hold"]);
        cmd
    });
    let pid = victim.pid();
    victim.kill();
    assert!(
        read_usage(dir.path()).expect("readable").is_none(),
        "no process of the container left: the agent counts nothing"
    );
    let usage = usage_while_attached(dir.path());
    assert_eq!(usage.devices[0].used, 60 * MIB, "nobody has reaped yet");
    assert!(usage.processes.iter().any(|p| p.pid == pid));

    let mut cmd = command(&probe(Mode::Direct), &shim);
    cmd.args(["alloc", "alloc", &LIMIT.to_string(), "free"])
        .env("GPUMEM_LOG", "info");
    let output = run(cmd);
    assert_eq!(stdout(&output), format!("alloc alloc {LIMIT} rc=0\nfree rc=0\n"));
    let err = stderr(&output);
    assert!(err.contains(&format!("reclaimed {} bytes", 60 * MIB)), "{err}");
    assert!(!err.contains("GPUMEM warn"), "{err}");
    let usage = usage_while_attached(dir.path());
    assert_eq!(
        (usage.devices[0].used, usage.processes.len()),
        (0, 0),
        "{usage:?}"
    );
}

/// nvmlDeviceGetMemoryInfo and _v2 (what nvidia-smi shows), linked and through dlsym: total is
/// the limit, used what the container uses, free the rest; without a limit, the GPU's own answer.
#[test]
fn nvml_reports_the_limit() {
    let dir = accounting_dir();
    let shim = Shim::limit(LIMIT_MIB, Some(dir.path()));
    let holder = Holder::start({
        let mut cmd = command(&probe(Mode::Direct), &shim);
        cmd.args(["alloc", "alloc", &(16 * MIB).to_string(), "hold"]);
        cmd
    });
    let (used, free) = (16 * MIB, LIMIT - 16 * MIB);
    for mode in [Mode::Direct, Mode::Dlsym] {
        let out = stdout(&run(command(&nvml_program(mode), &shim)));
        assert_eq!(
            out,
            format!(
                "v1 rc=0 total={LIMIT} free={free} used={used}\nv2 rc=0 total={LIMIT} free={free} used={used} reserved=0\n"
            ),
            "{mode:?}"
        );
        let t4 = 15360 * MIB;
        let unlimited = stdout(&run(command(&nvml_program(mode), &Shim::passthrough())));
        assert_eq!(
            unlimited,
            format!("v1 rc=0 total={t4} free={t4} used=0\nv2 rc=0 total={t4} free={t4} used=0 reserved=0\n"),
            "{mode:?}"
        );
    }
    holder.release();
}

/// Without GPUMEM_LIMIT_MIB the shim changes nothing: the same answers, byte for byte, as without
/// it (the fake's own 16 GiB limit included), no output of its own, and lookups return the
/// driver's own functions. (A linked program's calls do go through the shim's exports, which the
/// loader binds first; they forward unchanged.)
#[test]
fn no_limit_is_pass_through() {
    let args = [
        "check",
        "67108864",
        "alloc",
        "alloc",
        "1000",
        "alloc",
        "alloc",
        "17179869184",
        "info",
        "info_v1",
    ];
    let more = [
        "alloc", "create", "4194304", "alloc", "mipmap", "4096", "info", "where", "next",
    ];
    for mode in MODES {
        let outputs: Vec<_> = [Shim::off(), Shim::passthrough()]
            .iter()
            .map(|shim| {
                let mut cmd = command(&probe(mode), shim);
                cmd.args(args).args(more);
                run(cmd)
            })
            .collect();
        let keep = |out: &str| -> String {
            out.lines()
                // `next` names the next library after the program, which the preloaded shim is.
                .filter(|l| !l.starts_with("next ") && (mode != Mode::Direct || !l.starts_with("where ")))
                .map(|l| format!("{l}\n"))
                .collect()
        };
        let (without, with) = (stdout(&outputs[0]), stdout(&outputs[1]));
        assert_eq!(keep(&without), keep(&with), "{mode:?}");
        assert!(
            with.contains("alloc alloc 17179869184 rc=2"),
            "the fake's own limit still applies"
        );
        assert_eq!(stderr(&outputs[1]), "", "{mode:?}: the shim says nothing");
        if mode != Mode::Direct {
            let wheres: Vec<_> = with.lines().filter(|l| l.starts_with("where ")).collect();
            assert_eq!(wheres.len(), 40);
            assert!(
                wheres.iter().all(|l| l.ends_with(" libcuda.so.1")),
                "{mode:?}: {wheres:?}"
            );
        }
    }
}

/// With a limit, every lookup of a wrapped entry point yields the shim's wrapper (26 of them) and
/// everything else the driver's own function, whichever way it was looked up.
#[test]
fn lookups_yield_the_wrappers_when_limited() {
    for mode in [Mode::Dlsym, Mode::ProcAddr] {
        let mut cmd = command(&probe(mode), &Shim::limit(LIMIT_MIB, None));
        cmd.arg("where").env("GPUMEM_LOG", "off");
        let out = stdout(&run(cmd));
        let in_shim = out.lines().filter(|l| l.ends_with(" libgpumem_cuda.so")).count();
        let in_driver: Vec<_> = out.lines().filter(|l| l.ends_with(" libcuda.so.1")).collect();
        assert_eq!(in_shim, 26, "{mode:?}:\n{out}");
        assert_eq!(
            in_driver,
            [
                "where cuInit libcuda.so.1",
                "where cuDeviceGet libcuda.so.1",
                "where cuDevicePrimaryCtxRetain libcuda.so.1",
                "where cuCtxSetCurrent libcuda.so.1",
                "where cuCtxCreate_v2 libcuda.so.1",
                "where cuCtxDestroy_v2 libcuda.so.1",
                "where cuStreamCreate libcuda.so.1",
                "where cuStreamDestroy_v2 libcuda.so.1",
                "where cuDeviceGetDefaultMemPool libcuda.so.1",
                "where cuMemAddressReserve libcuda.so.1",
                "where cuMemAddressFree libcuda.so.1",
                "where cuMemMap libcuda.so.1",
                "where cuMemUnmap libcuda.so.1",
                "where cuMemSetAccess libcuda.so.1",
            ],
            "{mode:?}"
        );
    }
}

/// The exported `dlsym` keeps glibc's view of who is asking: `dlsym(RTLD_NEXT, "dlsym")` from the
/// program finds the next definition after the program (the preloaded shim's own), not the one
/// after the shim. `RTLD_NEXT` lookups of wrapped symbols yield the wrapper.
#[test]
fn rtld_next_is_resolved_relative_to_the_real_caller() {
    for shim in [Shim::passthrough(), Shim::limit(LIMIT_MIB, None)] {
        let mut cmd = command(&probe(Mode::Dlsym), &shim);
        cmd.arg("next");
        let out = stdout(&run(cmd));
        assert_eq!(
            out, "next dlsym libgpumem_cuda.so\nnext cuMemAlloc_v2 libgpumem_cuda.so\n",
            "{shim:?}"
        );
    }
}

/// An unusable limit fails closed, loudly.
#[test]
fn an_invalid_limit_refuses_everything() {
    let mut cmd = command(&probe(Mode::Direct), &Shim::limit("lots", None));
    cmd.args(["alloc", "alloc", "1", "info"]);
    let output = run(cmd);
    assert!(
        stdout(&output).starts_with("alloc alloc 1 rc=2\ninfo rc=0 free=0 total=0\n"),
        "{}",
        stdout(&output)
    );
    assert!(stderr(&output).contains("GPUMEM error"), "{}", stderr(&output));
}

/// Without an accounting directory (or with one that cannot be used) each process is held to the
/// limit on its own, with a warning for the unusable directory.
#[test]
fn without_a_usable_directory_each_process_is_held_on_its_own() {
    let missing = std::env::temp_dir().join("gpumem-no-such-dir/deeper");
    for dir in [None, Some(missing.as_path())] {
        let mut cmd = command(&probe(Mode::ProcAddr), &Shim::limit(LIMIT_MIB, dir));
        cmd.args(["alloc", "alloc", &LIMIT.to_string(), "alloc", "pitch", "1"]);
        let output = run(cmd);
        assert_eq!(
            stdout(&output),
            format!("alloc alloc {LIMIT} rc=0\nalloc pitch 1 rc=2\n")
        );
        assert_eq!(
            stderr(&output).contains("cannot open"),
            dir.is_some(),
            "{}",
            stderr(&output)
        );
    }
}

/// A process that hides `/proc` (a tmpfs over it, in a user and mount namespace of its own: what the
/// e2e suite's escape does) sees every process as gone, itself included. It must not reap them: before
/// the shim checked that `/proc` shows the calling process, it reclaimed its own share at the limit and
/// went on to twice the limit. A process already holding memory outside keeps its share too.
#[test]
fn a_hidden_proc_reaps_nothing() {
    let Ok(status) = std::process::Command::new("unshare")
        .args(["-Urm", "true"])
        .status()
    else {
        eprintln!("no unshare(1) here: nothing to check");
        return;
    };
    if !status.success() {
        eprintln!("unshare -Urm is not permitted here: nothing to check");
        return;
    }
    let dir = accounting_dir();
    let shim = Shim::limit(LIMIT_MIB, Some(dir.path()));
    let holder = Holder::start({
        let mut cmd = command(&probe(Mode::Direct), &shim);
        cmd.args(["alloc", "alloc", &(16 * MIB).to_string(), "hold"]);
        cmd
    });
    let inner = command(&probe(Mode::Direct), &shim);
    let mut cmd = std::process::Command::new("unshare");
    cmd.args([
        "-Urm",
        "sh",
        "-c",
        "mount -t tmpfs none /proc && exec \"$0\" \"$@\"",
    ])
    .arg(inner.get_program())
    .args(["fill", "alloc", "128", "8", "info"]);
    for (key, value) in inner.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    let output = run(cmd);
    let out = stdout(&output);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            format!("fill alloc held={} rc=2", 48 * MIB).as_str(),
            format!("info rc=0 free=0 total={LIMIT}").as_str(),
        ],
        "{}",
        stderr(&output)
    );
    assert!(stderr(&output).contains("/proc does not show this process"));
    let usage = usage_while_attached(dir.path());
    assert_eq!(
        usage.devices[0].used,
        16 * MIB,
        "the holder's share, still counted"
    );
    holder.release();
}

/// A program started with a cleared environment (`env -u GPUMEM_LIMIT_MIB`, as a launcher that
/// passes its workers only what it chooses would) is held by the limit its container's first process
/// was started with: here PID 1 of a PID namespace of its own, started with the limit, as a
/// container's is. Before, it was not held (the e2e escapes measured 2000 MiB against 1000).
#[test]
fn a_cleared_environment_keeps_the_container_limit() {
    let unshare = ["-Upf", "--mount-proc"];
    let permitted = std::process::Command::new("unshare")
        .args(unshare)
        .arg("true")
        .status()
        .is_ok_and(|s| s.success());
    if !permitted {
        eprintln!("unshare -Upf --mount-proc is not permitted here: nothing to check");
        return;
    }
    let dir = accounting_dir();
    let inner = command(&probe(Mode::Direct), &Shim::limit(LIMIT_MIB, Some(dir.path())));
    let mut cmd = std::process::Command::new("unshare");
    // PID 1 (the shell) keeps the environment; its child, the probe, has neither variable.
    cmd.args(unshare)
        .args([
            "sh",
            "-c",
            "env -u GPUMEM_LIMIT_MIB -u GPUMEM_ACCOUNTING_DIR \"$0\" \"$@\"; status=$?; exit $status",
        ])
        .arg(inner.get_program())
        .args(["fill", "alloc", "128", "8", "info"]);
    for (key, value) in inner.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    cmd.env("GPUMEM_LOG", "info");
    let output = run(cmd);
    assert_eq!(
        stdout(&output).lines().collect::<Vec<_>>(),
        [
            format!("fill alloc held={LIMIT} rc=2").as_str(),
            format!("info rc=0 free=0 total={LIMIT}").as_str(),
        ],
        "{}",
        stderr(&output)
    );
    assert!(
        stderr(&output).contains("the container's (its first process's) applies"),
        "{}",
        stderr(&output)
    );
    assert!(
        dir.path().join(gpumem_accounting::FILE_NAME).exists(),
        "it used the container's accounting file"
    );
}
